"""``--boxlite-scope=worker`` without xdist: the whole session runs again inside one box."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pytest_boxlite import ledger
from pytest_boxlite.runtimes import choose
from pytest_boxlite.settings import Settings
from pytest_boxlite.spec import minimal_dirs
from pytest_boxlite.xdist_support import boxproc_argv


def run_session_in_box(config: pytest.Config, settings: Settings) -> int:
    """Re-run this pytest command inside a box; its output goes straight to this terminal."""
    home = Path(settings.home).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    ledger.reconcile(home)
    # A virtual environment's interpreter (``<venv>/bin``) is on no sys.path entry: mount the venv.
    venv = [sys.prefix] if sys.prefix != sys.base_prefix else []
    cmd = boxproc_argv(
        settings,
        session_id=ledger.new_session_id(),
        home=home,
        runtime=choose(settings.runtime).kind,
        mounts=minimal_dirs([str(config.rootpath), str(config.invocation_params.dir), *venv, *sys.path]),
        cwd=str(config.invocation_params.dir),
    )
    proc = subprocess.Popen([*cmd, "--", sys.executable, "-m", "pytest", *config.invocation_params.args])
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # The session inside got the same Ctrl-C from the terminal; let it finish cleaning up.
        return proc.wait(timeout=60)
