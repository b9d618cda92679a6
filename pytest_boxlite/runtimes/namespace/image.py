"""Namespace boxes on an image's root filesystem (``BoxSpec.root``, set by the session).

A box of an image sees the image's unpacked tree (from the image store, see
:mod:`pytest_boxlite.images`) copy-on-write: one overlay per top-level directory of the tree, the
tree as the lower layer and an empty upper layer per box (in memory), as the host's directories
are laid for a box without an image.  The runtime's own ``/proc``, ``/dev``, ``/sys``, ``/tmp``,
``/run``, ``/workspace`` and control directory come on top, then the host directories the spec
mounts at their own paths (the project; for boxed tests the interpreter's prefix, ``sys.path`` and
the project), then the credential masks of those directories.  Nothing else of the host is
visible.

**The agent** (:mod:`pytest_boxlite.guest.agent`) is the host's Python, which an image's C
library may not be able to run (busybox, musl, an old glibc).  So it runs on the host's own loader
and libraries, bound read-only under :data:`HOST_KIT` (a directory of its own at the box's top
level): ``<kit>/.lib/<loader> --library-path <kit>/.lib <kit>/<python> -I -S <kit>/<agent>``.
The loader's search path is the agent's alone (no ``LD_LIBRARY_PATH``): every command the agent
starts execs the image's own binaries with the image's loader and libraries, so ``cat``, ``sh``
and ``python3`` in a box are the image's.  The file operations (``read_file``, ``upload``...) run
in forks of the agent, so they need nothing of the image either.

**Boxed tests** in an image run the host's interpreter at its own path *with the image's C
library*: a test is meant to see the image's userland (its libc, its ``/etc``, its tools), and a
test whose interpreter ran on the host's libraries would not.  So the image must be able to run
that interpreter (its loader and the libraries it links, a glibc at least as new as the host's):
:func:`interpreter_problem` checks the loader and the libraries before any box boots and says what
is missing; a glibc too old shows as the worker's own start-up error, quoted in the failure.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import secrets
import shutil
import stat
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path

from pytest_boxlite import guest
from pytest_boxlite.errors import BoxStartError
from pytest_boxlite.runtimes.namespace.layout import WORKDIR
from pytest_boxlite.spec import ImageRoot

#: Where the agent's interpreter, loader and libraries are bound in a box of an image.
HOST_KIT = "/.boxlite-host"
#: Top-level entries of an image's tree the box never shows (the runtime mounts its own).
_RUNTIME_TOPS = frozenset({"proc", "dev", "sys", "tmp", "run"})
#: Directories a box of an image never gets from the host whole (they are the image's userland):
#: an interpreter installed there has its executable bound alone, its ``sys.path`` entries are
#: bound one by one.
_SYSTEM_DIRS = frozenset(
    {"/", "/usr", "/usr/local", "/usr/bin", "/usr/sbin", "/usr/lib", "/usr/lib64", "/usr/local/bin", "/opt"}
)
#: Where an image's libraries are looked for (the default search path of glibc and musl).
_LIB_DIRS = (
    "lib", "lib64", "usr/lib", "usr/lib64", "usr/local/lib",
    "lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu", "usr/lib/aarch64-linux-gnu",
)  # fmt: skip
_LDD_TIMEOUT = 30.0
#: Where a box finds ``env`` (its PATH without an image's own).
_ENV_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def _ldd(paths: Sequence[str]) -> tuple[str | None, dict[str, str]]:
    """``(loader, {soname: host path})`` of ``paths`` (ELF files), from the host's ``ldd``."""
    try:
        out = subprocess.run(
            ["ldd", *paths], capture_output=True, text=True, timeout=_LDD_TIMEOUT, env={"LC_ALL": "C"}
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BoxStartError(f"cannot list the host interpreter's libraries with ldd: {exc}") from None
    loader: str | None = None
    libs: dict[str, str] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>" and parts[2].startswith("/"):
            libs.setdefault(parts[0], parts[2])
        elif len(parts) == 2 and parts[0].startswith("/") and parts[1].startswith("(0x"):
            loader = loader or parts[0]
    return loader, libs


def _dynload_dir() -> str | None:
    """Where the interpreter's C extension modules live (``lib-dynload``)."""
    import importlib.util

    for name in ("_socket", "_ctypes", "select"):
        found = importlib.util.find_spec(name)
        origin = str(getattr(found, "origin", None) or "")
        if origin.endswith(".so"):
            return os.path.dirname(origin)
    return None


@lru_cache(maxsize=1)
def _host_interpreter() -> tuple[str, str, dict[str, str], tuple[str, ...]]:
    """``(python, loader, libraries, stdlib dirs)`` of this interpreter, links resolved."""
    exe = os.path.realpath(sys.executable)
    dynload = _dynload_dir()
    elves = [exe]
    if dynload is not None:
        with contextlib.suppress(OSError):
            elves += sorted(e.path for e in os.scandir(dynload) if e.name.endswith(".so"))
    loader, libs = _ldd(elves)
    if loader is None:
        raise BoxStartError(f"{exe} names no dynamic loader (ldd): the namespace runtime needs a dynamic interpreter")
    paths = sysconfig.get_paths()
    std = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib") if paths.get(k)}
    if dynload is not None:
        std.add(os.path.realpath(dynload))
    stdlib = tuple(d for d in sorted(std) if not any(d.startswith(o + "/") for o in std if o != d))
    return exe, loader, {k: os.path.realpath(v) for k, v in libs.items()}, stdlib


_KIT_LOCK = threading.Lock()


def _lib_dir() -> str:
    """A directory holding copies of the agent's loader and libraries (one mount per box, not one
    per library: a box costs what one without an image does).  Made once per set of libraries in
    this user's private /tmp directory (see :func:`~.mounts.private_tmp`), complete before it is
    renamed into place."""
    from pytest_boxlite.runtimes.namespace.layout import private_tmp

    _, loader, libs, _ = _host_interpreter()
    files = {os.path.basename(loader): os.path.realpath(loader), **libs}
    stamp = []
    for name, path in sorted(files.items()):
        st = os.stat(path)
        stamp.append((name, path, st.st_size, st.st_mtime_ns))
    key = hashlib.sha256(repr(stamp).encode()).hexdigest()[:16]
    base = private_tmp() / "kit"
    done = base / key
    with _KIT_LOCK:
        if (done / ".complete").is_file():
            return str(done)
        base.mkdir(exist_ok=True, mode=0o700)
        tmp = base / f"{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        tmp.mkdir(mode=0o755)
        try:
            for name, path in files.items():
                shutil.copy2(path, tmp / name)
            (tmp / ".complete").write_text("")
            try:
                os.rename(tmp, done)
            except OSError:  # another process made it first (or a stale one is in the way)
                if not (done / ".complete").is_file():
                    shutil.rmtree(done, ignore_errors=True)
                    os.rename(tmp, done)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(done)


def kit_args() -> list[str]:
    """bwrap arguments binding the agent's interpreter, loader, libraries and guest code under
    :data:`HOST_KIT`, read-only (a tmpfs of its own: a top-level mount a forked box keeps)."""
    exe, _, _, stdlib = _host_interpreter()
    args = ["--tmpfs", HOST_KIT, "--ro-bind", _lib_dir(), f"{HOST_KIT}/.lib"]
    args += ["--ro-bind", exe, HOST_KIT + exe]
    for d in stdlib:
        args += ["--ro-bind", d, HOST_KIT + d]
    paths = sysconfig.get_paths()
    hidden: list[str] = []
    for key in ("purelib", "platlib"):
        site = os.path.realpath(paths.get(key) or "/")
        if any(site.startswith(d + "/") for d in stdlib) and os.path.isdir(site) and site not in hidden:
            # The agent runs with -S: the host's installed packages are none of the box's business.
            hidden.append(site)
            args += ["--tmpfs", HOST_KIT + site]
    gdir = os.path.realpath(os.path.dirname(guest.path("agent")))
    # The guest code may live in one of those site-packages (an installed wheel): it is bound
    # before they are made read-only, so its mount point can still be made there.
    args += ["--ro-bind", gdir, HOST_KIT + gdir]
    for site in hidden:
        args += ["--remount-ro", HOST_KIT + site]
    return [*args, "--remount-ro", HOST_KIT]


def kit_argv() -> list[str]:
    """How the agent's interpreter starts in a box of an image (its own loader and libraries)."""
    exe, loader, _, _ = _host_interpreter()
    lib = f"{HOST_KIT}/.lib"
    return [f"{lib}/{os.path.basename(loader)}", "--library-path", lib, HOST_KIT + exe]


def kit_path(path: Path | str) -> str:
    """Where host file ``path`` of the guest code is in a box of an image."""
    return HOST_KIT + os.path.realpath(path)


def _entries(rootfs: str) -> list[os.DirEntry[str]]:
    try:
        return sorted(os.scandir(rootfs), key=lambda e: e.name)
    except OSError as exc:
        raise BoxStartError(f"the image's root filesystem {rootfs} cannot be read: {exc.strerror}") from None


#: At most this many sub-directories of an image's directories that hold host mounts get a
#: copy-on-write overlay of their own per box (see :func:`image_args`); past it, one is shown
#: read-only with its parent (each is one more mount per box, and per fork).
_TREE_OVERLAYS = 64
#: At most this many entries of each such directory are looked at (the rest: read-only with it).
_TREE_SCAN = 8192


def image_args(
    root: ImageRoot,
    template: str | None = None,
    persist: Path | None = None,
    mounts: Sequence[str] = (),
    files: Sequence[str] = (),
    workdir: str | None = None,
) -> list[str]:
    """bwrap arguments laying the image's tree copy-on-write: each top-level directory an overlay
    (the tree its lower layer, then a template's layer of it; the box's writes in memory, or kept
    in ``persist`` for a template build), its links and files as they are.

    ``mounts`` and ``files``: the host directories and files the box shows at their own paths
    (see :func:`host_mount_args`; the runtime makes ``workdir``, the box's working directory).  A
    directory of the image with one of them below it cannot be a writable overlay: a forked box
    renews each writable overlay over itself, and overlayfs refuses a lower directory with (locked)
    mounts beneath it.  So such a directory is a tree (as the host's directories with other mounts
    below them are, see :mod:`.mounts`): one read-only overlay of the image's directory (with the
    mount points, and the ``workdir`` the runtime makes, in a small layer on top), and each of its
    sub-directories with no host path below it an overlay of its own, copy-on-write.
    """
    top_dirs = {
        e.name
        for e in _entries(root.rootfs)
        if e.is_dir(follow_symlinks=False) and e.name not in _RUNTIME_TOPS and e.name != HOST_KIT.lstrip("/")
    }

    def within(paths: Sequence[str]) -> list[str]:
        return [p for p in paths if p.startswith("/") and p.count("/") > 1 and p.split("/")[1] in top_dirs]

    inside_dirs, inside_files = within(mounts), within(files)
    inside = [*inside_dirs, *inside_files]
    layers = layers_of(root, template)
    ancestors = {a for p in inside for a in _parents(p)}
    trees = {a.split("/")[1] for a in ancestors}
    wd = workdir if workdir and workdir.startswith("/") and workdir.split("/")[1] in trees else None
    spine = _spine(layers, inside_dirs, inside_files, wd) if ancestors else None
    budget = [_TREE_OVERLAYS]
    args: list[str] = []
    for entry in _entries(root.rootfs):
        if entry.name in _RUNTIME_TOPS or entry.name == HOST_KIT.lstrip("/"):
            continue
        if entry.name == WORKDIR.lstrip("/") and not entry.is_dir(follow_symlinks=False):
            continue  # the runtime makes /workspace: never through a link of the image's
        target = "/" + entry.name
        if target in mounts or target in files:
            continue  # the host's own goes there whole (host_mount_args): nothing of the image's beneath it
        if entry.is_symlink():
            args += ["--symlink", os.readlink(entry.path), target]
        elif entry.is_dir(follow_symlinks=False):
            if target in ancestors and spine is not None:
                below = _dir_layers(layers, entry.name) or [entry.path]
                # Lowest first: the image, a template's layer, the mount points on top.
                for src in [*reversed(below), os.path.join(spine, entry.name)]:
                    args += ["--overlay-src", src]
                args += ["--ro-overlay", target]
                args += _tree_children(
                    [os.path.join(spine, entry.name), *below], target, ancestors, set(inside), persist, budget
                )
            else:
                args += ["--overlay-src", entry.path]
                if template is not None and _is_dir(Path(template) / "upper" / entry.name):
                    args += ["--overlay-src", str(Path(template) / "upper" / entry.name)]
                args += _cow([], target, persist)
        elif entry.is_file(follow_symlinks=False):
            args += ["--ro-bind", entry.path, target]
    return args


def _parents(path: str) -> list[str]:
    """The proper ancestors of absolute ``path`` but ``/``: ``/a/b/c`` -> ``/a``, ``/a/b``."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]


def _cow(lowers: Sequence[str], target: str, persist: Path | None) -> list[str]:
    """bwrap arguments for one copy-on-write directory of the image: ``lowers`` top first; its
    writes thrown away with the box, or kept under ``persist`` (a template build) at ``target``."""
    args: list[str] = []
    for src in reversed(lowers):
        args += ["--overlay-src", src]
    if persist is not None:
        rel = target.lstrip("/")
        upper, work = persist / "upper" / rel, persist / "work" / rel
        upper.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        return [*args, "--overlay", str(upper), str(work), target]
    return [*args, "--tmp-overlay", target]


def _opaque(path: str) -> bool:
    """Whether directory ``path`` of a layer hides the layers below it (overlayfs's opaque mark)."""
    for name in ("user.overlay.opaque", "trusted.overlay.opaque"):
        with contextlib.suppress(OSError):
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
    return False


def _dir_layers(layers: Sequence[str], rel: str) -> list[str]:
    """Where ``rel`` is a directory in ``layers`` (top first) as overlayfs merges them: down to a
    layer where it is something else (a file, a whiteout, a link: it hides the rest) or opaque.
    Never through a link (lstat)."""
    out: list[str] = []
    for layer in layers:
        p = os.path.join(layer, rel)
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            break
        out.append(p)
        if _opaque(p):
            break
    return out


def _spine(layers: Sequence[str], dirs: Sequence[str], files: Sequence[str], workdir: str | None) -> str:
    """A small read-only layer holding the mount points of ``dirs`` and ``files`` (host paths shown
    in the image's directories: a directory, an empty file) and the directories on the way to them
    and to ``workdir``, with the modes and owners the image gives those it has (made once per
    content in this user's private /tmp, see :func:`.mounts._tree_snapshot`)."""
    from pytest_boxlite.runtimes.namespace.mounts import _tree_snapshot

    me = (os.getuid(), os.getgid())
    items: dict[str, tuple[str, str, int, int, int, bytes]] = {".": ("dir", ".", 0o755, *me, b"")}
    chains = [*((p, False) for p in dirs), *((p, True) for p in files)]
    if workdir is not None:
        chains.append((workdir, False))
    for path, is_file in chains:
        parts = [p for p in path.split("/") if p]
        for i in range(1, len(parts) + 1):
            rel = "/".join(parts[:i])
            if rel in items:
                continue
            leaf_file = is_file and i == len(parts)
            found = None if leaf_file else _dir_layers(layers, rel)
            if found:
                st = os.lstat(found[0])
                items[rel] = ("dir", rel, stat.S_IMODE(st.st_mode) & 0o1777, st.st_uid, st.st_gid, b"")
            else:
                items[rel] = ("file" if leaf_file else "dir", rel, 0o644 if leaf_file else 0o755, *me, b"")
    ordered = sorted(items.values(), key=lambda it: (it[1] != ".", it[1].count("/"), it[1]))
    return _tree_snapshot(ordered)


def _tree_children(
    parent: Sequence[str],
    target: str,
    ancestors: set[str],
    mounted: set[str],
    persist: Path | None,
    budget: list[int],
) -> list[str]:
    """The overlays of a tree's sub-directories (see :func:`image_args`): ``parent`` are the
    layers of directory ``target`` (top first, the spine's first), shown read-only already."""
    names: set[str] = set()
    for layer in parent:
        with contextlib.suppress(OSError), os.scandir(layer) as found:
            names.update(e.name for e in itertools.islice(found, _TREE_SCAN))
    args: list[str] = []
    for name in sorted(names)[:_TREE_SCAN]:
        path = target + "/" + name
        if path in mounted:
            continue  # the host's directory goes there (host_mount_args)
        lowers = _dir_layers(parent, name)
        if not lowers:
            continue  # not a directory in the merged view: shown as it is, read-only
        if path in ancestors:
            args += _tree_children(lowers, path, ancestors, mounted, persist, budget)
        elif budget[0] > 0:
            budget[0] -= 1
            args += _cow(lowers, path, persist)
    return args


def host_mount_args(
    root: ImageRoot,
    mounts: Sequence[str],
    files: Sequence[str],
    masks: Mapping[str, str],
    template: str | None,
    persist: Path | None,
) -> tuple[list[str], list[str]]:
    """bwrap arguments showing host directories ``mounts`` (and single files ``files``) at their
    own paths in a box of the image: ``(arguments, the directories laid copy-on-write)``.

    A directory under /tmp or /run, or whose top-level directory the image lacks, is laid
    copy-on-write (an overlay; in a read-only tmpfs made for its top-level directory, which a
    forked box keeps whole); one inside a directory of the image is shown read-only (an overlay
    with no upper layer: no host socket or FIFO in it is reachable; a writable one could not be
    renewed per forked box beneath another one: a forked box lays this one again, as a mask).
    """
    from pytest_boxlite.runtimes.namespace.mounts import _empty_layer, _overlay

    tops = {e.name: e for e in _entries(root.rootfs)}
    layers = layers_of(root, template)
    args: list[str] = []
    overlays: list[str] = []
    made: list[str] = []
    for m in [*mounts, *files]:
        link = None if m.split("/")[1] in ("tmp", "run") else linked_part(layers, m)
        if link is not None:
            # bubblewrap would follow the image's link (or one a template's setup planted) while it
            # mounts (hostile images): refused.
            where = "the image or its template's layer" if template is not None else "the image"
            raise BoxStartError(
                f"image {root.reference}: {link} is a link in {where} (or not a directory there);"
                f" host path {m} cannot be shown there"
                + (" (rebuild the template: python -m pytest_boxlite clean --templates)" if template else "")
            )
    for m in mounts:
        top = m.split("/")[1]
        private = top in ("tmp", "run")
        entry = tops.get(top)
        if private or entry is None:
            if not private and "/" + top != m and "/" + top not in made:
                args += ["--tmpfs", "/" + top]
                made.append("/" + top)
            args += _overlay(m, template, persist, masks)
            overlays.append(m)
        else:
            # Read-only, and an overlay, not a bind: a bind would show the host's sockets and FIFOs
            # themselves (a box could connect() to a daemon listening in the project).
            args += ["--overlay-src", m, "--overlay-src", _empty_layer(), "--ro-overlay", m]
    for f in files:
        real = os.path.realpath(f)  # a link of the host's: its file there
        if _is_file(real):
            args += ["--ro-bind", real, f]
    for top in made:
        args += ["--remount-ro", top]
    return args, overlays


def layers_of(root: ImageRoot, template: str | None = None) -> list[str]:
    """The trees a box of ``root`` stacks at the box's own paths, top first: a template's upper
    layer (what its ``--boxlite-setup`` wrote, the image's own shell included), then the image's."""
    return [str(Path(template) / "upper"), root.rootfs] if template is not None else [root.rootfs]


def _is_file(path: str) -> bool:
    """Whether ``path`` is a regular file (never a socket or a FIFO of the host's)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _is_dir(path: Path | str) -> bool:
    """Whether ``path`` is a directory itself (a link to one is not: it is never followed)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def linked_part(layers: Sequence[str], path: str) -> str | None:
    """The first part of absolute ``path`` that is a link in any of ``layers`` (the trees stacked
    at the box's paths, see :func:`layers_of`; or ``path`` itself if it has ``..`` parts), else
    ``None``: bubblewrap follows links while it makes a mount point or a directory, and a link of
    the image's, or one its shell planted in a template, may lead anywhere (``/oldroot`` is the
    host's root while bubblewrap sets a box up).

    Every layer is looked at, not only the one overlayfs would show: a link hidden below another
    layer's directory is refused all the same (a false alarm costs a clear error; overlayfs's own
    resolution, with its opaque directories and whiteouts, is not re-implemented here).  A
    non-directory (a file, a whiteout) on the way to ``path`` in any layer counts as a link too.
    """
    parts = [p for p in path.split("/") if p and p != "."]
    if ".." in parts:
        return path
    live = list(layers)
    for i in range(len(parts)):
        here = "/" + "/".join(parts[: i + 1])
        last = i == len(parts) - 1
        nxt: list[str] = []
        for layer in live:
            cur = os.path.join(layer, *parts[: i + 1])
            try:
                st = os.lstat(cur)  # every part before this one was a directory in this layer
            except OSError:
                continue  # absent here: nothing below it in this layer either
            if stat.S_ISLNK(st.st_mode) or (not last and not stat.S_ISDIR(st.st_mode)):
                return here
            nxt.append(layer)
        if not nxt:
            return None  # made anew below here: no layer has anything on the way
        live = nxt
    return None


def image_workdir(root: ImageRoot, template: str | None = None) -> str | None:
    """The image config's ``WorkingDir`` where the box can make and enter it (absolute, reached
    through no link of the image's nor of ``template``'s layer), else ``None`` (then ``/workspace``)."""
    wd = root.workdir
    if not wd or not wd.startswith("/") or len(wd) > 4096 or linked_part(layers_of(root, template), wd) is not None:
        return None
    top = wd.split("/")[1]
    if top in _RUNTIME_TOPS or top == HOST_KIT.lstrip("/"):
        return None
    return os.path.normpath(wd)


def interpreter_mounts() -> tuple[list[str], list[str]]:
    """What boxed tests' interpreter needs at its own paths beyond ``sys.path``: ``(directories,
    files)``: its prefixes (a virtual environment's ``pyvenv.cfg``), or, where one is a system
    directory the image has its own of, the executable alone (at each path its links pass)."""
    exe = os.path.realpath(sys.executable)
    dirs: list[str] = []
    files: list[str] = []
    for d in (sys.prefix, sys.exec_prefix, sys.base_prefix):
        real = os.path.realpath(d)
        if real in _SYSTEM_DIRS or real.count("/") == 1:
            continue
        dirs.append(real)
    # Every hop of the executable's links that lies outside those directories (a venv's
    # bin/python3 -> /usr/bin/python3 -> python3.11): the image has its own of none of them.
    hop = os.path.abspath(sys.executable)
    for _ in range(40):
        if not any(hop.startswith(d + "/") for d in dirs) and hop not in files:
            files.append(hop)
        if not os.path.islink(hop):
            break
        hop = os.path.normpath(os.path.join(os.path.dirname(hop), os.readlink(hop)))
    if exe not in files and not any(exe.startswith(d + "/") for d in dirs):
        files.append(exe)
    return dirs, files


def _in_image(rootfs: str, path: str, depth: int = 0) -> bool:
    """Whether ``path`` (absolute, in the image) names a file in the tree at ``rootfs``, links
    resolved inside the tree (never outside it: a link's target is read as the image's path)."""
    parts = [p for p in path.split("/") if p and p != "."]
    cur = rootfs
    for i, part in enumerate(parts):
        if part == "..":
            cur = os.path.dirname(cur) if cur != rootfs else rootfs
            continue
        nxt = os.path.join(cur, part)
        try:
            st = os.lstat(nxt)
        except OSError:
            return False
        import stat as _stat

        if _stat.S_ISLNK(st.st_mode):
            if depth > 16:
                return False
            target = os.readlink(nxt)
            base = "/" if target.startswith("/") else "/" + os.path.relpath(cur, rootfs)
            rest = "/".join(parts[i + 1 :])
            return _in_image(rootfs, os.path.normpath(os.path.join(base, target, rest)), depth + 1)
        cur = nxt
    return os.path.isfile(cur) if parts else False


@lru_cache(maxsize=1)
def _exe_libs() -> dict[str, str]:
    """The libraries the host's interpreter executable links (``{soname: host path}``)."""
    return _ldd([os.path.realpath(sys.executable)])[1]


def interpreter_problem(root: ImageRoot, mounted: Sequence[str]) -> str | None:
    """Why the image cannot run the host's interpreter for boxed tests, or ``None``.

    ``mounted``: host directories the box shows at their own paths (a library found there, e.g.
    a pyenv build's ``libpython``, comes from the host).  Cached per image and mounts: the session
    asks for every boxed test's spec."""
    return _interpreter_problem(root.rootfs, tuple(mounted))


@lru_cache(maxsize=64)
def _interpreter_problem(rootfs: str, mounted: tuple[str, ...]) -> str | None:
    exe, loader, _, _ = _host_interpreter()
    if not _in_image(rootfs, loader):
        return f"no dynamic loader {loader} in the image (the glibc loader {exe} was built for)"
    missing = []
    for soname, path in sorted(_exe_libs().items()):
        if any(path.startswith(m.rstrip("/") + "/") for m in mounted):
            continue
        if not any(_in_image(rootfs, f"/{d}/{soname}") for d in _LIB_DIRS):
            missing.append(soname)
    if missing:
        return f"the image has no {', '.join(missing)} (libraries {exe} links)"
    if not any(_in_image(rootfs, f"{d}/env") for d in _ENV_DIRS):
        return "the image has no env command (boxed tests' interpreter starts through it: coreutils or busybox)"
    return None


def _image_file(rootfs: str, rel: str, limit: int = 1 << 20) -> str:
    """A file of the image's tree (``etc/passwd``), read bounded and never through a link."""
    fd = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in rel.split("/")[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        leaf = os.open(rel.split("/")[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
    try:
        return os.read(leaf, limit).decode("utf-8", "replace")
    finally:
        os.close(leaf)


def image_identity(root: ImageRoot) -> tuple[int, int] | None:
    """The image config's ``User`` as ``(uid, gid)`` (names from the image's own /etc/passwd and
    /etc/group), or ``None`` when it names no one the image knows."""
    if not root.user:
        return None
    name, _, group = root.user.partition(":")

    def lookup(rel: str, key: str) -> tuple[int, int] | None:
        try:
            text = _image_file(root.rootfs, rel)
        except OSError:
            return None
        for line in text.splitlines():
            fields = line.split(":")
            if len(fields) >= 4 and fields[0] == key and fields[2].isdigit() and fields[3].isdigit():
                return int(fields[2]), int(fields[3])
        return None

    if name.isdigit():
        uid, gid = int(name), int(name)
    else:
        found = lookup("etc/passwd", name)
        if found is None:
            return None
        uid, gid = found
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            found = lookup("etc/group", group)
            if found is None:
                return None
            gid = found[0]
    if uid > 0xFFFFFFFE or gid > 0xFFFFFFFE:
        return None
    return uid, gid
