"""Who owns which box, whether the owner is alive, and removal of leftovers.

Every pytest process that makes boxes is an *owner* with an id (the
session id, plus the xdist worker id under xdist) and holds an exclusive
``flock`` on ``<home>/sessions/<owner>.lock`` for its whole life.  The kernel
drops that lock when the process dies, however it dies, so "the lock can be
taken" means "the owner is dead": a PID alone could have been reused.
Box names are ``pbx-<owner>-<n>``, so any box found anywhere can be traced to
its owner.  A box whose owner is dead is a leftover, unless it was kept for
debugging on purpose.

Each runtime kind knows its own layout on disk: it lists its leftovers and removes them
(:class:`~pytest_boxlite.runtimes.base.RuntimeKind`); the ledger only says who owns what and
whether that owner lives, and iterates the kinds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
from pathlib import Path

from pytest_boxlite._homefs import HomeDir, Refused, check_home
from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.runtimes import Leftover, kinds, kinds_with_state, register_home

__all__ = [
    "PREFIX",
    "Leftover",
    "OwnerLock",
    "new_session_id",
    "owner_alive",
    "owner_of",
    "reconcile",
    "remove_named",
    "scan",
]

PREFIX = "pbx-"
_NAME = re.compile(r"^pbx-(?P<owner>[a-z0-9]+(?:-[A-Za-z0-9_]+)?)-(?P<seq>\d+)$")


#: The home's source, for the ledger's own check (callers check first, naming where it came from).
_ASKED = "the caller"


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
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Through the home's descriptor: a ``sessions`` link or a planted lock link is refused.
        with HomeDir.at(self.home, "sessions", create=True) as sessions:
            fd = sessions.open_file(self.path.name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BoxliteError(f"owner id {self.owner} is already in use by a live process") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        # Every box on this machine (of any session, this user's or another's) hides the homes
        # in the registry: a guest must not read this home's boxes' logs and sockets.
        register_home(self.home)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError), HomeDir.at(self.home, "sessions") as sessions:
            sessions.unlink(self.path.name)
        os.close(self._fd)
        self._fd = None


def owner_alive(home: Path, owner: str) -> bool:
    """Whether ``owner``'s process still holds its lock (works across processes and in-process)."""
    if "/" in owner or owner in ("", ".", ".."):
        return False
    try:
        with HomeDir.at(home, "sessions") as sessions:
            fd = sessions.open_file(f"{owner}.lock", os.O_RDWR)
    except FileNotFoundError:
        return False
    except Refused:
        return True  # a lock that is a link or another user's: nothing of its owner is touched
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


class _Owners:
    """The ledger's answers about owners of ``home``, for the runtime kinds (see ``runtimes.base.Owners``)."""

    def __init__(self, home: Path) -> None:
        self.home = home

    def owner_of(self, name: str) -> str | None:
        return owner_of(name)

    def alive(self, owner: str) -> bool:
        return owner_alive(self.home, owner)


def scan(home: Path) -> list[Leftover]:
    """Every box under ``home``, of every runtime kind: namespace boxes, and the records in the vm
    homes of dead owners.

    The vm home of a live owner is locked by BoxLite and cannot be opened
    from here; its boxes are reported as one entry per home.
    """
    home = check_home(home, source=_ASKED)
    owners = _Owners(home)
    return [lo for k in kinds() for lo in k.leftovers(home, owners, each_box=True)]


def remove_named(home: Path, name: str) -> bool:
    """Remove the box ``name`` of a dead (or unknown) owner; ``False`` if no runtime has a box so named."""
    home = check_home(home, source=_ASKED)
    owners = _Owners(home)
    for k in kinds():
        for lo in k.leftovers(home, owners, each_box=False):
            # Only boxes are removed by name: a vm home's entry is a unit of several, named by its owner.
            if lo.name == name and owner_of(lo.name) == lo.owner:
                k.remove_leftover(home, lo)
                return True
    return False


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
    home = check_home(home, source=_ASKED)
    removed: list[str] = []
    lookup = _Owners(home)
    for k in kinds_with_state(home):
        for lo in k.leftovers(home, lookup, each_box=False):
            if lo.owner_alive or (lo.kept and not include_kept):
                continue
            if not _selected(lo.owner, owners, owner_prefix):
                continue
            what = k.remove_leftover(home, lo)
            if what is not None:
                removed.append(what)
    try:
        sessions = HomeDir.at(home, "sessions")
    except FileNotFoundError:
        return removed
    with sessions:
        # Only this user's own lock files: a link or another owner's entry is left (and never
        # followed): unlinking through a planted ``sessions`` link once removed files elsewhere.
        for entry in sessions.entries():
            if not (entry.refused is None and entry.is_file and entry.name.endswith(".lock")):
                continue
            if not owner_alive(home, entry.name.removesuffix(".lock")):
                with contextlib.suppress(OSError):
                    sessions.unlink(entry.name)
    return removed
