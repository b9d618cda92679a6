"""Reading local images: OCI image layouts (a directory or a tar of one) and ``docker save`` archives.

Everything read here is untrusted: JSON documents are bounded in size and checked for type, blob
names are digests (never paths), files are opened without following links, and every blob is
copied into the store only once its sha256 and size match its descriptor.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import stat
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from pytest_boxlite.images.reference import ImageError, Reference
from pytest_boxlite.images.unpack import _BoundedTarInfo

__all__ = ["MAX_JSON", "Resolved", "host_platform", "open_source"]

MAX_JSON = 4 << 20
_HEX = re.compile(r"^[0-9a-f]{64}$")
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
_MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json")
_MAX_ARCHIVE_MEMBERS = 200_000
_CHUNK = 1 << 20
#: An archive read in place keeps every member's TarInfo: its extended headers all together.
_MAX_ARCHIVE_EXT = 16 << 20
_ARCHES = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "armv7l": "arm",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
    "riscv64": "riscv64",
    "i686": "386",
    "i386": "386",
}


def host_platform() -> tuple[str, str]:
    """``("linux", GOARCH)`` of this machine, as OCI platforms name it."""
    machine = platform.machine().lower()
    return "linux", _ARCHES.get(machine, machine)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _host() -> str:
    return "/".join(host_platform())


def _digest_hex(digest: Any, what: str) -> str:
    if not isinstance(digest, str) or not digest.startswith("sha256:") or not _HEX.match(digest[7:]):
        raise ImageError(
            f"{what}: descriptor digest {str(digest)[:80]!r} is not sha256:<64 hex digits> (only sha256 is supported)"
        )
    return digest[7:]


def _json(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
        raise ImageError(f"{what} is not valid JSON ({exc}); the image is corrupt") from None
    if not isinstance(doc, dict):
        raise ImageError(f"{what} is not a JSON object; the image is corrupt")
    return doc


class Resolved:
    """One image chosen from a source: its manifest (digest and document), config and layer descriptors."""

    def __init__(
        self, digest: str, manifest: bytes, config: bytes, config_digest: str, layers: list[tuple[str, int]]
    ) -> None:
        self.digest = digest
        self.manifest = manifest
        self.config = config
        self.config_digest = config_digest
        #: (sha256 hex, size) of each layer blob, bottom first.
        self.layers = layers


class _Source:
    """Blobs by digest and small files by name, from a directory or a tar archive."""

    what: str

    def open_file(self, parts: list[str]) -> tuple[IO[bytes], int] | None:
        """The regular file at ``parts`` (path components) and its size, or ``None`` if absent."""
        raise NotImplementedError

    def small(self, name: str) -> bytes | None:
        """A small file's bytes (at most ``MAX_JSON``), or ``None`` if absent."""
        opened = self.open_file([name])
        if opened is None:
            return None
        f, size = opened
        with f:
            if size > MAX_JSON:
                raise ImageError(f"{self.what}: {name} has {size} bytes, more than the {MAX_JSON} allowed")
            return f.read(MAX_JSON + 1)

    def open_blob(self, hexd: str) -> tuple[IO[bytes], int] | None:
        return self.open_file(["blobs", "sha256", hexd])

    def close(self) -> None:
        pass

    def blob(self, digest: str, size: Any, what: str, *, limit: int = MAX_JSON) -> bytes:
        """A small blob (manifest, index, config), size- and digest-checked."""
        hexd = _digest_hex(digest, what)
        if not isinstance(size, int) or size < 0 or size > limit:
            raise ImageError(f"{what}: descriptor size {size!r} is not an integer of at most {limit} bytes")
        opened = self.open_blob(hexd)
        if opened is None:
            raise ImageError(f"{self.what}: blob {digest} ({what}) is missing from the image; it is incomplete")
        f, actual = opened
        with f:
            if actual != size:
                raise ImageError(
                    f"{what}: blob {digest} has {actual} bytes, its descriptor says {size}: the image is corrupt"
                )
            data = f.read(size + 1)
        if len(data) != size or hashlib.sha256(data).hexdigest() != hexd:
            raise ImageError(f"{what}: blob {digest} does not match its digest: the image is corrupt or truncated")
        return data

    def copy_blob(self, hexd: str, size: int, dest: Path, tmpdir: Path, what: str) -> None:
        """Copy blob ``hexd`` to ``dest`` (atomically), refusing it unless its size and sha256 match."""
        opened = self.open_blob(hexd)
        if opened is None:
            raise ImageError(f"{self.what}: layer blob sha256:{hexd} is missing from the image; it is incomplete")
        f, actual = opened
        with f:
            if actual != size:
                raise ImageError(
                    f"{what}: layer sha256:{hexd} has {actual} bytes, its descriptor says {size}: the image is corrupt"
                )
            _copy_verified(f, size, hexd, dest, tmpdir, what)


