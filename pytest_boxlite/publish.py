"""Published box ports (``Sandbox.publish``): a host-owned TCP relay into a box's own loopback.

How it works, and why: ``docs/explanation/internals/publish.md``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import socket
import struct
import sys
import threading
from collections.abc import Callable

from pytest_boxlite._shown import shown
from pytest_boxlite.errors import BoxliteError

__all__ = ["LOGGED_REFUSALS", "MAX_CONNECTIONS", "Relay", "peer_uid"]

_log = logging.getLogger(__name__)

#: Connections one published port relays at once; more are accepted and closed at once.
MAX_CONNECTIONS = 64
#: How long the box may take to connect one relayed connection to its port.
CONNECT_TIMEOUT = 5.0
#: The copy buffer of one direction of one connection: with :data:`MAX_CONNECTIONS`, a published
#: port holds at most 2 x 64 x 512 KiB = 64 MiB of the box's bytes.
_BUFFER = 512 << 10
#: Connections of other users one published port logs, one line each; later ones are counted.
LOGGED_REFUSALS = 8
#: The kernel's socket tables, searched for a connection's far end (a dual-stack client is in tcp6).
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")

Connect = Callable[[float], socket.socket]


class Relay:
    """Relays ``127.0.0.1:<host_port>`` to ``port`` on a box's loopback (see the module docstring)."""

    def __init__(self, connect: Connect, *, box: str, port: int) -> None:
        self._connect = connect
        self.box = box
        self.port = port
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.bind(("127.0.0.1", 0))
            self._listener.listen(64)
        except BaseException:
            self._listener.close()
            raise
        self.host, self.host_port = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        #: Connections refused because nothing listened in the box, or the relay was full.
        self.refused = 0
        #: Connections closed unserved because another user's process made them (module docstring).
        self.strangers = 0
        self._uid = os.geteuid()
        self._thread = threading.Thread(target=self._accept, name=f"boxlite-relay-{box}-{port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` to connect to on the host."""
        return self.host, self.host_port

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            # Before any byte either way: only this user's processes are served.
            owner = peer_uid(client)
            if owner != self._uid:
                client.close()
                self._refuse_stranger(owner)
                continue
            with self._lock:
                if self._closed or len(self._open) >= 2 * MAX_CONNECTIONS:
                    self.refused += 1
                    client.close()
                    continue
                self._open.add(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _refuse_stranger(self, owner: int | None) -> None:
        with self._lock:
            self.strangers += 1
            count = self.strangers
        if count > LOGGED_REFUSALS + 1:
            return
        where = f"published port {self.port} of box {shown(self.box, line=True)} (127.0.0.1:{self.host_port})"
        if count > LOGGED_REFUSALS:
            _log.warning("%s: more connections of other users refused; counted, no longer logged", where)
            return
        who = "a socket no process holds any more" if owner is None else f"uid {owner}{_user_name(owner)}"
        _log.warning(
            "%s: refused a connection from %s: only processes of uid %d%s, this session's user, may connect",
            where,
            who,
            self._uid,
            _user_name(self._uid),
        )

    def _serve(self, client: socket.socket) -> None:
        inner: socket.socket | None = None
        try:
            try:
                inner = self._connect(CONNECT_TIMEOUT)
            except (OSError, BoxliteError):
                with self._lock:
                    self.refused += 1
                return
            with self._lock:
                if self._closed:
                    return
                self._open.add(inner)
            _splice(client, inner)
        finally:
            with self._lock:
                for end in (client, inner):
                    if end is not None:
                        self._open.discard(end)
                        end.close()

    def close(self) -> None:
        """Stop listening and cut every relayed connection.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            doomed = list(self._open)
        # shutdown() wakes the threads blocked in accept() and recv(); close() alone would not.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in doomed:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(5.0)


def _user_name(uid: int) -> str:
    """`` (name)`` of ``uid``'s account, or nothing when it has none."""
    try:
        return f" ({shown(pwd.getpwuid(uid).pw_name, line=True)})"
    except (KeyError, OSError):
        return ""


def _words(family: socket.AddressFamily, host: str) -> bytes:
    """The 16 address bytes of ``host`` as sockets of ``family`` hold them (IPv4 v4-mapped in IPv6)."""
    if family == socket.AF_INET:
        return socket.inet_aton(host) + bytes(12)
    return socket.inet_pton(socket.AF_INET6, f"::ffff:{host}")


def _table_address(family: socket.AddressFamily, host: str, port: int) -> bytes:
    """``host:port`` as the kernel's socket tables print it: each 32-bit word of the address in
    this machine's byte order, in hex; an IPv4 address v4-mapped for ``tcp6``."""
    raw = _words(family, host)[: 4 if family == socket.AF_INET else 16]
    words = "".join(f"{int.from_bytes(raw[i : i + 4], sys.byteorder):08X}" for i in range(0, len(raw), 4))
    return f"{words}:{port:04X}".encode()


_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_NLMSG = struct.Struct("=IHHII")  # struct nlmsghdr
_DIAG_REQ = struct.Struct("=BBBBI")  # struct inet_diag_req_v2, up to its socket id
_SOCKID_PORTS = struct.Struct("!HH")
_NOCOOKIE = struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF)  # idiag_if, then INET_DIAG_NOCOOKIE
_DIAG_OWNER = struct.Struct("=II")  # inet_diag_msg's idiag_uid and idiag_inode, at offset 64
#: Whether this kernel answers sock_diag lookups (probed once: :func:`_sock_diag_works`).
_sock_diag: bool | None = None


def _diag(family: socket.AddressFamily, far: tuple[str, int], near: tuple[str, int]) -> tuple[int, int] | None:
    """``(uid, inode)`` of the TCP socket whose local end is ``far`` and remote end ``near``, asked
    of the kernel by its four addresses (``NETLINK_SOCK_DIAG``: one exact lookup, not a walk of
    every socket); ``None`` when there is none.  ``OSError`` when the kernel cannot answer."""
    sockid = _SOCKID_PORTS.pack(far[1], near[1]) + _words(family, far[0]) + _words(family, near[0])
    body = _DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid + _NOCOOKIE
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(2.0)
        nl.sendto(_NLMSG.pack(_NLMSG.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + body, (0, 0))
        data = nl.recv(4096)
    if len(data) < _NLMSG.size + 4:
        raise OSError(errno.EPROTO, "a short answer from sock_diag")
    _length, kind, _flags, seq, _pid = _NLMSG.unpack_from(data)
    if kind == _NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, _NLMSG.size)[0]
        if code == errno.ENOENT:
            return None
        raise OSError(code, os.strerror(code))
    if kind != _SOCK_DIAG_BY_FAMILY or seq != 1 or len(data) < _NLMSG.size + 72:
        raise OSError(errno.EPROTO, "an unexpected answer from sock_diag")
    # The socket found must be the one asked for (the kernel falls back to a listener on far's
    # address when no connection has those four addresses).
    if data[_NLMSG.size + 4 : _NLMSG.size + 4 + len(sockid)] != sockid:
        return None
    uid, inode = _DIAG_OWNER.unpack_from(data, _NLMSG.size + 64)
    return uid, inode


def _sock_diag_works() -> bool:
    """Whether :func:`_diag` finds a connection this process holds (the kernel's ``tcp_diag``
    may be missing, or netlink refused, in a container): else the socket tables are read."""
    global _sock_diag
    if _sock_diag is None:
        try:
            with (
                socket.create_server(("127.0.0.1", 0)) as srv,
                socket.create_connection(srv.getsockname(), timeout=2.0) as client,
            ):
                found = _diag(socket.AF_INET, client.getsockname()[:2], client.getpeername()[:2])
                _sock_diag = found is not None and found[1] != 0
        except OSError:
            _sock_diag = False
    return _sock_diag


def peer_uid(conn: socket.socket) -> int | None:
    """The effective uid (as this process sees uids) that made the socket at the far end of
    ``conn``, a TCP connection accepted on this host's IPv4 loopback; ``None`` when no socket
    held by a process is there: closed already (a closed socket keeps no owner: its TIME-WAIT
    entry says uid 0), or none found.  Asked of the kernel by the connection's four addresses
    (``sock_diag``), else read from its socket tables, where the far end is the one entry whose
    local and remote addresses are ``conn``'s remote and local ones (see the module docstring)."""
    try:
        near = conn.getsockname()[:2]
        far = conn.getpeername()[:2]
    except OSError:
        return None  # already reset
    if _sock_diag_works():
        for family in (socket.AF_INET, socket.AF_INET6):
            try:
                found = _diag(family, far, near)
            except OSError:
                return None  # the kernel could not say: nobody proven
            if found is not None:
                uid, inode = found
                return uid if inode else None  # no inode: closed
        return None
    return _table_uid(far, near)


def _table_uid(far: tuple[str, int], near: tuple[str, int]) -> int | None:
    """:func:`peer_uid` from ``/proc/net/tcp`` (and ``tcp6``): a walk of every socket's line."""
    for family, table in zip((socket.AF_INET, socket.AF_INET6), _TABLES, strict=True):
        local = _table_address(family, *far)
        remote = _table_address(family, *near)
        try:
            with open(table, "rb") as lines:
                next(lines, None)  # the header
                for line in lines:
                    fields = line.split()
                    if len(fields) < 10 or fields[1] != local or fields[2] != remote:
                        continue
                    if fields[9] == b"0":
                        return None  # no inode: closed (TIME-WAIT shows uid 0 for any owner)
                    return int(fields[7])
        except (OSError, ValueError):
            continue  # no such table (IPv6 off): the other one decides
    return None


def _splice(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways between two connected sockets (one thread per direction, this one's
    included) until both directions have ended."""
    for sock in (a, b):
        # Blocking: a socket with a timeout (a runtime's connect) would time the copy out.
        sock.setblocking(True)
        with contextlib.suppress(OSError):  # a runtime's box end may be a Unix socket (vm)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_copy, args=(b, a), daemon=True)
    back.start()
    _copy(a, b)
    back.join()


def _copy(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends, then end ``dst``'s writing side.

    Through one buffer of :data:`_BUFFER` bytes (``recv_into``/``sendall``, which release the
    GIL): at most that much of a connection's bytes per direction is in this process.  Measured
    here, this beats ``splice`` through a pipe (more wake-ups per byte).  Any error ends the copy
    (and, through the shutdown, the other direction's peer sees the end).
    """
    buf = bytearray(_BUFFER)
    view = memoryview(buf)
    try:
        while True:
            n = src.recv_into(buf)
            if not n:
                break
            dst.sendall(view[:n])
    except OSError:
        # A reset or a cut (close()): end both directions, so the other copy wakes too.
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
    finally:
        view.release()
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
