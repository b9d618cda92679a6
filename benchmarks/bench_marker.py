"""Benchmark the per-test cost of running a trivial test inside a box, side by side with the alternatives.

Usage::

    python benchmarks/bench_marker.py [--tests N] [--per-module K] [--repeat R] [--json PATH]

It writes ``N`` trivial tests (``def test_i(): pass``, ``K`` per module) into
a temporary directory and runs them in separate pytest subprocesses, one row
each, all in one run (the rows are interleaved ``R`` times, and each row's
median wall time is kept, so load changes on a shared machine hit every row
alike):

* ``unmarked``: plain ``python -m pytest`` (pytest-boxlite installed but not
  asked for);
* ``--boxlite``: every test in a fresh box (warm pool, default replicas);
* ``--boxlite --boxlite-scope=module``: one box per module;
* ``unmarked (pytest 8)`` and ``--forked (pytest 8)``: pytest-forked, which
  fails every test under pytest 9, runs in a separate virtual environment
  with ``pytest>=8,<9`` (created once at ``benchmarks/.venv-pytest8`` and
  reused; the rows are skipped, with the reason, when pip cannot install it).
  Its overhead is taken against the unmarked run of that same environment;
* ``python -m pytest <nodeid>`` once per test: the subprocess-per-test baseline.

Every row runs with ``-q -p no:cacheprovider`` and, unless ``--all-plugins``,
with the installed plugins the suite does not use blocked (hypothesis,
pytest-benchmark): their import would otherwise dominate every pytest start.

Per-test overhead (wall) = (wall of the row - wall of its unmarked run) / N;
for the subprocess row, the mean time of one invocation minus the unmarked
per-test time (unmarked wall / N).  Wall times include each run's start-up
and shutdown (for boxed runs: opening the runtime, prewarming, reaping),
spread over the N tests.  The host-side p50 comes from a generated
``conftest.py`` that timestamps ``pytest_runtest_logstart`` and
``pytest_runtest_logfinish`` in the host process (junitxml durations would
not do: a boxed test's durations are measured inside the box and leave out
the lease and the round trip).

Every boxed run gets a private ``--boxlite-home``, checked afterwards with
``python -m pytest_boxlite --home H ls`` (it must say ``no boxes``).  A run
that fails, leaks or times out stops the benchmark with its output tail and
a non-zero exit status.  The table goes to stdout, progress to stderr; the
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
VENV = HERE / ".venv-pytest8"
VENV_REQUIREMENTS = ("pytest>=8,<9", "pytest-forked")
BASE_ARGS = ("-q", "-p", "no:cacheprovider")
#: Installed plugins the trivial suite does not use.  Importing hypothesis's plugin alone costs
#: ~1.5 s per pytest start here, which would dwarf everything in the subprocess-per-test row.
UNUSED_PLUGINS = ("-p", "no:hypothesispytest", "-p", "no:benchmark")
TAIL = 3000

CONFTEST = '''\
"""Host-side per-test timing for bench_marker.py (logstart -> logfinish in the process that logs reports)."""

import json
import os
import time

_start = {}
_times = []


def pytest_runtest_logstart(nodeid, location):
    _start[nodeid] = time.perf_counter()


def pytest_runtest_logfinish(nodeid, location):
    t0 = _start.pop(nodeid, None)
    if t0 is not None:
        _times.append(time.perf_counter() - t0)


def pytest_unconfigure(config):
    out = os.environ.get("BENCH_TIMING_FILE")
    # Not from a box's test worker (it sees the same conftest), nor from an xdist worker.
    if out and os.environ.get("PYTEST_BOXLITE_GUEST") != "1" and not hasattr(config, "workerinput"):
        with open(out, "w") as f:
            json.dump(_times, f)
'''


# -- helpers ----------------------------------------------------------------


def fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.2f} ms" if abs(ms) < 10 else f"{ms:.1f} ms"


def check_passed(what: str, cmd: list[str], rc: int, output: str, timed_out: bool, want: int, timeout: float) -> None:
    if timed_out:
        raise RunFailed(what, cmd, f"timed out after {timeout:.0f} s", output)
    m = re.search(r"(\d+) passed", output)
    passed = int(m.group(1)) if m else 0
    if rc != 0 or passed != want:
        raise RunFailed(what, cmd, f"exit status {rc}, {passed} of {want} tests passed", output)


def summary_line(output: str) -> str | None:
    """pytest-boxlite's own terminal summary line (boxes booted, lease waits, leaks)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip().startswith("boxes booted")]
    return lines[-1] if lines else None


