"""The double's in-box agent: the part of BoxLite's guest agent that runs commands.  Standard library only.

It is passed as ``python -I -S -c <source>`` to the first process of the
double's bubblewrap sandbox, so it needs no file in the box.  One connection
is one command: ``{"argv", "env", "cwd", "user"}`` with three descriptors
(stdin, stdout, stderr) -> ``{"pid": n}`` or ``{"error": msg, "errno": n}``,
later ``{"exit": code}`` (negative: the signal).  ``{"signal": n}`` from the
host signals the command's **leader only**, as BoxLite's ``KillRequest`` with
``process_group=false`` does: children live on.  The host dying (the
watchdog pipe reads EOF) ends the agent, and with it the sandbox.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading


def _send(conn, obj):
    with contextlib.suppress(OSError):
        conn.sendall((json.dumps(obj) + "\n").encode())


def _user(spec):
    if not spec:
        return {}
    user, _, group = spec.partition(":")
    out = {"user": int(user) if user.isdigit() else user}
    if group:
        out["group"] = int(group) if group.isdigit() else group
    return out


def _serve(conn):
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            return
        data += more
    req = json.loads(data.decode())
    try:
        kwargs = _user(req.get("user"))
        if kwargs.get("user") in (0, "root") and kwargs.get("group") in (None, 0, "root"):
            kwargs = {}
        proc = subprocess.Popen(
            req["argv"],
            stdin=fds[0],
            stdout=fds[1],
            stderr=fds[2],
            cwd=req.get("cwd") or "/",
            env=req["env"],
            close_fds=True,
            restore_signals=True,
            **kwargs,
        )
    except (OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
        _send(conn, {"error": str(exc), "errno": getattr(exc, "errno", None) or 0})
        return
    finally:
        for fd in fds:
            os.close(fd)
    _send(conn, {"pid": proc.pid})

    def relay():
        buf = b""
        while True:
            try:
                chunk = conn.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                with contextlib.suppress(OSError, ValueError, KeyError):
                    os.kill(proc.pid, int(json.loads(line.decode())["signal"]))

    threading.Thread(target=relay, daemon=True).start()
    _send(conn, {"exit": proc.wait()})


def main(argv):
    sock_path, watch_fd = argv[0], int(argv[1])
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(128)

    def watchdog():
        try:
            os.read(watch_fd, 1)
        finally:
            os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1:])
