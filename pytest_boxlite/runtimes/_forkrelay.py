"""The host end of a VM's fork relay: forked boxes in a VM reach the host's fork listener.

On namespace boxes a forked box connects to a host socket made visible in the box.  A VM guest
can reach the host only through the SDK's exec streams, so one guest command per fork parent,
:mod:`pytest_boxlite.guest.relay`, listens on a guest socket and multiplexes each forked box's
connection over its stdio (binary-clean through the box's stdio bridge); this side opens one
connection to the host listening socket per guest connection and pumps bytes both ways.  The
host's :class:`~pytest_boxlite.remote.worker_host.ForkedBoxes` then accepts and reads those
connections exactly as it does a namespace box's.

Every byte from the guest is hostile: a frame of an unknown kind or longer than
:data:`~pytest_boxlite.guest.relay.MAX_PAYLOAD` ends the relay (the stream cannot be
resynchronised), frames for unknown connection ids are dropped, at most
:data:`~pytest_boxlite.guest.relay.MAX_CONNS` connections are relayed at once, and nothing the
guest sends is used as a host path (the guest's socket directory is chosen here).  Every wait is
bounded, and :meth:`ForkRelay.close` ends the guest command, the threads and the sockets.

The host socket's only clients are this relay's own connections, so both ends check their peer
with ``SO_PEERCRED`` before a byte flows: the listener (:class:`_RelayListener`) hands the runner
only connections made by this very process (another process, of any user, is closed unread and
logged, a bounded number of lines), and each relayed connection carries bytes only once the
socket it reached is this process's own listener.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from pytest_boxlite import guest
from pytest_boxlite._tidy import remove_own_dir
from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.guest.relay import CLOSE, DATA, HEADER, KINDS, MAX_CONNS, MAX_PAYLOAD, OPEN, READY

#: Bound on the guest relay's start (the READY frame), in seconds.
START_TIMEOUT = 30.0
#: Bound on handing bytes to a host connection the runner does not read (it reads all it gets).
SEND_TIMEOUT = 30.0
#: Bound on each thread's end when the relay closes.
JOIN_TIMEOUT = 5.0
#: Connections of other processes one listener logs, one line each; later ones are counted.
LOGGED_STRANGERS = 8

_log = logging.getLogger(__name__)


class RelayError(BoxliteError):
    """The guest's side of the relay broke the protocol or would not start."""


