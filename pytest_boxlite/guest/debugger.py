"""In a boxed test: the test's debugger on the host's terminal, as locally.

``breakpoint()``, ``pdb.set_trace()``, ``pytest.set_trace()`` and ``--pdb``'s post-mortem go
through pytest's own debugging plugin in the box, which calls ``pytest_enter_pdb`` with the
debugger it made.  :class:`BoxDebugger` (registered for one run) points that debugger's
``stdin``/``stdout`` at the host: what it prints travels as ``DEBUG out`` frames, and each line it
reads is asked for with ``DEBUG read`` and answered by the host with one line of the user's (or
the end of the host's stdin, or Ctrl-C).  Every boxed test runs in a fork (fresh or in place),
which sends and reads on its socket (:class:`SocketAnswers`).  The time spent waiting for that
line does not count against the test's timeout (:class:`LastWords` pauses; the host pauses its own).

Under pytest-xdist the host is a worker with no terminal: the debugger reads end-of-file, as it
does in an unboxed xdist worker (the test fails with ``bdb.BdbQuit``), and nothing is relayed.

Imported in the box's pytest (the package is on its ``sys.path``: this plugin runs there) by
``guest/worker.py`` when it runs a test.
"""

from __future__ import annotations

import io
import json
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest

from pytest_boxlite.guest import messages as msg

#: The relay of the run in progress in this process (``None`` outside a boxed test's run).
_current: BoxDebugger | None = None


def current() -> BoxDebugger | None:
    """The debugger relay of the test running in this box (forked or booted), if any."""
    return _current


def under_xdist() -> bool:
    """The host is an xdist worker: it has no terminal to debug on (nor has an unboxed worker)."""
    return "PYTEST_XDIST_WORKER" in os.environ


class _RelayOut(io.TextIOBase):
    """The debugger's ``stdout``: text goes to the host in ``DEBUG out`` frames.

    Kept until a newline, a read or :meth:`flush` (pdb flushes its prompt), so a frame carries a
    line or more, never more than :data:`~pytest_boxlite.guest.messages.DEBUG_TEXT_CAP`.
    """

    def __init__(self, relay: BoxDebugger) -> None:
        super().__init__()
        self._relay = relay
        self._buf: list[str] = []
        self._size = 0

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        text = str(text)
        self._buf.append(text)
        self._size += len(text)
        if "\n" in text or self._size >= msg.DEBUG_TEXT_CAP:
            self.flush()
        return len(text)

    def flush(self) -> None:
        text, self._buf, self._size = "".join(self._buf), [], 0
        for start in range(0, len(text), msg.DEBUG_TEXT_CAP):
            self._relay.frame("out", text=text[start : start + msg.DEBUG_TEXT_CAP])


class _RelayIn(io.TextIOBase):
    """The debugger's ``stdin``: each line is the host's answer to one ``DEBUG read``."""

    def __init__(self, relay: BoxDebugger) -> None:
        super().__init__()
        self._relay = relay

    def readable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        return self._relay.read_line()


class SocketAnswers:
    """The host's answers on a forked box's socket: one JSON line each (``commands``: its reading side)."""

    def __init__(self, commands: Any) -> None:
        self.commands = commands

    def next(self) -> object:
        """The next message from the host, decoded; ``None`` when it hung up or sent no JSON."""
        try:
            raw = self.commands.readline(1 << 20)
        except (OSError, ValueError):
            return None
        try:
            return json.loads(raw)
        except (ValueError, TypeError, RecursionError):
            return None


def _ignore_sigint() -> Any:
    """Ignore SIGINT (the main thread only may; elsewhere nothing changes): the previous handler."""
    try:
        return signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:
        return None


def _restore_sigint(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGINT, previous)


