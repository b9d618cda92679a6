"""Build small test images without a registry, from files already on this machine.

``python -m tests.images.build OUTDIR`` (from the project root) writes them and prints their
references; tests call :func:`test_images` (cached, built once per set of inputs).

- ``busybox``: a userland of Debian's ``busybox-static`` (``/bin/busybox`` and its applets as
  absolute links), its own ``/etc/os-release`` (``ID=boxlite-test``), two layers: the second
  removes a file by whiteout, makes a directory opaque and adds files; Env, WorkingDir, User,
  Entrypoint and Cmd set.  As an OCI layout (``busybox-oci``), an oci-archive (``busybox``) and a
  docker save archive (``busybox-docker``), with gzip and plain layers.
- ``glibc``: busybox plus the host's dynamic loader, libc and every shared library the host's
  interpreters (``sys.executable``, ``/usr/bin/python3``) and their extension modules need
  (``ldd``), at their own paths, with merged-/usr links as on the host.  The cheapest honest
  image that runs the host's Python when its interpreter is mounted in (mmdebstrap needs a
  Debian mirror, which CI lacks).
- broken ones for the bad-input tests: ``truncated`` (half an oci-archive), ``corrupt`` (a
  layer whose bytes do not match its digest), ``other-arch`` (an index with only a manifest for
  another architecture), ``no-shell`` (a layer with ``/etc/os-release`` only).

Files are written with fixed owners and times, so the same inputs give the same digests.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["BUSYBOX", "OS_RELEASE", "ImagesUnavailable", "layer_tar", "oci_layout", "shared_cache", "test_images"]

BUSYBOX = Path("/bin/busybox")
MTIME = 1_700_000_000
OS_RELEASE = 'ID=boxlite-test\nNAME="BoxLite test busybox"\nPRETTY_NAME="BoxLite test busybox"\nVERSION_ID=1\n'
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
_OTHER_ARCH = "s390x" if _ARCH != "s390x" else "amd64"
#: Entries of a layer: (path, kind, data-or-target, mode); kind is file, dir, symlink, hardlink, whiteout.
Entry = tuple[str, str, Any, int]


class ImagesUnavailable(Exception):
    """The test images cannot be built here; the message says why (tests skip with it)."""


def _info(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = mode
    ti.mtime = MTIME
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    return ti


def layer_tar(entries: list[Entry]) -> bytes:
    """An uncompressed tar of ``entries`` (in the order given, as a layer's changeset)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, data, mode in entries:
            if kind == "dir":
                tf.addfile(_info(name, tarfile.DIRTYPE, mode))
            elif kind == "file":
                raw = (
                    data
                    if isinstance(data, bytes)
                    else Path(data).read_bytes()
                    if isinstance(data, Path)
                    else str(data).encode()
                )
                ti = _info(name, tarfile.REGTYPE, mode)
                ti.size = len(raw)
                tf.addfile(ti, io.BytesIO(raw))
            elif kind in ("symlink", "hardlink"):
                ti = _info(name, tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE, mode)
                ti.linkname = data
                tf.addfile(ti)
            elif kind == "whiteout":
                tf.addfile(_info(name, tarfile.REGTYPE, 0o644))
            else:
                raise ValueError(kind)
    return buf.getvalue()


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=6, mtime=0)


def _config(diff_ids: list[str], *, arch: str = _ARCH, cfg: dict[str, Any] | None = None) -> bytes:
    doc = {
        "architecture": arch,
        "os": "linux",
        "config": cfg or {},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created_by": "tests/images/build.py"}],
    }
    return json.dumps(doc, sort_keys=True).encode()


def _put(blobs: Path, data: bytes) -> dict[str, Any]:
    hexd = hashlib.sha256(data).hexdigest()
    (blobs / hexd).write_bytes(data)
    return {"digest": f"sha256:{hexd}", "size": len(data)}


