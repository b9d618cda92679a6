"""Host-side stdio bridge for VM boxes: the VM's counterpart of the namespace agent.

It serves the same Unix-socket protocol as :mod:`pytest_boxlite.guest.agent`
(one connection = one command, stdio passed as file descriptors, ``exit``
and ``signal`` messages), so :mod:`pytest_boxlite.guest.attach` (and so
execnet gateways and xdist workers) reach a VM exactly as they reach a
namespace box.  It lives in the process that owns the VM, because BoxLite
allows one runtime per home per process.

The VM's exec stdout arrives as lossily decoded text, so the guest command is
wrapped in :data:`FRAMING_SHIM`, which base64-encodes stdout one line per
chunk; this side decodes it back to the exact bytes.  Stdin is binary-safe
as it is; stderr (diagnostics) is passed through as text.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

FRAMING_SHIM = """
import base64, os, signal, subprocess, sys
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE)
fd = p.stdout.fileno()
while True:
    chunk = os.read(fd, 48 * 1024)
    if not chunk:
        break
    sys.stdout.write(base64.b64encode(chunk).decode("ascii") + "\\n")
    sys.stdout.flush()
code = p.wait()
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


class VmBridge:
    """Accepts attach connections for one VM box and runs each command through the SDK."""

    def __init__(self, box: Any, loop: asyncio.AbstractEventLoop, sock_path: Path, guest_python: str) -> None:
        self._box = box
        self._loop = loop
        self.sock_path = sock_path
        self._python = guest_python
        sock_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            sock_path.unlink()
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(str(sock_path))
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
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            data, got, _flags, _addr = socket.recv_fds(conn, 1 << 16, 8)
            fds = list(got)
            while not data.endswith(b"\n"):
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
            fut = asyncio.run_coroutine_threadsafe(self._run(req, fds, conn), self._loop)
            code = fut.result()
            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
        except Exception as exc:  # noqa: BLE001 - reported to the client, which fails the caller
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"error": f"vm bridge: {exc}", "errno": 0}).encode() + b"\n")
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            with contextlib.suppress(OSError):
                conn.close()

    async def _run(self, req: dict[str, Any], fds: list[int], conn: socket.socket) -> int:
        argv = [self._python, "-I", "-S", "-c", FRAMING_SHIM, *req["argv"]]
        env = list((req.get("env") or {}).items()) or None
        execution = await self._box.exec(argv[0], argv[1:], env, False, None, None, req.get("cwd"))
        loop = asyncio.get_running_loop()
        stdin = execution.stdin()

        async def pump_in() -> None:
            while True:
                chunk = await loop.run_in_executor(None, os.read, fds[0], 65536)
                if not chunk:
                    break
                await stdin.send_input(chunk)
            await stdin.close()

        async def pump_out() -> None:
            pending = ""
            async for text in execution.stdout():
                pending += text
                while "\n" in pending:
                    line, pending = pending.split("\n", 1)
                    if line:
                        await loop.run_in_executor(None, _write_all, fds[1], base64.b64decode(line))

        async def pump_err() -> None:
            async for text in execution.stderr():
                await loop.run_in_executor(None, _write_all, fds[2], text.encode("utf-8", "replace"))

        async def watch_client() -> None:
            # A signal message is relayed; the client hanging up kills the command.
            buf = b""
            while True:
                chunk = await loop.run_in_executor(None, conn.recv, 4096)
                if not chunk:
                    with contextlib.suppress(Exception):
                        await execution.kill()
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    with contextlib.suppress(Exception):
                        await execution.signal(int(json.loads(line)["signal"]))

        watcher = asyncio.ensure_future(watch_client())
        feeder = asyncio.ensure_future(pump_in())
        try:
            await asyncio.gather(pump_out(), pump_err())
            result = await execution.wait()
            return int(result.exit_code)
        finally:
            feeder.cancel()
            watcher.cancel()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
