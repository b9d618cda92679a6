"""An in-memory runtime for the unit layer: no process, no bwrap, no VM.

This is a **fake**, used only by ``tests/unit/``: it implements the runtime protocol of
:mod:`pytest_boxlite.runtimes.base` (``Runtime`` and ``BoxHandle``) with plain Python objects,
so the pool's and the session's logic can be tested deterministically, in milliseconds, on any
host. It also injects the faults a real runtime cannot produce on demand:

* boot failure: :meth:`FakeRuntime.fail_boots` (the next ``n`` boots raise);
* slow boot: :attr:`FakeRuntime.boot_delay` (a boot longer than its timeout raises
  :class:`~pytest_boxlite.errors.BoxStartError`, as a real runtime's bound does);
* death mid-test: :meth:`FakeBox.die` / :meth:`FakeRuntime.kill` (the box stops answering);
* hung destroy: :meth:`FakeRuntime.hang_destroys` (destroy blocks until :meth:`unhang` or its
  bound passes, then raises and leaves the box listed, as a leak).

Every wait in here is bounded. The real runtimes are tested against real boxes by the contract
suite (``tests/test_contract.py``); nothing here stands in for that.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from pytest_boxlite.errors import BoxDeadError, BoxStartError, BoxTimeoutError
from pytest_boxlite.runtimes.base import (
    DEFAULT_MAX_OUTPUT,
    BoxDefaults,
    BoxHandle,
    BoxRecord,
    RawResult,
    Runtime,
    RuntimeDefaults,
)
from pytest_boxlite.spec import BoxSpec

#: Upper bound on any wait a fake may be told to do, so a wrong test cannot hang the run.
MAX_FAKE_WAIT = 10.0

ExecHandler = Callable[["FakeBox", Sequence[str]], RawResult]


def _ok(box: FakeBox, argv: Sequence[str]) -> RawResult:
    return RawResult(exit_code=0, stdout=b"", stderr=b"", timed_out=False, duration=0.0)


class FakeBox(BoxDefaults):
    """A box that lives in memory.  Conforms to :class:`~pytest_boxlite.runtimes.base.BoxHandle`."""

    runtime_name = "fake"
    guest_python = "python3"
    binary_stdout = True
    workdir = "/workspace"

    def __init__(self, runtime: FakeRuntime, spec: BoxSpec, name: str, box_id: str) -> None:
        self.runtime = runtime
        self.spec = spec
        self.name = name
        self.id = box_id
        self.commands: list[list[str]] = []
        self.kept = False
        self.destroyed = False
        self._dead = False

    # -- faults ---------------------------------------------------------------
    def die(self) -> None:
        """The box crashes: from now on it answers nothing (as if its process was killed)."""
        self._dead = True

    @property
    def dead(self) -> bool:
        return self._dead or self.destroyed

    # -- BoxHandle -------------------------------------------------------------
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
        if self.dead:
            raise BoxDeadError(f"box {self.name} is dead")
        self.commands.append(list(argv))
        return self.runtime.exec_handler(self, argv)

    def alive(self, timeout: float = 2.0) -> bool:
        return not self.dead

    def attach_argv(self, argv: Sequence[str], *, cwd: str | None = None, status_file: str | None = None) -> list[str]:
        return ["fake-attach", self.name, *argv]

    def log_tail(self, max_bytes: int = 4000, *, since: int = 0) -> str:
        return f"fake box {self.name}"[-max_bytes:]

    def keep(self) -> None:
        """Let the box outlive the pool (``--boxlite-keep``): it stays listed by the runtime."""
        self.kept = True

    def destroy(self) -> None:
        self.runtime._destroy(self)


class FakeRuntime(RuntimeDefaults):
    """A runtime whose boxes are :class:`FakeBox` objects.  Thread-safe; counts what it does."""

    name = "fake"
    isolation = "none: an in-memory fake for unit tests"

    def __init__(self, *, boot_delay: float = 0.0) -> None:
        #: Seconds each boot takes (bounded by the boot's own timeout and :data:`MAX_FAKE_WAIT`).
        self.boot_delay = boot_delay
        #: What ``exec`` returns; replace to script a guest.
        self.exec_handler: ExecHandler = _ok
        self.boxes: dict[str, FakeBox] = {}
        self.created: list[str] = []
        self.destroyed: list[str] = []
        self.boot_attempts = 0
        self.max_live = 0
        self.closed = False
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._failures: list[BaseException] = []
        self._hang: threading.Event | None = None
        self._hang_bound = 0.0
        self._booting = 0

    # -- faults ---------------------------------------------------------------
    def fail_boots(self, n: int = 1, error: BaseException | None = None) -> None:
        """The next ``n`` boots raise ``error`` (default: a :class:`BoxStartError`)."""
        with self._lock:
            for _ in range(n):
                self._failures.append(error if error is not None else BoxStartError("injected boot failure"))

    def kill(self, name: str) -> None:
        """Kill a box behind everyone's back (as a crash or OOM would)."""
        self.boxes[name].die()

    def hang_destroys(self, bound: float) -> None:
        """From now on, destroy blocks until :meth:`unhang` or ``bound`` seconds pass; then it raises
        :class:`BoxTimeoutError` and the box stays listed (a leak the session must find)."""
        with self._lock:
            self._hang = threading.Event()
            self._hang_bound = min(bound, MAX_FAKE_WAIT)

    def unhang(self) -> None:
        """Let hung destroys finish (and later ones not hang)."""
        with self._lock:
            hang, self._hang = self._hang, None
        if hang is not None:
            hang.set()

    @property
    def live(self) -> int:
        """Boxes created (or being created) and not yet destroyed."""
        with self._lock:
            return len(self.boxes) + self._booting

    # -- Runtime -----------------------------------------------------------------
    def create_box(self, spec: BoxSpec, name: str, *, timeout: float) -> FakeBox:
        with self._lock:
            if self.closed:
                raise BoxStartError("the fake runtime is closed")
            self.boot_attempts += 1
            failure = self._failures.pop(0) if self._failures else None
            self._booting += 1
            self.max_live = max(self.max_live, len(self.boxes) + self._booting)
        try:
            if self.boot_delay:
                time.sleep(min(self.boot_delay, timeout, MAX_FAKE_WAIT))
                if self.boot_delay > timeout:
                    raise BoxStartError(f"box {name} did not start within {timeout:.1f}s")
            if failure is not None:
                raise failure
            box = FakeBox(self, spec, name, f"fake-{next(self._ids)}")
            with self._lock:
                if name in self.boxes:
                    raise BoxStartError(f"a box named {name} already exists")
                self.boxes[name] = box
                self.created.append(name)
            return box
        finally:
            with self._lock:
                self._booting -= 1

    def list_boxes(self) -> list[BoxRecord]:
        with self._lock:
            return [
                BoxRecord(name=b.name, id=b.id, runtime=self.name, state="dead" if b.dead else "running", home="")
                for b in self.boxes.values()
            ]

    def remove_box(self, name: str) -> None:
        with self._lock:
            box = self.boxes.pop(name, None)
        if box is not None:
            box.destroyed = True
            with self._lock:
                self.destroyed.append(name)

    def close(self) -> None:
        self.closed = True

    # -- internals -----------------------------------------------------------------
    def _destroy(self, box: FakeBox) -> None:
        with self._lock:
            hang, bound = self._hang, self._hang_bound
        if hang is not None and not hang.wait(bound):
            raise BoxTimeoutError(f"destroying box {box.name} did not finish within {bound:.1f}s")
        self.remove_box(box.name)