class BoxDebugger:
    """One run's debugger relay (a pytest plugin while the run lasts).

    ``send``: the box's ``send(name, **fields)`` (it adds the run's number); ``answers``: where
    the host answers each ``DEBUG read`` (:class:`SocketAnswers`);
    ``clock``: the run's :class:`LastWords`, paused while the user types; ``postmortem``: the host
    runs with ``--pdb``.
    """

    def __init__(self, send: Callable[..., None], answers: Any, clock: Any, postmortem: bool) -> None:
        self.send = send
        self.answers = answers
        self.clock = clock
        self.postmortem = postmortem
        self.xdist = under_xdist()
        self.method = "set_trace"
        self.broken = False  # the host stopped answering: every later read is end-of-file
        self.lock = threading.Lock()

    def frame(self, op: str, **fields: Any) -> None:
        """Send one ``DEBUG`` frame (a closed socket: the host is gone, the debugger reads EOF)."""
        if self.broken:
            return
        try:
            self.send(msg.DEBUG, op=op, **fields)
        except (OSError, ValueError):
            self.broken = True

    def read_line(self) -> str:
        """One line from the host's user: ``""`` (end of file) if the host has none to give."""
        with self.lock:
            if self.broken or self.xdist:
                return ""
            self.frame("read")
            self.clock.pause()
            # Ctrl-C on the user's terminal reaches this box too (its init passes it on): the
            # host's relay takes it and answers "interrupt", so here it is ignored while waiting.
            previous = _ignore_sigint()
            try:
                message = self.answers.next()
            finally:
                _restore_sigint(previous)
                self.clock.resume()
            if not isinstance(message, (tuple, list)) or len(message) != 2:
                self.broken = True  # the host hung up (or spoke out of turn): nothing more to read
                return ""
            name, fields = message
            if name != msg.DEBUG or not isinstance(fields, dict):
                self.broken = True
                return ""
            if fields.get("interrupt"):
                raise KeyboardInterrupt  # Ctrl-C at the host's prompt: pdb says so and asks again
            line = fields.get("line")
            if fields.get("eof") or not isinstance(line, str):
                return ""
            return line[: msg.DEBUG_TEXT_CAP]

    def service_logs(self, name: str, lines: int) -> str:
        """The last ``lines`` output lines of the host's service ``name`` (a fixture of this
        test's), asked of the host on the debugger's answer path; raises ``LookupError`` with the
        host's reason when it has none to give."""
        with self.lock:
            if self.broken:
                raise LookupError("the host no longer answers this box (its test is over)")
            self.frame("logs", service=name, lines=lines)
            message = self.answers.next()
            if not isinstance(message, (tuple, list)) or len(message) != 2:
                self.broken = True
                raise LookupError("the host did not answer")
            kind, fields = message
            if kind != msg.DEBUG or not isinstance(fields, dict):
                self.broken = True
                raise LookupError("the host answered out of turn")
            text = fields.get("logs")
            if not isinstance(text, str):
                raise LookupError(str(fields.get("error", "the host has no output of this service"))[:2000])
            return text

    # -- pytest hooks, in the box (called by :class:`_Hooks`) ------------------------------
    def pytest_enter_pdb(self, config: pytest.Config, pdb: Any) -> None:
        """Point the debugger pytest made at the host (or, under xdist, at end-of-file)."""
        if self.xdist:
            pdb.stdin = io.StringIO("")
            pdb.use_rawinput = False
            return
        pdb.stdin = _RelayIn(self)
        pdb.stdout = _RelayOut(self)
        pdb.use_rawinput = False  # read pdb.stdin, not input(): the box has no terminal
        capman = config.pluginmanager.getplugin("capturemanager")
        capturing = config.option.capture != "no" and capman is not None
        title = f"PDB {self.method}" + (" (IO-capturing turned off)" if capturing else "")
        # Shown by the host as pytest's own ">>>>> PDB set_trace (IO-capturing turned off) >>>>>".
        self.frame("enter", title=title)
        self.method = "set_trace"

    def pytest_leave_pdb(self, config: pytest.Config, pdb: Any) -> None:
        """``continue``: the host shows pytest's ">>>>> PDB continue (IO-capturing resumed) >>>>>"."""
        if not self.xdist:
            capturing = config.option.capture != "no"
            self.frame("leave", title="PDB continue" + (" (IO-capturing resumed)" if capturing else ""))

    def pytest_exception_interact(self, node: Any, call: Any, report: Any) -> None:
        """``--pdb``: before pytest's post-mortem (its ``PdbInvoke``, registered with this relay)
        opens at the failing frame, show the host what pytest shows locally: the captured
        output, the traceback, then "entering PDB"."""
        if not self.postmortem or self.xdist or not isinstance(report, pytest.TestReport):
            return
        self.method = "post_mortem"
        self.frame("enter")  # the session starts here: what pytest shows before its debugger
        showcapture = node.config.option.showcapture
        for name, content in (("stdout", report.capstdout), ("stderr", report.capstderr), ("log", report.caplog)):
            if showcapture in (name, "all") and content:
                self.frame("sep", title="captured " + name)
                self._out(content if content.endswith("\n") else content + "\n")
        self.frame("sep", title="traceback")
        text = report.longreprtext
        self._out(msg.cap(text if text.endswith("\n") else text + "\n", "of this failure"))
        self.frame("sep", title="entering PDB")

    def _out(self, text: str) -> None:
        for start in range(0, len(text), msg.DEBUG_TEXT_CAP):
            self.frame("out", text=text[start : start + msg.DEBUG_TEXT_CAP])


