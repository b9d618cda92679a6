"""Boxed tests reach services: a service's host address, reachable from inside a box whose
network is off (issue 24, "Boxed tests reach services too").

How it works, and why: ``docs/explanation/internals/reach.md``.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pytest_boxlite.errors import BoxliteError, ConfigError
from pytest_boxlite.publish import _splice

__all__ = [
    "MAX_CONNECTIONS",
    "BoxGone",
    "Offer",
    "ReachError",
    "close_box",
    "listen_in",
    "prepare",
    "prepare_booted",
    "prepare_forked",
    "targets_of",
]

#: Connections one offer relays at once (per test box and service address); more are closed at once.
MAX_CONNECTIONS = 32
#: How long the host waits to connect to the service for one relayed connection.
CONNECT_TIMEOUT = 5.0
#: Bound on the helper that makes the listening socket in the box's network.
HELPER_TIMEOUT = 10.0
#: Offers per test box (each is a listener and a thread on the host).
MAX_OFFERS = 64
_SO_PEERPIDFD = 77  # Linux 6.5+ (socket.SO_PEERPIDFD from Python 3.13)
_LOOPBACK = "127.0.0.1"

#: The helper: enter the namespaces of the process of the pidfd, listen there, hand the socket
#: back, exit.  Run with -I -S: it imports nothing from the project or the user's site.
#: The helper: a small single-threaded process of this host's (started once per host process, on
#: first use) that, per request (a pidfd and ports), forks a child; the child enters the
#: namespaces of the pidfd's process, listens there, hands the sockets back and exits.  Its
#: requests come only from this process (a socketpair); it ends when this process closes it.
_HELPER = r"""
import ctypes, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG SIGKILL: never outlives the host process
conn = socket.socket(fileno=int(sys.argv[1]))
def child(pidfd, ports):
    def fail(what):
        conn.sendall(("E%d %s" % (ctypes.get_errno(), what)).encode()); os._exit(1)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0: nothing in the box may ptrace it
        fail("prctl")
    # The user namespace too (an ordinary user holds no capability over the box's network without it).
    if libc.setns(pidfd, 0x10000000 | 0x40000000) != 0:
        first = ctypes.get_errno()
        if libc.setns(pidfd, 0x40000000) != 0:
            fail("setns (user and network: errno %d; network: errno %d)" % (first, ctypes.get_errno()))
    made = []
    for port in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(64)
        except OSError as exc:
            conn.sendall(("E%d bind 127.0.0.1:%d: %s" % (exc.errno or 0, port, exc.strerror)).encode()); os._exit(1)
        made.append(s)  # held: a socket dropped here would be closed before it is sent
    socket.send_fds(conn, [b"OK"], [m.fileno() for m in made])
    os._exit(0)
while True:
    data, fds, _flags, _addr = socket.recv_fds(conn, 4096, 1)
    if not data or len(fds) != 1:
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        try:
            child(fds[0], [int(p) for p in data.decode().split(",")])
        except BaseException as exc:
            conn.sendall(("E0 %r" % (exc,))[:300].encode())
        finally:
            os._exit(1)
    os.close(fds[0])
    os.waitpid(pid, 0)  # one request at a time: its child answers on the same socket
"""


class _Helper:
    """This process's helper (see :data:`_HELPER`), started on first use, restarted if it died."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> socket.socket:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _HELPER, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={"PATH": "/usr/bin:/bin"},
                cwd="/",
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self._conn = mine
        return mine

    def ask(self, pidfd: int, ports: list[int]) -> tuple[bytes, list[int]]:
        with self._lock:
            for attempt in (0, 1):
                conn = self._conn if self._conn is not None else self._start()
                try:
                    conn.settimeout(HELPER_TIMEOUT)
                    socket.send_fds(conn, [",".join(map(str, ports)).encode()], [pidfd])
                    data, fds, _flags, _addr = socket.recv_fds(conn, 512, len(ports))
                except TimeoutError:
                    self._stop()
                    why = f"the helper that listens in boxes did not answer in {HELPER_TIMEOUT:g} s"
                    raise ReachError(why) from None
                except OSError:
                    data, fds = b"", []
                if data or attempt:
                    return data, fds
                self._stop()  # it had died (a broken pipe, no answer): once more with a new one
            return b"", []

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


