"""``spawn`` on the vm runtime: a process started through the boxlite SDK's exec, its stdio relayed
into host pipes (:class:`~pytest_boxlite.runtimes.base.RawProcess`) for
:class:`pytest_boxlite.process.BoxProcess`.

The SDK gives no guest pid and no spawn error before the process runs, so the command starts
under a tiny shim (:data:`SHIM`) that writes one header line on stdout, its pid (then ``exec``:
the pid is the command's own, and signals reach the command itself) or the ``exec`` error; the
host takes that line off before anything reaches the user, and reads at most
:data:`_MAX_HEADER` bytes of it.  Nothing in the box can write before the shim does: the stream
is the command's own.  What differs from a namespace box: stdout and stderr come through the SDK
as lossily decoded UTF-8 text (re-encoded here), and signals reach the leader only (a process
group is ended by its environment tag, as ``exec``'s timeout does).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import os
import select
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pytest_boxlite.errors import BoxDeadError, BoxliteError, BoxTimeoutError, file_error

#: Runs the command: header line ``pid N`` then ``exec``, or ``error ERRNO MESSAGE`` when the
#: program is not found or not executable (looked up first: after the pid line, an ``exec``
#: failure could only be told apart from the command's own output on stderr, where it goes).
SHIM = """
import os, sys
def find(name):
    dirs = [""] if "/" in name else os.environ.get("PATH", "/usr/bin:/bin").split(":")
    err = 2
    for d in dirs:
        path = os.path.join(d, name) if d else name
        if os.path.isfile(path):
            if os.access(path, os.X_OK):
                return path, 0
            err = 13
    return None, err
path, err = find(sys.argv[1])
if path is None:
    os.write(1, b"error %d %s\\n" % (err, os.strerror(err).encode()))
    os._exit(127)
os.write(1, b"pid %d\\n" % os.getpid())
try:
    os.execv(path, sys.argv[1:])
except OSError as exc:
    os.write(2, ("pytest-boxlite: cannot run %r: %s\\n" % (sys.argv[1], exc)).encode()[:400])
    os._exit(127)
"""
_MAX_HEADER = 512
#: Bound on starting the command and reading its header.
START_TIMEOUT = 30.0
_CHUNK = 1 << 16


def _write_all(fd: int, data: bytes) -> bool:
    """Write ``data`` to the host pipe ``fd`` (blocking: the reader drains it); ``False`` once the
    host closed its end (what the box writes after that is dropped)."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        return False
    return True


class VmProcess:
    """A process started in a VM for ``spawn`` (see :class:`~pytest_boxlite.runtimes.base.RawProcess`)."""

    def __init__(
        self,
        box: str,
        loop: asyncio.AbstractEventLoop,
        kill_group: Callable[[], Awaitable[None]],
    ) -> None:
        self.box = box
        self._loop = loop
        self._kill_group = kill_group
        self.pid = 0
        in_r, self.stdin = os.pipe2(os.O_CLOEXEC)
        self.stdout, out_w = os.pipe2(os.O_CLOEXEC)
        self.stderr, err_w = os.pipe2(os.O_CLOEXEC)
        self._ctl, self._ctl_vm = socket.socketpair()
        self._ctl.setblocking(False)
        self._guest = (in_r, out_w, err_w)
        self._buf = b""
        self._eof = False
        self._closed = False
        self._execution: Any = None
        self._exited = threading.Event()
        self.header: concurrent.futures.Future[int] = concurrent.futures.Future()

    # -- the loop's side -------------------------------------------------------
    async def run(self, start: Callable[[], Awaitable[Any]], answers: Callable[[], Awaitable[bool]]) -> None:
        """Start the command, relay its stdio, report its exit on the control socket."""
        in_r, out_w, err_w = self._guest
        try:
            try:
                self._execution = execution = await start()
            except Exception as exc:  # noqa: BLE001 - handed to the caller of spawn
                self.header.set_exception(exc)
                return
            stdin = execution.stdin()
            feeder = threading.Thread(target=self._feed_stdin, args=(in_r, stdin), daemon=True)
            feeder.start()
            in_r = -1  # the thread owns it now
            readers = asyncio.gather(
                self._collect(execution.stdout(), out_w, header=True), self._collect(execution.stderr(), err_w)
            )
            code: int | None = int((await execution.wait()).exit_code)
            # The process is gone: its stdin is closed before its exit is told, so a write after
            # wait() is a BrokenPipeError as with a pipe (the SDK never says the guest closed it).
            self._exited.set()
            await asyncio.get_running_loop().run_in_executor(None, feeder.join, 5.0)
            try:
                await asyncio.wait_for(readers, 2)
            except asyncio.TimeoutError:
                readers.cancel()
                await self._kill_group()  # children that outlived it hold the streams
            if code == -1 and not await answers():
                code = None  # the channel was lost, not a signal: the host sees the box die
            if not self.header.done():
                self.header.set_exception(BoxDeadError(f"box {self.box}: the command gave no header"))
            if code is not None:
                with contextlib.suppress(OSError):
                    self._ctl_vm.sendall((json.dumps({"exit": code}) + "\n").encode())
        finally:
            for fd in (in_r, out_w, err_w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._ctl_vm.close()

    async def _collect(self, stream: Any, fd: int, *, header: bool = False) -> None:
        loop = asyncio.get_running_loop()
        pending = b""
        open_ = True
        async for chunk in stream:
            data = chunk.encode("utf-8", "surrogateescape") if isinstance(chunk, str) else bytes(chunk)
            if header and not self.header.done():
                pending += data
                if b"\n" not in pending:
                    if len(pending) > _MAX_HEADER:
                        self.header.set_exception(BoxDeadError(f"box {self.box}: the command's header was too long"))
                    continue
                line, data = pending.split(b"\n", 1)
                self._header(line)
            if open_ and data:
                # In a worker thread: a full pipe must not stall the loop every box shares.
                open_ = await loop.run_in_executor(None, _write_all, fd, data)
        if header and not self.header.done():
            self.header.set_exception(BoxDeadError(f"box {self.box}: the command ended before its header"))

    def _header(self, line: bytes) -> None:
        words = line.decode("utf-8", "replace").split(" ", 2)
        if len(words) == 2 and words[0] == "pid" and words[1].isdigit() and int(words[1]) > 0:
            self.pid = int(words[1])
            self.header.set_result(self.pid)
        elif len(words) == 3 and words[0] == "error" and words[1].isdigit():
            self.header.set_exception(file_error(int(words[1]), words[2][:300]))
        else:
            self.header.set_exception(BoxDeadError(f"box {self.box}: the command's header was malformed"))

    def _feed_stdin(self, fd: int, stdin: Any) -> None:
        """Host pipe -> ``send_input``, until the host closes its end or the box stops reading.

        The SDK's calls are made on the loop (each needs a running loop when it is called)."""

        async def send(data: bytes) -> None:
            await stdin.send_input(data)

        async def close() -> None:
            await stdin.close()

        try:
            while not self._exited.is_set():
                ready, _, _ = select.select([fd], [], [], 0.1)
                if not ready:
                    continue
                data = os.read(fd, _CHUNK)
                if not data:
                    break
                asyncio.run_coroutine_threadsafe(send(data), self._loop).result(30)
        except Exception:  # noqa: BLE001 - the stream ended (the process exited, the box is gone)
            pass
        finally:
            os.close(fd)
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)

    # -- the host's side (RawProcess) --------------------------------------------
    def fileno(self) -> int:
        return self._ctl.fileno()

    def feed(self) -> int | None:
        try:
            chunk = self._ctl.recv(4096)
        except BlockingIOError:
            return None
        except OSError:
            chunk = b""
        if not chunk:
            raise BoxDeadError(f"box {self.box}: the channel to the process was lost before it exited")
        self._buf = (self._buf + chunk)[-4096:]
        if b"\n" in self._buf:
            line = self._buf.split(b"\n", 1)[0]
            try:
                code = json.loads(line.decode())["exit"]
                return int(code)
            except (ValueError, KeyError, TypeError):
                raise BoxDeadError(f"box {self.box}: a malformed exit message") from None
        return None

    def signal(self, sig: int, *, group: bool = False) -> None:
        execution = self._execution
        if execution is None:
            return

        async def send() -> None:
            if group:
                await self._kill_group()
            await execution.signal(int(sig))

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(send(), self._loop).result(15)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ctl.close()

    def discard(self) -> None:
        """Close everything the host holds, for a process that never started."""
        self.close()
        for fd in (self.stdin, self.stdout, self.stderr):
            with contextlib.suppress(OSError):
                os.close(fd)


