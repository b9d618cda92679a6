"""The runtime protocol: what every kind of box (micro-VM, namespace) provides.

Three parts, so that code outside ``runtimes/`` never asks which runtime it has:

* :class:`BoxHandle`, a started box.  Its optional capabilities (keeping a box, the log's
  size, OOM kills, a fast file helper, forking, attaching) are declared here with defaults in
  :class:`BoxDefaults`, which a runtime's box class inherits and overrides where it can do better.
* :class:`Runtime`, an opened runtime on one home (defaults in :class:`RuntimeDefaults`),
  including provisioning (``--boxlite-setup``).
* :class:`RuntimeKind`, what a kind of runtime says and does from a home directory alone,
  without opening anything: its :class:`Capabilities`, host facts for ``doctor``, its leftovers
  and their removal, its templates, attaching to a running box.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pytest_boxlite import guest
from pytest_boxlite.errors import BoxliteError, UnsupportedError
from pytest_boxlite.runtimes._forkcell import ForkCell as ForkCell  # re-exported: fork_cell() returns one
from pytest_boxlite.spec import BoxSpec

#: Default cap on captured bytes per output stream of one command.
DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024

#: Takes the file helper's stdout chunk by chunk as it arrives (see :meth:`BoxHandle.run_helper`).
HelperSink = Callable[[bytes], None]


def helper_argv(guest_python: str) -> list[str]:
    """The guest command that runs the file helper where a runtime execs it: isolated (``-I``: no
    ``PYTHON*`` variables, no user site, no script directory on the path) and without :mod:`site`
    (``-S``: no ``.pth`` files, no ``sitecustomize``)."""
    return [guest_python, "-I", "-S", "-c", guest.source("files")]


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


class RawProcess(Protocol):
    """A process a runtime started in a box for :meth:`BoxHandle.spawn`, as the host holds it.

    Its stdio are host descriptors this object owns (``stdin`` writable, ``stdout``/``stderr``
    readable; what a box writes is hostile: read them bounded).  :meth:`fileno` is a descriptor
    that turns readable when :meth:`feed` has something to read (the process's exit).
    """

    #: The process's pid as the box sees it.
    pid: int
    stdin: int
    stdout: int
    stderr: int

    def fileno(self) -> int:
        """The control descriptor to select on."""
        ...

    def feed(self) -> int | None:
        """Read what the control descriptor has; the exit status once known (negative: signal).

        Raises :class:`~pytest_boxlite.errors.BoxDeadError` when the box hung up before the
        process's exit was known.
        """
        ...

    def signal(self, sig: int, *, group: bool = False) -> None:
        """Send ``sig`` to the process (with ``group``, to its whole process group)."""
        ...

    def close(self) -> None:
        """Hang up: a process still running is killed with its process group.  Idempotent."""
        ...


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
    #: A box forked from this one (:meth:`fork_listener`) renews every writable directory, not
    #: only its overlays' upper layers: the box's root and mounts are no overlays (a VM's disk).
    fork_renews_all: bool

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

    def log_tail(self, max_bytes: int = 4000, *, since: int = 0) -> str:
        """The tail of the box's console or runtime log, for failure reports.

        ``since`` is a :meth:`log_size` taken earlier: only what the log gained after it.
        """
        ...

    def destroy(self) -> None:
        """Stop the box and remove every trace of it.  Idempotent."""
        ...

    # -- optional capabilities (defaults in BoxDefaults) ---------------------------------
    def keep(self) -> None:
        """Let the box outlive this process (``--boxlite-keep``), for ``shell`` and ``clean``."""
        ...

    def log_size(self) -> int:
        """The box log's current length, for a later :meth:`log_tail` ``since``."""
        ...

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has killed in this box so far."""
        ...

    def run_helper(self, payload: bytes, *, timeout: float, max_output: int, sink: HelperSink) -> RawResult | None:
        """Run the file helper on ``payload`` the runtime's fast way, or ``None``: run it with :meth:`exec`.

        The helper's stdout goes to ``sink`` as it arrives, never buffered here (the result's
        ``stdout`` is empty); an exception from ``sink`` ends the helper and propagates.  Its
        stderr is kept up to ``max_output`` bytes.
        """
        ...

    def fork_listener(self) -> tuple[socket.socket, str]:
        """A new listening Unix socket that boxes forked from this one connect to, and its path as
        they see it (for :attr:`Capabilities.fork` runtimes)."""
        ...

    def fork_cell(self, name: str) -> ForkCell | None:
        """Cgroups and a stderr of its own for the box ``name`` about to be forked from this one
        (see :mod:`pytest_boxlite.runtimes._forkcell`), or ``None`` where the runtime has none."""
        ...

    def run_attached(self, argv: Sequence[str], *, cwd: str | None, env: Mapping[str, str]) -> int:
        """Run ``argv`` in the box with this process's stdin/stdout/stderr; return its exit status."""
        ...

    def spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None, cwd: str | None, user: str | None
    ) -> RawProcess:
        """Start ``argv`` in the box and return at once (``Sandbox.spawn``)."""
        ...

    def connect_port(self, port: int, *, timeout: float) -> socket.socket:
        """A TCP connection to ``port`` on the box's own loopback, made in the box's network
        (``Sandbox.publish``); :class:`ConnectionRefusedError` while nothing listens there."""
        ...

    def changes(self, *, timeout: float) -> dict[str, Any]:
        """What the box's files gained since it started, unchecked (``Sandbox.changes()`` checks it)."""
        ...


