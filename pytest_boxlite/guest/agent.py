"""In-box agent of the namespace runtime.  Standard library only.

Runs as process 1 of the box's pid namespace (``bwrap --as-pid-1``; uid 0 of the
box's own user namespace): no guest can kill it (the kernel ignores signals sent
to a namespace's pid 1 from inside it), and when it exits the kernel kills every
process of the box, so nothing outlives it.  It reaps orphans like an init.  It
serves requests on a listening Unix socket that the host created and handed over
as a descriptor: the socket's path lives in the host's private control directory,
which no guest can see.  One connection is one request:

* ``{"op": "ping"}`` -> ``{"pong": pid}``
* ``{"op": "spawn", ...}`` (a *zygote* only, which serves nothing else): fork a new box from
  this one (see "the zygote" below and :mod:`pytest_boxlite.runtimes.namespace.zygote`).
* ``{"op": "helper"}`` with three descriptors: like ``exec``, but the file
  helper (:mod:`pytest_boxlite.guest.files`) runs in a fork of this agent, which
  has it imported already: no interpreter start-up per file operation.
* ``{"op": "changes"}`` -> ``{"files": [...], "notes": [...]}``: what the box's files gained since
  it started (``Sandbox.changes()``; a box forked from a zygote only, which keeps a handle on its
  fresh layers: :mod:`pytest_boxlite.guest.changes`), at most :data:`_CHANGES_ANSWER` bytes of it.
* ``{"op": "connect", "port": n}`` -> ``{"connected": n}`` with one descriptor: a TCP socket
  connected to the box's own ``127.0.0.1:n`` (published ports), or ``{"error": ..., "errno": n}``.
* ``{"op": "exec", "argv": [...], "env": {...}, "cwd": ..., "user": ...}`` sent
  together with three file descriptors (stdin, stdout, stderr) -> ``{"pid": n}``
  or ``{"error": msg, "errno": n}``, later ``{"exit": code}`` (negative: signal).
  A ``{"signal": n}`` line from the client signals the process group (the process
  alone with ``"signal_group": false`` in the request: ``Sandbox.spawn``); the
  client hanging up kills the group, so no guest process outlives its caller.

The descriptors are passed with SCM_RIGHTS, so the output never travels
through this process: it is binary-clean and costs no copy here.

Privileges.  bubblewrap starts the agent with every capability of the box's
user namespace (never of the host's).  Before it serves anything the agent

1. makes itself non-dumpable, so no guest process (even uid 0 of the box) can
   ptrace it or open ``/proc/<agent>/fd/*`` (the watchdog pipe, the socket);
2. binds /proc/sys, /proc/sysrq-trigger, /proc/irq, /proc/bus and /proc/fs over themselves
   read-only (as Docker does: on a root host, the box's uid 0 passes the kernel's sysctl
   permission checks);
3. mounts a spare ``/proc`` where no path reaches it (under a tmpfs stacked
   on its mount point): the kernel lets a process in a *nested* user namespace
   mount a new procfs only when a fully visible one exists, and bubblewrap's
   own ``/proc`` has read-only covers on ``/proc/sys`` & co.  This is what lets
   the per-test fork (and a guest's own sandbox) have a ``/proc`` of its own;
4. sets the per-box process limit (``RLIMIT_NPROC``, counted per user
   namespace) when the host asks for one (no pids cgroup);
5. drops its capabilities to Docker's default set (no CAP_SYS_ADMIN, so no
   guest can unmount or remount anything the runtime mounted), clears the
   ambient set, and keeps ``no_new_privs`` (set by bubblewrap).

Identity.  A command runs as the request's ``user`` (``"uid:gid"``, a number
or a name from the box's /etc/passwd), else as the box's default identity.
An id that the box's user namespace maps is used directly; one it does not
(a non-root host maps only the host user, as uid 0) gets a nested user
namespace in which that id stands for the host user: the command sees the id
it asked for and the host sees the host user.

Watchdog: the agent holds the read end of a pipe whose write end only the
host process holds.  When the host dies (even by SIGKILL) the pipe reads EOF
and the agent exits, which ends the sandbox, unless the host first wrote
``k`` into that pipe to keep the box for debugging.  No guest can reach the
pipe: the agent is non-dumpable, and no child inherits it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading

# Types for mypy only: the agent starts with every box, and importing typing would cost it milliseconds.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any, Protocol

    class _Proc(Protocol):
        """What the agent reads of a process it started (a Popen, or a child it forked itself)."""

        pid: int
        returncode: int | None

        def poll(self) -> int | None: ...

        def wait(self) -> int: ...


def _guest_package() -> None:
    """Make ``pytest_boxlite.guest`` importable from this file's directory alone, as the host's own.

    The agent runs by path under ``python -I -S``, which leaves that directory off ``sys.path``, and a
    box of an image holds only the guest directory of the package (the agent's kit, see
    runtimes/namespace/image.py), not the package's ``__init__`` (which needs more than the
    standard library): so both packages are made here, empty, with the guest directory as the
    one place their modules are found.
    """
    import types

    top = types.ModuleType("pytest_boxlite")
    top.__path__ = []
    guest = types.ModuleType("pytest_boxlite.guest")
    guest.__path__ = [os.path.dirname(os.path.abspath(__file__))]
    top.__dict__["guest"] = guest
    sys.modules.update({top.__name__: top, guest.__name__: guest})


if __name__ == "__main__":  # run by path, in an interpreter of its own (never imported)
    _guest_package()

from pytest_boxlite.guest import caps as _caps  # noqa: E402 - once the package is importable

DEFAULT_CWD = "/workspace"
#: Largest request line the agent accepts (argv + env of one command).
MAX_REQUEST = 4 << 20

_PR_SET_DUMPABLE = 4
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWCGROUP = 0x02000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 8, 32, 4096, 16384
#: Parts of /proc no box may write, read-only as in Docker: on a root host uid 0 of the box is
#: uid 0 to the kernel's sysctl permission checks (core_pattern, sysrq-trigger...).
PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
#: Docker's default capability set: chown, dac_override, fowner, fsetid, kill, setgid, setuid,
#: setpcap, net_bind_service, net_raw, sys_chroot, mknod, audit_write, setfcap.
DOCKER_CAPS = (0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31)
HIDDEN_PROC = "/run/.boxlite-proc"

_libc = ctypes.CDLL(None, use_errno=True)


_check = _caps.check_libc


def limit_caps(keep: tuple[int, ...]) -> None:
    """Keep only the capabilities ``keep`` (numbers): bounding set, effective, permitted; no ambient."""
    _caps.limit_caps(_libc, keep)


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(v: str | None) -> bytes | None:
        return v.encode() if v is not None else None

    _check(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), "mount %s" % target)


def _seal_proc() -> None:
    """Bind the dangerous parts of /proc over themselves read-only (bubblewrap covers only some)."""
    for name in PROC_READ_ONLY:
        path = "/proc/" + name
        if not os.path.exists(path):
            continue
        _mount(path, path, None, _MS_BIND | _MS_REC)
        _mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)


def _hide_spare_proc(root: str = "") -> None:
    """A fully visible procfs that no path reaches (see the module docstring, step 3), in the tree
    at ``root`` (a forked box makes it in its new root before it moves there)."""
    hidden = root + HIDDEN_PROC
    try:
        os.makedirs(hidden, mode=0o700, exist_ok=True)
        _mount("tmpfs", hidden, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "mode=0700,size=4k")
        os.mkdir(hidden + "/p", 0o700)
        _mount("proc", hidden + "/p", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        # Stacked on the same mount point: the procfs is still mounted, but nothing leads to it.
        _mount("tmpfs", hidden, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "mode=0,size=4k")
    except OSError as exc:
        sys.stderr.write("pytest-boxlite agent: no spare /proc (forked boxes get none): %s\n" % exc)


# --- identity -------------------------------------------------------------------------------


def _mapped(which: str, ident: int) -> bool:
    """Whether ``ident`` is mapped in this user namespace (``which``: "uid" or "gid")."""
    try:
        with open("/proc/self/%s_map" % which) as fh:
            for line in fh:
                inner, _outer, count = (int(x) for x in line.split())
                if inner <= ident < inner + count:
                    return True
    except (OSError, ValueError):
        pass
    return False


#: Most bytes of the box's /etc/passwd or /etc/group read for one lookup.
_MAX_ID_FILE = 4 << 20


def _id_entries(path: str) -> list[list[str]]:
    """The entries of the box's ``/etc/passwd`` or ``/etc/group`` as lists of fields, read here.

    Not through ``pwd``/``grp``: libc would load the NSS modules the box's ``/etc/nsswitch.conf``
    names into this agent, code a guest (root in its box) can plant.  The file is the guest's
    too: bounded, never waited on (a FIFO there is no file), parsed as text.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        data = os.read(fd, _MAX_ID_FILE)
    except OSError:
        return []
    finally:
        os.close(fd)
    return [line.split(":") for line in data.decode("utf-8", "replace").splitlines() if line.count(":") >= 3]


