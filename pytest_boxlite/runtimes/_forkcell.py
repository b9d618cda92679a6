"""What the host holds of one box forked per test from a warm interpreter: its cell.

A box forked from a warm interpreter used to stay in the warm box's cgroups and write to the warm
box's log: a test that left 4,000 threads (or 900 MiB) behind made the next test fail, and what
it wrote to its stderr reached the host's disk and the next test's report.  A cell gives each
forked box, before any of its code runs:

* its own cgroups (memory, cpu, pids: the warm box's limits), which the box's first process joins
  itself through descriptors the host opened (:meth:`ForkCell.descriptors`), and which the host
  kills whole once the box is done (:meth:`ForkCell.kill`);
* its own stderr: a pipe whose read end a thread of this process (one for all) drains into a bounded tail
  (:class:`ForkLog`), quoted by that box's own failure reports and no one else's.

The descriptors travel to the warm interpreter on a Unix socket of the runtime's (``deal``); the
guest side is :func:`pytest_boxlite.guest.fresh.take_cell`.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pytest_boxlite.runtimes import _cgroups

#: Bytes of a forked box's stderr kept (its tail); what came before is counted.
LOG_KEPT = 256 << 10


class _Drainer:
    """One daemon thread that drains the stderr pipes of every live :class:`ForkLog` of this
    process (one epoll set), started with the first: no thread per forked box.  A pipe is added
    to the epoll set directly (epoll_ctl beside a running epoll_wait is the kernel's to order), so
    adding one wakes nobody: the thread runs only when a box has written."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logs: dict[int, ForkLog] = {}
        self._epoll = select.epoll()
        self._thread: threading.Thread | None = None

    def add(self, log: ForkLog) -> None:
        with self._lock:
            self._logs[log.read_end] = log
            self._epoll.register(log.read_end, select.EPOLLIN)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="boxlite-fork-logs", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                events = self._epoll.poll()
            except InterruptedError:
                continue
            for fd, _ in events:
                with self._lock:
                    log = self._logs.get(fd)
                if log is not None and not log.take():
                    with self._lock:
                        del self._logs[fd]
                        self._epoll.unregister(fd)
                    log.close()


_DRAINER = _Drainer()


def _new_drainer_in_child() -> None:
    # A forked copy of this process has no drainer thread (nor the parent's logs): it starts afresh.
    global _DRAINER
    _DRAINER = _Drainer()


os.register_at_fork(after_in_child=_new_drainer_in_child)


class ForkLog:
    """A forked box's stderr: a pipe drained by this process (one thread for all, :class:`_Drainer`)
    into a bounded tail.

    Only the write end goes to the box.  The pipe ends when every holder of the write end has
    closed it (the box's processes have ended), so :meth:`tail` can wait for what a box that just
    died wrote last.
    """

    def __init__(self, name: str, kept: int = LOG_KEPT) -> None:
        self.name = name
        self.kept = kept
        self.read_end, self.write_end = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self.read_end, False)
        self._buf = bytearray()
        self.total = 0
        self._lock = threading.Lock()
        self._ended = threading.Event()
        _DRAINER.add(self)

    def handed_over(self) -> None:
        """The box holds the write end now (or never will): this process closes its own."""
        if self.write_end >= 0:
            os.close(self.write_end)
            self.write_end = -1

    def take(self) -> bool:
        """Read one chunk of the pipe and :meth:`keep` it (the drainer's thread); False at its end."""
        try:
            chunk = os.read(self.read_end, 1 << 16)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not chunk:
            return False
        self.keep(chunk)
        return True

    def keep(self, chunk: bytes) -> None:
        """What a chunk of the pipe becomes: here, the bounded tail."""
        with self._lock:
            self.total += len(chunk)
            self._buf += chunk
            if len(self._buf) > self.kept:
                del self._buf[: len(self._buf) - self.kept]

    def close(self) -> None:
        """The pipe ended (the drainer's thread): its read end is closed."""
        os.close(self.read_end)
        self._ended.set()

    def tail(self, max_bytes: int = 4000, *, wait: float = 0.0) -> str:
        """The last ``max_bytes`` the box wrote (lossily decoded), after waiting up to ``wait``
        seconds for the box's last writer to close the pipe."""
        if wait > 0:
            self._ended.wait(wait)
        with self._lock:
            data = bytes(self._buf[-max_bytes:]) if max_bytes > 0 else b""
            before = self.total - len(data)
        text = data.decode("utf-8", "replace")
        return f"[{before} earlier bytes not shown]\n{text}" if before > 0 and text else text

    @property
    def ended(self) -> bool:
        """Whether every writer has closed the pipe (the box's processes are gone)."""
        return self._ended.is_set()


