"""The rows of issue 15's table, measured side by side in one run: boxed runs beside plain pytest,
pytest-forked and pytest-isolate (namespace runtime).

Usage::

    python benchmarks/bench_issue15.py [--tests N] [--repeat R] [--sandbox-tests N] [--big N] [--json PATH]

``benchmarks/bench_table.py`` runs the same measurement as one section of its table (``--only
issue15`` runs that section alone).  Suites, each written once into a temporary directory:

* ``N`` (200) trivial tests in ONE module (``def test_i(): pass``);
* ``--sandbox-tests`` (200) tests that each take ``boxlite_sandbox`` and run one
  ``execute_command("true")``, beside the same number of trivial tests as their base;
* one parametrized test of ``N`` cases and one of ``--big`` (2,000) cases (per-test cost against
  the module's size).

Rows (each run is a separate pytest process; every row of a repetition runs before the next
repetition starts, so load changes hit all rows alike; each row keeps its median wall time over
``R`` runs, and the p50 of the per-test host times logstart -> logfinish from a generated conftest):

* plain; plain with ``-p no:boxlite`` (what the plugin installed costs a run that boxes nothing);
  ``--boxlite``; ``--boxlite --boxlite-scope=module``;
* plain and ``--forked`` in the pytest 8 environment bench_marker.py keeps
  (``benchmarks/.venv-pytest8``: pytest-forked fails every test under pytest 9);
* plain and ``--isolate`` there with pytest-isolate on ``PYTHONPATH`` and pytest-forked blocked
  (as bench_table.py runs it);
* ``boxlite_sandbox`` + one command, and its trivial base;
* ``-n 2``, ``--boxlite -n 2``, ``--boxlite-scope=worker -n 2`` (pytest-xdist);
* the parametrized module of ``N`` and of ``--big`` cases, plain and ``--boxlite``
  (``--big-repeat`` runs: the big boxed run is long).

Overhead per test = (row wall - its base's wall) / tests; "p50 overhead" = the row's per-test p50
minus its base's; "cores" = the machine's busy CPU seconds during a run (``/proc/stat``) over its
wall, which says how much of the machine a row keeps busy (and so how much faster more xdist
workers could make it).  Every boxed run gets a private ``--boxlite-home``, checked afterwards with
``python -m pytest_boxlite --home H ls`` (it must say ``no boxes``).  The goals of issue 15 are
printed with ``holds`` / ``DOES NOT HOLD``.  The table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_marker as bm  # noqa: E402
from _bench import RunFailed, clean_env, cli, leak_check, log, machine_busy, positive, run_bounded  # noqa: E402

SANDBOX_TEST = """\
def test_sandbox_{i}(boxlite_sandbox):
    assert boxlite_sandbox.execute_command("true").exit_code == 0


"""

PARAM_MODULE = """\
import pytest


@pytest.mark.parametrize("i", range({n}))
def test_case(i):
    pass
