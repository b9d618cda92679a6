"""Scaling with the pool's size: trivial ``@pytest.mark.boxlite`` tests run with
``--boxlite-max-boxes`` 1, 2 and 4, beside the same suite unmarked (interleaved rounds; each run a
fresh, leak-checked ``--boxlite-home``)."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks import _rows, _suites
from benchmarks._bench import RunFailed, Table, Workdir, machine_header, option, positive, seconds
from benchmarks._rows import Row


def _replicas(text: str) -> list[int]:
    return [positive(x) for x in text.split(",")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    option(p, "--tests", 200, 20, help="marked trivial tests")
    option(p, "--per-module", 10, help="tests per module")
    option(p, "--replicas", [1, 2, 4], [1, 2], type=_replicas, help="comma-separated pool sizes")
    option(p, "--rounds", 1, help="interleaved rounds")
    option(p, "--timeout", 600.0, 300.0, type=seconds, help="bound on each pytest run, seconds")


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    with Workdir("replicas") as work:
        suites = {
            "unmarked": _suites.trivial(work.root / "unmarked", args.tests, args.per_module),
            "marked": _suites.trivial(work.root / "marked", args.tests, args.per_module, marked=True),
        }
        rows = [Row("unmarked", "unmarked", "unmarked")]
        rows += [
            Row(f"r{r}", f"marked, --boxlite-max-boxes {r}", "marked", ("--boxlite-max-boxes", str(r)), base="unmarked",
                boxed=True)
            for r in args.replicas
        ]  # fmt: skip
        try:
            res = _rows.measure(rows, suites, work, rounds=args.rounds, timeout=args.timeout)
        except RunFailed as exc:
            return _rows.failed(exc), {}
    first = f"r{args.replicas[0]}"
    out = [
        *machine_header(),
        f"scaling: {args.tests} trivial @pytest.mark.boxlite tests ({args.per_module} per module), "
        f"median of {args.rounds} round(s); last column: wall over replicas {args.replicas[0]}'s",
        "",
        *_rows.render(res, peer=first, by="wall"),
        "",
        *_rows.commands(res),
    ]
    print("\n".join(out), flush=True)
    return 0, {"rows": res}


REPLICAS = Table("replicas", "marked trivial tests with --boxlite-max-boxes 1, 2, 4", __doc__ or "", add_arguments, run)