# -- the pytest 8 environment -----------------------------------------------
def ensure_venv(timeout: float) -> tuple[Path | None, str]:
    """``benchmarks/.venv-pytest8`` with pytest 8 and pytest-forked: reused if usable, else (re)installed."""
    py = VENV / "bin" / "python"
    probe = (
        "import importlib.metadata as m, pytest, pytest_forked, sys; "
        "print('pytest', pytest.__version__, 'pytest-forked', m.version('pytest-forked')); "
        "sys.exit(0 if pytest.version_tuple[0] == 8 else 1)"
    )

    def usable() -> str | None:
        if not py.exists():
            return None
        rc, out, _, _ = run_bounded([str(py), "-c", probe], cwd=HERE, env=clean_env(), timeout=60)
        return out.strip() if rc == 0 else None

    versions = usable()
    if versions:
        return py, f"reused {VENV} ({versions})"
    if not py.exists():
        log(f"creating {VENV}")
        rc, out, _, _ = run_bounded([sys.executable, "-m", "venv", str(VENV)], cwd=HERE, env=clean_env(), timeout=300)
        if rc != 0:
            return None, f"python -m venv failed (exit {rc}): {out.strip()[-300:]}"
    # A generated environment: keep it out of git without touching the project's .gitignore.
    (VENV / ".gitignore").write_text("*\n")
    log(f"installing {' '.join(VENV_REQUIREMENTS)} into {VENV}")
    cmd = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *VENV_REQUIREMENTS]
    rc, out, _, timed_out = run_bounded(cmd, cwd=HERE, env=clean_env(), timeout=timeout)
    if rc != 0 or timed_out:
        why = "timed out" if timed_out else f"exit {rc}"
        return None, f"pip install {' '.join(VENV_REQUIREMENTS)} failed ({why}): {out.strip()[-300:]}"
    versions = usable()
    if not versions:
        return None, f"{VENV} has no usable pytest 8 + pytest-forked after pip install"
    return py, f"created {VENV} ({versions})"


# -- the suite ----------------------------------------------------------------
def write_suite(work: Path, n: int, per_module: int) -> list[str]:
    """N trivial tests in modules of ``per_module``; returns their node ids."""
    work.mkdir()
    (work / "pytest.ini").write_text("[pytest]\n")
    (work / "conftest.py").write_text(CONFTEST)
    nodeids = []
    modules = (n + per_module - 1) // per_module
    for m in range(modules):
        names = [f"test_{i}" for i in range(m * per_module, min(n, (m + 1) * per_module))]
        path = work / f"test_trivial_{m:03d}.py"
        path.write_text("".join(f"def {name}():\n    pass\n\n\n" for name in names).rstrip() + "\n")
        nodeids += [f"{path.name}::{name}" for name in names]
    return nodeids


