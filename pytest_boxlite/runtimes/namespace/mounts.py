"""The mount plan: how the host's filesystem appears in a box (copy-on-write overlays, read-only
binds), and the mask layers that hide credentials and the boxlite home from guests."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import re
import secrets
import shutil
import stat
import sys
import threading
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path

from pytest_boxlite.runtimes._homes import STATE_ENTRIES, boxlite_homes
from pytest_boxlite.runtimes.namespace.layout import private_tmp
from pytest_boxlite.runtimes.namespace.regroup import regroup_args

#: Credential directories masked by an empty tmpfs inside every box (in every home it can read).
_SECRET_DIRS = (
    ".ssh", ".gnupg", ".aws", ".azure", ".kube", ".docker", ".config/gcloud", ".config/gh", ".config/hub",
    ".password-store", ".terraform.d", ".oci", ".config/op", ".config/rclone",
)  # fmt: skip
#: Credential files masked by /dev/null.
_SECRET_FILES = (
    ".netrc", ".git-credentials", ".pypirc", ".npmrc", ".yarnrc", ".yarnrc.yml", ".m2/settings.xml",
    ".m2/settings-security.xml", ".cargo/credentials", ".cargo/credentials.toml", ".vault-token", ".pgpass",
    ".my.cnf", ".boto", ".s3cfg", ".config/pip/pip.conf", ".pip/pip.conf", ".gem/credentials",
    ".config/hub", ".dockercfg",
)  # fmt: skip
_SKIP_TOP = {"proc", "dev", "sys", "tmp", "run", "lost+found"}


def _mount_points() -> tuple[str, ...]:
    """Every mount point this process sees (``/proc/self/mountinfo``'s octal escapes undone)."""
    try:
        text = Path("/proc/self/mountinfo").read_text(errors="surrogateescape")
    except OSError:
        return ()
    points = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) > 4:
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
    return tuple(points)


def _mounts_below(top: str, points: Sequence[str] | None = None) -> bool:
    prefix = top.rstrip("/") + "/"
    return any(p.startswith(prefix) for p in (_mount_points() if points is None else points))


#: Bounds on what a directory holding other mounts costs (see :func:`_tree`): its sub-directories
#: shown copy-on-write (one overlay each, per box; past that they are copied into the snapshot),
#: and what the snapshot holds.
_TREE_OVERLAYS = 64
_TREE_FILE_BYTES = 1 << 20
_TREE_BYTES = 16 << 20
_TREE_ENTRIES = 8192


class _Tree:
    """The read-only snapshot of directories that hold other mounts, being built (see :func:`_tree`)."""

    def __init__(self, secret_files: frozenset[str], secret_dirs: frozenset[str]) -> None:
        self.secret_files = secret_files
        self.secret_dirs = secret_dirs
        #: ``(kind, relative path, mode, uid, gid, data or link target)``, parents first.
        self.items: list[tuple[str, str, int, int, int, bytes]] = []
        #: The plan entries of what is shown in it copy-on-write (its sub-directories and mounts).
        self.overlays: list[tuple[str, ...]] = []
        #: What could not be shown within the bounds above: left out (directories shown empty).
        self.left_out: list[str] = []
        self.size = 0


def _tree(top: str, path: str, points: Sequence[str], tree: _Tree, budget: list[int]) -> None:
    """Record directory ``path`` (below ``top``), which has other mounts below it, into ``tree``.

    Such a directory cannot be an overlay's lower layer in a user namespace (overlayfs refuses a
    lower directory with locked mounts beneath it), and a read-only bind of it would show the
    host's sockets and FIFOs themselves: a box could ``connect()`` to every daemon listening there.
    So a box sees a read-only snapshot of it instead (its links, its regular files copied, empty
    directories where its sub-directories go), with each sub-directory (and each mount) that has no
    mount below it laid on top as an overlay of its own, as a top-level directory is; past
    ``budget`` (overlays left) such a sub-directory is copied into the snapshot whole instead.
    Sockets, FIFOs and devices are never shown from it; those in the overlays are the overlay's own
    inodes, which no host process listens on.  What does not fit the bounds is left out, recorded.
    """
    if not _copy_dir(top, path, tree):
        return
    for name in _names(path):
        p = path.rstrip("/") + "/" + name
        st = _entry(p, tree)
        if st is None or not stat.S_ISDIR(st.st_mode):
            continue
        if _mounts_below(p, points):
            _tree(top, p, points, tree, budget)
        elif p in tree.secret_dirs:
            tree.items.append(("dir", os.path.relpath(p, top), 0o700, st.st_uid, st.st_gid, b""))  # empty
        elif budget[0] > 0:
            budget[0] -= 1
            tree.items.append(("dir", os.path.relpath(p, top), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, b""))
            tree.overlays.append(("overlay", p))
        else:
            _copy_tree(top, p, tree)


