"""Issue 15's ``boxlite_sandbox`` row, side by side with another checkout, and the per-phase cost
of one forked sandbox box.

Usage::

    python benchmarks/bench_sandbox_fork.py [--tests N] [--repeat R] [--before DIR] [--phases K] [--json PATH]

Rows (interleaved ``R`` times, each keeps its median wall time; suites as bench_issue15.py writes
them: ``N`` tests that each take ``boxlite_sandbox`` and run ``execute_command("true")``, and
``N`` trivial tests as their base):

* ``trivial (sandbox base)``;
* ``boxlite_sandbox + one command``: this checkout (sandbox boxes forked from a zygote);
* the same with ``--before DIR`` on ``PYTHONPATH`` first (a checkout of another commit, e.g.
  ``git archive f67d490 | tar -x -C DIR``: booted sandbox boxes), when given.

Overhead per test = (row wall - base wall) / N; "p50 overhead" = the row's per-test host p50
(logstart -> logfinish) minus the base's.

Phases (``--phases K`` boxes, 0 to skip), measured in this process on a namespace runtime with
forking on, one box at a time (no pool, nothing overlapping): the zygote's boot (once), then per
box: create (the fork: request -> clone -> pristine layers -> agent ready), one
``execute_command("true")``, destroy; and, for comparison, the same on booted boxes.  Medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_issue15 as b15  # noqa: E402
from _bench import cli, log, positive  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tests", type=positive, default=200, help="boxlite_sandbox tests (default: 200)")
    p.add_argument("--repeat", type=positive, default=3, help="interleaved repetitions (default: 3)")
    p.add_argument("--before", type=Path, help="a checkout of another commit to run side by side")
    p.add_argument("--phases", type=int, default=40, help="boxes for the per-phase breakdown (default: 40)")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on each pytest run, seconds")
    p.add_argument("--json", metavar="PATH", type=Path, help="also write the results as JSON")
    return p.parse_args(argv)


def rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    py = sys.executable
    out: list[dict[str, Any]] = [
        {"key": "base", "label": "trivial (sandbox base)", "suite": "sandbox-base", "args": []},
        {"key": "after", "label": "boxlite_sandbox + one command (this checkout)", "suite": "sandbox", "args": []},
    ]
    if args.before is not None:
        before = str(args.before.resolve())
        out.append(
            {
                "key": "before",
                "label": f"boxlite_sandbox + one command ({args.before.name})",
                "suite": "sandbox",
                "args": [],
                "env": {"PYTHONPATH": before},
            }
        )
    for r in out:
        r.setdefault("env", {})
        r["python"] = py
        r["boxed"] = r["key"] != "base"
        if r["boxed"]:
            r["base"] = "base"
    return out


def measure(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    ns = argparse.Namespace(tests=1, sandbox_tests=args.tests, big=1)
    suites = b15.write_suites(root, ns)
    table = rows(args)
    runs: dict[str, list[dict[str, Any]]] = {r["key"]: [] for r in table}
    for rep in range(args.repeat):
        for row in table:
            res = b15.one_run(row, suites, root, args.timeout)
            runs[row["key"]].append(res)
            log(f"  [{rep + 1}/{args.repeat}] {row['label']}: {res['wall']:.2f} s")
    out: dict[str, Any] = {}
    for row in table:
        rs = runs[row["key"]]
        times = [t for r in rs for t in r["times"]]
        out[row["key"]] = {
            "label": row["label"],
            "walls": [r["wall"] for r in rs],
            "wall": statistics.median(r["wall"] for r in rs),
            "p50": statistics.median(times) if times else None,
            "command": rs[-1]["command"],
            "env": row["env"],
        }
    base = out["base"]
    for key, r in out.items():
        if key != "base":
            r["overhead"] = (r["wall"] - base["wall"]) / args.tests
            r["overhead_p50"] = r["p50"] - base["p50"] if r["p50"] is not None and base["p50"] is not None else None
    return out


def _tree_cpu(pid: int | None) -> float:
    """CPU seconds of ``pid`` and of the children it has reaped (a zygote: its forked boxes)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def phases(k: int) -> dict[str, Any]:
    """Median seconds per phase of ``k`` forked boxes, and of ``k`` booted ones, one at a time; and
    the CPU each forked box costs (this process; the zygote and the boxes it reaped)."""
    from pytest_boxlite.runtimes.namespace import NamespaceRuntime
    from pytest_boxlite.sandbox import Sandbox
    from pytest_boxlite.spec import BoxSpec

    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pbx-phases-") as home:
        rt = NamespaceRuntime(Path(home))
        try:
            for mode, fork in (("forked", True), ("booted", False)):
                rt.allow_forked_boxes(fork)
                spec = BoxSpec()
                t0 = time.perf_counter()
                first = rt.create_box(spec, f"pbx-phase{mode[0]}-1", timeout=60)
                res[f"{mode} first create (zygote boot + fork)" if fork else "booted first create"] = (
                    time.perf_counter() - t0
                )
                first.destroy()
                create, command, destroy = [], [], []
                zygote = rt._zygotes._boxes.get(spec) if fork else None
                zpid = zygote.agent_pid if zygote is not None else None
                cpu0, zcpu0 = _self_cpu(), _tree_cpu(zpid)
                for i in range(2, k + 2):
                    t0 = time.perf_counter()
                    h = rt.create_box(spec, f"pbx-phase{mode[0]}-{i}", timeout=60)
                    t1 = time.perf_counter()
                    assert Sandbox(h).execute_command("true").exit_code == 0
                    t2 = time.perf_counter()
                    h.destroy()
                    t3 = time.perf_counter()
                    create.append(t1 - t0)
                    command.append(t2 - t1)
                    destroy.append(t3 - t2)
                res[mode] = {
                    "create": statistics.median(create),
                    "command": statistics.median(command),
                    "destroy": statistics.median(destroy),
                }
                if fork:
                    time.sleep(1.5)  # the zygote reaps its ended boxes within a second
                    res[mode]["cpu_host"] = (_self_cpu() - cpu0) / k
                    res[mode]["cpu_zygote_and_boxes"] = (_tree_cpu(zpid) - zcpu0) / k
        finally:
            rt.close()
    return res


