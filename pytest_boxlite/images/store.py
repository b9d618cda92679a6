"""The image store: one per user (``<home>/image-store``), shared by every session, worker and runtime.

Layout (content-addressed; every entry appears whole, by rename, or not at all)::

    blobs/sha256/<hex>     manifests, configs and layers, verified, each stored once
    rootfs/<hex>/          the unpacked tree of manifest <hex> (complete: renamed in when done)
    meta/<hex>.json        its config, size and the references that named it
    refs/<key>.json        a reference (and, for local files, the file's identity) -> manifest digest
    tmp/                   work in progress (an image's new blobs too, until it is unpacked); removed by the next writer
    lock                   flock(2): one writer at a time; readers of complete entries take none

A second :func:`ensure_image` of a reference already seen reads two small files and stats the
source: no hashing, no unpacking.  Registry references are resolved once and kept (like a
container engine's local images) until ``clean --images``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pytest_boxlite.images import layout, pull
from pytest_boxlite.images.reference import ImageError, Reference, parse_reference
from pytest_boxlite.images.unpack import DEFAULT_MAX_UNPACKED, Limits, _rmtree_at, apply_layer, tree_size

__all__ = ["Image", "ImageConfig", "StoredImage", "drop_images", "ensure_image", "list_images", "store_dir"]

STORE_NAME = "image-store"
_MAX_META = 4 << 20


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
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
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


def _ref_path(store: Path, key: str) -> Path:
    return store / "refs" / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.json"


def _image_from_meta(store: Path, reference: str, hexd: str) -> Image | None:
    meta = _read_json(store / "meta" / f"{hexd}.json")
    rootfs = store / "rootfs" / hexd
    if meta is None or not rootfs.is_dir():
        return None
    try:
        return Image(reference, f"sha256:{hexd}", rootfs, _config_from(meta["config"]), int(meta["size"]))
    except (KeyError, TypeError, ValueError):
        return None


def _dirs(store: Path) -> None:
    for sub in ("", "blobs", "blobs/sha256", "rootfs", "meta", "refs", "tmp"):
        (store / sub).mkdir(mode=0o700, exist_ok=True, parents=(sub == ""))


@contextlib.contextmanager
def _locked(store: Path, timeout: float, what: str) -> Iterator[None]:
    _dirs(store)
    fd = os.open(store / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ImageError(
                        f"{what}: the image store {store} stayed locked for {timeout:.0f} s (another session "
                        "unpacking or pulling a large image?); try again, or raise the timeout"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _rmtree(path: Path) -> None:
    """Remove ``path`` (a whole tree too, of any depth: no recursion), following no link."""
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


def ensure_image(ref: str, *, store: Path, timeout: float = 600.0, max_unpacked: int = DEFAULT_MAX_UNPACKED) -> Image:
    """The image ``ref`` names, unpacked in ``store`` (pulled or read, verified and unpacked once).

    Safe under concurrent callers (xdist workers, several sessions): work happens under the
    store's lock, in a temporary directory renamed into place when complete.  Raises
    :class:`ImageError` naming the image, the cause and the fix.
    """
    parsed = parse_reference(ref)
    store = Path(store)
    what = f"image {ref!r}"
    key = _source_key(parsed)
    if key is not None:
        known = _read_json(_ref_path(store, key))
        if known is not None and isinstance(known.get("digest"), str):
            image = _image_from_meta(store, ref, known["digest"])
            if image is not None:
                return image
    deadline = time.monotonic() + timeout
    with _locked(store, timeout, what):
        for stale in (store / "tmp").iterdir():
            _rmtree(stale)  # a writer that died; none other runs while the lock is held
        # Not TemporaryDirectory: its cleanup is a recursive rmtree, which a deep tree defeats.
        work = Path(tempfile.mkdtemp(prefix="work-", dir=store / "tmp"))
        try:
            image = _ensure_locked(parsed, store, work, deadline, max_unpacked)
        finally:
            _rmtree(work)
        if key is not None:
            _write_json(_ref_path(store, key), {"key": key, "reference": ref, "digest": image.digest[7:]})
        return image


def _ensure_locked(ref: Reference, store: Path, work: Path, deadline: float, max_unpacked: int) -> Image:
    what = f"image {ref.original!r}"
    blobdir = store / "blobs" / "sha256"
    # Blobs of this image are copied here first, and join blobs/ only once the image is unpacked:
    # an image refused (too big, corrupt, hostile) leaves nothing in the store.
    staged = work / "blobs"
    staged.mkdir()
    if ref.transport == "docker":
        pulled = pull.pull(ref, work, timeout=max(1.0, deadline - time.monotonic()))
        if pulled.layout_dir is not None:
            where = str(pulled.layout_dir)
            local = Reference(f"oci:{where}:{pull.PULL_TAG}", "oci", path=where, tag=pull.PULL_TAG)
            src = layout.open_source(local)
            try:
                resolved = layout.resolve_oci(src, local)
                _import_blobs(src, resolved, blobdir, staged, work, max_unpacked, what)
            finally:
                src.close()
        else:
            resolved = pulled.resolved
            _import_blobs(pulled.source, resolved, blobdir, staged, work, max_unpacked, what)
    else:
        src = layout.open_source(ref)
        try:
            if ref.transport == "docker-archive":
                assert isinstance(src, layout._TarSource)
                resolved = layout.resolve_docker_archive(
                    src, ref, work, staged, check_sizes=lambda sizes: _check_layers(sizes, max_unpacked, what)
                )
            else:
                resolved = layout.resolve_oci(src, ref)
                hexd = resolved.digest[7:]
                if not _image_from_meta(store, ref.original, hexd):
                    _import_blobs(src, resolved, blobdir, staged, work, max_unpacked, what)
        finally:
            src.close()
    hexd = resolved.digest.removeprefix("sha256:")
    for name, data in ((hexd, resolved.manifest), (resolved.config_digest[7:], resolved.config)):
        if not (blobdir / name).exists():
            _write_blob(staged / name, data, work)
    existing = _image_from_meta(store, ref.original, hexd)
    if existing is not None:
        _promote(staged, blobdir)
        _add_reference(store, hexd, ref.original)
        return existing
    config = parse_config(resolved.config, what)
    rootfs = store / "rootfs" / hexd
    if not rootfs.is_dir():
        _unpack(resolved, (staged, blobdir), work, rootfs, deadline, max_unpacked, what)
    _promote(staged, blobdir)
    size = tree_size(rootfs)
    meta = {
        "config": _config_dict(config),
        "size": size,
        "references": [ref.original],
        "created": time.time(),
        "layers": [h for h, _ in resolved.layers],
    }
    _write_json(store / "meta" / f"{hexd}.json", meta)
    return Image(ref.original, resolved.digest, rootfs, config, size)


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
            f"unpacked can need ({bound}): the image is too big or its descriptors lie"
        )


def _write_blob(path: Path, data: bytes, work: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix="blob-", dir=work)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o444)
    os.replace(tmp, path)


def _import_blobs(
    src: Any, resolved: layout.Resolved, blobdir: Path, staged: Path, work: Path, max_unpacked: int, what: str
) -> None:
    """Copy the layers the store lacks into ``staged`` (verified), once their sizes pass the bound."""
    _check_layers([size for _, size in resolved.layers], max_unpacked, what)
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
    max_unpacked: int,
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
    limits = Limits(max_unpacked=max_unpacked)
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


def _add_reference(store: Path, hexd: str, reference: str) -> None:
    path = store / "meta" / f"{hexd}.json"
    meta = _read_json(path)
    if meta is not None and reference not in meta.get("references", []):
        meta["references"] = [*meta.get("references", []), reference][-32:]
        _write_json(path, meta)


def list_images(store: Path) -> list[StoredImage]:
    """The images unpacked in ``store``, newest first."""
    out: list[StoredImage] = []
    meta_dir = Path(store) / "meta"
    if not meta_dir.is_dir():
        return out
    for entry in sorted(meta_dir.glob("*.json")):
        meta = _read_json(entry)
        hexd = entry.name.removesuffix(".json")
        if meta is None or not (Path(store) / "rootfs" / hexd).is_dir():
            continue
        refs = meta.get("references", [])
        out.append(
            StoredImage(
                digest=f"sha256:{hexd}",
                references=tuple(str(r) for r in refs) if isinstance(refs, list) else (),
                rootfs=Path(store) / "rootfs" / hexd,
                size=int(meta.get("size", 0)),
                created=float(meta.get("created", 0.0)),
            )
        )
    out.sort(key=lambda s: s.created, reverse=True)
    return out


def drop_images(store: Path, *, timeout: float = 60.0) -> list[str]:
    """Remove every image, blob and reference of ``store``; returns the digests of the images removed.

    Boxes still running on a removed image keep their open tree until they end; new ones re-unpack.
    """
    store = Path(store)
    if not store.is_dir():
        return []
    dropped = [s.digest for s in list_images(store)]
    with _locked(store, timeout, f"image store {store}"):
        # Everything but the lock: also what runtimes derive from the blobs (the vm runtime's
        # vm-layouts link to them), which must not outlive them.
        for entry in sorted(os.listdir(store)):
            if entry != "lock":
                _rmtree(store / entry)
    return dropped


def store_usage(store: Path) -> tuple[int, int]:
    """(images, bytes on disk) of ``store``, for ``doctor``."""
    images = list_images(store)
    blobs = 0
    bdir = Path(store) / "blobs" / "sha256"
    if bdir.is_dir():
        for b in bdir.iterdir():
            with contextlib.suppress(OSError):
                blobs += b.lstat().st_blocks * 512
    return len(images), blobs + sum(i.size for i in images)
