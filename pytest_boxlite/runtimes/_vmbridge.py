"""Host-side stdio bridge for VM boxes: the VM's counterpart of the namespace agent.

How it works, and why: ``docs/explanation/internals/vm-bridge.md``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import json
import os
import queue
import select
import signal
import socket
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from pytest_boxlite.runtimes._forkrelay import peer

T = TypeVar("T")
#: Where commands run when the client names no cwd: the box's workdir, as on namespace boxes
#: (the SDK would run them in "/").
WORKDIR = "/workspace"
#: Bound on one SDK call made for a connection (creating the exec, one send, one signal).
CALL_TIMEOUT = 30.0
#: After the command's stdout ends, how long stderr may stay open (children that escaped the group).
STDERR_GRACE = 2.0
#: Lines the SDK itself writes into a command's stderr when the channel to the guest fails.
_SDK_STREAM_ERRORS = ("Attach failed:", "Attach stream error:")
#: Longest attach request a client may send (its argv and environment), and longest output
#: frame of the shim (a base64 line of 48 KiB is 64 KiB).
REQUEST_CAP = 1 << 20
FRAME_CAP = 1 << 20
#: Most text of one stream the bridge holds at once between the SDK and the client (read from
#: the box, not yet written on): a box that writes faster than the host reads is cut off here,
#: never buffered without end in the process that owns the VM.
BACKLOG_CAP = 64 << 20

FRAMING_SHIM = """
import base64, os, signal, subprocess, sys
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, start_new_session=True)
def forward(sig, frame):
    try:
        os.killpg(p.pid, sig)
    except OSError:
        pass
def kill_group(sig, frame):
    forward(signal.SIGKILL, frame)
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, forward)
signal.signal(signal.SIGUSR1, kill_group)
fd = p.stdout.fileno()
while True:
    chunk = os.read(fd, 48 * 1024)
    if not chunk:
        break
    sys.stdout.write(base64.b64encode(chunk).decode("ascii") + "\\n")
    sys.stdout.flush()
sys.stdout.write("!exit %d\\n" % p.wait())
sys.stdout.flush()
"""


class BridgeStreamError(Exception):
    """The framed stdout from the guest is not what the shim wrote (dropped or injected bytes)."""


class BoxGoneError(Exception):
    """The box was destroyed while the command ran (an expected end: the client is told nothing)."""


class FrameDecoder:
    """Decodes the shim's framing strictly: base64 lines, then one ``!exit N`` trailer."""

    def __init__(self) -> None:
        self.pending = ""
        self.exit_code: int | None = None

    def feed(self, text: str) -> list[bytes]:
        """The payload bytes in ``text``; raises :class:`BridgeStreamError` on anything else."""
        if "\n" not in text and len(self.pending) + len(text) > FRAME_CAP:
            raise BridgeStreamError(f"an output frame longer than {FRAME_CAP} bytes")  # before it is joined
        self.pending += text
        out: list[bytes] = []
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            if "[boxlite]" in line:
                raise BridgeStreamError(f"boxlite lost part of the command's output: {line.strip()[:200]}")
            if self.exit_code is not None:
                raise BridgeStreamError("output after the command's exit trailer")
            if line.startswith("!exit "):
                try:
                    self.exit_code = int(line[6:])
                except ValueError:
                    raise BridgeStreamError(f"bad exit trailer {line[:40]!r}") from None
                continue
            try:
                out.append(base64.b64decode(line, validate=True))
            except (binascii.Error, ValueError):
                raise BridgeStreamError(f"corrupted output frame ({len(line)} characters)") from None
        if len(self.pending) > FRAME_CAP:
            raise BridgeStreamError(f"an output frame longer than {FRAME_CAP} bytes")
        return out


class Backlog:
    """One stream's text between the SDK's reader (on the event loop) and its pump thread.

    At most ``cap`` characters are held: past that the stream is cut (:attr:`overflowed`) and
    its pump ends the command, rather than the bridge holding all a box writes.
    """

    def __init__(self, cap: int = BACKLOG_CAP) -> None:
        self.cap = cap
        self.overflowed = False
        self._held = 0
        self._lock = threading.Lock()
        self._q: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def put(self, text: str | None) -> bool:
        """Queue ``text`` (``None``: the stream ended); ``False`` once over the cap (stop reading)."""
        if text is not None:
            with self._lock:
                if self.overflowed:
                    return False
                self._held += len(text)
                self.overflowed = self._held > self.cap
            if self.overflowed:
                self._q.put(None)  # what is queued is still written; then the pump sees the cut
                return False
        self._q.put(text)
        return True

    def get(self) -> str | None:
        text = self._q.get()
        if text is not None:
            with self._lock:
                self._held -= len(text)
        return text


