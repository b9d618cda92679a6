"""``python -m benchmarks TABLE [options]``: measure one table (``all``: every one), print it.

Run from the repository root.  Tables go to stdout, progress to stderr; ``--json PATH`` also
writes the results, samples included.  ``--quick`` makes every table small enough for CI (its
figures are only a smoke test of the measuring).  Every boxed run gets a private boxlite home,
checked afterwards (``python -m pytest_boxlite --home H ls`` must say ``no boxes``), and every
temporary directory is removed, also on Ctrl-C or SIGTERM.  The machine is shared: the load
average at the start is printed; ratios measured side by side in one run are the headline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import (
    boxes,
    fidelity,
    fork_profile,
    images,
    leases,
    memory,
    per_test,
    real_suites,
    remote_server,
    replicas,
    sandbox_fork,
    services,
    suite_size,
    vm_path,
    xdist,
)
from benchmarks._bench import Table, install_signal_handlers, log, resolve_defaults

TABLES: tuple[Table, ...] = (
    per_test.PER_TEST,
    per_test.CPU,
    replicas.REPLICAS,
    suite_size.SUITE_SIZE,
    xdist.XDIST,
    leases.POOL,
    boxes.BOX,
    boxes.FILES,
    memory.MEMORY,
    vm_path.VM,
    remote_server.REST,
    sandbox_fork.SANDBOX_FORK,
    fork_profile.PROFILE_FORK,
    real_suites.REAL_SUITES,
    fidelity.FIDELITY,
    services.SERVICES,
    images.IMAGES,
)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small counts, one round: a smoke test for CI")
    p.add_argument("--json", metavar="PATH", type=Path, help="also write the results, samples included, as JSON")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=(__doc__ or "").split("\n\n")[0],
        epilog=(__doc__ or "").split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = top.add_subparsers(dest="table", metavar="TABLE", required=True)
    for t in TABLES:
        p = sub.add_parser(t.name, help=t.summary, description=t.description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        t.add_arguments(p)
        _common(p)
    names = ", ".join(t.name for t in TABLES if t.in_all)
    p = sub.add_parser(
        "all",
        help="every table in turn (with --quick: those small enough for CI)",
        description=f"Every table in turn, each with its own defaults: {names}.  With --quick, those "
        "that have a quick form (all but " + ", ".join(t.name for t in TABLES if t.in_all and not t.in_quick) + ").",
    )
    p.add_argument("--keep-going", action="store_true", help="run the other tables after one fails")
    _common(p)
    return top


def run_all(args: argparse.Namespace, top: argparse.ArgumentParser) -> tuple[int, dict[str, Any]]:
    rc = 0
    results: dict[str, Any] = {}
    for t in TABLES:
        if not t.in_all or (args.quick and not t.in_quick):
            continue
        argv = [t.name, *(["--quick"] if args.quick else [])]
        if t is per_test.CPU:
            argv.append("--no-real-suites")  # the real-suites table runs them itself
        sub_args = resolve_defaults(top.parse_args(argv))
        log(f"== {t.name}")
        print(f"\n== python -m benchmarks {t.name}{' --quick' if args.quick else ''}", flush=True)
        started = time.monotonic()
        code, results[t.name] = t.run(sub_args)
        log(f"== {t.name}: exit {code}, {time.monotonic() - started:.0f} s")
        rc = rc or code
        if code and not args.keep_going:
            break
    return rc, results


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args = resolve_defaults(top.parse_args(argv))
    install_signal_handlers()
    started = time.monotonic()
    try:
        if args.table == "all":
            rc, results = run_all(args, top)
        else:
            table = next(t for t in TABLES if t.name == args.table)
            rc, results = table.run(args)
    except KeyboardInterrupt:
        log("interrupted: the boxes made so far were removed and the temporary directories deleted")
        return 130
    log(f"took {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
