"""Published box ports (``Sandbox.publish``): a host-owned TCP relay into a box's own loopback.

The host listens on ``127.0.0.1:<ephemeral port>``; for each connection it accepts, it asks the
box's runtime for a connection to the published port *on the box's loopback* (made inside the
box's network, so the box needs no network of its own: namespace boxes' agent connects and hands
the socket over), then copies bytes both ways.  The relay never connects anywhere else, holds at
most :data:`MAX_CONNECTIONS` connections and a pipe's worth of bytes per direction (``splice``:
nothing is buffered in Python), and ends with the box.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable

from pytest_boxlite.errors import BoxliteError

__all__ = ["MAX_CONNECTIONS", "Relay"]

#: Connections one published port relays at once; more are accepted and closed at once.
MAX_CONNECTIONS = 128
#: How long the box may take to connect one relayed connection to its port.
CONNECT_TIMEOUT = 5.0
#: Bytes one ``splice`` moves at most (through a pipe sized to it).
_SPLICE = 1 << 20

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
            with self._lock:
                if self._closed or len(self._open) >= 2 * MAX_CONNECTIONS:
                    self.refused += 1
                    client.close()
                    continue
                self._open.add(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

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
            for sock in (client, inner):
                # Blocking descriptors: splice() on one with a timeout (non-blocking) fails EAGAIN.
                sock.setblocking(True)
                with contextlib.suppress(OSError):  # a runtime's box end may be a Unix socket (vm)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            back = threading.Thread(target=_copy, args=(inner, client), daemon=True)
            back.start()
            _copy(client, inner)
            back.join()
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
        # shutdown() wakes the threads blocked in accept() and splice(); close() alone would not.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in doomed:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(5.0)


def _copy(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends, then end ``dst``'s writing side.

    Through a pipe with ``splice``: the bytes never enter this process, and at most a pipe's
    capacity of them is in flight.  Any error ends the copy (and, through the shutdown, the
    other direction's peer sees the end).
    """
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):
            import fcntl

            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _SPLICE)
        sfd, dfd = src.fileno(), dst.fileno()
        while True:
            n = os.splice(sfd, w, _SPLICE)
            if n == 0:
                break
            while n:
                n -= os.splice(r, dfd, n)
    except OSError:
        # A reset or a cut (close()): end both directions, so the other copy wakes too.
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
    finally:
        os.close(r)
        os.close(w)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