_helper = _Helper()


class ReachError(BoxliteError):
    """A service's address could not be made reachable in a boxed test's box; the message says why."""


class BoxGone(ReachError):
    """The box's process ended first: nothing to reach into (the box's own end is reported as such)."""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (not ended, not a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _pidfd_pid(pidfd: int) -> int:
    """The pid (in this process's pid namespace) of the process a pidfd refers to; -1 once it exited."""
    for line in Path(f"/proc/self/fdinfo/{pidfd}").read_text().splitlines():
        if line.startswith("Pid:"):
            return int(line.split()[1])
    raise ReachError("this kernel's pidfds do not say their pid")


def listen_in(pidfd: int, ports: list[int]) -> list[socket.socket]:
    """TCP sockets listening on ``127.0.0.1:port`` for each of ``ports`` in the network namespace
    of the process of ``pidfd`` (made by the helper's child; see the module docstring)."""
    data, fds = _helper.ask(pidfd, ports)
    socks = [socket.socket(fileno=fd) for fd in fds]
    why = data[:300].decode("utf-8", "replace")
    if why.startswith("E3 setns"):  # ESRCH: the process of the pidfd has ended
        raise BoxGone(f"the box's process ended before its services could be offered in it ({why})")
    if data == b"OK" and len(socks) == len(ports):
        if all(
            s.family == socket.AF_INET and s.type == socket.SOCK_STREAM and s.getsockname() == (_LOOPBACK, p)
            for s, p in zip(socks, ports, strict=True)
        ):
            return socks
        why = "the helper handed back something other than the listening sockets asked for"
    for sock in socks:
        sock.close()
    raise ReachError(f"could not listen on 127.0.0.1:{', '.join(map(str, ports))} in the box: {why}")


class Offer:
    """Relays connections accepted on ``listener`` (in a box's network) to ``target`` (on the
    host), until ``pidfd``'s process exits or :meth:`close` (see the module docstring)."""

    def __init__(self, listener: socket.socket, target: tuple[str, int], *, pidfd: int, box: str) -> None:
        self.target = (str(target[0]), int(target[1]))
        self.box = box
        self._listener = listener
        self._listener.setblocking(False)
        self._pidfd = os.dup(pidfd)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._active = 0
        self._closed = False
        #: Connections closed at once (the offer was full, or the service refused), and relayed.
        self.refused = 0
        self.relayed = 0
        self._thread = threading.Thread(target=self._accept, name=f"boxlite-reach-{box}-{target[1]}", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def active(self) -> int:
        """Connections being relayed now."""
        with self._lock:
            return self._active

    def _accept(self) -> None:
        try:
            while not self._closed:
                ready, _, _ = select.select([self._listener.fileno(), self._pidfd, self._wake_r], [], [])
                if self._pidfd in ready or self._wake_r in ready:
                    return  # the box's test process ended (or close()): so does the offer
                try:
                    conn, _ = self._listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    return
                with self._lock:
                    full = self._closed or self._active >= MAX_CONNECTIONS
                    if full:
                        self.refused += 1
                    else:
                        self._active += 1
                        self._open.add(conn)
                if full:
                    conn.close()
                    continue
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
        finally:
            self._shut()

    def _serve(self, conn: socket.socket) -> None:
        out: socket.socket | None = None
        try:
            conn.setblocking(True)
            try:
                # The one address this offer was made for; nothing from the box is read first.
                out = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT)
            except OSError:
                with self._lock:
                    self.refused += 1
                return
            with self._lock:
                if self._closed:
                    return
                self._open.add(out)
                self.relayed += 1
            _splice(conn, out)
        finally:
            with self._lock:
                self._active -= 1
                for end in (conn, out):
                    if end is not None:
                        self._open.discard(end)
                        end.close()

    def _shut(self) -> None:
        with self._lock:
            if self._closed and self._listener.fileno() < 0:
                return
            self._closed = True
            doomed = list(self._open)
        self._listener.close()
        for sock in doomed:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for fd in (self._pidfd, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pidfd = self._wake_r = self._wake_w = -1

    def close(self) -> None:
        """Stop listening in the box and cut every relayed connection.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            wake = self._wake_w
        with contextlib.suppress(OSError):
            os.write(wake, b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)


# -- which process: the test process of a forked box -------------------------------------------


def peer_pidfd(conn: socket.socket) -> int:
    """A pidfd of the process that connected ``conn`` (race-free where the kernel has
    ``SO_PEERPIDFD``; else from ``SO_PEERCRED``, while that process holds its end)."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD, 4)
        return int(struct.unpack("i", raw)[0])
    except OSError:
        pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        return os.pidfd_open(pid)


def test_process_pidfd(peer_pidfd: int) -> int:
    """A pidfd of a forked box's test process, from ``peer_pidfd``: the process that connected
    the box's stream, asked for before the test runs (``guest/worker.py``'s ``fork``).  That is
    the test process itself where the box's pid 1 forked it at once (``guest/fresh.py``'s
    ``BareInit``: it has no child yet), or the box's pid 1 where pid 1 forked it after connecting
    (its one child).  ``peer_pidfd`` is returned itself in the first case, a new pidfd in the
    second."""
    ppid = _pidfd_pid(peer_pidfd)
    if ppid <= 0:
        raise ReachError("the box's first process has ended")
    children: list[int] = []
    for task in os.listdir(f"/proc/{ppid}/task"):
        with contextlib.suppress(OSError):
            children += [int(p) for p in Path(f"/proc/{ppid}/task/{task}/children").read_text().split()]
    if not children:
        return peer_pidfd
    if len(children) != 1:
        raise ReachError(f"the box's first process has {len(children)} children, not its one test process")
    fd = os.pidfd_open(children[0])
    try:
        # The pidfd is taken: check it names the child (a pid reused in between would not be).
        stat = Path(f"/proc/{children[0]}/stat").read_text()
        if int(stat.rsplit(")", 1)[1].split()[1]) != ppid or _pidfd_pid(peer_pidfd) != ppid:
            raise ReachError("the box's test process changed while it was looked up")
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- per box: the offers of its test process ---------------------------------------------------

_boxes: dict[str, dict[tuple[str, int], Offer]] = {}
#: A pidfd of each forked box's test process, taken before its first test ran (see :func:`prepare_forked`).
_pidfds: dict[str, int] = {}
_lock = threading.Lock()


def targets_of(descriptions: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The host addresses in services' descriptions (``{name: {"ports": {box port: [host,
    port]}}}``); descriptions of the host's own making, checked all the same."""
    out: list[tuple[str, int]] = []
    for desc in descriptions.values():
        ports = desc.get("ports") if isinstance(desc, Mapping) else None
        if not isinstance(ports, Mapping):
            continue
        for address in ports.values():
            with contextlib.suppress(TypeError, ValueError):
                host, port = address
                ok = isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536
                if host == _LOOPBACK and ok and (host, port) not in out:
                    out.append((host, port))
    return out


