"""Put the SDK double in place of ``boxlite`` for a pytest sub-run (``-p sdk_double.activate``).  TESTS ONLY.

The sub-run needs ``tests/`` on ``sys.path`` (``PYTHONPATH``).  Loaded with
``-p``, this module runs before pytest-boxlite reads its options: it
installs the double as ``boxlite`` (and ``boxlite.errors``), and makes the
host probe answer "vm can run" with a reason that names the double, so
``--boxlite-runtime=vm`` and ``auto`` select the vm runtime here, where no
micro-VM boots.  Nothing in the shipped package knows about it.
"""

from __future__ import annotations

import importlib
import os
import sys

import boxlite.errors as _real_errors

import sdk_double

DOUBLE_REASON = "boxlite SDK double (bubblewrap sandboxes standing in for micro-VMs; tests only)"


def install() -> None:
    """Make ``import boxlite`` give the double and the probe say yes (idempotent)."""
    if os.environ.get("PYTEST_BOXLITE_GUEST") == "1":
        return  # the test worker inside a box: the host does the boxing, and uses no SDK there
    sys.modules["boxlite"] = sdk_double  # type: ignore[assignment]
    sys.modules["boxlite.errors"] = _real_errors
    probe_mod = importlib.import_module("pytest_boxlite.runtimes.probe")
    runtimes = importlib.import_module("pytest_boxlite.runtimes")
    real_probe = probe_mod.probe.__wrapped__

    def probe() -> object:
        p = real_probe()
        return probe_mod.Probe(True, DOUBLE_REASON, p.kvm, p.boxlite_version or "0.10.8")

    probe_mod.probe = probe
    runtimes.probe = probe


install()