def _find(path: str, field: int, value: str) -> list[str] | None:
    """The first entry of ``path`` whose ``field`` is ``value``, with its numeric fields as ints."""
    for fields in _id_entries(path):
        if fields[field] == value and fields[2].isdigit() and (path != "/etc/passwd" or fields[3].isdigit()):
            return fields
    return None


def resolve_user(user: object, default: tuple[int, int]) -> tuple[int, int]:
    """``user`` ("uid[:gid]", a name, or None for ``default``) as ``(uid, gid)``."""
    if user is None or user == "":
        return (int(default[0]), int(default[1]))
    user = str(user)
    name, _, group = user.partition(":")
    if name.isdigit():
        uid = int(name)
        entry = _find("/etc/passwd", 2, name)
        gid = int(entry[3]) if entry else uid
    else:
        entry = _find("/etc/passwd", 0, name)
        if entry is None:
            raise LookupError("no user named %r in the box's /etc/passwd" % name)
        uid, gid = int(entry[2]), int(entry[3])
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            entry = _find("/etc/group", 0, group)
            if entry is None:
                raise LookupError("no group named %r in the box's /etc/group" % group)
            gid = int(entry[2])
    return uid, gid


#: Where a command's private home is made when its user has no writable one in the box.
_PRIVATE_HOMES = "/tmp/.boxlite-home"


