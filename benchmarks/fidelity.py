"""Fidelity harness: real third-party test suites, run plain and boxed, compared test by test.

For each project it downloads the pinned sdist (``pip download --no-deps
--no-binary :all: NAME==VER``), unpacks it, makes a virtual environment for it
under the cache directory with the project, its pinned test dependencies,
pytest-xdist and *this checkout* of pytest-boxlite (editable, so a merge of new
plugin code shows at once), and runs the project's own test suite from the
unpacked sdist once per mode (the environments and sdists are those of ``_sdists``, shared with
``real-suites``):

* ``plain``: ``python -m pytest`` (the plugin installed, not asked to box);
* ``boxed``: ``--boxlite`` (a box per test);
* ``module``: ``--boxlite --boxlite-scope=module``;
* ``n2``: ``--boxlite -n 2``;
* ``worker-n2``: ``--boxlite-scope=worker -n 2`` (each xdist worker inside a box).

Every run writes a junit XML file; each boxed mode's per-test outcomes
(passed, failed, error, skipped, xfail) are compared with the plain run's, test
by test.  The table (stdout) gives per project and mode: tests, mismatches,
wall time, the ratio to the plain run's wall time, the exit status; then the
first ``--show`` mismatches of each run with the boxed side's message.  With
``--json`` everything (including all mismatches) also goes to a file.

Every external step is bounded (``--run-timeout`` per pytest run; downloads and
installs have their own bounds); a run that times out gets SIGTERM, then
SIGKILL, and is reported as such.  Every run has a private
``--boxlite-home`` that must be empty afterwards (leak check, reported in the
table).  The cache directory (default ``~/.cache/pytest-boxlite-benchmarks``; it
must not lie inside a directory with a pytest configuration, nor under /tmp,
which boxes do not see) keeps the sdists and venvs between runs; results of each run go to
``<cache>/runs/<project>/<mode>.{xml,log}``.  Exit status 1 if any run differs, leaks or fails.
"""

from __future__ import annotations

import argparse
import re
import shutil
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks import _sdists
from benchmarks._bench import Skipped, Table, clean_env, log, pytest_summary, run_bounded, seconds, summary_counts
from benchmarks._sdists import Project

#: Small, fast, self-contained suites (each < 60 s plain on a 2-core machine) that ship their tests in the sdist.
PROJECTS: dict[str, Project] = {
    p.name: p
    for p in (
        # conftest.py fixtures in a test directory, parametrize, tmp_path.
        Project("iniconfig", "2.3.1", args=("testing",)),
        # testing/conftest.py fixtures used by every module; the benchmark file needs pytest-benchmark.
        Project("pluggy", "1.7.0", deps=("pytest-benchmark==5.3.1", "coverage==7.17.5"), args=("testing",)),
        # unittest.TestCase classes and subTest; its three slowest tests (~60 s of ~80) are left out.
        Project(
            "more-itertools",
            "11.2.1",
            args=(
                "tests",
                "--deselect=tests/test_recipes.py::PrimeFunctionTests::test_primes",
                "--deselect=tests/test_recipes.py::PrimeFunctionTests::test_nth_prime_approximate",
                "--deselect=tests/test_more.py::DiscreteFourierTransformTests::test_roundtrip",
            ),
        ),
        # Tests inside the package (toolz/tests), --strict-config, log_cli_level, xfail_strict.
        Project("toolz", "1.2.0"),
        # conftest hooks, filterwarnings=error, log_level, --strict-config, pretend, monkeypatched platform
        # probes.  The whole suite is 62k tests (330 s plain here): its ~1,200 non-version/specifier tests.
        Project(
            "packaging",
            "26.3",
            deps=("pretend==1.0.9", "tomli-w==1.2.0", "hypothesis==6.170.17", "coverage[toml]==7.17.5"),
            args=tuple(
                f"tests/test_{m}.py"
                for m in (
                    "metadata",
                    "ranges",
                    "tags",
                    "utils",
                    "pylock",
                    "pylock_select",
                    "direct_url",
                    "dependency_groups",
                    "manylinux",
                    "musllinux",
                    "elffile",
                    "errors",
                    "licenses",
                )
            ),
        ),
    )
}

MODES: dict[str, tuple[str, ...]] = {
    "plain": (),
    "boxed": ("--boxlite",),
    "module": ("--boxlite", "--boxlite-scope=module"),
    "n2": ("--boxlite", "-n", "2"),
    "worker-n2": ("--boxlite-scope=worker", "-n", "2"),
}


def prepare(project: Project, cache: Path) -> tuple[Path, Path]:
    """The unpacked sdist and its environment's python (project, test deps, xdist, this plugin)."""
    return _sdists.source(project, cache), _sdists.venv(project, cache, "boxlite")


# --------------------------------------------------------------------------
# junit outcomes


