"""The boxlite home as a trust boundary: the one module every caller uses for paths below a home.

A home holds what the host later acts on (box records naming pids, directories it removes, image
layers it unpacks).  Anyone who can write it, or who shipped it (a project's ini naming a home
inside the checkout), could plant links and records there.  So:

How it works, and why: ``docs/explanation/internals/homes.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
import pwd
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_boxlite.errors import BoxliteError

__all__ = [
    "OPENAT2",
    "Entry",
    "HomeDir",
    "Refused",
    "UnsafeHome",
    "check_home",
    "has_openat2",
    "limits",
    "open_beneath",
    "read_at_most",
    "remove_path",
    "remove_tree_at",
]


class UnsafeHome(BoxliteError):
    """A home (or a directory above it) that someone else could write: nothing in it is used."""


class Refused(OSError):
    """An entry below a home that is a link, of another owner, or of the wrong type: refused, not followed."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(errno.EPERM, f"refused {path}: {why} (pytest-boxlite never follows links in a home)")
        self.path = path
        self.why = why

    def __str__(self) -> str:
        return str(self.strerror)


# --- openat2 -------------------------------------------------------------------------------------

_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437, "ppc64le": 437, "s390x": 437, "riscv64": 437}
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08


@functools.cache
def _syscall() -> Any:
    """libc's ``syscall`` and openat2's number here, or None (ctypes is loaded on first use only:
    every pytest run imports this module, few of them open a home)."""
    nr = _SYS_OPENAT2.get(os.uname().machine)
    if nr is None:
        return None
    import ctypes

    class OpenHow(ctypes.Structure):
        _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None

    def call(dirfd: int, rel: str, flags: int, mode: int) -> int:
        how = OpenHow(flags, mode, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
        fd = libc.syscall(
            ctypes.c_long(nr),
            ctypes.c_int(dirfd),
            ctypes.c_char_p(os.fsencode(rel)),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), rel)
        return int(fd)

    return call


def _openat2(dirfd: int, rel: str, flags: int, mode: int) -> int:
    call = _syscall()
    if call is None:
        raise OSError(errno.ENOSYS, "openat2 unavailable")
    return int(call(dirfd, rel, flags, mode if flags & os.O_CREAT else 0))


@functools.cache
def has_openat2() -> bool:
    """Whether this kernel has ``openat2`` (Linux 5.6+); otherwise paths are walked one
    ``O_NOFOLLOW`` component at a time (as sound for links, a little slower).  Also :data:`OPENAT2`."""
    root = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = _openat2(root, ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0)
    except OSError:
        return False
    finally:
        os.close(root)
    os.close(fd)
    return True


if TYPE_CHECKING:
    #: Whether this kernel has ``openat2`` (:func:`has_openat2`, probed on first use).
    OPENAT2: bool


def __getattr__(name: str) -> Any:
    if name == "OPENAT2":
        return has_openat2()
    raise AttributeError(name)


def limits() -> list[str]:
    """The home rules this host cannot hold as designed, one line each (empty: all hold)."""
    out = []
    if not has_openat2():
        out.append("no openat2 on this kernel: paths below a home are walked one O_NOFOLLOW component at a time")
    if not hasattr(os, "pidfd_open"):
        out.append("no pidfd_open: a box process is checked, then signalled by pid (a reuse in between is possible)")
    return out


def _parts(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if rel.startswith("/") or ".." in parts:
        raise Refused(rel, "not a path below the directory")
    return parts


def open_beneath(dirfd: int, rel: str, flags: int, mode: int = 0) -> int:
    """Open ``rel`` below ``dirfd`` following no link on the way or at its end; a file descriptor.

    A link anywhere raises :class:`Refused` (``ELOOP``); ``..`` and absolute paths are refused.
    """
    parts = _parts(rel)
    flags |= os.O_CLOEXEC | os.O_NOFOLLOW
    if not parts:
        return os.open(".", flags & ~os.O_NOFOLLOW & ~os.O_CREAT, dir_fd=dirfd)
    try:
        if has_openat2():
            return _openat2(dirfd, "/".join(parts), flags, mode)
        return _walk_open(dirfd, parts, flags, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EXDEV) or (exc.errno == errno.ENOTDIR and flags & os.O_DIRECTORY):
            raise Refused(rel, "a link or not a directory where a directory or file is expected") from None
        raise


def _walk_open(dirfd: int, parts: list[str], flags: int, mode: int) -> int:
    cur = dirfd
    try:
        for name in parts[:-1]:
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cur)
            if cur != dirfd:
                os.close(cur)
            cur = nxt
        return os.open(parts[-1], flags, mode, dir_fd=cur)
    finally:
        if cur != dirfd:
            os.close(cur)