class VmBridge:
    """Accepts attach connections for one VM box and runs each command through the SDK."""

    def __init__(self, box: Any, loop: asyncio.AbstractEventLoop, sock_path: Path, guest_python: str) -> None:
        self._box = box
        self._loop = loop
        self.sock_path = sock_path
        self._python = guest_python
        sock_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            sock_path.unlink()
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        _bind(self._srv, sock_path)
        self._srv.listen(16)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name=f"boxlite-vmbridge-{sock_path.stem}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._srv.shutdown(socket.SHUT_RDWR)
        self._srv.close()
        with contextlib.suppress(FileNotFoundError):
            self.sock_path.unlink()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="boxlite-vmbridge-conn").start()

    def _call(self, factory: Callable[[], Awaitable[T]], timeout: float = CALL_TIMEOUT) -> T:
        """Run one SDK call on the loop from a connection thread, bounded."""

        async def runner() -> T:
            return await factory()

        fut = asyncio.run_coroutine_threadsafe(runner(), self._loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"a boxlite call did not finish within {timeout:.0f}s") from None

    def _serve(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            if peer(conn)[1] != os.geteuid():
                # Whoever else reached the socket (a umask that left it open, a directory made
                # by hand) gets no byte and runs nothing in the box: closed before it is read.
                return
            data, got, _flags, _addr = socket.recv_fds(conn, 1 << 16, 8)
            fds = list(got)
            while not data.endswith(b"\n"):
                if len(data) > REQUEST_CAP:
                    raise BridgeStreamError(f"an attach request longer than {REQUEST_CAP} bytes")
                more = conn.recv(1 << 16)
                if not more:
                    return
                data += more
            req = json.loads(data.decode())
            if req.get("op") == "ping":
                conn.sendall(b'{"pong": 0}\n')
                return
            if len(fds) != 3:
                conn.sendall(json.dumps({"error": "exec needs 3 descriptors", "errno": 22}).encode() + b"\n")
                return
            code = _Connection(self, req, fds, conn).run()
            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
        except BoxGoneError:
            pass  # hanging up without an exit message is how a box's end looks to the client
        except Exception as exc:  # noqa: BLE001 - reported to the client, which fails the caller
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"error": f"vm bridge: {exc}", "errno": 0}).encode() + b"\n")
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            with contextlib.suppress(OSError):
                conn.close()