def home_for(uid: int, gid: int) -> str:
    """``HOME`` for a command run as ``uid``/``gid`` when neither the box nor the call sets one.

    The user's home in the box's ``/etc/passwd`` where it is a directory that user owns and can
    write (copy-on-write over the host's), as ``su`` would give; else a private directory in the
    box's own /tmp, made for it here: an ordinary user's host shows the host root's ``/root``
    (and other users' homes) owned by nobody, read-only in the box.  Links are never followed.
    """
    # In a nested namespace (an id this box does not map) the user stands for the box's uid 0.
    owner = uid if _mapped("uid", uid) else os.getuid()
    entry = _find("/etc/passwd", 2, str(uid))
    home = entry[5] if entry is not None and len(entry) > 5 else ""
    if home.startswith("/"):
        try:
            st = os.stat(home)
            writable = stat.S_ISDIR(st.st_mode) and st.st_uid == owner and st.st_mode & 0o300 == 0o300
            # Not a directory bubblewrap made on the box's read-only root (an unreadable host /root).
            writable = writable and not os.statvfs(home).f_flag & os.ST_RDONLY
            if writable and (owner != os.getuid() or _can_write(home)):
                return home
        except (OSError, ValueError):
            pass
    path = "%s/%d" % (_PRIVATE_HOMES, uid)
    try:
        for d, mode in ((_PRIVATE_HOMES, 0o711), (path, 0o700)):
            try:
                os.mkdir(d, mode)
            except FileExistsError:
                pass
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode):
                return "/"
        if owner != os.getuid() or (_mapped("gid", gid) and os.lstat(path).st_gid != gid):
            os.chown(path, owner, gid if _mapped("gid", gid) else os.getgid(), follow_symlinks=False)
    except OSError:
        return "/"
    return path


def _can_write(directory: str) -> bool:
    """Whether this agent (the box's root, as its commands) can make an entry in ``directory``:
    a directory bubblewrap made where the host's is unreadable looks writable but is not."""
    probe = "%s/.boxlite-probe-%d" % (directory, os.getpid())
    try:
        os.mkdir(probe, 0o700)
    except OSError:
        return False
    try:
        os.rmdir(probe)
    except OSError:
        pass
    return True


