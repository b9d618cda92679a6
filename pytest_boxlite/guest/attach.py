"""Host-side stdio bridge into a box.  Standard library only; runs as ``python -I -S _attach.py``.

``attach.py SOCKET [--cwd DIR] [--status FILE] [--stderr FILE] [--env JSON] [--user USER] -- ARGV...``
runs ARGV in the box whose agent listens on SOCKET, handing it this process's stdin, stdout and stderr
(SCM_RIGHTS), so the stream is binary-clean and this process copies nothing.
It exits with the command's status (128+N for a signal), and is what an
execnet ``popen//python=...`` gateway (and so an xdist worker) runs to live
inside a box.  If this process dies, the agent kills the command.
"""

import json
import os
import signal
import socket
import sys


def _connect(path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if len(path.encode()) > 100:
        dirfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            sock.connect("/proc/self/fd/%d/%s" % (dirfd, os.path.basename(path)))
        finally:
            os.close(dirfd)
    else:
        sock.connect(path)
    return sock


def main(argv):
    path = argv[0]
    rest = argv[1:]
    cwd = None
    status_file = None
    stderr_fd = 2
    env = {}
    user = None
    while rest[:1] in (["--cwd"], ["--status"], ["--stderr"], ["--env"], ["--user"]):
        if rest[0] == "--cwd":
            cwd = rest[1]
        elif rest[0] == "--env":
            env = json.loads(rest[1])
        elif rest[0] == "--user":
            user = rest[1]
        elif rest[0] == "--stderr":
            # The box log lives in the host's private control directory; never follow a link there.
            stderr_fd = os.open(rest[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        else:
            status_file = rest[1]
        rest = rest[2:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    sock = _connect(path)
    req = {"op": "exec", "argv": rest, "env": env, "cwd": cwd}
    if user is not None:
        req["user"] = user
    socket.send_fds(sock, [(json.dumps(req) + "\n").encode()], [0, 1, stderr_fd])
    # Our own stdio now lives on in the box; keep nothing that could hold the pipes open.
    for fd in (0, 1):
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, fd)
        os.close(null)

    def forward(signum, frame):
        try:
            sock.sendall((json.dumps({"signal": signum}) + "\n").encode())
        except OSError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    buf = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except InterruptedError:
            continue
        if not chunk:
            return 255  # the box is gone (destroyed or crashed); the caller sees the channel close
        buf = (buf + chunk)[-65536:]  # the agent's lines are short: never grow without bound
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                msg = json.loads(line.decode())
            except ValueError:
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
