"""A bubblewrap-backed double of the boxlite 0.10.8 SDK surface that pytest-boxlite uses.  TESTS ONLY.

This is a test double, never shipped and never selectable by users: the
tests hand it to :class:`pytest_boxlite.runtimes.vm.VmRuntime` (``sdk=``) or
put it in ``sys.modules["boxlite"]`` of a pytest sub-run
(:mod:`sdk_double.activate`), so that the VM code path (exec, stdio bridge,
file operations, bookkeeping) runs here, where no micro-VM can boot.

A box is a real sandbox (bubblewrap: own user, pid, ipc, uts and optionally
network namespaces) whose root is the host's system directories
copy-on-write (the "image"), with the base interpreter at its host path as
the image's ``python3``; nothing else of the host is visible except the
volumes, mounted as asked (read-only really read-only).  Commands really run
in it.  What it reproduces of the real SDK, and where each rule comes from,
is section 4 of ``reviews/vm-sdk-review.md``:

1. async only: every call but the constructors, ``Box.id``/``.name`` and the
   ``Execution.std*()`` takers returns an awaitable made at call time, which
   needs a running loop ("no running event loop" otherwise);
2. one runtime per home, by ``flock(home/.lock)``, in this process too, held
   while the runtime or any :class:`Box` handle lives;
3. stdout/stderr as ``str`` chunks (<= 64 KiB) decoded as lossy UTF-8, a split
   code point carried across chunks;
4. stdin a pipe held open until ``ExecStdin.close()`` or until the Execution
   and its stdin are garbage (never /dev/null);
5. ``send_input`` one message per call, capped at 4 MiB like tonic's default:
   a larger one fails the stdin stream (the process sees EOF) and is lost;
6. a 1 MiB guest-side ring per stream that drains the process eagerly; when
   the (throttled) transport falls behind by more than that, the oldest bytes are dropped
   and ``"[boxlite] stdout output dropped N bytes\\r\\n"`` is injected.
   :func:`set_throttle` (or ``BOXLITE_DOUBLE_THROTTLE_BPS``) slows the
   transport so a test can force it; the host->Python side is unbounded;
7. a lost channel (box stopped or removed under a running command) gives
   ``"Attach stream error: ..."`` on stderr and ``wait()`` -> ``exit_code=-1``;
8. ``-signum`` for a signalled process;
9. ``kill()``/``signal()`` reach the leader only;
10. ``cwd=None`` runs in ``/``; env merged over image and box env; ``user``
    passed to the spawn (a single-uid user namespace refuses other users);
    exec on a ``configured`` box starts it;
11. records: 12-character ids, ``configured``/``running``/``stopped``, unique
    names, ``NotFoundError("not found: X")``, ``InvalidStateError`` for a
    non-forced remove of a running box, ``auto_delete`` an int (0 keeps);
12. volumes: host path checked at start (``ConfigError``), read-only is EROFS;
13. network disabled: ``--unshare-net`` (no interface but a down ``lo``);
14. the home layout, ``boxes/<id>/logs/console.log``, ``boxes/<id>/shim.stderr``
    and ``logs/boxlite.log.<date>``;
15. a per-home image index: the first start of an image in a home counts one
    registry contact (``db/registry_contacts``), shared blobs or not;
16. ``rootfs_path`` (a ``str``; a non-empty one wins over ``image``): a local OCI image layout,
    checked at start with the real SDK's messages, its first manifest booted on, no registry
    contact (:mod:`sdk_double._local_image`).

The error classes are the real wheel's own (:mod:`boxlite.errors` is pure
Python), so names, codes and bases are exact.  What the double cannot know
(spawn-failure shape, whether ``send_input`` raises on an oversized message)
is marked "unverified" where it is decided.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import datetime
import fcntl
import itertools
import json
import os
import queue
import secrets
import signal as _signal
import socket
import string
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from boxlite import errors
from boxlite.errors import (
    AlreadyExistsError,
    BoxliteError,
    ConfigError,
    ExecutionError,
    InternalError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    StoppedError,
    UnsupportedError,
)

from sdk_double import _local_image

__all__ = [
    "AccessToken",
    "AlreadyExistsError",
    "ApiKeyCredential",
    "Box",
    "BoxInfo",
    "BoxOptions",
    "BoxStateInfo",
    "Boxlite",
    "BoxliteError",
    "BoxliteRestOptions",
    "ConfigError",
    "CopyOptions",
    "ExecStderr",
    "ExecStdin",
    "ExecStdout",
    "Execution",
    "ExecutionError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidStateError",
    "NetworkError",
    "NetworkSpec",
    "NotFoundError",
    "Options",
    "OutboundNetworkSpec",
    "StoppedError",
    "UnsupportedError",
    "errors",
    "set_throttle",
]

IS_DOUBLE = True
RING_BYTES = 1024 * 1024
CHUNK = 64 * 1024
#: tonic's default max decoding message size; the guest sets no other.
MAX_MESSAGE = 4 * 1024 * 1024
#: protobuf framing of one ExecStdin message around its data (field tags, lengths, execution id).
_MESSAGE_OVERHEAD = 32
_ID_ALPHABET = string.ascii_letters + string.digits
_GUEST_SOURCE = (Path(__file__).with_name("_guest.py")).read_text()
_CTL = "/run/boxlite-double"
_IMAGE_TOPS = {"bin", "boot", "etc", "lib", "lib32", "lib64", "libx32", "opt", "sbin", "usr", "var", "srv"}
_throttle_bps = float(os.environ.get("BOXLITE_DOUBLE_THROTTLE_BPS") or 0)
#: Whether the container runtime creates a missing ``working_dir`` is unverified (review #13): by
#: default the double does not, so the plugin must not rely on it; set this to model the other answer.
CREATE_WORKING_DIR = os.environ.get("BOXLITE_DOUBLE_CREATE_WORKING_DIR") == "1"
#: Whether BoxLite's guest kernel (libkrun's) allows user namespaces is unverified: by default the
#: double's guest does (as this host's kernel does); set this to model a guest kernel that refuses
#: them (bwrap --disable-userns: no process in the box can make a user namespace).
NO_USER_NAMESPACES = os.environ.get("BOXLITE_DOUBLE_NO_USERNS") == "1"


def set_throttle(bytes_per_second: float | None) -> None:
    """Slow the guest->host transport of every stream to ``bytes_per_second`` (None: full speed)."""
    global _throttle_bps
    _throttle_bps = float(bytes_per_second or 0)


def _awaitable(coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
    """What a pyo3 future is: made at call time, running at once, needing the caller's running loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        coro.close()
        raise RuntimeError("no running event loop") from None
    return loop.create_task(coro)


