"""Copy-on-write for an ordinary user's files whose group the box cannot map.

How it works, and why: ``docs/explanation/internals/regroup.md``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import heapq
import json
import os
import secrets
import select
import stat
import struct
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pytest_boxlite._homefs import Refused, open_beneath, remove_tree_at

#: Entries looked at per tree: a tree this large (a home directory as the working directory) is
#: left as it is past this many, and said so.
MAX_ENTRIES = 200_000
#: File content copied per layer.  Past it, directories are still re-owned (removing and renaming
#: in them works) but the files left over are not (writing one fails as before), and said so.
MAX_COPY_BYTES = 256 * 1024 * 1024
#: A layer unused this long is removed when another one of the same directory is built.
_STALE_S = 24 * 3600
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
#: A copy made this close to its file's last change may predate a change in the same clock tick
#: (file times come from a coarse clock): it is made again once a box of this process stacks it.
_RACY_NS = 1_000_000_000


@dataclass(frozen=True)
class Entry:
    """One directory entry to re-own: its path relative to the copy-on-write directory."""

    rel: str
    kind: str  # "dir", "file", "link" or "fifo"
    mode: int
    size: int
    atime_ns: int
    mtime_ns: int
    ino: int
    target: str = ""  # a link's target, as read (never followed)
    ctime_ns: int = 0  # the change time: a change that keeps size and modification time moves it

    def look(self) -> tuple[object, ...]:
        """What tells this entry's state on the host (not the access time: reading moves it)."""
        return (self.rel, self.kind, self.mode, self.size, self.mtime_ns, self.ctime_ns, self.ino, self.target)


def regroup_args(top: str) -> list[str]:
    """bwrap arguments to add right after ``--overlay-src top``: the re-owned layer of ``top``'s
    entries that this user's box could not copy up, or nothing (a root host, nothing to re-own)."""
    if os.geteuid() == 0:
        return []
    layer = regroup_layer(top, _trees())
    return ["--overlay-src", layer] if layer is not None else []


def _trees() -> list[str]:
    """The trees a box of this process is made for: where it runs and what its interpreter uses."""
    out = [os.getcwd(), sys.prefix, sys.exec_prefix, *(p for p in sys.path if p.startswith("/"))]
    real: list[str] = []
    for p in out:
        with contextlib.suppress(OSError, ValueError):
            r = os.path.realpath(p)
            if r != "/" and os.path.isdir(r) and r not in real:  # "/" as the cwd: no tree of its own
                real.append(r)
    real.sort()
    return [t for i, t in enumerate(real) if not any(t.startswith(o.rstrip("/") + "/") for o in real[:i])]


_BUILD = threading.Lock()
_WARNED: set[str] = set()


def regroup_layer(top: str, trees: Iterable[str]) -> str | None:
    """The layer re-owning what the box cannot copy up of ``trees`` inside ``top`` (built, or
    reused when a layer of the same entries is there already), or ``None`` when there is none."""
    uid, gid = os.geteuid(), os.getegid()
    trees = list(trees)
    entries: dict[str, Entry] = {}
    for tree in trees:
        if tree == top or tree.startswith(top.rstrip("/") + "/"):
            entries.update(scan(top, tree, uid, gid))
    if not entries:
        return None
    with _BUILD:
        _settle_locked()
        for live in _LIVE.values():
            if live.top == top and live.matches(entries):
                return live.tree  # kept current since it was stacked: what the host has now
        built = _build(top, sorted(entries.values(), key=lambda e: e.rel))
        if built is None:
            return None
        _go_live(top, built, entries, trees)
        return built.tree


