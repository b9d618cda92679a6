"""The ``boxlite_sandbox`` row, side by side with another checkout, and the per-phase cost of one
forked sandbox box.

Rows (interleaved ``--rounds`` times, each keeps its median wall time; suites: ``N`` tests that
each take ``boxlite_sandbox`` and run ``execute_command("true")``, and ``N`` trivial tests as
their base):

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
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _rows, _suites
from benchmarks._bench import RunFailed, Table, Workdir, machine_header, option, seconds
from benchmarks._rows import Row


def add_arguments(p: argparse.ArgumentParser) -> None:
    option(p, "--tests", 200, 20, help="boxlite_sandbox tests")
    option(p, "--rounds", 3, 1, help="interleaved rounds")
    p.add_argument("--before", type=Path, help="a checkout of another commit to run side by side")
    option(p, "--phases", 40, 5, type=int, help="boxes for the per-phase breakdown (0: none)")
    option(p, "--timeout", 600.0, 300.0, type=seconds, help="bound on each pytest run, seconds")


def rows(args: argparse.Namespace) -> list[Row]:
    out = [
        Row("base", "trivial (sandbox base)", "trivial"),
        Row("after", "boxlite_sandbox + one command (this checkout)", "sandbox", base="base", boxed=True),
    ]
    if args.before is not None:
        out.append(
            Row("before", f"boxlite_sandbox + one command ({args.before.name})", "sandbox", base="base", boxed=True,
                env={"PYTHONPATH": str(args.before.resolve())})
        )  # fmt: skip
    return out


def measure(args: argparse.Namespace, work: Workdir) -> dict[str, dict[str, Any]]:
    suites = {
        "trivial": _suites.trivial(work.root / "trivial", args.tests),
        "sandbox": _suites.sandbox(work.root / "sandbox", args.tests),
    }
    return _rows.measure(rows(args), suites, work, rounds=args.rounds, timeout=args.timeout)


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


def render(res: dict[str, Any]) -> list[str]:
    lines = [*_rows.render(res["rows"]), "", *_rows.commands(res["rows"])]
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


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    with Workdir("sandbox-fork") as work:
        try:
            res: dict[str, Any] = {"rows": measure(args, work)}
        except RunFailed as exc:
            return _rows.failed(exc), {}
    if args.phases > 0:
        res["phases"] = phases(args.phases)
    print("\n".join([*machine_header(), f"{args.tests} boxlite_sandbox tests, median of {args.rounds} round(s)",
                     "", *render(res)]), flush=True)  # fmt: skip
    return 0, res


SANDBOX_FORK = Table("sandbox-fork", "boxlite_sandbox tests beside another checkout's; a forked box's phases",
                     __doc__ or "", add_arguments, run)  # fmt: skip
