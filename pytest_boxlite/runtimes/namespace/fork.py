"""The host end of the per-test fork: where a box forked from a warm interpreter reports back.

A namespace box's warm interpreter can fork a fresh box per test (new namespaces, empty writable
layers; see :mod:`pytest_boxlite.guest.fresh`).  The fork connects to a Unix socket the host
listens on in the box's guest-visible directory, which the guest sees read-only at
:data:`~pytest_boxlite.runtimes.namespace.layout.GUEST_CTL`.
"""

from __future__ import annotations

import socket
from pathlib import Path

from pytest_boxlite.runtimes.namespace.layout import GUEST_CTL, _bind

#: Where a forked box finds the host's listening socket.
FORK_SOCKET = f"{GUEST_CTL}/fork.sock"


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
