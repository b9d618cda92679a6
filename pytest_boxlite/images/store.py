"""The image store: one per user (``<home>/image-store``), shared by every session, worker and runtime.

How it works, and why: ``docs/explanation/internals/image-store.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pytest_boxlite._homefs import HomeDir, Refused
from pytest_boxlite.images import layout, pull
from pytest_boxlite.images.reference import ImageError, Reference, parse_reference
from pytest_boxlite.images.unpack import (
    DEFAULT_MAX_RATIO,
    DEFAULT_MAX_UNPACKED,
    RATIO_FLOOR,
    Limits,
    _rmtree_at,
    apply_layer,
    tree_size,
)

__all__ = [
    "DEFAULT_EXPIRY_DAYS",
    "DEFAULT_MAX_STORE",
    "EXPIRY_ENV",
    "MAX_IMAGE_ENV",
    "MAX_RATIO_ENV",
    "MAX_STORE_ENV",
    "Bounds",
    "Image",
    "ImageConfig",
    "StoredImage",
    "drop_images",
    "ensure_image",
    "list_images",
    "release_images",
    "store_dir",
]

STORE_NAME = "image-store"
_MAX_META = 4 << 20
#: Bytes on disk the whole store may keep (blobs and unpacked trees): two or three of the largest
#: images, dozens of ordinary ones.
DEFAULT_MAX_STORE = 20 << 30
#: An image no session used for this long is evicted (a CI machine's store does not grow forever).
DEFAULT_EXPIRY_DAYS = 30.0
MAX_IMAGE_ENV = "PYTEST_BOXLITE_IMAGE_MAX_SIZE"
MAX_STORE_ENV = "PYTEST_BOXLITE_IMAGE_STORE_MAX_SIZE"
MAX_RATIO_ENV = "PYTEST_BOXLITE_IMAGE_MAX_RATIO"
EXPIRY_ENV = "PYTEST_BOXLITE_IMAGE_EXPIRY_DAYS"
#: How often (seconds) a use of a known image also expires old ones (a slow path always does).
_SWEEP_EVERY = 3600.0
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def _size(name: str, text: str) -> int:
    m = _SIZE.match(text)
    if m is None or float(m.group(1)) <= 0:
        raise ImageError(f"{name}={text!r} is not a size: write bytes, or a number with K, M, G or T (e.g. 16G)")
    return int(float(m.group(1)) * (1 << (10 * " kmgt".index(m.group(2).lower() or " "))))


def _number(name: str, text: str, *, zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or (value == 0 and not zero) or value == float("inf"):
        raise ImageError(f"{name}={text!r} is not a {'non-negative' if zero else 'positive'} number")
    return value


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What images may cost: per image (file data unpacked), the compression ratio (tar stream
    per byte of layer blob, per layer and per image; never below :data:`RATIO_FLOOR`), the whole
    store (bytes on disk), and the days an unused image is kept (0: until the store is full)."""

    max_image: int = DEFAULT_MAX_UNPACKED
    max_store: int = DEFAULT_MAX_STORE
    max_ratio: float = DEFAULT_MAX_RATIO
    expiry_days: float = DEFAULT_EXPIRY_DAYS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Bounds:
        """The defaults, each overridden by its environment variable where set (a bad value: an
        :class:`ImageError` naming the variable)."""
        env = os.environ if environ is None else environ
        out = cls()
        if env.get(MAX_IMAGE_ENV):
            out = dataclasses.replace(out, max_image=_size(MAX_IMAGE_ENV, env[MAX_IMAGE_ENV]))
        if env.get(MAX_STORE_ENV):
            out = dataclasses.replace(out, max_store=_size(MAX_STORE_ENV, env[MAX_STORE_ENV]))
        if env.get(MAX_RATIO_ENV):
            out = dataclasses.replace(out, max_ratio=_number(MAX_RATIO_ENV, env[MAX_RATIO_ENV], zero=False))
        if env.get(EXPIRY_ENV):
            out = dataclasses.replace(out, expiry_days=_number(EXPIRY_ENV, env[EXPIRY_ENV], zero=True))
        return out


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """What an image's config says about running it (``config.Env`` split at the first ``=``)."""

    env: tuple[tuple[str, str], ...] = ()
    workdir: str | None = None
    user: str | None = None
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Image:
    """An image ready for boxes: ``rootfs`` is complete and must be treated as read-only."""

    reference: str
    digest: str
    rootfs: Path
    config: ImageConfig
    size: int


@dataclasses.dataclass(frozen=True)
class StoredImage:
    """One unpacked image in the store, as ``ls --images`` shows it."""

    digest: str
    references: tuple[str, ...]
    rootfs: Path
    size: int
    created: float


