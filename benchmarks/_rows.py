"""Rows of pytest runs measured side by side: interleaved rounds, each row against its base.

Every row of a round runs (a separate pytest process) before the next round starts, so a load
change hits all rows alike; each row keeps the median of its rounds.  Per run: the wall (woken by
the process's exit, a pidfd), its CPU seconds (``_bench.CpuMeter``: a cgroup per run, which counts
every process of the run, boxes reaped by their own init included, which no rusage of the run
sees; or, where no cgroup can be made, the machine's busy CPU from ``/proc/stat``, which counts
anything else running on the machine too), and the host-side time of each test (logstart ->
logfinish, from the suite's conftest).

Derived, per row against its base row: wall overhead per test = (wall - base wall) / tests;
p50 overhead = the row's per-test p50 minus its base's; CPU per test = (CPU - base CPU) / tests;
cores = CPU seconds over the wall (how much of the machine a row keeps busy).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _bench
from benchmarks._bench import (
    QUIET_ARGS,
    ROOT,
    RunFailed,
    Workdir,
    boxlite_summary,
    check_passed,
    clean_env,
    div,
    failure_text,
    fmt_delta,
    fmt_ratio,
    leak_check,
    log,
    table,
)
from benchmarks._suites import Suite


@dataclasses.dataclass
class Row:
    """One configuration of a pytest run."""

    key: str
    label: str
    suite: str
    args: tuple[str, ...] = ()
    python: str = sys.executable
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    #: The row this one is measured against.
    base: str | None = None
    #: Runs in a private ``--boxlite-home`` that is leak-checked (default: any ``--boxlite*`` argument).
    boxed: bool | None = None
    #: At most this many rounds (long rows).
    rounds: int | None = None
    #: ``python -m pytest <nodeid>`` once per test for this many of the suite's tests; the wall and
    #: CPU are the mean of one invocation scaled to the suite's size.
    each_test: int = 0
    #: Shown against the peer row (``render``'s last column).
    compare: bool = True
    #: Runs per round (a cheap row whose figure is a small difference: more samples for its median).
    repeat: int = 1

    def __post_init__(self) -> None:
        if self.boxed is None:
            self.boxed = any(a.startswith("--boxlite") for a in self.args)


def _timed(
    row: Row, cmd: list[str], suite: Suite, work: Workdir, timeout: float, want: int
) -> tuple[float, float | None, list[float], str]:
    timing = work.root / f"timing-{row.key}.json"
    home = None
    if row.boxed:
        home = work.home(row.key)
        cmd = [*cmd, "--boxlite-home", str(home)]
    env = clean_env(BENCH_TIMING_FILE=str(timing), **row.env)
    rc, out, wall, timed_out, cpu = _bench.METER.run(cmd, cwd=suite.path, env=env, timeout=timeout)
    check_passed(row.label, cmd, rc, out, timed_out, want, timeout)
    # Under xdist the controller logs a test's start and finish together when its worker reports
    # it: those times mean nothing, so such rows are judged by wall and CPU only.
    times = json.loads(timing.read_text()) if timing.exists() and "-n" not in row.args else []
    timing.unlink(missing_ok=True)
    if home is not None:
        leak_check(row.label, home)
        shutil.rmtree(home, ignore_errors=True)
    return wall, cpu, times, out


def shown(python: str) -> str:
    """An interpreter as a command shows it: ``python`` for this one, else its path (from the root)."""
    if python == sys.executable:
        return "python"
    path = Path(python)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else python


def one_run(row: Row, suite: Suite, work: Workdir, timeout: float) -> dict[str, Any]:
    """One measured run of ``row`` (or, for an ``each_test`` row, its invocations)."""
    base_cmd = [row.python, "-m", "pytest", *QUIET_ARGS, *row.args]
    if row.each_test:
        picked = suite.nodeids[: row.each_test]
        walls: list[float] = []
        cpus: list[float | None] = []
        for nodeid in picked:
            wall, cpu, _, _ = _timed(row, [*base_cmd, nodeid], suite, work, min(timeout, 120.0), 1)
            walls.append(wall)
            cpus.append(cpu)
        scale = suite.tests / len(picked)
        known = [c for c in cpus if c is not None]
        return {
            "wall": sum(walls) * scale,
            "cpu": sum(known) * scale if len(known) == len(cpus) else None,
            "times": walls,
            "summary": None,
            "command": shlex.join([Path(row.python).name, *base_cmd[1:], "<nodeid>"]) + "  # once per test",
        }
    wall, cpu, times, out = _timed(row, base_cmd, suite, work, timeout, suite.tests)
    return {
        "wall": wall,
        "cpu": cpu,
        "times": times,
        "summary": boxlite_summary(out),
        "command": shlex.join([shown(row.python), *base_cmd[1:]]),
    }


def measure(
    rows: Sequence[Row], suites: dict[str, Suite], work: Workdir, *, rounds: int, timeout: float
) -> dict[str, dict[str, Any]]:
    """Every row, ``rounds`` interleaved rounds after an untimed warm-up of each interpreter."""
    log(f"{len(rows)} rows, {rounds} interleaved round(s)")
    warmed: set[tuple[str, str]] = set()
    for row in rows:
        # Untimed: byte-code and assertion-rewrite caches of each interpreter and suite, page cache.
        if not row.boxed and not row.each_test and (row.python, row.suite) not in warmed:
            warmed.add((row.python, row.suite))
            one_run(row, suites[row.suite], work, timeout)
    runs: dict[str, list[dict[str, Any]]] = {r.key: [] for r in rows}
    for rnd in range(rounds):
        for row in rows:
            if row.rounds is not None and rnd >= row.rounds:
                continue
            for _ in range(row.repeat):
                res = one_run(row, suites[row.suite], work, timeout)
                runs[row.key].append(res)
                log(f"  [{rnd + 1}/{rounds}] {row.label}: {res['wall']:.2f} s")
    return derive(rows, suites, runs)


def derive(
    rows: Sequence[Row], suites: dict[str, Suite], runs: dict[str, list[dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    """Medians per row, and each row against its base."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        rs = runs[row.key]
        times = [t for r in rs for t in r["times"]]
        cpu_known = all(r["cpu"] is not None for r in rs)
        n = suites[row.suite].tests
        out[row.key] = {
            "label": row.label,
            "tests": n,
            "base": row.base,
            "walls": [r["wall"] for r in rs],
            "wall": statistics.median(r["wall"] for r in rs),
            "p50": statistics.median(times) if times else None,
            "cpu": statistics.median(r["cpu"] for r in rs) if cpu_known else None,
            # Cores kept busy: the machine's busy CPU seconds over the wall, per run, then the median.
            "cores": statistics.median(r["cpu"] / r["wall"] for r in rs) if cpu_known else None,
            "command": rs[-1]["command"],
            "env": row.env,
            "compare": row.compare,
            "summary": rs[-1]["summary"],
        }
    for r in out.values():
        base = out.get(r["base"]) if r["base"] else None
        if base is None:
            continue
        r["ratio"] = r["wall"] / base["wall"]
        r["overhead"] = (r["wall"] - base["wall"]) / r["tests"]
        r["overhead_p50"] = r["p50"] - base["p50"] if r["p50"] is not None and base["p50"] is not None else None
        r["overhead_cpu"] = (
            (r["cpu"] - base["cpu"]) / r["tests"] if r["cpu"] is not None and base["cpu"] is not None else None
        )
    return out