def _outcome(case: ET.Element) -> tuple[str, str]:
    """One testcase's outcome and the first line of its message."""
    for child in case:
        msg = (child.get("message") or (child.text or "")).strip().splitlines()
        first = msg[0][:300] if msg else ""
        if child.tag == "failure":
            return "failed", first
        if child.tag == "error":
            return "error", first
        if child.tag == "skipped":
            return ("xfail" if child.get("type") == "pytest.xfail" else "skipped"), first
    return "passed", ""


def outcomes(xml: Path) -> dict[str, list[tuple[str, str]]]:
    """Per test id (``classname::name``), its outcomes in file order (a test can appear twice)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        key = f"{case.get('classname', '')}::{case.get('name', '')}"
        out.setdefault(key, []).append(_outcome(case))
    return out


def compare(plain: dict[str, list[tuple[str, str]]], other: dict[str, list[tuple[str, str]]]) -> list[dict[str, Any]]:
    """Tests whose outcome multiset differs, with both sides and the other side's message."""
    diffs = []
    for key in sorted(set(plain) | set(other)):
        a = sorted(o for o, _ in plain.get(key, []))
        b = sorted(o for o, _ in other.get(key, []))
        if a != b:
            msgs = [m for o, m in other.get(key, []) if m]
            diffs.append(
                {"test": key, "plain": a or ["absent"], "mode": b or ["absent"], "message": msgs[0] if msgs else ""}
            )
    return diffs


# --------------------------------------------------------------------------
# running


def leftover_boxes(py: Path, home: Path) -> str:
    """``python -m pytest_boxlite --home H ls`` (bounded): '' when no box is left, else what it says."""
    if not home.exists():
        return ""
    rc, out, _, timed_out = run_bounded(
        [str(py), "-m", "pytest_boxlite", "--home", str(home), "ls"], cwd=home, env=clean_env(), timeout=60
    )
    if timed_out:
        return "leak check timed out"
    return "" if rc == 0 and out.strip() == "no boxes" else f"exit {rc}: {out.strip()[:300]}"


def run_mode(project: Project, src: Path, py: Path, mode: str, cache: Path, timeout: float) -> dict[str, Any]:
    rundir = cache / "runs" / project.name
    rundir.mkdir(parents=True, exist_ok=True)
    xml = rundir / f"{mode}.xml"
    logf = rundir / f"{mode}.log"
    home = rundir / f"home-{mode}"
    for p in (xml, logf):
        p.unlink(missing_ok=True)
    shutil.rmtree(home, ignore_errors=True)
    extra = (f"--boxlite-home={home}",) if mode != "plain" else ()
    cmd = [str(py), "-m", "pytest", *project.args, *MODES[mode], *extra, f"--junitxml={xml}"]
    log(f"[{project.name}] {mode}: {' '.join(cmd[3:])}")
    rc, out, wall, timed_out = run_bounded(cmd, cwd=src, env=clean_env(), timeout=timeout)
    logf.write_text(out)
    leak = leftover_boxes(py, home) if mode != "plain" else ""
    m = re.search(r"^rootdir: (\S+)", out, re.M)
    res: dict[str, Any] = {
        "mode": mode,
        "rootdir": m.group(1) if m else None,
        "cmd": cmd,
        "rc": rc,
        "timed_out": timed_out,
        "wall": round(wall, 2),
        "summary": pytest_summary(out),
        "leftover_boxes": leak,
        "log": str(logf),
        "tail": "\n".join(out.splitlines()[-12:]),
    }
    if res["rootdir"] is not None and Path(res["rootdir"]) != src:
        log(f"[{project.name}] {mode}: WARNING rootdir is {res['rootdir']}, not the sdist's {src}")
    res["outcomes"] = outcomes(xml) if xml.exists() else None
    log(f"[{project.name}] {mode}: exit {rc}{' (timed out)' if timed_out else ''}, {wall:.1f} s, {res['summary']}")
    return res


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--projects", default=",".join(PROJECTS), help=f"comma-separated, of: {', '.join(PROJECTS)}")
    ap.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)} (plain is always run)"
    )
    ap.add_argument(
        "--cache-dir",
        type=Path,
        default=_sdists.DEFAULT_CACHE,
        help="sdists, venvs and run logs (default: %(default)s)",
    )
    ap.add_argument("--run-timeout", type=seconds, default=600.0, help="bound on each pytest run, s (default 600)")
    ap.add_argument("--show", type=int, default=5, help="mismatches shown per run (default 5)")