def prepare(box: str, pidfd: int, targets: Iterable[tuple[str, int]]) -> list[Offer]:
    """Make each of ``targets`` (services' host addresses on ``127.0.0.1``) reachable at the same
    address in the network of the process of ``pidfd`` (a boxed test's process in box ``box``).
    Idempotent per box and address.  Raises :class:`ReachError` saying why one cannot be."""
    targets = list(targets)
    with _lock:
        # Boxes whose test process ended took their offers with them: forget them.
        for name in [n for n, o in _boxes.items() if n != box and all(x.closed for x in o.values())]:
            del _boxes[name]
        offers = _boxes.setdefault(box, {})
        for k in [k for k, o in offers.items() if o.closed]:
            del offers[k]
        new: list[tuple[str, int]] = []
        for host, port in targets:
            if host != _LOOPBACK:
                raise ConfigError(f"only services on {_LOOPBACK} can be reached from a box, not {host}:{port}")
            if (host, port) not in offers and (host, port) not in new:
                new.append((host, port))
        if len(offers) + len(new) > MAX_OFFERS:
            raise ReachError(f"box {box} would reach more than {MAX_OFFERS} service addresses")
        if new:
            # One helper for all of them: its start is most of an offer's cost.
            for target, listener in zip(new, listen_in(pidfd, [p for _, p in new]), strict=True):
                offers[target] = Offer(listener, target, pidfd=pidfd, box=box)
        made = [offers[(str(h), int(p))] for h, p in targets]
    return made