def scan(top: str, tree: str, uid: int, gid: int) -> dict[str, Entry]:
    """Entries of ``tree`` (inside ``top``) owned by ``uid`` with a group other than ``gid``, and
    the directories above them up to ``top`` (none when there are no such entries).  Links are never followed,
    on the way to an entry nor at its end; a directory of another owner is not entered (the box
    cannot change it, nor can the user)."""
    found: dict[str, Entry] = {}
    rel_tree = os.path.relpath(tree, top)
    # The directories between top and tree must be the user's: a copy of one would show it as the
    # box's root's, which the host's is not.
    parts = [] if rel_tree == "." else rel_tree.split("/")
    ancestors: list[Entry] = []
    for i in range(1, len(parts) + 1):
        rel = "/".join(parts[:i])
        got = _host_entry(top, rel)
        if got is None or got[1].kind != "dir" or got[0].st_uid != uid:
            return {}
        ancestors.append(got[1])
    seen = 0
    hits: list[Entry] = []
    stack = [rel_tree]
    while stack:
        rel_dir = stack.pop()
        try:
            fd = _dir_at(top, "" if rel_dir == "." else rel_dir, listable=True)
        except OSError:
            continue  # unreadable, or swapped for a link: its own entry (if any) is re-owned, no more
        try:
            with os.scandir(fd) as it:
                for de in it:
                    seen += 1
                    if seen > MAX_ENTRIES:
                        _warn_once(
                            tree, f"{tree} has more than {MAX_ENTRIES} entries; those past them were not looked at"
                        )
                        stack.clear()
                        break
                    try:
                        st = de.stat(follow_symlinks=False)  # relative to fd
                    except OSError:
                        continue
                    rel = de.name if rel_dir == "." else f"{rel_dir}/{de.name}"
                    if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
                        stack.append(rel)
                    if st.st_uid != uid or st.st_gid == gid:
                        continue
                    entry = _entry(rel, st, fd, de.name)
                    if entry is not None:
                        hits.append(entry)
        finally:
            os.close(fd)
    if not hits:
        return {}
    for e in ancestors:
        found[e.rel] = e
    for e in hits:
        found[e.rel] = e
    # Every directory above a re-owned entry must be in the layer (with its own look).
    for e in hits:
        parent = os.path.dirname(e.rel)
        while parent and parent not in found:
            got = _host_entry(top, parent)
            if got is None:
                break
            found[parent] = got[1]
            parent = os.path.dirname(parent)
    # An entry below one that is no directory (swapped for a link meanwhile) is not in the layer.
    return {r: e for r, e in found.items() if all(_is_dir(found, a) for a in _above(r))}


def _above(rel: str) -> Iterator[str]:
    """The directories above ``rel``, nearest first (not the top itself)."""
    parent = os.path.dirname(rel)
    while parent:
        yield parent
        parent = os.path.dirname(parent)


def _is_dir(entries: dict[str, Entry], rel: str) -> bool:
    e = entries.get(rel)
    return e is None or e.kind == "dir"  # one not listed is the host's own directory


def _dir_at(root: str, rel_dir: str, *, listable: bool = False) -> int:
    """A descriptor of the directory ``rel_dir`` below ``root`` (``""``: ``root`` itself), reached
    one component at a time without following a link (``O_PATH``, or readable for
    ``os.scandir`` with ``listable``).  ``OSError`` where a component is a link or no directory:
    what lies below it is not reached through it."""
    flags = (os.O_RDONLY if listable else os.O_PATH) | os.O_DIRECTORY
    rfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # the top (or the layer's root)
    try:
        return open_beneath(rfd, rel_dir, flags)
    finally:
        os.close(rfd)


@contextlib.contextmanager
def _at(root: str, rel: str) -> Iterator[tuple[int, str]]:
    """``(descriptor of rel's directory, rel's name)``, the directory reached as by :func:`_dir_at`."""
    fd = _dir_at(root, os.path.dirname(rel))
    try:
        yield fd, os.path.basename(rel)
    finally:
        os.close(fd)


def _gone(exc: OSError) -> bool:
    """Whether ``exc`` says an entry is not there, or not reachable without following a link."""
    return isinstance(exc, (FileNotFoundError, NotADirectoryError, Refused)) or exc.errno == errno.ELOOP


def _host_entry(top: str, rel: str) -> tuple[os.stat_result, Entry] | None:
    """``rel``'s status and entry on the host, reached without following a link; ``None`` when it
    is gone (or a socket, a device)."""
    try:
        with _at(top, rel) as (fd, name):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            e = _entry(rel, st, fd, name)
    except OSError as exc:
        if _gone(exc):
            return None
        raise
    return (st, e) if e is not None else None