def _names(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _entry(path: str, tree: _Tree) -> os.stat_result | None:
    """``path``'s own status, or ``None`` (gone, or over the snapshot's bound on entries: recorded)."""
    if len(tree.items) >= _TREE_ENTRIES:
        tree.left_out.append(path)
        return None
    try:
        return os.lstat(path)
    except OSError:
        return None


def _copy_dir(top: str, path: str, tree: _Tree) -> bool:
    """Record directory ``path`` and its links and regular files (not its sub-directories) into
    ``tree``; ``False`` where it cannot be read (left out, recorded)."""
    try:
        st = os.lstat(path)
        names = sorted(os.listdir(path))
    except OSError:
        tree.left_out.append(path)
        return False
    tree.items.append(("dir", os.path.relpath(path, top), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, b""))
    for name in names:
        p = path.rstrip("/") + "/" + name
        est = _entry(p, tree)
        if est is None:
            continue
        r, mode = os.path.relpath(p, top), stat.S_IMODE(est.st_mode)
        if stat.S_ISLNK(est.st_mode):
            with contextlib.suppress(OSError):
                tree.items.append(("link", r, mode, est.st_uid, est.st_gid, os.fsencode(os.readlink(p))))
        elif stat.S_ISREG(est.st_mode):
            if p in tree.secret_files:
                # Empty, where the mask of a credential is bound (a mount needs its point).
                tree.items.append(("file", r, 0o600, est.st_uid, est.st_gid, b""))
                continue
            if est.st_size > _TREE_FILE_BYTES or tree.size + est.st_size > _TREE_BYTES:
                tree.left_out.append(p)
                continue
            data = _small_file(p, est)
            if data is None:
                continue  # not ours to read: a box of this user could not read it either
            if tree.size + len(data) > _TREE_BYTES:
                tree.left_out.append(p)
                continue
            tree.size += len(data)
            tree.items.append(("file", r, mode, est.st_uid, est.st_gid, data))
        # Sockets, FIFOs, devices: not shown (a bound one would be the host's own).
    return True


def _copy_tree(top: str, path: str, tree: _Tree) -> None:
    """Record directory ``path`` whole (no mount below it) into ``tree``, as :func:`_copy_dir` does."""
    todo = [path]
    while todo:
        here = todo.pop(0)
        if here in tree.secret_dirs:
            st = _entry(here, tree)
            if st is not None:
                tree.items.append(("dir", os.path.relpath(here, top), 0o700, st.st_uid, st.st_gid, b""))
            continue
        if _copy_dir(top, here, tree):
            for name in _names(here):
                p = here.rstrip("/") + "/" + name
                with contextlib.suppress(OSError):
                    if stat.S_ISDIR(os.lstat(p).st_mode):
                        todo.append(p)


def _small_file(path: str, st: os.stat_result) -> bytes | None:
    """``path``'s content if it is a regular file of at most :data:`_TREE_FILE_BYTES` we can read."""
    if st.st_size > _TREE_FILE_BYTES:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, _TREE_FILE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) <= _TREE_FILE_BYTES else None


