"""Apply OCI layers (tar changesets) to a directory: hostile-input code.

How it works, and why: ``docs/explanation/internals/image-unpack.md``.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import gzip
import hashlib
import io
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from pytest_boxlite.images.reference import ImageError

__all__ = [
    "DEFAULT_MAX_MEMBERS",
    "DEFAULT_MAX_RATIO",
    "DEFAULT_MAX_UNPACKED",
    "RATIO_FLOOR",
    "Limits",
    "apply_layer",
    "open_layer_stream",
    "tree_size",
]

#: Bytes of file data one image may unpack to, all layers together (the largest real images, CUDA
#: and ML stacks, are some 5-8 GiB unpacked).
DEFAULT_MAX_UNPACKED = 8 << 30
DEFAULT_MAX_MEMBERS = 1_000_000
#: Bytes of tar stream a layer (and an image, all layers together) may unpack to per byte of blob:
#: real layers compress 2:1 to 10:1 (text, binaries), a gzip of zeros 1000:1.
DEFAULT_MAX_RATIO = 100
#: Below this many bytes of tar stream, a layer (or an image) passes whatever its ratio: a tiny
#: layer (an empty directory, a few small files) is mostly tar headers and padding, which compress
#: far better than 100:1.  So a blob of N bytes unpacks to at most max(100 N, 16 MiB).
RATIO_FLOOR = 16 << 20
_MAX_NAME = 4096
#: How deep the tree may get, in directories and in bytes of real path (links resolved): a deeper
#: tree would break the host's path-based tools (Python's recursive os.walk and shutil.rmtree raise
#: RecursionError at ~1000 levels; paths of more than PATH_MAX, 4096, cannot be named at all).
#: Real images' deepest paths (node_modules, JDKs) are some 30 levels and a few hundred bytes.
_MAX_DEPTH = 256
_MAX_REAL_PATH = 3500
_MAX_LINK_HOPS = 40
#: Directory fds kept for the next members (most land in the directory of the one before).
_MAX_CACHED_DIRS = 128
_WH = ".wh."
_OPAQUE = ".wh..wh..opq"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20
#: PEP 706's ``data`` filter, where this Python has it (3.11.4+; Debian's 3.11.2 has not).
_DATA_FILTER = getattr(tarfile, "data_filter", None)


class Limits:
    """What one image may cost to unpack, all layers together: bytes of file data, members, and the
    compression ratio (tar stream out per blob byte in, per layer and for the image).

    ``size_hint`` and ``ratio_hint`` end the refusals' messages: how to raise the bound (the
    store's caller knows its option; here none).
    """

    def __init__(
        self,
        max_unpacked: int = DEFAULT_MAX_UNPACKED,
        max_members: int = DEFAULT_MAX_MEMBERS,
        *,
        max_ratio: float = DEFAULT_MAX_RATIO,
        ratio_floor: int = RATIO_FLOOR,
        size_hint: str = "the image's size bound",
        ratio_hint: str = "the compression ratio bound",
    ) -> None:
        self.max_unpacked = max_unpacked
        self.max_members = max_members
        self.max_ratio = max_ratio
        self.ratio_floor = ratio_floor
        self.size_hint = size_hint
        self.ratio_hint = ratio_hint
        self.unpacked = 0
        self.members = 0
        self.skipped_special = 0
        #: Blob bytes read and tar stream bytes out, of the layers done (the current one: its reader's).
        self.blob_in = 0
        self.stream_out = 0
        #: Layer blobs already applied: a blob a manifest lists again counts once in ``blob_in``
        #: (else listing one 1 MB blob 1000 times would allow 1000 times its ratio bound).
        self.blobs_seen: set[str] = set()

    def ratio_bound(self, blob_bytes: int) -> int:
        """The most tar stream ``blob_bytes`` of layer blob may unpack to: max(ratio x in, floor)."""
        return max(int(self.max_ratio * blob_bytes), self.ratio_floor)


class _HashingReader(io.RawIOBase):
    """Reads a (decompressed) layer stream, hashing it and refusing more than ``limit`` bytes, or
    more than the compression ratio of ``limits`` allows for the blob bytes ``blob`` gave so far
    (this layer's, and the image's with the layers before): checked on every read, so a
    decompression bomb stops within one read buffer of its bound."""

    def __init__(
        self, raw: IO[bytes], limit: int, what: str, blob: IO[bytes] | None = None, limits: Limits | None = None
    ) -> None:
        self._raw = raw
        self._limit = limit
        self._what = what
        self._blob = blob
        self._limits = limits
        self.count = 0
        self.blob_in = 0
        #: Whether this blob's bytes count for the image's ratio (not when applied before).
        self.counts_in = True
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._raw.read(len(b))
        n = len(data)
        self.count += n
        if self.count > self._limit:
            raise ImageError(
                f"{self._what}: the layer unpacks to more than {self._limit} bytes (the image's size bound)"
            )
        if self._blob is not None and self._limits is not None:
            self._check_ratio(self._limits)
        self.sha.update(data)
        b[:n] = data
        return n

    def _check_ratio(self, limits: Limits) -> None:
        assert self._blob is not None
        # What the decompressor has taken from the blob so far (it reads ahead a buffer: generous).
        self.blob_in = self._blob.tell()
        bound = limits.ratio_bound(self.blob_in)
        if self.count > bound:
            raise ImageError(
                f"{self._what}: the layer's {self.blob_in} compressed bytes unpack to more than {bound} bytes "
                f"(more than {limits.max_ratio:g}:1, past the {limits.ratio_floor >> 20} MiB any layer may have): "
                f"a decompression bomb, or {limits.ratio_hint}"
            )
        image_in = limits.blob_in + (self.blob_in if self.counts_in else 0)
        image_bound = limits.ratio_bound(image_in)
        if limits.stream_out + self.count > image_bound:
            raise ImageError(
                f"{self._what}: the image's {image_in} compressed bytes unpack to more than {image_bound} bytes "
                f"(more than {limits.max_ratio:g}:1 all layers together, past the {limits.ratio_floor >> 20} MiB "
                f"any image may have): a decompression bomb, or {limits.ratio_hint}"
            )

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass


#: Extended headers (PAX, GNU long names) are read whole into memory by tarfile: bound them first.
#: Names are at most ``_MAX_NAME`` (4096) characters; the rest of a PAX record is times, ids and
#: xattrs (file capabilities, SELinux labels): small.  64 KiB leaves ample room.
_MAX_EXT_HEADER = 64 << 10
#: Global PAX headers are merged into the TarFile and kept for its whole life: all of them together.
_MAX_GLOBAL_EXT = 1 << 20
_EXT_TYPES = frozenset(
    {tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK}
)


class _BoundedTarInfo(tarfile.TarInfo):
    """A TarInfo whose extended headers may not exceed :data:`_MAX_EXT_HEADER` bytes each (a layer
    could declare gigabytes, which tarfile would read into memory before any check here), nor
    ``max_ext_total`` bytes all together where the TarFile keeps its members (``None``: the reader
    drops each member once handled, as :func:`apply_layer` does), global headers
    :data:`_MAX_GLOBAL_EXT` bytes together (tarfile keeps them always)."""

    max_ext_total: int | None = None

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXT_TYPES:
            if self.size > _MAX_EXT_HEADER:
                raise tarfile.HeaderError(f"an extended header of {self.size} bytes (at most {_MAX_EXT_HEADER})")
            counts: dict[str, int] = tarfile_.__dict__.setdefault("_boxlite_ext_bytes", {"all": 0, "global": 0})
            counts["all"] += self.size
            if self.type == tarfile.XGLTYPE:
                counts["global"] += self.size
                if counts["global"] > _MAX_GLOBAL_EXT:
                    raise tarfile.HeaderError(f"global extended headers of more than {_MAX_GLOBAL_EXT} bytes")
            if self.max_ext_total is not None and counts["all"] > self.max_ext_total:
                raise tarfile.HeaderError(f"extended headers of more than {self.max_ext_total} bytes in all")
        return super()._proc_member(tarfile_)  # type: ignore[misc, no-any-return]


def _compression(head: bytes) -> str:
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "zstd"
    if head.startswith(b"BZh"):
        return "bzip2"
    if head.startswith(b"\xfd7zXZ\x00"):
        return "xz"
    return "tar"


@contextlib.contextmanager
def open_layer_stream(blob: Path, limit: int, what: str, limits: Limits | None = None) -> Iterator[_HashingReader]:
    """The decompressed bytes of layer ``blob`` (tar, gzip; zstd where the ``zstandard`` module is),
    bounded to ``limit`` bytes and, given ``limits``, to its compression ratio bound."""
    try:
        # A blob of the store, never a link planted in its place (the store is below a home).
        fd = os.open(blob, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ImageError(f"{what}: cannot open the layer blob {blob.name}: {exc.strerror} (a link?)") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ImageError(f"{what}: the layer blob {blob.name} is not a regular file")
    with os.fdopen(fd, "rb") as raw:
        kind = _compression(raw.read(6))
        raw.seek(0)
        stream: Any
        if kind == "gzip":
            stream = gzip.GzipFile(fileobj=raw, mode="rb")
        elif kind == "tar":
            stream = raw
        elif kind == "zstd":
            try:
                import zstandard  # type: ignore[import-not-found, unused-ignore]
            except ImportError:
                raise ImageError(
                    f"{what}: the layer is zstd-compressed and the 'zstandard' module is not installed "
                    "(pip install zstandard, or re-pack the image with gzip layers: "
                    "skopeo copy --dest-compress-format gzip)"
                ) from None
            stream = zstandard.ZstdDecompressor().stream_reader(raw)
        else:
            raise ImageError(f"{what}: {kind}-compressed layers are not supported (use tar, gzip or zstd layers)")
        yield _HashingReader(stream, limit, what, raw, limits)


def _split(name: str) -> list[str]:
    return [p for p in name.split("/") if p not in ("", ".")]


class _Tree:
    """The tree being built, addressed by in-tree paths, through directory fds only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.rootfd = os.open(root, _DIR_FLAGS)
        self._cache: dict[tuple[str, ...], tuple[int, tuple[str, ...]]] = {}

    def close(self) -> None:
        self.forget()
        os.close(self.rootfd)

    def forget(self) -> None:
        """Drop cached directory fds: a link or directory changed, so paths may resolve otherwise."""
        for fd, _ in self._cache.values():
            os.close(fd)
        self._cache.clear()

    def resolve_dir(self, parts: list[str], *, create: bool, what: str) -> tuple[int, tuple[str, ...]] | None:
        """A new fd (the caller closes it) of directory ``parts`` resolved inside the tree, and its real path.

        Links are followed with the box's semantics (absolute from the tree's top; ``..`` stops
        there).  Missing directories are made when ``create`` (a layer may omit its parents), a
        non-directory in the way is replaced by one (the upper layer wins); else None.
        """
        key = tuple(parts)
        hit = self._cache.get(key)
        if hit is not None:
            return os.dup(hit[0]), hit[1]
        fds: list[int] = []
        real: list[str] = []
        todo = list(reversed(parts))
        hops = 0
        try:
            while todo:
                comp = todo.pop()
                if comp in ("", "."):
                    continue
                cur = fds[-1] if fds else self.rootfd
                if comp == "..":
                    if fds:
                        os.close(fds.pop())
                        real.pop()
                    continue
                try:
                    st = os.stat(comp, dir_fd=cur, follow_symlinks=False)
                except FileNotFoundError:
                    if not create:
                        return None
                    os.mkdir(comp, 0o755, dir_fd=cur)
                    st = os.stat(comp, dir_fd=cur, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    hops += 1
                    if hops > _MAX_LINK_HOPS:
                        raise ImageError(f"{what}: too many levels of symbolic links under {'/'.join(parts)!r}")
                    target = os.readlink(comp, dir_fd=cur)
                    if target.startswith("/"):
                        for fd in fds:
                            os.close(fd)
                        fds.clear()
                        real.clear()
                    todo.extend(reversed(target.split("/")))
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    if not create:
                        return None
                    os.unlink(comp, dir_fd=cur)
                    os.mkdir(comp, 0o755, dir_fd=cur)
                fds.append(os.open(comp, _DIR_FLAGS, dir_fd=cur))
                real.append(comp)
                _check_depth(real, what)
            fd = os.dup(fds[-1]) if fds else os.dup(self.rootfd)
        finally:
            for f in fds:
                os.close(f)
        if len(self._cache) >= _MAX_CACHED_DIRS:
            self.forget()  # one fd each: an image has more directories than a process may hold fds
        self._cache[key] = (fd, tuple(real))
        return os.dup(fd), tuple(real)

    def remove(self, dirfd: int, name: str) -> None:
        """Remove entry ``name`` of ``dirfd`` (a whole directory tree too), following no link."""
        try:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            _rmtree_at(dirfd, name)
        else:
            os.unlink(name, dir_fd=dirfd)
        self.forget()


def _check_depth(real: list[str] | tuple[str, ...], what: str) -> None:
    """Refuse a tree deeper than :data:`_MAX_DEPTH` directories or :data:`_MAX_REAL_PATH` bytes."""
    if len(real) > _MAX_DEPTH or sum(len(os.fsencode(c)) + 1 for c in real) > _MAX_REAL_PATH:
        shown = "/".join(real)
        raise ImageError(
            f"{what}: the path {shown[:60]!r}...{shown[-40:]!r} ({len(real)} levels, links resolved) is deeper "
            f"than an image may go ({_MAX_DEPTH} levels, {_MAX_REAL_PATH} bytes): the layer is hostile or broken"
        )


def _rmtree_at(dirfd: int, name: str, *, owner: int | None = None) -> None:
    """Remove directory ``name`` of ``dirfd`` and all below it, through fds, following no link.

    With ``owner``, an entry of another uid stops the removal (:class:`PermissionError` naming
    it), left in place: not ours to remove (the image store's trees are all the user's own).

    Without recursion and with two fds open at most, so any depth is removed (a tree too deep for
    paths, or for the fds a process may hold, too).  Going up is by ``..`` of the directory just
    emptied, checked against the inode that was entered from, so a directory moved meanwhile
    stops the removal instead of redirecting it.
    """
    with contextlib.suppress(OSError, NotImplementedError):
        os.chmod(name, 0o700, dir_fd=dirfd, follow_symlinks=False)
    fd = os.open(name, _DIR_FLAGS, dir_fd=dirfd)
    names: list[str] = []  # the path from ``name`` down to ``fd``'s directory
    ids: list[tuple[int, int]] = []  # (st_dev, st_ino) of each directory on that path, ``name`` first
    try:
        st = os.fstat(fd)
        ids.append((st.st_dev, st.st_ino))
        while True:
            child = None
            with os.scandir(fd) as it:
                for entry in it:
                    if owner is not None and entry.stat(follow_symlinks=False).st_uid != owner:
                        where = "/".join([name, *names, entry.name])
                        raise PermissionError(
                            errno.EPERM,
                            f"{where} belongs to uid {entry.stat(follow_symlinks=False).st_uid}, not to uid {owner}: "
                            "left in place, not pytest-boxlite's to remove",
                        )
                    if entry.is_dir(follow_symlinks=False):
                        child = entry.name
                        break
                    os.unlink(entry.name, dir_fd=fd)
            if child is not None:
                with contextlib.suppress(OSError, NotImplementedError):
                    os.chmod(child, 0o700, dir_fd=fd, follow_symlinks=False)
                nfd = os.open(child, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nfd
                st = os.fstat(fd)
                names.append(child)
                ids.append((st.st_dev, st.st_ino))
                continue
            if not names:
                break
            up = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = up
            ids.pop()
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != ids[-1]:
                raise OSError(errno.ESTALE, f"a directory under {name!r} was moved while it was being removed")
            os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dirfd)


def _safe_mode(member: tarfile.TarInfo) -> int:
    """The mode a member gets, as PEP 706's ``data`` filter sets it (no setuid/setgid/sticky, no
    group/other write, owner read+write on files), and ``u+rwx`` on directories, so the tree's
    owner can always remove it."""
    mode = (member.mode or 0) & 0o755
    if member.isdir():
        return mode | 0o700
    if not mode & 0o100:
        mode &= ~0o111
    return mode | 0o600


def _link_target(parent: tuple[str, ...], target: str) -> str:
    """Symlink ``target`` of a member in directory ``parent``, as written into the tree.

    Absolute: relative to ``parent`` (``/usr/bin/x`` at ``bin/sh`` is ``../usr/bin/x``), which
    the box, whose ``/`` is the tree, resolves the same way.  Relative and climbing above the
    top: clamped there, as the kernel clamps ``/..``.  Else literal.
    """
    if target.startswith("/"):
        return "/".join([".."] * len(parent) + _split(target)) or "."
    depth = len(parent)
    for comp in target.split("/"):
        if comp == "..":
            depth -= 1
            if depth < 0:
                return _clamped(parent, target)
        elif comp not in ("", "."):
            depth += 1
    return target


def _clamped(parent: tuple[str, ...], target: str) -> str:
    """``target`` (a link at directory ``parent``) as the box resolves it, written relative to ``parent``.

    ``..`` at the top stays at the top, as in the box, where the tree is ``/``.
    """
    parts: list[str] = [] if target.startswith("/") else list(parent)
    for comp in target.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            if parts:
                parts.pop()
        else:
            parts.append(comp)
    rel = "/".join([".."] * len(parent) + parts)
    return rel or "."


def apply_layer(root: Path, blob: Path, *, diff_id: str | None, limits: Limits, what: str) -> None:
    """Apply layer ``blob`` to ``root``; check its uncompressed digest against ``diff_id`` if given.

    Raises :class:`ImageError` naming ``what`` (the image and layer) and the member at fault.
    """
    tree = _Tree(root)
    dest = os.path.realpath(root)
    created: set[tuple[str, ...]] = set()
    try:
        with open_layer_stream(blob, limits.max_unpacked + (64 << 20), what, limits) as reader:
            reader.counts_in = blob.name not in limits.blobs_seen
            limits.blobs_seen.add(blob.name)
            try:
                with tarfile.open(fileobj=reader, mode="r|", tarinfo=_BoundedTarInfo) as tf:
                    # tf.next(), not iteration: tarfile keeps every TarInfo (PAX headers included)
                    # in tf.members, which a layer of many members with large headers makes
                    # gigabytes; a stream is read once, so each member is dropped once applied.
                    while (member := tf.next()) is not None:
                        _apply_member(tree, tf, member, dest, created, limits, what)
                        tf.members.clear()  # type: ignore[attr-defined]  # (not in typeshed)
                reader.drain()
            except tarfile.TarError as exc:
                raise ImageError(
                    f"{what}: the layer is not a valid tar archive ({exc}); is the image truncated or corrupt?"
                ) from None
            except (EOFError, gzip.BadGzipFile, OSError) as exc:
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise ImageError(f"{what}: no space left to unpack the image under {root}") from None
                raise ImageError(f"{what}: cannot read the layer ({exc}); is the image truncated or corrupt?") from None
            limits.blob_in += reader.blob_in if reader.counts_in else 0
            limits.stream_out += reader.count
            if diff_id is not None and f"sha256:{reader.sha.hexdigest()}" != diff_id:
                raise ImageError(
                    f"{what}: the layer's content does not match the image config's diff_id {diff_id} "
                    f"(got sha256:{reader.sha.hexdigest()}): the image is corrupt; rebuild or re-save it"
                )
    finally:
        tree.close()


def _apply_member(
    tree: _Tree,
    tf: tarfile.TarFile,
    member: tarfile.TarInfo,
    dest: str,
    created: set[tuple[str, ...]],
    limits: Limits,
    what: str,
) -> None:
    limits.members += 1
    if limits.members > limits.max_members:
        raise ImageError(f"{what}: more than {limits.max_members} members in the image (its member bound)")
    name = member.name
    if len(name) > _MAX_NAME or len(member.linkname) > _MAX_NAME or "\0" in name:
        raise ImageError(f"{what}: member name {name[:80]!r}... is longer than {_MAX_NAME} characters")
    parts = _split(name)
    if ".." in parts:
        raise ImageError(f"{what}: member {name!r} leaves the image's root ('..'): the layer is hostile or broken")
    if not parts:
        return  # the root itself: its mode stays the store's
    if member.ischr() or member.isblk() or member.isfifo():
        limits.skipped_special += 1  # a box gets its own /dev; nodes in an image are never made
        return
    base = parts[-1]
    if base.startswith(_WH):
        _whiteout(tree, parts, created, what)
        return
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        limits.skipped_special += 1
        return
    checked = copy.copy(member)
    checked.mode = _safe_mode(member)
    checked.uid = checked.gid = 0  # never used: nothing is chowned
    if member.issym():
        checked.linkname = _link_target(tuple(parts[:-1]), member.linkname)
    if _DATA_FILTER is not None:
        # PEP 706's own checks as well, where this Python has them (3.11.4+, 3.12+).
        try:
            try:
                _DATA_FILTER(checked, dest)
            except tarfile.LinkOutsideDestinationError:
                if not checked.issym():
                    raise
                # Through links planted earlier, the host would resolve it outside (the box
                # would not: its / stops '..'): written lexically resolved instead.
                checked.linkname = _clamped(tuple(parts[:-1]), checked.linkname)
                _DATA_FILTER(checked, dest)
        except tarfile.FilterError as exc:
            raise ImageError(f"{what}: member {name!r} refused: {exc}") from None
    found = tree.resolve_dir(parts[:-1], create=True, what=what)
    assert found is not None
    dirfd, real_parent = found
    try:
        _check_depth((*real_parent, base), what)
        _write_member(tree, tf, member, checked, dirfd, real_parent, created, limits, what)
    finally:
        os.close(dirfd)


def _write_member(
    tree: _Tree,
    tf: tarfile.TarFile,
    member: tarfile.TarInfo,
    checked: tarfile.TarInfo,
    dirfd: int,
    real_parent: tuple[str, ...],
    created: set[tuple[str, ...]],
    limits: Limits,
    what: str,
) -> None:
    base = _split(member.name)[-1]
    key = (*real_parent, base)
    created.add(key)
    if checked.isdir():
        mode = checked.mode
        try:
            st = os.stat(base, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            tree.remove(dirfd, base)
            st = None
        if st is None:
            os.mkdir(base, 0o700, dir_fd=dirfd)
        os.chmod(base, mode, dir_fd=dirfd, follow_symlinks=False)
        return
    tree.remove(dirfd, base)
    if checked.issym():
        os.symlink(checked.linkname, base, dir_fd=dirfd)
        tree.forget()
    elif checked.islnk():
        _hardlink(tree, dirfd, real_parent, base, checked, what)
    else:
        limits.unpacked += checked.size
        if limits.unpacked > limits.max_unpacked:
            raise ImageError(f"{what}: the image unpacks to more than {limits.max_unpacked} bytes ({limits.size_hint})")
        mode = checked.mode
        fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dirfd)
        try:
            src = tf.extractfile(member)
            assert src is not None
            with os.fdopen(fd, "wb", closefd=False) as out:
                shutil.copyfileobj(src, out, _CHUNK)
            os.fchmod(fd, mode)
            with contextlib.suppress(OverflowError, ValueError, OSError):
                os.utime(fd, (member.mtime, member.mtime))
        finally:
            os.close(fd)


def _hardlink(
    tree: _Tree, dirfd: int, real_parent: tuple[str, ...], base: str, member: tarfile.TarInfo, what: str
) -> None:
    target = _split(member.linkname)
    if not target or ".." in target:
        raise ImageError(f"{what}: hard link {member.name!r} -> {member.linkname!r} points outside the image")
    found = tree.resolve_dir(target[:-1], create=False, what=what)
    if found is None:
        raise ImageError(f"{what}: hard link {member.name!r} names {member.linkname!r}, which is not in the image")
    srcfd, src_parent = found
    try:
        try:
            st = os.stat(target[-1], dir_fd=srcfd, follow_symlinks=False)
        except FileNotFoundError:
            raise ImageError(
                f"{what}: hard link {member.name!r} names {member.linkname!r}, which is not in the image"
            ) from None
        if stat.S_ISDIR(st.st_mode):
            raise ImageError(f"{what}: hard link {member.name!r} names directory {member.linkname!r}")
        if stat.S_ISLNK(st.st_mode):
            # A hard link to a symlink is a second name of it, and its relative target is written
            # for its own directory: from another one it could leave the tree.  A new symlink with
            # the same (box-absolute) target, written for this directory, instead.
            linked = os.readlink(target[-1], dir_fd=srcfd)
            absolute = _clamped((), "/".join([*src_parent, linked]) if not linked.startswith("/") else linked)
            os.symlink(_link_target(real_parent, "/" + absolute), base, dir_fd=dirfd)
            tree.forget()
            return
        os.link(target[-1], base, src_dir_fd=srcfd, dst_dir_fd=dirfd, follow_symlinks=False)
    finally:
        os.close(srcfd)


def _whiteout(tree: _Tree, parts: list[str], created: set[tuple[str, ...]], what: str) -> None:
    found = tree.resolve_dir(parts[:-1], create=False, what=what)
    if found is None:
        return  # nothing below to hide
    dirfd, real_parent = found
    try:
        base = parts[-1]
        if base == _OPAQUE:
            # Empty the directory of lower layers' entries; this layer's own stay.
            for entry in os.listdir(dirfd):
                if (*real_parent, entry) not in created:
                    tree.remove(dirfd, entry)
            return
        victim = base[len(_WH) :]
        if victim in ("", ".", "..") or (*real_parent, victim) in created:
            return
        tree.remove(dirfd, victim)
    finally:
        os.close(dirfd)


def tree_size(root: Path) -> int:
    """Bytes on disk of the tree at ``root`` (each inode once; links never followed; no recursion).

    By path: what lies deeper than a path can name is not counted (the unpacker bounds depth).
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    todo = [os.fspath(root)]
    while todo:
        try:
            it = os.scandir(todo.pop())
        except OSError:
            continue
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    todo.append(entry.path)
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
                total += st.st_blocks * 512
    return total
