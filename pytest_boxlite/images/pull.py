"""Registry references: pulled by a maintained client, then read like a local image.

The puller is the boxlite SDK's own (``Boxlite(...).images.pull``: it needs no KVM and boots
nothing), into a throw-away SDK home in the store's work directory, whose ``images/manifests``,
``configs`` and ``layers`` are then read by digest and verified like any local image's blobs (so
the store holds each layer once: the SDK's copies go with the work directory).  Where the SDK
cannot be imported, ``skopeo`` (Debian's package) is used if on ``PATH``: ``skopeo copy
docker://REF oci:DIR:TAG`` for this machine's platform.

``PYTEST_BOXLITE_INSECURE_REGISTRIES`` (``host:port`` list, comma-separated) names registries
reached over plain HTTP, as a container engine's insecure-registries setting does (a test's own
registry on 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import threading
from pathlib import Path
from typing import IO, Any

from pytest_boxlite.images import layout
from pytest_boxlite.images.layout import host_platform
from pytest_boxlite.images.reference import ImageError, Reference

__all__ = ["INSECURE_ENV", "PULL_TAG", "Pulled", "pull"]

PULL_TAG = "pulled"
INSECURE_ENV = "PYTEST_BOXLITE_INSECURE_REGISTRIES"
_MAX_ERR = 4000
_MAX_MANIFESTS = 4096


def _offline_hint(ref: Reference) -> str:
    return (
        f"bring it in as a local archive instead: on a machine with a registry, run "
        f"'skopeo copy docker://{ref.registry_ref()} oci-archive:IMAGE.tar' "
        f"(or 'docker save -o IMAGE.tar {ref.registry_ref()}') "
        f"and use image='oci-archive:/path/IMAGE.tar' (or 'docker-archive:/path/IMAGE.tar')"
    )


def _insecure() -> list[str]:
    return [h.strip() for h in os.environ.get(INSECURE_ENV, "").split(",") if h.strip()]


class Pulled:
    """What a pull left: either an OCI layout directory (skopeo) or a resolved image (the SDK)."""

    def __init__(self, *, layout_dir: Path | None = None, source: Any = None, resolved: Any = None) -> None:
        self.layout_dir = layout_dir
        self.source = source
        self.resolved = resolved


def pull(ref: Reference, work: Path, *, timeout: float) -> Pulled:
    """Pull registry image ``ref`` for this machine's platform into ``work``."""
    try:
        import boxlite
    except ImportError:
        boxlite = None
    why = "the boxlite SDK cannot be imported"
    if boxlite is not None:
        try:
            return _pull_sdk(boxlite, ref, work, timeout)
        except _SdkUnavailable as exc:
            why = f"the boxlite SDK cannot open a runtime here ({exc})"
    return Pulled(layout_dir=_pull_skopeo(ref, work, timeout, why))


class _SdkUnavailable(Exception):
    """The SDK refuses to open a runtime on this host (an ordinary user without KVM access)."""


def _run_bounded(coro_fn: Any, timeout: float) -> Any:
    """Run ``coro_fn()`` on an event loop of its own thread (the caller may be inside a loop)."""
    box: dict[str, Any] = {}

    def main() -> None:
        try:
            box["result"] = asyncio.run(asyncio.wait_for(coro_fn(), timeout))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, raised there
            box["error"] = exc

    t = threading.Thread(target=main, name="boxlite-image-pull", daemon=True)
    t.start()
    t.join(timeout + 30)
    if t.is_alive():
        raise TimeoutError
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _pull_sdk(bl: Any, ref: Reference, work: Path, timeout: float) -> Pulled:
    home = work / "sdk-home"
    name = ref.registry_ref()
    what = f"image {ref.original!r}"

    async def go() -> Any:
        registries = [bl.ImageRegistry(h, transport="http", skip_verify=True) for h in _insecure()]
        opts = bl.Options(home_dir=str(home), image_registries=registries)
        if not registries:
            opts = bl.Options(home_dir=str(home))
        try:
            rt = bl.Boxlite(opts)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the SDK cannot pull here
            raise _SdkUnavailable(" ".join(str(exc).split())[-_MAX_ERR:]) from None
        try:
            return await rt.images.pull(name)
        finally:
            # shutdown, not close: close() aborts the interpreter at its exit (boxlite 0.10).
            await rt.shutdown()

    try:
        result = _run_bounded(go, timeout)
    except _SdkUnavailable:
        raise
    except (TimeoutError, asyncio.TimeoutError):
        raise ImageError(f"{what}: pulling it did not finish within {timeout:.0f} s; or {_offline_hint(ref)}") from None
    except Exception as exc:  # noqa: BLE001 - the SDK's errors have no common base; each is reported
        text = " ".join(str(exc).split())[-_MAX_ERR:]  # one line: the SDK lists its tries on several
        raise ImageError(
            f"{what}: the boxlite SDK could not pull it (is the registry reachable, and is the name right?): "
            f"{text}; or {_offline_hint(ref)}"
        ) from None
    config_digest = str(getattr(result, "config_digest", ""))
    src = _SdkSource(home / "images", what)
    manifest = src.find_manifest(config_digest)
    if manifest is None:
        raise ImageError(
            f"{what}: the boxlite SDK pulled it but its manifest (config {config_digest}) is not in its store"
        )
    digest, data = manifest
    doc = layout._json(data, f"{what}: manifest {digest}")
    return Pulled(source=src, resolved=layout._manifest(src, digest, data, doc, what))


