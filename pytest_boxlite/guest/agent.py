"""In-box agent of the namespace runtime.  Standard library only.

Runs as the first process inside a bubblewrap sandbox and listens on a Unix
socket that the host can reach.  One connection is one request:

* ``{"op": "ping"}`` -> ``{"pong": pid}``
* ``{"op": "helper"}`` with three descriptors: like ``exec``, but the file
  helper (:mod:`pytest_boxlite._guest`) runs in a fork of this agent, which
  has it imported already: no interpreter start-up per file operation.
* ``{"op": "exec", "argv": [...], "env": {...}, "cwd": ...}`` sent together
  with three file descriptors (stdin, stdout, stderr) -> ``{"pid": n}`` or
  ``{"error": msg, "errno": n}``, later ``{"exit": code}`` (negative: signal).
  A ``{"signal": n}`` line from the client signals the process group; the
  client hanging up kills it, so no guest process outlives its caller.

The descriptors are passed with SCM_RIGHTS, so the output never travels
through this process: it is binary-clean and costs no copy here.

Watchdog: the agent inherits the read end of a pipe whose write end only the
host process holds.  When the host dies (even by SIGKILL) the pipe reads EOF
and the agent exits, which ends the sandbox, unless the host first wrote
``k`` into that pipe to keep the box for debugging.  Nothing in the box can
ask for that: the control directory is made read-only once the socket exists.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading

DEFAULT_CWD = "/workspace"


def _send(conn, obj):
    conn.sendall((json.dumps(obj) + "\n").encode())


def _read_request(conn):
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 8)
    fds = list(fds)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            break
        data += more
    return json.loads(data.decode()), fds


def _killpg(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _watch_client(conn, proc):
    """Relay signals from the client; kill the process group when it hangs up."""
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
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                sig = int(json.loads(line.decode())["signal"])
            except (ValueError, KeyError, TypeError):
                continue
            _killpg(proc.pid, sig)


def _cwd(req):
    # A test may delete the box's working directory; the box must stay usable.
    return req.get("cwd") or (DEFAULT_CWD if os.path.isdir(DEFAULT_CWD) else "/")


_HELPER = {}


def _load_helper(path):
    """Import the file helper once; forked children inherit it."""
    import importlib
    import importlib.util

    spec = importlib.util.spec_from_file_location("_boxlite_guest_helper", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # What its operations import lazily is imported here, once, for every fork to inherit.
    for name in ("base64", "fnmatch", "io", "re", "shutil", "tarfile"):
        importlib.import_module(name)

    _HELPER["module"] = module


class _ForkedHelper:
    """A fork of the agent running the file helper: a Popen look-alike (pid, poll, wait)."""

    def __init__(self, fds, cwd):
        if not os.path.isdir(cwd):
            raise FileNotFoundError(2, "No such file or directory", cwd)
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                os.setsid()
                for i, fd in enumerate(fds):
                    os.dup2(fd, i)
                os.chdir(cwd)
                sys.stdin = open(0, "r", closefd=False)
                sys.stdout = open(1, "w", closefd=False)
                _HELPER["module"].main()
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        self.pid = pid
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self):
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _serve(conn, base_env):
    fds = []
    try:
        req, fds = _read_request(conn)
        op = req.get("op")
        if op == "ping":
            _send(conn, {"pong": os.getpid()})
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
            if op == "helper":
                proc = _ForkedHelper(fds, _cwd(req))
            else:
                proc = subprocess.Popen(
                    req["argv"],
                    stdin=fds[0],
                    stdout=fds[1],
                    stderr=fds[2],
                    env=env,
                    cwd=_cwd(req),
                    start_new_session=True,
                    close_fds=True,
                )
        except OSError as exc:
            _send(conn, {"error": exc.strerror or str(exc), "errno": exc.errno or 0, "filename": exc.filename})
            return
        for fd in fds:
            os.close(fd)
        fds = []
        _send(conn, {"pid": proc.pid})
        watcher = threading.Thread(target=_watch_client, args=(conn, proc), daemon=True)
        watcher.start()
        code = proc.wait()
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


def _watchdog(fd):
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


def _seal(path):
    """Remount the control directory read-only: a guest must not plant files the host reads."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ms_rdonly, ms_remount, ms_bind = 1, 32, 4096
    libc.mount(None, path.encode(), None, ms_remount | ms_bind | ms_rdonly, None)


def main():
    path = sys.argv[1]
    base_env = json.loads(sys.argv[2])
    watchdog_fd = int(sys.argv[3])
    _load_helper(sys.argv[4])
    threading.Thread(target=_watchdog, args=(watchdog_fd,), daemon=True).start()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    srv.bind(path)
    srv.listen(64)
    _seal(os.path.dirname(path))
    # Tell the host we are ready: it waits for this line on our stdout.
    sys.stdout.write("ready %d\n" % os.getpid())
    sys.stdout.flush()
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_serve, args=(conn, base_env), daemon=True).start()


if __name__ == "__main__":
    main()