def _write_tree(root: Path, items: Sequence[tuple[str, str, int, int, int, bytes]]) -> None:
    """Make the snapshot ``items`` (see :class:`_Tree`) under ``root``, owners kept where we may."""
    chown = os.geteuid() == 0
    dirs: list[tuple[Path, int]] = []
    for kind, rel, mode, uid, gid, data in items:
        target = root if rel == "." else root / rel
        if kind == "dir":
            target.mkdir(exist_ok=True, mode=0o700)
            dirs.append((target, mode))
        elif kind == "link":
            os.symlink(os.fsdecode(data), target)
        else:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, data)
                os.fchmod(fd, mode & 0o1777)  # no set-id bit on a copy of ours
            finally:
                os.close(fd)
        if chown:
            with contextlib.suppress(OSError):
                os.lchown(target, uid, gid)
    for d, mode in reversed(dirs):  # modes last: a read-only directory is filled first
        os.chmod(d, mode)


def _tree_snapshot(items: Sequence[tuple[str, str, int, int, int, bytes]]) -> str:
    """The snapshot directory of ``items`` in this user's private /tmp, made once per content."""
    key = hashlib.sha256(repr(list(items)).encode(errors="surrogateescape")).hexdigest()[:20]
    base = private_tmp() / "trees"
    base.mkdir(exist_ok=True, mode=0o700)
    done = base / key
    if not _is_dir(done):
        tmp = base / f"{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        os.mkdir(tmp, 0o700)
        try:
            _write_tree(tmp / "t", items)
            with contextlib.suppress(OSError):  # another session made the same one meanwhile: fine
                os.rename(tmp, done)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(done / "t")


def _is_dir(path: Path) -> bool:
    return stat.S_ISDIR(_lstat_mode(path))


def _empty_layer() -> str:
    """An empty directory: bubblewrap's read-only overlay takes two lower layers."""
    empty = private_tmp() / "empty"
    with contextlib.suppress(FileExistsError):
        os.mkdir(empty, 0o755)
    if _is_dir(empty):
        with os.scandir(empty) as found:
            if next(found, None) is None:
                return str(empty)
    raise OSError(f"{empty} should be an empty directory: remove it")


def _credentials() -> tuple[frozenset[str], frozenset[str]]:
    """The credential files and directories of every home we can list (never copied into a snapshot)."""
    files: set[str] = set()
    dirs: set[str] = set()
    for h in _homes():
        base = str(h).rstrip("/") + "/"
        files.update(base + n for n in _SECRET_FILES)
        dirs.update(base + n for n in _SECRET_DIRS)
    return frozenset(files), frozenset(dirs)


@lru_cache(maxsize=1)
def _plan() -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...], tuple[str, ...]]:
    """``(entries, trees, left out)``: see :func:`mount_plan`."""
    entries: list[tuple[str, ...]] = []
    trees: list[str] = []
    left_out: list[str] = []
    points = _mount_points()
    secret_files, secret_dirs = _credentials()
    budget = [_TREE_OVERLAYS]
    for entry in sorted(os.scandir("/"), key=lambda e: e.name):
        if entry.name in _SKIP_TOP:
            continue
        path = entry.path
        if entry.is_symlink():
            entries.append(("symlink", os.readlink(path), path))
            continue
        if not entry.is_dir(follow_symlinks=False):
            continue
        if not _mounts_below(path, points):
            entries.append(("overlay", path))
            continue
        tree = _Tree(secret_files, secret_dirs)
        _tree(path, path, points, tree, budget)
        if not tree.items:  # unreadable: an empty read-only directory
            tree.items.append(("dir", ".", 0o755, os.getuid(), os.getgid(), b""))
        entries.append(("tree", _tree_snapshot(tree.items), path))
        entries += tree.overlays
        trees.append(path)
        left_out += tree.left_out
    return tuple(entries), tuple(trees), tuple(left_out)


def mount_plan(bwrap: str) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
    """How the host's top-level directories appear in a box.

    Returns ``(entries, read_only)``, the entries in mount order; each is ``("overlay", path)``
    (copy-on-write over the host's), ``("symlink", target, path)`` or ``("tree", snapshot,
    path)``: a directory with other filesystems mounted below it, shown as a read-only snapshot
    with its sub-directories as overlay entries of their own after it (see :func:`_tree`: a box
    reaches no host socket or FIFO in it).  ``read_only`` lists those directories.  Worked out once
    per process (``bwrap`` is kept for the callers' sake: no probe is run any more).
    """
    entries, trees, _ = _plan()
    return entries, trees


