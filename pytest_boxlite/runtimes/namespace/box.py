"""A running namespace box (:class:`NamespaceBox`), its agent client, and :func:`attach`."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import selectors
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pytest_boxlite import guest
from pytest_boxlite._homefs import HomeDir
from pytest_boxlite._shown import shown
from pytest_boxlite.errors import (
    BoxDeadError,
    BoxliteError,
    BoxTimeoutError,
    ConfigError,
    UnsupportedError,
    file_error,
)
from pytest_boxlite.runtimes import _cgroups
from pytest_boxlite.runtimes._forkcell import ForkCell
from pytest_boxlite.runtimes._forkrelay import peer
from pytest_boxlite.runtimes.base import DEFAULT_MAX_OUTPUT, BoxDefaults, HelperSink, RawResult
from pytest_boxlite.runtimes.namespace.fork import CELL_SOCKET, CellDealer, fork_listener
from pytest_boxlite.runtimes.namespace.layout import _MAX_INFO, WORKDIR, ctl_dir, keep_marker
from pytest_boxlite.runtimes.namespace.leftovers import kill_box_processes, remove_box_dirs
from pytest_boxlite.runtimes.namespace.privileges import Limits
from pytest_boxlite.runtimes.namespace.regroup import settle as settle_regrouped

ATTACH = guest.path("attach")
_MAX_LOG_READ = 1 << 20


def _connect(path: Path, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    target = str(path)
    dirfd = None
    try:
        sock.settimeout(timeout)
        if len(target.encode()) > 100:
            # sun_path holds ~108 bytes; reach long paths through a directory descriptor (which
            # fails, like the connect, once the box's directory is gone: the socket closes then too).
            dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            target = f"/proc/self/fd/{dirfd}/{path.name}"
        sock.connect(target)
    except BaseException:
        sock.close()
        raise
    finally:
        if dirfd is not None:
            os.close(dirfd)
    return sock


class PeerRefused(BoxliteError, OSError):
    """The process behind a box's socket is not proven the box's: nothing was sent to it."""


def check_peer(sock: socket.socket, box_dir: Path, listener_pid: int | None = None) -> None:
    """Refuse (:class:`PeerRefused`) a connected Unix socket whose peer is not this user's, or
    not the process that listened on it for the box where that is known (``SO_PEERCRED``: the
    credentials the kernel recorded at ``listen()``, which the peer cannot forge)."""
    pid, uid = peer(sock)
    name = shown(box_dir.name, line=True)
    if uid != os.geteuid():
        raise PeerRefused(
            f"refused box {name}: its agent socket is held by uid {uid} (pid {pid}), not by uid {os.geteuid()} "
            "who runs this; nothing was sent to it. Someone else planted it in the home: use a home of your own"
        )
    if listener_pid is not None and pid != listener_pid:
        raise PeerRefused(
            f"refused box {name}: its agent socket is held by pid {pid}, not by pid {listener_pid} that made "
            "the box; nothing was sent to it"
        )


class _Lines:
    """Newline-delimited JSON from the agent, read under a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.eof = False

    def feed(self) -> None:
        try:
            chunk = self.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.eof = True
        self.buf += chunk

    def pop(self) -> dict[str, Any] | None:
        if b"\n" not in self.buf:
            if len(self.buf) > _MAX_INFO:
                raise BoxDeadError("the box agent sent an oversized message")
            return None
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            msg = json.loads(line.decode())
        except ValueError:
            raise BoxDeadError("the box agent sent a malformed message") from None
        if not isinstance(msg, dict):
            raise BoxDeadError("the box agent sent a malformed message")
        return msg

    def read(self, deadline: float) -> dict[str, Any]:
        while True:
            msg = self.pop()
            if msg is not None:
                return msg
            if self.eof:
                raise BoxDeadError("the box agent closed the connection")
            left = deadline - time.monotonic()
            if left <= 0:
                raise BoxTimeoutError("the box agent did not answer in time")
            self.sock.settimeout(left)
            try:
                self.feed()
            except TimeoutError:
                continue


