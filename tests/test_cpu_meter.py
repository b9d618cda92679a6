"""The benchmarks' cgroup CPU meter (``benchmarks._bench.CpuMeter``): what a run's figure counts.

The property it exists for: a process that leaves the run's process tree (a box's processes,
reaped by the box's own init, not by pytest) is counted, and its CPU after the run's own process
has exited too; nothing of the measuring process is.  No timing is asserted beyond "at least the
CPU the run is known to burn"."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks._bench import CpuMeter, clean_env  # noqa: E402

#: A grandchild that outlives its parent (re-parented, as a box's processes are) and burns CPU
#: for ``BURN`` seconds of its own CPU time.
BURN = 0.3
ORPHAN = f"""
import os, time
if os.fork() == 0:
    if os.fork() == 0:
        end = time.thread_time() + {BURN}
        while time.thread_time() < end:
            pass
    os._exit(0)
os.wait()
"""


@pytest.fixture
def meter() -> CpuMeter:
    m = CpuMeter("auto")
    if m.kind != "cgroup":
        pytest.skip(f"no cgroup can be made here: {m.note}")
    return m


def test_an_orphan_s_cpu_after_the_run_exits_is_counted(meter: CpuMeter, tmp_path: Path) -> None:
    rc, out, _, timed_out, cpu = meter.run([sys.executable, "-c", ORPHAN], cwd=tmp_path, env=clean_env(), timeout=60)
    assert (rc, timed_out) == (0, False), out
    assert cpu is not None and cpu >= BURN * 0.9, (cpu, meter.describe())
    assert "cgroup" in meter.describe()


def test_the_measuring_cgroups_are_removed(meter: CpuMeter, tmp_path: Path) -> None:
    assert meter._parent is not None
    before = {p.name for p in meter._parent.iterdir() if p.name.startswith("benchmarks-")}
    meter.run(["true"], cwd=tmp_path, env=clean_env(), timeout=60)
    after = {p.name for p in meter._parent.iterdir() if p.name.startswith("benchmarks-")}
    assert after == before


def test_proc_stat_when_asked() -> None:
    m = CpuMeter("proc-stat")
    assert m.kind == "proc-stat"
    assert "/proc/stat" in m.describe()