def _in_thread(fn: Any, *args: Any) -> asyncio.Future[Any]:
    """Run blocking ``fn`` on a thread of its own (never the loop's shared executor: see #22)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        try:
            res = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, False, exc)
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, True, res)

    threading.Thread(target=run, daemon=True, name="sdk-double-call").start()
    return fut


def _log(home: Path, msg: str) -> None:
    day = datetime.date.today().isoformat()
    with contextlib.suppress(OSError), open(home / "logs" / f"boxlite.log.{day}", "a") as fh:
        fh.write(f"{time.strftime('%H:%M:%S')} {msg}\n")


# -- options -------------------------------------------------------------------------------------
class Options:
    """``boxlite.Options``: where the runtime keeps its state."""

    def __init__(self, home_dir=None, image_registries=...):  # type: ignore[no-untyped-def]
        self.home_dir = home_dir
        self.image_registries = [] if image_registries is ... else list(image_registries)


class OutboundNetworkSpec:
    """``boxlite.OutboundNetworkSpec``."""

    def __init__(self, mode=..., allow_net=...):  # type: ignore[no-untyped-def]
        self.mode = "enabled" if mode is ... else mode
        self.allow_net = [] if allow_net is ... else list(allow_net)


class NetworkSpec:
    """``boxlite.NetworkSpec``; a bad mode is refused at ``create``, as the real one does."""

    def __init__(self, outbound=None, inbound=None, mode=None, allow_net=None):  # type: ignore[no-untyped-def]
        self.outbound = outbound
        self.inbound = inbound
        self.mode = mode
        self.allow_net = allow_net


def _check_int(value: Any, bits: int, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, float) or not isinstance(value, int):
        raise TypeError(f"'{type(value).__name__}' object cannot be interpreted as an integer ({what})")
    if value < 0 or value >= 1 << bits:
        raise OverflowError(f"out of range integral type conversion attempted ({what})")
    return int(value)


class BoxOptions:
    """``boxlite.BoxOptions`` (the members the plugin uses are checked as the real one checks them)."""

    def __init__(  # type: ignore[no-untyped-def]
        self,
        image=None,
        rootfs_path=None,
        cpus=None,
        memory_mib=None,
        disk_size_gb=None,
        working_dir=None,
        env=...,
        volumes=...,
        network=None,
        ports=...,
        auto_remove=None,
        auto_stop=None,
        auto_delete=None,
        auto_resume=None,
        detach=None,
        entrypoint=None,
        cmd=None,
        user=None,
        tty=None,
        advanced=None,
        secrets=...,
    ):
        # Both are Option<String> in the binding: anything but a str (a Path too) is refused.
        for what, value in (("image", image), ("rootfs_path", rootfs_path)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"argument '{what}': '{type(value).__name__}' object cannot be cast as 'str'")
        self.image = image
        self.rootfs_path = rootfs_path
        self.cpus = _check_int(cpus, 8, "cpus")
        self.memory_mib = _check_int(memory_mib, 32, "memory_mib")
        self.disk_size_gb = disk_size_gb
        self.working_dir = working_dir
        self.env = self._env([] if env is ... else env)
        self.volumes = self._volumes([] if volumes is ... else volumes)
        self.network = network
        self.ports = [] if ports is ... else ports
        self.auto_remove = auto_remove
        self.auto_stop = auto_stop
        self.auto_delete = _check_int(auto_delete, 32, "auto_delete")
        self.auto_resume = auto_resume
        self.detach = detach
        self.entrypoint = entrypoint
        self.cmd = cmd
        self.user = user
        self.tty = tty
        self.advanced = advanced
        self.secrets = [] if secrets is ... else secrets

    @staticmethod
    def _env(env: Any) -> list[tuple[str, str]]:
        if isinstance(env, (dict, str, bytes)):
            raise TypeError(f"'{type(env).__name__}' object cannot be converted to 'Sequence'")
        out = []
        for item in env:
            if not isinstance(item, tuple) or len(item) != 2 or not all(isinstance(x, str) for x in item):
                raise TypeError(f"'{type(item).__name__}' object cannot be converted to 'PyTuple'")
            out.append((item[0], item[1]))
        return out

    @staticmethod
    def _volumes(volumes: Any) -> list[tuple[str, str, bool]]:
        out = []
        for v in volumes:
            if isinstance(v, tuple) and len(v) in (2, 3):
                out.append((str(v[0]), str(v[1]), bool(v[2]) if len(v) == 3 else False))
            elif isinstance(v, dict) and "host_path" in v and "guest_path" in v:
                out.append((str(v["host_path"]), str(v["guest_path"]), bool(v.get("read_only", False))))
            else:
                raise RuntimeError(f"Invalid volume specification: {v!r}")
        return out


# -- records -------------------------------------------------------------------------------------
class _Outbound:
    def __init__(self, mode: str) -> None:
        self.mode = mode


class NetworkInfo:
    """``BoxInfo.network``: ``.outbound.mode``, ``.inbound.mode``."""

    def __init__(self, mode: str) -> None:
        self.outbound = _Outbound(mode)
        self.inbound = _Outbound("disabled")


class BoxStateInfo:
    """``boxlite.BoxStateInfo``."""

    def __init__(self, status: str, pid: int | None, exit_code: int | None = None) -> None:
        self.status = status
        self.running = status == "running"
        self.pid = pid
        self.exit_code = exit_code


class BoxInfo:
    """``boxlite.BoxInfo`` (the members the plugin and its tests read)."""

    def __init__(self, rec: dict[str, Any]) -> None:
        self.id = rec["id"]
        self.name = rec["name"]
        self.image = rec["image"]
        self.cpus = rec["cpus"]
        self.memory_mib = rec["memory_mib"]
        self.auto_delete = rec["auto_delete"]
        self.auto_stop = None
        self.auto_resume = None
        self.created_at = rec["created"]
        self.started_at = rec.get("started")
        self.last_activity_at = None
        self.health_status = None
        self.network = NetworkInfo(rec["network"])
        self.state = BoxStateInfo(rec["status"], rec.get("pid"))


def _pid_alive(pid: int | None, start: str | None) -> bool:
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] not in ("Z", "X") and fields[19] == start


def _ignore_work(directory: str, names: list[str]) -> list[str]:
    return ["work"] if os.path.basename(directory) == "disk" else []


def _kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every descendant (children first found, then killed top-down)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    todo = [root]
    while todo:
        pid = todo.pop()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, _signal.SIGKILL)
        todo += children.get(pid, [])


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class _HomeLock:
    """``flock(home/.lock)``: released only when the runtime and every Box handle are garbage."""

    def __init__(self, home: Path) -> None:
        self.fd = os.open(home / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            self.fd = -1
            raise InternalError(
                f"Another BoxliteRuntime is already using directory {home}; only one runtime may use a home at a time"
            ) from None

    def __del__(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


# -- streams -------------------------------------------------------------------------------------
class _Ring:
    """Guest side of one output stream: drains the process eagerly into a bounded ring, no backpressure."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.data = bytearray()
        self.gap = 0
        self.eof = False

    def fill(self, fd: int) -> None:
        try:
            while True:
                try:
                    chunk = os.read(fd, CHUNK)
                except OSError:
                    chunk = b""
                with self.cond:
                    if not chunk:
                        self.eof = True
                        self.cond.notify_all()
                        return
                    self.data += chunk
                    over = len(self.data) - RING_BYTES
                    # Unthrottled, the transport stands for vsock/gRPC, which outruns any process;
                    # here it shares a GIL with the test, so the ring only overflows when throttled.
                    if over > 0 and _throttle_bps:
                        del self.data[:over]
                        self.gap += over
                    self.cond.notify_all()
        finally:
            os.close(fd)

    def take(self) -> tuple[int, bytes] | None:
        with self.cond:
            while not self.data and not self.gap and not self.eof:
                self.cond.wait()
            if not self.data and not self.gap:
                return None
            gap, self.gap = self.gap, 0
            out = bytes(self.data[:CHUNK])
            del self.data[:CHUNK]
            return gap, out


