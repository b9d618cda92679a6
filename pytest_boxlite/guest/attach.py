"""Host-side stdio bridge into a box.  Standard library only; runs as ``python -I -S _attach.py``.

``attach.py SOCKET [--cwd DIR] [--status FILE] [--stderr FILE] [--env JSON] [--user USER] -- ARGV...``
runs ARGV in the box whose agent listens on SOCKET, handing it this process's stdin, stdout and stderr
(SCM_RIGHTS), so the stream is binary-clean and this process copies nothing.
It exits with the command's status (128+N for a signal), and is what an
execnet ``popen//python=...`` gateway (and so an xdist worker) runs to live
inside a box.  If this process dies, the agent kills the command.

With ``--stderr FILE`` the command's stderr is a pipe this process drains into FILE (the box log,
in the host's private control directory), at most :data:`LOG_CAP` bytes of it: no descriptor of a
host file ever reaches the box (a guest that wrote gigabytes to its stderr filled the host's disk).

``attach.py --via SOCKET [--log FILE] -- ARGV...`` hands the same three descriptors to a box
server instead (``python -m pytest_boxlite.boxproc --serve-fd``, one per ``--boxlite-scope=worker``
xdist worker, whose box booted ahead of time), which runs ARGV in its box with them.  FILE is
the server's log, quoted when the server fails.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys

# Types for mypy only: this file runs in a new interpreter per command, and importing typing
# would cost each one milliseconds (mypy reads this name as typing's own).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

#: Bytes of the command's stderr written to the box log; the rest is counted, and its last
#: :data:`TAIL_KEPT` bytes are written when the command ends (a crash's traceback after a flood).
LOG_CAP = 4 << 20
TAIL_KEPT = 4096
#: How long the log is still drained once the command has exited (its children may hold the pipe).
DRAIN_AFTER_EXIT = 1.0
_CAP_NOTE = b"\n[pytest-boxlite: this log reached its cap of %d bytes; the rest is dropped]\n" % LOG_CAP


def _connect(path: str) -> socket.socket:
    """A connection to the socket at ``path`` (an agent's or a box server's, in the home), once
    its peer is proven this user's: this process hands it its stdin, stdout and stderr, which a
    listener of another user (a socket planted in a shared home) must never get."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if len(path.encode()) > 100:
        dirfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            sock.connect("/proc/self/fd/%d/%s" % (dirfd, os.path.basename(path)))
        finally:
            os.close(dirfd)
    else:
        sock.connect(path)
    # SO_PEERCRED: the credentials the kernel recorded when the peer listened (unforgeable).
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.geteuid():
        sock.close()
        raise PermissionError(
            "refused %r: its listener is uid %d, not uid %d who runs this; nothing was sent to it"
            % (path, uid, os.geteuid())
        )
    return sock


def _log_tail(log: str | None) -> str:
    if not log:
        return ""
    try:
        fd = os.open(log, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 4000))
            return fh.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _hand_over(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """Send ``request`` with ``fds`` on ``sock``.  Then this process holds none of its stdio open
    (they live on in the box) and passes SIGINT, SIGTERM and SIGHUP on over ``sock``."""
    socket.send_fds(sock, [(json.dumps(request) + "\n").encode()], fds)
    for fd in (0, 1):
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, fd)
        os.close(null)

    def forward(signum: int, frame: object) -> None:
        try:
            sock.sendall((json.dumps({"signal": signum}) + "\n").encode())
        except OSError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)


def _json_lines(buf: bytes, chunk: bytes) -> tuple[list[Any], bytes]:
    """``buf`` with ``chunk`` added: the JSON values of its complete lines (``None`` for one that is
    not JSON) and what is left of it."""
    buf = (buf + chunk)[-65536:]  # the peer's lines are short: never grow without bound
    *lines, rest = buf.split(b"\n")
    values: list[Any] = []
    for line in lines:
        try:
            values.append(json.loads(line.decode()))
        except ValueError:
            values.append(None)
    return values, rest


def _messages(sock: socket.socket) -> Iterator[Any]:
    """The peer's JSON lines (``None`` for one that is not JSON) until it hangs up; bounded."""
    buf = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except InterruptedError:
            continue
        if not chunk:
            return
        values, buf = _json_lines(buf, chunk)
        yield from values


