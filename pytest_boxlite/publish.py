"""Published box ports (``Sandbox.publish``): a host-owned TCP relay into a box's own loopback.

The host listens on ``127.0.0.1:<ephemeral port>``; for each connection it accepts, it asks the
box's runtime for a connection to the published port *on the box's loopback* (made inside the
box's network, so the box needs no network of its own: namespace boxes' agent connects and hands
the socket over), then copies bytes both ways.  The relay never connects anywhere else, holds at
most :data:`MAX_CONNECTIONS` connections and one buffer of bytes per direction of each, and ends
with the box.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

from pytest_boxlite.errors import BoxliteError

__all__ = ["MAX_CONNECTIONS", "Relay"]

#: Connections one published port relays at once; more are accepted and closed at once.
MAX_CONNECTIONS = 64
#: How long the box may take to connect one relayed connection to its port.
CONNECT_TIMEOUT = 5.0
#: The copy buffer of one direction of one connection: with :data:`MAX_CONNECTIONS`, a published
#: port holds at most 2 x 64 x 512 KiB = 64 MiB of the box's bytes.
_BUFFER = 512 << 10

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