class BoxDefaults:
    """The defaults of :class:`BoxHandle`'s optional capabilities, for a box class to inherit."""

    runtime_name: str
    #: Only the overlays are renewed in a forked box: everything else writable is a fresh tmpfs
    #: already (namespace boxes).
    fork_renews_all = False

    def keep(self) -> None:
        """Nothing to mark: the box is just not destroyed, and stays listed until ``clean``."""

    def log_size(self) -> int:
        """``0``: the whole log is this box's."""
        return 0

    def oom_kills(self) -> int:
        """``0``: the runtime cannot tell."""
        return 0

    def run_helper(self, payload: bytes, *, timeout: float, max_output: int, sink: HelperSink) -> RawResult | None:
        """``None``: the helper runs as a guest command (:func:`helper_argv`)."""
        return None

    def changes(self, *, timeout: float) -> dict[str, Any]:
        """Refused: the runtime's boxes keep no handle on what their files gained."""
        raise UnsupportedError(
            f"{self.runtime_name} boxes cannot list what changed in them: Sandbox.changes() needs a sandbox "
            "forked from a warm box (the namespace runtime, --boxlite-fresh=fork, without --boxlite-keep)"
        )

    def fork_listener(self) -> tuple[socket.socket, str]:
        """Refused: only :attr:`Capabilities.fork` runtimes fork, and callers check that first."""
        raise BoxliteError(f"{self.runtime_name} boxes cannot be forked")

    def fork_cell(self, name: str) -> ForkCell | None:
        """``None``: boxes forked from this one share its cgroups and log (a VM's, inside it)."""
        return None

    def run_attached(self, argv: Sequence[str], *, cwd: str | None, env: Mapping[str, str]) -> int:
        """Refused: this runtime has no way to hand a process's stdio to a box."""
        raise BoxliteError(f"{self.runtime_name} boxes cannot run a command attached to this process")

    def spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None, cwd: str | None, user: str | None
    ) -> RawProcess:
        """Refused: this runtime cannot start a process that outlives the call."""
        raise UnsupportedError(
            f"the {self.runtime_name} runtime cannot spawn processes (Sandbox.spawn); use run() instead"
        )

    def connect_port(self, port: int, *, timeout: float) -> socket.socket:
        """Refused: this runtime cannot reach a port in its box from the host."""
        raise UnsupportedError(f"the {self.runtime_name} runtime cannot publish box ports (Sandbox.publish)")


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a kind of runtime can do beyond the protocol's core, for code choosing a strategy."""

    #: Boxed tests can run in boxes forked per test from a warm interpreter (:meth:`BoxHandle.fork_listener`).
    fork: bool = False