def _copy_verified(f: IO[bytes], size: int, hexd: str | None, dest: Path, tmpdir: Path, what: str) -> tuple[str, Path]:
    """Copy ``size`` bytes of ``f`` into the store; check the digest (``hexd``) if known.  Returns (hex, path).

    ``dest`` is the blob's path, or (digest not known before) the directory of blobs by digest.
    """
    fd, tmp = tempfile.mkstemp(prefix="blob-", dir=tmpdir)
    sha = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            left = size
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    raise ImageError(f"{what}: blob ends after {size - left} of {size} bytes: the image is truncated")
                sha.update(chunk)
                out.write(chunk)
                left -= len(chunk)
        got = sha.hexdigest()
        if hexd is not None and got != hexd:
            raise ImageError(
                f"{what}: blob sha256:{hexd} does not match its content (sha256:{got}): the image is corrupt"
            )
        final = dest if hexd is not None else dest / got
        os.chmod(tmp, 0o444)
        os.replace(tmp, final)
        return got, final
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class _DirSource(_Source):
    def __init__(self, root: Path, what: str) -> None:
        self.root = root
        self.what = what
        try:
            self.rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ImageError(f"{what}: directory {root} does not exist") from None
        except NotADirectoryError:
            raise ImageError(
                f"{what}: {root} is not a directory (an OCI layout is one; for a tar of it write oci-archive:)"
            ) from None
        except OSError as exc:
            raise ImageError(f"{what}: cannot open {root}: {exc.strerror}") from None

    def close(self) -> None:
        os.close(self.rootfd)

    def _open(self, parts: list[str]) -> tuple[IO[bytes], int] | None:
        fd = os.dup(self.rootfd)
        try:
            for n, comp in enumerate(parts[:-1], 1):
                try:
                    nfd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except NotADirectoryError:
                    # There, but a link (O_NOFOLLOW) or a file: not "missing", which would mislead.
                    st = os.stat(comp, dir_fd=fd, follow_symlinks=False)
                    kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
                    raise ImageError(
                        f"{self.what}: {'/'.join(parts[:n])} is {kind}; an OCI layout's directories must be its own "
                        "(copy the layout, e.g. cp -rL, or skopeo copy it)"
                    ) from None
                os.close(fd)
                fd = nfd
            ffd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise ImageError(
                f"{self.what}: cannot open {'/'.join(parts)}: {exc.strerror} (a link or unreadable file?)"
            ) from None
        finally:
            os.close(fd)
        st = os.fstat(ffd)
        if not stat.S_ISREG(st.st_mode):
            os.close(ffd)
            raise ImageError(f"{self.what}: {'/'.join(parts)} is not a regular file")
        return os.fdopen(ffd, "rb"), st.st_size

    def open_file(self, parts: list[str]) -> tuple[IO[bytes], int] | None:
        return self._open(parts)


class _ArchiveTarInfo(_BoundedTarInfo):
    """Bounded extended headers, all members together too: :class:`_TarSource` keeps them all."""

    max_ext_total = _MAX_ARCHIVE_EXT