class _Hooks:
    """The pytest hooks of the running test's relay (:data:`_current`), registered once per
    interpreter: the warm interpreter registers it before it forks (:func:`prepare`), so a forked
    box neither imports this module nor registers a plugin per test (together ~8 ms of CPU)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_enter_pdb(self, config: pytest.Config, pdb: Any) -> None:
        if _current is not None:
            _current.pytest_enter_pdb(config, pdb)

    def pytest_leave_pdb(self, config: pytest.Config, pdb: Any) -> None:
        if _current is not None:
            _current.pytest_leave_pdb(config, pdb)

    @pytest.hookimpl(tryfirst=True)
    def pytest_exception_interact(self, node: Any, call: Any, report: Any) -> None:
        if _current is not None:
            _current.pytest_exception_interact(node, call, report)


_HOOKS_NAME = "boxlite-debugger"


def prepare(config: pytest.Config) -> None:
    """Register the relay's hooks in this interpreter (once; they act only while a run is attached)."""
    if config.pluginmanager.get_plugin(_HOOKS_NAME) is None:
        config.pluginmanager.register(_Hooks(), _HOOKS_NAME)


def attach(config: pytest.Config, send: Callable[..., None], answers: Any, clock: Any, postmortem: bool) -> BoxDebugger:
    """Relay the debugger of the run about to start (see :class:`BoxDebugger`); :func:`detach` after."""
    global _current
    relay = BoxDebugger(send, answers, clock, postmortem)
    prepare(config)
    if postmortem and not relay.xdist and not config.pluginmanager.has_plugin("pdbinvoke"):
        # pytest's own --pdb post-mortem: the box's pytest had --pdb taken off at its configure
        # (a box that cannot relay must not open a debugger), so it is registered per run here.
        # _pytest.debugging.PdbInvoke is private (pytest 8.0 to 9 have it as is).
        from _pytest.debugging import PdbInvoke

        config.pluginmanager.register(PdbInvoke(), "boxlite-pdbinvoke")
    _current = relay
    return relay


def detach(config: pytest.Config) -> None:
    """The run is over: no more relaying (a debugger opened later reads end-of-file)."""
    global _current
    relay, _current = _current, None
    if relay is not None:
        relay.broken = True
    plugin = config.pluginmanager.get_plugin("boxlite-pdbinvoke")
    if plugin is not None:
        config.pluginmanager.unregister(plugin, "boxlite-pdbinvoke")