class _Connection:
    """One attached command: its SDK execution and the threads that pump its stdio."""

    def __init__(self, bridge: VmBridge, req: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
        self.bridge = bridge
        self.req = req
        self.fds = fds
        self.conn = conn
        self.done = threading.Event()
        self.error: str | None = None
        self.decoder = FrameDecoder()

    def run(self) -> int:
        b = self.bridge
        argv = [b._python, "-I", "-S", "-c", FRAMING_SHIM, *self.req["argv"]]
        env = list((self.req.get("env") or {}).items()) or None
        cwd = self.req.get("cwd") or WORKDIR

        async def start() -> tuple[Any, Any, Any, Any]:
            ex = await b._box.exec(argv[0], argv[1:], env, False, None, None, cwd)
            return ex, ex.stdin(), ex.stdout(), ex.stderr()

        self.execution, stdin, stdout, stderr = b._call(start)
        out_q, err_q = Backlog(), Backlog()
        drains = [
            asyncio.run_coroutine_threadsafe(_drain(stdout, out_q), b._loop),
            asyncio.run_coroutine_threadsafe(_drain(stderr, err_q), b._loop),
        ]
        threads = {
            "in": threading.Thread(target=self._pump_in, args=(stdin,), daemon=True),
            "out": threading.Thread(target=self._pump_out, args=(out_q,), daemon=True),
            "err": threading.Thread(target=self._pump_err, args=(err_q,), daemon=True),
            "client": threading.Thread(target=self._watch_client, daemon=True),
        }
        for t in threads.values():
            t.start()
        try:
            threads["out"].join()
            if self.error is None:
                result = b._call(lambda: self.execution.wait(), CALL_TIMEOUT)
            else:
                self._kill()
                result = None
            threads["err"].join(STDERR_GRACE)
        finally:
            self.done.set()
            for d in drains:
                d.cancel()
        if self.error is not None:
            raise BridgeStreamError(self.error)
        if self.decoder.exit_code is not None:
            return self.decoder.exit_code
        code = int(result.exit_code)
        if code == -1 and not getattr(result, "error_message", None) and self.bridge._closed:
            raise BoxGoneError  # destroyed under the command: the client sees the box go, silently
        if code == -1 and not getattr(result, "error_message", None):
            # No trailer and -1: the SDK's value for a lost channel (the shim itself was not SIGHUPed:
            # it forwards that signal).
            raise BridgeStreamError("the exec channel to the box was lost before the command finished")
        return code

    def _kill(self) -> None:
        with contextlib.suppress(Exception):
            self.bridge._call(lambda: self.execution.signal(int(signal.SIGUSR1)), 5)
        with contextlib.suppress(Exception):
            self.bridge._call(lambda: asyncio.wait_for(self.execution.wait(), 2), 3)
            return
        with contextlib.suppress(Exception):
            self.bridge._call(lambda: self.execution.kill(), 5)

    def _pump_in(self, stdin: Any) -> None:
        fd = self.fds[0]
        try:
            while not self.done.is_set():
                ready, _, _ = select.select([fd], [], [], 0.2)
                if not ready:
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                self.bridge._call(lambda c=chunk: stdin.send_input(c))  # type: ignore[misc]
        except (OSError, ValueError, TimeoutError):
            pass
        finally:
            with contextlib.suppress(Exception):
                self.bridge._call(lambda: stdin.close(), 5)

    def _pump_out(self, q: Backlog) -> None:
        writable = True
        while (text := q.get()) is not None:
            if self.error is not None:
                continue
            try:
                payload = self.decoder.feed(text)
            except BridgeStreamError as exc:
                self.error = str(exc)
                _write_all(self.fds[2], f"boxlite vm bridge: {exc}\n".encode(), quiet=True)
                self._kill()
                continue
            for data in payload:
                if writable and not _write_all(self.fds[1], data, quiet=True):
                    writable = False  # the client is gone; keep draining so the command can finish
        if q.overflowed and self.error is None:
            self.error = f"the command's output ran more than {q.cap} bytes ahead of its client"
            _write_all(self.fds[2], f"boxlite vm bridge: {self.error}\n".encode(), quiet=True)
            self._kill()

    def _pump_err(self, q: Backlog) -> None:
        while (text := q.get()) is not None:
            if self.bridge._closed and text.startswith(_SDK_STREAM_ERRORS):
                continue  # the box is being destroyed: its channels ending is expected, not news
            _write_all(self.fds[2], text.encode("utf-8", "replace"), quiet=True)
        if q.overflowed:  # diagnostics only: the rest is dropped, saying so
            note = f"\nboxlite vm bridge: stderr ran more than {q.cap} bytes ahead; cut\n"
            _write_all(self.fds[2], note.encode(), quiet=True)

    def _watch_client(self) -> None:
        # A signal message is relayed to the command's group (via the shim); hanging up kills it.
        buf = b""
        while not self.done.is_set():
            try:
                chunk = self.conn.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                if not self.done.is_set():
                    self._kill()
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                with contextlib.suppress(Exception):
                    sig = int(json.loads(line)["signal"])
                    self.bridge._call(lambda s=sig: self.execution.signal(s), 5)  # type: ignore[misc]


def _bind(sock: socket.socket, path: Path) -> None:
    """Bind to ``path``, through a descriptor of its directory when it is longer than ``sun_path`` allows."""
    if len(str(path).encode()) <= 100:
        sock.bind(str(path))
        return
    dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sock.bind(f"/proc/self/fd/{dirfd}/{path.name}")
    finally:
        os.close(dirfd)


async def _drain(stream: Any, q: Backlog) -> None:
    try:
        async for text in stream:
            if not q.put(text):
                return  # over the backlog's cap: the pump ends the command
    finally:
        q.put(None)


def _write_all(fd: int, data: bytes, *, quiet: bool = False) -> bool:
    view = memoryview(data)
    try:
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except OSError:
        if not quiet:
            raise
        return False
    return True