def _conforms(box: FakeBox, runtime: FakeRuntime) -> tuple[BoxHandle, Runtime]:
    """Never called: mypy checks here that the fakes still implement the runtime protocol."""
    return box, runtime


class RecordingLifecycle:
    """A fake :class:`~pytest_boxlite.pool.BoxLifecycle` for the unit layer: records every call.

    ``prepare`` maps specs through :attr:`prepared` (identity by default); ``after_boot`` raises
    :attr:`boot_error` when set; ``relieve`` calls :attr:`on_relieve` (default: nothing to give).
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.prepared: dict[BoxSpec, BoxSpec] = {}
        self.boot_error: BaseException | None = None
        self.on_relieve: Callable[[BoxSpec], bool] = lambda spec: False
        self._lock = threading.Lock()

    def _record(self, step: str, what: str) -> None:
        with self._lock:
            self.calls.append((step, what))

    def steps(self, step: str) -> list[str]:
        """The arguments (box names, or spec descriptions) of every call of ``step``, in order."""
        with self._lock:
            return [what for s, what in self.calls if s == step]

    def prepare(self, spec: BoxSpec) -> BoxSpec:
        self._record("prepare", spec.describe())
        return self.prepared.get(spec, spec)

    def after_boot(self, handle: BoxHandle, spec: BoxSpec) -> None:
        self._record("after_boot", handle.name)
        if self.boot_error is not None:
            raise self.boot_error

    def before_destroy(self, handle: BoxHandle) -> None:
        self._record("before_destroy", handle.name)

    def relieve(self, spec: BoxSpec) -> bool:
        self._record("relieve", spec.describe())
        return self.on_relieve(spec)
