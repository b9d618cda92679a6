"""``python -m pytest_boxlite.boxproc``: run one command inside a box of its own.

Used for ``--boxlite-scope=worker``.  Two ways:

* ``boxproc [options] -- COMMAND``: create a box, run COMMAND in it with this process's own
  stdin/stdout/stderr (binary-clean, no copying), destroy the box when it ends.  The whole
  session in one box (``--boxlite-scope=worker`` without ``-n``) runs this way.
* ``boxproc [options] --serve-fd N``: a *box server* for one xdist worker slot, accepting on the
  listening Unix socket it inherits as descriptor N.  The controller starts one per local worker
  when it configures (a fork of the controller that calls :func:`main`, where that is safe: see
  :class:`pytest_boxlite.xdist_support.WorkerBoxServers`), so the boxes boot side by side and
  ahead of time, instead of one after the other inside xdist's gateway set-up (which waits for
  each worker's interpreter before starting the next).  The worker's gateway command is then the
  small :mod:`pytest_boxlite.guest.attach` client with ``--via SOCKET``: it hands its
  stdin/stdout/stderr to this server, which runs the worker in the box already booted.  After a
  worker ends its box is destroyed; a restarted worker (``--max-worker-restart``) gets a new one.

Either way this process owns the box: it takes an owner lock, and destroys the box when the
command ends, when the client hangs up, or when it gets SIGTERM/SIGHUP.  A server also ends when
its parent (the controller) dies.  If this process is killed, the box's watchdog ends the box and
the next session's reconciliation removes what is left.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path

from pytest_boxlite import ledger
from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.runtimes import LOCAL_KINDS, open_runtime
from pytest_boxlite.runtimes.base import BoxHandle, Runtime
from pytest_boxlite.spec import DEFAULT_ENV_DENY, BoxSpec, worker_env

#: Bound on a client's request line (its argv): it is our own client, but the socket is a file.
MAX_REQUEST = 64 * 1024
#: How often a waiting server looks at its parent (PR_SET_PDEATHSIG is what ends it in time).
PARENT_CHECK = 1.0
#: How long a worker may take to end after its box was destroyed under it.
END_GRACE = 10.0
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
#: A box server's name in the process table (``/proc/PID/comm``; at most 15 bytes).
SERVER_NAME = b"boxlite-server"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pytest_boxlite.boxproc")
    parser.add_argument("--home", required=True)
    parser.add_argument("--session", required=True, help="session id: the box's name carries it")
    parser.add_argument("--runtime", required=True, choices=LOCAL_KINDS)
    parser.add_argument("--image", required=True)
    parser.add_argument("--cpus", type=int)
    parser.add_argument("--memory", type=int)
    parser.add_argument("--network", action="store_true")
    parser.add_argument("--mount", action="append", default=[])
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE set in the box")
    parser.add_argument(
        "--env-deny", action="append", default=None, help="a pattern of host variables the box does not see"
    )
    parser.add_argument("--cwd")
    parser.add_argument("--boot-timeout", type=float, default=120.0)
    parser.add_argument(
        "--serve-fd", type=int, metavar="N", help="serve worker boxes to attach clients on the listening socket N"
    )
    parser.add_argument(
        "--serve-dir", metavar="DIR", help="the directory of the box servers, removed when a signal ends this one"
    )
    parser.add_argument(
        "--parent", type=int, metavar="PID", help="the controller whose death ends this server (default: the parent)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser


class _Boxes:
    """This process's owner lock, runtime and boxes, all made from one set of arguments."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.home = Path(args.home)
        self.owner = f"{args.session}-p{os.getpid()}"
        env = tuple((k, v) for k, _, v in (e.partition("=") for e in args.env))
        self.spec = BoxSpec(
            image=args.image,
            cpus=args.cpus,
            memory_mib=args.memory,
            network=args.network,
            env=env,
            mounts=tuple(args.mount),
            # The worker runs as the host user, as it would locally (root only where the host is root).
            user=f"{os.getuid()}:{os.getgid()}",
        )
        deny = DEFAULT_ENV_DENY if args.env_deny is None else tuple(p for p in args.env_deny if p)
        self.guest_env = worker_env(self.spec, deny)
        self.lock = ledger.OwnerLock(self.home, self.owner)
        self.runtime: Runtime | None = None
        self.made = 0

    def __enter__(self) -> _Boxes:
        self.lock.acquire()
        return self

    def create(self) -> BoxHandle:
        if self.runtime is None:
            self.runtime = open_runtime(self.args.runtime, self.home, self.owner)
        self.made += 1
        return self.runtime.create_box(self.spec, f"pbx-{self.owner}-{self.made}", timeout=self.args.boot_timeout)

    def __exit__(self, *exc: object) -> None:
        if self.runtime is not None:
            self.runtime.close()
        self.lock.release()