class _Child:
    """A Popen look-alike (pid, poll, wait) for a child this agent forked itself."""

    pid = 0
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class _Nested(_Child):
    """A command in a nested user namespace where ``uid``/``gid`` stand for the box's uid 0.

    For ids the box's own namespace does not map (a non-root host maps one id only).  A
    Popen look-alike (pid, poll, wait).
    """

    def __init__(self, argv: list[str], fds: list[int], env: dict[str, str], cwd: str, uid: int, gid: int) -> None:
        if not os.path.isdir(cwd):
            raise FileNotFoundError(2, "No such file or directory", cwd)
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(ready_r)
                os.close(go_w)
                os.close(err_r)
                os.setsid()
                _check(_libc.unshare(_CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
                os.write(ready_w, b"u")
                if os.read(go_r, 1) != b"g":
                    os._exit(71)
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
                for i, fd in enumerate(fds):
                    os.dup2(fd, i)
                os.chdir(cwd)
                os.closerange(3, 65536)
                os.execvpe(argv[0], argv, env)
            except BaseException as exc:
                try:
                    os.write(err_w, ("%d\0%s" % (getattr(exc, "errno", 0) or 0, exc)).encode()[:4000])
                finally:
                    os._exit(127)
        os.close(ready_w)
        os.close(go_r)
        os.close(err_w)
        try:
            if os.read(ready_r, 1) == b"u":
                for name, data in (
                    ("uid_map", "%d 0 1\n" % uid),
                    ("setgroups", "deny"),
                    ("gid_map", "%d 0 1\n" % gid),
                ):
                    with open("/proc/%d/%s" % (pid, name), "w") as fh:
                        fh.write(data)
                os.write(go_w, b"g")
        finally:
            os.close(ready_r)
            os.close(go_w)
        failure = os.read(err_r, 4096)
        os.close(err_r)
        self.pid = pid
        self.returncode = None
        if failure:
            self.wait()
            code, _, msg = failure.decode("utf-8", "replace").partition("\0")
            raise OSError(int(code or 0), msg)


def spawn(argv: list[str], fds: list[int], env: dict[str, str], cwd: str, uid: int, gid: int) -> _Proc:
    """Start ``argv`` as ``uid``/``gid`` in its own session with ``fds`` as its stdio."""
    if _mapped("uid", uid) and _mapped("gid", gid):
        kwargs: dict[str, Any] = {}
        if (uid, gid) != (os.getuid(), os.getgid()):
            kwargs = {"user": uid, "group": gid, "extra_groups": []}
        return subprocess.Popen(
            argv,
            stdin=fds[0],
            stdout=fds[1],
            stderr=fds[2],
            env=env,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
            **kwargs,
        )
    return _Nested(argv, fds, env, cwd, uid, gid)


# --- serving --------------------------------------------------------------------------------


def _send(conn: socket.socket, obj: object) -> None:
    conn.sendall((json.dumps(obj) + "\n").encode())


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, got, _flags, _addr = socket.recv_fds(conn, 1 << 16, 8)
    fds = list(got)
    chunks = [data]
    size = len(data)
    while not chunks[-1].endswith(b"\n"):
        if size > MAX_REQUEST:
            raise ValueError("request larger than %d bytes" % MAX_REQUEST)
        more = conn.recv(1 << 16)
        if not more:
            break
        chunks.append(more)
        size += len(more)
    req = json.loads(b"".join(chunks).decode())
    if not isinstance(req, dict):
        raise ValueError("a request is a JSON object, not %s" % type(req).__name__)
    return req, fds


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _watch_client(conn: socket.socket, proc: _Proc, group: bool = True) -> None:
    """Relay signals from the client; kill the process group when it hangs up.

    A ``{"signal": n}`` line signals the process group (``group``, an ``exec``), or the process
    alone (a ``spawn``-style request: ``"signal_group": false``, as ``Popen.send_signal``); a
    line's own ``"group"`` says which for that signal.
    """
    buf = b""
    while True:
        try:
            chunk = conn.recv(4096)
        except OSError:
            chunk = b""
        if not chunk:
            if proc.poll() is None:
                _killpg(proc.pid, signal.SIGKILL)
            return
        buf = (buf + chunk)[-65536:]
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                msg = json.loads(line.decode())
                sig = int(msg["signal"])
                whole = bool(msg.get("group", group))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            if whole:
                _killpg(proc.pid, sig)
            elif proc.returncode is None:
                # Not reaped yet (the serving thread reaps it: no poll() here, which could reap
                # it under that thread's waitpid): the pid is still this child's.
                try:
                    os.kill(proc.pid, sig)
                except (ProcessLookupError, PermissionError, ValueError, OverflowError):
                    pass


#: How long the agent tries to connect to a port of its box for the host (``connect``).
_CONNECT_TIMEOUT = 5.0


def _connect_port(conn: socket.socket, req: dict[str, Any]) -> None:
    """``{"op": "connect", "port": n}``: connect to the box's own ``127.0.0.1:n`` (this agent is in
    the box's network namespace) and hand the connected socket to the host (SCM_RIGHTS), which
    relays a published port through it.  Only the box's loopback, only TCP: never anywhere else."""
    port = req.get("port")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        _send(conn, {"error": "connect needs a port from 1 to 65535, got %r" % (port,), "errno": 22})
        return
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=_CONNECT_TIMEOUT)
    except OSError as exc:
        _send(conn, {"error": exc.strerror or str(exc), "errno": exc.errno or 0})
        return
    with sock:
        sock.settimeout(None)
        socket.send_fds(conn, [(json.dumps({"connected": port}) + "\n").encode()], [sock.fileno()])


def _cwd(req: dict[str, Any]) -> str:
    # A test may delete the box's working directory; the box must stay usable.
    return req.get("cwd") or (DEFAULT_CWD if os.path.isdir(DEFAULT_CWD) else "/")


_HELPER: dict[str, ModuleType] = {}
#: Children the agent waits for itself (their exit status is reported); the reaper leaves them alone.
_TRACKED: set[int] = set()
_TRACKED_LOCK = threading.Lock()


def _untrack(pid: int) -> None:
    with _TRACKED_LOCK:
        _TRACKED.discard(pid)


def _reap_orphans() -> None:
    """As the box's pid 1, collect orphaned zombies (never a child whose status a request waits for)."""
    import time

    while True:
        time.sleep(0.5)
        try:
            entries = os.listdir("/proc")
        except OSError:
            continue
        for entry in entries:
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                with open("/proc/%d/stat" % pid) as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" or fields[1] != "1":
                continue
            with _TRACKED_LOCK:
                if pid in _TRACKED:
                    continue
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass


#: Descriptors only the agent may hold (the watchdog pipe, the listening socket): closed in forks.
_PRIVATE_FDS: list[int] = []


def _load_helper(path: str) -> None:
    """Import the file helper once, before any guest process runs; forked children inherit it.

    What its operations import lazily is imported here too: a fork importing a module later
    would read it from the box's filesystem, where a guest (root in its box) may have replaced
    it.  The helper itself looks up no user or group name (no NSS module of the box is loaded).
    """
    import importlib
    import importlib.util

    spec = importlib.util.spec_from_file_location("_boxlite_guest_helper", path)
    if spec is None or spec.loader is None:
        raise ImportError("no file helper at %s" % path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in module.LAZY_IMPORTS:
        importlib.import_module(name)

    _HELPER["module"] = module


class _ForkedHelper(_Child):
    """A fork of the agent running the file helper: a Popen look-alike (pid, poll, wait)."""

    def __init__(self, fds: list[int], cwd: str, uid: int, gid: int) -> None:
        if not os.path.isdir(cwd):
            raise FileNotFoundError(2, "No such file or directory", cwd)
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                for fd in _PRIVATE_FDS:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                os.setsid()
                if (uid, gid) != (os.getuid(), os.getgid()) and _mapped("uid", uid) and _mapped("gid", gid):
                    os.setgroups([])
                    os.setresgid(gid, gid, gid)
                    os.setresuid(uid, uid, uid)
                for i, fd in enumerate(fds):
                    os.dup2(fd, i)
                os.chdir(cwd)
                # Binary streams on the new descriptors: no text layer (and no codec to look up).
                _HELPER["module"].main(open(0, "rb", closefd=False), open(1, "wb", closefd=False))
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        self.pid = pid
        self.returncode = None


def _serve(conn: socket.socket, base_env: dict[str, str], default_user: tuple[int, int]) -> None:
    fds: list[int] = []
    try:
        req, fds = _read_request(conn)
        op = req.get("op")
        if op == "ping":
            _send(conn, {"pong": os.getpid()})
            return
        if op == "connect":
            _connect_port(conn, req)
            return
        if op == "changes":
            _send(conn, _changes_answer())
            return
        if op not in ("exec", "helper"):
            _send(conn, {"error": "unknown op %r" % (op,), "errno": 22})
            return
        if len(fds) != 3:
            _send(conn, {"error": "exec needs 3 descriptors, got %d" % len(fds), "errno": 22})
            return
        env = dict(base_env)
        env.update(req.get("env") or {})
        try:
            uid, gid = resolve_user(req.get("user"), default_user)
        except LookupError as exc:
            _send(conn, {"error": str(exc), "errno": 22})
            return
        if op == "exec" and "HOME" not in env:  # the file helper runs with no environment of the box's
            env["HOME"] = home_for(uid, gid)
        try:
            # Under the lock: the reaper must not collect the child before it is tracked.
            with _TRACKED_LOCK:
                proc: _Proc
                if op == "helper":
                    proc = _ForkedHelper(fds, _cwd(req), uid, gid)
                else:
                    proc = spawn(req["argv"], fds, env, _cwd(req), uid, gid)
                _TRACKED.add(proc.pid)
        except OSError as exc:
            _send(conn, {"error": exc.strerror or str(exc), "errno": exc.errno or 0, "filename": exc.filename})
            return
        for fd in fds:
            os.close(fd)
        fds = []
        _send(conn, {"pid": proc.pid})
        group = req.get("signal_group", True) is not False
        watcher = threading.Thread(target=_watch_client, args=(conn, proc, group), daemon=True)
        watcher.start()
        try:
            code = proc.wait()
        finally:
            _untrack(proc.pid)
        try:
            _send(conn, {"exit": code})
        except OSError:
            pass
    except Exception as exc:  # the agent must survive any single bad request
        try:
            _send(conn, {"error": "agent: %s: %s" % (type(exc).__name__, exc), "errno": 0})
        except OSError:
            pass
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            # shutdown() wakes the watcher thread blocked in recv(); close() alone would not.
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            conn.close()
        except OSError:
            pass


def _watchdog(fd: int) -> None:
    keep = False
    while True:
        try:
            data = os.read(fd, 4096)
        except InterruptedError:
            continue
        except OSError:
            break
        if not data:
            break
        keep = keep or b"k" in data
    if not keep:
        os._exit(0)


def _harden(cfg: dict[str, Any]) -> None:
    """What the agent does before it serves anything (see the module docstring): process limit,
    Docker's capabilities, not dumpable.  ``/proc`` is sealed and the spare one hidden by the
    caller first (a forked box does both in its own new tree)."""
    if cfg.get("nproc"):
        import resource

        resource.setrlimit(resource.RLIMIT_NPROC, (int(cfg["nproc"]), int(cfg["nproc"])))
    limit_caps(DOCKER_CAPS)
    _check(_libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


def _serve_forever(
    srv: socket.socket, watchdog_fd: int, base_env: dict[str, str], default_user: tuple[int, int]
) -> None:
    threading.Thread(target=_watchdog, args=(watchdog_fd,), daemon=True).start()
    threading.Thread(target=_reap_orphans, daemon=True).start()
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_serve, args=(conn, base_env, default_user), daemon=True).start()


# --- the zygote: a warm template box that sandbox boxes are forked from -----------------------
#
# A zygote is a box booted like any other, whose agent serves no command at all: only ``ping``
# and ``spawn``.  On ``spawn`` it clones a child into new user, mount, pid, uts, ipc (and, unless
# the spec shares the host's, network) namespaces with guest/fresh.py's and layers.py's code, the very code that
# gives each boxed test its pristine box: every overlay gets a new, empty upper layer, /tmp,
# /dev/shm and /run new tmpfs, /proc a new procfs of the new pid namespace, and the box a new
# root of its own (layers.py's fresh_box: /workspace and any top-level entry made anew).  The
# child first moves itself into the box's own cgroups (the host sends their files' descriptors)
# and a cgroup namespace of its own, then becomes the new box's pid 1 agent, serving on the
# socket the host sent with the request, watched by its own watchdog pipe, its stderr in its own
# log: from the host's side it is a box like a booted one.
#
# The zygote stays single-threaded so that fresh.py's clone(2) copies no lock another thread
# holds (see fresh.py's _KNOWN_THREADS): no watchdog or reaper thread, one select loop instead.
# Its children die with it (PR_SET_PDEATHSIG, and their pid namespaces are nested in its own,
# which the kernel empties when it ends), and it dies with the host (its watchdog pipe).

_ZYGOTE_REQUEST_TIMEOUT = 10.0


#: The forked box's watch on its own files (``{"op": "changes"}``), taken as it starts; the zygote
#: imports guest/changes.py once (``_zygote``), its boxes inherit it.
_WATCH: list[Any] = []
#: The longest answer to ``changes`` (the host reads agent lines up to 64 KiB).
_CHANGES_ANSWER = 60 * 1024


def _changes_answer() -> dict[str, Any]:
    if not _WATCH:
        return {
            "error": "this box keeps no handle on its layers (only a sandbox forked from a warm box does)",
            "errno": 95,
        }
    out: dict[str, Any] = _WATCH[0].listing()
    dropped = 0
    while out["files"] and len(json.dumps(out)) > _CHANGES_ANSWER:
        cut = max(1, len(out["files"]) // 4)
        dropped += cut
        out["files"] = out["files"][:-cut]
    if dropped:
        out["notes"].append("%d more changed files not listed (the answer's size)" % dropped)
    return out


def _reap_children() -> None:
    """Collect the zygote's ended children (forked boxes), never blocking."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _zygote(cfg: dict[str, Any], srv: socket.socket, watchdog_fd: int) -> None:
    import gc
    import select

    # Imported here, once, before any box is forked: every box inherits them (none reads a module
    # from its own file system, which its guest may have changed).
    from pytest_boxlite.guest import changes, fresh, layers  # noqa: F401 - imported for the boxes

    # Every object so far out of the collector's sight: a collection in a forked box would
    # otherwise touch (and so copy) every page of the zygote's heap.
    gc.freeze()
    while True:
        _reap_children()
        try:
            waits: list[Any] = [srv, watchdog_fd]
            ready, _, _ = select.select(waits, [], [], 1.0)
        except InterruptedError:
            continue
        if watchdog_fd in ready:
            try:
                data = os.read(watchdog_fd, 4096)
            except OSError:
                data = b""
            if not data:
                os._exit(0)  # the host is gone: so is the zygote, and with it every box it forked
        if srv in ready:
            conn, _ = srv.accept()
            _zygote_serve(conn, cfg)


def _zygote_serve(conn: socket.socket, cfg: dict[str, Any]) -> None:
    """One request to the zygote; in the parent it returns, in a forked child it never does."""
    from pytest_boxlite.guest import fresh, ids  # imported by the zygote already

    fds: list[int] = []
    try:
        conn.settimeout(_ZYGOTE_REQUEST_TIMEOUT)
        req, fds = _read_request(conn)
        op = req.get("op")
        if op == "ping":
            _send(conn, {"pong": os.getpid()})
            return
        if op != "spawn":
            # The zygote never runs a command: it is the template every forked box starts from.
            _send(conn, {"error": "a zygote runs no command (op %r)" % (op,), "errno": 1})
            return
        if len(fds) < 3:
            _send(conn, {"error": "spawn needs at least 3 descriptors, got %d" % len(fds), "errno": 22})
            return
        mapper = ids.IdMapper() if os.geteuid() == 0 else None
        try:
            network = bool(req.get("network"))
            pid = fresh.clone_box(network, mapper, flags=fresh.sandbox_flags(network))
        except OSError as exc:
            if mapper is not None:
                mapper.close_parent_side()
                mapper.close_child_side()
            _send(conn, {"error": "clone: %s" % exc, "errno": exc.errno or 0})
            return
        if pid == 0:
            _forked_box(conn, fds, req, cfg)  # never returns
        if mapper is not None:
            mapper.serve(pid)
    except Exception as exc:  # the zygote must survive any single bad request
        try:
            _send(conn, {"error": "zygote: %s: %s" % (type(exc).__name__, exc), "errno": 0})
        except OSError:
            pass
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        conn.close()


def _forked_box(conn: socket.socket, fds: list[int], req: dict[str, Any], cfg: dict[str, Any]) -> None:
    """In the zygote's child, pid 1 of its new namespaces: become the new box's agent."""
    from pytest_boxlite.guest import changes, layers  # imported by the zygote already

    code = 70
    try:
        listen_fd, watchdog_fd, log_fd = fds[:3]
        # The box's own log from here on (the zygote's stays the zygote's).
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        # Then into the box's own cgroups (the host opened their task files for it): a process
        # that moves itself, one thread, takes no lock the whole machine waits on (the host moving
        # it would take cgroup_threadgroup_rwsem, an RCU grace period: milliseconds).
        for fd in fds[3:]:
            os.write(fd, b"0")
            os.close(fd)
        # And a cgroup namespace whose root is that cgroup, as bubblewrap gives a booted box.
        _check(_libc.unshare(_CLONE_NEWCGROUP), "unshare(CLONE_NEWCGROUP)")
        # Nothing of the zygote's stays open here: its listening socket and its watchdog pipe.
        for fd in _PRIVATE_FDS:
            os.close(fd)
        del _PRIVATE_FDS[:]
        _PRIVATE_FDS.extend([listen_fd, watchdog_fd])
        for fd in _PRIVATE_FDS:
            os.set_inheritable(fd, False)
        conn.settimeout(_ZYGOTE_REQUEST_TIMEOUT)
        # The kernel tells the host (SO_PASSCRED) this process's pid as the host sees it; the host
        # records it (so cleanup finds this box whatever happens next), then says go.
        _send(conn, {"forked": os.getpid()})
        word = b""
        while len(word) < 3:
            more = conn.recv(3 - len(word))
            if not more:
                break
            word += more
        if word != b"go\n":
            os._exit(71)  # the host gave up on this box (it cannot have been recorded)
        with open("/proc/self/oom_score_adj") as fh:
            oom_adj = fh.read().strip()
        network = bool(req.get("network"))
        layers.KEEP_LAYERS[0] = True  # Sandbox.changes(): a handle on each fresh layer
        # The spare /proc goes into the new root before the old one (and the zygote's spare /proc
        # in it) is detached: the kernel mounts a new procfs only where a fully visible one exists.
        layers.fresh_box(str(req["hostname"]), network, own_root=True, before_pivot=_hide_spare_proc)
        # fresh_box favours the warm interpreter under memory pressure: a box's agent has none.
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write(oom_adj)
        if not network:
            layers.loopback_up()
        # What the box holds as it starts: Sandbox.changes() says what its commands changed since.
        containers = [_PRIVATE_HOMES, _PRIVATE_HOMES + "/*"]  # made by home_for(), not by a command
        watch = changes.Watch(layers.LAYERS, {"files": True, "containers": containers}, None, True)
        _WATCH.append(watch)
        _harden(req)
        srv = socket.socket(fileno=listen_fd)
        _send(conn, {"ready": os.getpid()})
        conn.close()
        _serve_forever(srv, watchdog_fd, req["env"], tuple(req["user"]))
    except BaseException as exc:
        try:
            sys.stderr.write("pytest-boxlite agent: the forked box could not start: %r\n" % (exc,))
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    # First of all: nothing in the box may ptrace us or open our descriptors through /proc.
    _check(_libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    listen_fd = int(cfg["listen_fd"])
    watchdog_fd = int(cfg["watchdog_fd"])
    _PRIVATE_FDS.extend([listen_fd, watchdog_fd])
    for fd in _PRIVATE_FDS:
        os.set_inheritable(fd, False)
    _seal_proc()
    _hide_spare_proc()
    _harden(cfg)
    _load_helper(cfg["helper"])
    srv = socket.socket(fileno=listen_fd)
    # Tell the host we are ready: it waits for this line on our stdout.
    sys.stdout.write("ready %d\n" % os.getpid())
    sys.stdout.flush()
    if cfg.get("zygote"):
        _zygote(cfg, srv, watchdog_fd)
    _serve_forever(srv, watchdog_fd, cfg["env"], tuple(cfg["user"]))


if __name__ == "__main__":
    main()
