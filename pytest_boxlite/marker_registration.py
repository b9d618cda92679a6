"""Registers the ``boxlite`` marker, and nothing else.

A plugin of its own (entry point ``boxlite-marker``), so that ``-p no:boxlite``, which switches
boxing off for one run, leaves ``@pytest.mark.boxlite`` known and ``--strict-markers`` happy.
"""

from __future__ import annotations

import pytest

MARKER_HELP = (
    "boxlite(image=None, cpus=None, memory=None, env=None, network=None, timeout=None, user=None): "
    "run this test inside a throw-away box"
)
#: Why an item that ``--boxlite`` would box runs on the host (the sandbox fixtures it needs).  Here,
#: not in markers.py, so that plugin.py reads it without importing the session (boxes' pytest).
ON_HOST_KEY = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