def _entry(rel: str, st: os.stat_result, dirfd: int, name: str) -> Entry | None:
    """The entry of ``name`` in the directory of ``dirfd`` (``rel`` in its tree), of status ``st``."""
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        kind = "dir"
    elif stat.S_ISREG(mode):
        kind = "file"
    elif stat.S_ISLNK(mode):
        kind = "link"
    elif stat.S_ISFIFO(mode):
        kind = "fifo"
    else:
        return None  # a socket or a device: nothing the user could make a copy of
    target = ""
    if kind == "link":
        try:
            target = os.readlink(name, dir_fd=dirfd)
        except OSError:
            return None
    size, ino = st.st_size, st.st_ino
    return Entry(rel, kind, stat.S_IMODE(mode), size, st.st_atime_ns, st.st_mtime_ns, ino, target, st.st_ctime_ns)


def _warn_once(tree: str, what: str) -> None:
    if tree in _WARNED:
        return
    _WARNED.add(tree)
    warnings.warn(
        f"pytest-boxlite: {what}: in this user's boxes, changing files there whose group is not the "
        f"user's own fails with EOVERFLOW; `chgrp -R {os.getegid()} {tree}` gives them the user's group",
        RuntimeWarning,
        stacklevel=3,
    )


@dataclass
class _Built:
    """A layer on disk: its root, when its copies were made and the files it does not hold."""

    tree: str
    copied_ns: int
    absent: set[str]


def _build(top: str, entries: Sequence[Entry]) -> _Built | None:
    """The layer of ``entries`` of ``top`` (the caller holds ``_BUILD``): made once per distinct set
    (their looks and inodes key it), in a fresh directory renamed into place, or one made before and
    never changed since (its ``ready`` mark says when its copies were made and which files it lacks)."""
    from pytest_boxlite.runtimes.namespace.layout import private_tmp

    key = hashlib.sha256(repr(("v2", top, [e.look() for e in entries])).encode()).hexdigest()[:20]
    base = private_tmp() / "regroup" / hashlib.sha256(top.encode()).hexdigest()[:12]
    layer = base / key
    made = _ready(layer)
    if made is not None:
        with contextlib.suppress(OSError):
            os.utime(layer / "ready")
        return made
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    if layer.exists():
        # One made of these entries and changed in place since (see _go_live): a box that stacks it
        # may still be live, so it stays as it is, and this one is made beside it.
        layer = base / f"{key}.{secrets.token_hex(4)}"
    tmp = base / f"{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    copied_ns = time.time_ns()
    try:
        absent, left = _populate(top, tmp / "tree", entries)
        (tmp / "ready").write_text(json.dumps({"copied_ns": copied_ns, "absent": sorted(absent)}))
        os.rename(tmp, layer)
    except OSError as exc:
        _remove(tmp)  # a leftover is pruned with the stale layers
        made = _ready(layer)
        if made is not None:
            return made  # another process built it meanwhile
        _warn_once(top, f"no copy-on-write layer could be made for the files of {top} ({exc})")
        return None
    if left:
        _warn_once(top, f"{left} files of {top} past the {MAX_COPY_BYTES >> 20} MiB copy cap were not copied")
    _prune(base, keep=layer)
    return _Built(str(layer / "tree"), copied_ns, absent)


def _ready(layer: Path) -> _Built | None:
    """The layer at ``layer`` if it is complete and was never changed in place, else ``None``."""
    try:
        with open(layer / "ready", "rb") as fh:
            raw = fh.read(64 << 20)  # our own file in the user's private directory; bounded all the same
        mark = json.loads(raw)
        copied_ns, absent = int(mark["copied_ns"]), {str(a) for a in mark["absent"]}
    except (OSError, ValueError, TypeError, KeyError):
        return None  # absent, half written or of an older version: made anew
    return _Built(str(layer / "tree"), copied_ns, absent)


