"""What a box costs on a remote BoxLite server (``--boxlite-url``), measured through the SDK double's server.

Starts the double's server (``tests/sdk_double/rest.py``: a separate process, a local socket, so
no network cost is in these figures), then times ``RestRuntime.create_box`` without an upload and
with ``DIR`` (default: this interpreter's ``site-packages``) uploaded with ``copy_in``, and the
per-session content fingerprint of ``DIR``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._bench import HERE, ROOT, Table, machine_header, option
from pytest_boxlite.spec import BoxSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    option(p, "--upload", sysconfig.get_paths()["purelib"], str(HERE), type=str,
           help="the directory uploaded (this interpreter's site-packages; --quick: the benchmarks)")  # fmt: skip
    option(p, "--repeat", 3, 1, help="boots of each row")


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    sys.path.insert(0, str(ROOT / "tests"))
    import sdk_double
    from sdk_double.rest import ServerProcess

    from pytest_boxlite.runtimes.rest import RestRuntime, fingerprint, remote_target

    print("\n".join(machine_header()), flush=True)
    results: dict[str, Any] = {}
    upload = os.path.abspath(args.upload)
    size = sum(f.stat().st_size for f in Path(upload).rglob("*") if f.is_file() and not f.is_symlink())
    with tempfile.TemporaryDirectory() as tmp:
        srv = ServerProcess(Path(tmp) / "server", key="bench")
        try:
            target = remote_target(srv.url, credential_file=None, max_boxes=1, environ={"BOXLITE_API_KEY": "bench"})
            rt = RestRuntime(target, Path(tmp) / "scratch", "bench1", sdk=sdk_double)
            try:
                started = time.monotonic()
                fingerprint([upload])
                results["fingerprint"] = time.monotonic() - started
                print(f"fingerprint of {upload} ({size / 2**20:.0f} MiB): {time.monotonic() - started:.2f} s")
                for label, mounts in (("boot, no upload", ()), (f"boot + upload {size / 2**20:.0f} MiB", (upload,))):
                    times: list[float] = []
                    for i in range(args.repeat):
                        started = time.monotonic()
                        box = rt.create_box(BoxSpec(mounts=mounts), f"pbx-bench1-{len(times)}{i}", timeout=600)
                        times.append(time.monotonic() - started)
                        box.destroy()
                    results[label] = times
                    print(
                        f"{label}: median {statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f})"
                    )
            finally:
                rt.close()
        finally:
            srv.stop()
    return 0, results


REST = Table("rest", "a box on a remote server (the SDK double's): boot, upload, fingerprint", __doc__ or "",
             add_arguments, run)  # fmt: skip
