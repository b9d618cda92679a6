"""A fresh box's layers: new upper layers on its overlays, masks laid again, new tmpfs, /dev, /proc
and root directory (in the box's pid 1, after :func:`pytest_boxlite.guest.fresh.clone_box`).

Standard library only.  Imported by :mod:`pytest_boxlite.guest.forks` (a test's box), a zygote's
agent (a sandbox's box), and :mod:`pytest_boxlite.guest.worker` (whether the box's mounts let a fork
renew them at all).  :data:`LAYERS` is what guest/changes.py reads the test's writes from.
"""

from __future__ import annotations

import os

from pytest_boxlite.guest.caps import check_libc, limit_caps
from pytest_boxlite.guest.linux import (
    LIBC,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
)

# Types for mypy only: a zygote's agent imports this file, and typing would cost it milliseconds.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Collection
    from typing import Any

    #: ``(mount point, fstype, per-mount options, super options)``: a row of :func:`_mount_table`.
    MountRow = tuple[str, str, list[str], list[str]]

#: Parts of /proc a box must not write (host-wide sysctls...): read-only, as bubblewrap does.
_PROC_COVERS = ("sys", "sysrq-trigger", "irq", "bus", "fs")


def _mount(libc: Any, src: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    def enc(v: str | None) -> bytes | None:
        return v.encode() if v is not None else None

    check_libc(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), "mount %s" % target)


#: ``xino=on``: every file of an overlay reports the overlay's device, as its directory does (with
#: its layers on two file systems and xino off, a file reports its layer's, and os.path.ismount()
#: says True of it).  Emptied where the kernel does not know the option (before 4.17).
_XINO = [",xino=on"]


#: ``[True]`` when a fresh box must keep a handle on its upper layers (guest/changes.py reads what
#: the test wrote there); each is then in :data:`LAYERS` as ``(shown at, lower, fd)``.  The stage
#: that holds them is out of the box's sight (left in the old root, which the box detached; a VM's
#: box: under its new /run); the box's test holds only these descriptors.
KEEP_LAYERS = [False]
LAYERS: list[tuple[str, str, int]] = []


def _overlay(
    libc: Any, lower: str, target: str, stage: str, n: int | str, shown: str | None = None, named: str | None = None
) -> None:
    """A new overlay on ``target`` over ``lower``, with an empty upper layer in ``stage``.

    In :data:`LAYERS` (when kept) it is ``(shown, named, fd)``: where the box sees it (``target``
    unless the box's root moves) and what guest/changes.py takes its lower for (``lower`` unless
    told: a directory of the warm box's /tmp goes by its staging name, ``<stage>/tmpN``)."""
    upper, work = "%s/u%s" % (stage, n), "%s/w%s" % (stage, n)
    os.mkdir(upper)
    os.mkdir(work)
    opts = "lowerdir=%s,upperdir=%s,workdir=%s,userxattr" % (lower, upper, work)
    try:
        _mount(libc, "overlay", target, "overlay", 0, opts + _XINO[0])
    except OSError as exc:
        if not _XINO[0] or exc.errno != 22:
            raise
        _mount(libc, "overlay", target, "overlay", 0, opts)  # raises if xino was not the reason
        _XINO[0] = ""
    if KEEP_LAYERS[0]:
        fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        LAYERS.append((shown or target, named or lower, fd))


def _renewed_overlays(table: list[MountRow]) -> list[str]:
    """The writable overlays of ``table`` (:func:`_mount_table`): each gets a new upper layer in a
    fresh box.  A read-only one (a host directory holding other mounts, shown as a snapshot with
    its sub-directories as overlays of their own: see the runtime's mounts.py) is kept whole: no
    box can write to it, and overlayfs refuses a lower directory with locked mounts beneath it."""
    return [m for m, fs, _, sopts in table if fs == "overlay" and "ro" not in sopts]


def _under(path: str, top: str) -> bool:
    return path.startswith(top.rstrip("/") + "/")


#: What a fresh box gets anew (tmpfs, its own /proc...), never renewed as a layer.
_PRIVATE = ("/tmp", "/run", "/proc", "/dev", "/sys")