def plan_note() -> str:
    """What ``doctor`` says of the host trees a box sees read-only (empty where there are none)."""
    _, trees, left_out = _plan()
    if not trees:
        return ""
    note = (
        f"; read-only (other mounts below them): {', '.join(trees)}: a snapshot of their own files"
        " and links, their sub-directories and mounts copy-on-write, no host socket or FIFO in them"
        " reachable"
    )
    if left_out:
        shown = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
        bounds = f"{_TREE_FILE_BYTES >> 20} MiB a file, {_TREE_BYTES >> 20} MiB and {_TREE_ENTRIES} entries in all"
        note += f"; left out of the snapshot (over its bounds: {bounds}): {shown}"
    return note


def _layer_args(
    bwrap: str,
    template: str | None = None,
    persist: Path | None = None,
    masks: Mapping[str, str] | None = None,
) -> list[str]:
    """bwrap arguments for the mount plan: each directory copy-on-write over the host.

    ``template`` adds a provisioned template's layers on top of the host's;
    ``persist`` keeps this box's writes in that directory (to build a template);
    ``masks`` maps a directory to its mask layer (see :func:`_mask_plan`), laid on top.
    """
    masks = masks or {}
    entries, _ = mount_plan(bwrap)
    args: list[str] = []
    for entry in entries:
        kind, path = entry[0], entry[-1]
        if kind == "symlink":
            args += ["--symlink", entry[1], path]
        elif kind == "tree":
            # Read-only: no upper layer, so nothing a box writes there reaches the next forked box.
            args += ["--overlay-src", entry[1], "--overlay-src", _empty_layer(), "--ro-overlay", path]
        else:
            args += _overlay(path, template, persist, masks)
    return args


def _overlay(path: str, template: str | None, persist: Path | None, masks: Mapping[str, str]) -> list[str]:
    """bwrap arguments for one copy-on-write directory: the host's ``path``, then the template's
    layer of it and its mask layer; its writes kept in ``persist`` (a template build) or thrown away."""
    layer = path.strip("/")
    args = ["--overlay-src", path, *regroup_args(path)]  # the user's files of a group the box cannot map
    owned = _writable_layer(path)
    if owned is not None:
        args += ["--overlay-src", owned]
    # lstat, not is_dir(): a link in the template is never followed on the host.
    if template is not None and stat.S_ISDIR(_lstat_mode(Path(template) / "upper" / layer)):
        args += ["--overlay-src", str(Path(template) / "upper" / layer)]
    if path in masks:
        args += ["--overlay-src", masks[path]]
    if persist is not None:
        upper, work = persist / "upper" / layer, persist / "work" / layer
        upper.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        args += ["--overlay", str(upper), str(work), path]
    else:
        args += ["--tmp-overlay", path]
    return args


_PRIVATE_TOPS = ("/tmp", "/run", "/dev", "/proc", "/sys")
#: At most this many entries of a copy-on-write directory are looked at for :func:`_writable_layer`.
_WRITABLE_SCAN = 4096


@lru_cache(maxsize=256)
def _writable_layer(top: str) -> str | None:
    """A layer giving the sub-directories of ``top`` that this (ordinary) user may write but does
    not own (``/var/tmp``, ``/var/crash``: sticky and world-writable, owned by root) an owner the
    box maps, or ``None`` (a root host maps every owner; none such).

    A box of an ordinary user maps only that user: a directory of someone else's shows as owned by
    ``nobody``, and overlayfs cannot copy it up to the box's upper layer (it would have to give the
    copy that owner), so the first file made in it failed with EOVERFLOW where locally it is made.
    With this layer on top of the host's, such a directory takes the layer's owner and mode (a
    merged directory shows its top layer's): root in the box, as it is on the host, with its mode;
    its entries stay the host's, and what a box writes there goes to the box's own upper layer.
    """
    if os.geteuid() == 0:
        return None
    me = os.getuid()
    found: list[tuple[str, str, int, int, int, bytes]] = []
    try:
        with os.scandir(top) as it:
            for n, entry in enumerate(it):
                if n >= _WRITABLE_SCAN:
                    break
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode) and st.st_uid != me and os.access(entry.path, os.W_OK | os.X_OK):
                        found.append(("dir", entry.name, stat.S_IMODE(st.st_mode), me, os.getgid(), b""))
    except OSError:
        return None
    if not found:
        return None
    return _tree_snapshot([("dir", ".", 0o755, me, os.getgid(), b""), *sorted(found)])


