"""A boxed test's last words: at its timeout, what it printed and logged so far, sent to the host.

The host kills a boxed test's box when the test's timeout passes (``timeout=`` of the marker,
``--boxlite-timeout``); pytest's capture of the test's output dies with it.  So the box watches
the same deadline: when it passes, it reads what pytest captured of the running phase (its
stdout and stderr, at the descriptor level, and its log records) and sends that as one
``LASTWORDS`` message, which the host puts in the timeout's report as pytest-timeout's would be.
The host waits briefly for it and kills the box as before; the message is only ever text, capped.

Imported by the session in the box (:mod:`pytest_boxlite.guest.session`).
"""

from __future__ import annotations

import _thread
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pytest_boxlite.guest.messages import LASTWORDS, cap


class LastWords:
    """Watch one test run: at ``timeout`` seconds, send its phase's captured output with ``send``.

    The time the test waits at a debugger's prompt for the host's user (:meth:`pause` to
    :meth:`resume`) does not count, as pytest-timeout does not count it locally.
    """

    def __init__(self, item: Any, send: Callable[..., None], timeout: float | None) -> None:
        import time

        self.item = item
        self.send = send
        self.done = False
        self.paused_at: float | None = None
        self.deadline = time.monotonic() + float(timeout or 0)
        if timeout is not None and timeout > 0:
            _Watcher.of_this_process().watch(self)

    def stop(self) -> None:
        with _Watcher.held():
            self.done = True

    def pause(self) -> None:
        """The test waits for the user (at a debugger's prompt): the clock stops."""
        import time

        with _Watcher.held():
            if self.paused_at is None:
                self.paused_at = time.monotonic()

    def resume(self) -> None:
        """The user answered: the clock runs on from where it stopped."""
        import time

        with _Watcher.held() as watcher:
            if self.paused_at is not None:
                self.deadline += time.monotonic() - self.paused_at
                self.paused_at = None
                if watcher is not None:
                    watcher.changed.notify_all()  # it may sleep without a deadline while paused

    def _speak(self) -> None:
        """The deadline passed: send what the running phase captured (once)."""
        try:
            fields = self._captured()
        except Exception as exc:  # noqa: BLE001 - best effort: the host reports the timeout either way
            fields = {"when": "call", "out": "", "err": "", "log": "", "problem": "%s: %s" % (type(exc).__name__, exc)}
        if not self.done:
            self.send(LASTWORDS, **fields)

    def _captured(self) -> dict[str, str]:
        # "nodeid (call)": which phase runs now, as pytest itself says it.
        current = os.environ.get("PYTEST_CURRENT_TEST", "")
        when = current.rsplit("(", 1)[-1].rstrip(")") if current.endswith(")") else "call"
        if when not in ("setup", "call", "teardown"):
            when = "call"
        config = self.item.config
        out = err = log = ""
        capman = config.pluginmanager.getplugin("capturemanager")
        if capman is not None and capman.is_globally_capturing():
            captured = capman.read_global_capture()
            out, err = captured.out, captured.err
        logging_plugin = config.pluginmanager.getplugin("logging-plugin")
        handler = getattr(logging_plugin, "report_handler", None)
        stream = getattr(handler, "stream", None)
        if stream is not None and hasattr(stream, "getvalue"):
            log = stream.getvalue().strip()
        return {
            "when": when,
            "out": cap(out),
            "err": cap(err),
            "log": cap(log),
        }


class _Watcher:
    """One thread per process watches the running test's deadline, for every test of the box.

    A thread per test would cost its start and its end for each test of a module's box; this one
    sleeps until the deadline it knows, and a test that starts or ends wakes it only when its own
    deadline is sooner: when it wakes it looks at the test of the moment.  It lives as long as its
    process: a warm interpreter that forks boxes runs no test itself, so it has none (a thread of
    its own would make guest/fresh.py fork its boxes the slower way, through fork(3)).

    A bare ``_thread`` thread, not a ``threading.Thread``: the test sees only its own threads
    (``threading.active_count()``, ``threading.enumerate()``), as locally, and starting it waits
    for nothing (``Thread.start`` waits until the new thread runs: a third of a millisecond
    of each boxed test's CPU, most of it page faults).
    """

    #: The watcher of the process that made it (a forked process has no thread of its parent's).
    current: _Watcher | None = None

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.changed = threading.Condition()
        self.run: LastWords | None = None
        #: The deadline the thread sleeps until (``None``: until it is woken).
        self.until: float | None = None
        # Like a daemon thread: the process's exit does not wait for it.
        _thread.start_new_thread(self._serve, ())

    @classmethod
    def _mine(cls) -> _Watcher | None:
        watcher = cls.current
        return watcher if watcher is not None and watcher.pid == os.getpid() else None

    @classmethod
    def of_this_process(cls) -> _Watcher:
        watcher = cls._mine()
        if watcher is None:
            watcher = cls.current = cls()
        return watcher

    @classmethod
    @contextlib.contextmanager
    def held(cls) -> Iterator[_Watcher | None]:
        """This process's watcher (``None`` where no test here had a timeout), its condition held."""
        watcher = cls._mine()
        if watcher is None:
            yield None
            return
        with watcher.changed:
            yield watcher

    def watch(self, run: LastWords) -> None:
        with self.changed:
            self.run = run
            if self.until is None or run.deadline < self.until:
                self.changed.notify_all()

    def _serve(self) -> None:
        import time

        while True:
            with self.changed:
                run = self.run
                if run is None or run.done or run.paused_at is not None:
                    self.until = None
                    self.changed.wait()
                    continue
                left = run.deadline - time.monotonic()
                if left > 0:
                    self.until = run.deadline
                    self.changed.wait(left)
                    continue
                self.run = self.until = None
            run._speak()
