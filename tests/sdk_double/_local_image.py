"""The SDK double's ``BoxOptions.rootfs_path``: a local OCI image layout, read as boxlite 0.10.8 reads it.  TESTS ONLY.

What the real SDK does with ``rootfs_path`` (a non-empty string wins over ``image``; see
``docs/how-to/images.md`` for the sources), each step reproduced here with its message, checked
against the 0.10.8 wheel on this machine (``box.start()`` fails before any boot, as
:class:`boxlite.errors.StorageError` with ``"storage error: "`` in front):

1. ``Rootfs path does not exist: <path>`` (``container_rootfs.rs``, ``run_container_rootfs``);
2. ``Local image must contain oci-layout file, not found at: <path>/oci-layout``
   (``images/store.rs``, ``load_from_local``);
3. ``Failed to read index.json: <io error>`` / ``Failed to parse index.json: <serde error>``;
4. ``No manifests found in index.json``; the **first** descriptor is used (no tag is looked at);
   an image index there is resolved for the host's platform;
5. ``Failed to read manifest file: <io error>`` for a missing manifest blob;
6. no registry contact: the blobs are read in place.

Then the double's box is booted on the image's root filesystem (its layers applied in order, OCI
whiteouts honoured, the tarfile ``tar`` filter on every member) instead of the host's system
directories, and commands get the image config's ``Env`` (the real guest merges the exec's env over
the container's, which starts from the image's).  The double's agent is not part of the image (in
BoxLite it is the guest agent, outside the container): it runs on the host's loader and libraries,
bound under :data:`KIT`, so an image without a C library the host's Python can use still boots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from boxlite.errors import StorageError

#: Where the double's agent finds the host's loader and libraries in a box of a local image.
KIT = "/.boxlite-double-host"
MT_INDEX = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")


@dataclasses.dataclass(frozen=True)
class LocalImage:
    manifest_digest: str
    rootfs: Path
    env: list[tuple[str, str]]


def _storage(msg: str) -> StorageError:
    return StorageError(f"storage error: {msg}")


def _io(exc: OSError) -> str:
    return f"{exc.strerror} (os error {exc.errno})"


def _blob(root: Path, digest: str) -> Path:
    return root / "blobs" / digest.replace(":", "/")


def load(path: str, extracted: Path) -> LocalImage:
    """Validate ``path`` as the real SDK does and unpack its image once into ``extracted``."""
    root = Path(path)
    if not root.exists():
        raise _storage(f"Rootfs path does not exist: {path}")
    if not (root / "oci-layout").exists():
        raise _storage(f"Local image must contain oci-layout file, not found at: {root / 'oci-layout'}")
    try:
        text = (root / "index.json").read_text()
    except OSError as exc:
        raise _storage(f"Failed to read index.json: {_io(exc)}") from None
    try:
        index = json.loads(text)
    except ValueError as exc:
        raise _storage(f"Failed to parse index.json: {exc}") from None
    manifests = index.get("manifests") or []
    if not manifests:
        raise _storage("No manifests found in index.json")
    desc = manifests[0]
    if desc.get("mediaType") in MT_INDEX:
        arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
        child = json.loads(_blob(root, desc["digest"]).read_text())
        hits = [m for m in child.get("manifests", []) if (m.get("platform") or {}).get("architecture") == arch]
        if not hits:
            raise _storage(f"no manifest for linux/{arch} in image index {desc['digest']}")
        desc = hits[0]
    try:
        manifest = json.loads(_blob(root, desc["digest"]).read_text())
    except OSError as exc:
        raise _storage(f"Failed to read manifest file: {_io(exc)}") from None
    config = json.loads(_blob(root, manifest["config"]["digest"]).read_text())
    env = [tuple(e.split("=", 1)) for e in (config.get("config") or {}).get("Env") or [] if "=" in e]
    dest = extracted / f"local-{desc['digest'].partition(':')[2][:32]}"
    if not dest.is_dir():
        extracted.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=extracted))
        try:
            for layer in manifest.get("layers", []):
                _apply(_blob(root, layer["digest"]), tmp)
            with contextlib.suppress(OSError):
                os.rename(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return LocalImage(desc["digest"], dest, [(k, v) for k, v in env])


def _apply(blob: Path, dest: Path) -> None:
    """One layer onto ``dest``: whiteouts first remove, then the members are extracted (data filter)."""
    with tarfile.open(blob, "r:*") as tar:
        members = []
        for m in tar.getmembers():
            name = os.path.normpath(m.name.lstrip("/"))
            head, base = os.path.split(name)
            if base == ".wh..wh..opq":
                target = dest / head
                for child in target.iterdir() if target.is_dir() else []:
                    shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
            elif base.startswith(".wh."):
                target = dest / head / base[len(".wh.") :]
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                elif target.exists() or target.is_symlink():
                    target.unlink()
            elif name != ".." and not name.startswith("../"):
                # What tarfile's "tar" filter does (names kept inside dest, no setuid bits), by hand
                # where the interpreter predates extraction filters (Debian 12's 3.11.2); not
                # "data": images link absolutely (bin/sh -> /bin/busybox), meaning their own root,
                # as BoxLite's extraction does.  Test images only: the plugin's store is the
                # hostile-input path.
                m.name, m.mode = name, m.mode & ~0o6000
                members.append(m)
        if hasattr(tarfile, "tar_filter"):
            tar.extractall(dest, members=members, filter="tar")
        else:  # pragma: no cover - interpreters before extraction filters (checked by hand above)
            tar.extractall(dest, members=members)


def mounts(image: LocalImage, disk_layer: Any) -> list[str]:
    """bwrap arguments that lay the image's tree (copy-on-write, on the box's disk) as the root."""
    argv: list[str] = []
    for entry in sorted(image.rootfs.iterdir()):
        if entry.name in ("proc", "dev", "sys", "tmp", "run", "root", "home", "workspace"):
            continue
        if entry.is_symlink():
            argv += ["--symlink", os.readlink(entry), f"/{entry.name}"]
        elif entry.is_dir():
            argv += disk_layer(str(entry), f"/{entry.name}")
        else:
            argv += ["--ro-bind", str(entry), f"/{entry.name}"]
    return argv


def agent_kit(python: str) -> tuple[list[str], list[str]]:
    """``(bwrap arguments, command prefix)`` that run the host's ``python`` on the host's own loader."""
    libdir = os.path.realpath(
        "/lib64/ld-linux-x86-64.so.2" if os.path.exists("/lib64/ld-linux-x86-64.so.2") else "/lib/ld-linux-aarch64.so.1"
    )
    loader_dir, loader = os.path.split(libdir)
    binds = ["--ro-bind", loader_dir, f"{KIT}/lib"]
    extra = [os.path.join(sys.base_prefix, "lib")]
    return binds, [f"{KIT}/lib/{loader}", "--library-path", ":".join([f"{KIT}/lib", *extra]), python]


def digest_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"