def render(
    res: dict[str, dict[str, Any]], *, peer: str | None = None, by: str = "overhead", skipped: Sequence[str] = ()
) -> list[str]:
    """The rows as a table; with ``peer`` (a row key), each row's ``by`` (``overhead``,
    ``overhead_cpu``) over the peer's as a last column."""
    p = res.get(peer) if peer else None
    header = ["row", "tests", "wall", "cores", "x base", "wall/test", "p50/test", "CPU/test"]
    if peer:
        header.append(f"{'CPU' if by == 'overhead_cpu' else 'wall'} / {peer}")
    rows = []
    for r in res.values():
        has_base = r["base"] is not None and "overhead" in r
        cells = [
            r["label"],
            str(r["tests"]),
            f"{r['wall']:.2f} s",
            "-" if r["cores"] is None else f"{r['cores']:.2f}",
            fmt_ratio(r["ratio"]) if has_base else "base",
            fmt_delta(r["overhead"]) if has_base else "-",
            fmt_delta(r["overhead_p50"]) if has_base else "-",
            fmt_delta(r["overhead_cpu"]) if has_base else "-",
        ]
        if peer:
            cells.append(fmt_ratio(div(r.get(by), p.get(by))) if has_base and r["compare"] and p is not None else "")
        rows.append(cells)
    for reason in skipped:
        rows.append([f"skipped: {reason}", *[""] * (len(header) - 1)])
    return [
        *table(header, rows),
        "x base, wall/test, p50/test, CPU/test: against the row's base (an unboxed run in the same "
        "interpreter), per test; cores: the run's CPU seconds over the wall",
    ]


def commands(res: dict[str, dict[str, Any]]) -> list[str]:
    """Each row's command (its cwd: the generated suite; boxed rows add a private --boxlite-home)."""
    out = ["commands (cwd: the generated suite; boxed rows also get a private --boxlite-home):"]
    for r in res.values():
        env = " ".join(f"{k}={v}" for k, v in r["env"].items())
        out.append(f"  {r['label']}: {env + ' ' if env else ''}{r['command']}")
    return out


def failed(exc: RunFailed) -> int:
    """Report a failed run (its command and output tail); the table's exit status."""
    log(failure_text(exc))
    return 1