def _lstat_mode(path: Path) -> int:
    """``path``'s own mode (0 where it is absent): a link is not followed."""
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0


def _own_dirs() -> list[str]:
    """What every box needs at the host's paths: this package (the agent and the file helper run
    from it) and the interpreter that runs them, wherever they are installed, even under /tmp."""
    exe = os.path.realpath(sys.executable)
    return [
        str(Path(__file__).resolve().parents[2]),  # the pytest_boxlite package
        sys.prefix,
        sys.exec_prefix,
        sys.base_prefix,
        os.path.dirname(exe),
    ]


def _mirrored(mounts: Sequence[str]) -> list[str]:
    """The host directories that the box would otherwise hide (under /tmp, /run), to show copy-on-write."""
    return [m for m in mounts if any(m == t or m.startswith(t + "/") for t in _PRIVATE_TOPS)]


def _mirror_args(
    mounts: Sequence[str],
    masks: Mapping[str, str] | None = None,
    template: str | None = None,
    persist: Path | None = None,
) -> list[str]:
    """Make host directories that the box would otherwise hide (under /tmp, /run) visible copy-on-write.

    ``template`` and ``persist`` as for :func:`_layer_args`: a virtual environment under /tmp is
    where ``--boxlite-setup "pip install ..."`` writes, so a template keeps (and stacks) its layer too.
    """
    args: list[str] = []
    for m in _mirrored(mounts):
        args += _overlay(m, template, persist, masks or {})
    return args


def _homes() -> list[Path]:
    """Home directories whose credentials a box must not see: ours, root's, and every /home/* we can list."""
    homes = [Path.home(), Path("/root")]
    with contextlib.suppress(OSError):
        homes += [Path(e.path) for e in os.scandir("/home") if e.is_dir(follow_symlinks=False)]
    out: list[Path] = []
    for h in homes:
        if h not in out:
            out.append(h)
    return out


def _readable(path: Path, want_dir: bool) -> Path | None:
    """``path`` (links resolved) if it exists, is of the wanted kind and readable by us; never raises.

    Paths this user cannot reach (another user's home) are simply not masked: nothing in a box
    of this user can read them either.
    """
    try:
        os.lstat(path)  # most candidates do not exist: fail fast, before resolving links
        real = Path(os.path.realpath(path))
        st = os.stat(real)
    except (OSError, ValueError):
        return None
    import stat as _stat

    kind_ok = _stat.S_ISDIR(st.st_mode) if want_dir else _stat.S_ISREG(st.st_mode)
    if not kind_ok or not os.access(real, os.R_OK):
        return None
    return real


def _secrets(home: Path, tops: Sequence[str] = ()) -> tuple[list[Path], list[Path]]:
    """``(directories, files)`` to hide from guests: credentials in readable homes, and the boxlite home.

    Asked before every box (a forked one too: see ``NamespaceRuntime._fork_plan``), so the common
    case, a candidate that does not exist, costs one ``lstat`` of a string and nothing more.
    """
    dirs: list[Path] = []
    files: list[Path] = []
    for h in _homes():
        base = str(h).rstrip("/") + "/"
        for names, want_dir, found in ((_SECRET_DIRS, True, dirs), (_SECRET_FILES, False, files)):
            for name in names:
                try:
                    os.lstat(base + name)
                except (OSError, ValueError):
                    continue
                real = _readable(Path(base + name), want_dir=want_dir)
                if real is not None and real not in found:
                    found.append(real)
    # Other boxes' control sockets, logs and records live in boxlite homes: a guest must reach none
    # of them, this session's or any other on this machine (another project's, another user's).
    for path in _home_masks(home, tops):
        real = _readable(Path(path), want_dir=True)
        if real is not None and real not in dirs:
            dirs.append(real)
    return dirs, files