# --- the home itself -----------------------------------------------------------------------------


def _who(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _unsafe(path: str, why: str, fix: str, source: str) -> UnsafeHome:
    return UnsafeHome(
        f"boxlite home {path} (from {source}) is not safe to use: {why}. "
        f"Another user, or files shipped with a project, could plant links and records there that "
        f"make pytest-boxlite remove or signal what is not its own. Fix: {fix}, or choose another "
        "home with --boxlite-home / PYTEST_BOXLITE_HOME (python -m pytest_boxlite: --home)"
    )


def _check_parent(path: str, st: os.stat_result, home: str, source: str) -> None:
    me = os.geteuid()
    if st.st_uid not in (0, me):
        raise _unsafe(
            home,
            f"the directory {path} above it belongs to {_who(st.st_uid)}, who could replace the home",
            "move the home below a directory of your own or root's",
            source,
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise _unsafe(
            home,
            f"the directory {path} above it is writable by others (mode {stat.filemode(st.st_mode)}) and not sticky",
            f"chmod go-w {path}",
            source,
        )


def check_home(path: str | os.PathLike[str], *, source: str, create: bool = False) -> Path:
    """The absolute home ``path`` once it is safe to use; :class:`UnsafeHome` otherwise.

    Safe: a real directory (reached through links only in directories above it that pass the
    same rule) owned by this uid and writable by no group or other; every directory above it
    owned by root or this uid and not writable by others unless sticky.  ``create`` makes a
    missing home (mode 0700, parents as ``mkdir -p``).  ``source`` says where the value came from
    (``command line --boxlite-home``, ``ini boxlite_home``...), for the message.
    """
    given = os.path.abspath(os.fspath(path))
    if create:
        # A home that cannot be made is no trust question: the OSError is the caller's to word.
        os.makedirs(given, mode=0o700, exist_ok=True)
    # The path as given: each directory above, and any link on the way, is someone's to change.
    for chain in (given, os.path.realpath(given)):
        parts = chain.split("/")[1:]
        cur = "/"
        for name in parts[:-1]:
            cur = os.path.join(cur, name)
            try:
                st = os.lstat(cur)
            except OSError:
                continue  # checked on the resolved chain (or the home is missing, said below)
            if stat.S_ISLNK(st.st_mode):
                if st.st_uid not in (0, os.geteuid()):
                    raise _unsafe(
                        given, f"the link {cur} on its path belongs to {_who(st.st_uid)}", f"remove {cur}", source
                    )
                continue
            _check_parent(cur, st, given, source)
    try:
        fd = os.open(given, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return Path(given)  # nothing to trust yet: made (checked) by whoever uses it
    # Any other OSError (not readable by this user...) is the caller's to word, as it always was.
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        raise _unsafe(
            given,
            f"it belongs to {_who(st.st_uid)}, not to {_who(os.geteuid())} who runs this",
            "use a home of your own (each user needs their own)",
            source,
        )
    if st.st_mode & 0o022:
        raise _unsafe(
            given, f"it is writable by others (mode {stat.filemode(st.st_mode)})", f"chmod go-w {given}", source
        )
    return Path(given)


# --- directories below a home --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    """One child of a :class:`HomeDir`, from ``lstat`` (nothing followed).

    ``refused`` is why the entry is not to be used as a directory or record of ours (a link,
    another owner's), else ``None``.
    """

    name: str
    is_dir: bool
    is_file: bool
    is_link: bool
    uid: int
    refused: str | None


_DIR = os.O_RDONLY | os.O_DIRECTORY


def read_at_most(fd: int, limit: int) -> bytes:
    """At most ``limit`` bytes from ``fd``, read in bounded chunks (a file someone else may grow)."""
    chunks: list[bytes] = []
    left = limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _ours(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid()


class HomeDir:
    """An open directory of a checked home (or below it): every path is opened relative to it."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def open(cls, home: str | os.PathLike[str], *, follow: bool = False) -> HomeDir:
        """Open a directory of ours by path: a home that :func:`check_home` accepted (``follow``:
        the home itself may be a link, checked there), or a directory of one whose own name is
        not followed if it is a link (``ELOOP``)."""
        path = Path(home)
        fd = os.open(path, _DIR | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
        st = os.fstat(fd)
        if not _ours(st):
            os.close(fd)
            raise Refused(str(path), f"it belongs to {_who(st.st_uid)}")
        return cls(fd, path)

    @classmethod
    def open_expected(cls, path: str | os.PathLike[str], what: str) -> HomeDir:
        """:meth:`open` of a directory below a home that the caller expects there (``what``: how
        its refusal names it): a link or a non-directory in its place is :class:`Refused`."""
        try:
            return cls.open(path)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise Refused(str(path), f"a link or not a directory where {what} is expected") from None
            raise

    @classmethod
    def at(cls, home: str | os.PathLike[str], rel: str, *, create: bool = False) -> HomeDir:
        """``HomeDir.open(home).sub(rel, create=create)``, closing the home's descriptor."""
        with cls.open(home, follow=True) as top:
            return top.sub(rel, create=create)

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> HomeDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _name(self, rel: str) -> str:
        return str(self.path / rel)

    def sub(self, rel: str, *, create: bool = False, mode: int = 0o700) -> HomeDir:
        """The directory ``rel`` (ours, reached through no link), made with ``create``."""
        parts = _parts(rel)
        cur = HomeDir(os.dup(self.fd), self.path)
        try:
            for name in parts:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, mode, dir_fd=cur.fd)
                try:
                    fd = open_beneath(cur.fd, name, _DIR)
                except Refused:
                    raise Refused(cur._name(name), "a link where a directory is expected") from None
                except NotADirectoryError:
                    raise Refused(cur._name(name), "not a directory") from None
                st = os.fstat(fd)
                nxt = HomeDir(fd, cur.path / name)
                cur.close()
                cur = nxt
                if not _ours(st):
                    raise Refused(str(cur.path), f"it belongs to {_who(st.st_uid)}")
            return cur
        except BaseException:
            cur.close()
            raise

    def entries(self) -> list[Entry]:
        """Every child, sorted by name, each from ``lstat``; links and others' entries flagged."""
        out = []
        with os.scandir(self.fd) as it:
            names = sorted(e.name for e in it)
        for name in names:
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            link = stat.S_ISLNK(st.st_mode)
            refused = None
            if link:
                refused = "a link"
            elif not _ours(st):
                refused = f"it belongs to {_who(st.st_uid)}"
            out.append(Entry(name, stat.S_ISDIR(st.st_mode), stat.S_ISREG(st.st_mode), link, st.st_uid, refused))
        return out

    def stat(self, rel: str) -> os.stat_result:
        """``lstat`` of ``rel`` (its parents reached through no link)."""
        parent, name = self._split(rel)
        with parent:
            return os.stat(name, dir_fd=parent.fd, follow_symlinks=False)

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists (a link counts: it is there, even if refused)."""
        try:
            self.stat(rel)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except Refused:
            return False
        return True

    def _split(self, rel: str) -> tuple[HomeDir, str]:
        parts = _parts(rel)
        if not parts:
            raise Refused(self._name(rel), "not a name")
        return self.sub("/".join(parts[:-1])), parts[-1]

    def open_file(self, rel: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
        """A descriptor of the regular file ``rel`` of ours, reached through no link."""
        try:
            fd = open_beneath(self.fd, rel, flags | os.O_NONBLOCK, mode)
        except Refused:
            raise Refused(self._name(rel), "a link where a file is expected") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not _ours(st):
            os.close(fd)
            why = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"it belongs to {_who(st.st_uid)}"
            raise Refused(self._name(rel), why)
        return fd

    def read(self, rel: str, limit: int) -> bytes:
        """At most ``limit`` bytes of the regular file ``rel`` (ours, never through a link)."""
        fd = self.open_file(rel)
        try:
            return read_at_most(fd, limit)
        finally:
            os.close(fd)

    def write(self, rel: str, data: bytes, mode: int = 0o600) -> None:
        """Create or replace the file ``rel`` atomically (a reader never sees half of it)."""
        parent, name = self._split(rel)
        with parent:
            tmp = f".{name}.{os.getpid()}.tmp"
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent.fd
            )
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=parent.fd)
                raise
            os.close(fd)
            os.replace(tmp, name, src_dir_fd=parent.fd, dst_dir_fd=parent.fd)

    def unlink(self, rel: str, *, missing_ok: bool = True) -> None:
        """Remove the file or link ``rel`` (a link is removed, never followed)."""
        parent, name = self._split(rel)
        with parent:
            try:
                os.unlink(name, dir_fd=parent.fd)
            except FileNotFoundError:
                if not missing_ok:
                    raise

    def remove(self, name: str) -> None:
        """Remove the child ``name`` whatever it is, by descriptors (see :func:`remove_tree_at`)."""
        parent, last = self._split(name)
        with parent:
            remove_tree_at(parent.fd, last)


# --- removal -------------------------------------------------------------------------------------


def _make_ours(fd: int) -> None:
    # Overlayfs leaves work directories at mode 000, a box's writes keep their modes: a directory
    # we own is made listable and writable before it is emptied (another owner's: rmtree then
    # says what it could not remove).
    with contextlib.suppress(OSError):
        st = os.fstat(fd)
        if st.st_mode & 0o700 != 0o700:
            os.fchmod(fd, 0o700)


def _open_child_dir(dirfd: int, name: str, want: os.stat_result) -> int:
    try:
        fd = os.open(name, _DIR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    except PermissionError:
        # Mode 000 (overlayfs work dirs): make it ours through an O_PATH descriptor, then open.
        pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dirfd)
        try:
            pst = os.fstat(pfd)
            if (pst.st_dev, pst.st_ino) != (want.st_dev, want.st_ino):
                raise Refused(name, "replaced while it was being removed") from None
            os.chmod(f"/proc/self/fd/{pfd}", 0o700)
        finally:
            os.close(pfd)
        fd = os.open(name, _DIR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino):
        os.close(fd)
        raise Refused(name, "replaced while it was being removed")
    return fd


def remove_tree_at(dirfd: int, name: str) -> None:
    """Remove ``name`` in ``dirfd`` and, if it is a directory, everything below it.

    Every step is relative to an open directory descriptor: a link is unlinked, never followed,
    and a directory swapped for another while it is being emptied is refused (``Refused``), so
    the walk never leaves the tree it started in.  Missing is fine.  Raises ``OSError`` naming
    what could not be removed.
    """
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dirfd)
        return
    # An explicit stack, not Python frames, holding at most _MAX_OPEN descriptors: a deeper
    # level's far ancestors are closed, and opened again on the way back up as ``..`` of their
    # child, checked to be the very directory the walk came down through (device and inode).
    stack: list[_Level] = []
    try:
        top = _open_child_dir(dirfd, name, st)
        _make_ours(top)
        stack.append(_Level(top, name, st, iter(sorted(os.listdir(top)))))
        while stack:
            level = stack[-1]
            child = next(level.names, None)
            if child is None:
                stack.pop()
                if stack and stack[-1].fd < 0:
                    stack[-1].fd = _parent_of(level.fd, stack[-1])
                os.close(level.fd)
                level.fd = -1
                os.rmdir(level.name, dir_fd=stack[-1].fd if stack else dirfd)
                continue
            cst = os.stat(child, dir_fd=level.fd, follow_symlinks=False)
            if stat.S_ISDIR(cst.st_mode):
                sub = _open_child_dir(level.fd, child, cst)
                _make_ours(sub)
                stack.append(_Level(sub, child, cst, iter(sorted(os.listdir(sub)))))
                if len(stack) > _MAX_OPEN:
                    far = stack[-_MAX_OPEN - 1]
                    if far.fd >= 0:
                        os.close(far.fd)
                        far.fd = -1
            else:
                os.unlink(child, dir_fd=level.fd)
    finally:
        for level in stack:
            if level.fd >= 0:
                os.close(level.fd)


#: Descriptors one removal holds at most (a guest can make a tree thousands of levels deep).
_MAX_OPEN = 64


@dataclasses.dataclass
class _Level:
    fd: int  # -1: closed, to be opened again from its child on the way up
    name: str
    st: os.stat_result
    names: Iterator[str]


def _parent_of(fd: int, parent: _Level) -> int:
    """``..`` of the directory ``fd`` (never a link), if it is still ``parent``: else refused."""
    up = os.open("..", _DIR | os.O_CLOEXEC, dir_fd=fd)
    got = os.fstat(up)
    if (got.st_dev, got.st_ino) != (parent.st.st_dev, parent.st.st_ino):
        os.close(up)
        raise Refused(parent.name, "moved while it was being removed")
    return up


def remove_path(path: str | os.PathLike[str]) -> None:
    """Remove ``path`` (a directory tree of ours, or a file or link) by descriptors: its parent is
    opened by path, everything below it never through a link (see :func:`remove_tree_at`)."""
    p = Path(path)
    parent = os.open(p.parent, _DIR | os.O_CLOEXEC)
    try:
        remove_tree_at(parent, p.name)
    finally:
        os.close(parent)
