"""``python -m tests.images.perf [DIR ...]``: what the image store costs (issue 25's performance bounds).

Builds an image of real files (the busybox base layer plus a layer of each ``DIR``, default
Debian's ``/usr/lib/python3.11``; gzip layers, as an oci-archive), then times, in fresh stores,
the first :func:`~pytest_boxlite.images.ensure_image` (blobs verified and copied, layers
unpacked) and the second (the store's answer).  A measurement, not a test: the machine is
shared, so the CPU time is printed too.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from pytest_boxlite.images import ensure_image
from pytest_boxlite.images.store import _rmtree

from .build import _busybox_base, _tar_dir, layer_tar, oci_layout

ROUNDS = 5


def main(argv: list[str]) -> int:
    dirs = argv or ["/usr/lib/python3.11"]
    work = Path(tempfile.mkdtemp(prefix="image-perf-"))
    try:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for d in dirs:
                tf.add(d, arcname=d.lstrip("/"), filter=lambda ti: None if "__pycache__" in ti.name else ti)
        layout = oci_layout(work / "oci", [layer_tar(_busybox_base()), buf.getvalue()], gzip_layers=(True, True))
        archive = _tar_dir(layout, work / "image.tar")
        ref = f"oci-archive:{archive}"
        first, second, cpu = [], [], []
        for n in range(ROUNDS):
            store = work / f"store{n}"
            t, c = time.perf_counter(), time.process_time()
            image = ensure_image(ref, store=store)
            first.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            t = time.perf_counter()
            ensure_image(ref, store=store)
            second.append(time.perf_counter() - t)
            _rmtree(store)
        print(
            f"load average {os.getloadavg()[0]:.2f}; image: {archive.stat().st_size / 1e6:.1f} MB archive, "
            f"{len(buf.getvalue()) / 1e6:.1f} MB of files, rootfs {image.size / 1e6:.1f} MB on disk"
        )
        print(f"first ensure_image:  p50 {statistics.median(first):.2f} s (min {min(first):.2f}, max {max(first):.2f})")
        print(f"first ensure_image's CPU time (this process, user+system): p50 {statistics.median(cpu):.2f} s")
        print(f"second ensure_image: p50 {statistics.median(second) * 1e3:.2f} ms (max {max(second) * 1e3:.2f})")
    finally:
        _rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