def _home_masks(home: Path, tops: Sequence[str] = ()) -> list[str]:
    """The directories that hide every boxlite home this user can see: each home as a whole, or
    (where a box must see something below it: the project, the interpreter, a user's home
    directory) its state entries one by one.

    This session's home is always hidden whole, as before; the rest come from the registry and
    the users' default homes (see :mod:`pytest_boxlite.runtimes._homes`), a few ``lstat`` calls
    for each user in the user database: asked per booted box (and per sandbox fork's plan).
    ``tops`` are the box's copy-on-write directories (see :func:`_mask_plan`), the ones it
    mirrors under /tmp and /run among them.
    """
    out = [str(home)]
    try:
        own = os.path.realpath(home)
    except (OSError, ValueError):
        own = str(home)
    visible = (*_must_stay_visible(os.getcwd(), tuple(sys.path)), *tops)
    # Under /tmp or /run a box sees only the directories mirrored there (the project, the venv):
    # a home elsewhere below those tops is out of its reach already.
    mirrored = [v for v in visible if _private(v)]

    def reachable(h: str) -> bool:
        return not _private(h) or any(h == v or h.startswith(v.rstrip("/") + "/") for v in mirrored)

    others = [h for h in boxlite_homes(reachable) if h != own]
    if not others:
        return out
    for h in others:
        prefix = h.rstrip("/") + "/"
        if h.count("/") <= 1 or any(v == h or v.startswith(prefix) for v in visible):
            out += [os.path.join(h, entry) for entry in STATE_ENTRIES]
        else:
            out.append(h)
    return out


def _private(path: str) -> bool:
    """Whether ``path`` lies in a top-level directory each box gets a private one of."""
    return any(path == t or path.startswith(t + "/") for t in _PRIVATE_TOPS)


@lru_cache(maxsize=8)
def _must_stay_visible(cwd: str, path: tuple[str, ...]) -> tuple[str, ...]:
    """Directories a box needs to see (links resolved): a boxlite home above one of them is
    hidden entry by entry, not whole.  The worker mounts are all among these: the project and
    invocation directory (at or above the working directory), ``sys.path`` and this package."""
    wanted = [cwd, *(p for p in path if p.startswith("/")), *_own_dirs()]
    with contextlib.suppress(OSError):
        wanted += [pw.pw_dir for pw in pwd.getpwall()]
    wanted.append(str(Path.home()))
    out: list[str] = []
    for w in wanted:
        with contextlib.suppress(OSError, ValueError):
            real = os.path.realpath(w)
            if real not in out:
                out.append(real)
    return tuple(out)


_OPAQUE = "user.overlay.opaque"


def _build_mask_layer(root: Path, entries: Sequence[tuple[str, str, str]]) -> set[str]:
    """Create mask layers under ``root``: per (top, relative path, kind) an opaque empty directory or an
    empty file.  Returns the tops whose layer could not be made (no user xattrs on this /tmp)."""
    failed: set[str] = set()
    tops = sorted({t for t, _, _ in entries})
    for n, top in enumerate(tops):
        layer = root / str(n)
        layer.mkdir(parents=True, exist_ok=True)
        for t, rel, kind in entries:
            if t != top:
                continue
            target = layer / rel
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            try:
                if kind == "dir":
                    target.mkdir(exist_ok=True, mode=0o700)
                    os.setxattr(target, _OPAQUE, b"y", follow_symlinks=False)
                else:
                    target.touch(mode=0o600)
            except OSError:
                failed.add(top)
    return failed


def _complete(root: Path) -> bool:
    """Whether ``root`` holds mask layers built for every top (its ``ready`` lists no failure)."""
    try:
        return bool(json.loads((root / "ready").read_text()) == [])
    except (OSError, ValueError):
        return False


_MASK_BUILD = threading.Lock()