"""

#: Issue 15's goals.
GOAL_FORKED = 2.0  # --boxlite overhead <= 2x pytest-forked's
GOAL_MODULE = 0.005  # --boxlite-scope=module: <= 5 ms per test
GOAL_SANDBOX = 0.015  # boxlite_sandbox + one command: <= 15 ms per test
GOAL_XDIST = 1.8  # --boxlite -n 2 at least 1.8x faster than --boxlite
GOAL_WORKER = 1.15  # --boxlite-scope=worker -n 2 <= 1.15x plain -n 2
GOAL_SIZE = 0.10  # per-test cost of 200 and 2,000 cases within 10%


def write_suites(root: Path, args: argparse.Namespace) -> dict[str, tuple[Path, int]]:
    """The suites: name -> (directory, number of tests)."""
    suites: dict[str, tuple[Path, int]] = {}

    def suite(name: str, files: dict[str, str], n: int) -> None:
        d = root / name
        d.mkdir()
        (d / "pytest.ini").write_text("[pytest]\n")
        (d / "conftest.py").write_text(bm.CONFTEST)
        for fname, text in files.items():
            (d / fname).write_text(text)
        suites[name] = (d, n)

    def trivial(n: int) -> str:
        return "".join(f"def test_{i}():\n    pass\n\n\n" for i in range(n))

    suite("trivial", {"test_trivial.py": trivial(args.tests)}, args.tests)
    suite(
        "sandbox",
        {"test_sandbox.py": "".join(SANDBOX_TEST.format(i=i) for i in range(args.sandbox_tests))},
        args.sandbox_tests,
    )
    suite("sandbox-base", {"test_trivial.py": trivial(args.sandbox_tests)}, args.sandbox_tests)
    suite("param-small", {"test_param.py": PARAM_MODULE.format(n=args.tests)}, args.tests)
    suite("param-big", {"test_param.py": PARAM_MODULE.format(n=args.big)}, args.big)
    return suites


def rows(args: argparse.Namespace, venv8: Path | None, isolate_env: dict[str, str] | None) -> list[dict[str, Any]]:
    """Every row: key, label, suite, python, extra args, env, whether boxed, its base's key."""
    py = sys.executable
    out: list[dict[str, Any]] = [
        {"key": "plain", "label": "plain", "suite": "trivial", "args": []},
        # What having the plugin installed costs a run that boxes nothing.
        {
            "key": "plain-off",
            "label": "plain, plugin off (-p no:boxlite)",
            "suite": "trivial",
            "args": ["-p", "no:boxlite"],
        },
        {"key": "boxed", "label": "--boxlite", "suite": "trivial", "args": ["--boxlite"], "base": "plain"},
        {
            "key": "module",
            "label": "--boxlite --boxlite-scope=module",
            "suite": "trivial",
            "args": ["--boxlite", "--boxlite-scope=module"],
            "base": "plain",
        },
        {"key": "sandbox-base", "label": "trivial (sandbox base)", "suite": "sandbox-base", "args": []},
        {
            "key": "sandbox",
            "label": "boxlite_sandbox + execute_command('true')",
            "suite": "sandbox",
            "args": [],
            "base": "sandbox-base",
            "boxed": True,
        },
        {"key": "n2", "label": "-n 2", "suite": "trivial", "args": ["-n", "2"]},
        {
            "key": "boxed-n2",
            "label": "--boxlite -n 2",
            "suite": "trivial",
            "args": ["--boxlite", "-n", "2"],
            "base": "n2",
        },
        {
            "key": "worker-n2",
            "label": "--boxlite-scope=worker -n 2",
            "suite": "trivial",
            "args": ["--boxlite-scope=worker", "-n", "2"],
            "base": "n2",
        },
        {"key": "param-small", "label": f"{args.tests} cases, plain", "suite": "param-small", "args": []},
        {
            "key": "param-small-boxed",
            "label": f"{args.tests} cases, --boxlite",
            "suite": "param-small",
            "args": ["--boxlite"],
            "base": "param-small",
        },
        {"key": "param-big", "label": f"{args.big} cases, plain", "suite": "param-big", "args": [], "big": True},
        {
            "key": "param-big-boxed",
            "label": f"{args.big} cases, --boxlite",
            "suite": "param-big",
            "args": ["--boxlite"],
            "base": "param-big",
            "big": True,
        },
    ]
    if venv8 is not None:
        out += [
            {"key": "plain8", "label": "plain (pytest 8 venv)", "suite": "trivial", "args": [], "python": str(venv8)},
            {
                "key": "forked",
                "label": "pytest-forked --forked (pytest 8 venv)",
                "suite": "trivial",
                "args": ["--forked"],
                "python": str(venv8),
                "base": "plain8",
            },
        ]
        if isolate_env is not None:
            out += [
                {
                    "key": "plain8-iso",
                    "label": "plain (pytest 8 venv, pytest-isolate loaded)",
                    "suite": "trivial",
                    "args": ["-p", "no:pytest_forked"],
                    "python": str(venv8),
                    "env": isolate_env,
                },
                {
                    "key": "isolate",
                    "label": "pytest-isolate --isolate (pytest 8 venv)",
                    "suite": "trivial",
                    "args": ["-p", "no:pytest_forked", "--isolate"],
                    "python": str(venv8),
                    "env": isolate_env,
                    "base": "plain8-iso",
                },
            ]
    for r in out:
        r.setdefault("python", py)
        r.setdefault("env", {})
        r["boxed"] = r.get("boxed", False) or any(a.startswith("--boxlite") for a in r["args"])
    return out


