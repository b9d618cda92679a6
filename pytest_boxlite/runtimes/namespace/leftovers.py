"""A box's processes and directories, from the host's own record: liveness and cleanup."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from pytest_boxlite.runtimes.namespace.layout import ctl_dir, keep_marker


def _proc_start_time(pid: int) -> str | None:
    """The process's start time (to tell a reused pid apart), or None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _same_process(pid: object, start: object) -> bool:
    return isinstance(pid, int) and pid > 0 and _proc_start_time(pid) == start


def _alive(info: dict[str, Any]) -> bool:
    return _same_process(info.get("pid"), info.get("start_time")) or _same_process(
        info.get("init_pid"), info.get("init_start_time")
    )


def kill_box_processes(info: dict[str, Any]) -> None:
    """Kill every process of a box from the host's own record: its pid namespace's first process.

    When the first process of a pid namespace dies the kernel kills everything else in it, so
    nothing a guest did (new sessions, double forks) keeps a process alive.  bubblewrap's monitor
    outside the namespace goes too.  Pids are checked against their recorded start time first.
    """
    for key, start in (("init_pid", "init_start_time"), ("pid", "start_time")):
        pid = info.get(key)
        if _same_process(pid, info.get(start)):
            assert isinstance(pid, int)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def remove_box_dirs(box_dir: Path) -> None:
    """Remove a box's directories and keep mark (its processes must be dead)."""
    shutil.rmtree(box_dir, ignore_errors=True)
    shutil.rmtree(ctl_dir(box_dir), ignore_errors=True)
    keep_marker(box_dir).unlink(missing_ok=True)