def via_server(argv: list[str]) -> int:
    """Run ARGV in a box server's box (see the module's docstring); exit as ``boxproc`` would."""
    path, rest = argv[0], argv[1:]
    log: str | None = None
    if rest[:1] == ["--log"]:
        log, rest = rest[1], rest[2:]
    if rest[:1] == ["--"]:
        rest = rest[1:]

    def fail(why: str) -> int:
        tail = _log_tail(log)
        sys.stderr.write(
            "pytest-boxlite: could not run the worker in a box: %s\n%s" % (why, tail + "\n" if tail else "")
        )
        return 3

    try:
        sock = _connect(path)
        # A terminal's Ctrl-C reaches this client (in the controller's process group), not the
        # worker in the box: passed on, the server ends the worker's box, as it ends a plain worker.
        _hand_over(sock, {"argv": rest}, [0, 1, 2])
    except OSError as exc:
        return fail("could not connect to its box server (%s)" % (exc.strerror or exc))
    for msg in _messages(sock):
        if isinstance(msg, dict) and isinstance(msg.get("exit"), int):
            code: int = msg["exit"]
            return 128 - code if code < 0 else code
        return fail(str(msg.get("error") if isinstance(msg, dict) else "its box server answered garbage")[:2000])
    return fail("its box server ended")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--via"]:
        return via_server(argv[1:])
    path = argv[0]
    rest = argv[1:]
    cwd: str | None = None
    status_file: str | None = None
    stderr_fd = 2
    log: _CappedLog | None = None
    env: dict[str, str] = {}
    user: str | None = None
    while rest[:1] in (["--cwd"], ["--status"], ["--stderr"], ["--env"], ["--user"]):
        if rest[0] == "--cwd":
            cwd = rest[1]
        elif rest[0] == "--env":
            env = json.loads(rest[1])
        elif rest[0] == "--user":
            user = rest[1]
        elif rest[0] == "--stderr":
            # The box log lives in the host's private control directory; never follow a link there.
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            log = _CappedLog(os.open(rest[1], flags, 0o600))
            stderr_fd = log.write_end
        else:
            status_file = rest[1]
        rest = rest[2:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    try:
        sock = _connect(path)
    except OSError as exc:
        sys.stderr.write("boxlite attach: could not connect to the box's agent: %s\n" % (exc.strerror or exc))
        return 126
    req: dict[str, Any] = {"op": "exec", "argv": rest, "env": env, "cwd": cwd}
    if user is not None:
        req["user"] = user
    try:
        _hand_over(sock, req, [0, 1, stderr_fd])
    finally:
        if log is not None:
            log.handed_over()
    messages = _messages(sock) if log is None else log.drain_while(sock)
    try:
        for msg in messages:
            if not isinstance(msg, dict):
                continue
            if "error" in msg:
                sys.stderr.write("boxlite attach: %s: %s\n" % (rest[0] if rest else "", msg["error"]))
                return 127
            if "exit" in msg:
                code = int(msg["exit"])
                if status_file:
                    # The raw status (negative: killed by that signal), for whoever wants to say how it died.
                    with open(status_file, "w") as fh:
                        fh.write("%d\n" % code)
                return 128 - code if code < 0 else code
        return 255  # the box is gone (destroyed or crashed); the caller sees the channel close
    finally:
        if log is not None:
            log.finish(DRAIN_AFTER_EXIT)


class _CappedLog:
    """The command's stderr: a pipe whose read end this process copies into the log, bounded.

    Only this (host) process writes the log file; the box gets the pipe's write end, so what it
    writes can fill the pipe (64 KiB), never the host's disk.
    """

    def __init__(self, log_fd: int) -> None:
        self.log_fd = log_fd
        self.read_end, self.write_end = os.pipe()
        os.set_inheritable(self.read_end, False)
        self.written = 0
        self.dropped = 0
        self.tail = b""

    def handed_over(self) -> None:
        """The box holds the write end now (or never will): this process must not keep it open."""
        if self.write_end >= 0:
            os.close(self.write_end)
            self.write_end = -1

    def _take(self, chunk: bytes) -> None:
        room = LOG_CAP - self.written
        if room > 0:
            part = chunk[:room]
            self._write(part)
            self.written += len(part)
            chunk = chunk[room:]
            if chunk:
                self._write(_CAP_NOTE)
        if chunk:
            self.dropped += len(chunk)
            self.tail = (self.tail + chunk)[-TAIL_KEPT:]

    def _write(self, data: bytes) -> None:
        try:
            while data:
                data = data[os.write(self.log_fd, data) :]
        except OSError:
            pass  # a full disk or a removed box: the box's stderr is drained all the same

    def _read(self) -> bytes | None:
        """One chunk of the pipe (b"" at its end); never blocks (the pipe's read end is non-blocking)."""
        try:
            chunk = os.read(self.read_end, 65536)
        except BlockingIOError:
            return None
        except OSError:
            return b""
        self._take(chunk)
        return chunk

    def drain_while(self, sock: socket.socket) -> Iterator[Any]:
        """The peer's JSON lines on ``sock`` (as :func:`_messages`), the log drained meanwhile."""
        os.set_blocking(self.read_end, False)
        sel = selectors.DefaultSelector()
        sel.register(self.read_end, selectors.EVENT_READ, "log")
        sel.register(sock, selectors.EVENT_READ, "sock")
        buf = b""
        try:
            while True:
                for key, _ in sel.select():
                    if key.data == "log":
                        if self._read() == b"":
                            sel.unregister(self.read_end)
                        continue
                    try:
                        chunk = sock.recv(4096)
                    except InterruptedError:
                        continue
                    if not chunk:
                        return
                    values, buf = _json_lines(buf, chunk)
                    yield from values
        finally:
            sel.close()

    def finish(self, timeout: float) -> None:
        """What is left in the pipe, for at most ``timeout`` seconds; then the dropped tail."""
        import time

        self.handed_over()
        os.set_blocking(self.read_end, False)
        deadline = time.monotonic() + timeout
        sel = selectors.DefaultSelector()
        sel.register(self.read_end, selectors.EVENT_READ)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    break
                if self._read() == b"":
                    break
        finally:
            sel.close()
            os.close(self.read_end)
        if self.dropped:
            self._write(
                b"\n[pytest-boxlite: %d bytes were dropped; the last %d of them:]\n" % (self.dropped, len(self.tail))
                + self.tail
            )
        os.close(self.log_fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