def one_run(row: dict[str, Any], suites: dict[str, tuple[Path, int]], root: Path, timeout: float) -> dict[str, Any]:
    work, n = suites[row["suite"]]
    cmd = [row["python"], "-m", "pytest", *bm.BASE_ARGS, *bm.UNUSED_PLUGINS, *row["args"]]
    home = None
    if row["boxed"]:
        home = Path(tempfile.mkdtemp(prefix="home-", dir=root))
        cmd += ["--boxlite-home", str(home)]
    timing = root / f"timing-{row['key']}.json"
    env = clean_env(BENCH_TIMING_FILE=str(timing), **row["env"])
    busy = machine_busy()
    rc, out, wall, timed_out = run_bounded(cmd, cwd=work, env=env, timeout=timeout)
    after = machine_busy()
    bm.check_passed(row["label"], cmd, rc, out, timed_out, n, timeout)
    res: dict[str, Any] = {"wall": wall, "summary": bm.summary_line(out)}
    res["cpu"] = after - busy if busy is not None and after is not None else None
    # Under xdist the controller logs a test's start and finish together when its worker reports
    # it: its conftest's times mean nothing there, so those rows are judged by wall only.
    times = json.loads(timing.read_text()) if timing.exists() else []
    res["times"] = [] if "-n" in row["args"] else times
    timing.unlink(missing_ok=True)
    if home is not None:
        leak_check(row["label"], home)
        shutil.rmtree(home, ignore_errors=True)
    res["command"] = (
        shlex.join([Path(cmd[0]).name, *cmd[1:]]).replace(str(home), "HOME")
        if home
        else shlex.join([Path(cmd[0]).name, *cmd[1:]])
    )
    return res


def measure(
    args: argparse.Namespace, root: Path, venv8: Path | None, isolate_env: dict[str, str] | None
) -> dict[str, Any]:
    suites = write_suites(root, args)
    table = rows(args, venv8, isolate_env)
    runs: dict[str, list[dict[str, Any]]] = {r["key"]: [] for r in table}
    log(f"issue 15 rows: {len(table)} rows, {args.repeat} interleaved repetitions ({args.big_repeat} of the big ones)")
    for rep in range(args.repeat):
        for row in table:
            if row.get("big") and rep >= args.big_repeat:
                continue
            res = one_run(row, suites, root, args.timeout)
            runs[row["key"]].append(res)
            log(f"  [{rep + 1}/{args.repeat}] {row['label']}: {res['wall']:.2f} s")
    out: dict[str, Any] = {"rows": {}, "tests": args.tests, "sandbox_tests": args.sandbox_tests, "big": args.big}
    for row in table:
        rs = runs[row["key"]]
        times = [t for r in rs for t in r["times"]]
        n = suites[row["suite"]][1]
        cpu_known = all(r["cpu"] is not None for r in rs)
        out["rows"][row["key"]] = {
            "label": row["label"],
            "tests": n,
            "walls": [r["wall"] for r in rs],
            "wall": statistics.median(r["wall"] for r in rs),
            "p50": statistics.median(times) if times else None,
            # Cores kept busy: the machine's busy CPU seconds over the wall, per run, then the median.
            "cores": statistics.median(r["cpu"] / r["wall"] for r in rs) if cpu_known else None,
            "cpu": statistics.median(r["cpu"] for r in rs) if cpu_known else None,
            "base": row.get("base"),
            "command": rs[-1]["command"],
            "summary": rs[-1]["summary"],
        }
    for _key, r in out["rows"].items():
        base = out["rows"].get(r["base"]) if r["base"] else None
        if base is not None:
            r["overhead"] = (r["wall"] - base["wall"]) / r["tests"]
            r["ratio"] = r["wall"] / base["wall"]
            r["overhead_p50"] = r["p50"] - base["p50"] if r["p50"] is not None and base["p50"] is not None else None
            r["overhead_cpu"] = (
                (r["cpu"] - base["cpu"]) / r["tests"] if r["cpu"] is not None and base["cpu"] is not None else None
            )
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:+.1f} ms"