_NOT_HERE = (
    "this runtime's boxes are not processes of this host (a VM's, a remote server's): a boxed test "
    "cannot reach a service's address there yet; run the test on the host (drop --boxlite or the marker)"
)


def _descends(pid: int, ancestor: int) -> bool:
    """Whether ``ancestor`` is ``pid``'s parent, or its parent's, ... (at most 64 steps)."""
    for _ in range(64):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


def prepare_booted(box: str, agent: int | None, targets: Iterable[tuple[str, int]]) -> list[Offer]:
    """:func:`prepare` for a boxed test run by the warm interpreter of a booted box, whose first
    process (its agent) is ``agent`` on this host: the box's network is the agent's."""
    targets = list(targets)
    if not targets:
        return []
    if agent is None:
        raise ReachError(_NOT_HERE)
    if not _alive(agent):
        raise BoxGone(f"box {box} has ended")
    pidfd = os.pidfd_open(agent)
    try:
        return prepare(box, pidfd, targets)
    finally:
        os.close(pidfd)


def prepare_forked(
    box: str, conn: socket.socket, targets: Iterable[tuple[str, int]], *, agent: int | None
) -> list[Offer]:
    """:func:`prepare` for a box forked from a warm interpreter (in the box whose agent is
    ``agent`` on this host), whose test process (or its pid 1, see :func:`test_process_pidfd`)
    connected ``conn`` (its stream to the host) and waits for its first test: the test process's
    pidfd is taken on the first call, before the box ran any test code, and kept for the box's
    later tests (module scope) until :func:`close_box`."""
    targets = list(targets)
    if not targets:
        return []
    if agent is None:
        raise ReachError(_NOT_HERE)
    if not _alive(agent):
        raise BoxGone(f"the warm box of box {box} has ended")
    with _lock:
        pidfd = _pidfds.get(box)
    if pidfd is None:
        peer = peer_pidfd(conn)
        try:
            pid = _pidfd_pid(peer)
            # The peer is a process of the forked box, a descendant of the warm box's agent (not,
            # say, a relay of the host's): else there is no box process to take the network of.
            if pid <= 0 or not _descends(pid, agent):
                raise ReachError(_NOT_HERE)
            pidfd = test_process_pidfd(peer)
        finally:
            if pidfd != peer:
                os.close(peer)
        with _lock:
            _pidfds[box] = pidfd
    return prepare(box, pidfd, targets)


def close_box(box: str) -> None:
    """End the offers of ``box`` (a test box that is done)."""
    with _lock:
        offers = _boxes.pop(box, {})
        pidfd = _pidfds.pop(box, None)
    for offer in offers.values():
        offer.close()
    if pidfd is not None:
        os.close(pidfd)