ROWS: tuple[tuple[str, str, tuple[str, ...], bool, str], ...] = (
    # key, label, extra pytest args, boxed, baseline key
    ("unmarked", "unmarked", (), False, "unmarked"),
    ("boxed", "--boxlite", ("--boxlite",), True, "unmarked"),
    ("module", "--boxlite --boxlite-scope=module", ("--boxlite", "--boxlite-scope=module"), True, "unmarked"),
    ("unmarked8", "unmarked (pytest 8 venv)", (), False, "unmarked8"),
    ("forked", "--forked (pytest 8 venv)", ("--forked",), False, "unmarked8"),
)


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path, venv_python: Path | None) -> None:
        self.args = args
        self.root = root
        self.work = root / "work"
        self.homes = root / "homes"
        self.homes.mkdir()
        self.venv_python = venv_python
        self.base_args = BASE_ARGS if args.all_plugins else (*BASE_ARGS, *UNUSED_PLUGINS)
        self.nodeids = write_suite(self.work, args.tests, args.per_module)
        self.results: dict[str, dict[str, Any]] = {}
        self.commands: dict[str, str] = {}

    def python_for(self, key: str) -> str:
        if key in ("unmarked8", "forked"):
            assert self.venv_python is not None
            return str(self.venv_python)
        return sys.executable

    def rows(self) -> list[str]:
        keys = [k for k, *_ in ROWS if self.venv_python is not None or k not in ("unmarked8", "forked")]
        return [*keys, "subprocess"]

    def pytest_run(self, key: str, rep: int, *, timed: bool = True) -> None:
        _, label, extra, boxed, _ = next(r for r in ROWS if r[0] == key)
        cmd = [self.python_for(key), "-m", "pytest", *self.base_args, *extra]
        home = self.homes / f"{key}-{rep}"
        if boxed:
            cmd += ["--boxlite-home", str(home)]
        timing = self.root / f"timing-{key}-{rep}.json"
        env = clean_env(BENCH_TIMING_FILE=str(timing))
        rc, out, wall, timed_out = run_bounded(cmd, cwd=self.work, env=env, timeout=self.args.timeout)
        check_passed(label, cmd, rc, out, timed_out, len(self.nodeids), self.args.timeout)
        if not timed:
            return
        res = self.results.setdefault(key, {"label": label, "walls": [], "host": [], "boxlite": []})
        res["walls"].append(wall)
        res["host"] += json.loads(timing.read_text())
        note = f"{wall:.2f} s"
        if boxed:
            res["boxlite"].append(summary_line(out))
            res.setdefault("leak_checks", []).append(leak_check(label, home))
            shutil.rmtree(home, ignore_errors=True)
            note += ", leak check: no boxes"
        self.commands.setdefault(key, shlex.join(cmd))
        log(f"  {label}: {note}")

    def per_test_run(self, rep: int) -> None:
        label = "python -m pytest <nodeid> per test"
        res = self.results.setdefault("subprocess", {"label": label, "walls": [], "host": [], "boxlite": []})
        total = 0.0
        timeout = min(self.args.timeout, 120.0)
        for nodeid in self.nodeids:
            cmd = [sys.executable, "-m", "pytest", *self.base_args, nodeid]
            rc, out, wall, timed_out = run_bounded(cmd, cwd=self.work, env=clean_env(), timeout=timeout)
            check_passed(f"{label} ({nodeid})", cmd, rc, out, timed_out, 1, timeout)
            res["host"].append(wall)
            total += wall
            self.commands.setdefault("subprocess", shlex.join(cmd) + f"   # once per test, {len(self.nodeids)} runs")
        res["walls"].append(total)
        log(f"  {label}: {total:.2f} s in all, mean {total / len(self.nodeids) * 1e3:.0f} ms")

    def run(self) -> None:
        # Untimed warm-up: byte-code and assertion-rewrite caches of both interpreters, page cache.
        log("warm-up (untimed)")
        self.pytest_run("unmarked", -1, timed=False)
        if self.venv_python is not None:
            self.pytest_run("unmarked8", -1, timed=False)
        for rep in range(self.args.repeat):
            log(f"repetition {rep + 1}/{self.args.repeat}")
            for key in self.rows():
                if key == "subprocess":
                    self.per_test_run(rep)
                else:
                    self.pytest_run(key, rep)

    def analyse(self) -> dict[str, Any]:
        n = len(self.nodeids)
        out: dict[str, Any] = {}
        for key in self.rows():
            res = self.results[key]
            wall = statistics.median(res["walls"])
            base_key = "unmarked" if key == "subprocess" else next(r[4] for r in ROWS if r[0] == key)
            base = self.results[base_key]
            base_wall = statistics.median(base["walls"])
            base_p50 = statistics.median(base["host"])
            p50 = statistics.median(res["host"])
            if key == "subprocess":
                per_test = statistics.fmean(res["host"])
                overhead = per_test - base_wall / n
            else:
                per_test = wall / n
                overhead = (wall - base_wall) / n
            out[key] = {
                "label": res["label"],
                "baseline": base_key,
                "runs": len(res["walls"]),
                "walls": res["walls"],
                "wall": wall,
                "per_test": per_test,
                "overhead": overhead,
                "p50": p50,
                "overhead_p50": p50 - base_p50,
                "vs_unmarked": per_test / (base_wall / n),
                "boxlite": res["boxlite"],
                "host_samples": res["host"],
            }
        return out