class BoxProcess(Protocol):
    """What a box holds of the process it started: a booted box's ``Popen`` of bubblewrap, or a
    forked box's pid 1 (:class:`~pytest_boxlite.runtimes.namespace.zygote.ForkedProcess`)."""

    pid: int

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class NamespaceBox(BoxDefaults):
    """A running namespace box.  See :class:`pytest_boxlite.runtimes.base.BoxHandle`."""

    runtime_name = "namespace"
    binary_stdout = True
    workdir = WORKDIR

    def __init__(
        self,
        name: str,
        box_dir: Path,
        proc: BoxProcess,
        cgroups: _cgroups.CgroupSet,
        watchdog: int,
        *,
        identity: tuple[int, int] = (0, 0),
        limits: Limits | None = None,
        info: dict[str, Any] | None = None,
        forked_from: str | None = None,
    ) -> None:
        self.name = name
        self.id = name
        #: What the guest sees (read-only) at /run/pytest-boxlite; the host binds fork sockets here.
        self.box_dir = box_dir
        #: The host's private directory: agent socket, box log, info.
        self.ctl_dir = ctl_dir(box_dir)
        self.sock_path = self.ctl_dir / "agent.sock"
        self.log_path = self.ctl_dir / "box.log"
        self._proc = proc
        self._cgroups = cgroups
        self.guest_python = sys.executable
        #: Default ``(uid, gid)`` of commands in this box (see :func:`box_identity`).
        self.identity = identity
        self.limits = limits or Limits((), ())
        self.limits_missing = list(self.limits.missing)
        self._info = dict(info or {})
        self._watchdog = watchdog
        self._destroyed = False
        #: The zygote this box was forked from (``None``: booted).
        self.forked_from = forked_from
        #: The caps of each box forked per test from this one (memory MiB, cpus, pids): the box's
        #: own, set by the runtime that made it.
        self.cell_limits: tuple[int | None, int | None, int | None] = (None, None, None)
        self._cells: CellDealer | None = None
        #: The working directory of the last command attached to this box (a boxed test's
        #: pytest), recorded when the box is kept: ``shell`` starts there.
        self._attached_cwd: str | None = None

    @property
    def agent_pid(self) -> int | None:
        """The host pid of the box's pid 1 (its agent), when known."""
        pid = self._info.get("init_pid")
        return pid if isinstance(pid, int) else None

    def running(self) -> bool:
        """Whether the box's process still runs (no request: see :meth:`alive` for one)."""
        return not self._destroyed and self._proc.poll() is None

    def keep(self) -> None:
        """Let the box outlive this process (for debugging); ``python -m pytest_boxlite clean`` removes it.

        The mark lives outside the box's directory (which the guest sees), so only the host can set it.
        A forked box cannot outlive its zygote, which ends with this process: that is refused.
        """
        if self.forked_from is not None:
            raise BoxliteError(
                f"box {self.name} was forked from zygote {self.forked_from} and ends with it: "
                "a box to keep must be booted (sessions with --boxlite-keep boot their boxes)"
            )
        # Through the state directory's descriptor: a link planted under the mark's name is
        # replaced, never written through.
        mark = {"kept_at": time.time(), "cwd": self._attached_cwd}
        with HomeDir.open(self.box_dir.parent) as state:
            state.write(keep_marker(self.box_dir).name, json.dumps(mark).encode(), mode=0o644)
        os.write(self._watchdog, b"k")

    # -- requests -------------------------------------------------------
    def _request(self, req: dict[str, Any], fds: Sequence[int], timeout: float) -> tuple[socket.socket, _Lines]:
        if self._destroyed:
            raise BoxDeadError(f"box {self.name} has been destroyed")
        try:
            sock = _connect(self.sock_path, timeout)
        except OSError as exc:
            raise BoxDeadError(f"box {self.name} does not answer: {exc}") from exc
        try:
            # The listener is the one this process made for the box (its record says so): a
            # request hands it descriptors, so a socket anyone else holds gets none.
            listener = self._info.get("listener_pid")
            check_peer(sock, self.box_dir, listener if isinstance(listener, int) else None)
        except BaseException:
            sock.close()
            raise
        try:
            socket.send_fds(sock, [(json.dumps(req) + "\n").encode()], list(fds))
        except OSError as exc:
            sock.close()
            raise BoxDeadError(f"box {self.name} dropped a request: {exc}") from exc
        return sock, _Lines(sock)

    def alive(self, timeout: float = 2.0) -> bool:
        if self._destroyed or self._proc.poll() is not None:
            return False
        try:
            sock, lines = self._request({"op": "ping"}, [], timeout)
        except (BoxDeadError, BoxTimeoutError):
            return False
        with sock:
            try:
                return "pong" in lines.read(time.monotonic() + timeout)
            except (BoxDeadError, BoxTimeoutError, ValueError):
                return False

    def exec(
        self,
        argv: Sequence[str],
        *,
        input: bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float,
        max_output: int = DEFAULT_MAX_OUTPUT,
        op: str = "exec",
        sink: HelperSink | None = None,
    ) -> RawResult:
        if user is not None and not isinstance(user, (str, int)):
            raise ConfigError(f"user must be a name or 'uid[:gid]', got {user!r}")
        settle_regrouped()  # the command reads the host's re-owned files as they are now
        start = time.monotonic()
        deadline = start + timeout
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_w: int | None = None
        if input is None:
            in_r = os.open(os.devnull, os.O_RDONLY)
        else:
            in_r, in_w = os.pipe()
        if cwd is None and op == "exec" and self.workdir != WORKDIR:
            cwd = self.workdir  # the image config's WorkingDir (the agent's default is /workspace)
        req: dict[str, Any] = {"op": op, "argv": list(argv), "env": dict(env or {}), "cwd": cwd}
        if user is not None:
            req["user"] = "0:0" if str(user) == "root" else str(user)
        try:
            sock, lines = self._request(req, [in_r, out_w, err_w], min(timeout, 10.0) + 1.0)
        except BaseException:
            for fd in (out_r, err_r, in_w):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        with sock, contextlib.ExitStack() as stack:
            for fd in (out_r, err_r):
                stack.callback(os.close, fd)
            try:
                first = lines.read(max(deadline, time.monotonic() + 5.0))
            except BaseException:
                if in_w is not None:
                    os.close(in_w)
                raise
            if "error" in first:
                if in_w is not None:
                    os.close(in_w)
                raise file_error(int(first.get("errno") or 0), first["error"], first.get("filename"))
            return self._pump(sock, lines, out_r, err_r, in_w, input or b"", start, deadline, max_output, sink)

    def _pump(
        self,
        sock: socket.socket,
        lines: _Lines,
        out_r: int,
        err_r: int,
        in_w: int | None,
        payload: bytes,
        start: float,
        deadline: float,
        max_output: int,
        sink: HelperSink | None = None,
    ) -> RawResult:
        """Feed stdin, drain stdout and stderr (each kept up to ``max_output``; stdout handed to
        ``sink`` instead when given) until the process exits or its time is up.  An exception
        (from ``sink`` too) leaves with the socket closed by the caller, which kills the process."""
        sel = selectors.DefaultSelector()
        bufs = {out_r: bytearray(), err_r: bytearray()}
        dropped = {out_r: 0, err_r: 0}
        sel.register(out_r, selectors.EVENT_READ)
        sel.register(err_r, selectors.EVENT_READ)
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
        view = memoryview(payload)
        if in_w is not None:
            os.set_blocking(in_w, False)
            sel.register(in_w, selectors.EVENT_WRITE)
        exit_code: int | None = None
        # The exit message may have arrived together with the pid message.
        while (early := lines.pop()) is not None:
            if "exit" in early:
                exit_code = int(early["exit"])
        timed_out = False
        error: str | None = None
        hard_deadline: float | None = None  # after a kill, or after exit while pipes stay open
        try:
            while True:
                open_pipes = [fd for fd in (out_r, err_r) if fd in sel.get_map()]
                if exit_code is not None and not open_pipes:
                    break
                now = time.monotonic()
                if not timed_out and exit_code is None and now >= deadline:
                    timed_out = True
                    with contextlib.suppress(OSError):
                        sock.send(b'{"signal": 9}\n')
                    hard_deadline = now + 5.0
                if exit_code is not None and hard_deadline is None:
                    # Background children may hold the pipes open; don't wait on them for long.
                    hard_deadline = now + 0.5
                if hard_deadline is not None and now >= hard_deadline:
                    if exit_code is None:
                        error = "the guest process did not exit after SIGKILL"
                    break
                wait_until = hard_deadline if hard_deadline is not None else deadline
                for key, _ in sel.select(max(0.0, wait_until - now)):
                    fd = key.fd
                    if key.fileobj is sock:
                        lines.feed()
                        while (msg := lines.pop()) is not None:
                            if "exit" in msg:
                                exit_code = int(msg["exit"])
                        if lines.eof:
                            sel.unregister(sock)
                            if exit_code is None:
                                error = "the box agent hung up before the process exited"
                                raise BoxDeadError(f"box {self.name}: {error}")
                    elif fd == in_w:
                        try:
                            n = os.write(fd, view[:65536])
                        except (BrokenPipeError, OSError):
                            n = len(view)
                        view = view[n:]
                        if not view:
                            sel.unregister(fd)
                            os.close(fd)
                            in_w = None
                    else:
                        chunk = os.read(fd, 1 << 16)
                        if not chunk:
                            sel.unregister(fd)
                            continue
                        if sink is not None and fd == out_r:
                            sink(chunk)
                            continue
                        room = max_output - len(bufs[fd])
                        if room > 0:
                            bufs[fd] += chunk[:room]
                        dropped[fd] += max(0, len(chunk) - max(room, 0))
        finally:
            sel.close()
            if in_w is not None:
                os.close(in_w)
        return RawResult(
            exit_code=exit_code,
            stdout=bytes(bufs[out_r]),
            stderr=bytes(bufs[err_r]),
            timed_out=timed_out,
            duration=time.monotonic() - start,
            stdout_dropped=dropped[out_r],
            stderr_dropped=dropped[err_r],
            error=error,
        )

    def spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None, cwd: str | None, user: str | None
    ) -> _AgentProcess:
        """Start ``argv`` in the box through the agent, its stdio host pipes; return at once."""
        if user is not None and not isinstance(user, (str, int)):
            raise ConfigError(f"user must be a name or 'uid[:gid]', got {user!r}")
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        req: dict[str, Any] = {
            "op": "exec",
            "argv": list(argv),
            "env": dict(env or {}),
            "cwd": cwd if cwd is not None or self.workdir == WORKDIR else self.workdir,
            # Popen.send_signal signals the process itself, not its group.
            "signal_group": False,
        }
        if user is not None:
            req["user"] = "0:0" if str(user) == "root" else str(user)
        ours = [in_w, out_r, err_r]
        try:
            try:
                sock, lines = self._request(req, [in_r, out_w, err_w], _SPAWN_TIMEOUT)
            finally:
                for fd in (in_r, out_w, err_w):
                    os.close(fd)
            try:
                first = lines.read(time.monotonic() + _SPAWN_TIMEOUT)
                if "error" in first:
                    raise file_error(int(first.get("errno") or 0), str(first["error"]), _text(first.get("filename")))
                pid = first.get("pid")
                if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
                    raise BoxDeadError(f"box {self.name}: the agent sent no pid for the process")
            except BaseException:
                sock.close()
                raise
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        sock.setblocking(False)
        return _AgentProcess(self.name, sock, lines, pid, in_w, out_r, err_r)

    def connect_port(self, port: int, *, timeout: float) -> socket.socket:
        """A connection to ``port`` on the box's loopback, made by its agent (in the box's network
        namespace) and handed over with SCM_RIGHTS: the socket is checked to be a TCP stream."""
        deadline = time.monotonic() + timeout
        sock, _lines = self._request({"op": "connect", "port": int(port)}, [], timeout)
        with sock:
            buf = b""
            fds: list[int] = []
            try:
                while b"\n" not in buf:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise BoxTimeoutError(f"box {self.name}: the agent did not connect to port {port} in time")
                    sock.settimeout(left)
                    try:
                        data, more, _flags, _addr = socket.recv_fds(sock, 4096, 1)
                    except TimeoutError:
                        continue
                    fds += more
                    if not data:
                        raise BoxDeadError(f"box {self.name}: the agent hung up on a connect to port {port}")
                    buf += data
                    if len(buf) > 4096 or len(fds) > 1:
                        raise BoxDeadError(f"box {self.name}: the agent sent an oversized answer to a connect")
                try:
                    msg = json.loads(buf.split(b"\n", 1)[0].decode())
                except ValueError:
                    raise BoxDeadError(f"box {self.name}: the agent sent a malformed answer to a connect") from None
                if not isinstance(msg, dict):
                    raise BoxDeadError(f"box {self.name}: the agent sent a malformed answer to a connect")
                if "error" in msg:
                    code = msg.get("errno")
                    code = code if isinstance(code, int) and not isinstance(code, bool) else 0
                    err = OSError(code, f"box {self.name}, port {port}: {_text(msg['error'])}")
                    if code == errno.ECONNREFUSED:
                        err = ConnectionRefusedError(code, f"box {self.name}: nothing listens on port {port}")
                    raise err
                if msg.get("connected") != port or len(fds) != 1:
                    raise BoxDeadError(f"box {self.name}: the agent's answer to a connect carried no socket")
                fd = fds.pop()
                st = os.fstat(fd)
                conn = socket.socket(fileno=fd)
                if not stat.S_ISSOCK(st.st_mode) or conn.family != socket.AF_INET or conn.type != socket.SOCK_STREAM:
                    conn.close()
                    raise BoxDeadError(f"box {self.name}: the agent handed over something other than a TCP socket")
                conn.setblocking(True)
                return conn
            finally:
                for fd in fds:
                    os.close(fd)

    def changes(self, *, timeout: float) -> dict[str, Any]:
        """What the box's files gained since it started, as its agent lists them (a box forked from
        a zygote keeps a handle on its fresh layers: guest/changes.py), unchecked: the caller
        checks it (``box_changes.take``).  A booted box's agent says it cannot."""
        sock, lines = self._request({"op": "changes"}, [], timeout)
        with sock:
            answer = lines.read(time.monotonic() + timeout)  # one line, at most 64 KiB
        if "error" in answer:
            raise UnsupportedError(f"box {self.name}: {_text(answer['error'])}")
        return answer

    def fork_listener(self) -> tuple[socket.socket, str]:
        """A listening socket in the box's guest-visible directory, for boxes forked from this one."""
        return fork_listener(self.box_dir)

    def fork_cell(self, name: str) -> ForkCell:
        """The cell of a box about to be forked from this one's warm interpreter: cgroups of its
        own with this box's caps (where this host lets us make them) and its own stderr, which
        the guest takes before the fork (see :mod:`pytest_boxlite.runtimes._forkcell`)."""
        if self._destroyed:
            raise BoxDeadError(f"box {self.name} has been destroyed")
        settle_regrouped()  # the forked box's test reads the host's re-owned files as they are now
        if self._cells is None:
            self._cells = CellDealer(self.box_dir)
        memory_mib, cpus, pids = self.cell_limits
        cg = _cgroups.create(_cgroups.cell_name(self.name, next(_CELLS)), memory_mib=memory_mib, cpus=cpus, pids=pids)
        try:
            return ForkCell(name, cg, {"sock": CELL_SOCKET}, self._cells.deal)
        except BaseException:
            cg.remove()
            raise

    def run_attached(self, argv: Sequence[str], *, cwd: str | None, env: Mapping[str, str]) -> int:
        """Run ``argv`` in this box with this process's own stdin/stdout/stderr (see :func:`attach`)."""
        return attach(self.box_dir, argv, cwd=cwd, env=env)

    def run_helper(self, payload: bytes, *, timeout: float, max_output: int, sink: HelperSink) -> RawResult:
        """Run the file helper on ``payload`` in a fork of the box's agent (no interpreter start-up)."""
        return self.exec(["<helper>"], input=payload, timeout=timeout, max_output=max_output, op="helper", sink=sink)

    def attach_argv(
        self,
        argv: Sequence[str],
        *,
        cwd: str | None = None,
        status_file: str | None = None,
        user: str | None = None,
    ) -> list[str]:
        """A host command whose stdin/stdout/stderr are those of ``argv`` running in this box.

        With ``status_file``, the command's raw exit status is written there when it ends.  It
        runs as ``user`` ("uid[:gid]" or a name), else as the box's identity (:func:`box_identity`).
        """
        # The command's stderr goes to the box log, which failure reports quote.
        extra = ["--stderr", str(self.log_path)]
        if cwd:
            extra += ["--cwd", cwd]
            self._attached_cwd = cwd
        if status_file:
            extra += ["--status", status_file]
        if user is not None:
            extra += ["--user", str(user)]
        return [sys.executable, "-I", "-S", str(ATTACH), str(self.sock_path), *extra, "--", *argv]

    def oom_kills(self) -> int:
        """How many processes the OOM killer has killed in this box so far."""
        return self._cgroups.oom_kills()

    def log_tail(self, max_bytes: int = 4000, *, since: int = 0) -> str:
        """The last ``max_bytes`` of the box log, from byte offset ``since`` on.

        Guests write to the log (their stderr), so it is opened without following links and read
        bounded; its path is in the host's private directory, which no guest can reach.
        """
        max_bytes = max(0, min(max_bytes, _MAX_LOG_READ))
        try:
            fd = os.open(self.log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return ""
        try:
            size = os.fstat(fd).st_size
            os.lseek(fd, max(since, size - max_bytes, 0), os.SEEK_SET)
            return os.read(fd, max_bytes).decode("utf-8", "replace")
        except OSError:
            return ""
        finally:
            os.close(fd)

    def log_size(self) -> int:
        """Current length of the box log, to quote only what a later step adds."""
        try:
            return os.stat(self.log_path, follow_symlinks=False).st_size
        except OSError:
            return 0

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        with contextlib.suppress(OSError):
            os.close(self._watchdog)
        if self._cells is not None:
            self._cells.close()
        if self._proc.poll() is None:
            # The pid namespace's first process: its death takes every process of the box along.
            kill_box_processes(self._info, self.box_dir)
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
        self._cgroups.remove()
        if self._cells is not None:
            # Cgroups of boxes forked from this one that no one removed (their processes died with it).
            _cgroups.remove_dirs(_cgroups.find_dirs(self.name))
        remove_box_dirs(self.box_dir)


#: Bound on the agent's answer to a ``spawn`` (the process's pid, or why it could not start).
_SPAWN_TIMEOUT = 10.0


def _text(value: object, limit: int = 500) -> str | None:
    """A string the agent sent, cut to ``limit`` characters (``None`` stays ``None``)."""
    if value is None:
        return None
    return str(value)[:limit]


class _AgentProcess:
    """A process the agent started for :meth:`NamespaceBox.spawn` (see :class:`RawProcess`): its
    control connection (the agent's exit message; signals; hanging up kills its group) and the
    host ends of its stdio pipes, which the caller takes over."""

    def __init__(
        self, box: str, sock: socket.socket, lines: _Lines, pid: int, stdin: int, stdout: int, stderr: int
    ) -> None:
        self.box = box
        self._sock = sock
        self._lines = lines
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self._closed = False

    def fileno(self) -> int:
        return self._sock.fileno()

    def feed(self) -> int | None:
        self._lines.feed()
        while (msg := self._lines.pop()) is not None:
            code = msg.get("exit")
            if isinstance(code, int) and not isinstance(code, bool):
                return code
        if self._lines.eof:
            raise BoxDeadError(f"box {self.box}: the agent hung up before the process exited")
        return None

    def pending(self) -> int | None:
        """The exit status if it already arrived with the pid (no read)."""
        while (msg := self._lines.pop()) is not None:
            code = msg.get("exit")
            if isinstance(code, int) and not isinstance(code, bool):
                return code
        return None

    def signal(self, sig: int, *, group: bool = False) -> None:
        with contextlib.suppress(OSError):
            self._sock.send((json.dumps({"signal": int(sig), "group": bool(group)}) + "\n").encode())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close()


#: Bounds on a kept box's recorded working directory (see :func:`kept_cwd`): as PATH_MAX.
_MAX_KEPT_CWD = 4096


def kept_cwd(mark: bytes) -> str | None:
    """The working directory a kept box's mark records (see :meth:`NamespaceBox.keep`), or
    ``None``: none recorded (a sandbox's box, an older mark), or not one to use.  The mark lies in
    the home on disk: only an absolute path of at most :data:`_MAX_KEPT_CWD` bytes with no NUL or
    other control character is taken; it is handed to the box's agent as a command's cwd, never
    opened or followed on the host."""
    try:
        cwd = json.loads(mark[: _MAX_KEPT_CWD * 2 + 256]).get("cwd")
    except (ValueError, AttributeError):
        return None
    if not isinstance(cwd, str) or not cwd.startswith("/") or len(cwd.encode(errors="replace")) > _MAX_KEPT_CWD:
        return None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in cwd):
        return None
    return cwd