def render(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = [f"{args.tests} tests, median of {args.repeat} interleaved runs (wall s; overhead per test)"]
    for key, r in res["rows"].items():
        extra = ""
        if key != "base":
            p50 = r["overhead_p50"]
            extra = f"  overhead wall {r['overhead'] * 1e3:+.1f} ms, p50 " + (
                f"{p50 * 1e3:+.1f} ms" if p50 is not None else "-"
            )
        env = " ".join(f"{k}={v}" for k, v in r["env"].items())
        lines.append(f"  {r['label']:<52} {r['wall']:7.2f} s{extra}")
        lines.append(f"      {env + ' ' if env else ''}{r['command']}")
    ph = res.get("phases")
    if ph:
        lines.append("per-phase (median wall, one box at a time):")
        for k, v in ph.items():
            if isinstance(v, dict):
                lines.append(
                    f"  {k}: create {v['create'] * 1e3:.1f} ms, execute_command('true') {v['command'] * 1e3:.1f} ms, "
                    f"destroy {v['destroy'] * 1e3:.1f} ms"
                )
                if "cpu_host" in v:
                    lines.append(
                        f"  {k}: CPU per box (create + command + destroy): this process "
                        f"{v['cpu_host'] * 1e3:.1f} ms, zygote and the box itself "
                        f"{v['cpu_zygote_and_boxes'] * 1e3:.1f} ms"
                    )
            else:
                lines.append(f"  {k}: {v * 1e3:.1f} ms")
    return lines


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="pbx-bench-sbxfork-") as root:
        load = os.getloadavg()
        res: dict[str, Any] = {"rows": measure(args, Path(root))}
        if args.phases > 0:
            res["phases"] = phases(args.phases)
        end = os.getloadavg()
    print(f"load average {load[0]:.2f} at the start, {end[0]:.2f} at the end, on {os.cpu_count()} CPUs")
    print("\n".join(render(res, args)))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli(parse_args, run, interrupted="the temporary directory was removed", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
