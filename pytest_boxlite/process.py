"""Processes running in a box with :class:`subprocess.Popen`'s interface (``Sandbox.spawn``).

A :class:`BoxProcess` is what code written against ``Popen`` expects: ``pid``, binary ``stdin``,
``stdout`` and ``stderr`` streams, ``poll``, ``wait``, ``communicate``, ``returncode`` (negative
for a signal), ``send_signal``/``terminate``/``kill`` and use as a context manager.  Where a box
differs, the docstrings say so:

* ``pid`` is the process's pid *in the box's* pid namespace.
* ``stdout``/``stderr`` are filled by a host thread as the box writes, each up to a bound (the
  sandbox's ``max_output``): what a box writes beyond it is dropped, counted in the stream's
  ``dropped`` and flagged by its ``truncated``, so a flood never grows the host without end (a
  real pipe would block the writer instead; a box's service must never stall on a log nobody
  reads).  They have no ``fileno``.
* :meth:`BoxProcess.wait_for_output` waits for a line matching a pattern, the readline loop
  people otherwise write around ``Popen``.

Every byte from a box is hostile: reads are bounded, lines are cut at :data:`MAX_LINE`, and the
lines quoted in errors are escaped.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import re
import selectors
import signal
import subprocess
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

from pytest_boxlite._shown import shown
from pytest_boxlite.errors import BoxDeadError, OutputTimeoutError, ProcessExitedError
from pytest_boxlite.runtimes.base import DEFAULT_MAX_OUTPUT, RawProcess

__all__ = ["MAX_LINE", "BoxProcess", "BoxProcessWarning", "OutputStream", "quote_output"]

#: Longest line :meth:`BoxProcess.wait_for_output` matches: a longer line is matched on its
#: first ``MAX_LINE`` bytes (the rest of it is not kept for the waits).  Small because Python's
#: ``re`` cannot be interrupted and a pattern like ``\s+ready`` costs time quadratic in the
#: line's length (64 KiB lines of spaces took 2 s each): the bound is what keeps a wait's
#: timeout meaningful against a guest's output.
MAX_LINE = 4 * 1024
#: Output lines kept for :meth:`BoxProcess.wait_for_output` and error messages (per process)...
_HISTORY = 2000
#: ...and the bytes they may hold together (at most; a process's ``max_output`` when smaller,
#: but never under one line): older lines are dropped first.
_HISTORY_BYTES = 4 << 20
#: Lines quoted in an error (each cut to ``_QUOTE`` characters).
_QUOTED_LINES = 20
_QUOTE = 300
#: How long closing a process waits for the box to report it reaped after SIGKILL.
_REAP_TIMEOUT = 5.0
_CHUNK = 1 << 16


class BoxProcessWarning(UserWarning):
    """A box process was still running when its sandbox ended or was given back: it was killed."""


def _quote(line: bytes) -> str:
    """A line from the box as printable text: escaped, cut."""
    # A line: no newline in it; a tab stays.
    text = shown(line[: _QUOTE * 4].decode("utf-8", "backslashreplace"))
    return text if len(text) <= _QUOTE else text[:_QUOTE] + "..."


def quote_output(output: str | bytes, count: int = _QUOTED_LINES) -> list[str]:
    """The last ``count`` lines of a box's ``output`` (a command's stdout/stderr), each escaped
    and cut as :meth:`BoxProcess.last_lines` does, for an error, a warning or a report."""
    data = output.encode("utf-8", "surrogateescape") if isinstance(output, str) else output
    # Split from the right, ``count`` times: the output may be as large as its max_output.
    lines = data.strip().rsplit(b"\n", count)[-count:] if data.strip() else []
    return [_quote(line.rstrip(b"\r")) for line in lines]


class OutputStream(io.RawIOBase):
    """One output stream of a :class:`BoxProcess` (``proc.stdout``, ``proc.stderr``): binary,
    read-only, with ``read``/``readline``/iteration like a ``Popen`` pipe.

    Reads block until data comes or the stream ends (the box closed its end), as a pipe's do.
    What the box wrote beyond ``limit`` unread bytes was dropped: ``dropped`` counts it and
    ``truncated`` says so.  There is no ``fileno``: the bytes pass through a host thread.
    """

    def __init__(self, name: str, limit: int, cond: threading.Condition) -> None:
        super().__init__()
        self.name = name
        self.limit = limit
        self._cond = cond
        self._buf = bytearray()
        self._eof = False
        #: Bytes the box wrote that did not fit (dropped, never buffered).
        self.dropped = 0

    @property
    def truncated(self) -> bool:
        """Whether any output was dropped because the unread buffer was full."""
        return self.dropped > 0

    # -- fed by the pump (under the condition) --------------------------------
    def _put(self, chunk: bytes) -> None:
        room = self.limit - len(self._buf)
        if room > 0:
            self._buf += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    # -- io.RawIOBase ----------------------------------------------------------
    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"a box process's {self.name} has no descriptor (it is relayed by the host)")

    def _wait_data(self) -> None:
        while not self._buf and not self._eof and not self.closed:
            self._cond.wait(0.5)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        with self._cond:
            self._wait_data()
            n = min(len(view), len(self._buf))
            view[:n] = self._buf[:n]
            del self._buf[:n]
            return n

    def read(self, size: int | None = -1, /) -> bytes:
        if size is None or size < 0:
            return self.readall()
        with self._cond:
            self._wait_data()
            data = bytes(self._buf[:size])
            del self._buf[:size]
            return data

    def readall(self) -> bytes:
        with self._cond:
            while not self._eof and not self.closed:
                self._cond.wait(0.5)
            data = bytes(self._buf)
            self._buf.clear()
            return data

    def readline(self, size: int | None = -1, /) -> bytes:
        with self._cond:
            while True:
                end = self._buf.find(b"\n")
                if end >= 0 and (size is None or size < 0 or end < size):
                    n = end + 1
                    break
                if size is not None and 0 <= size <= len(self._buf):
                    n = size
                    break
                if self._eof or self.closed:
                    n = len(self._buf)
                    break
                self._cond.wait(0.5)
            data = bytes(self._buf[:n])
            del self._buf[:n]
            return data

    def close(self) -> None:
        with self._cond:
            super().close()
            self._buf.clear()
            self._cond.notify_all()


class BoxProcess:
    """A process running in a box, with :class:`subprocess.Popen`'s interface (see the module
    docstring for where it differs).  Made by :meth:`pytest_boxlite.sandbox.Sandbox.spawn`."""

    def __init__(self, raw: RawProcess, args: Sequence[str], *, box: str, max_output: int = DEFAULT_MAX_OUTPUT) -> None:
        self._raw = raw
        self.args = list(args)
        self.box = box
        #: The process's pid in the box's pid namespace.
        self.pid = raw.pid
        self.returncode: int | None = None
        self._cond = threading.Condition()
        self.stdin: io.BufferedWriter | None = io.BufferedWriter(io.FileIO(raw.stdin, "wb", closefd=True))
        self.stdout = OutputStream("stdout", max_output, self._cond)
        self.stderr = OutputStream("stderr", max_output, self._cond)
        #: ``(sequence number, stream name, line)`` of the last lines written, for the waits.
        self._lines: collections.deque[tuple[int, str, bytes]] = collections.deque()
        self._history_bytes = 0
        self._history_budget = max(MAX_LINE, min(max_output, _HISTORY_BYTES))
        self._seq = 0
        self._partial = {"stdout": bytearray(), "stderr": bytearray()}
        #: Streams whose current line passed MAX_LINE: its rest is skipped up to its newline.
        self._skipping = {"stdout": False, "stderr": False}
        #: Where the next wait_for_output starts, per stream filter (after the last match).
        self._cursor: dict[str | None, int] = {}
        self._error: str | None = None
        self._closed = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        early = getattr(raw, "pending", None)
        if early is not None:
            self.returncode = early()
        self._pump_thread = threading.Thread(target=self._pump, name=f"boxlite-proc-{box}-{self.pid}", daemon=True)
        self._pump_thread.start()

    def __del__(self) -> None:
        # A process whose box was destroyed without close(): its pump ended, its wake pipe stays.
        if not getattr(self, "_closed", True):
            for fd in (getattr(self, "_wake_r", -1), getattr(self, "_wake_w", -1)):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def __repr__(self) -> str:
        return f"<BoxProcess pid={self.pid} box={self.box} returncode={self.returncode} args={self.args!r}>"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the process is then reaped and its streams released)."""
        return self._closed

    # -- the pump ---------------------------------------------------------------
    def _pump(self) -> None:
        """Move the box's output into the streams' bounded buffers and note the exit, until both
        streams end and the exit is known, or the process is closed."""
        sel = selectors.DefaultSelector()
        streams = {self._raw.stdout: self.stdout, self._raw.stderr: self.stderr}
        try:
            for fd in streams:
                sel.register(fd, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            if self.returncode is None:
                sel.register(self._raw.fileno(), selectors.EVENT_READ)
            while True:
                with self._cond:
                    if self._closed or (not streams and self.returncode is not None):
                        return
                for key, _ in sel.select(1.0):
                    fd = key.fd
                    if fd == self._wake_r:
                        with contextlib.suppress(OSError):
                            os.read(fd, 4096)
                    elif fd in streams:
                        try:
                            chunk = os.read(fd, _CHUNK)
                        except OSError:
                            chunk = b""
                        with self._cond:
                            stream = streams[fd]
                            if chunk:
                                stream._put(chunk)
                                self._scan(stream.name, chunk)
                            else:
                                sel.unregister(fd)
                                del streams[fd]
                                stream._eof = True
                                self._flush_partial(stream.name)
                            self._cond.notify_all()
                    else:
                        try:
                            code = self._raw.feed()
                        except BoxDeadError as exc:
                            code = None
                            self._error = str(exc)
                            sel.unregister(fd)
                        if code is not None:
                            sel.unregister(fd)
                        with self._cond:
                            if code is not None:
                                self.returncode = code
                            self._cond.notify_all()
                if self._error is not None and self.returncode is None:
                    # The box is gone: so is the process; its streams end with the box.
                    with self._cond:
                        self.returncode = -signal.SIGKILL
                        self._cond.notify_all()
        finally:
            sel.close()
            with self._cond:
                for stream in streams.values():
                    stream._eof = True
                for fd in (self._raw.stdout, self._raw.stderr):
                    with contextlib.suppress(OSError):
                        os.close(fd)
                self._cond.notify_all()

    def _scan(self, name: str, chunk: bytes) -> None:
        """Split ``chunk`` into lines for the waits: each line is kept up to :data:`MAX_LINE`
        bytes, as soon as it has them (a wait need not wait for its newline); the rest of a
        longer line is skipped up to its newline."""
        partial = self._partial[name]
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if self._skipping[name]:
                if end >= 0:
                    self._skipping[name] = False
            else:
                partial += piece[: max(0, MAX_LINE - len(partial))]
                if len(partial) >= MAX_LINE:
                    self._flush_partial(name)
                    self._skipping[name] = end < 0
                elif end >= 0:
                    self._flush_partial(name, force=True)
            if end < 0:
                return
            start = end + 1

    def _flush_partial(self, name: str, *, force: bool = False) -> None:
        partial = self._partial[name]
        if partial or force:
            line = bytes(partial)
            self._lines.append((self._seq, name, line))
            self._history_bytes += len(line)
            self._seq += 1
            partial.clear()
            # Bounded by count and by bytes: the oldest lines go first (a wait never sees them).
            while len(self._lines) > 1 and (len(self._lines) > _HISTORY or self._history_bytes > self._history_budget):
                self._history_bytes -= len(self._lines.popleft()[2])

    # -- Popen's interface ----------------------------------------------------
    def poll(self) -> int | None:
        """The exit status if the process has ended (negative: the signal that killed it), else ``None``."""
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to end; :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.returncode is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                self._cond.wait(0.5 if left is None else min(left, 0.5))
            return self.returncode

    def communicate(self, input: bytes | None = None, timeout: float | None = None) -> tuple[bytes, bytes]:
        """Send ``input`` (then close stdin), read both streams to their end and wait for the exit.

        As ``Popen.communicate``: :class:`subprocess.TimeoutExpired` after ``timeout`` (nothing is
        lost: call it again).  Returns ``(stdout, stderr)``, each cut at the stream's bound.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stdin is not None and not self.stdin.closed:
            if input:
                self._write_all(input, deadline, timeout)
            with contextlib.suppress(BrokenPipeError):
                self.stdin.close()
        with self._cond:
            while self.returncode is None or not (self.stdout._eof and self.stderr._eof):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                self._cond.wait(0.5 if left is None else min(left, 0.5))
        return self.stdout.readall(), self.stderr.readall()

    def _write_all(self, data: bytes, deadline: float | None, timeout: float | None) -> None:
        assert self.stdin is not None
        self.stdin.flush()
        fd = self.stdin.fileno()
        view = memoryview(data)
        os.set_blocking(fd, False)
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_WRITE)
                while view:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                    if not sel.select(0.5 if left is None else min(left, 0.5)):
                        continue
                    try:
                        n = os.write(fd, view[:_CHUNK])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        return  # as Popen.communicate: the process did not read it all
                    view = view[n:]
        finally:
            with contextlib.suppress(OSError):
                os.set_blocking(fd, True)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process itself (not a shim, not its group); nothing once it ended."""
        if self.returncode is None:
            self._raw.signal(int(sig))

    def terminate(self) -> None:
        """``SIGTERM`` to the process."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """``SIGKILL`` to the process."""
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> BoxProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- beyond Popen -----------------------------------------------------------
    def wait_for_output(
        self, pattern: str | bytes | re.Pattern[str] | re.Pattern[bytes], *, timeout: float, stream: str | None = None
    ) -> re.Match[Any]:
        """The :class:`re.Match` of the first output line (``stream``: ``"stdout"``, ``"stderr"``,
        or ``None`` for either) that matches ``pattern`` (``re.search``; a text pattern searches the
        line decoded as UTF-8), after the line a previous wait matched.

        Lines are those the process still keeps (its last :data:`_HISTORY` lines, at most
        ``min(max_output, 4 MiB)`` bytes of them: a line dropped before the wait saw it is not
        seen), in order, without their newline; a line longer than :data:`MAX_LINE` bytes is
        matched on its first ``MAX_LINE`` bytes.  The pattern runs outside the process's lock and
        the deadline is checked between lines.  Raises :class:`~pytest_boxlite.errors.OutputTimeoutError` after
        ``timeout`` seconds, :class:`~pytest_boxlite.errors.ProcessExitedError` when the output
        ends first; both quote the last lines.
        """
        if stream not in (None, "stdout", "stderr"):
            raise ValueError(f"stream must be 'stdout', 'stderr' or None, got {stream!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        regex: re.Pattern[Any] = re.compile(pattern) if isinstance(pattern, (str, bytes)) else pattern
        text = isinstance(regex.pattern, str)
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                # Only the lines not yet looked at are copied; they are matched outside the lock,
                # so the pump (and the box's output) never waits on a pattern.
                cursor = self._cursor.get(stream, 0)
                fresh = [
                    (seq, line)
                    for seq, name, line in self._lines
                    if seq >= cursor and (stream is None or name == stream)
                ]
                copied = self._seq
            unchecked = False
            for i, (seq, line) in enumerate(fresh):
                if i and time.monotonic() >= deadline:
                    unchecked = True
                    break
                match = regex.search(line.decode("utf-8", "replace") if text else line)
                if match is not None:
                    with self._cond:
                        self._cursor[stream] = seq + 1
                    return match
                cursor = seq + 1
            with self._cond:
                self._cursor[stream] = cursor
                if not unchecked and self._seq != copied:
                    # Lines came while matching: look at them before deciding anything.
                    if time.monotonic() < deadline:
                        continue
                    unchecked = True
                ended = self.stdout._eof and self.stderr._eof if stream is None else getattr(self, stream)._eof
                if (ended or self._closed) and not unchecked:
                    # The exit status usually follows the end of the output: say it when it does.
                    soon = min(deadline, time.monotonic() + 1.0)
                    while self.returncode is None and not self._closed and time.monotonic() < soon:
                        self._cond.wait(soon - time.monotonic())
                    code = self.returncode
                    what = "closed its output" if code is None else f"exited with status {code}"
                    raise ProcessExitedError(
                        f"{self._label()} {what} before a line matched {regex.pattern!r}", self.last_lines()
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OutputTimeoutError(
                        f"no line of {self._label()} matched {regex.pattern!r} within {timeout:g} s", self.last_lines()
                    )
                self._cond.wait(min(left, 0.5))

    def _settle(self, bound: float = 1.0) -> None:
        """Once the process has exited, wait (at most ``bound`` seconds) until both streams have
        ended: the exit status can arrive before the pump has read the last output, and an error
        that quotes the last lines must not miss the line that says why it exited."""
        deadline = time.monotonic() + bound
        with self._cond:
            while (
                self.returncode is not None
                and not self._closed
                and not (self.stdout._eof and self.stderr._eof)
                and time.monotonic() < deadline
            ):
                self._cond.wait(deadline - time.monotonic())

    def last_lines(self, count: int = _QUOTED_LINES) -> list[str]:
        """The process's last ``count`` output lines, escaped, each ``"stdout: ..."``/``"stderr: ..."``."""
        with self._cond:
            tail = list(self._lines)[-count:]
            partial = [(n, bytes(p)) for n, p in self._partial.items() if p]
        return [f"{name}: {_quote(line)}" for _, name, line in tail] + [f"{n}: {_quote(p)}" for n, p in partial]

    def _label(self) -> str:
        return f"process {self.pid} ({' '.join(self.args)[:200]!r}) in box {self.box}"

    def close(self) -> bool:
        """Kill the process if it still runs, wait (bounded) until the box has reaped it, and
        release its streams.  Returns whether it had to be killed.  Idempotent."""
        if self._closed:
            return False
        killed = False
        if self.returncode is None:
            killed = True
            # Its whole process group: what it started goes with it.
            self._raw.signal(signal.SIGKILL, group=True)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(_REAP_TIMEOUT)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._pump_thread.join(_REAP_TIMEOUT)
        self._raw.close()
        if self.stdin is not None:
            with contextlib.suppress(OSError):
                self.stdin.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        return killed


def end_processes(processes: list[BoxProcess], why: str) -> list[str]:
    """Close every process of ``processes`` (emptied); warn (:class:`BoxProcessWarning`) about
    those still running, which were killed, and return what was said of them."""
    said = []
    while processes:
        proc = processes.pop()
        if proc.close():
            said.append(f"{proc._label()} was still running when {why}: killed")
    for line in said:
        warnings.warn(BoxProcessWarning(line), stacklevel=3)
    return said