def _populate(top: str, root: Path, entries: Sequence[Entry]) -> tuple[set[str], int]:
    """Make ``entries`` under ``root``; returns the files not copied (unreadable, changed meanwhile,
    past the copy cap, or no longer reached without following a link) and how many of them were
    left out for the cap."""
    root.mkdir(parents=True, mode=0o700)
    tree = str(root)
    budget = MAX_COPY_BYTES
    left = 0
    absent: set[str] = set()
    dirs: list[Entry] = []
    for e in entries:  # sorted: a directory comes before what is in it
        with _at(tree, e.rel) as (lfd, name):
            if e.kind == "dir":
                os.mkdir(name, 0o700, dir_fd=lfd)
                dirs.append(e)
            elif e.kind == "link":
                os.symlink(e.target, name, dir_fd=lfd)
                os.utime(name, ns=(e.atime_ns, e.mtime_ns), dir_fd=lfd, follow_symlinks=False)
            elif e.kind == "fifo":
                os.mkfifo(name, 0o600, dir_fd=lfd)
                _chmod_at(lfd, name, e.mode)
                os.utime(name, ns=(e.atime_ns, e.mtime_ns), dir_fd=lfd, follow_symlinks=False)
            elif e.size > budget:
                left += 1
                absent.add(e.rel)
            elif _copy_file(top, e, lfd, name):
                budget -= e.size
            else:
                absent.add(e.rel)
    # Modes and times last, deepest first: a directory's own mode may forbid making what is in it,
    # and making it changes its time.
    for e in reversed(dirs):
        with _at(tree, e.rel) as (lfd, name):
            _chmod_at(lfd, name, e.mode & 0o7777)
            os.utime(name, ns=(e.atime_ns, e.mtime_ns), dir_fd=lfd, follow_symlinks=False)
    return absent, left


def _open_host_file(top: str, rel: str) -> int | None:
    """``rel`` of the host opened for reading, reached without following a link; ``None`` when it
    cannot be (unreadable for the user, gone, a link on the way)."""
    try:
        with _at(top, rel) as (hfd, name):
            return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=hfd)
    except OSError:
        return None


def _copy_file(top: str, e: Entry, lfd: int, name: str) -> bool:
    """Copy one file's content (a reflink where the filesystem can), mode and times into ``name``
    of the layer directory ``lfd``; ``False`` (and nothing made) when it cannot be read or is no
    longer the file that was looked at."""
    fd = _open_host_file(top, e.rel)
    if fd is None:
        return False  # unreadable for the user: unreadable in the box too, and never written there
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != e.ino:
            return False
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=lfd)
        try:
            _write_copy(fd, out, e)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return True


def _write_copy(fd: int, out: int, e: Entry) -> None:
    """``out`` made the content of ``fd`` (a reflink where the filesystem can; whatever ``out``
    held beyond it cut off), with ``e``'s mode and times."""
    try:
        fcntl.ioctl(out, _FICLONE, fd)
        os.ftruncate(out, os.fstat(fd).st_size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS):
            raise
        written = 0
        while n := os.sendfile(out, fd, None, 1 << 20):
            written += n
        os.ftruncate(out, written)
    os.fchmod(out, e.mode & 0o7777)
    os.utime(out, ns=(e.atime_ns, e.mtime_ns))


def _prune(base: Path, keep: Path) -> None:
    """Remove this directory's layers unused for a day (a live box's layer is in use: touched)."""
    now = time.time()
    with contextlib.suppress(OSError):
        for p in base.iterdir():
            if p == keep:
                continue
            with contextlib.suppress(OSError):
                ready = p / "ready"
                stamp = ready.stat().st_mtime if ready.exists() else p.lstat().st_mtime
                if now - stamp > _STALE_S:
                    _remove(p)