#: Numbers the cgroups of boxes forked per test (unique in this process; see ``fork_cell``).
_CELLS = itertools.count(1)


def attach(
    box_dir: Path,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    user: str | None = None,
    listener_pid: int | None = None,
) -> int:
    """Run ``argv`` in an existing box with *this* process's stdin/stdout/stderr; return its exit code.

    The descriptors themselves are handed to the box, so the stream is
    binary-clean and nothing is copied through this process.  If this process
    dies, the agent kills the command.  It runs as ``user``, else as the box's identity.
    The socket's peer is checked first (:func:`check_peer`; ``listener_pid``: the process that
    listened on it, where the box's record says).
    """
    sock = _connect(ctl_dir(box_dir) / "agent.sock", 10.0)
    with sock:
        # Nothing, least of all this process's stdio, goes to a listener not proven ours.
        check_peer(sock, box_dir, listener_pid)
        req: dict[str, Any] = {"op": "exec", "argv": list(argv), "env": dict(env or {}), "cwd": cwd}
        if user is not None:
            req["user"] = str(user)
        socket.send_fds(sock, [(json.dumps(req) + "\n").encode()], [0, 1, 2])
        lines = _Lines(sock)
        sock.settimeout(None)
        while True:
            msg = lines.pop()
            if msg is None:
                if lines.eof:
                    raise BoxDeadError(f"box {box_dir.name} hung up")
                lines.feed()
                continue
            if "error" in msg:
                raise file_error(int(msg.get("errno") or 0), msg["error"], msg.get("filename"))
            if "exit" in msg:
                return int(msg["exit"])
