"""pytest-xdist integration (the controller's hooks are on :class:`pytest_boxlite.plugin.ControllerPlugin`).

* The controller hands its session id to every worker (``workerinput``), so
  all box names of one run carry it; each worker is its own owner
  (``<session>-<workerid>``) with its own pool and BoxLite home.
* Workers send their pool counters back (``workeroutput``, :data:`WORKEROUTPUT_KEY`) for the summary.
* ``--boxlite-scope=worker`` starts each worker inside a box of its own (:func:`box_worker_specs`).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from pytest_boxlite.session import BoxliteSession
from pytest_boxlite.settings import Settings

WORKEROUTPUT_KEY = "boxlite"


def boxproc_argv(
    settings: Settings, *, session_id: str, home: Path, runtime: str, mounts: tuple[str, ...], cwd: str
) -> list[str]:
    """The host command that runs a worker (or a whole session) inside a fresh box."""
    s = settings
    argv = [
        sys.executable, "-m", "pytest_boxlite.boxproc",
        "--home", str(home),
        "--session", session_id,
        "--runtime", runtime,
        "--image", s.image,
        "--cwd", cwd,
        "--boot-timeout", str(s.boot_timeout),
    ]  # fmt: skip
    if s.cpus:
        argv += ["--cpus", str(s.cpus)]
    if s.memory:
        argv += ["--memory", str(s.memory)]
    if s.network:
        argv.append("--network")
    for m in mounts:
        argv += ["--mount", m]
    # An empty pattern still says "deny nothing" (rather than "use the default").
    for pattern in s.env_deny or ("",):
        argv += ["--env-deny", pattern]
    return argv


def box_worker_specs(box: BoxliteSession, config: pytest.Config) -> None:
    """Rewrite xdist's plain ``popen`` gateways so each worker starts inside its own box."""
    tx = list(getattr(config.option, "tx", None) or [])
    cmd = boxproc_argv(
        box.settings,
        session_id=box.session_id,
        home=box.home,
        runtime=box.choice.kind,
        mounts=box.worker_mounts,
        cwd=str(config.invocation_params.dir),
    )
    python = shlex.join([*cmd, "--", sys.executable])
    config.option.tx = [f"popen//python={python}" if t == "popen" else t for t in tx]
