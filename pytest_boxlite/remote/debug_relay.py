"""Host side of a boxed test's debugger: the box's pdb on this terminal (see guest/debugger.py).

A boxed test's box sends ``DEBUG`` frames on its socket while its test sits in a debugger:
``enter`` (a session starts), ``sep``/``out`` (what it prints), ``read`` (it waits for a line),
``leave`` (it continued).  :class:`DebugRelay` prints what it prints, with control characters
escaped (a guest must not drive this terminal), and answers each ``read`` with one line of this
process's stdin, read only then, while pytest's capture is suspended as pytest's own pdb support
does; the answer goes back the way the frames came (``answer``: the socket).
The wait for that line is not counted against the test's timeout: :attr:`paused` is added to the
deadline, and the host's ``pytest_enter_pdb`` hook is called (pytest-timeout stops its timer
there, as it does for a local debugger).

Everything a box sends is bounded: the text of one test's debugger sessions together
(``DEBUG_OUTPUT_CAP``), each frame's; the host holds no more of it than one frame (what it
prints it writes at once, so a box that prints fast waits on the terminal).  Under xdist (this
process is a worker, it has no terminal) every ``read`` gets end-of-file, as pdb gets in an
unboxed xdist worker.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import termios
import time
from collections.abc import Callable
from typing import Any

import pytest

from pytest_boxlite._shown import shown
from pytest_boxlite.guest import messages as msg


def escape_controls(text: str) -> str:
    """A box's debugger output as this terminal may be sent it: a pty's CRLF line ends become
    newlines, and every other character that could act on a terminal (a lone CR included) is
    escaped (:func:`_shown.shown`)."""
    return shown(text.replace("\r\n", "\n"))


#: The tests whose box could relay a debugger to this terminal (they ran in a box that sends its
#: messages to this process): ``--pdb``'s "no debugger here" line is not for them.
RELAYED = pytest.StashKey[bool]()

#: Longest line of the user's sent to a box (the rest of a longer one follows as the next line).
LINE_CAP = msg.DEBUG_TEXT_CAP


class _Refused(Exception):
    """A box's ``DEBUG`` frame the host does not take (see :class:`DebugRelay.handle`)."""


class _Stdin:
    """This process's stdin, read in lines without ever blocking past a poll that said it can.

    What one read brings beyond a line waits here for the next ``read`` (of any box: it is the
    user's input to a debugger either way).
    """

    def __init__(self) -> None:
        self.buf = bytearray()
        self.eof = False

    def line(self) -> bytes | None:
        """A complete line (or the rest at end of file), if one is here already."""
        ends = [i for i in (self.buf.find(b"\n"), self.buf.find(b"\x03")) if i >= 0]
        end = min(ends) if ends else -1  # Ctrl-C ends a line too (see _ctrl_c_ends_the_line)
        if end < 0 and len(self.buf) >= LINE_CAP:
            end = LINE_CAP - 1
        if end >= 0:
            end = min(end, LINE_CAP - 1)
            line = bytes(self.buf[: end + 1])
            del self.buf[: end + 1]
            return line
        if self.eof and self.buf:
            line = bytes(self.buf)
            self.buf.clear()
            return line
        return None

    def fill(self) -> None:
        """Read what stdin has (the caller polled it readable); an unreadable stdin is at its end."""
        try:
            chunk = os.read(0, 4096)
        except OSError:
            chunk = b""
        if chunk:
            self.buf += chunk
        else:
            self.eof = True


_STDIN_KEY = pytest.StashKey[_Stdin]()


def _stdin(config: pytest.Config) -> _Stdin:
    found = config.stash.get(_STDIN_KEY, None)
    if found is None:
        found = config.stash[_STDIN_KEY] = _Stdin()
    return found


def can_debug_here(config: pytest.Config) -> bool:
    """This process has the user's terminal to debug on: not an xdist worker (whose stdin is not
    the user's), and pytest's debugging plugin is on."""
    return (
        not hasattr(config, "workerinput")
        and "PYTEST_XDIST_WORKER" not in os.environ
        and config.pluginmanager.has_plugin("debugging")
    )


_CTRL_C = b"\x03"