class _HostStream:
    """Host side: the transport moves ring contents into an unbounded queue of ``str`` chunks."""

    def __init__(self, name: str, fd: int, loop: asyncio.AbstractEventLoop, outcome: _Outcome | None = None) -> None:
        self.name = name
        self.loop = loop
        self.outcome = outcome
        self.q: asyncio.Queue[str | None] = asyncio.Queue()
        self.ring = _Ring()
        self.taken = False
        threading.Thread(target=self.ring.fill, args=(fd,), daemon=True, name=f"sdk-double-{name}-ring").start()
        threading.Thread(target=self._transport, daemon=True, name=f"sdk-double-{name}-transport").start()

    def put(self, item: str | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody reads any more
            self.loop.call_soon_threadsafe(self.q.put_nowait, item)

    def _transport(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        while (got := self.ring.take()) is not None:
            gap, data = got
            if gap:
                tail = decoder.decode(b"", final=True)
                decoder.reset()
                self.put(tail + f"[boxlite] {self.name} output dropped {gap} bytes\r\n")
            text = decoder.decode(data)
            if text:
                self.put(text)
            if _throttle_bps:
                time.sleep(len(data) / _throttle_bps)
        tail = decoder.decode(b"", final=True)
        if tail:
            self.put(tail)
        if self.outcome is not None and self.outcome.settled.wait(2.0) and self.outcome.lost:
            # The host SDK's own line, in the stream, before it ends.
            self.put("Attach stream error: the exec stream ended without an exit status\n")
        self.put(None)


class _Outcome:
    """How an exec ended, as its streams learn it: normally, or with the channel lost."""

    def __init__(self) -> None:
        self.settled = threading.Event()
        self.lost = False


class _StreamIter:
    def __init__(self, stream: _HostStream) -> None:
        self._s = stream

    def __aiter__(self, /):  # type: ignore[no-untyped-def]
        return self

    def __anext__(self, /):  # type: ignore[no-untyped-def]
        return _awaitable(self._next())

    async def _next(self) -> str:
        item = await self._s.q.get()
        if item is None:
            self._s.q.put_nowait(None)
            raise StopAsyncIteration
        return item


class ExecStdout(_StreamIter):
    """``boxlite.ExecStdout``: ``async for chunk: str``."""


class ExecStderr(_StreamIter):
    """``boxlite.ExecStderr``: ``async for chunk: str``."""


class _StdinPipe:
    """The write end of the process's stdin, fed by a thread of its own; closed when garbage."""

    def __init__(self, fd: int, log: Path) -> None:
        self.q: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.closed = False
        self.log = log
        threading.Thread(target=self._write, args=(fd, self.q), daemon=True, name="sdk-double-stdin").start()

    @staticmethod
    def _write(fd: int, q: queue.SimpleQueue[bytes | None]) -> None:
        try:
            while (data := q.get()) is not None:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
        except OSError:
            pass
        finally:
            os.close(fd)

    def send(self, data: bytes) -> None:
        if self.closed:
            return
        if len(data) + _MESSAGE_OVERHEAD > MAX_MESSAGE:
            # The guest's tonic server refuses the message and the stdin stream fails: the process
            # sees EOF and the data is lost.  Whether the host's send_input raises is unverified.
            with contextlib.suppress(OSError), open(self.log, "a") as fh:
                fh.write(f"stdin stream error: decoded message length too large: found {len(data)} bytes\n")
            self.close()
            return
        self.q.put(bytes(data))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.q.put(None)

    def __del__(self) -> None:
        self.close()


class ExecStdin:
    """``boxlite.ExecStdin``: ``send_input(bytes)``, ``close()``."""

    def __init__(self, pipe: _StdinPipe) -> None:
        self._pipe = pipe

    def send_input(self, /, data):  # type: ignore[no-untyped-def]
        async def send() -> None:
            self._pipe.send(bytes(data))

        return _awaitable(send())

    def close(self, /):  # type: ignore[no-untyped-def]
        async def close() -> None:
            self._pipe.close()

        return _awaitable(close())

    def is_closed(self, /):  # type: ignore[no-untyped-def]
        async def closed() -> bool:
            return self._pipe.closed

        return _awaitable(closed())


class ExecResult:
    """What ``Execution.wait()`` gives: ``exit_code`` (negative: signal; -1 also a lost channel), ``error_message``."""

    def __init__(self, exit_code: int, error_message: str | None = None) -> None:
        self.exit_code = exit_code
        self.error_message = error_message


class Execution:
    """``boxlite.Execution``: one command in a box."""

    def __init__(
        self, box: _BoxState, conn: socket.socket, fds: tuple[int, int, int], rest: bytes, loop: Any, eid: str
    ) -> None:
        self._id = eid
        self._box = box
        self._conn = conn
        self._stdin_pipe: _StdinPipe | None = _StdinPipe(fds[0], box.dir / "shim.stderr")
        outcome = _Outcome()
        self._out: _HostStream | None = _HostStream("stdout", fds[1], loop)
        self._err: _HostStream | None = _HostStream("stderr", fds[2], loop, outcome)
        self._done: asyncio.Future[ExecResult] = loop.create_future()
        threading.Thread(target=self._watch, args=(loop, conn, rest, self._done, outcome), daemon=True).start()

    @staticmethod
    def _watch(loop: Any, conn: socket.socket, buf: bytes, done: asyncio.Future[ExecResult], outcome: _Outcome) -> None:
        code: int | None = None
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line.decode())
                if "exit" in msg:
                    code = int(msg["exit"])
            if code is not None:
                break
            try:
                chunk = conn.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
        conn.close()
        # The box going away under the command gives -1 (and the synthetic stderr line).
        outcome.lost = code is None
        outcome.settled.set()
        result = ExecResult(-1 if code is None else code, None)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(result))

    def id(self, /):  # type: ignore[no-untyped-def]
        return self._id

    def stdin(self, /):  # type: ignore[no-untyped-def]
        if self._stdin_pipe is None:
            raise RuntimeError("stdin stream not available")
        pipe, self._stdin_pipe = self._stdin_pipe, None
        return ExecStdin(pipe)

    def stdout(self, /):  # type: ignore[no-untyped-def]
        if self._out is None:
            raise RuntimeError("stdout stream not available")
        s, self._out = self._out, None
        return ExecStdout(s)

    def stderr(self, /):  # type: ignore[no-untyped-def]
        if self._err is None:
            raise RuntimeError("stderr stream not available")
        s, self._err = self._err, None
        return ExecStderr(s)

    def wait(self, /):  # type: ignore[no-untyped-def]
        async def wait() -> ExecResult:
            return await asyncio.shield(self._done)

        return _awaitable(wait())

    def signal(self, /, signal):  # type: ignore[no-untyped-def]
        async def send() -> None:
            if self._done.done():
                return
            with contextlib.suppress(OSError):
                self._conn.sendall((json.dumps({"signal": int(signal)}) + "\n").encode())

        return _awaitable(send())

    def kill(self, /):  # type: ignore[no-untyped-def]
        return self.signal(int(_signal.SIGKILL))

    def resize_tty(self, /, rows, cols):  # type: ignore[no-untyped-def]
        async def nothing() -> None:
            raise UnsupportedError("resize_tty needs a tty exec")

        return _awaitable(nothing())

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self._conn.close()


