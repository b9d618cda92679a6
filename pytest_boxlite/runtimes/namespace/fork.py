"""The host end of the per-test fork: where a box forked from a warm interpreter reports back.

A namespace box's warm interpreter can fork a fresh box per test (new namespaces, empty writable
layers; see :mod:`pytest_boxlite.guest.fresh`).  The fork connects to a Unix socket the host
listens on in the box's guest-visible directory, which the guest sees read-only at
:data:`~pytest_boxlite.runtimes.namespace.layout.GUEST_CTL`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

from pytest_boxlite.runtimes._forkcell import ForkCell
from pytest_boxlite.runtimes.namespace.layout import GUEST_CTL, _bind

#: Where a forked box finds the host's listening socket.
FORK_SOCKET = f"{GUEST_CTL}/fork.sock"
#: Where the warm interpreter fetches each forked box's cell (cgroups and stderr) before the fork.
CELL_SOCKET = f"{GUEST_CTL}/cells.sock"


class CellDealer:
    """Hands forked boxes' cells (see :mod:`pytest_boxlite.runtimes._forkcell`) to one warm
    interpreter: a socket at ``box_dir/cells.sock`` it connects to on its first cell, then one
    message per cell (a JSON line naming it, with its descriptors), in the order of the FORKs.

    The host only ever sends here: nothing the box writes on it is read.
    """

    def __init__(self, box_dir: Path) -> None:
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _bind(self._listener, box_dir / "cells.sock")
            self._listener.listen(1)
        except BaseException:
            self._listener.close()
            raise
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()

    def deal(self, cell: ForkCell, timeout: float) -> None:
        """Send ``cell`` (its FORK is on the channel: a first one makes the interpreter connect)."""
        with self._lock:
            if self._conn is None:
                self._listener.settimeout(timeout)
                self._conn, _ = self._listener.accept()
            self._conn.settimeout(timeout)
            fds = cell.descriptors()
            try:
                head = json.dumps({"cell": cell.name, "joins": len(fds) - 1}) + "\n"
                socket.send_fds(self._conn, [head.encode()], fds)
            except OSError:
                self._conn.close()  # a peer that stopped reading: the next cell starts over
                self._conn = None
                raise
            finally:
                for fd in fds[:-1]:  # the log's write end is the cell's to close
                    os.close(fd)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._listener.close()


def fork_listener(box_dir: Path) -> tuple[socket.socket, str]:
    """A listening socket at ``box_dir/fork.sock`` and its path as forked boxes see it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _bind(sock, box_dir / "fork.sock")
        sock.listen(4)
    except BaseException:
        sock.close()
        raise
    return sock, FORK_SOCKET