def _remove(p: Path) -> None:
    """Remove ``p`` (a layer's directory of this user's) and all below it, through descriptors
    (a copied mode that lacks write or search is given them first); what cannot go is left to
    the next prune."""
    with contextlib.suppress(OSError):
        fd = os.open(p.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            remove_tree_at(fd, p.name)
        finally:
            os.close(fd)


# --- keeping the layers of live boxes current ---------------------------------------------------

_IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE = 0x2, 0x4, 0x8
_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x40, 0x80, 0x100, 0x200
_IN_DELETE_SELF, _IN_MOVE_SELF, _IN_Q_OVERFLOW, _IN_IGNORED = 0x400, 0x800, 0x4000, 0x8000
_IN_ONLYDIR, _IN_DONT_FOLLOW, _IN_EXCL_UNLINK = 0x01000000, 0x02000000, 0x04000000
#: What changes a directory's entries or the entries themselves (not reads, not opens).
_WATCH_MASK = (
    _IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
    | _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_ONLYDIR | _IN_DONT_FOLLOW | _IN_EXCL_UNLINK
)  # fmt: skip
_EVENT = struct.Struct("=iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)
#: Whether a descriptor can be watched through its ``/proc/self/fd`` entry.
_PROC_FD = os.path.isdir("/proc/self/fd")
#: Event bytes read per settle: past it, every layer is compared whole instead.
_MAX_EVENT_BYTES = 4 << 20
#: How long a settle waits for another process of this user changing the same layer.
_LOCK_WAIT_S = 5.0


@dataclass(eq=False)
class _Live:
    """A layer that boxes of this process stack, and what it holds (as the host had it when copied)."""

    top: str
    tree: str
    trees: tuple[str, ...]
    held: dict[str, Entry]
    absent: dict[str, Entry]  # files of the scan it does not hold (unreadable, past the cap)
    used: int
    copied_ns: int
    polled: bool = False  # no watches: every settle compares each entry's look
    changed: bool = False  # changed in place: no later box start takes it by its key
    failed: bool = False  # a change could not be made: said once, no longer kept current
    dirty: set[str] = field(default_factory=set)
    forced: set[str] = field(default_factory=set)  # copied again even where the look is the same
    full: bool = False  # compare everything (events were lost, a watched directory moved)

    def matches(self, entries: dict[str, Entry]) -> bool:
        """Whether this layer is what a box start that scanned ``entries`` would stack."""
        if self.failed or len(entries) != len(self.held) + len(self.absent):
            return False
        for rel, e in entries.items():
            mine = self.held.get(rel) or self.absent.get(rel)
            if mine is None or mine.look() != e.look():
                return False
        return True


_LIVE: dict[str, _Live] = {}
#: A watch on a host directory: its copy-on-write directory and the directory's path in it.
_WDS: dict[int, tuple[str, str]] = {}
_WATCHER: _Inotify | None = None
_NO_INOTIFY: list[str] = []  # why there is none (said in the polled layers' stead)


class _Inotify:
    """This process's inotify instance (non-blocking, closed on exec)."""

    def __init__(self) -> None:
        import ctypes

        self._libc = ctypes.CDLL(None, use_errno=True)
        fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.fd: int = fd

    def add(self, path: str, mask: int) -> int:
        import ctypes

        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), mask)
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        return int(wd)

    def events(self) -> Iterator[tuple[int, int, str]] | None:
        """``(wd, mask, name)`` of what is queued (``None``: more than a settle reads, compare all)."""
        out: list[tuple[int, int, str]] = []
        total = 0
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return iter(out)
            total += len(buf)
            if total > _MAX_EVENT_BYTES:
                return None
            i = 0
            while i + _EVENT.size <= len(buf):
                wd, mask, _cookie, n = _EVENT.unpack_from(buf, i)
                raw = buf[i + _EVENT.size : i + _EVENT.size + n].split(b"\0", 1)[0]
                out.append((wd, mask, os.fsdecode(raw)))
                i += _EVENT.size + n


def settle() -> None:
    """Bring every layer this process's boxes stack up to what the host has now (before a box is
    forked from a warm one: its test must read the host's files as they are).  Cheap where nothing
    changed: one read of the queued events."""
    if not _LIVE:
        return
    with _BUILD:
        _settle_locked()


def _go_live(top: str, built: _Built, entries: dict[str, Entry], trees: Iterable[str]) -> None:
    """Keep ``built`` current from now on: watch the host directories it has copies of, then
    compare what it holds with the host (what changed since the scan, or within a clock tick of
    its copies, is copied again)."""
    global _WATCHER
    held = {r: e for r, e in entries.items() if r not in built.absent}
    absent = {r: e for r, e in entries.items() if r in built.absent}
    used = sum(e.size for e in held.values() if e.kind == "file")
    live = _Live(top, built.tree, tuple(trees), held, absent, used, built.copied_ns)
    if _WATCHER is None and not _NO_INOTIFY:
        try:
            _WATCHER = _Inotify()
        except OSError as exc:
            _NO_INOTIFY.append(str(exc))
        else:
            threading.Thread(target=_watch_loop, args=(_WATCHER,), name="boxlite-regroup", daemon=True).start()
    for rel, e in held.items():
        if e.kind == "dir":
            _watch(live, rel)
    _watch(live, "")  # the top itself: entries made or removed right in it
    live.dirty |= set(entries)
    live.forced |= {r for r, e in held.items() if e.kind == "file" and e.ctime_ns >= built.copied_ns - _RACY_NS}
    _LIVE[built.tree] = live
    _sync(live)