def _masks_over(mounts: list[tuple[str, str]], overlays: Collection[str]) -> list[tuple[str, str]]:
    """The mounts other than the renewed ``overlays`` laid over part of one of them (outside
    :data:`_PRIVATE`): the masks a fresh box must lay again on its new layers (a read-only overlay,
    a host directory shown in an image's, is one too)."""
    renewed = set(overlays)
    return [
        (m, fs)
        for m, fs in mounts
        if m not in renewed
        and any(_under(m, o) for o in overlays)
        and not any(m == p or _under(m, p) for p in _PRIVATE)
    ]


#: At most this much of the files in the warm box's /tmp is copied into each fresh box, and at
#: most so many of its directories are shown (each is one more mount per box).
_TMP_FILES_BYTES = 4 << 20
_TMP_DIRS = 64


def _tmp_view(mounts: list[tuple[str, str]]) -> tuple[list[str], list[str], list[tuple[str, int, bytes]]]:
    """What of the warm box's /tmp a fresh box sees (see :func:`fresh_box`): ``(paths, dirs,
    files)``: the directories on the way to mounts beneath /tmp (made anew), the directories with no
    mount on or beneath them (shown copy-on-write) and the regular files beside them, as ``(path,
    mode, content)`` (copied, up to :data:`_TMP_FILES_BYTES` in all)."""
    import stat

    paths: list[str] = []
    dirs: list[str] = []
    files: list[tuple[str, int, bytes]] = []
    total = 0
    todo = ["/tmp"]
    while todo:
        here = todo.pop(0)
        try:
            names = sorted(os.listdir(here))
        except OSError:
            continue
        for name in names:
            p = here + "/" + name
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if any(m == p for m, _ in mounts):
                continue  # a mount point: laid again on its own (the hidden overlays)
            if stat.S_ISDIR(st.st_mode):
                if any(_under(m, p) for m, _ in mounts):
                    paths.append(p)
                    todo.append(p)
                elif len(dirs) < _TMP_DIRS:
                    dirs.append(p)
            elif stat.S_ISREG(st.st_mode) and total + st.st_size <= _TMP_FILES_BYTES:
                # Non-blocking, and checked again once open: a FIFO put in its place must not hang the box.
                try:
                    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                except OSError:
                    continue  # not this box's to read (it would not be in the new /tmp either)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        continue
                    data = os.read(fd, st.st_size)
                finally:
                    os.close(fd)
                total += len(data)
                files.append((p, stat.S_IMODE(st.st_mode), data))
    return paths, dirs, files


#: At most this many entries of the warm box's /dev are laid again in a box's own, and a file
#: there is copied only up to this size (bubblewrap's /dev holds a dozen entries, no file).
_DEV_ENTRIES = 256
_DEV_FILE_BYTES = 1 << 16


def _fresh_dev(libc: Any, table: list[MountRow], into: str) -> None:
    """A /dev of the box's own: a new tmpfs holding what the warm box's /dev holds (its device
    nodes, /dev/pts and other mounts bound again; links and small files copied; directories
    made anew, empty).  The warm box's /dev is one tmpfs (bubblewrap's) that every box forked
    from it shared: a file one test wrote there (``/dev/x``), the next test saw.  A VM's /dev is
    the kernel's devtmpfs, not renewed here (``renew_all``)."""
    import stat

    mounted = {m for m, _, _, _ in table if m.startswith("/dev/") and m.count("/") == 2}
    # The new tmpfs is made where the box will see it (``into``: the /dev of its new root), while
    # the warm box's entries are still in sight: each mount is bound once, straight from there.
    # No MS_NODEV: the device nodes bound in must still open.
    _mount(libc, "tmpfs", into, "tmpfs", MS_NOSUID, "mode=%o" % stat.S_IMODE(os.stat("/dev").st_mode))
    for name in sorted(os.listdir("/dev"))[:_DEV_ENTRIES]:
        path, target = "/dev/" + name, into + "/" + name
        st = os.lstat(path)
        if path in mounted:
            if path == "/dev/shm":
                os.mkdir(target)  # a new tmpfs goes on it (fresh_box): nothing to bind
                continue
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(target)
            else:
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            _mount(libc, path, target, None, MS_BIND | MS_REC, None)
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(path), target)
        elif stat.S_ISDIR(st.st_mode):
            os.mkdir(target, stat.S_IMODE(st.st_mode))
        elif stat.S_ISREG(st.st_mode) and st.st_size <= _DEV_FILE_BYTES:
            src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                data = os.read(src, _DEV_FILE_BYTES)
            finally:
                os.close(src)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, stat.S_IMODE(st.st_mode))
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        # Nothing else is kept: a device node there is a bound mount (above), never made here.