def render(res: dict[str, Any]) -> list[str]:
    rows_ = res["rows"]
    lines = [
        f"issue 15 rows ({res['tests']} trivial tests in one module unless said; median wall of the interleaved runs)",
        f"  {'row':<48} {'wall':>8} {'cores':>6} {'base':>8} {'x base':>7} {'overhead/test':>14} {'p50 overhead':>13}",
    ]
    for _key, r in rows_.items():
        base = rows_.get(r["base"]) if r["base"] else None
        cores = f"{r['cores']:6.2f}" if r.get("cores") is not None else f"{'-':>6}"
        lines.append(
            f"  {r['label']:<48} {r['wall']:7.2f}s {cores} "
            + (
                f"{base['wall']:7.2f}s {r['ratio']:6.2f}x {_ms(r['overhead']):>14} {_ms(r['overhead_p50']):>13}"
                if base
                else f"{'':>8} {'':>7}"
            )
        )
    lines.append(
        f"  (cores: this machine's busy CPU seconds during a run over its wall, of {os.cpu_count()} cores; "
        "a quiet machine's figure)"
    )
    lines.append("")
    off = rows_.get("plain-off")
    if off is not None:
        cost = (rows_["plain"]["wall"] - off["wall"]) * 1e3
        lines.append(f"the plugin installed costs a run that boxes nothing {cost:+.0f} ms (plain vs -p no:boxlite)")
    lines.append("issue 15 goals:")

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("holds" if ok else "DOES NOT HOLD")

    boxed = rows_["boxed"]
    forked = rows_.get("forked")
    isolate = rows_.get("isolate")
    for name, peer in (("pytest-forked", forked), ("pytest-isolate", isolate)):
        if peer is None:
            lines.append(f"  --boxlite overhead vs {name}: not measured")
            continue
        by_wall = boxed["overhead"] / peer["overhead"] if peer["overhead"] > 0 else None
        by_p50 = (
            boxed["overhead_p50"] / peer["overhead_p50"]
            if boxed["overhead_p50"] is not None and peer["overhead_p50"]
            else None
        )
        ok = by_wall is not None and by_wall <= GOAL_FORKED if name == "pytest-forked" else None
        lines.append(
            f"  --boxlite overhead / {name}'s: wall {by_wall:.2f}x, p50 "
            + (f"{by_p50:.2f}x" if by_p50 is not None else "n/a")
            + (f" (goal <= {GOAL_FORKED:.0f}x of pytest-forked's, by wall: {verdict(ok)})" if ok is not None else "")
            if by_wall is not None
            else f"  --boxlite overhead vs {name}: {name}'s overhead not positive"
        )
        if boxed.get("overhead_cpu") is not None and peer.get("overhead_cpu"):
            lines.append(
                f"    CPU per test: --boxlite {_ms(boxed['overhead_cpu'])}, {name} {_ms(peer['overhead_cpu'])} "
                f"({boxed['overhead_cpu'] / peer['overhead_cpu']:.2f}x; --boxlite makes its next boxes "
                "while a test runs)"
            )
    m = rows_["module"]
    lines.append(
        f"  --boxlite-scope=module overhead per test {m['overhead'] * 1e3:.1f} ms "
        f"(goal <= {GOAL_MODULE * 1e3:.0f} ms: {verdict(m['overhead'] <= GOAL_MODULE)})"
    )
    s = rows_["sandbox"]
    steady = s["overhead_p50"]
    lines.append(
        f"  boxlite_sandbox + one command: p50 overhead {_ms(steady)} per test (steady state), wall "
        f"{_ms(s['overhead'])} per test (goal <= {GOAL_SANDBOX * 1e3:.0f} ms steady: "
        f"{verdict(steady is not None and steady <= GOAL_SANDBOX)})"
    )
    speedup = boxed["wall"] / rows_["boxed-n2"]["wall"]
    lines.append(
        f"  --boxlite -n 2 is {speedup:.2f}x faster than --boxlite (goal >= {GOAL_XDIST}x: "
        f"{verdict(speedup >= GOAL_XDIST)})"
    )
    if boxed.get("cores"):
        # More workers cannot make the work take less CPU: the cores --boxlite alone leaves idle
        # are all that -n 2 can add.
        cpus = os.cpu_count() or 1
        lines.append(
            f"    --boxlite alone keeps {boxed['cores']:.2f} of {cpus} cores busy: on this machine no "
            f"number of workers can make it more than {cpus / boxed['cores']:.2f}x faster"
        )
    w = rows_["worker-n2"]["ratio"]
    lines.append(
        f"  --boxlite-scope=worker -n 2 is {w:.2f}x plain -n 2 (goal <= {GOAL_WORKER}x: {verdict(w <= GOAL_WORKER)})"
    )
    small, big = rows_["param-small-boxed"], rows_["param-big-boxed"]
    size_ratio = big["overhead"] / small["overhead"] if small["overhead"] > 0 else None
    p50_ratio = big["overhead_p50"] / small["overhead_p50"] if small["overhead_p50"] and big["overhead_p50"] else None
    lines.append(
        f"  per-test overhead, {res['big']} cases / {res['tests']} cases: wall "
        + (f"{size_ratio:.2f}x" if size_ratio is not None else "n/a")
        + ", p50 "
        + (f"{p50_ratio:.2f}x" if p50_ratio is not None else "n/a")
        + f" (goal within {GOAL_SIZE:.0%}, by p50: "
        + verdict(p50_ratio is not None and abs(p50_ratio - 1) <= GOAL_SIZE)
        + ")"
    )
    lines.append("commands (HOME: a private --boxlite-home per run):")
    lines += [f"  {r['label']}: {r['command']}" for r in rows_.values()]
    return lines


