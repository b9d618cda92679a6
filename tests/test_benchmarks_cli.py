"""``python -m benchmarks``: every table has its sub-command and ``--help``, ``--quick`` picks each
option's quick default (an explicit value wins), and the rows' arithmetic against their base.

No timing is asserted: the tables are measured by running them, not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks import _rows  # noqa: E402
from benchmarks.__main__ import TABLES, parser  # noqa: E402
from benchmarks._bench import resolve_defaults  # noqa: E402
from benchmarks._suites import Suite  # noqa: E402
from benchmarks.fork_profile import isolation_floor  # noqa: E402


def test_every_table_is_a_sub_command_with_help(capsys: pytest.CaptureFixture[str]) -> None:
    names = [t.name for t in TABLES]
    assert len(set(names)) == len(names)
    for name in [*names, "all"]:
        with pytest.raises(SystemExit) as exc:
            parser().parse_args([name, "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert f"python -m benchmarks {name}" in out and "--quick" in out, name


def test_quick_defaults_and_explicit_values() -> None:
    normal = resolve_defaults(parser().parse_args(["per-test"]))
    quick = resolve_defaults(parser().parse_args(["per-test", "--quick"]))
    explicit = resolve_defaults(parser().parse_args(["per-test", "--quick", "--tests", "7"]))
    assert (normal.tests, normal.rounds) == (200, 3)
    assert (quick.tests, quick.rounds) == (20, 1)
    assert explicit.tests == 7 and explicit.rounds == 1


def test_bad_option_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["per-test", "--tests", "0"])
    assert exc.value.code == 2
    assert "must be a positive integer" in capsys.readouterr().err


def test_rows_against_their_base(tmp_path: Path) -> None:
    """A unit layer: fabricated runs (no pytest run), the medians and per-test figures derived."""
    suites = {"s": Suite(tmp_path, tuple(f"t{i}" for i in range(10)))}
    rows = [_rows.Row("plain", "plain", "s"), _rows.Row("boxed", "--boxlite", "s", ("--boxlite",), base="plain")]

    def run(wall: float, cpu: float, times: list[float]) -> dict[str, object]:
        return {"wall": wall, "cpu": cpu, "times": times, "summary": None, "command": "c"}

    res = _rows.derive(
        rows,
        suites,
        {
            "plain": [run(1.0, 1.0, [0.01]), run(3.0, 1.2, [0.01])],
            "boxed": [run(2.0, 2.0, [0.03]), run(2.4, 2.2, [0.05])],
        },
    )
    boxed = res["boxed"]
    assert rows[1].boxed and not rows[0].boxed
    assert boxed["wall"] == pytest.approx(2.2) and res["plain"]["wall"] == pytest.approx(2.0)
    assert boxed["overhead"] == pytest.approx(0.02)  # (2.2 - 2.0) / 10 tests
    assert boxed["overhead_cpu"] == pytest.approx(0.1)  # (2.1 - 1.1) / 10
    assert boxed["overhead_p50"] == pytest.approx(0.03)  # 0.04 - 0.01
    assert boxed["ratio"] == pytest.approx(1.1)
    assert "overhead" not in res["plain"]


def test_help_runs_as_a_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert all(t.name in out.stdout for t in TABLES)


def test_profile_fork_sees_every_process_of_a_box(tmp_path: Path) -> None:
    """A real run of ``profile-fork`` (one ``pytest --boxlite`` of 20 trivial tests): the stamps of
    a box's pid 1 and of its test process reach the tables.  Its probe once took the bare init's
    test process (``clone_box`` returns ``IN_TEST``, -1, there) for the warm interpreter, and lost
    the test process's stamps to the box's own log: every row of the box was missing, silently."""
    out = tmp_path / "profile.json"
    # The Python pid 1 stamps its phases; the native one (boxinit, no interpreter) has none to send.
    env = {**os.environ, "PYTEST_BOXLITE_NATIVE_INIT": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "profile-fork", "--quick", "--no-floor", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    profile = json.loads(out.read_text())["profile"]
    phases = {row["phase"]: row for row in profile["phases"]}
    assert "box: the test itself" in phases, sorted(phases)
    box = {row["phase"] for row in profile["box_phases"]}
    assert "clone -> pid 1 runs, ids mapped" in box and "pid 1: fresh layers, masks, tmpfs, /proc, hostname" in box
    cpu = {row["phase"]: row for row in profile["test_cpu"]}
    whole = cpu["the test process, fork to its teardown report"]
    assert whole["n"] >= 10 and whole["p50"] > 0
    # The test process's phases add up to no more than the whole of it (one clock, zero at its fork).
    parts = ("fork -> it runs (faults of the return to Python)", "fresh layers, masks, tmpfs, /proc, hostname")
    assert sum(cpu[p]["p50"] for p in parts) < whole["p50"]
    assert cpu["its pid 1 (a bare init), clone to _exit"]["p50"] > 0
    assert profile["test_faults"]["the test process, fork to its teardown report"] > 0


def test_isolation_floor_is_pytest_forked_plus_what_a_pid_namespace_adds_to_a_fork() -> None:
    steps: list[dict[str, Any]] = [
        {"step": "fork + _exit + wait (warm interpreter)", "p50": 1.0, "cpu_p50": 0.003, "n": 50},
        {"step": "  + id maps, make / private, a tmpfs and an overlay mount", "skipped": "needs root"},
        {"step": "  + unshare, fork pid 1 and wait for it", "p50": 1.0, "cpu_p50": 0.0065, "n": 50},
        {"step": "fork + runtest protocol of a trivial test (pytest-forked)", "p50": 1.0, "cpu_p50": 0.005, "n": 50},
    ]
    total, ratio = isolation_floor(steps) or (0.0, 0.0)
    assert total == pytest.approx(0.0085)
    assert ratio == pytest.approx(1.7)
    assert isolation_floor([s for s in steps if "pid 1" not in s["step"]]) is None
