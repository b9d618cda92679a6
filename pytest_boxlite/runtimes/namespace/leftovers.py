"""A box's processes and directories, from the host's own record: liveness and cleanup."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pytest_boxlite._homefs import HomeDir, Refused
from pytest_boxlite._shown import shown
from pytest_boxlite.runtimes import _cgroups
from pytest_boxlite.runtimes.namespace.layout import _read_info, ctl_dir, keep_marker


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


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _uids(pid: int) -> set[int] | None:
    """The real, effective, saved and file-system uids of ``pid`` (None if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return {int(u) for u in line.split()[1:]}
    except (OSError, ValueError):
        return None
    return None


#: Bound on a command line read back from /proc (a box's holds the agent's small JSON config).
_MAX_CMDLINE = 256 * 1024
#: How many parents up a box's process may be from the one holding its token (a forked box:
#: clone of the zygote's agent, whose parent is bubblewrap).
_MAX_ANCESTRY = 8


def _holds(pid: int, tokens: frozenset[str]) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read(_MAX_CMDLINE)
    except OSError:
        return False
    # Only in the form the host writes it (the agent's JSON config, in its and bubblewrap's
    # command lines): a token is no proof where it is any text of a process's arguments.
    return any(b'"token": "%s"' % t.encode() in cmdline for t in tokens)


#: A box's token as runtime.py makes it (secrets.token_hex(16)).  Anything else read back from a
#: record (a long argument of some process of ours, copied into a planted info.json) proves nothing.
_TOKEN = re.compile(r"[0-9a-f]{32}")


def _token_of(info: dict[str, Any]) -> str | None:
    token = info.get("token")
    return token if isinstance(token, str) and _TOKEN.fullmatch(token) else None


def _tokens(info: dict[str, Any], box_dir: Path | None) -> frozenset[str]:
    """The per-box secrets a box's processes carry: its own, and its zygote's for a forked box."""
    found = {_token_of(info)}
    zygote = info.get("forked_from")
    if box_dir is not None and isinstance(zygote, str) and zygote and "/" not in zygote and zygote not in (".", ".."):
        found.add(_token_of(_read_info(box_dir.with_name(zygote))))
    return frozenset(t for t in found if t is not None)


def _proven(pid: object, start: object, tokens: frozenset[str]) -> bool:
    """Whether ``pid`` (a claim read from a file) is a process of this box of this user.

    It must run as this uid, have the recorded start time, and hold the box's secret token (a
    random string the host put in its agent's command line when it started it) in its own
    command line or one of its few closest parents'.  A record planted in a home cannot name a
    process that holds a token no one could know in advance.
    """
    if not (isinstance(pid, int) and pid > 0 and tokens) or _proc_start_time(pid) != start:
        return False
    if _uids(pid) != {os.geteuid()}:
        return False
    current: int | None = pid
    for _ in range(_MAX_ANCESTRY):
        if current is None or current <= 1:
            return False
        if _holds(current, tokens):
            return True
        current = _ppid(current)
    return False


def _alive(info: dict[str, Any], box_dir: Path | None = None) -> bool:
    tokens = _tokens(info, box_dir)
    return _proven(info.get("pid"), info.get("start_time"), tokens) or _proven(
        info.get("init_pid"), info.get("init_start_time"), tokens
    )


def _kill_proven(pid: object, start: object, tokens: frozenset[str]) -> bool:
    """SIGKILL ``pid`` if it is proven a process of the box; a pidfd is held across the proof
    and the signal, so a pid reused in between is never signalled.  Whether it was signalled."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    pidfd: int | None = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError:
            pidfd = None  # an old kernel: checked, then signalled by pid (doctor says so)
    try:
        # After the pidfd is open: if the pid was reused before it, the checks fail; if it is
        # reused after them, the signal goes to the (dead) process the pidfd names: ESRCH.
        if not _proven(pid, start, tokens):
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        return True
    finally:
        if pidfd is not None:
            os.close(pidfd)


def kill_box_processes(info: dict[str, Any], box_dir: Path | None = None) -> None:
    """Kill every process of a box from the host's own record: its pid namespace's first process.

    When the first process of a pid namespace dies the kernel kills everything else in it, so
    nothing a guest did (new sessions, double forks) keeps a process alive.  bubblewrap's monitor
    outside the namespace goes too.  A recorded pid is only a claim: it is signalled only once
    proven this box's (see :func:`_proven`), through a pidfd.
    """
    tokens = _tokens(info, box_dir)
    for key, start in (("init_pid", "init_start_time"), ("pid", "start_time")):
        _kill_proven(info.get(key), info.get(start), tokens)


def remove_tree(path: Path) -> None:
    """Remove ``path`` (a box's directory or control directory) by descriptors: its parent (the
    state directory) is opened never through a link and must be ours, nothing below is followed."""
    try:
        parent = HomeDir.open(path.parent)
    except FileNotFoundError:
        return
    with parent:
        parent.remove(path.name)


#: Pauses between tries at removing a box's directories (see remove_box_dirs).
_REMOVE_RETRIES = (0.1, 0.3, 1.0)


def remove_box_dirs(box_dir: Path) -> None:
    """Remove a box's directories and keep mark (its processes must be dead); raises ``OSError``,
    naming the directory, if they cannot be removed.

    Every mode a box left is undone first (overlayfs leaves its work directories at mode 000,
    which an ordinary user's ``rmtree`` cannot list), by descriptors, never through a link (see
    :func:`pytest_boxlite._homefs.remove_tree_at`).  A box whose first process was killed may
    still have processes on their way out under a loaded host, so a failed try is repeated a few
    times before the error is raised: a directory left behind here is a leaked box in the ledger.
    """
    for pause in (*_REMOVE_RETRIES, None):
        try:
            remove_tree(box_dir)
            remove_tree(ctl_dir(box_dir))
            remove_tree(keep_marker(box_dir))
            return
        except Refused:
            raise
        except OSError as exc:
            if pause is None:
                raise OSError(f"could not remove the directories of box {box_dir.name} ({box_dir}): {exc}") from exc
            time.sleep(pause)


def box_dirs(state_dir: Path) -> Iterator[Path]:
    """The boxes' directories under a runtime's state directory: real directories of this user's
    only (not control directories, keep marks, links, other owners' entries: those are warned
    about, never followed or removed).  Raises :class:`~pytest_boxlite._homefs.Refused` if the
    state directory itself is a link or another user's."""
    try:
        top = HomeDir.open_expected(state_dir, "the boxes' directory")
    except FileNotFoundError:
        return
    with top:
        entries = top.entries()
    for entry in entries:
        if entry.refused is not None:
            _refused(state_dir / entry.name, entry.refused)
            continue
        if entry.name.endswith((".ctl", ".keep")) or not entry.is_dir:
            continue
        yield state_dir / entry.name


def _refused(path: Path, why: str) -> None:
    warnings.warn(
        f"pytest-boxlite: refused {shown(path, line=True)}: {why}; not a box of yours: it is not followed, "
        "signalled or removed (remove it by hand if you know what it is)",
        RuntimeWarning,
        stacklevel=3,
    )


def running(box_dir: Path) -> bool:
    """Whether the box's recorded processes still run and are proven its own (see :func:`_proven`)."""
    return _alive(_read_info(box_dir), box_dir)


def remove_box_state(box_dir: Path) -> None:
    """Kill a box and remove its state.

    Only host-side facts are used: the pids the host recorded in the box's private control
    directory, each proven this box's before a signal (uid, start time, the box's token, through
    a pidfd), and the box's cgroups.  Killing the first process of the box's pid namespace makes
    the kernel kill every other one.
    """
    kill_box_processes(_read_info(box_dir), box_dir)
    _cgroups.remove_dirs(_cgroups.find_dirs(box_dir.name))
    remove_box_dirs(box_dir)