class ForkRelay:
    """One guest relay command and the host threads that carry its connections.

    ``attach_argv`` turns a guest argv into a host command with that command's stdio (the VM
    box's :meth:`~pytest_boxlite.runtimes.vm.VmBox.attach_argv`); ``guest_python`` runs the relay.
    :attr:`listener` is the socket the host accepts forked boxes on; :attr:`guest_path` the path
    they connect to in the guest.
    """

    def __init__(
        self,
        attach_argv: Callable[[Sequence[str]], list[str]],
        guest_python: str,
        *,
        guest_dir: str | None = None,
        start_timeout: float = START_TIMEOUT,
    ) -> None:
        self._host_dir = tempfile.mkdtemp(prefix="boxlite-relay-")  # 0700
        self._host_path = os.path.join(self._host_dir, "fork.sock")
        self.listener = _RelayListener(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.relay = self
        self._closed = False
        self._lock = threading.Lock()  # the connection table; never held while blocked
        self._write_lock = threading.Lock()  # frames to the guest, one at a time
        self._conns: dict[int, socket.socket] = {}
        self._threads: list[threading.Thread] = []
        self.error: str | None = None
        self._ready = False  # the guest relay said it listens
        guest_dir = guest_dir or f"/run/boxlite-relay-{secrets.token_hex(8)}"
        self.guest_path = f"{guest_dir}/fork.sock"
        try:
            self.listener.bind(self._host_path)
            self.listener.listen(MAX_CONNS)
            argv = attach_argv([guest_python, "-I", "-S", "-c", guest.source("relay"), guest_dir])
            self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0
            )
            assert self._proc.stdin is not None
            os.set_blocking(self._proc.stdin.fileno(), False)  # writes are bounded: see _send
        except BaseException:
            self.listener.relay = None
            self.listener.close()
            remove_own_dir(self._host_dir, "the fork relay's directory")
            raise
        self._spawn(self._drain_stderr, "stderr")
        started = threading.Event()
        self._reader = self._spawn(lambda: self._read(started), "reader")
        if not started.wait(start_timeout) or not self._ready:
            why = self.error or f"no answer within {start_timeout:.0f}s"
            self.close()
            raise RelayError(f"the fork relay did not start in the box: {why}")

    # -- the guest's stream ---------------------------------------------------------------
    def _read(self, started: threading.Event) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        stream = self._proc.stdout
        try:
            while True:
                header = _read_exact(stream, HEADER.size)
                if header is None:
                    return  # the relay ended
                kind, cid, length = HEADER.unpack(header)
                if kind not in KINDS or length > MAX_PAYLOAD:
                    raise RelayError(f"bad frame from the box (kind {kind}, {length} bytes)")
                payload = _read_exact(stream, length) if length else b""
                if payload is None:
                    return
                if kind == READY:
                    self._ready = True
                    started.set()
                elif kind == OPEN:
                    self._open(cid)
                elif kind == DATA:
                    self._to_host(cid, payload)
                else:
                    self._drop(cid, tell_guest=False)
        except (RelayError, OSError, ValueError) as exc:
            self.error = str(exc)
            # A relay that broke the protocol says nothing more: its attach helper goes, and with
            # it (the bridge kills the command's group when its client hangs up) the guest relay.
            with contextlib.suppress(OSError):
                self._proc.kill()
        finally:
            started.set()
            self._end_guest()

    def _open(self, cid: int) -> None:
        with self._lock:
            if cid in self._conns or len(self._conns) >= MAX_CONNS or self._closed:
                refused = True
            else:
                refused = False
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._conns[cid] = conn
        if refused:
            self._send(_frame(CLOSE, cid))
            return
        try:
            conn.settimeout(SEND_TIMEOUT)
            conn.connect(self._host_path)
            if peer(conn) != (os.getpid(), os.geteuid()):
                raise ConnectionRefusedError("the fork socket is not this process's listener")
        except OSError:
            self._drop(cid, tell_guest=True)
            return
        self._spawn(lambda: self._from_host(cid, conn), f"conn-{cid}")

    def _to_host(self, cid: int, payload: bytes) -> None:
        with self._lock:
            conn = self._conns.get(cid)
        if conn is None:
            return  # unknown or already closed: dropped
        try:
            conn.sendall(payload)
        except OSError:
            self._drop(cid, tell_guest=True)

    def _from_host(self, cid: int, conn: socket.socket) -> None:
        """Pump one host connection's bytes to the guest until either end closes it."""
        while True:
            try:
                conn.settimeout(None)  # in the loop: a connection dropped meanwhile is closed here
                data = conn.recv(MAX_PAYLOAD)
            except OSError:
                data = b""
            if not data:
                self._drop(cid, tell_guest=True)
                return
            if not self._send(_frame(DATA, cid, data)):
                self._drop(cid, tell_guest=False)
                return

    def _drop(self, cid: int, *, tell_guest: bool) -> None:
        with self._lock:
            conn = self._conns.pop(cid, None)
        if conn is None:
            return
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)  # wakes its pump thread
        conn.close()
        if tell_guest:
            self._send(_frame(CLOSE, cid))

    def _send(self, data: bytes) -> bool:
        """Write one frame to the guest relay's stdin, bounded by :data:`SEND_TIMEOUT`: a guest
        that stops reading is ended (it cannot hold a thread, nor :meth:`close`, for ever)."""
        proc = self._proc
        if proc is None or proc.stdin is None:
            return False
        view = memoryview(data)
        deadline = time.monotonic() + SEND_TIMEOUT
        with self._write_lock:
            try:
                fd = proc.stdin.fileno()
                while view:
                    _, ready, _ = select.select([], [fd], [], max(0.0, deadline - time.monotonic()))
                    if not ready:
                        self.error = f"the box's fork relay read nothing for {SEND_TIMEOUT:.0f}s"
                        proc.kill()
                        return False
                    view = view[os.write(fd, view) :]
            except (OSError, ValueError):
                return False
        return True

    def _drain_stderr(self) -> None:
        """Keep the last of what the guest relay says (why it ended), never blocking it."""
        assert self._proc is not None and self._proc.stderr is not None
        tail = b""
        while chunk := os.read(self._proc.stderr.fileno(), 4096):
            tail = (tail + chunk)[-2000:]
        if tail.strip() and self.error is None and not self._closed:
            self.error = tail.decode("utf-8", "replace").strip()

    def _end_guest(self) -> None:
        """The guest relay is gone or broken: end every connection, so the runner sees each end."""
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _spawn(self, target: Callable[[], None], what: str) -> threading.Thread:
        t = threading.Thread(target=target, name=f"boxlite-forkrelay-{what}", daemon=True)
        t.start()
        self._threads.append(t)
        return t

    # -- the end --------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Whether the guest relay still runs."""
        return self._proc is not None and self._proc.poll() is None and self.error is None

    def close(self) -> None:
        """End the guest relay (its stdin closes; killed if it lingers), the threads and the sockets."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.listener.relay = None
        self.listener.close()
        proc = self._proc
        if proc is not None:
            # The descriptor is closed only with no frame half-written to it (nor its number reused
            # under a writer): a writer stuck on a guest that reads nothing ends once it is killed.
            if not self._write_lock.acquire(timeout=JOIN_TIMEOUT):
                proc.kill()
                self._write_lock.acquire()
            try:
                with contextlib.suppress(OSError, ValueError):
                    assert proc.stdin is not None
                    proc.stdin.close()  # the relay's cue to end
            finally:
                self._write_lock.release()
            try:
                proc.wait(JOIN_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()  # the attach helper: the bridge then kills the guest command's group
                proc.wait(JOIN_TIMEOUT)
        self._end_guest()
        for t in list(self._threads):
            if t is not threading.current_thread():
                t.join(JOIN_TIMEOUT)
        if proc is not None:
            for f in (proc.stdout, proc.stderr):
                if f is not None:
                    f.close()
        remove_own_dir(self._host_dir, "the fork relay's directory")


class _RelayListener(socket.socket):
    """The fork listener handed to the runner: closing it (when the runner is done with the fork
    parent) ends its relay too."""

    relay: ForkRelay | None = None
    #: Connections made by another process: closed unread (see the module docstring).
    strangers = 0

    def accept(self) -> tuple[socket.socket, Any]:
        """The next connection made by this process (a relayed one); any other is closed unread."""
        while True:
            conn, addr = super().accept()
            try:
                who = peer(conn)
            except OSError:
                who = None
            if who == (os.getpid(), os.geteuid()):
                return conn, addr
            conn.close()
            self.strangers += 1
            if self.strangers <= LOGGED_STRANGERS:
                pid, uid = who if who is not None else (-1, -1)
                _log.warning(
                    "the VM fork relay's host socket refused a connection from pid %d (uid %d): only the relay "
                    "itself (pid %d) may connect%s",
                    pid,
                    uid,
                    os.getpid(),
                    "; later ones are counted, not logged" if self.strangers == LOGGED_STRANGERS else "",
                )

    def close(self) -> None:
        relay, self.relay = self.relay, None
        super().close()
        if relay is not None:
            relay.close()


def peer(conn: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of the Unix socket ``conn`` (``SO_PEERCRED``)."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def _frame(kind: int, cid: int, payload: bytes = b"") -> bytes:
    """One frame's bytes (the guest relay's own layout)."""
    return HEADER.pack(kind, cid, len(payload)) + payload


def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    """``n`` bytes from ``stream`` (unbuffered: reads may be short), or ``None`` at its end (a
    partial frame included)."""
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data
