"""The runtime protocol: what every kind of box (micro-VM, namespace) provides."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from pytest_boxlite.spec import BoxSpec

#: Default cap on captured bytes per output stream of one command.
DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class RawResult:
    """What a runtime returns for one finished (or killed) guest process."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    duration: float
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    #: Set when the runtime itself saw the process die abnormally (not a plain exit status).
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class BoxRecord:
    """A box as listed by a runtime, whether or not this process owns a handle to it."""

    name: str
    id: str
    runtime: str
    state: str
    home: str


@runtime_checkable
class BoxHandle(Protocol):
    """A started box.  All methods are synchronous and bounded in time."""

    name: str
    id: str
    runtime_name: str
    #: Interpreter to use for guest-side helpers.
    guest_python: str
    #: False where guest stdout is lossy text (the VM), so payloads must be encoded.
    binary_stdout: bool
    #: Default working directory of commands.
    workdir: str

    def exec(
        self,
        argv: Sequence[str],
        *,
        input: bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> RawResult:
        """Run ``argv`` without a shell; kill it at ``timeout`` and keep its partial output."""
        ...

    def alive(self, timeout: float = 2.0) -> bool:
        """Whether the box answers a trivial request within ``timeout``."""
        ...

    def attach_argv(self, argv: Sequence[str], *, cwd: str | None = None, status_file: str | None = None) -> list[str]:
        """A host command whose binary-clean stdin/stdout are those of ``argv`` run in the box.

        With ``status_file``, the command's raw exit status (negative: signal) is written there.
        """
        ...

    def log_tail(self, max_bytes: int = 4000) -> str:
        """The tail of the box's console or runtime log, for failure reports."""
        ...

    def destroy(self) -> None:
        """Stop the box and remove every trace of it.  Idempotent."""
        ...


class Runtime(Protocol):
    """Creates, lists and removes boxes in one home directory."""

    name: str
    #: One line saying what isolation this runtime gives.
    isolation: str

    def create_box(self, spec: BoxSpec, name: str, *, timeout: float) -> BoxHandle:
        """Create and start a box; return once it accepts commands."""
        ...

    def list_boxes(self) -> list[BoxRecord]:
        """Every box this runtime's home knows of, running or not."""
        ...

    def remove_box(self, name: str) -> None:
        """Remove a box (stopping it first) by name.  Missing boxes are not an error."""
        ...

    def close(self) -> None:
        """Release the runtime.  Idempotent."""
        ...