# -- boxes ---------------------------------------------------------------------------------------
class _BoxState:
    """One box's record and, while it runs, its sandbox.  Shared by every handle to it."""

    def __init__(self, rt: _RuntimeState, rec: dict[str, Any], opts: BoxOptions | None) -> None:
        self.rt = rt
        self.rec = rec
        self.opts = opts
        self.dir = rt.home / "boxes" / rec["id"]
        self.proc: subprocess.Popen[bytes] | None = None
        self.watch_w: int | None = None
        self.ns_init: int | None = None
        self.lock = threading.Lock()
        #: The local OCI image (``rootfs_path``) this box boots on, once started.
        self.local: _local_image.LocalImage | None = None

    # The blocking parts run on threads of their own (see _in_thread).
    def start_blocking(self) -> None:
        with self.lock:
            if self.rec["status"] == "running" and self.proc is not None and self.proc.poll() is None:
                return
            if self.opts is None:
                raise InvalidStateError(f"box {self.rec['id']} was created by another runtime and cannot be started")
            for host, _guest, _ro in self.opts.volumes:
                if not os.path.exists(host):
                    raise ConfigError(f"Volume host path does not exist: {host}")
            if self.opts.rootfs_path:
                # Read in place: no registry contact (the real SDK's load_from_local).
                self.local = _local_image.load(self.opts.rootfs_path, self.rt.home / "images" / "extracted")
            else:
                self.rt.pull(self.rec["image"])
            self._launch()

    def _launch(self) -> None:
        from pytest_boxlite.runtimes.namespace import find_bwrap, mount_plan

        bwrap, why = find_bwrap()
        if bwrap is None:
            raise InternalError(f"sdk double: {why}")
        ctl = self.dir / "ctl"
        ctl.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (ctl / "agent.sock").unlink()
        assert self.opts is not None
        entries, _ = mount_plan(bwrap)
        argv = [bwrap, "--unshare-user", "--uid", "0", "--gid", "0", "--unshare-pid", "--unshare-ipc"]
        argv += ["--unshare-uts", "--unshare-cgroup-try", "--new-session", "--hostname", self.rec["id"]]
        if os.geteuid() != 0:
            # bwrap keeps a root caller's capabilities and drops everyone else's; a VM guest's root
            # holds all of them in its own kernel (sethostname works there), so ask for them back
            # (they are the box's user namespace's, worth nothing on the host).
            argv += ["--cap-add", "ALL"]
        for entry in entries if self.local is None else []:
            kind, path = entry[0], entry[-1]
            if path.strip("/") not in _IMAGE_TOPS:
                continue
            if kind == "symlink":
                argv += ["--symlink", entry[1], path]
            elif kind in ("ro", "tree"):  # a directory holding other mounts: a VM's disk has none
                argv += ["--ro-bind", path, path]
            else:
                argv += self._disk_layer(path)
        kit: list[str] = [_image_python()]
        if self.local is not None:
            argv += _local_image.mounts(self.local, self._disk_layer)
            binds, kit = _local_image.agent_kit(_image_python())
            argv += binds
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run"]
        # The box's disk: what the guest writes outside /tmp and /run persists across stop and start
        # (and is what clone_box and export copy), as a VM's disk image does.
        for d in ("root", "home", "workspace"):
            (self.dir / "disk" / "dirs" / d).mkdir(parents=True, exist_ok=True)
        argv += ["--bind", str(self.dir / "disk" / "dirs" / "root"), "/root"]
        argv += ["--bind", str(self.dir / "disk" / "dirs" / "home"), "/home"]
        if CREATE_WORKING_DIR and self.opts.working_dir:
            argv += ["--dir", self.opts.working_dir]
        # The image's interpreter: the host's base Python, at its own path, copy-on-write.
        argv += self._disk_layer(sys.base_prefix)
        for host, guest, ro in self.opts.volumes:
            argv += ["--ro-bind" if ro else "--bind", host, guest]
        argv += ["--bind", str(ctl), _CTL]
        if self.rt.network_mode(self.opts) == "disabled":
            argv.append("--unshare-net")
        if NO_USER_NAMESPACES:
            argv.append("--disable-userns")
        watch_r, watch_w = os.pipe()
        agent = [*kit, "-I", "-S", "-c", _GUEST_SOURCE, f"{_CTL}/agent.sock", str(watch_r)]
        shim_err = open(self.dir / "shim.stderr", "ab")  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(
                [*argv, *agent],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=shim_err,
                start_new_session=True,
                pass_fds=(watch_r,),
            )
        except BaseException:
            os.close(watch_w)
            raise
        finally:
            shim_err.close()
            os.close(watch_r)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        proc.stdout.close()
        if not line.startswith(b"ready"):
            os.close(watch_w)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, _signal.SIGKILL)
            proc.wait()
            tail = (self.dir / "shim.stderr").read_text(errors="replace")[-2000:]
            raise InternalError(f"box {self.rec['id']} failed to start: {tail.strip() or 'no output'}")
        self.proc = proc
        self.watch_w = watch_w
        # bwrap's init in the box's pid namespace: killing it ends every process of the box at once.
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        self.ns_init = int(kids[0]) if kids else None
        with open(self.dir / "logs" / "console.log", "a") as fh:
            fh.write(f"[double] box {self.rec['id']} booted, agent pid {proc.pid}\n")
        self.rt.update(self.rec, status="running", pid=proc.pid, pid_start=_start_time(proc.pid), started=time.time())

    def _disk_layer(self, path: str, dest: str | None = None) -> list[str]:
        layer = (dest or path).strip("/").replace("/", "%")
        upper = self.dir / "disk" / "upper" / layer
        work = self.dir / "disk" / "work" / layer
        upper.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        return ["--overlay-src", path, "--overlay", str(upper), str(work), dest or path]

    def stop_blocking(self) -> None:
        with self.lock:
            proc, self.proc = self.proc, None
            if self.watch_w is not None:
                # The agent exits on its watchdog's EOF; bwrap's init follows and the kernel ends the
                # whole pid namespace (the shim's watchdog pipe, in BoxLite's terms).
                os.close(self.watch_w)
                self.watch_w = None
            pid = proc.pid if proc is not None else self.rec.get("pid")
            if self.ns_init is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(self.ns_init, _signal.SIGKILL)
                self.ns_init = None
            if proc is not None:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    _kill_tree(proc.pid)
                    proc.wait()
            elif pid and _pid_alive(pid, self.rec.get("pid_start")):
                _kill_tree(pid)
            if self.rec["status"] == "running":
                self.rt.update(self.rec, status="stopped", pid=None)

    def exec_blocking(self, argv: list[str], env: dict[str, str], cwd: str | None, user: str | None) -> Any:
        self.start_blocking()
        return spawn(self.dir / "ctl" / "agent.sock", str(self.rec["id"]), argv, env, cwd, user)


