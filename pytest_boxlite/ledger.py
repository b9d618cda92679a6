"""Who owns which box, whether the owner is alive, and removal of leftovers.

Every pytest process that makes boxes is an *owner* with an id (the
session id, plus the xdist worker id under xdist) and holds an exclusive
``flock`` on ``<home>/sessions/<owner>.lock`` for its whole life.  The kernel
drops that lock when the process dies, however it dies, so "the lock can be
taken" means "the owner is dead": a PID alone could have been reused.
Box names are ``pbx-<owner>-<n>``, so any box found anywhere can be traced to
its owner.  A box whose owner is dead is a leftover, unless it was kept for
debugging on purpose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.runtimes import _cgroups
from pytest_boxlite.runtimes.namespace import _alive, _read_info, keep_marker, kill_box_processes, remove_box_dirs

PREFIX = "pbx-"
_NAME = re.compile(r"^pbx-(?P<owner>[a-z0-9]+(?:-[A-Za-z0-9_]+)?)-(?P<seq>\d+)$")


def new_session_id() -> str:
    """A fresh, short, lowercase session id (it becomes part of every box name)."""
    return secrets.token_hex(4)


def owner_of(box_name: str) -> str | None:
    """The owner id encoded in a box name, or ``None`` for boxes that are not ours."""
    m = _NAME.match(box_name)
    return m.group("owner") if m else None


def _lock_path(home: Path, owner: str) -> Path:
    return home / "sessions" / f"{owner}.lock"


class OwnerLock:
    """The liveness lock of one owner; held from :meth:`acquire` until :meth:`release`."""

    def __init__(self, home: Path, owner: str) -> None:
        self.home = Path(home)
        self.owner = owner
        self.path = _lock_path(self.home, owner)
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BoxliteError(f"owner id {self.owner} is already in use by a live process") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None


def owner_alive(home: Path, owner: str) -> bool:
    """Whether ``owner``'s process still holds its lock (works across processes and in-process)."""
    path = _lock_path(Path(home), owner)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@dataclasses.dataclass(frozen=True)
class Leftover:
    """A box found on disk, with its owner and whether that owner is alive."""

    name: str
    runtime: str
    owner: str | None
    owner_alive: bool
    running: bool
    kept: bool
    location: str


def _namespace_boxes(home: Path) -> Iterator[Leftover]:
    state = home / "namespace"
    if not state.is_dir():
        return
    for box_dir in sorted(state.iterdir()):
        if box_dir.name.endswith((".ctl", ".keep")) or box_dir.is_symlink() or not box_dir.is_dir():
            continue  # a box's private control directory, or a keep marker
        owner = owner_of(box_dir.name)
        yield Leftover(
            name=box_dir.name,
            runtime="namespace",
            owner=owner,
            owner_alive=owner is not None and owner_alive(home, owner),
            running=_alive(_read_info(box_dir)),
            kept=keep_marker(box_dir).exists(),
            location=str(box_dir),
        )


def _vm_homes(home: Path) -> Iterator[tuple[str, Path]]:
    vm = home / "vm"
    if vm.is_dir():
        for d in sorted(vm.iterdir()):
            if d.is_dir():
                yield d.name, d


def scan(home: Path, *, with_vm: bool = True) -> list[Leftover]:
    """Every box under ``home``: namespace boxes, and records in the vm homes of dead owners.

    The vm home of a live owner is locked by BoxLite and cannot be opened
    from here; its boxes are reported as one entry per home.
    """
    home = Path(home)
    found = list(_namespace_boxes(home))
    if not with_vm:
        return found
    for owner, vm_home in _vm_homes(home):
        alive = owner_alive(home, owner)
        kept = (vm_home / "keep").exists()
        if alive:
            found.append(Leftover(f"(vm home of {owner})", "vm", owner, True, True, kept, str(vm_home)))
            continue
        for rec in _vm_records(vm_home):
            found.append(Leftover(rec, "vm", owner, False, False, kept, str(vm_home)))
    return found


def _vm_records(vm_home: Path) -> list[str]:
    from pytest_boxlite.runtimes.vm import VmRuntime

    try:
        rt = VmRuntime(vm_home)
    except BoxliteError:
        return []
    try:
        return [r.name for r in rt.list_boxes()]
    finally:
        rt.close()


def remove_namespace_box(home: Path, name: str) -> None:
    """Kill a namespace box and remove its state.

    Only host-side facts are used: the pids the host recorded (checked against their start
    times) in the box's private control directory, which no guest can see, and the box's cgroups.
    Killing the first process of the box's pid namespace makes the kernel kill every other one.
    """
    if not name or "/" in name or name in (".", ".."):
        raise BoxliteError(f"invalid box name {name!r}")
    box_dir = Path(home) / "namespace" / name
    kill_box_processes(_read_info(box_dir))
    _cgroups.remove_dirs(_cgroups.find_dirs(name))
    remove_box_dirs(box_dir)


def remove_vm_home(vm_home: Path) -> int:
    """Remove every box record of a dead owner's vm home, then the home (the shared image store stays)."""
    from pytest_boxlite.runtimes.vm import VmRuntime

    rt = VmRuntime(vm_home)
    try:
        names = [r.name for r in rt.list_boxes()]
        for n in names:
            rt.remove_box(n)
    finally:
        rt.close()
    shutil.rmtree(vm_home, ignore_errors=True)
    return len(names)


def _selected(owner: str | None, owners: set[str] | None, prefix: str | None) -> bool:
    if owners is not None and owner not in owners:
        return False
    return prefix is None or (owner is not None and owner.startswith(prefix))


def reconcile(
    home: Path, *, include_kept: bool = False, owners: set[str] | None = None, owner_prefix: str | None = None
) -> list[str]:
    """Remove the boxes of dead owners (only ``owners``, or owners starting with ``owner_prefix``).

    Returns what was removed.

    Live owners' boxes are never touched: two concurrent sessions sharing a
    home do not interfere.  Kept boxes stay unless ``include_kept``.
    """
    home = Path(home)
    removed: list[str] = []
    for lo in _namespace_boxes(home):
        if lo.owner_alive or (lo.kept and not include_kept):
            continue
        if not _selected(lo.owner, owners, owner_prefix):
            continue
        remove_namespace_box(home, lo.name)
        removed.append(lo.name)
    for owner, vm_home in _vm_homes(home):
        if owner_alive(home, owner) or ((vm_home / "keep").exists() and not include_kept):
            continue
        if not _selected(owner, owners, owner_prefix):
            continue
        try:
            n = remove_vm_home(vm_home)
        except BoxliteError:
            continue  # BoxLite still holds the home: its process is alive after all
        removed.append(f"{owner} (vm home, {n} boxes)")
    sessions = home / "sessions"
    if sessions.is_dir():
        for lock in sessions.glob("*.lock"):
            if not owner_alive(home, lock.stem):
                with contextlib.suppress(OSError):
                    lock.unlink()
    return removed
