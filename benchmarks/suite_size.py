"""Per-test cost against the module's size: one parametrized test of ``--tests`` cases and one of
``--big`` cases, plain and ``--boxlite`` (interleaved rounds; the big rows run ``--big-rounds``
rounds, a big boxed run is long).  The per-test overhead should not grow with the module."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks import _rows, _suites
from benchmarks._bench import RunFailed, Table, Workdir, div, fmt_ratio, machine_header, option, seconds
from benchmarks._rows import Row

TARGET = 0.10  # the per-test overhead of both sizes within 10% (by p50)


def add_arguments(p: argparse.ArgumentParser) -> None:
    option(p, "--tests", 200, 20, help="cases of the small module")
    option(p, "--big", 2000, 100, help="cases of the big module")
    option(p, "--rounds", 3, 1, help="interleaved rounds")
    option(p, "--big-rounds", 1, help="rounds of the big rows")
    option(p, "--timeout", 1200.0, 300.0, type=seconds, help="bound on each pytest run, seconds")


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    with Workdir("suite-size") as work:
        suites = {
            "small": _suites.parametrized(work.root / "small", args.tests),
            "big": _suites.parametrized(work.root / "big", args.big),
        }
        rows = [
            Row("small", f"{args.tests} cases, plain", "small"),
            Row("small-boxed", f"{args.tests} cases, --boxlite", "small", ("--boxlite",), base="small"),
            Row("big", f"{args.big} cases, plain", "big", rounds=args.big_rounds),
            Row("big-boxed", f"{args.big} cases, --boxlite", "big", ("--boxlite",), base="big", rounds=args.big_rounds),
        ]
        try:
            res = _rows.measure(rows, suites, work, rounds=args.rounds, timeout=args.timeout)
        except RunFailed as exc:
            return _rows.failed(exc), {}
    small, big = res["small-boxed"], res["big-boxed"]
    by_wall = div(big["overhead"], small["overhead"])
    by_p50 = div(big["overhead_p50"], small["overhead_p50"])
    ok = by_p50 is not None and abs(by_p50 - 1) <= TARGET
    out = [
        *machine_header(),
        f"per-test cost against the module's size: {args.tests} and {args.big} parametrized cases",
        "",
        *_rows.render(res),
        "",
        f"target: per-test overhead, {args.big} cases / {args.tests} cases: wall {fmt_ratio(by_wall)}, "
        f"p50 {fmt_ratio(by_p50)} (within {TARGET:.0%} by p50: {'holds' if ok else 'DOES NOT HOLD'})",
        "",
        *_rows.commands(res),
    ]
    print("\n".join(out), flush=True)
    return 0, {"rows": res}


SUITE_SIZE = Table("suite-size", "per-test cost of 200 against 2,000 parametrized cases, plain and --boxlite",
                   __doc__ or "", add_arguments, run)  # fmt: skip