class ForkCell:
    """One forked box's own cgroups and stderr (see the module's docstring)."""

    def __init__(
        self,
        name: str,
        cgroups: _cgroups.CgroupSet,
        request: dict[str, Any],
        deal: Callable[[ForkCell, float], None],
    ) -> None:
        self.name = name
        self.cgroups = cgroups
        self.log = ForkLog(name)
        #: What the FORK request carries for the guest to find this cell (see ``fresh.take_cell``).
        self.request = dict(request, name=name, joins=len(cgroups.dirs))
        self._deal = deal
        #: Why the cell could not be handed to the warm interpreter (its fork then fails), or None.
        self.error: str | None = None
        self._left = list(cgroups.dirs)
        #: The box's CPU time when its current test began, the peaks that still count from the
        #: box's start, and whether a test began in it before (see :meth:`begin_test`).
        self._cpu_base = 0
        self._stale: list[str] = []
        self._began = False

    @property
    def missing(self) -> Sequence[str]:
        """The limits no cgroup holds for this box (no cgroups here: an ordinary user)."""
        return self.cgroups.missing

    def descriptors(self) -> list[int]:
        """The descriptors the box gets, in the guest's order: its cgroups' join files, then its
        stderr's write end.  The caller closes the join files once sent (:meth:`handed_over`)."""
        if self.log.write_end < 0:
            raise OSError(9, "the cell was handed over already")
        return [*self.cgroups.join_fds(), self.log.write_end]

    def deal(self, timeout: float) -> bool:
        """Hand this cell to the warm interpreter (after its FORK was sent); False (and
        :attr:`error`) when that failed: the guest then refuses the fork and says so."""
        try:
            self._deal(self, timeout)
        except OSError as exc:
            self.error = f"the host could not hand the box its cgroups and log: {exc.strerror or exc}"
            return False
        finally:
            self.log.handed_over()
        return True

    def abandon(self) -> None:
        """The FORK never reached the warm interpreter: the cell is not handed over (its cgroups
        stay empty, and are removed as any done cell's)."""
        self.log.handed_over()

    def oom_kills(self) -> int:
        """How many of the box's processes the OOM killer has killed (its own memory cgroup)."""
        return self.cgroups.oom_kills()

    def begin_test(self) -> None:
        """A test starts in the box now: :meth:`usage` counts from here (its CPU time), and the
        peaks start again where the kernel lets them (:meth:`CgroupSet.reset_peaks`).  A peak that
        cannot start again is left out of the usage of every test after the box's first (module
        scope), never reported as a later test's."""
        now = self.cgroups.usage()
        self._cpu_base = now.get("cpu_ns", 0)
        kept = self.cgroups.reset_peaks() if now else []
        self._stale = kept if self._began else []
        self._began = True

    def usage(self) -> dict[str, int]:
        """What the box used since :meth:`begin_test` (since its start, where never called), from
        its own cgroups (see :meth:`CgroupSet.usage`); empty without them."""
        now = self.cgroups.usage()
        if "cpu_ns" in now:
            now["cpu_ns"] = max(now["cpu_ns"] - self._cpu_base, 0)
        for key in self._stale:
            now.pop(key, None)
        return now

    def kill(self) -> None:
        """Kill every process of the box now: the box is done (its test ended, or it was unused)."""
        self.cgroups.kill()

    def release(self) -> bool:
        """Kill the box's processes and remove its cgroups where they are empty already (never
        waits); True once nothing of it is left.  Called again until it is."""
        if self._left:
            # Killed when it was done (kill()): by now it is usually gone, and the removal is all.
            self._left = _cgroups.try_remove_dirs(self._left)
            if self._left:
                self.cgroups.kill()
        return not self._left

    def remove(self, timeout: float = 2.0) -> None:
        """Kill and remove the box's cgroups, waiting up to ``timeout`` (the session's end)."""
        with contextlib.suppress(OSError):
            _cgroups.remove_dirs(self._left, timeout)
        self._left = [d for d in self._left if d.exists()]

    def log_tail(self, max_bytes: int = 16_000, *, wait: float = 0.0) -> str:
        """The tail of what the box wrote to its stderr (see :meth:`ForkLog.tail`).

        The box's stderr holds its own test's words only, so a crash's whole faulthandler dump fits
        (4,000 bytes cut its first line off once the interpreter's paths were long: a venv under /tmp).
        """
        return self.log.tail(max_bytes, wait=wait)

    def pids_exhausted(self) -> bool:
        """Whether the box's own pids cgroup refused a fork (its test hit the box's process cap)."""
        return self.cgroups.pids_max_reached()
