"""A box's processes and directories, from the host's own record: liveness and cleanup."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pytest_boxlite.runtimes import _cgroups
from pytest_boxlite.runtimes.namespace.layout import _read_info, ctl_dir, keep_marker
from pytest_boxlite.runtimes.namespace.provision import remove_tree


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


#: Pauses between tries at removing a box's directories (see remove_box_dirs).
_REMOVE_RETRIES = (0.1, 0.3, 1.0)


def remove_box_dirs(box_dir: Path) -> None:
    """Remove a box's directories and keep mark (its processes must be dead); raises ``OSError``,
    naming the directory, if they cannot be removed.

    Every mode a box left is undone first (:func:`~.provision.remove_tree`: overlayfs leaves its
    work directories at mode 000, which an ordinary user's ``rmtree`` cannot list).  A box whose
    first process was killed may still have processes on their way out under a loaded host, so a
    failed try is repeated a few times before the error is raised: a directory left behind here is
    a leaked box in the ledger (it used to be ``rmtree(ignore_errors=True)``, which hid it).
    """
    for pause in (*_REMOVE_RETRIES, None):
        try:
            remove_tree(box_dir)
            remove_tree(ctl_dir(box_dir))
            keep_marker(box_dir).unlink(missing_ok=True)
            return
        except OSError as exc:
            if pause is None:
                raise OSError(f"could not remove the directories of box {box_dir.name} ({box_dir}): {exc}") from exc
            time.sleep(pause)


def box_dirs(state_dir: Path) -> Iterator[Path]:
    """The boxes' directories under a runtime's state directory (not their control directories,
    keep marks, or anything that is not a plain directory)."""
    if not state_dir.is_dir():
        return
    for box_dir in sorted(state_dir.iterdir()):
        if box_dir.name.endswith((".ctl", ".keep")) or box_dir.is_symlink() or not box_dir.is_dir():
            continue
        yield box_dir


def running(box_dir: Path) -> bool:
    """Whether the box's recorded processes still run (checked against their start times)."""
    return _alive(_read_info(box_dir))


def remove_box_state(box_dir: Path) -> None:
    """Kill a box and remove its state.

    Only host-side facts are used: the pids the host recorded (checked against their start
    times) in the box's private control directory, which no guest can see, and the box's cgroups.
    Killing the first process of the box's pid namespace makes the kernel kill every other one.
    """
    kill_box_processes(_read_info(box_dir))
    _cgroups.remove_dirs(_cgroups.find_dirs(box_dir.name))
    remove_box_dirs(box_dir)