@lru_cache(maxsize=64)
def _mask_plan_cached(entries: tuple[tuple[str, str, str], ...]) -> tuple[tuple[tuple[str, str], ...], frozenset[str]]:
    tops = sorted({t for t, _, _ in entries})
    key = hashlib.sha256(repr(entries).encode()).hexdigest()[:16]
    base = private_tmp() / "masks"
    root = base / key
    failed: set[str] = set()
    if not _complete(root):
        # Unique per build: two threads (a warm box's boot, a zygote's) may build the same key.
        tmp = base / f"{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        failed = _build_mask_layer(tmp, entries)
        (tmp / "ready").write_text(json.dumps(sorted(failed)))
        shared = False
        if not failed:
            if root.exists():
                # An earlier build that recorded a failure: set aside, not removed (live boxes may
                # still have its layers under them).
                with contextlib.suppress(OSError):
                    os.rename(root, base / f"{key}.{secrets.token_hex(4)}.stale")
            with contextlib.suppress(OSError):
                os.rename(tmp, root)
                shared = True
        if not shared:
            # Only complete builds are shared: a failure may pass, and a shared record of it would
            # cost every later session on this host its per-test forks (see fork_blocked_by_mounts).
            root = base / f"{key}.{secrets.token_hex(4)}.own"
            os.rename(tmp, root)
    layers = tuple((top, str(root / str(n))) for n, top in enumerate(tops) if top not in failed)
    return layers, frozenset(failed)


def _mask_plan(home: Path, tops: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """How to hide credentials and the boxlite home: ``(layers, mount arguments)``.

    A secret inside a copy-on-write directory is hidden by one more overlay layer on top of it:
    an opaque empty directory or an empty file at its path.  Unlike a mount laid over it, a
    layer leaves nothing to unmount, and the per-test fork can stack its fresh layer over the
    directory (overlayfs cannot use a lower directory that has locked mounts below it).
    Secrets elsewhere (a read-only bound directory) get a mount: an empty tmpfs or /dev/null.
    """
    dirs, files = _secrets(home, tops)
    entries: list[tuple[str, str, str]] = []
    mounts: list[str] = []
    by_top: dict[str, list[tuple[Path, str]]] = {}
    for path, kind in [(d, "dir") for d in dirs] + [(f, "file") for f in files]:
        p = str(path)
        top = max((t for t in tops if p.startswith(t.rstrip("/") + "/")), key=len, default=None)
        if top is None:
            if not any(p == t or p.startswith(t + "/") for t in _PRIVATE_TOPS):
                mounts += ["--tmpfs", p] if kind == "dir" else ["--ro-bind", "/dev/null", p]
            continue  # under the box's private /tmp or /run: not visible anyway
        entries.append((top, os.path.relpath(p, top), kind))
        by_top.setdefault(top, []).append((path, kind))
    if not entries:
        return {}, mounts
    key = tuple(sorted(entries))
    with _MASK_BUILD:  # one build per key at a time: boxes of several threads want the same layers
        layers, failed = _mask_plan_cached(key)
        if not all(os.path.isdir(layer) for _, layer in layers):  # /tmp was cleaned meanwhile: build again
            _mask_plan_cached.cache_clear()
            layers, failed = _mask_plan_cached(key)
        if failed:
            # Not kept: the next box tries again.  A mount in place of a layer costs boxed tests their
            # per-test fork (see guest/fresh.py's fork_blocked_by_mounts), so a passing failure must
            # not last the whole session.
            _mask_plan_cached.cache_clear()
    for top in failed:
        for path, kind in by_top.get(top, []):
            mounts += ["--tmpfs", str(path)] if kind == "dir" else ["--ro-bind", "/dev/null", str(path)]
    return dict(layers), mounts


def _kernel_has_xino() -> bool:
    """Whether this kernel's overlayfs knows ``xino`` (Linux 4.17 and later)."""
    try:
        major, minor = (int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
    except ValueError:
        return False
    return (major, minor) >= (4, 17)


def device_note() -> str:
    """What ``doctor`` says of the devices files report in a box (``os.path.ismount``, ``st_dev``)."""
    if not _kernel_has_xino():
        return (
            f"this kernel ({os.uname().release}) has no overlayfs xino: in every box a host file reports its"
            " layer's device, not its directory's (os.path.ismount() says True of it)"
        )
    return (
        "a boxed test's and a sandbox's (forked) box: a file reports its directory's device (overlays with"
        " xino=on); a booted one (--boxlite-fresh=boot, a warm box): bubblewrap's overlays"
        " take no xino, so a host file reports its layer's device and os.path.ismount() says True of it"
    )