# -- report -----------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "n/a (baseline overhead <= 0: within noise)"
    return f"{a / b:.1f}x"


def render(report: dict[str, Any]) -> str:
    meta = report["meta"]
    rows = report["rows"]
    n = meta["tests"]
    header = ("row", "runs", "wall", "per test", "overhead/test", "p50/test", "p50 overhead", "per test vs base")
    table = [header]
    for key, r in rows.items():
        is_base = key in ("unmarked", "unmarked8")
        table.append(
            (
                r["label"],
                str(r["runs"]),
                f"{r['wall']:.2f} s",
                fmt_ms(r["per_test"]),
                "-" if is_base else fmt_ms(r["overhead"]),
                fmt_ms(r["p50"]),
                "-" if is_base else fmt_ms(r["overhead_p50"]),
                "-" if is_base else f"{r['vs_unmarked']:.1f}x",
            )
        )
    for reason in meta["skipped"]:
        table.append(("--forked (pytest 8 venv)", "skipped", "", "", "", "", "", reason))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]

    def line(r: tuple[str, ...]) -> str:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        return "  ".join(cells).rstrip()

    load = meta["loadavg_start"]
    out = [
        f"pytest-boxlite per-test overhead: {n} trivial tests ({meta['per_module']} per module), "
        f"python {meta['python']}, pytest {meta['pytest']}, {meta['platform']}",
        f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {meta['cpus']} CPUs "
        "(a shared machine: absolute times are noisy; ratios are the headline)",
        f"boxlite runtime: {meta['runtime']}",
        f"pytest 8 environment: {meta['venv']}",
        "plugins: every installed one"
        if meta["all_plugins"]
        else "plugins: hypothesis and pytest-benchmark blocked in every row (-p no:...; --all-plugins keeps them)",
        f"wall = median of {meta['repeat']} interleaved runs; overhead/test = (wall - wall of its base run) / {n}; "
        "base = unmarked, or unmarked (pytest 8 venv) for --forked",
        "p50/test = host-side logstart->logfinish p50 over all runs (per invocation for the subprocess row); "
        "p50 overhead = minus the base's p50",
        "",
        line(header),
        line(tuple("-" * w for w in widths)),
        *(line(r) for r in table[1:]),
        "",
    ]
    sub = rows["subprocess"]
    for key in ("boxed", "module"):
        r = rows[key]
        out.append(
            f"subprocess-per-test / {r['label']}: overhead {ratio(sub['overhead'], r['overhead'])}, "
            f"p50 overhead {ratio(sub['overhead_p50'], r['overhead_p50'])}"
        )
    if "forked" in rows:
        f = rows["forked"]
        for key in ("boxed", "module"):
            r = rows[key]
            out.append(
                f"{r['label']} / --forked: overhead {ratio(r['overhead'], f['overhead'])}, "
                f"p50 overhead {ratio(r['overhead_p50'], f['overhead_p50'])}"
            )
    boxed = rows["boxed"]
    target = 0.060
    met = "met" if boxed["overhead_p50"] <= target else "NOT met"
    out.append(
        f"issue 6 targets: --boxlite p50 overhead {fmt_ms(boxed['overhead_p50'])} <= 60 ms: {met}; "
        f"subprocess-per-test / --boxlite p50 overhead {ratio(sub['overhead_p50'], boxed['overhead_p50'])} >= 5x: "
        + ("met" if boxed["overhead_p50"] > 0 and sub["overhead_p50"] / boxed["overhead_p50"] >= 5 else "NOT met")
    )
    for key in ("boxed", "module"):
        lines = [s for s in rows[key]["boxlite"] if s]
        if lines:
            out.append(f"pytest-boxlite summary ({rows[key]['label']}, last run): {lines[-1]}")
    out += ["", f"commands (cwd: the generated suite, {meta['work']}, removed afterwards; a fresh home per run):"]
    out += [f"  {c}" for c in meta["commands"].values()]
    return "\n".join(out)


