"""Real projects' own test suites, unboxed, ``--boxlite``, module scope and pytest-forked.

The pinned sdists of click and python-dateutil come from the package index (``pip download
--no-deps --no-binary :all:``), unpacked, each into a virtual environment of the benchmarks' own
with its test dependencies and this checkout of pytest-boxlite (editable), and one with pytest 8
and pytest-forked (which fails every test under pytest 9); both are cached (``--cache-dir``) and
no test of theirs is changed.  Rows per suite, interleaved ``--suite-rounds`` times: unboxed;
``--boxlite``; ``--boxlite --boxlite-scope=module``; unboxed and ``--forked`` in the pytest 8
environment.  Each row: its wall, its tests' outcomes (pytest's summary), its CPU per test over
its unboxed base (``--cpu-meter``: a cgroup per run, every process of it and its boxes; or the
machine's busy CPU from ``/proc/stat``), and the ratio of its wall to the unboxed one.
A row whose outcomes differ from its base's shows both; one that timed out (``--suite-timeout``) or
broke most of its tests (pytest-forked errors on most of click's) gets no ratio.  Takes minutes;
not part of ``--quick``.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
from pathlib import Path
from typing import Any

from benchmarks import _bench, _sdists
from benchmarks._bench import (
    RunFailed,
    Skipped,
    Table,
    Workdir,
    clean_env,
    div,
    fmt_delta,
    fmt_ratio,
    leak_check,
    log,
    machine_header,
    positive,
    pytest_summary,
    seconds,
    summary_counts,
    table,
)
from benchmarks._sdists import Project

PROJECTS: dict[str, Project] = {
    "click": Project("click", "8.5.1", args=("tests",)),
    # Its requirements-dev.txt's test tools: pytest-cov registers the no_cover mark its tests use
    # (an unknown mark is an error under its filterwarnings = error).
    "dateutil": Project(
        "python-dateutil", "4.0.0", deps=("hypothesis", "freezegun", "pytest-cov", "attrs"), args=("tests",)
    ),
}
ARGS = ("-q", "-p", "no:cacheprovider")
#: The rows: key, label, environment flavour, extra pytest arguments, base.
ROWS: tuple[tuple[str, str, str, tuple[str, ...], str | None], ...] = (
    ("plain", "unboxed", "boxlite", (), None),
    ("boxed", "--boxlite", "boxlite", ("--boxlite",), "plain"),
    ("module", "--boxlite-scope=module", "boxlite", ("--boxlite", "--boxlite-scope=module"), "plain"),
    ("plain8", "unboxed (pytest 8 venv)", "pytest8", (), None),
    ("forked", "pytest-forked --forked", "pytest8", ("--forked",), "plain8"),
)
TARGET_BOXED = 3.0  # --boxlite wall <= 3x unboxed
TARGET_MODULE = 1.3  # module scope wall <= 1.3x unboxed


def add_suite_options(p: argparse.ArgumentParser) -> None:
    """The options of the real-suite rows (``cpu`` runs them too)."""
    p.add_argument("--suites", default=",".join(PROJECTS), help=f"comma-separated, of: {', '.join(PROJECTS)}")
    p.add_argument("--suite-rounds", type=positive, default=1, help="interleaved rounds of each suite (default: 1)")
    p.add_argument("--suite-timeout", type=seconds, default=900.0, help="bound on each suite run, s (default: 900)")
    p.add_argument("--no-forked", action="store_true", help="skip the pytest 8 / pytest-forked rows")
    p.add_argument("--cache-dir", type=Path, default=_sdists.DEFAULT_CACHE,
                   help="sdists and environments (default: %(default)s)")  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_suite_options(p)
    _bench.cpu_meter_option(p)


def _one(project: Project, src: Path, py: Path, key: str, label: str, extra: tuple[str, ...],
         work: Workdir, timeout: float) -> dict[str, Any]:  # fmt: skip
    cmd = [str(py), "-m", "pytest", *ARGS, *project.args, *extra]
    home = work.home(f"{project.name}-{key}") if extra and extra[0].startswith("--boxlite") else None
    if home is not None:
        cmd += ["--boxlite-home", str(home)]
    rc, out, wall, timed_out, cpu = _bench.METER.run(cmd, cwd=src, env=clean_env(), timeout=timeout)
    if home is not None:
        leak_check(f"{project.name} {label}", home, str(py))
        shutil.rmtree(home, ignore_errors=True)
    summary = pytest_summary(out)
    if timed_out:
        # A run that hangs is a row of the table (how far it got), not the end of the table.
        progress = [ln.split()[-1].strip("[]") for ln in out.splitlines() if ln.rstrip().endswith("%]")]
        summary = f"timed out after {timeout:.0f} s" + (f" at {progress[-1]}" if progress else "")
        log(f"  [{project.name}] {label}: {summary}; output tail:\n{out[-1500:]}")
    elif not summary:
        raise RunFailed(f"{project.name} {label}", cmd, f"exit {rc} and no pytest summary", out)
    return {
        "rc": rc,
        "timed_out": timed_out,
        "wall": wall,
        "cpu": cpu,
        "summary": summary,
        "counts": summary_counts(summary),
        "command": shlex.join(cmd).replace(str(home), "HOME") if home else shlex.join(cmd),
    }  # fmt: skip


def measure_project(project: Project, args: argparse.Namespace, work: Workdir) -> dict[str, Any]:
    src = _sdists.source(project, args.cache_dir)
    envs = {"boxlite": _sdists.venv(project, args.cache_dir, "boxlite")}
    rows = list(ROWS)
    skipped: list[str] = []
    if args.no_forked:
        rows = [r for r in rows if r[2] != "pytest8"]
        skipped.append("pytest-forked: --no-forked")
    else:
        try:
            envs["pytest8"] = _sdists.venv(project, args.cache_dir, "pytest8")
        except Skipped as exc:
            rows = [r for r in rows if r[2] != "pytest8"]
            skipped.append(f"pytest-forked: {exc}")
    runs: dict[str, list[dict[str, Any]]] = {r[0]: [] for r in rows}
    for rnd in range(args.suite_rounds):
        for key, label, flavour, extra, _ in rows:
            res = _one(project, src, envs[flavour], key, label, extra, work, args.suite_timeout)
            runs[key].append(res)
            log(f"  [{project.name} {rnd + 1}/{args.suite_rounds}] {label}: {res['wall']:.1f} s, {res['summary']}")
    plain = runs["plain"][-1]
    if not plain["counts"].get("passed"):
        raise Skipped(f"its unboxed run passed no test ({plain['summary']}): a broken environment, no baseline")
    out: dict[str, Any] = {"version": project.version, "rows": {}, "skipped": skipped}
    for key, label, _, _, base in rows:
        rs = runs[key]
        cpu_known = all(r["cpu"] is not None for r in rs)
        counts = rs[-1]["counts"]
        out["rows"][key] = {
            "label": label,
            "base": base,
            "tests": sum(counts.values()),
            "walls": [r["wall"] for r in rs],
            "wall": statistics.median(r["wall"] for r in rs),
            "cpu": statistics.median(r["cpu"] for r in rs) if cpu_known else None,
            "cores": statistics.median(r["cpu"] / r["wall"] for r in rs) if cpu_known else None,
            "summary": rs[-1]["summary"],
            "counts": counts,
            "rc": rs[-1]["rc"],
            "timed_out": any(r["timed_out"] for r in rs),
            "command": rs[-1]["command"],
        }
    for r in out["rows"].values():
        b = out["rows"].get(r["base"]) if r["base"] else None
        if b is None:
            continue
        r["same_outcomes"] = r["counts"] == b["counts"]
        # A row runs unless it timed out or most of its tests broke: pytest-forked's errors are no speed.
        broke = sum(r["counts"].get(k, 0) - b["counts"].get(k, 0) for k in ("failed", "error"))
        r["runs"] = not r["timed_out"] and not b["timed_out"] and broke <= b["tests"] / 2
        r["ratio"] = r["wall"] / b["wall"]
        n = b["tests"] or 1
        r["overhead"] = (r["wall"] - b["wall"]) / n
        r["overhead_cpu"] = (r["cpu"] - b["cpu"]) / n if r["cpu"] is not None and b["cpu"] is not None else None
    return out


def render(res: dict[str, Any], trivial: dict[str, dict[str, Any]] | None) -> list[str]:
    header = ["suite", "row", "tests", "wall", "x unboxed", "wall/test", "CPU/test", "cores", "outcomes"]
    rows = []
    lines: list[str] = []
    for name, p in res.items():
        if "error" in p:
            rows.append([name, f"not run: {p['error'][:150]}", *[""] * 7])
            continue
        for r in p["rows"].values():
            based = r["base"] is not None
            runs = not based or r["runs"]
            rows.append([
                f"{name} {p['version']}", r["label"], str(r["tests"]), f"{r['wall']:.1f} s",
                (fmt_ratio(r["ratio"]) if runs else "timed out" if r["timed_out"] else "does not run")
                if based
                else "base",
                fmt_delta(r["overhead"]) if based and runs else "-",
                fmt_delta(r["overhead_cpu"]) if based and runs else "-",
                "-" if r["cores"] is None else f"{r['cores']:.2f}",
                r["summary"] if not based or r["same_outcomes"]
                else f"{r['summary']} (base: {p['rows'][r['base']]['summary']})",
            ])  # fmt: skip
        for why in p["skipped"]:
            rows.append([name, f"skipped: {why[:150]}", *[""] * 7])
        boxed, module = p["rows"]["boxed"], p["rows"]["module"]
        for r, target in ((boxed, TARGET_BOXED), (module, TARGET_MODULE)):
            if not r["runs"]:
                lines.append(f"target: {name} {r['label']} <= {target}x unboxed: DOES NOT HOLD ({r['summary']})")
                continue
            verdict = "holds" if r["ratio"] <= target else "DOES NOT HOLD"
            lines.append(f"target: {name} {r['label']} {fmt_ratio(r['ratio'])} unboxed (<= {target}x: {verdict})")
    out = [*table(header, rows, left=(0, 1, 8)), "", *lines]
    if trivial:
        parts = []
        for key in ("boxed", "module", "forked"):
            if key in trivial and trivial[key].get("overhead_cpu") is not None:
                parts.append(f"{trivial[key]['label']} {fmt_delta(trivial[key]['overhead_cpu'])}")
        out.append("CPU per test of the trivial suite, beside: " + ", ".join(parts))
        for name, p in res.items():
            if "error" in p:
                continue
            r, t = p["rows"]["boxed"], trivial.get("boxed", {})
            ratio = div(r.get("overhead_cpu"), t.get("overhead_cpu"))
            out.append(f"  {name}: --boxlite CPU per test {fmt_ratio(ratio)} the trivial suite's")
    out.append(f"wall/test and CPU/test: over the row's unboxed base, per test of the base; cores: CPU / wall; "
               f"{_bench.METER.describe()}")  # fmt: skip
    out.append("commands (cwd: the unpacked sdist, under the cache; HOME: a private --boxlite-home):")
    for name, p in res.items():
        for r in p.get("rows", {}).values():
            out.append(f"  {name} {r['label']}: {r['command']}")
    return out


def run_suites(
    args: argparse.Namespace, trivial: dict[str, dict[str, Any]] | None = None
) -> tuple[int, dict[str, Any]]:
    names = [n.strip() for n in args.suites.split(",") if n.strip()]
    bad = [n for n in names if n not in PROJECTS]
    if bad:
        log(f"error: unknown suite {', '.join(bad)} (known: {', '.join(PROJECTS)})")
        return 2, {}
    args.cache_dir = args.cache_dir.resolve()
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {}
    rc = 0
    with Workdir("real-suites") as work:
        for name in names:
            try:
                res[name] = measure_project(PROJECTS[name], args, work)
            except Skipped as exc:
                log(f"[{name}] not run: {exc}")
                res[name] = {"error": str(exc)}
                rc = 1
            except RunFailed as exc:
                from benchmarks._bench import failure_text

                log(failure_text(exc))
                res[name] = {"error": str(exc)}
                rc = 1
    print("\n".join(["real suites (their own tests, from the sdists; wall: median of "
                     f"{args.suite_rounds} round(s))", *render(res, trivial)]), flush=True)  # fmt: skip
    return rc, res


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    meter = _bench.use_cpu_meter(args)
    print("\n".join([*machine_header(), meter.describe()]), flush=True)
    return run_suites(args)


REAL_SUITES = Table(
    "real-suites",
    "click's and python-dateutil's own suites unboxed, --boxlite, module scope, pytest-forked",
    __doc__ or "",
    add_arguments,
    run,
    in_quick=False,
)