def _watch(live: _Live, rel: str) -> None:
    """Watch the host directory ``rel``: the one reached without following a link (through its
    descriptor's ``/proc/self/fd`` entry; by its path where ``/proc`` is not mounted)."""
    if _WATCHER is None:
        live.polled = True
        return
    try:
        if _PROC_FD:
            fd = _dir_at(live.top, rel)
            try:
                wd = _WATCHER.add(f"/proc/self/fd/{fd}", _WATCH_MASK & ~_IN_DONT_FOLLOW)
            finally:
                os.close(fd)
        else:
            wd = _WATCHER.add(os.path.join(live.top, rel) if rel else live.top, _WATCH_MASK)
    except OSError as exc:
        if _gone(exc):
            live.dirty.add(rel)  # gone meanwhile (or a link now): the sync removes its copy
        else:
            live.polled = True  # watches used up (ENOSPC): compared at each settle instead
        return
    _WDS[wd] = (live.top, rel)


def _watch_loop(watcher: _Inotify) -> None:
    """The host changes files while boxes live: bring their copies up to date as it does."""
    while True:
        try:
            select.select([watcher.fd], [], [])
        except (OSError, ValueError):
            return  # closed: this process no longer keeps layers current (see _forget_after_fork)
        with _BUILD:
            if _WATCHER is not watcher:
                return
            _settle_locked()


def _settle_locked() -> None:
    if _WATCHER is not None:
        events = _WATCHER.events()
        if events is None:
            for live in _LIVE.values():
                live.full = True
        else:
            for wd, mask, name in events:
                _note(wd, mask, name)
    for live in list(_LIVE.values()):
        if live.failed:
            continue
        if live.polled:
            live.dirty |= set(live.held) | set(live.absent)
        if live.full:
            live.full = False
            live.dirty |= set(live.held) | set(live.absent)
            for tree in live.trees:
                live.dirty |= set(scan(live.top, tree, os.geteuid(), os.getegid()))
            for rel, e in list(live.held.items()):
                if e.kind == "dir":
                    _watch(live, rel)  # a moved directory's watch names its new path
        if live.dirty:
            _sync(live)


def _note(wd: int, mask: int, name: str) -> None:
    """Mark what an event says changed in every live layer of its directory."""
    if mask & _IN_Q_OVERFLOW:
        for live in _LIVE.values():
            live.full = True
        return
    where = _WDS.get(wd)
    if where is None:
        return
    top, rel_dir = where
    if mask & _IN_IGNORED:
        del _WDS[wd]
        return
    rel = f"{rel_dir}/{name}" if rel_dir and name else name or rel_dir
    for live in _LIVE.values():
        if live.top != top:
            continue
        if mask & (_IN_MOVE_SELF | _IN_DELETE_SELF):
            live.full = True  # its path is no longer the one watched
        if rel:
            live.dirty.add(rel)
            if mask & (_IN_MODIFY | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE):
                live.forced.add(rel)  # written: copied again even if its times did not move (one tick)
        if rel_dir:
            live.dirty.add(rel_dir)  # its own times


def _sync(live: _Live) -> None:
    """Make ``live``'s copies of its dirty entries what the host has now (under its lock: other
    processes of this user may stack and keep the same layer)."""
    todo, forced = live.dirty, live.forced
    live.dirty, live.forced = set(), set()
    uid, gid = os.geteuid(), os.getegid()
    try:
        with _layer_lock(live):
            fix: set[str] = set()
            heap = [(r.count("/"), r) for r in todo if r]
            heapq.heapify(heap)  # a directory before what is in it
            seen: set[str] = set()
            while heap:
                _, rel = heapq.heappop(heap)
                if rel in seen:
                    continue
                seen.add(rel)
                if len(seen) > MAX_ENTRIES:
                    _warn_once(live.top, f"more than {MAX_ENTRIES} entries of {live.top} changed at once")
                    break
                for more in _sync_one(live, rel, rel in forced, uid, gid, fix):
                    heapq.heappush(heap, (more.count("/"), more))
            for rel in sorted(fix, key=lambda r: -r.count("/")):  # deepest first: making it moves its time
                _fix_dir(live, rel)
    except OSError as exc:
        live.failed = True
        _warn_once(
            live.top,
            f"the re-owned copy of {live.top} could not be kept current ({exc}); its live boxes may see "
            "files as they were when they started",
        )


@contextlib.contextmanager
def _layer_lock(live: _Live) -> Iterator[None]:
    fd = os.open(os.path.dirname(live.tree), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OSError(errno.ETIMEDOUT, "another process holds the layer's lock") from None
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)  # and with it the lock