class _TarSource(_Source):
    """A tar archive read in place: members by name (no extraction), regular files only."""

    def __init__(self, path: Path, what: str) -> None:
        self.what = what
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ImageError(f"{what}: archive {path} does not exist") from None
        except OSError as exc:
            raise ImageError(f"{what}: cannot open archive {path}: {exc.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise ImageError(f"{what}: {path} is not a regular file (an image archive is a tar file)")
        self.file = os.fdopen(fd, "rb")
        self.members: dict[str, tarfile.TarInfo] = {}
        try:
            # Bounded extended headers, as in layers: tarfile reads them whole into memory.
            self.tf = tarfile.open(fileobj=self.file, mode="r:", tarinfo=_ArchiveTarInfo)  # noqa: SIM115 - closed by close()
            for count, m in enumerate(self.tf, 1):
                if count > _MAX_ARCHIVE_MEMBERS:
                    raise ImageError(f"{what}: the archive has more than {_MAX_ARCHIVE_MEMBERS} members")
                if m.isreg():
                    self.members["/".join(p for p in m.name.split("/") if p not in ("", "."))] = m
        except (tarfile.TarError, EOFError, OSError) as exc:
            self.file.close()
            raise ImageError(
                f"{what}: {path} is not a readable tar archive ({exc}): is it truncated or corrupt?"
            ) from None
        except BaseException:
            self.file.close()
            raise

    def close(self) -> None:
        self.tf.close()
        self.file.close()

    def member(self, name: str) -> tuple[IO[bytes], int] | None:
        m = self.members.get("/".join(p for p in name.split("/") if p not in ("", ".")))
        if m is None:
            return None
        if m.offset_data + m.size > os.fstat(self.file.fileno()).st_size:
            raise ImageError(f"{self.what}: member {name} runs past the end of the archive: it is truncated")
        f = self.tf.extractfile(m)
        assert f is not None
        return f, m.size

    def open_file(self, parts: list[str]) -> tuple[IO[bytes], int] | None:
        return self.member("/".join(parts))


def open_source(ref: Reference) -> _Source:
    """The files of local image ``ref`` (a directory for ``oci:``, a tar archive otherwise)."""
    assert ref.path is not None
    path = Path(ref.path).expanduser()
    if ref.transport == "oci":
        return _DirSource(path, f"image {ref.original!r}")
    return _TarSource(path, f"image {ref.original!r}")


def _platform_ok(plat: Any) -> bool:
    want_os, want_arch = host_platform()
    return isinstance(plat, dict) and plat.get("os") == want_os and plat.get("architecture") == want_arch


def _pick(entries: list[Any], what: str, tag: str | None) -> dict[str, Any]:
    good = [e for e in entries if isinstance(e, dict)]
    if tag is not None:
        good = [
            e
            for e in good
            if isinstance(e.get("annotations"), dict)
            and e["annotations"].get("org.opencontainers.image.ref.name") == tag
        ]
        if not good:
            tags = sorted(
                str(e["annotations"].get("org.opencontainers.image.ref.name"))
                for e in entries
                if isinstance(e, dict)
                and isinstance(e.get("annotations"), dict)
                and e["annotations"].get("org.opencontainers.image.ref.name")
            )
            raise ImageError(f"{what}: no image is tagged {tag!r} (tags in it: {', '.join(tags) or 'none'})")
    if len(good) > 1 and any("platform" in e for e in good):
        plats = [e for e in good if _platform_ok(e.get("platform"))]
        if not plats:
            have = sorted(
                {
                    f"{e['platform'].get('os')}/{e['platform'].get('architecture')}"
                    for e in good
                    if isinstance(e.get("platform"), dict)
                }
            )
            raise ImageError(
                f"{what}: no image for this machine ({_host()}); it has {', '.join(have)}: "
                f"use an image built for {_host()}"
            )
        good = plats
    if not good:
        raise ImageError(f"{what}: the image index lists no manifest")
    if len(good) > 1:
        raise ImageError(f"{what}: the layout holds {len(good)} images: name one with :TAG")
    return good[0]


def resolve_oci(src: _Source, ref: Reference) -> Resolved:
    """Choose the manifest of OCI layout ``src`` that ``ref`` names, for this machine's platform."""
    what = f"image {ref.original!r}"
    layout = src.small("oci-layout")
    index_data = src.small("index.json")
    if index_data is None or layout is None:
        if ref.transport == "oci-archive" and isinstance(src, _TarSource) and "manifest.json" in src.members:
            raise ImageError(f"{what}: this is a docker save archive, not an OCI one: write docker-archive:{ref.path}")
        raise ImageError(
            f"{what}: not an OCI image layout (no {'oci-layout' if layout is None else 'index.json'}); "
            "was it written by skopeo copy or buildah push to oci:...?"
        )
    index = _json(index_data, f"{what}: index.json")
    entry = _pick(_list(index.get("manifests")), what, ref.tag)
    for _depth in range(4):
        media = entry.get("mediaType")
        data = src.blob(str(entry.get("digest")), entry.get("size"), f"{what}: manifest")
        doc = _json(data, f"{what}: manifest {entry.get('digest')}")
        if media in _INDEX_TYPES or (media is None and "manifests" in doc and "layers" not in doc):
            entry = _pick(_list(doc.get("manifests")), what, None)
            if not _platform_ok(entry.get("platform")):
                plat = entry.get("platform") or {}
                raise ImageError(
                    f"{what}: the image is for {plat.get('os')}/{plat.get('architecture')}, this machine is "
                    f"{_host()}: use an image built for {_host()}"
                )
            continue
        return _manifest(src, str(entry["digest"]), data, doc, what)
    raise ImageError(f"{what}: image indexes nest too deep")


def _manifest(src: _Source, digest: str, data: bytes, doc: dict[str, Any], what: str) -> Resolved:
    config = doc.get("config")
    layers = doc.get("layers")
    if not isinstance(config, dict) or not isinstance(layers, list):
        raise ImageError(f"{what}: manifest {digest} has no config or layers; the image is corrupt")
    config_data = src.blob(str(config.get("digest")), config.get("size"), f"{what}: config")
    out: list[tuple[str, int]] = []
    for layer in layers:
        if not isinstance(layer, dict):
            raise ImageError(f"{what}: manifest {digest} lists a layer that is not an object")
        size = layer.get("size")
        if not isinstance(size, int) or size < 0:
            raise ImageError(f"{what}: layer size {size!r} is not a non-negative integer")
        out.append((_digest_hex(layer.get("digest"), what), size))
    _check_arch(_json(config_data, f"{what}: config"), what)
    return Resolved(digest, data, config_data, str(config["digest"]), out)


def _check_arch(config: dict[str, Any], what: str) -> None:
    want_os, want_arch = host_platform()
    arch, osname = config.get("architecture"), config.get("os")
    if (arch is not None and arch != want_arch) or (osname is not None and osname != want_os):
        raise ImageError(
            f"{what}: the image is for {osname}/{arch}, this machine is {want_os}/{want_arch}: "
            f"use an image built for {want_os}/{want_arch} (e.g. skopeo copy --override-arch {want_arch} ...)"
        )


def resolve_docker_archive(
    src: _TarSource,
    ref: Reference,
    tmpdir: Path,
    blobdir: Path,
    *,
    check_sizes: Callable[[list[int]], None] | None = None,
) -> Resolved:
    """Read a ``docker save`` archive; its layers are hashed into ``blobdir`` as they are read, once
    ``check_sizes`` (the store's bound: it raises) has passed their sizes, if given.

    Its manifest is synthesised (OCI, canonical JSON), so the same archive always has the same digest.
    """
    what = f"image {ref.original!r}"
    data = src.small("manifest.json")
    if data is None:
        if src.small("repositories") is not None:
            raise ImageError(
                f"{what}: the legacy docker save format (before Docker 1.10) is not supported: "
                "re-save it with a current docker or skopeo"
            )
        if src.small("index.json") is not None:
            raise ImageError(f"{what}: this is an OCI archive, not a docker save one: write oci-archive:{ref.path}")
        raise ImageError(f"{what}: no manifest.json: not a docker save archive")
    try:
        items = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ImageError(f"{what}: manifest.json is not valid JSON ({exc})") from None
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise ImageError(f"{what}: manifest.json lists no image")
    if ref.tag:
        want = {
            ref.tag,
            f"{ref.tag}:latest",
            ref.tag.removeprefix("docker.io/library/"),
            ref.tag.removeprefix("docker.io/"),
        }
        chosen = [i for i in items if isinstance(i.get("RepoTags"), list) and want & set(map(str, i["RepoTags"]))]
        if not chosen:
            tags = sorted(str(t) for i in items for t in (i.get("RepoTags") or []))
            raise ImageError(
                f"{what}: no image is tagged {ref.tag!r} in the archive (tags: {', '.join(tags) or 'none'})"
            )
    elif len(items) > 1:
        raise ImageError(f"{what}: the archive holds {len(items)} images: name one with :NAME:TAG")
    else:
        chosen = items
    item = chosen[0]
    config_name, layer_names = item.get("Config"), item.get("Layers")
    if (
        not isinstance(config_name, str)
        or not isinstance(layer_names, list)
        or not all(isinstance(n, str) for n in layer_names)
    ):
        raise ImageError(f"{what}: manifest.json has no Config or Layers")
    config_data = src.small(config_name)
    if config_data is None:
        raise ImageError(f"{what}: config {config_name} is missing from the archive; it is incomplete")
    config_hex = hashlib.sha256(config_data).hexdigest()
    named = os.path.basename(config_name).removesuffix(".json")
    if _HEX.match(named) and named != config_hex:
        raise ImageError(f"{what}: config {config_name} does not match its digest: the archive is corrupt")
    _check_arch(_json(config_data, f"{what}: config"), what)
    sizes = []
    for name in layer_names:
        m = src.members.get("/".join(p for p in name.split("/") if p not in ("", ".")))
        if m is None:
            raise ImageError(f"{what}: layer {name} is missing from the archive; it is incomplete")
        sizes.append(m.size)
    if check_sizes is not None:
        check_sizes(sizes)  # before any layer is copied
    layers: list[tuple[str, int]] = []
    for name in layer_names:
        opened = src.member(name)
        if opened is None:
            raise ImageError(f"{what}: layer {name} is missing from the archive; it is incomplete")
        f, size = opened
        with f:
            hexd, _path = _copy_verified(f, size, None, blobdir, tmpdir, f"{what}: layer {name}")
        layers.append((hexd, size))
    manifest = {
        "schemaVersion": 2,
        "mediaType": _MANIFEST_TYPES[0],
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": f"sha256:{config_hex}",
            "size": len(config_data),
        },
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": f"sha256:{h}", "size": s}
            for h, s in layers
        ],
    }
    mdata = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return Resolved(f"sha256:{hashlib.sha256(mdata).hexdigest()}", mdata, config_data, f"sha256:{config_hex}", layers)
