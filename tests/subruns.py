"""Helpers shared by the test files that start real pytest sub-runs (session, reliability, xdist)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

#: Plugins installed here that sub-runs do not need and that slow every pytest start.
QUIET = ("-p", "no:hypothesispytest", "-p", "no:benchmark", "-p", "no:cacheprovider")
#: pytester changes $HOME; bwrap is found in boxlite's data directory under the real one.
REAL_DATA_HOME = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(interval)


def sub_env(**extra: str) -> dict[str, str]:
    """A sub-run's environment: no boxlite settings and no outer xdist/pytest state leak in."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_BOXLITE_", "PYTEST_XDIST_")) and k not in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")
    }
    env["XDG_DATA_HOME"] = REAL_DATA_HOME
    env.update(extra)
    return env


def process_gone(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (it runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def pids_with(tag: str) -> list[int]:
    """Host pids of live processes whose command line contains ``tag``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if tag.encode() in cmd and not process_gone(int(entry)):
            out.append(int(entry))
    return out
