"""``python -m benchmarks images [--boxes N]``: what a namespace box on an image costs next to one
on the host's files (issue 25: p50 within 1.2x, forked boxes included).

Per mode (booted: bubblewrap each; forked: from the spec's zygote, as sessions make sandboxes),
boxes of the two specs are made alternately (so the shared machine's load falls on both alike):
create, run ``true`` in it, destroy; the time of each is one sample.  The first box of each spec
(and its zygote) is not counted: "second and later boxes".  The image is a Debian-shaped tree (its
usual top-level directories, a static busybox, the host interpreter's libraries) packed as an OCI
layout and unpacked by the image store of a private home, as a session does.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._bench import Table, log, option, summary
from pytest_boxlite.images import ensure_image, store_dir
from pytest_boxlite.runtimes.namespace import NamespaceRuntime
from pytest_boxlite.spec import BoxSpec, ImageRoot

_TOPS = ("bin", "boot", "etc", "home", "lib", "lib64", "media", "mnt", "opt", "root", "sbin", "srv", "usr", "var")


def _tree(root: Path) -> None:
    for d in _TOPS:
        (root / d).mkdir(parents=True, exist_ok=True)
    busybox = shutil.which("busybox")
    if busybox is None:
        raise SystemExit("needs busybox (apt-get install busybox-static)")
    shutil.copy2(busybox, root / "bin" / "busybox")
    for applet in ("sh", "true", "cat"):
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "os-release").write_text('NAME="bench"\n')
    out = subprocess.run(["ldd", os.path.realpath(sys.executable)], capture_output=True, text=True, timeout=30).stdout
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if len(parts) >= 3 and parts[1] == "=>" else parts[0] if parts else ""
        if path.startswith("/"):
            target = root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(path), target)


def _layout(tree: Path, dest: Path) -> str:
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": "sha256:" + digest, "size": len(data)}

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(tree.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(tree)), recursive=False)
    layer = put(buf.getvalue())
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    config = {"architecture": arch, "os": "linux", "rootfs": {"type": "layers", "diff_ids": [layer["digest"]]}}
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **put(json.dumps(config).encode())},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **layer}],
    }
    entry = {
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        **put(json.dumps(manifest).encode()),
        "annotations": {"org.opencontainers.image.ref.name": "bench"},
    }
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return f"oci:{dest}:bench"


def _p50(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def add_arguments(p: argparse.ArgumentParser) -> None:
    option(p, "--boxes", 30, 5, help="boxes of each spec per mode, after the first")


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pbx-bench-img-") as tmp:
        base = Path(tmp)
        _tree(base / "tree")
        ref = _layout(base / "tree", base / "oci")
        home = base / "home"
        t0 = time.monotonic()
        img = ensure_image(ref, store=store_dir(home))
        unpack = time.monotonic() - t0
        t0 = time.monotonic()
        ensure_image(ref, store=store_dir(home))
        again = time.monotonic() - t0
        root = ImageRoot(ref, img.digest, str(img.rootfs))
        specs = {"host": BoxSpec(mounts=(os.getcwd(),)), "image": BoxSpec(image=ref, root=root, mounts=(os.getcwd(),))}
        rows = []
        rt = NamespaceRuntime(home)
        try:
            for mode in ("booted", "forked"):
                rt.allow_forked_boxes(mode == "forked")
                samples: dict[str, list[float]] = {"host": [], "image": []}
                for n in range(args.boxes + 1):
                    for kind, spec in specs.items():
                        t = time.monotonic()
                        box = rt.create_box(spec, f"pbx-bench{os.getpid()}-{mode[0]}{kind[0]}{n + 1}", timeout=60)
                        try:
                            r = box.exec(["true"], timeout=30)
                            assert r.exit_code == 0, r
                        finally:
                            box.destroy()
                        if n:
                            samples[kind].append(time.monotonic() - t)
                    log(f"images {mode}: {n}/{args.boxes}")
                host, image = _p50(samples["host"]), _p50(samples["image"])
                rows.append((mode, host, image, image / host))
                res[mode] = {"host": summary(samples["host"]), "image": summary(samples["image"])}
        finally:
            rt.close()
        res["unpack_s"], res["again_s"], res["size"] = unpack, again, img.size
        print(
            f"image of {img.size >> 20} MiB: first ensure_image (unpack) {unpack:.2f} s, second {again * 1000:.2f} ms"
        )
        print(f"{'boxes':<8}{'host p50 ms':>14}{'image p50 ms':>15}{'image/host':>12}")
        for mode, host, image, ratio in rows:
            print(f"{mode:<8}{host:>14.1f}{image:>15.1f}{ratio:>12.2f}")
    return 0, res


IMAGES = Table("images", "namespace boxes of an image beside boxes on the host's files; first and second unpack",
               __doc__ or "", add_arguments, run)  # fmt: skip
