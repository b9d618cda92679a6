"""Benchmark a 200-test suite under pytest-xdist: locally, with a box per test, and with workers in boxes.

Usage::

    python benchmarks/bench_xdist.py [--tests N] [--workers W] [--repeat R] [--json PATH]

It writes ``N`` trivial tests (``def test_i(): pass``, ``--per-module`` per
module) into a temporary directory and runs the same suite, side by side in
one run, as separate pytest subprocesses:

* ``-n W``: locally, the baseline;
* ``--boxlite -n W``: every test in a fresh box (each worker has its own pool);
* ``--boxlite-scope=worker -n W``: each xdist worker runs inside a box of its
  own, and its tests run there unboxed.

With ``--repeat R`` the rows are interleaved ``R`` times and each row's median
wall time is kept.  The headline is each row's wall time as a multiple of the
local ``-n W`` run.  Every run gets a private ``--boxlite-home`` that is
checked afterwards with ``python -m pytest_boxlite --home H ls``, which must
say ``no boxes`` (leak check).  A run that fails, leaks or times out stops the
benchmark with its output tail and a non-zero exit status.  Every row runs
with ``-q -p no:cacheprovider`` and, unless ``--all-plugins``, with the
installed plugins the suite does not use blocked (hypothesis,
pytest-benchmark).  The table goes to stdout, progress to stderr; the
temporary directory is removed at the end.  Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _bench import RunFailed, clean_env, cli, deferred_signals, leak_check, log, positive, run_bounded

HERE = Path(__file__).resolve().parent
BASE_ARGS = ("-q", "-p", "no:cacheprovider")
#: Installed plugins the trivial suite does not use; hypothesis's alone costs ~1.5 s per pytest start here.
UNUSED_PLUGINS = ("-p", "no:hypothesispytest", "-p", "no:benchmark")
TAIL = 3000


# -- helpers ----------------------------------------------------------------


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.2f} ms" if abs(ms) < 10 else f"{ms:.1f} ms"


def write_suite(work: Path, n: int, per_module: int) -> None:
    work.mkdir()
    (work / "pytest.ini").write_text("[pytest]\n")
    for m in range((n + per_module - 1) // per_module):
        names = [f"test_{i}" for i in range(m * per_module, min(n, (m + 1) * per_module))]
        text = "".join(f"def {name}():\n    pass\n\n\n" for name in names).rstrip() + "\n"
        (work / f"test_trivial_{m:03d}.py").write_text(text)


# -- the runs -----------------------------------------------------------------
def rows(workers: int) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    n = ("-n", str(workers))
    return (
        ("local", f"-n {workers} (local)", n),
        ("boxed", f"--boxlite -n {workers}", ("--boxlite", *n)),
        ("worker", f"--boxlite-scope=worker -n {workers}", ("--boxlite-scope=worker", *n)),
    )


def measure(args: argparse.Namespace, root: Path) -> tuple[dict[str, Any], dict[str, str]]:
    work = root / "work"
    write_suite(work, args.tests, args.per_module)
    base = BASE_ARGS if args.all_plugins else (*BASE_ARGS, *UNUSED_PLUGINS)
    results: dict[str, dict[str, Any]] = {}
    commands: dict[str, str] = {}

    def one(key: str, label: str, extra: tuple[str, ...], rep: int, *, timed: bool = True) -> None:
        home = root / "homes" / f"{key}-{rep}"
        cmd = [sys.executable, "-m", "pytest", *base, *extra, "--boxlite-home", str(home)]
        rc, out, wall, timed_out = run_bounded(cmd, cwd=work, env=clean_env(), timeout=args.timeout)
        if timed_out:
            raise RunFailed(label, cmd, f"timed out after {args.timeout:.0f} s", out)
        m = re.search(r"(\d+) passed", out)
        passed = int(m.group(1)) if m else 0
        if rc != 0 or passed != args.tests:
            raise RunFailed(label, cmd, f"exit status {rc}, {passed} of {args.tests} tests passed", out)
        leaks = leak_check(label, home)
        shutil.rmtree(home, ignore_errors=True)
        if not timed:
            return
        res = results.setdefault(key, {"label": label, "walls": [], "boxlite": [], "leak_checks": []})
        res["walls"].append(wall)
        res["leak_checks"].append(leaks)
        summary = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("boxes booted")]
        res["boxlite"].append(summary[-1] if summary else None)
        commands.setdefault(key, shlex.join(cmd))
        log(f"  {label}: {wall:.2f} s, leak check: {leaks}")

    log("warm-up (untimed): byte-code and assertion-rewrite caches")
    one("warmup", "warm-up", ("-n", str(args.workers)), -1, timed=False)
    for rep in range(args.repeat):
        log(f"repetition {rep + 1}/{args.repeat}")
        for key, label, extra in rows(args.workers):
            one(key, label, extra, rep)
    local = statistics.median(results["local"]["walls"])
    for res in results.values():
        res["wall"] = statistics.median(res["walls"])
        res["ratio"] = res["wall"] / local
        res["overhead_per_test"] = (res["wall"] - local) / args.tests
    return results, commands


# -- report -----------------------------------------------------------------
def render(report: dict[str, Any]) -> str:
    meta = report["meta"]
    results = report["rows"]
    header = ("run", "runs", "wall", "vs local", "overhead/test", "leak check")
    table = [header]
    for key, r in results.items():
        table.append(
            (
                r["label"],
                str(len(r["walls"])),
                f"{r['wall']:.2f} s",
                f"{r['ratio']:.2f}x",
                "-" if key == "local" else fmt_ms(r["overhead_per_test"]),
                r["leak_checks"][-1] if all(c == "no boxes" for c in r["leak_checks"]) else "LEAK",
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]

    def line(r: tuple[str, ...]) -> str:
        cells = [c.ljust(w) if i in (0, 5) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        return "  ".join(cells).rstrip()

    load = meta["loadavg_start"]
    out = [
        f"pytest-boxlite xdist benchmark: {meta['tests']} trivial tests ({meta['per_module']} per module), "
        f"{meta['workers']} workers, python {meta['python']}, pytest {meta['pytest']}, {meta['platform']}",
        f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {meta['cpus']} CPUs "
        "(a shared machine: absolute times are noisy; ratios are the headline)",
        f"boxlite runtime: {meta['runtime']}",
        "plugins: every installed one"
        if meta["all_plugins"]
        else "plugins: hypothesis and pytest-benchmark blocked in every run (-p no:...; --all-plugins keeps them)",
        f"wall = median of {meta['repeat']} interleaved run(s); vs local = wall / wall of -n {meta['workers']} "
        f"(local); overhead/test = (wall - local wall) / {meta['tests']}",
        "leak check = `python -m pytest_boxlite --home <the run's home> ls` after the run",
        "",
        line(header),
        line(tuple("-" * w for w in widths)),
        *(line(r) for r in table[1:]),
        "",
    ]
    for key, r in results.items():
        lines = [s for s in r["boxlite"] if s]
        if key == "local":
            continue  # the controller prints an all-zero line even when no box is used
        if lines:
            out.append(f"pytest-boxlite summary ({r['label']}, last run): {lines[-1]}")
    out += ["", f"commands (cwd: the generated suite, {meta['work']}, removed afterwards; a fresh home per run):"]
    out += [f"  {c}" for c in meta["commands"].values()]
    return "\n".join(out)


# -- main -------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tests", type=positive, default=200, help="trivial tests in the suite (default: 200)")
    p.add_argument("--per-module", type=positive, default=10, help="tests per module (default: 10)")
    p.add_argument("--workers", type=positive, default=2, help="xdist workers, -n (default: 2)")
    p.add_argument("--repeat", type=positive, default=1, help="interleaved repetitions of every run (default: 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on each pytest run, seconds (default: 600)")
    p.add_argument(
        "--all-plugins",
        action="store_true",
        help="do not block the installed plugins the suite does not use (hypothesis, pytest-benchmark)",
    )
    p.add_argument("--json", metavar="PATH", type=Path, help="also write the full results as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return cli(parse_args, run, interrupted="the temporary directory was removed", argv=argv)


def run(args: argparse.Namespace) -> int:
    import pytest

    try:
        import xdist  # noqa: F401 - only its presence matters
    except ImportError:
        log("error: pytest-xdist is not installed (pip install -e '.[xdist]')")
        return 2
    from pytest_boxlite.runtimes import choose

    try:
        choice = choose("auto")
        runtime = f"{choice.kind} ({choice.reason})"
    except Exception as exc:  # noqa: BLE001 - shown; the boxed runs will fail on it
        runtime = f"unavailable: {exc}"
    meta: dict[str, Any] = {
        "python": platform.python_version(),
        "pytest": pytest.__version__,
        "platform": platform.platform(),
        "loadavg_start": os.getloadavg(),
        "cpus": os.cpu_count(),
        "tests": args.tests,
        "per_module": args.per_module,
        "workers": args.workers,
        "repeat": args.repeat,
        "runtime": runtime,
        "all_plugins": args.all_plugins,
    }
    root = Path(tempfile.mkdtemp(prefix="pbx-bench-xdist-"))
    meta["work"] = str(root / "work")
    try:
        try:
            results, meta["commands"] = measure(args, root)
        except RunFailed as exc:
            log(f"error: {exc}")
            log(f"command: {shlex.join(exc.cmd)}")
            log(f"output tail:\n{exc.output[-TAIL:]}")
            return 1
    finally:
        with deferred_signals():
            for home in sorted(root.glob("homes/*")):
                # Only a run that was stopped half-way (or leaked) leaves anything here: reap it first.
                with contextlib.suppress(Exception):
                    run_bounded(
                        [sys.executable, "-m", "pytest_boxlite", "--home", str(home), "clean"],
                        cwd=HERE,
                        env=clean_env(),
                        timeout=60,
                    )
            shutil.rmtree(root, ignore_errors=True)

    report = {"meta": meta, "rows": results}
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