def spawn(agent: Path, box_id: str, argv: list[str], env: dict[str, str], cwd: str | None, user: str | None) -> Any:
    """Start ``argv`` through a running box's agent socket: (connection, host ends of stdio, rest of reply)."""
    sock = _connect(agent)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        req = {"argv": argv, "env": env, "cwd": cwd, "user": user}
        socket.send_fds(sock, [(json.dumps(req) + "\n").encode()], [in_r, out_w, err_w])
    finally:
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    buf = b""
    while b"\n" not in buf:
        chunk = sock.recv(4096)
        if not chunk:
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            sock.close()
            raise ExecutionError(f"box {box_id} stopped before the command started")
        buf += chunk
    line, rest = buf.split(b"\n", 1)
    msg = json.loads(line.decode())
    if "error" in msg:
        for fd in (in_w, out_r, err_r):
            os.close(fd)
        sock.close()
        # Unverified: how the real guest reports a failed spawn (this shape is a plausible guess).
        raise ExecutionError(f"failed to spawn {argv[0]!r}: {msg['error']}")
    # The exit message may have come with the pid message: the watcher starts from it.
    return sock, (in_w, out_r, err_r), rest


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if len(str(path).encode()) <= 100:
        sock.connect(str(path))
        return sock
    # sun_path holds ~108 bytes: reach long paths through a descriptor of the directory.
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sock.connect(f"/proc/self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)
    return sock


def _image_python() -> str:
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"):
        cand = Path(sys.base_prefix) / "bin" / name
        if cand.exists():
            return str(cand)
    return os.path.realpath(sys.executable)


def _image_env() -> list[tuple[str, str]]:
    """What an OCI image's config gives every process (python:*-slim sets PATH and LANG)."""
    path = f"{sys.base_prefix}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return [("PATH", path), ("LANG", "C.UTF-8"), ("HOME", "/root")]


class Box:
    """``boxlite.Box``: a handle; it keeps the home's lock alive, as the real one does."""

    def __init__(self, state: _BoxState) -> None:
        self._state = state
        self._lock = state.rt.lock

    @property
    def id(self) -> str:
        return str(self._state.rec["id"])

    @property
    def name(self) -> str | None:
        name: str | None = self._state.rec["name"]
        return name

    def start(self, /):  # type: ignore[no-untyped-def]
        async def start() -> None:
            self._state.rt.check_open()
            await _in_thread(self._state.start_blocking)

        return _awaitable(start())

    def stop(self, /):  # type: ignore[no-untyped-def]
        async def stop() -> None:
            await _in_thread(self._state.stop_blocking)
            self._state.rt.after_stop(self._state)

        return _awaitable(stop())

    def info(self, /):  # type: ignore[no-untyped-def]
        async def info() -> BoxInfo:
            return BoxInfo(self._state.rec)

        return _awaitable(info())

    def exec(self, /, command, args=None, env=None, tty=False, user=None, timeout_secs=None, cwd=None):  # type: ignore[no-untyped-def]
        if env is not None:
            env = BoxOptions._env(env)

        async def run() -> Execution:
            state = self._state
            if state.rec["status"] == "stopped":
                raise InvalidStateError(f"box {state.rec['id']} is stopped")
            assert state.opts is not None
            merged = dict(_image_env() if state.local is None else state.local.env)
            merged.update(state.opts.env)
            merged.update(env or [])
            argv = [str(command), *(str(a) for a in (args or []))]
            loop = asyncio.get_running_loop()
            sock, fds, rest = await _in_thread(state.exec_blocking, argv, merged, cwd, user)
            return Execution(state, sock, fds, rest, loop, secrets.token_hex(8))

        return _awaitable(run())

    def clone_box(self, /, *, options=None, name=None):  # type: ignore[no-untyped-def]
        """A copy of this box's disk as a new, stopped box (the real one quiesces a running box first)."""

        async def clone() -> Box:
            state = self._state
            state.rt.check_open()
            return Box(await _in_thread(state.rt.clone, state, name, None))

        return _awaitable(clone())

    def export(self, /, *, options=None, dest):  # type: ignore[no-untyped-def]
        """Write the box (its record and disk) to the archive ``dest``."""

        async def export() -> None:
            await _in_thread(self._state.rt.export, self._state, Path(dest))

        return _awaitable(export())


# -- runtime -------------------------------------------------------------------------------------
class _RuntimeState:
    """The runtime proper; Box handles keep a reference to its lock, not to it."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.db = home / "db" / "boxes.json"
        self.mutex = threading.RLock()
        self.shut = False
        self.boxes: dict[str, _BoxState] = {}
        self.lock = _HomeLock(home)
        self._recover()

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data: dict[str, dict[str, Any]] = json.loads(self.db.read_text())
            return data
        except (OSError, ValueError):
            return {}

    def _save(self) -> None:
        recs = {bid: b.rec for bid, b in self.boxes.items()}
        tmp = self.db.with_suffix(".tmp")
        tmp.write_text(json.dumps(recs))
        os.replace(tmp, self.db)

    def _recover(self) -> None:
        """Opening a home: boxes whose shim is gone are stopped (BoxLite's own recovery)."""
        for bid, rec in self._load().items():
            if rec["status"] == "running" and not _pid_alive(rec.get("pid"), rec.get("pid_start")):
                rec["status"] = "stopped"
            self.boxes[bid] = _BoxState(self, rec, None)
        self._save()

    def update(self, rec: dict[str, Any], **changes: Any) -> None:
        with self.mutex:
            rec.update(changes)
            if rec["id"] in self.boxes:
                self._save()

    def check_open(self) -> None:
        if self.shut:
            raise StoppedError("runtime has been shut down")

    def network_mode(self, opts: BoxOptions) -> str:
        net = opts.network
        if net is None:
            return "enabled"
        mode = getattr(net.outbound, "mode", None) if net.outbound is not None else net.mode
        return str(mode or "enabled")

    def pull(self, image: str) -> None:
        """A fresh home's index has no image: one registry contact, whatever blobs are shared."""
        index = self.home / "db" / "images.json"
        with self.mutex:
            try:
                known = set(json.loads(index.read_text()))
            except (OSError, ValueError):
                known = set()
            if image in known:
                return
            counter = self.home / "db" / "registry_contacts"
            try:
                n = int(counter.read_text())
            except (OSError, ValueError):
                n = 0
            counter.write_text(str(n + 1))
            manifest = self.home / "images" / "manifests" / (image.replace("/", "_").replace(":", "_") + ".json")
            manifest.parent.mkdir(parents=True, exist_ok=True)
            manifest.write_text(json.dumps({"image": image}))
            index.write_text(json.dumps(sorted(known | {image})))
            _log(self.home, f"pulled {image} (manifest from the registry)")

    def find(self, id_or_name: str) -> _BoxState:
        with self.mutex:
            for b in self.boxes.values():
                if b.rec["name"] == id_or_name:
                    return b
            if id_or_name in self.boxes:
                return self.boxes[id_or_name]
            hits = [b for bid, b in self.boxes.items() if bid.startswith(id_or_name)] if id_or_name else []
            if len(hits) == 1:
                return hits[0]
        raise NotFoundError(f"not found: {id_or_name}")

    def new_record(self, base: dict[str, Any], name: str | None) -> dict[str, Any]:
        with self.mutex:
            if name is not None and any(b.rec["name"] == name for b in self.boxes.values()):
                raise InvalidArgumentError(f"box with name '{name}' already exists")
            bid = "".join(secrets.choice(_ID_ALPHABET) for _ in range(12))
            return dict(base, id=bid, name=name, status="stopped", pid=None, created=time.time())

    def clone(self, src: _BoxState, name: str | None, disk: Path | None) -> _BoxState:
        import shutil

        rec = self.new_record(src.rec, name)
        state = _BoxState(self, rec, src.opts)
        state.dir.mkdir(parents=True)
        (state.dir / "logs").mkdir()
        if (src.dir / "disk").is_dir():
            # Overlay work directories are scratch space: only the upper layers and dirs are the disk.
            shutil.copytree(src.dir / "disk", state.dir / "disk", symlinks=True, ignore=_ignore_work)
        with self.mutex:
            self.boxes[rec["id"]] = state
            self._save()
        return state

    def export(self, src: _BoxState, dest: Path) -> None:
        import io
        import pickle
        import tarfile

        with tarfile.open(dest, "w") as tar:
            meta = json.dumps({"rec": src.rec}).encode()
            info = tarfile.TarInfo("record.json")
            info.size = len(meta)
            tar.addfile(info, io.BytesIO(meta))
            opts = pickle.dumps(src.opts)
            info = tarfile.TarInfo("options.pickle")
            info.size = len(opts)
            tar.addfile(info, io.BytesIO(opts))
            if (src.dir / "disk").is_dir():
                tar.add(src.dir / "disk", "disk", filter=lambda t: None if "/work/" in f"/{t.name}/" else t)

    def import_box(self, archive: Path, name: str | None) -> _BoxState:
        import pickle
        import tarfile

        with tarfile.open(archive) as tar:
            meta = tar.extractfile("record.json")
            opts_f = tar.extractfile("options.pickle")
            if meta is None or opts_f is None:
                raise InvalidArgumentError(f"{archive} is not a box archive")
            base = json.loads(meta.read())["rec"]
            opts = pickle.loads(opts_f.read())  # the double's own archives only
            rec = self.new_record(base, name)
            state = _BoxState(self, rec, opts)
            state.dir.mkdir(parents=True)
            (state.dir / "logs").mkdir()
            members = [m for m in tar.getmembers() if m.name.startswith("disk")]
            # Python < 3.11.4 (Debian 12's 3.11.2) has no extraction filters and refuses the keyword.
            safe: dict[str, Any] = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}
            tar.extractall(state.dir, members=members, **safe)
        with self.mutex:
            self.boxes[rec["id"]] = state
            self._save()
        return state

    def after_stop(self, state: _BoxState) -> None:
        if state.rec["auto_delete"]:
            self.forget(state)

    def forget(self, state: _BoxState) -> None:
        with self.mutex:
            self.boxes.pop(state.rec["id"], None)
            self._save()
        _rmtree(state.dir)


def _rmtree(path: Path) -> None:
    """Remove a box's directory, as BoxLite removes a box's disk: all of it, for any host user.

    The kernel makes overlayfs's ``work/work`` mode 000 (and a guest may chmod what it wrote):
    root removes those anyway, an ordinary user must first give itself access to each directory.
    """
    import shutil

    for root, dirs, _files in os.walk(path):  # top-down: a directory is opened up before it is entered
        for d in dirs:
            sub = os.path.join(root, d)
            if not os.path.islink(sub):
                with contextlib.suppress(OSError):
                    os.chmod(sub, 0o700)
    shutil.rmtree(path, ignore_errors=True)


_ids = itertools.count()


class Boxlite:
    """``boxlite.Boxlite``: a runtime on one home directory (synchronous constructor)."""

    def __init__(self, options):  # type: ignore[no-untyped-def]
        home = getattr(options, "home_dir", None)
        if home is None:
            raise UnsupportedError("sdk double: the default home is never used by pytest-boxlite")
        home_path = Path(home)
        if not home_path.is_absolute():
            raise InternalError("home_dir must be absolute")
        for sub in ("bases", "boxes", "db", "locks", "logs", "tmp", "images"):
            (home_path / sub).mkdir(parents=True, exist_ok=True)
        for sub in ("layers", "manifests", "configs", "extracted", "disk-images"):
            (home_path / "images" / sub).mkdir(parents=True, exist_ok=True)
        self._rt = _RuntimeState(home_path)
        _log(home_path, "runtime opened")

    def create(self, /, options, name=None):  # type: ignore[no-untyped-def]
        async def create() -> Box:
            rt = self._rt
            rt.check_open()
            mode = rt.network_mode(options)
            if mode not in ("enabled", "disabled"):
                raise InvalidArgumentError(f"invalid network mode {mode!r}")
            with rt.mutex:
                if name is not None and any(b.rec["name"] == name for b in rt.boxes.values()):
                    raise InvalidArgumentError(f"box with name '{name}' already exists")
                bid = "".join(secrets.choice(_ID_ALPHABET) for _ in range(12))
                rec = {
                    "id": bid,
                    "name": name,
                    # A non-empty rootfs_path wins over image; the record shows it as the real one does.
                    "image": f"rootfs:{options.rootfs_path}" if options.rootfs_path else options.image,
                    "cpus": options.cpus or 1,
                    "memory_mib": options.memory_mib or 1024,
                    "auto_delete": 1 if options.auto_delete is None else options.auto_delete,
                    "network": mode,
                    "status": "configured",
                    "created": time.time(),
                }
                state = _BoxState(rt, rec, options)
                state.dir.mkdir(parents=True)
                (state.dir / "logs").mkdir()
                rt.boxes[bid] = state
                rt.update(rec)
            return Box(state)

        return _awaitable(create())

    def list_info(self, /, _state=None):  # type: ignore[no-untyped-def]
        async def listing() -> list[BoxInfo]:
            with self._rt.mutex:
                return [BoxInfo(b.rec) for b in self._rt.boxes.values()]

        return _awaitable(listing())

    def get_info(self, /, id_or_name):  # type: ignore[no-untyped-def]
        async def get_info() -> BoxInfo | None:
            try:
                return BoxInfo(self._rt.find(id_or_name).rec)
            except NotFoundError:
                return None

        return _awaitable(get_info())

    def get(self, /, id_or_name):  # type: ignore[no-untyped-def]
        async def get() -> Box | None:
            try:
                return Box(self._rt.find(id_or_name))
            except NotFoundError:
                return None

        return _awaitable(get())

    def remove(self, /, id_or_name, force=False):  # type: ignore[no-untyped-def]
        async def remove() -> None:
            state = self._rt.find(id_or_name)
            if state.rec["status"] == "running" and not force:
                raise InvalidStateError(f"box {id_or_name} is running; stop it first or use force=True")
            await _in_thread(state.stop_blocking)
            self._rt.forget(state)

        return _awaitable(remove())

    def shutdown(self, /, timeout=None):  # type: ignore[no-untyped-def]
        async def shutdown() -> None:
            rt = self._rt
            rt.shut = True
            for state in list(rt.boxes.values()):
                if state.rec["status"] == "running":
                    await _in_thread(state.stop_blocking)
                    rt.after_stop(state)

        return _awaitable(shutdown())

    def import_box(self, /, archive_path, name=None, *, untrusted=False):  # type: ignore[no-untyped-def]
        """A new, stopped box from an archive :meth:`Box.export` wrote."""

        async def import_box() -> Box:
            self._rt.check_open()
            return Box(await _in_thread(self._rt.import_box, Path(archive_path), name))

        return _awaitable(import_box())

    def close(self, /):  # type: ignore[no-untyped-def]
        return None


# -- the REST runtime (Boxlite.rest) -----------------------------------------------------------------
from boxlite.errors import NetworkError  # noqa: E402 - the real class, like the other errors

from sdk_double import rest as _rest  # noqa: E402 - it builds on everything above

AccessToken = _rest.AccessToken
ApiKeyCredential = _rest.ApiKeyCredential
BoxliteRestOptions = _rest.BoxliteRestOptions
CopyOptions = _rest.CopyOptions
Boxlite.rest = staticmethod(_rest.rest)  # type: ignore[attr-defined]