def _destroy(box: BoxHandle | None) -> None:
    if box is None:
        return
    # SIGTERM/SIGHUP exit through the cleanup, which destroys this box again: held off until this
    # destroy is done, so that it is never cut short halfway (a box record left behind; a box's
    # destroy runs once, so the cleanup's second call would not finish it).  Blocking the signals
    # in this thread is not enough: the kernel then hands them to another thread (a server's
    # worker thread), and Python runs the handler in this one all the same.  So the handler
    # itself waits (_exit_on_signal) until the destroy is done.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGHUP})
    _destroying.append(box.name)
    try:
        box.destroy()
    except Exception as exc:  # noqa: BLE001 - said; the box's watchdog and the next reconcile get the rest
        _failed.append(box.name)
        print(f"pytest-boxlite: could not destroy box {box.name}: {exc}", file=sys.stderr)
    finally:
        _destroying.pop()
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    if _deferred and not _destroying:
        sys.exit(128 + _deferred.pop())


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.serve_fd is not None and command:
        parser.error("--serve-fd takes no command: its clients name theirs")
    if args.serve_fd is None and not command:
        parser.error("no command given")
    # SIGTERM/SIGHUP must run the cleanup below, not end this process on the spot.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    with _Boxes(args) as boxes:
        if args.serve_fd is None:
            return _run_one(boxes, command)
        return _serve(boxes, args.serve_fd, args.serve_dir, args.parent or os.getppid())


#: The signal that ended this process, if one did (SIGTERM, SIGHUP).
_ended_by: list[int] = []
#: The boxes being destroyed now (see _destroy), and a signal that came meanwhile.
_destroying: list[str] = []
_deferred: list[int] = []
#: The boxes whose destroy failed: their server keeps its log, which says why.
_failed: list[str] = []


def _exit_on_signal(signum: int, frame: object) -> None:
    _ended_by.append(signum)
    if _destroying:
        _deferred.append(signum)  # exits when the destroy is done
        return
    sys.exit(128 + signum)


def _run_one(boxes: _Boxes, command: list[str]) -> int:
    box = None
    try:
        box = boxes.create()
        # The command inherits SIGINT from the terminal's process group; so do we: let the box handle it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        code = box.run_attached(command, cwd=boxes.args.cwd, env=boxes.guest_env)
        return 128 - code if code < 0 else code
    except BoxliteError as exc:
        print(f"pytest-boxlite: could not run the worker in a box: {exc}", file=sys.stderr)
        return 3
    finally:
        _exiting()
        _destroy(box)