def _ctrl_c_ends_the_line() -> list[Any] | None:
    """While the box's debugger waits on a terminal: Ctrl-C ends the line (``VEOL``) instead of
    sending SIGINT to the terminal's process group, which holds the boxes too (their warm
    interpreters and the boxes forked ahead would die of it; locally only pdb sees it).  Returns
    the terminal's settings to put back, or ``None`` where stdin is no terminal."""
    try:
        if not os.isatty(0):
            return None
        saved = termios.tcgetattr(0)
        changed = termios.tcgetattr(0)
        changed[3] &= ~termios.ISIG
        changed[6][termios.VEOL] = _CTRL_C
        termios.tcsetattr(0, termios.TCSANOW, changed)
    except (OSError, termios.error):
        return None
    return saved


#: Service-logs questions one test may ask (each answer is at most ``services.LOG_LINES_CAP`` lines).
LOGS_ASKS_CAP = 1000
#: The most characters of one answer: its JSON line stays under the 1 MiB a box reads of a line.
LOGS_TEXT_CAP = 256 << 10

#: Sends one answer (``DEBUG`` fields) to the box that asked; a gone box is not an error here.
Answer = Callable[[dict[str, Any]], None]


class DebugRelay:
    """One boxed test's debugger frames, from one box.

    ``answer`` sends an answer to that box (``None``: the box relays no debugger, its frames are
    refused).  While the box waits for a line, :meth:`wait_input` also watches the box, to stop
    waiting when it sends something or ends: ``fd``, the box's socket, polled with stdin.
    """

    def __init__(
        self,
        item: pytest.Item,
        answer: Answer | None,
        *,
        fd: int | None = None,
    ) -> None:
        self.item = item
        self.config = item.config
        self.answer = answer
        self.fd = fd
        self.enabled = answer is not None and can_debug_here(self.config)
        self.active = False  # inside a session (``enter`` seen, no ``leave`` yet)
        self.wanted = False  # the box waits for a line
        self.paused = 0.0  # seconds spent waiting for the user: not the test's
        self.printed = 0
        self.logs_asked = 0
        self._suspended = False
        self._entered = False  # the host's pytest_enter_pdb hook was called
        if answer is not None:
            item.stash[RELAYED] = True

    # -- frames from the box ----------------------------------------------------------------
    def handle(self, fields: dict[str, Any]) -> None:
        """Act on one ``DEBUG`` frame; raises ``ValueError`` for one the host refuses."""
        op = fields.get("op")
        self.printed += msg.DEBUG_FRAME_COST
        if self.printed > msg.DEBUG_OUTPUT_CAP:
            raise ValueError(f"more than {msg.DEBUG_OUTPUT_CAP} bytes of debugger output for one test")
        if self.answer is None:
            raise ValueError("debugger frames from a box that runs no relayed debugger")
        if self.wanted:
            # A box waiting for its line prints nothing (its pdb is blocked reading): a frame now
            # is foreign to the session.
            raise ValueError(f"a debugger {str(op)[:20]!r} frame while it waits for input")
        if op == "logs":
            self._logs(fields)
        elif op == "enter":
            self._enter()
            if fields.get("title") is not None:
                self._sep(fields.get("title"), newline=True)
        elif op in ("sep", "out", "read", "leave") and not self.active:
            raise ValueError(f"a debugger {op!r} frame outside a debugger session")
        elif op == "sep":
            self._sep(fields.get("title"))
        elif op == "out":
            text = fields.get("text")
            if not isinstance(text, str) or len(text) > 2 * msg.DEBUG_TEXT_CAP:
                raise ValueError("debugger output that is not text of a frame's size")
            self.printed += len(text)
            if self.printed > msg.DEBUG_OUTPUT_CAP:
                raise ValueError(f"more than {msg.DEBUG_OUTPUT_CAP} bytes of debugger output for one test")
            self._write(text)
        elif op == "read":
            if self.enabled:
                self.wanted = True
            else:
                self._answer({"eof": True})  # as pdb reads in an unboxed xdist worker
        elif op == "leave":
            self._sep(fields.get("title"), newline=True)
            self._leave()
        else:
            raise ValueError(f"an unknown debugger frame {str(op)[:20]!r}")

    def _enter(self) -> None:
        self.active = True
        if not self.enabled:
            return
        if not self._suspended:
            capman = self.config.pluginmanager.getplugin("capturemanager")
            if capman is not None:
                # As pytest's own pdb support: the terminal, stdin included, is the debugger's.
                capman.suspend_global_capture(in_=True)
            self._suspended = True
        if not self._entered:
            self._entered = True
            # pytest-timeout (and any plugin that watches for debuggers) stops its timer here.
            self.config.hook.pytest_enter_pdb(config=self.config, pdb=self)

    def _leave(self) -> None:
        self.active = False
        if not self.enabled:
            return
        self._resume()
        if self._entered:
            self._entered = False
            self.config.hook.pytest_leave_pdb(config=self.config, pdb=self)

    def _resume(self) -> None:
        if self._suspended:
            self._suspended = False
            capman = self.config.pluginmanager.getplugin("capturemanager")
            if capman is not None:
                capman.resume_global_capture()

    def _sep(self, title: object, newline: bool = False) -> None:
        if not self.enabled:
            return
        words = escape_controls(str(title)[:200]).replace("\n", " ") if title is not None else ""
        tw = self.config.get_terminal_writer()
        if newline:
            tw.line()  # as pytest's own pdb support starts (and ends) a session
        tw.sep(">", words)

    def _write(self, text: str) -> None:
        if not self.enabled:
            return
        tw = self.config.get_terminal_writer()
        tw.write(escape_controls(text), flush=True)

    def _logs(self, fields: dict[str, Any]) -> None:
        """Answer a boxed test's ``Service.logs()``: the host's service of that fixture name, if
        the test uses one (the name is only looked up, never followed)."""
        name, lines = fields.get("service"), fields.get("lines")
        if not isinstance(name, str) or len(name) > 100 or type(lines) is not int:
            raise ValueError("a service-logs question that is not a fixture name and a line count")
        self.logs_asked += 1
        if self.logs_asked > LOGS_ASKS_CAP:
            raise ValueError(f"more than {LOGS_ASKS_CAP} service-logs questions for one test")
        from pytest_boxlite import services

        text = services.logs_for(self.item, name, max(1, min(lines, services.LOG_LINES_CAP)))
        if text is None:
            self._answer({"error": f"this test uses no running service {name!r} on the host"})
        else:
            self._answer({"logs": text[-LOGS_TEXT_CAP:]})

    def _answer(self, fields: dict[str, Any]) -> None:
        if self.answer is not None:
            self.answer(fields)  # a box gone meanwhile: the stream says so next

    # -- while the box waits for a line -------------------------------------------------------
    def wait_input(self) -> None:
        """Called by the stream before it waits on the box: while the box waits for a line, wait
        for the user's (or for the box: a frame, its end) and send it.  Every wait is a bounded
        poll; Ctrl-C here goes to the box's debugger, as pdb takes it at its prompt."""
        if not self.wanted or self.answer is None:
            return
        start = time.monotonic()
        stdin = _stdin(self.config)
        interrupted: list[int] = []
        # Ctrl-C at the prompt is the debugger's, as pdb takes it locally: a flag, sent to the box
        # as "interrupt" (no KeyboardInterrupt here, wherever this process is when it comes).
        try:
            previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
        except ValueError:  # not the main thread: Ctrl-C stays as it is
            previous = None
        terminal = _ctrl_c_ends_the_line()
        try:
            while self.wanted:
                if interrupted:
                    self.wanted = False
                    self._answer({"interrupt": True})
                    return
                line = stdin.line()
                if line is not None and line.endswith(_CTRL_C):
                    interrupted.append(signal.SIGINT)  # Ctrl-C typed on this terminal
                    continue
                if line is not None or stdin.eof:
                    self.wanted = False
                    if line is None:
                        self._answer({"eof": True})
                    else:
                        self._answer({"line": line.decode("utf-8", "replace")})
                    return
                poller = select.poll()
                poller.register(0, select.POLLIN)
                if self.fd is not None:
                    poller.register(self.fd, select.POLLIN | select.POLLRDHUP)
                # Bounded: the Ctrl-C flag is looked at between polls.
                events = poller.poll(200)
                for fd, event in events:
                    if fd == 0:
                        if event & select.POLLNVAL:
                            stdin.eof = True
                        else:
                            stdin.fill()
                    else:
                        # The box ended (or sent something while it waits): the stream reads it.
                        return
        finally:
            if terminal is not None:
                with contextlib.suppress(OSError, termios.error):
                    termios.tcsetattr(0, termios.TCSANOW, terminal)
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            self.paused += time.monotonic() - start

    def close(self) -> None:
        """The test is done (or its box is): capture resumes, no more relaying."""
        self.wanted = False
        with contextlib.suppress(Exception):
            if self.active:
                self._write("\n")
        self.active = False
        self._resume()
        if self._entered:
            self._entered = False
            self.config.hook.pytest_leave_pdb(config=self.config, pdb=self)
        self.answer = None