def run(a: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    projects = [p.strip() for p in a.projects.split(",") if p.strip()]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [p for p in projects if p not in PROJECTS] + [m for m in modes if m not in MODES]
    if bad:
        known = f"projects: {', '.join(PROJECTS)}; modes: {', '.join(MODES)}"
        log(f"error: unknown project or mode: {', '.join(bad)} ({known})")
        return 2, {}
    if "plain" in modes:
        modes.remove("plain")
    modes.insert(0, "plain")
    cache = a.cache_dir.resolve()
    cache.mkdir(parents=True, exist_ok=True)

    report: dict[str, Any] = {"modes": {m: list(MODES[m]) for m in modes}, "projects": {}}
    for name in projects:
        project = PROJECTS[name]
        entry: dict[str, Any] = {"version": project.version, "runs": {}}
        report["projects"][name] = entry
        try:
            src, py = prepare(project, cache)
        except Skipped as exc:
            log(f"[{name}] skipped: {exc}")
            entry["error"] = str(exc)
            continue
        for mode in modes:
            entry["runs"][mode] = run_mode(project, src, py, mode, cache, a.run_timeout)
            if mode == "plain" and entry["runs"][mode]["timed_out"]:
                # The baseline must be whole: one retry (a suite with a rare hang of its own, on a loaded machine).
                log(f"[{name}] plain run timed out: once more")
                entry["runs"][mode] = run_mode(project, src, py, mode, cache, a.run_timeout)
                entry["runs"][mode]["retried"] = True
        base = entry["runs"]["plain"]["outcomes"] if not entry["runs"]["plain"]["timed_out"] else None
        for mode in modes:
            r = entry["runs"][mode]
            if base is None or r["outcomes"] is None:
                r["mismatches"] = None
            else:
                r["mismatches"] = compare(base, r["outcomes"]) if mode != "plain" else []
                # junit lists a test whose call report never came as passed: the terminal's counts must agree too.
                want, got = summary_counts(entry["runs"]["plain"]["summary"]), summary_counts(r["summary"])
                if mode != "plain" and want != got:
                    r["mismatches"].append(
                        {"test": "(terminal summary)", "plain": [str(want)], "mode": [str(got)], "message": ""}
                    )
            r["tests"] = len(r["outcomes"]) if r["outcomes"] is not None else None
            r["outcome_counts"] = (
                dict(Counter(o for outs in r["outcomes"].values() for o, _ in outs))
                if r["outcomes"] is not None
                else None
            )

    print_table(report, a.show)
    failed = any(
        r.get("mismatches") or r.get("mismatches") is None or r.get("leftover_boxes") or r.get("timed_out")
        for e in report["projects"].values()
        for r in e["runs"].values()
    ) or any("error" in e for e in report["projects"].values())
    return (1 if failed else 0), report


def print_table(report: dict[str, Any], show: int) -> None:
    rows = [("project", "mode", "tests", "mismatches", "wall s", "x plain", "exit", "leak", "summary")]
    for name, e in report["projects"].items():
        if "error" in e:
            rows.append((name, "-", "-", "-", "-", "-", "-", "-", "not run: " + e["error"].splitlines()[0]))
            continue
        plain_wall = e["runs"]["plain"]["wall"]
        for mode, r in e["runs"].items():
            baseline_ok = not e["runs"]["plain"]["timed_out"] and e["runs"]["plain"]["outcomes"] is not None
            if r["mismatches"] is not None:
                mism = str(len(r["mismatches"]))
            else:
                mism = "no junit" if r["outcomes"] is None else "no baseline" if not baseline_ok else "?"
            ratio = f"{r['wall'] / plain_wall:.1f}" if plain_wall else "-"
            rc = f"{r['rc']}{' T/O' if r['timed_out'] else ''}"
            rows.append(
                (
                    name,
                    mode,
                    str(r["tests"] if r["tests"] is not None else "-"),
                    mism,
                    f"{r['wall']:.1f}",
                    ratio,
                    rc,
                    "LEAK" if r["leftover_boxes"] else "ok" if mode != "plain" else "-",
                    r["summary"][:70],
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths))
    for name, e in report["projects"].items():
        for mode, r in e.get("runs", {}).items():
            if mode == "plain" and not r["timed_out"] and r["outcomes"] is not None:
                continue
            if r["mismatches"] is None and r["outcomes"] is not None:
                print(f"\n{name} / {mode}: not compared: the plain run (the baseline) did not finish")
            elif r["mismatches"] is None:
                print(f"\n{name} / {mode}: no junit XML (exit {r['rc']}); output tail:\n{r['tail']}")
            elif r["mismatches"]:
                print(f"\n{name} / {mode}: {len(r['mismatches'])} mismatches, first {min(show, len(r['mismatches']))}:")
                for d in r["mismatches"][:show]:
                    sides = f"plain {'/'.join(d['plain'])}, {mode} {'/'.join(d['mode'])}"
                    print(f"  {d['test']}: {sides}  {d['message'][:200]}")
            if r["leftover_boxes"]:
                print(f"\n{name} / {mode}: boxes left behind: {r['leftover_boxes']}")


FIDELITY = Table("fidelity", "real projects' suites plain and boxed, compared test by test (outcomes)", __doc__ or "",
                 add_arguments, run, in_all=False)  # fmt: skip
