"""The warm interpreter of a box: the box's pytest, run the way pytest-xdist runs a worker.

The host ships :mod:`pytest_boxlite.guest.bootstrap` with execnet ``remote_exec``; it puts the
host's ``sys.path`` in place (the box sees the host's project and packages at the same paths) and
calls :func:`serve`, which sets the box up, asks once whether this kernel can fork fresh boxes,
and runs ``pytest.main`` with the host's own command line and two roles: the session in the box
(:mod:`pytest_boxlite.guest.session`) and the fork server (:mod:`pytest_boxlite.guest.forks`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

# Imported before pytest: guest/fresh.py notes the threads and descriptors of this interpreter as
# they are before pytest starts (its _KNOWN_THREADS), and its probes fork cheapest now.
from pytest_boxlite.guest.fresh import fork_refused
from pytest_boxlite.guest.layers import fork_blocked_by_mounts


def serve(channel: Any, cfg: dict[str, Any]) -> None:
    """Run the box's pytest for the host at the other end of ``channel``; ``cfg`` is its first
    message (see :mod:`pytest_boxlite.guest.messages`), of which the bootstrap used ``sys_path``."""
    os.environ.update(cfg["env"])
    # A test may write below ``~`` as it does locally; a VM's image has no directory for the host's
    # $HOME (a namespace box sees the host's), so make it, in the box, before any box is forked.
    home = os.environ.get("HOME", "")
    if home.startswith("/") and not os.path.isdir(home):
        try:
            os.makedirs(home, mode=0o700)
        except OSError as exc:
            sys.stderr.write(f"pytest-boxlite: cannot make the home {home!r} in this box: {exc}\n")
    # Asked once, before pytest is imported (a fork is cheapest now): can this kernel make the
    # per-test box's namespaces?  A VM's kernel may lack user namespaces; a namespace box may have
    # a mount over part of a copy-on-write directory, which no fork can renew.  The host then
    # boots a box per test instead of failing every test.
    probe = fork_refused if cfg.get("probe_fork") else fork_blocked_by_mounts
    fork_problem = probe()
    import pytest

    from pytest_boxlite.guest.forks import ForkServer
    from pytest_boxlite.guest.session import GuestPlugin

    plugin = GuestPlugin(channel, cfg, fork_problem)
    ForkServer(plugin, channel).install()
    pytest.main(cfg["args"], plugins=[plugin])