# -- main -------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tests", type=positive, default=40, help="trivial tests per run (default: 40)")
    p.add_argument("--per-module", type=positive, default=10, help="tests per module (default: 10)")
    p.add_argument("--repeat", type=positive, default=3, help="interleaved repetitions of every row (default: 3)")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on each pytest run, seconds (default: 600)")
    p.add_argument("--no-forked", action="store_true", help="skip the pytest 8 / pytest-forked rows")
    p.add_argument(
        "--all-plugins",
        action="store_true",
        help="do not block the installed plugins the suite does not use (hypothesis, pytest-benchmark)",
    )
    p.add_argument("--json", metavar="PATH", type=Path, help="also write the full results, samples included, as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return cli(parse_args, run, interrupted="the temporary directory was removed", argv=argv)


def run(args: argparse.Namespace) -> int:
    import pytest

    from pytest_boxlite.runtimes import choose

    try:
        choice = choose("auto")
        runtime = f"{choice.kind} ({choice.reason})"
    except Exception as exc:  # noqa: BLE001 - shown, the boxed runs will fail on it
        runtime = f"unavailable: {exc}"
    meta: dict[str, Any] = {
        "python": platform.python_version(),
        "pytest": pytest.__version__,
        "platform": platform.platform(),
        "loadavg_start": os.getloadavg(),
        "cpus": os.cpu_count(),
        "tests": args.tests,
        "per_module": args.per_module,
        "repeat": args.repeat,
        "runtime": runtime,
        "all_plugins": args.all_plugins,
        "skipped": [],
    }
    venv_python: Path | None = None
    if args.no_forked:
        meta["venv"] = "not used (--no-forked)"
        meta["skipped"].append("--no-forked")
    else:
        venv_python, meta["venv"] = ensure_venv(args.timeout)
        if venv_python is None:
            log(f"--forked rows skipped: {meta['venv']}")
            meta["skipped"].append(meta["venv"])
    root = Path(tempfile.mkdtemp(prefix="pbx-bench-marker-"))
    meta["work"] = str(root / "work")
    try:
        bench = Bench(args, root, venv_python)
        try:
            bench.run()
        except RunFailed as exc:
            log(f"error: {exc}")
            log(f"command: {shlex.join(exc.cmd)}")
            log(f"output tail:\n{exc.output[-TAIL:]}")
            return 1
        rows = bench.analyse()
        meta["commands"] = bench.commands
    finally:
        with deferred_signals():
            for home in sorted(root.glob("homes/*")):
                # Only a run that was stopped half-way leaves anything here: reap it before removal.
                with contextlib.suppress(Exception):
                    cmd = [sys.executable, "-m", "pytest_boxlite", "--home", str(home), "clean"]
                    run_bounded(cmd, cwd=HERE, env=clean_env(), timeout=60)
            shutil.rmtree(root, ignore_errors=True)

    report = {"meta": meta, "rows": rows}
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
