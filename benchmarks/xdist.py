"""Trivial tests under pytest-xdist: ``-n W`` locally, ``--boxlite -n W`` (each worker has its own
pool, a box per test) and ``--boxlite-scope=worker -n W`` (each xdist worker inside a box of its
own, its tests unboxed there), beside plain and ``--boxlite`` without xdist (interleaved rounds;
a private, leak-checked ``--boxlite-home`` per boxed run).  The cores column says how much of the
machine each row keeps busy: the cores a row leaves idle bound what more workers can gain."""

from __future__ import annotations

import argparse
import os
from typing import Any

from benchmarks import _rows, _suites
from benchmarks._bench import RunFailed, Table, Workdir, div, fmt_ratio, log, machine_header, option, seconds
from benchmarks._rows import Row

TARGET_SPEEDUP = 1.8  # --boxlite -n 2 at least 1.8x faster than --boxlite
TARGET_WORKER = 1.15  # --boxlite-scope=worker -n W <= 1.15x plain -n W


def add_arguments(p: argparse.ArgumentParser) -> None:
    option(p, "--tests", 200, 20, help="trivial tests")
    option(p, "--per-module", 10, help="tests per module")
    option(p, "--workers", 2, help="xdist workers, -n")
    option(p, "--rounds", 3, 1, help="interleaved rounds")
    option(p, "--timeout", 600.0, 300.0, type=seconds, help="bound on each pytest run, seconds")


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    try:
        import xdist  # noqa: F401 - only its presence matters
    except ImportError:
        log("error: pytest-xdist is not installed (pip install -e '.[xdist]')")
        return 2, {}
    n = ("-n", str(args.workers))
    w = args.workers
    with Workdir("xdist") as work:
        suites = {"trivial": _suites.trivial(work.root / "trivial", args.tests, args.per_module)}
        rows = [
            Row("plain", "plain", "trivial"),
            Row("boxed", "--boxlite", "trivial", ("--boxlite",), base="plain"),
            Row("local", f"-n {w}", "trivial", n),
            Row("boxed-n", f"--boxlite -n {w}", "trivial", ("--boxlite", *n), base="local"),
            Row("worker-n", f"--boxlite-scope=worker -n {w}", "trivial", ("--boxlite-scope=worker", *n), base="local"),
        ]
        try:
            res = _rows.measure(rows, suites, work, rounds=args.rounds, timeout=args.timeout)
        except RunFailed as exc:
            return _rows.failed(exc), {}
    speedup = div(res["boxed"]["wall"], res["boxed-n"]["wall"])
    worker = res["worker-n"]["ratio"]
    lines = [
        f"target: --boxlite -n {w} is {fmt_ratio(speedup)} faster than --boxlite (>= {TARGET_SPEEDUP}x: "
        f"{'holds' if speedup is not None and speedup >= TARGET_SPEEDUP else 'DOES NOT HOLD'})",
        f"target: --boxlite-scope=worker -n {w} is {fmt_ratio(worker)} plain -n {w} (<= {TARGET_WORKER}x: "
        f"{'holds' if worker <= TARGET_WORKER else 'DOES NOT HOLD'})",
    ]
    cores = res["boxed"]["cores"]
    if cores:
        cpus = os.cpu_count() or 1
        lines.append(
            f"--boxlite alone keeps {cores:.2f} of {cpus} cores busy: on this machine no number of workers "
            f"can make it more than {cpus / cores:.2f}x faster"
        )
    out = [
        *machine_header(),
        f"xdist: {args.tests} trivial tests ({args.per_module} per module), {w} workers, "
        f"median of {args.rounds} round(s)",
        "",
        *_rows.render(res),
        "",
        *lines,
        "",
        *_rows.commands(res),
    ]
    print("\n".join(out), flush=True)
    return 0, {"rows": res}


XDIST = Table("xdist", "trivial tests under -n W: local, --boxlite, worker scope", __doc__ or "", add_arguments, run)