def _exiting() -> None:
    """On the way out: SIGTERM/SIGHUP no longer interrupt the cleanup (one already started it)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


# -- the box server ---------------------------------------------------------------------------------


def _serve(boxes: _Boxes, fd: int, directory: str | None, parent: int) -> int:
    # Descriptors 0-2 become each worker's own while it runs: this server's messages (and a
    # traceback) go to its log, the stderr it was started with, whatever 2 is at the time.
    sys.stderr = open(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    # The controller's death (even kill -9) ends this server, whose exit destroys its box.  A
    # name of its own in the process table (a forked server's command line is the controller's).
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        libc.prctl(_PR_SET_NAME, SERVER_NAME)
    if os.getppid() != parent:
        return 0  # the controller died before the signal above was asked for: nothing to serve
    # Ctrl-C reaches the whole terminal's process group: the controller decides what ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The controller made and bound the socket (in a directory only its user can enter) before
    # starting this process, so a worker that connects early never finds it missing.
    listener = socket.socket(fileno=fd)
    box: BoxHandle | None = None
    error: str | None = None
    try:
        try:
            box = boxes.create()  # ahead of the worker that will use it: the point of serving
        except BoxliteError as exc:
            error = str(exc)
        while os.getppid() == parent:
            ready, _, _ = select.select([listener], [], [], PARENT_CHECK)
            if not ready:
                continue
            conn, _ = listener.accept()
            with conn:
                if box is None and error is None:
                    try:
                        box = boxes.create()
                    except BoxliteError as exc:
                        error = str(exc)
                _serve_client(conn, box, error, boxes)
            # One worker per box: a restarted worker gets a new one.
            _destroy(box)
            box, error = None, None
        return 0
    finally:
        _exiting()
        _destroy(box)
        listener.close()
        if directory and _ended_by and not _failed:
            # Told to end: by the controller's stop (which removes the directory too), or by the
            # controller's death (PR_SET_PDEATHSIG; then nobody else removes its sockets and logs).
            # Not on a crash, nor after a destroy that failed: the log, with the traceback or the
            # reason, is what the worker's client quotes and what is left to look at.
            # (Whether the parent died cannot be told from getppid(): while the dying controller
            # has threads left, this process is first handed to one of them, same pid.)
            shutil.rmtree(directory, ignore_errors=True)


def _send(conn: socket.socket, message: dict[str, object]) -> None:
    with contextlib.suppress(OSError):
        conn.sendall((json.dumps(message) + "\n").encode())


def _serve_client(conn: socket.socket, box: BoxHandle | None, error: str | None, boxes: _Boxes) -> None:
    """Run one client's command in ``box`` with the client's stdio; answer its exit status."""
    if not _same_user(conn):
        return  # not our user's client (the directory should have kept it out): say nothing to it
    conn.settimeout(10.0)
    try:
        data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
    except OSError:
        return
    try:
        request = json.loads(data.decode()) if data.endswith(b"\n") else None
        argv = request.get("argv") if isinstance(request, dict) else None
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)) or len(fds) != 3:
            _send(conn, {"error": "malformed request to the worker's box server"})
            return
        if box is None:
            _send(conn, {"error": error or "no box"})
            return
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
    finally:
        for fd in fds:
            os.close(fd)
    outcome: dict[str, object] = {}
    # The worker's end wakes the wait below at once (a timed poll would hold every worker's exit
    # status, and with it xdist's shutdown, for up to its period).
    ended_r, ended_w = os.pipe()

    def run() -> None:
        try:
            outcome["exit"] = box.run_attached(argv, cwd=boxes.args.cwd, env=boxes.guest_env)
        except BoxliteError as exc:
            outcome["error"] = str(exc)
        except BaseException as exc:  # noqa: BLE001 - reported to the client, which exits with it
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            os.close(ended_w)

    worker = threading.Thread(target=run, name="boxlite-worker-box", daemon=True)
    worker.start()
    conn.settimeout(None)
    try:
        # The client speaks again only to pass on a signal (SIGINT, SIGTERM, SIGHUP), or hangs up
        # when it dies: either way the worker must end, and destroying its box ends it.
        while worker.is_alive():
            ready, _, _ = select.select([conn.fileno(), ended_r], [], [], 0.5)
            if conn.fileno() in ready:
                with contextlib.suppress(OSError):
                    conn.recv(4096)
                _destroy(box)
                worker.join(END_GRACE)
                break
            if ended_r in ready:
                worker.join(END_GRACE)
    finally:
        os.close(ended_r)
    # The worker's pipes live on only in the box: let go of them here.
    for target in (0, 1, 2):
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, target)
        os.close(null)
    _send(conn, {"exit": outcome["exit"]} if "exit" in outcome else {"error": outcome.get("error", "the box ended")})


def _same_user(conn: socket.socket) -> bool:
    import struct

    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return bool(uid == os.getuid())


if __name__ == "__main__":
    sys.exit(main())