class _SdkSource(layout._Source):
    """The blobs an SDK pull left in its home: ``manifests/sha256-<hex>.json``, ``configs/...json``,
    ``layers/sha256-<hex>.tar.gz`` (whatever the layer's compression).  Checked like any source."""

    def __init__(self, images: Path, what: str) -> None:
        self.images = images
        self.what = what

    def _open(self, path: Path) -> tuple[IO[bytes], int] | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        return os.fdopen(fd, "rb"), st.st_size

    def small(self, name: str) -> bytes | None:
        return None

    def open_blob(self, hexd: str) -> tuple[IO[bytes], int] | None:
        for sub, suffix in (("layers", ".tar.gz"), ("layers", ".tar"), ("configs", ".json"), ("manifests", ".json")):
            found = self._open(self.images / sub / f"sha256-{hexd}{suffix}")
            if found is not None:
                return found
        return None

    def find_manifest(self, config_digest: str) -> tuple[str, bytes] | None:
        mdir = self.images / "manifests"
        if not mdir.is_dir():
            return None
        for n, entry in enumerate(sorted(mdir.iterdir())):
            if n >= _MAX_MANIFESTS:
                break
            hexd = entry.name.removeprefix("sha256-").removesuffix(".json")
            opened = self._open(entry)
            if opened is None:
                continue
            f, size = opened
            with f:
                if size > layout.MAX_JSON:
                    continue
                data = f.read(layout.MAX_JSON + 1)
            try:
                doc = layout._json(data, self.what)
            except ImageError:
                continue
            if isinstance(doc.get("config"), dict) and doc["config"].get("digest") == config_digest:
                return f"sha256:{hexd}", data
        return None


def _pull_skopeo(ref: Reference, work: Path, timeout: float, why: str) -> Path:
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        raise ImageError(
            f"image {ref.original!r}: no registry client is available to pull it ({why}, and skopeo is not "
            f"installed: 'apt-get install skopeo' provides one); or {_offline_hint(ref)}"
        )
    dest = work / "pulled"
    _os, arch = host_platform()
    # skopeo compresses a layer the registry serves uncompressed, which rewrites the manifest: the
    # same image would get another digest than its archive's and be stored twice.  Keep it as served.
    argv = [skopeo, "--override-os", "linux", "--override-arch", arch, "copy", "--quiet"]
    argv.append("--dest-oci-accept-uncompressed-layers")
    host = (ref.name or "").split("/", 1)[0]
    if host in _insecure():
        argv.append("--src-tls-verify=false")
    argv += [f"docker://{ref.registry_ref()}", f"oci:{dest}:{PULL_TAG}"]
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
            env={**os.environ, "LC_ALL": "C"},
        )
    except subprocess.TimeoutExpired:
        raise ImageError(
            f"image {ref.original!r}: pulling it did not finish within {timeout:.0f} s; or {_offline_hint(ref)}"
        ) from None
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip()[-_MAX_ERR:]
        raise ImageError(
            f"image {ref.original!r}: the registry could not be reached or has no such image: "
            f"skopeo said: {err}; or {_offline_hint(ref)}"
        )
    return dest
