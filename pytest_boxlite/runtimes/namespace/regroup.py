"""Copy-on-write for an ordinary user's files whose group the box cannot map.

An ordinary user's box maps one uid and one gid: the user's own, as root.  A file the user owns
whose group is another one (a tree root extracted and then ``chown -R user``-ed, a shared
directory's setgid group) shows in the box with the overflow group, and overlayfs cannot copy it
up: the copy's group cannot be set, so writing the file, or removing or renaming anything in such a
directory, fails with ``EOVERFLOW`` ("Value too large for defined data type").  The host user can
do all of that; the box must let its guest do it too, without any write reaching the host.

So each such directory's entries get one more lower layer right above the host's directory: a copy
of them that the user owns with the user's own group, same modes, times and content (a reflink
where the filesystem has them).  The layer is built on the host in the user's private directory
(see :func:`~pytest_boxlite.runtimes.namespace.mounts.private_tmp`), before the box starts, and is
only ever a *lower* layer: the box writes to its own upper layer as before, never to the copy nor
to the host's files.  Only the trees a box is made for are looked at (the working directory, the
interpreter's prefix and ``sys.path``), and only entries the user owns and may already change on
the host: a file of another owner keeps its look (and stays unwritable, as on the host).

A root host maps every id one to one (see ``privileges._write_id_maps``): nothing to do there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import secrets
import shutil
import stat
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: Entries looked at per tree: a tree this large (a home directory as the working directory) is
#: left as it is past this many, and said so.
MAX_ENTRIES = 200_000
#: File content copied per layer.  Past it, directories are still re-owned (removing and renaming
#: in them works) but the files left over are not (writing one fails as before), and said so.
MAX_COPY_BYTES = 256 * 1024 * 1024
#: A layer unused this long is removed when another one of the same directory is built.
_STALE_S = 24 * 3600
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)


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
    entries: dict[str, Entry] = {}
    for tree in trees:
        if tree == top or tree.startswith(top.rstrip("/") + "/"):
            entries.update(scan(top, tree, uid, gid))
    if not entries:
        return None
    return _build(top, sorted(entries.values(), key=lambda e: e.rel))


def scan(top: str, tree: str, uid: int, gid: int) -> dict[str, Entry]:
    """Entries of ``tree`` (inside ``top``) owned by ``uid`` with a group other than ``gid``, and
    the directories above them up to ``top`` (none when there are no such entries).  Links are never followed;
    a directory of another owner is not entered (the box cannot change it, nor can the user)."""
    found: dict[str, Entry] = {}
    rel_tree = os.path.relpath(tree, top)
    # The directories between top and tree must be the user's: a copy of one would show it as the
    # box's root's, which the host's is not.
    parts = [] if rel_tree == "." else rel_tree.split("/")
    ancestors: list[tuple[str, os.stat_result]] = []
    for i in range(1, len(parts) + 1):
        rel = "/".join(parts[:i])
        try:
            st = os.lstat(os.path.join(top, rel))
        except OSError:
            return {}
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            return {}
        ancestors.append((rel, st))
    seen = 0
    hits: list[Entry] = []
    stack = [rel_tree]
    while stack:
        rel_dir = stack.pop()
        try:
            it = os.scandir(os.path.join(top, rel_dir))
        except OSError:
            continue  # unreadable: its own entry (if any) is re-owned, its content is not visible
        with it:
            for de in it:
                seen += 1
                if seen > MAX_ENTRIES:
                    _warn_once(tree, f"{tree} has more than {MAX_ENTRIES} entries; those past them were not looked at")
                    stack.clear()
                    break
                try:
                    st = de.stat(follow_symlinks=False)
                except OSError:
                    continue
                rel = de.name if rel_dir == "." else f"{rel_dir}/{de.name}"
                if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
                    stack.append(rel)
                if st.st_uid != uid or st.st_gid == gid:
                    continue
                entry = _entry(rel, st, os.path.join(top, rel))
                if entry is not None:
                    hits.append(entry)
    if not hits:
        return {}
    for rel, st in ancestors:
        e = _entry(rel, st, os.path.join(top, rel))
        if e is not None:
            found[rel] = e
    for e in hits:
        found[e.rel] = e
    # Every directory above a re-owned entry must be in the layer (with its own look).
    for e in hits:
        parent = os.path.dirname(e.rel)
        while parent and parent not in found:
            try:
                st = os.lstat(os.path.join(top, parent))
            except OSError:
                break
            pe = _entry(parent, st, os.path.join(top, parent))
            if pe is None:
                break
            found[parent] = pe
            parent = os.path.dirname(parent)
    return found


def _entry(rel: str, st: os.stat_result, path: str) -> Entry | None:
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
            target = os.readlink(path)
        except OSError:
            return None
    return Entry(rel, kind, stat.S_IMODE(mode), st.st_size, st.st_atime_ns, st.st_mtime_ns, st.st_ino, target)


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


def _build(top: str, entries: Sequence[Entry]) -> str | None:
    """The layer of ``entries`` of ``top``: made once per distinct set (their looks and inodes
    key it), in a fresh directory renamed into place, so a layer a live box stacks is never changed."""
    from pytest_boxlite.runtimes.namespace.layout import private_tmp

    # Not the access times: reading a file (a box's lookups, the copy itself) may change them.
    looks = [(e.rel, e.kind, e.mode, e.size, e.mtime_ns, e.ino, e.target) for e in entries]
    key = hashlib.sha256(repr((top, looks)).encode()).hexdigest()[:20]
    base = private_tmp() / "regroup" / hashlib.sha256(top.encode()).hexdigest()[:12]
    layer = base / key
    with _BUILD:
        if (layer / "ready").is_file():
            with contextlib.suppress(OSError):
                os.utime(layer / "ready")
            return str(layer / "tree")
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = base / f"{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            left = _populate(top, tmp / "tree", entries)
            (tmp / "ready").write_text("")
            os.rename(tmp, layer)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if (layer / "ready").is_file():
                return str(layer / "tree")  # another process built it meanwhile
            _warn_once(top, f"no copy-on-write layer could be made for the files of {top} ({exc})")
            return None
        if left:
            _warn_once(top, f"{left} files of {top} past the {MAX_COPY_BYTES >> 20} MiB copy cap were not copied")
        _prune(base, keep=layer)
    return str(layer / "tree")


def _populate(top: str, root: Path, entries: Sequence[Entry]) -> int:
    """Make ``entries`` under ``root``; returns how many files were left out for the copy cap."""
    root.mkdir(parents=True, mode=0o700)
    budget = MAX_COPY_BYTES
    left = 0
    dirs: list[Entry] = []
    for e in entries:  # sorted: a directory comes before what is in it
        dst = os.path.join(root, e.rel)
        if e.kind == "dir":
            os.mkdir(dst, 0o700)
            dirs.append(e)
        elif e.kind == "link":
            os.symlink(e.target, dst)
            os.utime(dst, ns=(e.atime_ns, e.mtime_ns), follow_symlinks=False)
        elif e.kind == "fifo":
            os.mkfifo(dst, 0o600)
            os.chmod(dst, e.mode)
            os.utime(dst, ns=(e.atime_ns, e.mtime_ns))
        elif e.size > budget:
            left += 1
        elif _copy_file(os.path.join(top, e.rel), dst, e):
            budget -= e.size
    # Modes and times last, deepest first: a directory's own mode may forbid making what is in it,
    # and making it changes its time.
    for e in reversed(dirs):
        dst = os.path.join(root, e.rel)
        os.chmod(dst, e.mode & 0o7777)
        os.utime(dst, ns=(e.atime_ns, e.mtime_ns))
    return left


def _copy_file(src: str, dst: str, e: Entry) -> bool:
    """Copy one file's content (a reflink where the filesystem can), mode and times; ``False`` (and
    nothing made) when it cannot be read or is no longer the file that was looked at."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False  # unreadable for the user: unreadable in the box too, and never written there
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != e.ino:
            return False
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.ioctl(out, _FICLONE, fd)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS):
                    raise
                while os.sendfile(out, fd, None, 1 << 20):
                    pass
            os.fchmod(out, e.mode & 0o7777)
            os.utime(out, ns=(e.atime_ns, e.mtime_ns))
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return True


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
                    _make_removable(p)
                    shutil.rmtree(p, ignore_errors=True)


def _make_removable(p: Path) -> None:
    """Give the user write and search on every directory of ``p`` (a copied mode may lack them)."""
    for dirpath, dirnames, _ in os.walk(p):
        for d in dirnames:
            full = os.path.join(dirpath, d)
            with contextlib.suppress(OSError):
                if not os.path.islink(full):
                    os.chmod(full, 0o700)
