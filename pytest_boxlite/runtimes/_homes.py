"""Every boxlite home on this machine that this user can see, so that boxes are shown none of them.

A home holds other boxes' control sockets, logs and records (a kept box's ``box.log``, another
project's, another user's CI job's): a guest must reach none, not only its own session's.  Homes
are found two ways, both from host-side facts only:

- the **registry**: every session records its home (:func:`register_home`, called when it takes
  its owner lock) as one small file in its user's registry directory, ``~/.cache/pytest-boxlite/
  homes.d`` of the user's home in the user database (not ``$HOME``, which a run may change), or
  ``/tmp/pytest-boxlite-<uid>/homes.d`` where that is not writable;
- the **default home** (``.cache/pytest-boxlite``) of every home directory in the user database.

Another user's entries are trusted only for directories that user owns: a registry cannot make
this user's boxes hide a directory its writer does not own.  Reads are bounded (entries per
registry, bytes per entry) and never follow a link to an entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import pwd
import stat
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["REGISTRY", "STATE_ENTRIES", "boxlite_homes", "register_home", "registries"]

#: The registry directory's name (inside a user's default home, or their directory on /tmp).
REGISTRY = "homes.d"
#: What the runtimes keep directly in a home (``namespace``: boxes; ``vm``, ``vm-templates``,
#: ``images``: micro-VM homes, templates and BoxLite's image cache; ``image-store``: the unpacked
#: OCI images of pytest_boxlite.images; ``rest``: remote leases; ``sessions``: owner locks) and the
#: registry: hidden one by one where the whole home cannot be (it lies above a directory a box
#: must see).
STATE_ENTRIES = ("namespace", "vm", "vm-templates", "images", "image-store", "rest", "sessions", REGISTRY)
_DEFAULT = (".cache", "pytest-boxlite")
#: Bounds on what one registry may cost a reader (another user writes it).  The entry bound is
#: high: a home past it is not hidden from boxes, and a user's own registry keeps every live home
#: of theirs (a machine that ran a few hundred test sessions with homes of their own, each still
#: on disk, held over 300, and the homes past 256 were seen by boxes).
_MAX_ENTRIES = 4096
_MAX_ENTRY_BYTES = 4096


def registries(uid: int, user_dir: str) -> list[str]:
    """The registry directories of user ``uid`` whose home directory is ``user_dir``: the
    persistent one first, then the per-machine fallback."""
    return [f"{user_dir.rstrip('/')}/{'/'.join(_DEFAULT)}/{REGISTRY}", f"/tmp/pytest-boxlite-{uid}/{REGISTRY}"]


def _own_user_dir() -> str | None:
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return None  # a uid without an entry in the user database: the /tmp registry only


def _entry_name(home: str) -> str:
    return hashlib.sha256(home.encode()).hexdigest()[:24]


def _read_entry(dirfd: int, name: str, owner: int) -> str | None:
    """The home path a registry entry names, if it is a small regular file owned by ``owner``."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != owner:
            return None
        data = os.read(fd, _MAX_ENTRY_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > _MAX_ENTRY_BYTES or b"\0" in data:
        return None
    text = data.decode("utf-8", "replace").strip()
    return text if text.startswith("/") and "\n" not in text else None


#: What each registry held when last read: ``{registry: ((st_dev, st_ino, st_mtime_ns), paths)}``.
#: An entry is added or removed by a rename or unlink in the directory, which changes its mtime.
_READ: dict[str, tuple[tuple[int, int, int], tuple[str, ...]]] = {}


def _entries(registry: str, owner: int) -> tuple[str, ...]:
    """The home paths in ``registry`` (a directory owned by ``owner``, never a link), bounded;
    read again only when the directory changed."""
    try:
        dirfd = os.open(registry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ()
    try:
        st = os.fstat(dirfd)
        if st.st_uid != owner:
            return ()
        stamp = (st.st_dev, st.st_ino, st.st_mtime_ns)
        known = _READ.get(registry)
        if known is not None and known[0] == stamp:
            return known[1]
        with os.scandir(dirfd) as it:
            names = [e.name for e in itertools.islice(it, _MAX_ENTRIES)]
        paths = tuple(
            path
            for name in names
            if not name.startswith(".")
            for path in [_read_entry(dirfd, name, owner)]
            if path is not None
        )
        _READ[registry] = (stamp, paths)
        return paths
    except OSError:
        return ()
    finally:
        os.close(dirfd)


def register_home(home: Path) -> None:
    """Record ``home`` in this user's registry, so every later box on this machine hides it.

    Best effort, never raises: a home that cannot be recorded is still hidden from this
    session's own boxes (and, in the default place, from everyone's).  Entries of homes that no
    longer exist are pruned when a new one is added.
    """
    try:
        real = os.path.realpath(home)
    except (OSError, ValueError):
        return
    name = _entry_name(real)
    user_dir = _own_user_dir()
    places = registries(os.getuid(), user_dir) if user_dir else registries(os.getuid(), "/nonexistent")[1:]
    for place in places:
        registry = Path(place)
        try:
            # The directory holding it is a home (the default one) or this user's own on /tmp:
            # made private, as a session makes its home, so that it passes the home's check
            # (_homefs.check_home) whatever the umask.
            os.makedirs(registry.parent, mode=0o700, exist_ok=True)
            registry.mkdir(exist_ok=True, mode=0o755)
            st = os.lstat(registry)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            entry = registry / name
            with contextlib.suppress(FileNotFoundError):
                os.lstat(entry)
                return  # recorded already (the common case: one lstat)
            tmp = registry / f".{name}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, real.encode() + b"\n")
            finally:
                os.close(fd)
            os.replace(tmp, entry)
            _prune(registry)
            return
        except OSError:
            continue


def _prune(registry: Path) -> None:
    """Drop this user's entries whose home is gone (test runs make many short-lived homes)."""
    try:
        dirfd = os.open(registry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with os.scandir(dirfd) as it:
            names = [e.name for e in it if not e.name.startswith(".")]
        for name in names:
            target = _read_entry(dirfd, name, os.getuid())
            if target is not None and not os.path.isdir(target):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dirfd)
    except OSError:
        return
    finally:
        os.close(dirfd)


_USERS: tuple[float, list[tuple[int, str]]] | None = None
#: How long one read of the user database serves (it is asked for every booted box).
_USERS_TTL = 30.0


def _users() -> list[tuple[int, str]]:
    """``(uid, home directory)`` of every user in the user database (re-read every few seconds)."""
    global _USERS
    now = time.monotonic()
    if _USERS is None or now - _USERS[0] > _USERS_TTL:
        users: list[tuple[int, str]] = []
        with contextlib.suppress(OSError):
            users = [(pw.pw_uid, pw.pw_dir) for pw in pwd.getpwall() if pw.pw_dir.startswith("/")]
        _USERS = (now, users)
    return _USERS[1]


def _user_dirs() -> list[tuple[int, str]]:
    """``(uid, home directory)`` of every user in the user database, each directory once, and
    this process's ``$HOME`` (which a run may point elsewhere) as this user's."""
    out: dict[str, int] = {}
    for uid, user_dir in _users():
        out.setdefault(user_dir, uid)
    home = os.environ.get("HOME")
    if home and home.startswith("/"):
        out.setdefault(home, os.getuid())
    return [(uid, d) for d, uid in out.items()]


def _owned_dir(path: str, owner: int | None) -> str | None:
    """``path`` with its links resolved, if it is a directory (owned by ``owner`` unless None)."""
    try:
        os.lstat(path)  # most candidates do not exist: fail fast, before resolving links
        real = os.path.realpath(path)
        st = os.stat(real)
    except (OSError, ValueError):
        return None
    if not stat.S_ISDIR(st.st_mode) or (owner is not None and st.st_uid != owner):
        return None
    return real


def boxlite_homes(wanted: Callable[[str], bool] | None = None) -> list[str]:
    """Every boxlite home this user may be able to see (links resolved, each once).

    Another user's homes count only where that user owns them; this user's own entries are
    taken as they are.  ``wanted`` skips a recorded path before it is looked at (paths no box
    can reach: most homes of test runs lie under the host's /tmp).  Whether each can be read,
    and how to hide it, is the caller's to decide.
    """
    me = os.getuid()
    found: list[str] = []

    def add(path: str, owner: int | None) -> None:
        if wanted is not None and not wanted(path):
            return
        real = _owned_dir(path, owner)
        if real is not None and wanted is not None and not wanted(real):
            return
        if real is not None and real not in found:
            found.append(real)

    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and xdg.startswith("/"):
        add(os.path.join(xdg, "pytest-boxlite"), None)
    for uid, user_dir in _user_dirs():
        trusted = None if uid == me else uid
        default, persistent, per_machine = f"{user_dir.rstrip('/')}/{'/'.join(_DEFAULT)}", *registries(uid, user_dir)
        try:
            os.lstat(default)
        except (OSError, ValueError):
            # No default home, so no registry in it either (the common case: one lstat).
            places = [per_machine]
        else:
            add(default, trusted)
            places = [persistent, per_machine]
        for registry in places:
            for path in _entries(registry, uid):
                add(path, trusted)
    return found