def oci_layout(
    out: Path,
    layers: list[bytes],
    *,
    gzip_layers: tuple[bool, ...] | None = None,
    cfg: dict[str, Any] | None = None,
    tag: str = "latest",
    arch: str = _ARCH,
    index_arch: str | None = None,
) -> Path:
    """Write an OCI image layout of ``layers`` (uncompressed tars) at ``out``.

    ``index_arch`` wraps the manifest in an image index whose only entry is for that architecture.
    """
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    gz = gzip_layers or tuple(False for _ in layers)
    descs = []
    for data, packed in zip(layers, gz, strict=True):
        body = _gzip(data) if packed else data
        media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if packed else "")
        descs.append({"mediaType": media, **_put(blobs, body)})
    config = _config([f"sha256:{hashlib.sha256(d).hexdigest()}" for d in layers], arch=arch, cfg=cfg)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **_put(blobs, config)},
        "layers": descs,
    }
    mdesc: dict[str, Any] = {
        "mediaType": manifest["mediaType"],
        **_put(blobs, json.dumps(manifest, sort_keys=True).encode()),
    }
    if index_arch is not None:
        mdesc["platform"] = {"os": "linux", "architecture": index_arch}
        inner = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [mdesc]}
        mdesc = {"mediaType": inner["mediaType"], **_put(blobs, json.dumps(inner, sort_keys=True).encode())}
    mdesc["annotations"] = {"org.opencontainers.image.ref.name": tag}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [mdesc]}
    (out / "index.json").write_text(json.dumps(index, sort_keys=True))
    (out / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return out


def _tar_dir(src: Path, dest: Path) -> Path:
    """A tar of directory ``src``'s contents (what an oci-archive is), deterministic."""
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tf:
        for path in sorted(src.rglob("*")):
            ti = tf.gettarinfo(str(path), arcname=str(path.relative_to(src)))
            ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = MTIME, 0, 0, "root", "root"
            if ti.isreg():
                with open(path, "rb") as f:
                    tf.addfile(ti, f)
            else:
                tf.addfile(ti)
    return dest


def docker_archive(dest: Path, layers: list[bytes], *, cfg: dict[str, Any], repo_tag: str) -> Path:
    """Write a ``docker save`` archive (manifest.json, <config>.json, <id>/layer.tar) of ``layers``."""
    config = _config([f"sha256:{hashlib.sha256(d).hexdigest()}" for d in layers], cfg=cfg)
    chex = hashlib.sha256(config).hexdigest()
    entries: list[Entry] = [(f"{chex}.json", "file", config, 0o644)]
    names = []
    for data in layers:
        lid = hashlib.sha256(data).hexdigest()
        entries.append((f"{lid}/layer.tar", "file", data, 0o644))
        names.append(f"{lid}/layer.tar")
    manifest = [{"Config": f"{chex}.json", "RepoTags": [repo_tag], "Layers": names}]
    entries.append(("manifest.json", "file", json.dumps(manifest).encode(), 0o644))
    dest.write_bytes(layer_tar(entries))
    return dest


def _applets() -> list[str]:
    out = subprocess.run([str(BUSYBOX), "--list-full"], capture_output=True, text=True, timeout=30, check=True).stdout
    return sorted({line.strip() for line in out.splitlines() if re.fullmatch(r"[a-z0-9_./\[-]+", line.strip())})


def _busybox_base() -> list[Entry]:
    entries: list[Entry] = [
        (d, "dir", None, 0o755)
        for d in (
            "bin",
            "sbin",
            "usr",
            "usr/bin",
            "usr/sbin",
            "etc",
            "root",
            "home",
            "srv",
            "srv/work",
            "var",
            "proc",
            "dev",
            "sys",
            "run",
        )
    ]
    entries += [("tmp", "dir", None, 0o1777), ("bin/busybox", "file", BUSYBOX, 0o755)]
    for applet in _applets():
        if applet not in ("bin/busybox",):
            entries.append((applet, "symlink", "/bin/busybox", 0o777))
    entries += [
        ("etc/os-release", "file", OS_RELEASE, 0o644),
        (
            "etc/passwd",
            "file",
            "root:x:0:0:root:/root:/bin/sh\ntester:x:1000:1000:tester:/home/tester:/bin/sh\n",
            0o644,
        ),
        ("etc/group", "file", "root:x:0:\ntester:x:1000:\n", 0o644),
        ("etc/removed-by-layer2", "file", "lower\n", 0o644),
        ("opaque", "dir", None, 0o755),
        ("opaque/lower-a", "file", "a\n", 0o644),
        ("opaque/lower-b", "file", "b\n", 0o644),
    ]
    return entries


_LAYER2: list[Entry] = [
    ("etc/.wh.removed-by-layer2", "whiteout", None, 0o644),
    ("opaque/.wh..wh..opq", "whiteout", None, 0o644),
    ("opaque/upper", "file", "upper\n", 0o644),
    ("etc/layer2", "file", "from layer 2\n", 0o644),
]
BUSYBOX_CONFIG = {
    "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "BOXLITE_TEST_IMAGE=busybox", "WITH_EQUALS=a=b"],
    "WorkingDir": "/srv/work",
    "User": "root",
    "Entrypoint": ["/bin/sh", "-c"],
    "Cmd": ["cat /etc/os-release"],
}


def _ldd(paths: list[str]) -> set[str]:
    libs: set[str] = set()
    for p in paths:
        try:
            out = subprocess.run(["ldd", p], capture_output=True, text=True, timeout=30, check=False).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        for line in out.splitlines():
            m = re.search(r"(/\S+) \(0x", line)
            if m:
                libs.add(m.group(1))
    return libs


def _glibc_files() -> list[Entry]:
    """The host's loader and the libraries its interpreters need, at their own (real) paths."""
    interpreters = {os.path.realpath(sys.executable), os.path.realpath("/usr/bin/python3")}
    targets = [i for i in interpreters if os.path.exists(i)]
    for interp in list(targets):
        proc = subprocess.run(
            [interp, "-c", "import sysconfig; print(sysconfig.get_config_var('DESTSHARED') or '')"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        dyn = proc.stdout.strip()
        if dyn and os.path.isdir(dyn):
            targets += sorted(str(p) for p in Path(dyn).glob("*.so"))
    entries: list[Entry] = []
    dirs: set[str] = set()
    # Merged /usr as on the host: /lib -> usr/lib and so on, so the loader's paths hold.
    links = {}
    for top in ("lib", "lib64", "lib32", "libx32"):
        p = Path("/") / top
        if p.is_symlink():
            links[top] = os.readlink(p).lstrip("/")
            entries.append((top, "symlink", links[top], 0o777))
    for lib in sorted(_ldd(targets)):
        if lib.startswith(("/root/", "/home/", "/tmp/", "/opt/")):
            continue  # the interpreter's own tree: mounted into the box, not part of the image
        real = os.path.realpath(lib).lstrip("/")
        alias = lib.lstrip("/")
        top = alias.split("/")[0]
        if top in links:
            alias = links[top] + alias[len(top) :]
        for path in (real, alias):
            parts = Path(path).parent.parts
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in dirs and d.split("/")[0] not in links:
                    dirs.add(d)
                    entries.append((d, "dir", None, 0o755))
        entries.append((real, "file", Path("/") / real, 0o755))
        if alias != real:
            # Absolute, as Debian's loader link is: the unpacker keeps it inside the image.
            entries.append((alias, "symlink", f"/{real}", 0o777))
    # Directories before their files, in order.
    entries.sort(key=lambda e: (e[1] != "dir", e[0]))
    return entries


def _inputs_key() -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(repr((sys.executable, sys.version, _ARCH)).encode())
    for p in (BUSYBOX, Path("/lib64/ld-linux-x86-64.so.2"), Path("/lib/x86_64-linux-gnu/libc.so.6")):
        with contextlib.suppress(OSError):
            st = p.stat()
            h.update(f"{p}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def build_all(out: Path) -> dict[str, str]:
    """Build every test image under ``out``; returns name -> reference."""
    if not BUSYBOX.is_file():
        raise ImagesUnavailable(
            f"{BUSYBOX} is missing: install Debian's busybox-static (apt-get install busybox-static) "
            "to build the test images"
        )
    out.mkdir(parents=True, exist_ok=True)
    base, upper = layer_tar(_busybox_base()), layer_tar(_LAYER2)
    refs: dict[str, str] = {}
    oci = oci_layout(out / "busybox-oci", [base, upper], gzip_layers=(True, False), cfg=BUSYBOX_CONFIG)
    refs["busybox-oci"] = f"oci:{oci}:latest"
    refs["busybox"] = f"oci-archive:{_tar_dir(oci, out / 'busybox.tar')}"
    refs["busybox-docker"] = "docker-archive:" + str(
        docker_archive(
            out / "busybox-docker.tar", [base, upper], cfg=BUSYBOX_CONFIG, repo_tag="boxlite-test/busybox:latest"
        )
    )
    glibc_layer = layer_tar(_glibc_files())
    glibc_cfg = {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "BOXLITE_TEST_IMAGE=glibc"]}
    g = oci_layout(out / "glibc-oci", [base, glibc_layer], gzip_layers=(True, True), cfg=glibc_cfg)
    refs["glibc"] = f"oci-archive:{_tar_dir(g, out / 'glibc.tar')}"
    shutil.rmtree(g)
    whole = (out / "busybox.tar").read_bytes()
    (out / "truncated.tar").write_bytes(whole[: len(whole) // 2])
    refs["truncated"] = f"oci-archive:{out / 'truncated.tar'}"
    # A layer of its own (no other image has its digest, so no store holds a good copy of it).
    own = layer_tar([*_LAYER2, ("etc/corrupt", "file", "this layer's bytes are altered\n" * 40, 0o644)])
    corrupt = oci_layout(out / "corrupt-oci", [base, own], gzip_layers=(True, False), cfg=BUSYBOX_CONFIG)
    blob = corrupt / "blobs" / "sha256" / hashlib.sha256(own).hexdigest()
    data = bytearray(blob.read_bytes())
    data[600] ^= 0xFF  # inside the first member's data: same size, other bytes
    blob.write_bytes(bytes(data))
    refs["corrupt"] = f"oci:{corrupt}"
    other = oci_layout(out / "other-arch-oci", [upper], arch=_OTHER_ARCH, index_arch=_OTHER_ARCH)
    refs["other-arch"] = f"oci-archive:{_tar_dir(other, out / 'other-arch.tar')}"
    shutil.rmtree(other)
    noshell = oci_layout(
        out / "no-shell-oci", [layer_tar([("etc", "dir", None, 0o755), ("etc/os-release", "file", OS_RELEASE, 0o644)])]
    )
    refs["no-shell"] = f"oci-archive:{_tar_dir(noshell, out / 'no-shell.tar')}"
    shutil.rmtree(noshell)
    # Paths as "{OUT}/...": the cache builds in a temporary directory and renames it.
    (out / "refs.json").write_text(
        json.dumps({k: v.replace(str(out), "{OUT}") for k, v in refs.items()}, sort_keys=True)
    )
    return refs


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # bounded by the builder's own run time (seconds)
        yield
    finally:
        os.close(fd)


def test_images(cache_dir: Path) -> dict[str, str]:
    """Name -> reference of every test image, built once into ``cache_dir`` per set of inputs.

    Safe for concurrent callers (xdist workers).  Raises :class:`ImagesUnavailable` saying why
    where they cannot be built (no busybox-static).
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / f"images-{_inputs_key()}"
    done = final / "refs.json"
    if not done.exists():
        with _lock(cache_dir / ".build.lock"):
            if not done.exists():
                work = Path(tempfile.mkdtemp(prefix="build-", dir=cache_dir))
                try:
                    build_all(work)
                    os.chmod(work, 0o755)
                    os.rename(work, final)
                except BaseException:
                    shutil.rmtree(work, ignore_errors=True)
                    raise
    refs: dict[str, str] = json.loads(done.read_text())
    return {k: v.replace("{OUT}", str(final)) for k, v in refs.items()}


def shared_cache(tmp_path_factory: Any) -> Path:
    """The test images' cache for a pytest session: shared by its xdist workers (their base
    temporary directories' parent) and, outside xdist, kept across sessions (keyed by inputs)."""
    return Path(tmp_path_factory.getbasetemp()).parent / "boxlite-test-images"


test_images.__test__ = False  # type: ignore[attr-defined]  # not a test, though its name says so


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.images.build OUTDIR", file=sys.stderr)
        return 2
    try:
        refs = build_all(Path(argv[0]).resolve())
    except ImagesUnavailable as exc:
        print(f"cannot build the test images: {exc}", file=sys.stderr)
        return 1
    for name, ref in sorted(refs.items()):
        print(f"{name}\t{ref}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