def _changing(live: _Live) -> None:
    """Before the first change in place: no later box start may take this layer by its key."""
    if not live.changed:
        live.changed = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(os.path.dirname(live.tree), "ready"))


def _sync_one(live: _Live, rel: str, forced: bool, uid: int, gid: int, fix: set[str]) -> set[str]:
    """Bring the copy of ``rel`` up to date; returns entries to look at next (a new directory's).

    Both ends are reached without following a link (see the module docstring): on the host, an
    entry whose way holds a link is gone; in the layer, nothing is ever below a copied link (a
    directory dropped takes what was held below it along)."""
    parent = os.path.dirname(rel)
    if parent and (parent not in live.held or live.held[parent].kind != "dir"):
        if parent in live.held:
            _forget_below(live, parent)  # below a link (never so: a dropped directory takes them)
        return set()  # its directory is not in the layer: the host's shows as it is
    old = live.held.get(rel)
    if old is None and rel not in live.absent and not any(_rel_under(live, rel, t) for t in live.trees):
        return set()  # beside the trees its boxes are made for (in a directory above them): not looked at
    got = _host_entry(live.top, rel)
    st, new = got if got is not None else (None, None)
    if st is not None and st.st_uid != uid:
        new = None
    if new is not None and st is not None and st.st_gid == gid and old is None:
        new = None  # of the user's own group: the host's shows as it is
    # A copy held already stays, brought up to date, even where the host's is now of the user's own
    # group (an editor's save makes a new file): a live box's overlay keeps the copy's inode
    # cached, so only a change made in it reaches that box.
    if new is None or (old is not None and old.kind != new.kind):
        live.absent.pop(rel, None)
        if old is not None:
            _changing(live)
            _writable(live, parent, fix)
            with _at(live.tree, rel) as (lfd, name):
                _drop(lfd, name, old.kind)
            del live.held[rel]
            if old.kind == "file":
                live.used -= old.size
            if old.kind == "dir":
                _forget_below(live, rel)  # their copies went with it
        if new is None:
            return set()
        old = None
    if old is not None and not forced and old.look() == new.look() and rel not in live.absent:
        return set()
    if old is None and rel in live.absent and not forced and live.absent[rel].look() == new.look():
        return set()  # not copied before (unreadable, past the cap) and not changed since
    if old is None or old.look() != new.look():
        _changing(live)  # a copy made again with the same look (a clock tick's doubt) keeps the key true
    _writable(live, parent, fix)
    more: set[str] = set()
    if new.kind == "dir":
        if old is None:
            with _at(live.tree, rel) as (lfd, name):
                os.mkdir(name, 0o700, dir_fd=lfd)
            more = {f"{rel}/{n}" for n in _host_names(live.top, rel)}  # what it holds: looked at next
        live.held[rel] = new
        fix.add(rel)
        _watch(live, rel)
        return more
    if new.kind == "link":
        with _at(live.tree, rel) as (lfd, name):
            tmp = f"{name}.{secrets.token_hex(4)}.boxlite"
            os.symlink(new.target, tmp, dir_fd=lfd)
            os.utime(tmp, ns=(new.atime_ns, new.mtime_ns), dir_fd=lfd, follow_symlinks=False)
            os.replace(tmp, name, src_dir_fd=lfd, dst_dir_fd=lfd)
    elif new.kind == "fifo":
        with _at(live.tree, rel) as (lfd, name):
            if old is None:
                os.mkfifo(name, 0o600, dir_fd=lfd)
            _chmod_at(lfd, name, new.mode)
            os.utime(name, ns=(new.atime_ns, new.mtime_ns), dir_fd=lfd, follow_symlinks=False)
    else:
        copied = _refresh_file(live, rel, old.size if old is not None else 0)
        if copied is None:
            if old is not None:
                with _at(live.tree, rel) as (lfd, name):
                    _drop(lfd, name, "file")  # the host's shows (its group unmapped): never an old content
                del live.held[rel]
                live.used -= old.size
            live.absent[rel] = new
            return set()
        new = copied
        live.used += new.size - (old.size if old is not None else 0)
    live.absent.pop(rel, None)
    live.held[rel] = new
    return more