def store_dir(home: Path) -> Path:
    """The image store of boxlite home ``home`` (not ``<home>/images``: that is BoxLite's own blob store)."""
    return Path(home) / STORE_NAME


#: A config's strings reach execve(2) as arguments and environment: each is at most
#: MAX_ARG_STRLEN (32 pages, its NUL included), and all together far below ARG_MAX (2 MiB here).
_MAX_EXEC_STRING = (32 << 12) - 1
_MAX_EXEC_TOTAL = 1 << 20


def _strings(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ImageError(f"{what} is not a list of strings; the image config is malformed")
    for v in value:
        _exec_string(v, what)
    return tuple(value)


def _exec_string(value: str, what: str) -> None:
    """Refuse a string no process can be given (the kernel would refuse it, far from its cause)."""
    if "\0" in value:
        raise ImageError(f"{what}: {value[:40]!r}... holds a NUL byte, which no command line or environment can")
    if len(value.encode("utf-8", "surrogateescape")) > _MAX_EXEC_STRING:
        raise ImageError(
            f"{what}: a string of {len(value)} characters, more than the {_MAX_EXEC_STRING} bytes the kernel "
            "passes to a process"
        )


def parse_config(data: bytes, what: str) -> ImageConfig:
    """The :class:`ImageConfig` of an OCI/docker image config document."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ImageError(f"{what}: the config is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ImageError(f"{what}: the config is not a JSON object")
    cfg = doc.get("config") or {}
    if not isinstance(cfg, dict):
        raise ImageError(f"{what}: config.config is not an object")
    env = []
    for item in _strings(cfg.get("Env"), f"{what}: config Env"):
        key, sep, value = item.partition("=")
        if key and sep:
            env.append((key, value))
    workdir: Any = cfg.get("WorkingDir") or None
    user: Any = cfg.get("User") or None
    for name, value in (("WorkingDir", workdir), ("User", user)):
        if value is not None and not isinstance(value, str):
            raise ImageError(f"{what}: config {name} is not a string")
        if value is not None:
            _exec_string(value, f"{what}: config {name}")
    out = ImageConfig(
        env=tuple(env),
        workdir=workdir,
        user=user,
        entrypoint=_strings(cfg.get("Entrypoint"), f"{what}: config Entrypoint"),
        cmd=_strings(cfg.get("Cmd"), f"{what}: config Cmd"),
    )
    total = sum(len(k) + len(v) + 2 for k, v in out.env) + sum(len(a) + 1 for a in out.entrypoint + out.cmd)
    if total > _MAX_EXEC_TOTAL:
        raise ImageError(
            f"{what}: the config's Env, Entrypoint and Cmd hold {total} bytes, more than the {_MAX_EXEC_TOTAL} "
            "a box's commands can be given; the image config is malformed"
        )
    return out


def _config_dict(c: ImageConfig) -> dict[str, Any]:
    return {
        "env": [list(kv) for kv in c.env],
        "workdir": c.workdir,
        "user": c.user,
        "entrypoint": list(c.entrypoint),
        "cmd": list(c.cmd),
    }


def _config_from(d: dict[str, Any]) -> ImageConfig:
    return ImageConfig(
        env=tuple((str(k), str(v)) for k, v in d.get("env", [])),
        workdir=d.get("workdir"),
        user=d.get("user"),
        entrypoint=tuple(d.get("entrypoint", [])),
        cmd=tuple(d.get("cmd", [])),
    )


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None  # not a record of ours: ignored, as a missing one
        data = f.read(_MAX_META + 1)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _source_key(ref: Reference) -> str | None:
    """What identifies the image ``ref`` names now: its file's identity, or the registry name."""
    if ref.transport == "docker":
        return f"docker:{ref.registry_ref()}"
    assert ref.path is not None
    path = Path(ref.path).expanduser()
    probe = path / "index.json" if ref.transport == "oci" else path
    try:
        st = os.stat(probe)
        real = os.path.realpath(path)
    except OSError:
        return None  # missing: the slow path says so
    return (
        f"{ref.transport}:{real}:{ref.tag or ''}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    )


def _ref_name(key: str) -> str:
    return f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.json"


# -- the store on disk: opened through no link, every directory of ours -----------------------------

#: The store's directories, each checked (a real directory of this user's) before any use.
_SUBDIRS = ("blobs", "blobs/sha256", "rootfs", "meta", "refs", "tmp", "uses")
_HEX = re.compile(r"^[0-9a-f]{64}$")


class _Store:
    """An open image store: a descriptor of its directory (checked: ours, writable by no one
    else, reached through no link) and the paths below it, which go through that descriptor."""

    def __init__(self, path: Path, top: HomeDir) -> None:
        self.path = path
        self.dir = top
        pinned = Path(f"/proc/self/fd/{top.fd}")
        # Through /proc: the directory just checked, whatever is renamed or linked above it later.
        self.base = pinned if os.path.isdir(pinned) else path

    def p(self, *parts: str) -> Path:
        """A path below the store, for calls that take paths (through the store's descriptor)."""
        return self.base.joinpath(*parts)

    def shown(self, *parts: str) -> Path:
        """The same path as the caller named the store (for messages and for :class:`Image`)."""
        return self.path.joinpath(*parts)

    def sub(self, rel: str) -> HomeDir:
        try:
            return self.dir.sub(rel)
        except Refused as exc:
            raise _refused(self.path, exc) from None

    def is_tree(self, hexd: str) -> bool:
        """Whether ``rootfs/<hexd>`` is a directory of ours (a link there is not an image)."""
        try:
            st = self.dir.stat(f"rootfs/{hexd}")
        except (OSError, Refused):
            return False
        return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()

    def close(self) -> None:
        self.dir.close()

    def __enter__(self) -> _Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refused(store: Path, exc: Refused) -> ImageError:
    return ImageError(
        f"image store {store}: {exc}. It is not pytest-boxlite's to use or remove: remove it yourself if "
        "it is yours, or name a home of your own with --boxlite-home (python -m pytest_boxlite: --home)"
    )


def _open_home(home: Path) -> HomeDir:
    try:
        return HomeDir.open(home)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
    # The home itself named through a link (a --boxlite-home of a link to a disk): its target,
    # which must be ours as well.  Links below it are never followed.
    return HomeDir.open(os.path.realpath(home))


def _open_store(store: Path, *, create: bool) -> _Store | None:
    """The store at ``store`` checked and open (made with ``create``); ``None`` where there is none.

    Raises :class:`ImageError` naming what was refused: a link or another user's entry where a
    directory of ours is expected, a store others may write.
    """
    store = Path(os.path.abspath(store))
    if create:
        os.makedirs(store.parent, mode=0o700, exist_ok=True)
    try:
        home = _open_home(store.parent)
    except FileNotFoundError:
        return None
    except Refused as exc:
        raise _refused(store, exc) from None
    try:
        with home:
            if not create and not home.exists(store.name):
                return None
            top = home.sub(store.name, create=create)
    except Refused as exc:
        raise _refused(store, exc) from None
    try:
        mode = os.fstat(top.fd).st_mode
        if mode & 0o022:
            raise ImageError(
                f"image store {store} is writable by others (mode {stat.filemode(mode)}): anyone could plant "
                f"links or images in it. Fix: chmod go-w {store}, or clean --images and let it be made again"
            )
        for sub in (*_SUBDIRS, "vm-layouts"):  # vm-layouts: the vm runtime's, made on its first use
            if (create and sub in _SUBDIRS) or top.exists(sub):
                top.sub(sub, create=create and sub in _SUBDIRS).close()
    except Refused as exc:
        top.close()
        raise _refused(store, exc) from None
    except BaseException:
        top.close()
        raise
    return _Store(store, top)


def _image_from_meta(st: _Store, reference: str, hexd: str) -> Image | None:
    if not _HEX.match(hexd):
        return None
    meta = _read_json(st.p("meta", f"{hexd}.json"))
    if meta is None or not st.is_tree(hexd):
        return None
    try:
        return Image(
            reference, f"sha256:{hexd}", st.shown("rootfs", hexd), _config_from(meta["config"]), int(meta["size"])
        )
    except (KeyError, TypeError, ValueError):
        return None


@contextlib.contextmanager
def _locked(st: _Store, timeout: float, what: str, *, wait: bool = True) -> Iterator[bool]:
    """Hold the store's writer lock (yields ``False`` at once, not holding it, where ``wait`` is
    off and another holds it)."""
    try:
        fd = st.dir.open_file("lock", os.O_RDWR | os.O_CREAT, 0o600)
    except Refused as exc:
        raise _refused(st.path, exc) from None
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not wait:
                    yield False
                    return
                if time.monotonic() > deadline:
                    raise ImageError(
                        f"{what}: the image store {st.path} stayed locked for {timeout:.0f} s (another session "
                        "unpacking or pulling a large image?); try again, or raise the timeout"
                    ) from None
                time.sleep(0.05)
        yield True
    finally:
        os.close(fd)  # releases the lock


def _remove_in(d: HomeDir, name: str) -> None:
    """Remove ``name`` of directory ``d`` (a tree of any depth too), by descriptors, following no
    link; an entry of another user in it stops the removal (``PermissionError``), left in place."""
    try:
        st = os.stat(name, dir_fd=d.fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid():
        raise PermissionError(errno.EPERM, f"{name} belongs to uid {st.st_uid}: left in place, not ours to remove")
    if stat.S_ISDIR(st.st_mode):
        _rmtree_at(d.fd, name, owner=os.geteuid())
    else:
        os.unlink(name, dir_fd=d.fd)


def _rmtree(path: Path) -> None:
    """Remove ``path`` (a whole tree too, of any depth: no recursion), following no link below it."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _rmtree_at(parent, path.name)
    finally:
        os.close(parent)


def _clear_tmp(st: _Store) -> None:
    """Remove what writers that died left in ``tmp/`` (none other runs while the lock is held);
    a link or another user's entry there is refused, not followed nor removed."""
    with st.sub("tmp") as tmp:
        for entry in tmp.entries():
            if entry.refused is not None:
                raise ImageError(
                    f"image store {st.path}: tmp/{entry.name} is refused ({entry.refused}): pytest-boxlite never "
                    "follows nor removes what is not its own in a home. Remove it yourself if it is yours, or "
                    "name a home of your own with --boxlite-home"
                )
            try:
                _remove_in(tmp, entry.name)
            except PermissionError as exc:
                raise ImageError(
                    f"image store {st.path}: in tmp/, {exc.strerror}. Remove it yourself if it is yours, or name "
                    "a home of your own with --boxlite-home"
                ) from None


# -- uses: who holds an image, and when it was last used -------------------------------------------

#: The ``uses/<hex>`` descriptors this process holds (flock LOCK_SH) for the images it uses: held
#: until :func:`release_images` or the process ends, so no other session evicts them meanwhile.
_HELD: dict[tuple[int, int, str], int] = {}
_HELD_LOCK = threading.Lock()


def _store_id(st: _Store) -> tuple[int, int]:
    s = os.fstat(st.dir.fd)
    return s.st_dev, s.st_ino


def _use(st: _Store, hexd: str, *, wait: bool) -> bool:
    """Record a use of image ``hexd`` (its ``uses`` file's mtime) and hold it for this process.

    ``False`` where it cannot be held now (an evictor has it: ``wait`` off) or it is gone.
    """
    key = (*_store_id(st), hexd)
    with _HELD_LOCK:
        fd = _HELD.get(key)
        if fd is not None:
            try:
                same = os.fstat(fd).st_ino == st.dir.stat(f"uses/{hexd}").st_ino
            except (OSError, Refused):
                same = False
            if same and st.is_tree(hexd):
                os.utime(fd)
                return True
            del _HELD[key]
            os.close(fd)  # an image evicted meanwhile (clean --images): held again below
        try:
            fd = st.dir.open_file(f"uses/{hexd}", os.O_RDWR | os.O_CREAT, 0o600)
        except Refused as exc:
            raise _refused(st.path, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | (0 if wait else fcntl.LOCK_NB))
            # Evicted between the open and the lock: the file is another (or none) and the tree gone.
            if os.fstat(fd).st_ino != st.dir.stat(f"uses/{hexd}").st_ino or not st.is_tree(hexd):
                os.close(fd)
                return False
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        os.utime(fd)
        _HELD[key] = fd
        return True


def release_images() -> None:
    """Let go of every image this process holds (they may be evicted again); for tests and
    long-lived processes that are done with their images."""
    with _HELD_LOCK:
        for fd in _HELD.values():
            os.close(fd)
        _HELD.clear()


@dataclasses.dataclass
class _Entry:
    hexd: str
    size: int
    last_use: float
    blobs: set[str] | None  # None: not known (a store of an older version): its blobs stay


def _entries(st: _Store) -> list[_Entry]:
    """Every complete image of the store, least recently used first."""
    out = []
    with st.sub("meta") as meta_dir:
        names = [e.name for e in meta_dir.entries() if e.is_file and e.refused is None]
    for name in names:
        hexd = name.removesuffix(".json")
        if not _HEX.match(hexd):
            continue
        meta = _read_json(st.p("meta", name))
        if meta is None or not st.is_tree(hexd):
            continue
        try:
            last = st.dir.stat(f"uses/{hexd}").st_mtime
        except (OSError, Refused):
            last = float(meta.get("created", 0.0)) if isinstance(meta.get("created"), int | float) else 0.0
        blobs = meta.get("blobs")
        known = {b for b in blobs if isinstance(b, str)} if isinstance(blobs, list) else _manifest_blobs(st, hexd)
        size = meta.get("size")
        out.append(_Entry(hexd, int(size) if isinstance(size, int) else 0, last, known))
    out.sort(key=lambda e: e.last_use)
    return out


def _manifest_blobs(st: _Store, hexd: str) -> set[str] | None:
    """The blobs manifest ``hexd`` names (for metas written before they were recorded)."""
    doc = _read_json(st.p("blobs", "sha256", hexd))
    if doc is None:
        return None
    try:
        out = {hexd, str(doc["config"]["digest"]).removeprefix("sha256:")}
        out.update(str(d["digest"]).removeprefix("sha256:") for d in doc["layers"])
    except (KeyError, TypeError):
        return None
    return out


def _blob_bytes(st: _Store) -> dict[str, int]:
    out = {}
    with st.sub("blobs/sha256") as bdir:
        for e in bdir.entries():
            if e.is_file and e.refused is None:
                with contextlib.suppress(OSError):
                    out[e.name] = os.stat(e.name, dir_fd=bdir.fd, follow_symlinks=False).st_blocks * 512
    return out


def _usage(st: _Store, entries: list[_Entry]) -> int:
    return sum(_blob_bytes(st).values()) + sum(e.size for e in entries)


def _try_evict(st: _Store, entry: _Entry) -> bool:
    """Evict image ``entry`` unless a live process holds it; under the store's lock."""
    try:
        fd = st.dir.open_file(f"uses/{entry.hexd}", os.O_RDWR | os.O_CREAT, 0o600)
    except Refused as exc:
        raise _refused(st.path, exc) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # in use by a live session: never evicted
        # The tree first: a reader finding the meta without it takes the slow path.
        with st.sub("rootfs") as d:
            try:
                _remove_in(d, entry.hexd)
            except PermissionError as exc:
                raise ImageError(
                    f"image store {st.path}: evicting sha256:{entry.hexd[:12]}: in rootfs/, {exc.strerror}. Remove "
                    "it yourself if it is yours, or name a home of your own with --boxlite-home"
                ) from None
        with st.sub("meta") as d:
            _remove_in(d, f"{entry.hexd}.json")
        with st.sub("refs") as d:
            for e in d.entries():
                if e.is_file and e.refused is None:
                    ref = _read_json(st.p("refs", e.name))
                    if ref is None or ref.get("digest") == entry.hexd:
                        _remove_in(d, e.name)
        if st.dir.exists("vm-layouts"):
            with st.sub("vm-layouts") as d:
                _remove_in(d, entry.hexd)
        with st.sub("uses") as d:
            _remove_in(d, entry.hexd)
        return True
    finally:
        os.close(fd)


def _collect_blobs(st: _Store) -> None:
    """Remove the blobs no image left in the store names (none, where an image's are unknown)."""
    entries = _entries(st)
    keep: set[str] = set()
    for e in entries:
        if e.blobs is None:
            return
        keep |= e.blobs
    with st.sub("blobs/sha256") as bdir:
        for name in _blob_bytes(st):
            if name not in keep:
                _remove_in(bdir, name)


def _evict(st: _Store, bounds: Bounds, *, room: int = 0, keep: str | None = None) -> int:
    """Evict expired images, then the least recently used ones, until ``room`` more bytes fit in
    the store's bound; never an image a live process holds, nor ``keep``.  Under the store's lock.
    Returns the bytes the store keeps now."""
    entries = _entries(st)
    now = time.time()
    evicted = False
    for e in list(entries):
        if (
            e.hexd != keep
            and bounds.expiry_days
            and now - e.last_use > bounds.expiry_days * 86400
            and _try_evict(st, e)
        ):
            entries.remove(e)
            evicted = True
    if evicted:
        _collect_blobs(st)
    used = _usage(st, entries)
    for e in list(entries):
        if used + room <= bounds.max_store:
            break
        if e.hexd != keep and _try_evict(st, e):
            entries.remove(e)
            _collect_blobs(st)
            used = _usage(st, entries)
    return used


def _sweep(st: _Store, bounds: Bounds, what: str) -> None:
    """Expire images at most every :data:`_SWEEP_EVERY` seconds, where no writer holds the store."""
    try:
        if time.time() - st.dir.stat("swept").st_mtime < _SWEEP_EVERY:
            return
    except (OSError, Refused):
        pass
    with _locked(st, 0.0, what, wait=False) as got:
        if got:
            _evict(st, bounds)
            st.dir.write("swept", b"")


def ensure_image(
    ref: str,
    *,
    store: Path,
    timeout: float = 600.0,
    max_unpacked: int | None = None,
    bounds: Bounds | None = None,
) -> Image:
    """The image ``ref`` names, unpacked in ``store`` (pulled or read, verified and unpacked once).

    Safe under concurrent callers (xdist workers, several sessions): work happens under the
    store's lock, in a temporary directory renamed into place when complete.  The image is held
    for this process (never evicted while it lives; :func:`release_images`).  ``bounds`` (default
    :meth:`Bounds.from_env`; ``max_unpacked`` overrides its per-image bound) is what it and the
    store may cost.  Raises :class:`ImageError` naming the image, the cause and the fix.
    """
    parsed = parse_reference(ref)
    bounds = bounds or Bounds.from_env()
    if max_unpacked is not None:
        bounds = dataclasses.replace(bounds, max_image=max_unpacked)
    what = f"image {ref!r}"
    key = _source_key(parsed)
    st = _open_store(Path(store), create=True)
    assert st is not None
    with st:
        if key is not None:
            known = _read_json(st.p("refs", _ref_name(key)))
            if known is not None and isinstance(known.get("digest"), str):
                image = _image_from_meta(st, ref, known["digest"])
                if image is not None and _use(st, known["digest"], wait=False):
                    _sweep(st, bounds, what)
                    return image
        deadline = time.monotonic() + timeout
        with _locked(st, timeout, what):
            _clear_tmp(st)
            # Not TemporaryDirectory: its cleanup is a recursive rmtree, which a deep tree defeats.
            work = Path(tempfile.mkdtemp(prefix="work-", dir=st.p("tmp")))
            try:
                image = _ensure_locked(parsed, st, work, deadline, bounds)
            finally:
                with st.sub("tmp") as tmp:
                    _remove_in(tmp, work.name)
            if key is not None:
                _write_json(st.p("refs", _ref_name(key)), {"key": key, "reference": ref, "digest": image.digest[7:]})
            hexd = image.digest[7:]
            _use(st, hexd, wait=True)
            # Within the bound again, now that the tree's size on disk is known.
            _evict(st, bounds, keep=hexd)
            st.dir.write("swept", b"")
        return image


def _ensure_locked(ref: Reference, st: _Store, work: Path, deadline: float, bounds: Bounds) -> Image:
    what = f"image {ref.original!r}"
    blobdir = st.p("blobs", "sha256")
    max_unpacked = bounds.max_image
    # Blobs of this image are copied here first, and join blobs/ only once the image is unpacked:
    # an image refused (too big, corrupt, hostile) leaves nothing in the store.
    staged = work / "blobs"
    staged.mkdir()
    if ref.transport == "docker":
        # A path other processes can use (skopeo): the store's own, as the kernel names its descriptor.
        real = Path(os.readlink(st.base)) / "tmp" / work.name if st.base != st.path else work
        pulled = pull.pull(ref, real, timeout=max(1.0, deadline - time.monotonic()))
        if pulled.layout_dir is not None:
            where = str(pulled.layout_dir)
            local = Reference(f"oci:{where}:{pull.PULL_TAG}", "oci", path=where, tag=pull.PULL_TAG)
            src = layout.open_source(local)
            try:
                resolved = layout.resolve_oci(src, local)
                _import_blobs(src, resolved, st, staged, work, bounds, what)
            finally:
                src.close()
        else:
            resolved = pulled.resolved
            _import_blobs(pulled.source, resolved, st, staged, work, bounds, what)
    else:
        src = layout.open_source(ref)
        try:
            if ref.transport == "docker-archive":
                assert isinstance(src, layout._TarSource)
                resolved = layout.resolve_docker_archive(
                    src,
                    ref,
                    work,
                    staged,
                    check_sizes=lambda sizes: _make_room(st, sizes, sizes, bounds, what),
                )
            else:
                resolved = layout.resolve_oci(src, ref)
                hexd = resolved.digest[7:]
                if not _image_from_meta(st, ref.original, hexd):
                    _import_blobs(src, resolved, st, staged, work, bounds, what)
        finally:
            src.close()
    hexd = resolved.digest.removeprefix("sha256:")
    for name, data in ((hexd, resolved.manifest), (resolved.config_digest[7:], resolved.config)):
        if not (blobdir / name).exists():
            _write_blob(staged / name, data, work)
    existing = _image_from_meta(st, ref.original, hexd)
    if existing is not None:
        _promote(staged, blobdir)
        _add_reference(st, hexd, ref.original)
        return existing
    config = parse_config(resolved.config, what)
    rootfs = st.p("rootfs", hexd)
    if not st.is_tree(hexd):
        staged_bytes = sum(os.lstat(staged / n).st_blocks * 512 for n in os.listdir(staged))
        used = _usage(st, _entries(st))
        left = bounds.max_store - used - staged_bytes
        limits = Limits(
            max_unpacked=min(max_unpacked, max(left, 0)),
            max_ratio=bounds.max_ratio,
            size_hint=(
                f"the per-image bound; raise it with {MAX_IMAGE_ENV}=<size, e.g. 16G>"
                if max_unpacked <= left
                else f"what the image store's bound of {bounds.max_store} bytes leaves: images in use by live "
                f"sessions keep {used} bytes; raise it with {MAX_STORE_ENV}=<size, e.g. 40G>, or end those sessions"
            ),
            ratio_hint=f"raise the ratio bound with {MAX_RATIO_ENV}=<ratio, e.g. 1000> if the image is yours",
        )
        _unpack(resolved, (staged, blobdir), work, rootfs, deadline, limits, what)
    _promote(staged, blobdir)
    size = tree_size(rootfs)
    meta = {
        "config": _config_dict(config),
        "size": size,
        "references": [ref.original],
        "created": time.time(),
        "layers": [h for h, _ in resolved.layers],
        "blobs": sorted({hexd, resolved.config_digest[7:], *(h for h, _ in resolved.layers)}),
    }
    _write_json(st.p("meta", f"{hexd}.json"), meta)
    return Image(ref.original, resolved.digest, st.shown("rootfs", hexd), config, size)


#: What a layer blob may hold beyond the file data it unpacks to (tar headers and padding,
#: compression's own overhead): the same slack the unpacker allows a layer's tar stream.
_LAYER_SLACK = 64 << 20
#: More layers than any builder writes (overlayfs stacks at most ~128; docker refuses more than 125).
MAX_LAYERS = 1000


def layers_bound(max_unpacked: int, layers: int) -> int:
    """The most bytes of layer blobs an image of ``layers`` layers may have, when it may unpack to
    ``max_unpacked`` bytes: compressed, a layer is no larger than its tar, whose file data counts
    against ``max_unpacked``, plus :data:`_LAYER_SLACK` for headers and compression overhead."""
    return max_unpacked + layers * _LAYER_SLACK


def _check_layers(sizes: list[int], max_unpacked: int, what: str) -> None:
    """Refuse an image whose layer blobs could not unpack within the bound, before copying any."""
    if len(sizes) > MAX_LAYERS:
        raise ImageError(f"{what}: the image has {len(sizes)} layers, more than the {MAX_LAYERS} allowed")
    bound = layers_bound(max_unpacked, len(sizes))
    if sum(sizes) > bound:
        raise ImageError(
            f"{what}: its layers are {sum(sizes)} bytes, more than an image bounded to {max_unpacked} bytes "
            f"unpacked can need ({bound}): the image is too big or its descriptors lie (raise the per-image "
            f"bound with {MAX_IMAGE_ENV}=<size, e.g. 16G> if it is yours)"
        )


def _make_room(st: _Store, sizes: list[int], new: list[int], bounds: Bounds, what: str) -> None:
    """Before any blob of an image is copied: its sizes pass the per-image bound, and the store
    makes room (evicting) for its new blobs (``new``) and the most all its layers (``sizes``) may
    unpack to; refused where images in use leave too little for the blobs alone."""
    _check_layers(sizes, bounds.max_image, what)
    worst = min(bounds.max_image, max(int(bounds.max_ratio * sum(sizes)), RATIO_FLOOR))
    used = _evict(st, bounds, room=sum(new) + worst)
    if used + sum(new) > bounds.max_store:
        raise ImageError(
            f"{what}: its new layers ({sum(new)} bytes) do not fit in the image store's bound of "
            f"{bounds.max_store} bytes: images in use by live sessions keep {used} bytes. Raise the bound with "
            f"{MAX_STORE_ENV}=<size, e.g. 40G>, or end those sessions (clean --images empties the store)"
        )


def _write_blob(path: Path, data: bytes, work: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix="blob-", dir=work)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o444)
    os.replace(tmp, path)


def _import_blobs(
    src: Any, resolved: layout.Resolved, st: _Store, staged: Path, work: Path, bounds: Bounds, what: str
) -> None:
    """Copy the layers the store lacks into ``staged`` (verified), once their sizes pass the bounds."""
    blobdir = st.p("blobs", "sha256")
    sizes = [size for _, size in resolved.layers]
    new = [size for hexd, size in resolved.layers if not (blobdir / hexd).exists()]
    _make_room(st, sizes, new, bounds, what)
    for n, (hexd, size) in enumerate(resolved.layers, 1):
        if (blobdir / hexd).exists() or (staged / hexd).exists():
            continue  # stored once: verified when it was written
        src.copy_blob(hexd, size, staged / hexd, work, f"{what}: layer {n}")


def _promote(staged: Path, blobdir: Path) -> None:
    """Move the verified blobs of an image now unpacked into the store (each appears whole, by rename)."""
    for entry in os.listdir(staged):
        if not (blobdir / entry).exists():
            os.replace(staged / entry, blobdir / entry)


def _unpack(
    resolved: layout.Resolved,
    blobdirs: tuple[Path, ...],
    work: Path,
    rootfs: Path,
    deadline: float,
    limits: Limits,
    what: str,
) -> None:
    config = json.loads(resolved.config)
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") if isinstance(config, dict) else None
    if not isinstance(diff_ids, list) or len(diff_ids) != len(resolved.layers):
        raise ImageError(
            f"{what}: the config lists {len(diff_ids) if isinstance(diff_ids, list) else 'no'} diff_ids for "
            f"{len(resolved.layers)} layers: the image is malformed"
        )
    tree = work / "rootfs"
    tree.mkdir(mode=0o755)
    for n, (hexd, _size) in enumerate(resolved.layers):
        if time.monotonic() > deadline:
            raise ImageError(
                f"{what}: unpacking did not finish within the time allowed (layer {n + 1} of {len(resolved.layers)})"
            )
        diff_id = diff_ids[n]
        if not isinstance(diff_id, str):
            raise ImageError(f"{what}: diff_id {n} is not a string")
        blob = next((d / hexd for d in blobdirs if (d / hexd).exists()), blobdirs[-1] / hexd)
        apply_layer(tree, blob, diff_id=diff_id, limits=limits, what=f"{what}: layer {n + 1} (sha256:{hexd[:12]})")
    os.chmod(tree, 0o755)
    os.rename(tree, rootfs)


def _add_reference(st: _Store, hexd: str, reference: str) -> None:
    path = st.p("meta", f"{hexd}.json")
    meta = _read_json(path)
    if meta is not None and reference not in meta.get("references", []):
        meta["references"] = [*meta.get("references", []), reference][-32:]
        _write_json(path, meta)


def list_images(store: Path) -> list[StoredImage]:
    """The images unpacked in ``store``, newest first."""
    st = _open_store(Path(store), create=False)
    if st is None:
        return []
    out: list[StoredImage] = []
    with st:
        if not st.dir.exists("meta"):
            return out
        with st.sub("meta") as meta_dir:
            names = sorted(e.name for e in meta_dir.entries() if e.is_file and e.refused is None)
        for name in names:
            meta = _read_json(st.p("meta", name))
            hexd = name.removesuffix(".json")
            if meta is None or not _HEX.match(hexd) or not st.is_tree(hexd):
                continue
            refs = meta.get("references", [])
            out.append(
                StoredImage(
                    digest=f"sha256:{hexd}",
                    references=tuple(str(r) for r in refs) if isinstance(refs, list) else (),
                    rootfs=st.shown("rootfs", hexd),
                    size=int(meta.get("size", 0)),
                    created=float(meta.get("created", 0.0)),
                )
            )
    out.sort(key=lambda s: s.created, reverse=True)
    return out


def drop_images(store: Path, *, timeout: float = 60.0) -> list[str]:
    """Remove every image, blob and reference of ``store``; returns the digests of the images removed.

    Boxes still running on a removed image keep their open tree until they end; new ones re-unpack.
    A link or another user's entry in the store is refused (an :class:`ImageError` naming it,
    once the rest is removed), never followed nor removed.
    """
    dropped = [s.digest for s in list_images(store)]
    st = _open_store(Path(store), create=False)
    if st is None:
        return []
    refused = []
    with st, _locked(st, timeout, f"image store {store}"):
        # Everything but the lock: also what runtimes derive from the blobs (the vm runtime's
        # vm-layouts link to them), which must not outlive them.
        for entry in st.dir.entries():
            if entry.name == "lock":
                continue
            if entry.refused is not None:
                refused.append(f"{entry.name} ({entry.refused})")
                continue
            try:
                _remove_in(st.dir, entry.name)
            except PermissionError as exc:
                refused.append(exc.strerror or str(exc))
    if refused:
        raise ImageError(
            f"image store {store}: left in place, not pytest-boxlite's to remove: {', '.join(refused)}; the rest "
            "was removed. Remove them yourself if they are yours"
        )
    return dropped


def store_usage(store: Path) -> tuple[int, int]:
    """(images, bytes on disk) of ``store``, for ``doctor``."""
    st = _open_store(Path(store), create=False)
    if st is None:
        return 0, 0
    with st:
        if not st.dir.exists("meta") or not st.dir.exists("blobs/sha256"):
            return 0, 0
        entries = _entries(st)
        return len(entries), _usage(st, entries)
