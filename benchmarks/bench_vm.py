"""The vm runtime's code path on the SDK double, beside the namespace runtime.

Usage::

    python benchmarks/bench_vm.py [--repeat N] [--tests N]

Where no micro-VM boots (this project's machines), ``vm`` here is the vm
runtime's real code (SDK calls, exec streams, base64 file transfers, the stdio
bridge) running on the boxlite SDK double of ``tests/sdk_double``, whose boxes
are bubblewrap sandboxes: the figures measure the plugin's overhead on the VM
path (text streams, framing, chunked input, per-exec SDK round trips), not a
micro-VM's.  For each runtime it prints, as p50 over ``--repeat`` runs:

* box create+start;
* ``Sandbox.run(["true"])``;
* 1 MiB and 20 MiB ``write_bytes`` + ``read_bytes`` round trips (sha256-checked);
* boxed-test overhead: ``--tests`` trivial tests with ``--boxlite`` minus the
  same run without it, per test (real pytest sub-runs).

The table goes to stdout, progress to stderr; every box is destroyed and the
temporary home removed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _bench import log

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import sdk_double  # noqa: E402 - the tests' SDK double

from pytest_boxlite.runtimes import Runtime, open_runtime, probe  # noqa: E402
from pytest_boxlite.runtimes.vm import VmRuntime, prepare_home  # noqa: E402
from pytest_boxlite.sandbox import Sandbox  # noqa: E402
from pytest_boxlite.spec import BoxSpec  # noqa: E402

MIB = 1 << 20


def p50(fn: Callable[[], Any], n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def open_kind(kind: str, home: Path) -> tuple[Runtime, str]:
    if kind == "vm" and not probe().vm_ok:
        return VmRuntime(prepare_home(home, "bench"), sdk=sdk_double), "vm (SDK double)"
    return open_runtime(kind, home, "bench"), kind


def bench_runtime(kind: str, home: Path, repeat: int) -> dict[str, float]:
    rt, label = open_kind(kind, home)
    out: dict[str, float] = {}
    try:
        boxes = []
        try:

            def start() -> None:
                boxes.append(rt.create_box(BoxSpec(), f"pbx-bench-{secrets.token_hex(4)}", timeout=120))

            out["create+start"] = p50(start, max(3, repeat // 4))
            sb = Sandbox(boxes[0])
            for _ in range(3):
                sb.run(["true"], timeout=30)
            out["run true"] = p50(lambda: sb.run(["true"], timeout=30), repeat)
            for size, name in ((MIB, "1 MiB"), (20 * MIB, "20 MiB")):
                data = os.urandom(size)
                digest = hashlib.sha256(data).hexdigest()

                def round_trip(data: bytes = data, digest: str = digest) -> None:
                    sb.write_bytes("bench.bin", data, timeout=120)
                    if hashlib.sha256(sb.read_bytes("bench.bin", timeout=120)).hexdigest() != digest:
                        raise AssertionError("round trip corrupted the data")

                out[f"{name} write+read"] = p50(round_trip, 3 if size > MIB else max(3, repeat // 4))
        finally:
            for b in boxes:
                b.destroy()
    finally:
        rt.close()
    log(f"{label}: done")
    out["label"] = label  # type: ignore[assignment]
    return out


def boxed_overhead(kind: str, n: int, work: Path) -> float:
    """Per-test cost of ``--boxlite`` over a local run of ``n`` trivial tests."""
    proj = work / f"proj-{kind}"
    proj.mkdir()
    (proj / "test_t.py").write_text(f"import pytest\n@pytest.mark.parametrize('i', range({n}))\ndef test_t(i): pass\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    if kind == "vm" and not probe().vm_ok:
        site = ROOT / "tests" / "sdk_double" / "site"
        env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(site)]), BOXLITE_SDK_DOUBLE="1")
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest"]
    base += [f"--boxlite-home={work / ('home-' + kind)}", f"--boxlite-runtime={kind}", "test_t.py"]

    def run(extra: list[str]) -> float:
        t = time.perf_counter()
        r = subprocess.run([*base, *extra], cwd=proj, env=env, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"sub-run failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        return time.perf_counter() - t

    local = run([])
    boxed = run(["--boxlite"])
    return (boxed - local) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--tests", type=int, default=20)
    args = ap.parse_args()
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-vm-") as tmp:
        work = Path(tmp)
        for kind in ("namespace", "vm"):
            res = bench_runtime(kind, work / f"rt-{kind}", args.repeat)
            label = str(res.pop("label"))
            if args.tests:
                res["boxed test overhead"] = boxed_overhead(kind, args.tests, work)
            rows[label] = res
    keys = list(next(iter(rows.values())))
    labels = list(rows)
    print(f"{'':22}" + "".join(f"{lab:>20}" for lab in labels))
    for k in keys:
        print(f"{k:22}" + "".join(f"{rows[lab][k] * 1000:>17.1f} ms" for lab in labels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