def add_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument(f"--{prefix}tests", type=positive, default=200, help="trivial tests in the module (default: 200)")
    p.add_argument(f"--{prefix}repeat", type=positive, default=3, help="interleaved repetitions (default: 3)")
    p.add_argument(f"--{prefix}sandbox-tests", type=positive, default=200, help="boxlite_sandbox tests (default: 200)")
    p.add_argument(f"--{prefix}big", type=positive, default=2000, help="cases of the big module (default: 2000)")
    p.add_argument(f"--{prefix}big-repeat", type=positive, default=1, help="runs of the big rows (default: 1)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("--no-peers", action="store_true", help="skip pytest-forked and pytest-isolate")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on each pytest run, seconds (default: 600)")
    p.add_argument("--retry-isolate", action="store_true", help="try pip install pytest-isolate again")
    p.add_argument("--json", metavar="PATH", type=Path, help="also write the results as JSON")
    return p.parse_args(argv)


def peers(retry_isolate: bool, timeout: float) -> tuple[Path | None, dict[str, str] | None, list[str]]:
    """The pytest 8 python, pytest-isolate's environment, and why any of them is missing."""
    import bench_table  # not at import time: bench_table imports this module

    notes = []
    venv8, why = bm.ensure_venv(timeout)
    if venv8 is None:
        notes.append(f"pytest-forked rows skipped: {why}")
        return None, None, notes
    try:
        env, desc = bench_table.ensure_isolate(retry_isolate, timeout)
    except bench_table.Skipped as exc:
        notes.append(f"pytest-isolate rows skipped: {exc}")
        return venv8, None, notes
    notes.append(f"pytest 8 environment: {why}; {desc}")
    return venv8, env, notes


def run(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="pbx-bench-issue15-"))
    load = os.getloadavg()
    try:
        venv8, iso, notes = (
            (None, None, ["peers skipped (--no-peers)"]) if args.no_peers else peers(args.retry_isolate, args.timeout)
        )
        try:
            res = measure(args, root, venv8, iso)
        except RunFailed as exc:
            log(f"error: {exc}\ncommand: {shlex.join(exc.cmd)}\noutput tail:\n{exc.output[-bm.TAIL :]}")
            return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    end = os.getloadavg()
    print(f"load average {load[0]:.2f} at the start, {end[0]:.2f} at the end, on {os.cpu_count()} CPUs")
    print("\n".join([*notes, *render(res)]))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli(parse_args, run, interrupted="the temporary directory was removed", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