def fresh_box(
    hostname: str,
    network: bool,
    renew_all: bool = False,
    own_root: bool = False,
    before_pivot: Callable[[str], object] | None = None,
) -> None:
    """In pid 1 of a box made by :func:`clone_box`: pristine writable layers, /proc, hostname.

    Every overlay gets a new, empty upper layer.  The masks the box had on top of its overlays
    (credential directories, the boxes' state) are laid again on top of the new layers, and
    /tmp, /workspace, /dev/shm and /run are new tmpfs.  Anyone but root ends with no capability
    (root's test process moves one user namespace down instead: :func:`enter_test_namespaces`).

    ``renew_all`` (a VM: its root is a disk, its volumes virtio-fs, no overlays): every other
    writable directory is renewed too (:func:`_renew_plain`) and the root itself made read-only.
    ``own_root`` (a test's box, not with ``renew_all``): every fresh mount is made in a root
    directory of the box's own, which it then moves to, keeping its working directory (see
    :func:`_fresh_box_in_new_root`); ``before_pivot(new_root)`` runs just before the move.
    Without it (a VM's box) the box keeps the root directory it has.
    """
    libc = LIBC
    uid, gid = os.geteuid(), os.getegid()
    # The table this box was cloned with: the same rows as its own (the stage mounted below is
    # under /run, which nothing here renews or shows).
    warm = _take_warm_mounts()
    table, propagates = warm if warm is not None else (_mount_table(), True)
    if propagates:
        # Nothing the box mounts may reach the warm box, nor the host's mounts the box.
        _mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None)
    stage = "/run/.boxlite-fresh"
    os.makedirs(stage, exist_ok=True)
    _mount(libc, "tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700")
    if own_root and not renew_all:
        _fresh_box_in_new_root(libc, table, stage, hostname, before_pivot)
        _drop_privileges(libc, uid, gid, network)
        return
    mounts = [(m, fs) for m, fs, _, _ in table]
    overlays = sorted(set(_renewed_overlays(table)), key=lambda p: (p.count("/"), p))
    hidden = [m for m in overlays if _under(m, "/tmp")]
    masks = _masks_over(mounts, overlays)
    # Overlays under /tmp and bind masks vanish under what is mounted next: keep a handle on them.
    for i, m in enumerate(hidden):
        os.mkdir("%s/keep%d" % (stage, i))
        _mount(libc, m, "%s/keep%d" % (stage, i), None, MS_BIND | MS_REC, None)
    for i, (m, fs) in enumerate(masks):
        if fs != "tmpfs":
            held = "%s/mask%d" % (stage, i)
            if os.path.isdir(m):
                os.mkdir(held)
            else:
                open(held, "w").close()
            _mount(libc, m, held, None, MS_BIND, None)
    if renew_all:
        # Root here is root of the VM's kernel (clone_box's real_root): it can pivot into an overlay of /.
        plain_root = _renew_plain(libc, stage, _PRIVATE + ("/workspace",), pivot=uid == 0)
    for i, m in enumerate(overlays):
        if m not in hidden:
            _overlay(libc, m, m, stage, i)
    for i, (m, fs) in enumerate(masks):
        if fs == "tmpfs":
            _mount(libc, "tmpfs", m, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
        else:
            _mount(libc, "%s/mask%d" % (stage, i), m, None, MS_BIND, None)
    # What the warm interpreter made in /tmp (the fixtures it set up for every box: under
    # /tmp/pytest-of-<user>, tmp_path_factory's) is seen in the new /tmp, copy-on-write: each
    # directory with no mount beneath as a layer (a locked mount cannot be left out of a layer's
    # lower), the way to the mounts made anew.
    paths, dirs, files = _tmp_view(mounts)
    shown: list[str] = []
    for d in dirs:
        held = "%s/tmp%d" % (stage, len(shown))
        os.mkdir(held)
        try:
            _mount(libc, d, held, None, MS_BIND, None)
        except OSError:
            os.rmdir(held)  # one the box may not bind: it is not shown (as before, when none was)
            continue
        shown.append(d)
    for d in ("/tmp", "/workspace", "/dev/shm"):
        if os.path.isdir(d):
            _mount(libc, "tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777" if d != "/workspace" else "mode=0755")
    for d in paths:
        os.makedirs(d, exist_ok=True)
    for i, d in enumerate(shown):
        os.mkdir(d)
        _overlay(libc, "%s/tmp%d" % (stage, i), d, stage, "t%d" % i)
    _write_copies(files)
    for i, m in enumerate(hidden):
        os.makedirs(m, exist_ok=True)
        _overlay(libc, "%s/keep%d" % (stage, i), m, stage, len(overlays) + i)
    # Last, a new /run: it hides the staging area and the template's control directory.
    _mount(libc, "tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    if renew_all and plain_root is not None:
        # What the box would write directly in / would reach the next box (the directories in it
        # are renewed, / itself cannot be): / is read-only, with the flags it had (locked ones
        # cannot be dropped in this user namespace).
        _mount(libc, None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | plain_root, None)
    _fresh_proc(libc, "/proc")
    _name_and_yield(hostname)
    _drop_privileges(libc, uid, gid, network)


def _fresh_proc(libc: Any, at: str) -> None:
    """A procfs of the box's pid namespace on ``at``, the parts that act host-wide read-only."""
    _mount(libc, "proc", at, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    for name in _PROC_COVERS:
        cover = at + "/" + name
        if os.path.exists(cover):
            _mount(libc, cover, cover, None, MS_BIND | MS_REC, None)
            ro = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
            _mount(libc, None, cover, None, ro, None)


def _name_and_yield(hostname: str) -> None:
    """The box's host name; under memory pressure its processes die first, not the warm interpreter."""
    import socket

    socket.sethostname(hostname)
    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, b"1000")
    finally:
        os.close(fd)


def _write_copies(files: list[tuple[str, int, bytes]], root: str = "") -> None:
    """The files of :func:`_tmp_view` beside its directories: copies (a layer is a directory's)."""
    for path, mode, data in files:
        fd = os.open(root + path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def _drop_privileges(libc: Any, uid: int, gid: int, network: bool) -> None:
    """The end of :func:`fresh_box`: anyone but root keeps no capability, as locally."""
    if uid != 0:
        if not network:
            loopback_up()
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        limit_caps(libc, ())


def _fresh_box_in_new_root(
    libc: Any, table: list[MountRow], stage: str, hostname: str, before_pivot: Callable[[str], object] | None
) -> None:
    """:func:`fresh_box` of a test's box (its own root, no VM): every fresh mount is made straight
    in a new root directory, which the box then moves to.

    The warm box's root directory (bubblewrap's tmpfs) is shared with every box forked from it: a
    top-level entry one test made would reach the next, so the box needs a root of its own.  Made
    first, it takes each fresh layer where the box will see it, while the warm box's mounts stay
    in sight at their own paths as lower layers and sources: nothing is held aside first and
    bound back (a mask, a directory of /tmp, an overlay under /tmp), no renewed mount is copied
    into the new root, and the old root, detached at the end, holds none of the box's layers.
    ``table``: the warm box's mounts (:func:`_mount_table`).
    """
    import stat

    mounts = [(m, fs) for m, fs, _, _ in table]
    tops = _top_level(mounts)
    overlays = sorted(set(_renewed_overlays(table)), key=lambda p: (p.count("/"), p))
    hidden = [m for m in overlays if _under(m, "/tmp")]
    masks = _masks_over(mounts, overlays)
    root = stage + "/root"
    os.mkdir(root)
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    # Mounts of the warm box made anew (its /run holds this stage and its control directory; its
    # /dev, /tmp, /workspace and /proc are shared with every box); where one of these is a plain
    # directory there (bubblewrap's /workspace), it is one here too, empty, as any other.
    made = {"/dev": "dev", "/proc": "proc", "/run": "0755", "/tmp": "1777", "/workspace": "0755"}
    for name in sorted(os.listdir("/")):
        path, target = "/" + name, root + "/" + name
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(path), target)
        elif not stat.S_ISDIR(st.st_mode):
            if path not in tops:
                raise OSError(22, "unexpected entry %s in the warm box's root" % path)
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
            _mount(libc, path, target, None, MS_BIND | MS_REC, None)
        elif path in made and path in tops:
            os.mkdir(target, 0o755)
            kind = made[path]
            if kind == "dev":
                _fresh_dev(libc, table, target)
                _mount(libc, "tmpfs", target + "/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
            elif kind == "proc":
                _fresh_proc(libc, target)
            else:
                _mount(libc, "tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, "mode=" + kind)
        elif path in overlays:
            os.mkdir(target, 0o755)  # the overlay laid on it below shows its lower's mode
        elif path in tops:
            os.mkdir(target, 0o755)
            _mount(libc, path, target, None, MS_BIND | MS_REC, None)  # /sys, a read-only tree
        else:
            if os.listdir(path):
                raise OSError(39, "the warm box's root holds files in %s: cannot make it anew" % path)
            os.mkdir(target, stat.S_IMODE(st.st_mode))
    for i, m in enumerate(overlays):
        if m not in hidden:  # deeper ones after the ones they lie in: the order is by depth
            _overlay(libc, m, root + m, stage, i, shown=m)
    for m, fs in masks:
        if fs == "tmpfs":
            _mount(libc, "tmpfs", root + m, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
        else:
            _mount(libc, m, root + m, None, MS_BIND, None)
    # What the warm interpreter made in /tmp (its fixtures' files under /tmp/pytest-of-<user>) is
    # seen in the new /tmp, copy-on-write: each directory with no mount beneath as a layer (a
    # locked mount cannot be left out of a layer's lower), the way to the mounts made anew, and
    # the files beside them copied.
    paths, dirs, files = _tmp_view(mounts)
    for d in paths:
        os.makedirs(root + d, exist_ok=True)
    for i, d in enumerate(dirs):
        os.mkdir(root + d)
        try:
            _overlay(libc, d, root + d, stage, "t%d" % i, shown=d, named="%s/tmp%d" % (stage, i))
        except OSError:
            os.rmdir(root + d)  # one the box may not take as a layer: it is not shown
    _write_copies(files, root)
    for i, m in enumerate(hidden):  # a host directory under /tmp (a project there)
        os.makedirs(root + m, exist_ok=True)
        _overlay(libc, m, root + m, stage, len(overlays) + i, shown=m)
    _name_and_yield(hostname)
    # Into the new root, the working directory kept (the same path there: reports name files
    # relative to it); the old root stacked under it by pivot_root(".", ".") and detached.
    if before_pivot is not None:
        before_pivot(root)
    here = os.getcwd()
    os.chdir(root)
    check_libc(libc.syscall(_pivot_root_number(), b".", b"."), "pivot_root")
    check_libc(libc.umount2(b".", _MNT_DETACH), "detaching the old root")
    os.chdir("/")
    os.chdir(here)


#: File systems that hold no one's files (the kernel's views): never renewed.
_VIRTUAL = frozenset(
    (
        "proc", "sysfs", "devtmpfs", "devpts", "mqueue", "cgroup", "cgroup2", "securityfs", "debugfs",
        "tracefs", "bpf", "pstore", "hugetlbfs", "fusectl", "configfs", "binfmt_misc", "efivarfs",
        "autofs", "nsfs",
    )
)  # fmt: skip
#: Per-mount options as mount(2) flags, to remount with the flags a mount already has.
_FLAG_OF = {
    "ro": MS_RDONLY,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
    "strictatime": 1 << 24,
}


def _mount_table() -> list[MountRow]:
    """``(mount point, fstype, per-mount options, super options)`` of every mount this process sees, in
    mount order."""
    with open("/proc/self/mountinfo") as fh:
        return _parse_mountinfo(fh.read())[0]


def _parse_mountinfo(text: str) -> tuple[list[MountRow], bool]:
    """The rows of :func:`_mount_table` from ``text`` (a mountinfo file), and whether any of them
    takes part in propagation (a shared or a slave mount)."""
    out: list[MountRow] = []
    propagates = False
    for line in text.splitlines():
        f = line.split()
        point = f[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
        dash = f.index("-")
        # Optional fields (between the options and the dash): "shared:N", "master:N"...
        propagates = propagates or any(o.startswith(("shared:", "master:")) for o in f[6:dash])
        out.append((point, f[dash + 1], f[5].split(","), f[dash + 3].split(",") if len(f) > dash + 3 else []))
    return out, propagates


# --- the warm interpreter's mount table, read once --------------------------------------------
# Every box forked from the warm interpreter starts with a copy of its mount table, and reading
# and parsing /proc/self/mountinfo in each box cost it about 1 ms of CPU.  So the warm interpreter
# reads it before its first box and again only when its mount namespace changed (a fixture of
# the warm interpreter's that mounted): poll(2) on an open mountinfo file reports POLLPRI once
# after each change of its namespace (mounts_poll; what libmount and systemd watch).  The box
# takes the table the parent held at its clone and closes its copy of the descriptor at once.

#: ``[table, propagates, descriptor]``: the warm interpreter's table (:func:`_parse_mountinfo`) and
#: its open mountinfo file (-1: none yet).
_WARM_MOUNTS: list[Any] = [None, True, -1]


def remember_warm_mounts() -> None:
    """In the warm interpreter (or a zygote), just before it clones a box: make sure the table a box
    will take (:func:`_take_warm_mounts`) is this namespace's current one."""
    import select

    fd = _WARM_MOUNTS[2]
    if fd >= 0:
        watch = select.poll()
        watch.register(fd, select.POLLPRI)
        if not watch.poll(0):
            return  # no mount or unmount in this namespace since the table was read
        os.close(fd)
        _WARM_MOUNTS[2] = -1
    fd = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        table, propagates = _parse_mountinfo(b"".join(chunks).decode("utf-8", "surrogateescape"))
    except BaseException:
        os.close(fd)
        raise
    _WARM_MOUNTS[:] = [table, propagates, fd]


def _take_warm_mounts() -> tuple[list[MountRow], bool] | None:
    """In a box just cloned: the table its parent held at the clone (``None``: none was read), and
    whether any mount in it propagates.  The parent's descriptor is closed here: a test holds
    nothing of the warm interpreter's."""
    table, propagates, fd = _WARM_MOUNTS
    _WARM_MOUNTS[:] = [None, True, -1]
    if fd >= 0:
        os.close(fd)
    return None if table is None else (table, propagates)


#: pivot_root(2)'s number (glibc has no wrapper), where this file knows it.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203}
_MNT_DETACH = 2


def _pivot_root_number() -> int:
    number = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(38, "pivot_root: unknown system call number on %s" % os.uname().machine)
    return number


def _renew_plain(libc: Any, stage: str, private: tuple[str, ...], pivot: bool = False) -> int | None:
    """Renew what is writable in the box but no overlay (a VM's disk, its writable volumes).

    Each writable mount that is no overlay, no mask on one and not in ``private`` (renewed as new
    tmpfs anyway) gets an overlay of itself with an empty upper layer in ``stage``; a file mount
    gets a copy.  Mounts beneath one are held and laid back on top of its overlay (an overlay
    shows only its lower directory).  When / itself is such a mount: with ``pivot`` (root of the
    VM's kernel, whose mounts are not locked), the box moves into an overlay of / (see
    :func:`_pivot_into_overlay`) and ``None`` is returned; without, each directory directly in /
    gets an overlay and the flags of / are returned, for the caller to make / read-only (a file
    created directly in / would outlive the box).
    """
    table = _mount_table()
    top: dict[str, tuple[str, list[str]]] = {}
    for m, fs, opts, _ in table:
        top[m] = (fs, opts)  # the last mount on a point is the one seen
    overlays = [m for m, (fs, _) in top.items() if fs == "overlay"]

    def skipped(m: str) -> bool:
        return any(m == p or _under(m, p) for p in private) or any(_under(m, o) for o in overlays)

    targets = [
        m
        for m, (fs, opts) in top.items()
        if m != "/" and fs != "overlay" and fs not in _VIRTUAL and "rw" in opts and not skipped(m)
    ]
    root_flags: int | None = None
    fs, opts = top.get("/", ("", []))
    root_plain = fs != "overlay" and "rw" in opts
    pivot = pivot and root_plain and os.uname().machine in _SYS_PIVOT_ROOT
    if root_plain and not pivot:
        root_flags = 0
        for opt in opts:
            root_flags |= _FLAG_OF.get(opt, 0)
        for name in os.listdir("/"):
            m = "/" + name
            if m not in top and not skipped(m) and os.path.isdir(m) and not os.path.islink(m):
                targets.append(m)
    work = stage + "/plain"
    os.mkdir(work)
    n = 0
    for target in sorted(targets, key=lambda p: (p.count("/"), p)):
        beneath = [m for m in top if _under(m, target)]
        held = [m for m in beneath if not any(_under(m, o) for o in beneath)]
        for m in held:
            n += 1
            keep = "%s/hold%d" % (work, n)
            if os.path.isdir(m):
                os.mkdir(keep)
            else:
                open(keep, "w").close()
            _mount(libc, m, keep, None, MS_BIND | MS_REC, None)
        n += 1
        if os.path.isdir(target):
            _overlay(libc, target, target, work, n)
        elif os.path.isfile(target):
            copy = "%s/file%d" % (work, n)
            with open(target, "rb") as src, open(copy, "wb") as dst:
                dst.write(src.read())
            _mount(libc, copy, target, None, MS_BIND, None)
        else:
            continue  # a socket, a device: nothing a test writes into
        for i, m in enumerate(held):
            _mount(libc, "%s/hold%d" % (work, n - len(held) + i), m, None, MS_BIND | MS_REC, None)
    if pivot:
        _pivot_into_overlay(libc, work, list(top), n + 1)
    return root_flags


def _pivot_into_overlay(libc: Any, work: str, points: list[str], n: int) -> None:
    """Make an overlay of / (empty upper layer) the box's root, every mount laid in it in place.

    An overlay of / shows only the root file system, so each mount tree on it (``points``: every
    mount point of the box, renewed ones included) is bound whole into the same place in the new
    root; then pivot_root(".", ".") stacks the old root on the new one and detaching it leaves the
    new one alone.  The working directory is taken along (the same path, in the new root).
    """
    import ctypes

    new = "%s/root" % work
    os.mkdir(new)
    _overlay(libc, "/", new, work, n)
    firsts = [m for m in points if m != "/" and not any(_under(m, o) for o in points if o != "/")]
    # The tree that holds the new root itself goes first, while the new root has no mounts yet:
    # its copy then carries one bare copy of it, not of every tree bound after.
    for m in sorted(firsts, key=lambda p: (not _under(new, p), p)):
        _mount(libc, m, new + m, None, MS_BIND | MS_REC, None)
    cwd = os.getcwd()
    os.chdir(new)
    number = ctypes.c_long(_SYS_PIVOT_ROOT[os.uname().machine])
    check_libc(0 if libc.syscall(number, b".", b".") == 0 else -1, "pivot_root")
    check_libc(libc.umount2(b".", _MNT_DETACH), "detaching the old root")
    os.chdir("/")
    os.chdir(cwd)


def fork_blocked_by_mounts() -> str | None:
    """Why fresh boxes forked from this (namespace) box could not renew its copy-on-write
    directories, or ``None``.

    A fork makes a new user namespace, in which every mount of this box is locked, and overlayfs
    refuses a lower directory with locked mounts beneath it.  Credentials are masked by overlay
    layers for that reason; a credential masked by a mount instead (the layer could not be made:
    no user xattrs where the layers live) sits over part of an overlay directory, and every fresh
    overlay over that directory would fail.  Such a box is booted per test instead.
    """
    table = _mount_table()
    mounts = [(m, fs) for m, fs, _, _ in table]
    overlays = _renewed_overlays(table)
    masks = _masks_over(mounts, overlays)
    if not masks:
        return None
    m = masks[0][0]
    o = next(o for o in overlays if _under(m, o))
    return "%s is mounted over part of %s (a credential masked by a mount, or a host directory in an image's)" % (m, o)


def loopback_up() -> None:
    import fcntl
    import socket
    import struct

    try:
        with socket.socket() as s:  # bring loopback up, as a new machine has it
            fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH14s", b"lo", 0x1 | 0x40, b""))
    except OSError:
        pass


def _top_level(mounts: list[tuple[str, str]]) -> set[str]:
    """The top-level mount points (``/usr``, ``/tmp``...) of ``mounts`` (:func:`_mounts`)."""
    return {m for m, _ in mounts if m != "/" and m.count("/") == 1}