def _rel_under(live: _Live, rel: str, tree: str) -> bool:
    """Whether the host's ``rel`` lies inside ``tree``."""
    return os.path.join(live.top, rel).startswith(tree.rstrip("/") + "/")


def _forget_below(live: _Live, rel: str) -> None:
    """Forget every entry held (or left out) below ``rel``: its copy is gone, or it is no directory."""
    prefix = rel + "/"
    for r in [r for r in live.held if r.startswith(prefix)]:
        e = live.held.pop(r)
        if e.kind == "file":
            live.used -= e.size
    for r in [r for r in live.absent if r.startswith(prefix)]:
        del live.absent[r]


def _host_names(top: str, rel: str) -> list[str]:
    """The names in the host directory ``rel``, reached without following a link (none when it
    cannot be listed)."""
    try:
        fd = _dir_at(top, rel, listable=True)
    except OSError:
        return []
    try:
        with os.scandir(fd) as it:
            return [de.name for de in it]
    finally:
        os.close(fd)


def _writable(live: _Live, rel_dir: str, fix: set[str]) -> None:
    """The copy of ``rel_dir`` (the layer's root for ``""``) writable by the user until _fix_dir."""
    if not rel_dir:
        if stat.S_IMODE(os.lstat(live.tree).st_mode) & 0o700 != 0o700:
            os.chmod(live.tree, 0o700)
        return
    fix.add(rel_dir)
    with _at(live.tree, rel_dir) as (lfd, name):
        st = os.stat(name, dir_fd=lfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "the layer's copy is not a directory", rel_dir)
        if stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
            _chmod_at(lfd, name, 0o700)


def _fix_dir(live: _Live, rel: str) -> None:
    """Give the copy of the directory ``rel`` the host's mode and times again."""
    e = live.held.get(rel)
    if e is None or e.kind != "dir":
        return
    got = _host_entry(live.top, rel)
    if got is not None and got[1].kind == "dir":
        e = got[1]
        live.held[rel] = e
    with _at(live.tree, rel) as (lfd, name):
        _chmod_at(lfd, name, e.mode & 0o7777)
        os.utime(name, ns=(e.atime_ns, e.mtime_ns), dir_fd=lfd, follow_symlinks=False)


def _chmod_at(lfd: int, name: str, mode: int) -> None:
    """``chmod`` of ``name`` in the layer directory ``lfd``, a link left as it is.  The layer is
    this user's private directory, changed only under its lock: a check, then a chmod by name
    (``fchmodat``'s no-follow flag needs a recent C library)."""
    if not stat.S_ISLNK(os.stat(name, dir_fd=lfd, follow_symlinks=False).st_mode):
        os.chmod(name, mode, dir_fd=lfd)


def _drop(lfd: int, name: str, kind: str) -> None:
    """Remove the copy ``name`` of the layer directory ``lfd`` (a directory with all below it)."""
    if kind == "dir":
        remove_tree_at(lfd, name)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=lfd)


def _refresh_file(live: _Live, rel: str, old_size: int) -> Entry | None:
    """Copy the host's ``rel`` into its copy in place (the same inode: a box that has the copy open
    or cached reads the new content); its entry as copied, or ``None`` where it cannot be
    (unreadable for the user, past the copy cap, a link on its way: then the caller removes the copy)."""
    fd = _open_host_file(live.top, rel)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        if live.used - old_size + st.st_size > MAX_COPY_BYTES:
            _warn_once(live.top, f"files of {live.top} grew past the {MAX_COPY_BYTES >> 20} MiB copy cap")
            return None
        e = _entry(rel, st, fd, "")  # a file: nothing is read by name
        assert e is not None
        with _at(live.tree, rel) as (lfd, name):
            with contextlib.suppress(FileNotFoundError):
                if stat.S_IMODE(os.stat(name, dir_fd=lfd, follow_symlinks=False).st_mode) & 0o200 == 0:
                    _chmod_at(lfd, name, 0o600)  # a read-only file's copy
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=lfd)
        try:
            _write_copy(fd, out, e)  # in place: a longer old content does not stay behind
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return e


def _forget_after_fork() -> None:
    """A child forked from this process keeps no layer current (the parent does)."""
    global _BUILD, _WATCHER
    _BUILD = threading.Lock()
    if _WATCHER is not None:
        with contextlib.suppress(OSError):
            os.close(_WATCHER.fd)
    _WATCHER = None
    _LIVE.clear()
    _WDS.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