def wait_header(proc: VmProcess, box: str, wrap: Callable[[Exception], BoxliteError]) -> None:
    """Wait (bounded) for the command's header: its pid, or why it could not start (raised)."""
    try:
        proc.header.result(START_TIMEOUT)
    except concurrent.futures.TimeoutError:
        proc.signal(9, group=True)
        proc.discard()
        raise BoxTimeoutError(f"box {box}: the command did not start within {START_TIMEOUT:g} s") from None
    except BoxliteError:
        proc.discard()
        raise
    except Exception as exc:
        proc.discard()
        raise wrap(exc) from exc


#: The guest side of one connection to a published port on a VM: connects to the box's own
#: ``127.0.0.1:PORT``, says ``+`` (or ``-ERRNO``) on a line, then copies stdin -> socket and
#: socket -> stdout (binary-clean through the box's stdio bridge).
CONNECT = """
import os, socket, sys, threading
try:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
except OSError as e:
    os.write(1, b"-%d\\n" % (e.errno or 0))
    sys.exit(1)
s.settimeout(None)
os.write(1, b"+\\n")
def up():
    while True:
        d = os.read(0, 65536)
        if not d:
            break
        s.sendall(d)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while True:
    d = s.recv(65536)
    if not d:
        break
    os.write(1, d)
"""


def connect_port(argv: list[str], box: str, port: int, timeout: float) -> socket.socket:
    """Run the host command ``argv`` (the box's attach of :data:`CONNECT`) on one end of a socket
    pair and return the other end once the guest connected; the command ends with the connection."""
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen(
            argv, stdin=theirs.fileno(), stdout=theirs.fileno(), stderr=subprocess.DEVNULL, close_fds=True
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    threading.Thread(target=proc.wait, daemon=True).start()  # reaped when the connection ends
    try:
        deadline = time.monotonic() + timeout
        status = b""
        while not status.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise BoxTimeoutError(f"box {box}: no connection to port {port} within {timeout:g} s")
            ours.settimeout(left)
            try:
                more = ours.recv(1)
            except TimeoutError:
                continue
            if not more or len(status) > 16:
                raise BoxDeadError(f"box {box}: the connection to port {port} ended before it was made")
            status += more
        if status != b"+\n":
            code = status[1:-1]
            err = int(code) if status[:1] == b"-" and code.isdigit() else 0
            if err == errno.ECONNREFUSED:
                raise ConnectionRefusedError(err, f"box {box}: nothing listens on port {port}")
            raise OSError(err, f"box {box}: cannot connect to port {port}: {os.strerror(err) if err else status!r}")
        ours.settimeout(None)
        return ours
    except BaseException:
        ours.close()
        with contextlib.suppress(OSError):
            proc.kill()
        raise