class Runtime(Protocol):
    """Creates, lists and removes boxes in one home directory."""

    name: str
    #: One line saying what isolation this runtime gives.
    isolation: str

    @property
    def reaped(self) -> Sequence[str]:
        """What dead sessions left that opening this runtime removed (a remote server), for the report."""
        ...

    def provision(
        self, spec: BoxSpec, setup: str, *, key: str, home: Path, cwd: Path, timeout: float, name: str
    ) -> BoxSpec:
        """The spec whose boxes start with ``setup`` (a shell command run in ``cwd``) already done.

        ``key`` identifies ``spec`` and ``setup`` (and the files the command names); ``name`` is a
        box name the runtime may use to build a template.  A runtime that makes no template
        returns ``spec`` unchanged, with no ``template``: each box then runs ``setup`` at boot.
        """
        ...

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

    def allow_forked_boxes(self, allowed: bool) -> None:
        """Whether new boxes may be forked from a warm template box of their spec instead of
        booted, on runtimes that can (such a box cannot outlive this process)."""
        ...

    def stop_forking(self) -> None:
        """Stop the warm template boxes new boxes are forked from (before leftovers are counted)."""
        ...

    @property
    def fork_fallback(self) -> str | None:
        """Why boxes were booted where forking was allowed (the host refused a fork), or ``None``."""
        ...


class RuntimeDefaults:
    """The defaults of :class:`Runtime`'s optional parts, for a runtime class to inherit."""

    reaped: Sequence[str] = ()

    @property
    def fork_fallback(self) -> str | None:
        """No fork is ever tried here, so none was refused."""
        return None

    def provision(
        self, spec: BoxSpec, setup: str, *, key: str, home: Path, cwd: Path, timeout: float, name: str
    ) -> BoxSpec:
        """No template: ``spec`` unchanged, so each box runs ``setup`` when it boots."""
        return spec

    def allow_forked_boxes(self, allowed: bool) -> None:
        """Every box is booted here: nothing to allow."""
        return None

    def stop_forking(self) -> None:
        """Nothing is kept to fork from."""
        return None


@dataclasses.dataclass(frozen=True)
class Leftover:
    """A box (or a runtime's unit of boxes) found on disk, with its owner and whether that owner is alive."""

    name: str
    runtime: str
    owner: str | None
    owner_alive: bool
    running: bool
    kept: bool
    location: str


class Owners(Protocol):
    """Who owns a box, and whether that owner lives (the ledger's answers, handed to a runtime kind)."""

    def owner_of(self, name: str) -> str | None:
        """The owner id a box name carries, or ``None`` for a box that is not ours."""
        ...

    def alive(self, owner: str) -> bool:
        """Whether ``owner``'s process still holds its lock."""
        ...


class RuntimeKind(Protocol):
    """A kind of runtime as this host sees it without opening one: nothing here boots a box."""

    name: str
    capabilities: Capabilities

    def host_facts(self) -> list[tuple[str, str]]:
        """``(label, fact)`` lines for ``doctor``: what this host lets the runtime do, and why."""
        ...

    def leftovers(self, home: Path, owners: Owners, *, each_box: bool) -> list[Leftover]:
        """Every box of this kind under ``home``.  Without ``each_box``, one entry per thing
        :meth:`remove_leftover` removes (which may hold several boxes); never opens a live owner's state."""
        ...

    def remove_leftover(self, home: Path, leftover: Leftover) -> str | None:
        """Remove one of :meth:`leftovers` (``each_box=False``) and say what went; ``None`` when it
        turned out to be in use after all and was left alone."""
        ...

    def drop_templates(self, home: Path) -> list[str]:
        """Remove every provisioned template of ``home`` (``clean --templates``); returns their keys."""
        ...

    def attach_existing(self, home: Path, name: str, argv: Sequence[str]) -> int | None:
        """Run ``argv`` attached to this process in the running box ``name`` (``shell``); its exit
        status, or ``None`` when there is no such running box of this kind."""
        ...
