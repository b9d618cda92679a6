"""One table, measured side by side in one run: pytest-boxlite against the alternatives (issue 6, section 3).

Usage::

    python benchmarks/bench_table.py [--tests N] [--repeat R] [--scale-tests N] [--only issue15] [--json PATH]

It drives the other benchmark scripts of this directory (each with ``--json``
into a temporary file, small counts) and adds what none of them measures, then
prints ONE table whose headline column is a ratio:

* **leases** (``bench_pool.py --runtime namespace``): warm lease p50 and cold
  lease p50 (the lease has to boot a box);
* **cold box start** (``bench_runtime.py --runtime namespace``): create+start
  p50 of one box;
* **per-test overhead** of a trivial test (``bench_marker.py``): boxed
  (``--boxlite``) against unmarked, pytest-forked and ``python -m pytest
  <nodeid>`` once per test; and pytest-isolate, measured here on the same
  generated suite (``--isolate``) in the pytest 8 environment that
  bench_marker.py keeps at ``benchmarks/.venv-pytest8``.  pytest-isolate is
  pip-installed with ``--target`` into ``.venv-pytest8/pytest-isolate-site``
  (once; a failed install is remembered there, ``--retry-isolate`` tries
  again) and put on ``PYTHONPATH`` only for its own rows: installed into the
  venv's site-packages it would take over bench_marker's ``--forked`` row (its
  ``pytest_runtest_protocol`` is ``tryfirst`` and it treats ``--forked`` as
  ``--isolate``).  A suite whose test checks it runs in another process is
  run first; if pytest-isolate does not install or fails it, its row is
  printed as skipped with the reason;
* **scaling**: ``--scale-tests`` (200) trivial tests marked
  ``@pytest.mark.boxlite`` run with ``--boxlite-replicas`` 1, 2 and 4 (and the
  same suite unmarked, as the base), each run with a fresh ``--boxlite-home``;
* **file transfer** (``bench_runtime.py``): ``write_bytes`` / ``read_bytes`` of
  20 MiB, in MiB/s, against writing and reading the same bytes to a host file;
* **issue 15's table** (``bench_issue15.py``, its options here prefixed ``--i15-``): 200 trivial
  tests in one module plain, ``--boxlite``, module scope, pytest-forked and pytest-isolate (their
  own plain bases), ``boxlite_sandbox`` with one command, ``-n 2`` / ``--boxlite -n 2`` /
  ``--boxlite-scope=worker -n 2``, and 200 against 2,000 parametrized cases, interleaved, with the
  issue's goals judged.  ``--only issue15`` runs this section alone;
* **resident memory per warm box**: ``--memory-boxes`` (3) boxes booted with
  ``NamespaceRuntime``, and the warm test-worker box of a pytest run (a marked
  test, then an unmarked one that holds the session while it is measured).  A
  box's processes are the bwrap process recorded in
  ``<home>/namespace/<name>/info.json`` and its descendants (``/proc/*/stat``
  parent links); their PSS (``/proc/<pid>/smaps_rollup``) and RSS are summed.

Every pytest run blocks hypothesis and pytest-benchmark and the cache provider
(``-p no:hypothesispytest -p no:benchmark -p no:cacheprovider``), as the other
scripts do.  Every home this script uses is checked with ``python -m
pytest_boxlite --home H ls`` (it must say ``no boxes``); the temporary
directory is removed at the end, also on Ctrl-C or SIGTERM.  The table goes
to stdout, progress to stderr.  The machine is shared and absolute times are
noisy: the load average at the start is printed, and the ratios are the
headline.  Standard library only, besides pytest_boxlite itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
# Runnable from a checkout without installing the package; the sibling scripts are imported for their helpers.
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_issue15  # noqa: E402
import bench_marker as bm  # noqa: E402
from _bench import RunFailed, clean_env, cli, deferred_signals, leak_check, log, positive, run_bounded  # noqa: E402

from pytest_boxlite.runtimes import open_runtime  # noqa: E402
from pytest_boxlite.spec import BoxSpec  # noqa: E402

T = TypeVar("T")
MIB = 1 << 20
#: pytest-isolate lives outside the venv's site-packages, on PYTHONPATH for its own rows only.
ISOLATE_SITE = bm.VENV / "pytest-isolate-site"
ISOLATE_FAILED = bm.VENV / "pytest-isolate-install-failed.txt"
ISOLATE_PACKAGES = ("pytest-isolate", "dill", "filelock", "tblib")  # with --no-deps: pytest comes from the venv
#: Run the generated suites without pytest-forked loaded (pytest-isolate defers to nothing it cannot see anyway).
ISOLATE_ARGS = ("-p", "no:pytest_forked")
#: The issue 6 targets.
TARGET_OVERHEAD = 0.060
TARGET_VS_SUBPROCESS = 5.0
TARGET_WARM_LEASE = 0.005

ISOLATE_PROBE = """\
import os

PID = os.getpid()


def test_runs_in_another_process():
    assert os.getpid() != PID
"""

HOLD_SUITE = '''\
"""bench_table.py: a boxed test starts the warm worker box, then the host holds the session while it is measured."""

import os
import pathlib
import time

import pytest


@pytest.mark.boxlite
def test_boxed():
    pass


def test_hold():
    d = pathlib.Path(os.environ["BENCH_MEM_DIR"])
    (d / "ready").write_text(str(os.getpid()))
    deadline = time.monotonic() + float(os.environ["BENCH_MEM_HOLD"])
    while not (d / "done").exists():
        assert time.monotonic() < deadline, "bench_table.py never said it was done measuring"
        time.sleep(0.02)
'''


class Skipped(Exception):
    """A row that cannot be measured here; the reason is printed in its place."""


# -- helpers ----------------------------------------------------------------


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    if abs(ms) >= 1000:
        return f"{seconds:.2f} s"
    return f"{ms:.3f} ms" if abs(ms) < 1 else (f"{ms:.2f} ms" if abs(ms) < 10 else f"{ms:.1f} ms")


def fmt_mib(kb: float | None) -> str:
    return "n/a" if kb is None else f"{kb / 1024:.1f}"


def fmt_delta(seconds: float | None) -> str:
    """A signed difference: noise can make an overhead negative."""
    return "-" if seconds is None else ("+" if seconds >= 0 else "-") + fmt_time(abs(seconds))


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value >= 100:
        return f"{value:,.0f}x"
    return f"{value:.2f}x" if value < 10 else f"{value:.1f}x"


def div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def loadavg() -> tuple[float, float, float]:
    return os.getloadavg()


def run_script(script: str, args: list[str], root: Path, timeout: float, verbose: bool) -> dict[str, Any]:
    """Run ``benchmarks/<script> ARGS --json F``; returns the parsed JSON (its own table goes to our stderr with -v)."""
    out = root / f"{Path(script).stem}.json"
    cmd = [sys.executable, str(HERE / script), *args, "--json", str(out)]
    log(f"{script} {shlex.join(args)}")
    rc, text, wall, timed_out = run_bounded(cmd, cwd=HERE, env=clean_env(), timeout=timeout)
    if verbose:
        log(text.rstrip())
    if timed_out or rc != 0 or not out.exists():
        why = f"timed out after {timeout:.0f} s" if timed_out else f"exit status {rc}"
        raise RunFailed(script, cmd, why, text)
    log(f"  {script}: {wall:.1f} s")
    data: dict[str, Any] = json.loads(out.read_text())
    data["_command"] = shlex.join([Path(sys.executable).name, f"benchmarks/{script}", *args])
    return data


def with_retry(what: str, fn: Callable[[], T], retries: list[dict[str, str]]) -> T:
    """``fn()``; a failed run is logged, recorded (the table lists it) and run once more."""
    try:
        return fn()
    except RunFailed as exc:
        boxlite = [ln.strip() for ln in exc.output.splitlines() if "[boxlite]" in ln]
        reason = exc.detail + (f"; {boxlite[0][:200]}" if boxlite else "")
        log(f"warning: {what} failed ({reason}); running it once more")
        log(f"output tail:\n{exc.output[-bm.TAIL :]}")
        retries.append({"what": what, "reason": reason})
        return fn()


def pytest_cmd(python: str, *extra: str) -> list[str]:
    return [python, "-m", "pytest", *bm.BASE_ARGS, *bm.UNUSED_PLUGINS, *extra]


def timed_pytest(
    what: str, cmd: list[str], cwd: Path, want: int, timeout: float, timing: Path, **env: str
) -> dict[str, Any]:
    """One pytest run of a generated suite (bench_marker's conftest times each test on the host)."""
    rc, out, wall, timed_out = run_bounded(
        cmd, cwd=cwd, env=clean_env(BENCH_TIMING_FILE=str(timing), **env), timeout=timeout
    )
    bm.check_passed(what, cmd, rc, out, timed_out, want, timeout)
    times = json.loads(timing.read_text())
    timing.unlink()
    return {"wall": wall, "host": times, "summary": bm.summary_line(out)}


# -- pytest-isolate -----------------------------------------------------------
def ensure_isolate(retry: bool, timeout: float) -> tuple[dict[str, str], str]:
    """The environment that loads pytest-isolate into the venv's pytest, and a description; raises Skipped."""
    py = bm.VENV / "bin" / "python"
    if not py.exists():
        raise Skipped(f"no pytest 8 environment at {bm.VENV} (bench_marker.py could not create it)")
    env = {"PYTHONPATH": str(ISOLATE_SITE)}
    probe = "import importlib.metadata as m; print('pytest-isolate', m.version('pytest-isolate'))"

    def version() -> str | None:
        rc, out, _, _ = run_bounded([str(py), "-c", probe], cwd=HERE, env=clean_env(**env), timeout=60)
        return out.strip() if rc == 0 else None

    found = version() if ISOLATE_SITE.is_dir() else None
    if found:
        return env, f"{found}, reused {ISOLATE_SITE}"
    if ISOLATE_FAILED.exists() and not retry:
        raise Skipped(f"{ISOLATE_FAILED.read_text().strip()} (remembered; --retry-isolate tries again)")
    log(f"installing {' '.join(ISOLATE_PACKAGES)} into {ISOLATE_SITE}")
    shutil.rmtree(ISOLATE_SITE, ignore_errors=True)
    cmd = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    cmd += ["--target", str(ISOLATE_SITE), *ISOLATE_PACKAGES]
    rc, out, _, timed_out = run_bounded(cmd, cwd=HERE, env=clean_env(), timeout=timeout)
    found = version() if rc == 0 and not timed_out else None
    if not found:
        why = "timed out" if timed_out else f"exit {rc}"
        reason = f"pip install pytest-isolate failed ({why}): {' '.join(out.strip()[-200:].split())}"
        ISOLATE_FAILED.write_text(reason + "\n")
        shutil.rmtree(ISOLATE_SITE, ignore_errors=True)
        raise Skipped(reason)
    ISOLATE_FAILED.unlink(missing_ok=True)
    return env, f"{found}, installed into {ISOLATE_SITE}"


def bench_isolate(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """``--isolate`` against an unmarked run of the same venv, both without pytest-forked, interleaved."""
    env, desc = ensure_isolate(args.retry_isolate, args.timeout)
    py = str(bm.VENV / "bin" / "python")
    probe_dir = root / "isolate-probe"
    probe_dir.mkdir()
    (probe_dir / "pytest.ini").write_text("[pytest]\n")
    (probe_dir / "test_probe.py").write_text(ISOLATE_PROBE)
    cmd = pytest_cmd(py, *ISOLATE_ARGS, "--isolate")
    rc, out, _, timed_out = run_bounded(cmd, cwd=probe_dir, env=clean_env(**env), timeout=120)
    if timed_out or rc != 0:
        tail = " ".join(out.strip().splitlines()[-1:]) if out.strip() else "no output"
        raise Skipped(f"{desc}: a test run with --isolate failed (exit {rc}): {tail[-200:]}")
    work = root / "isolate-suite"
    nodeids = bm.write_suite(work, args.tests, args.per_module)
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "isolate": []}
    commands = {
        "base": pytest_cmd(py, *ISOLATE_ARGS),
        "isolate": pytest_cmd(py, *ISOLATE_ARGS, "--isolate"),
    }
    log(f"pytest-isolate ({desc}): {args.tests} trivial tests, {args.repeat} interleaved runs")
    timing = root / "timing-isolate.json"
    try:
        timed_pytest("isolate warm-up", commands["base"], work, len(nodeids), args.timeout, timing, **env)
        for _ in range(args.repeat):
            for key, cmd in commands.items():
                res = timed_pytest(f"isolate {key}", cmd, work, len(nodeids), args.timeout, timing, **env)
                runs[key].append(res)
                log(
                    f"  {'--isolate' if key == 'isolate' else 'unmarked'} (pytest 8 venv + pytest-isolate): "
                    f"{res['wall']:.2f} s"
                )
    except RunFailed as exc:
        log(f"output tail:\n{exc.output[-bm.TAIL :]}")
        raise Skipped(f"{desc}: {exc}") from exc
    n = len(nodeids)
    wall = {k: statistics.median(r["wall"] for r in v) for k, v in runs.items()}
    p50 = {k: statistics.median(t for r in v for t in r["host"]) for k, v in runs.items()}
    return {
        "installed": desc,
        "version": desc.split(",")[0],
        "tests": n,
        "walls": {k: [r["wall"] for r in v] for k, v in runs.items()},
        "wall": wall,
        "p50": p50,
        "overhead": (wall["isolate"] - wall["base"]) / n,
        "overhead_p50": p50["isolate"] - p50["base"],
        "commands": {k: shlex.join(v) + f"   # PYTHONPATH={ISOLATE_SITE}" for k, v in commands.items()},
    }


# -- scaling ------------------------------------------------------------------
def write_marked_suite(work: Path, n: int, per_module: int) -> list[str]:
    """bench_marker's trivial suite, every test decorated with ``@pytest.mark.boxlite``."""
    nodeids = bm.write_suite(work, n, per_module)
    for path in sorted(work.glob("test_*.py")):
        body = path.read_text().replace("def test_", "@pytest.mark.boxlite\ndef test_")
        path.write_text("import pytest\n\n\n" + body)
    return nodeids


def bench_scaling(
    args: argparse.Namespace, root: Path, homes: list[Path], retries: list[dict[str, str]]
) -> dict[str, Any]:
    marked, plain = root / "scale-marked", root / "scale-unmarked"
    n = len(write_marked_suite(marked, args.scale_tests, args.per_module))
    bm.write_suite(plain, args.scale_tests, args.per_module)
    timing = root / "timing-scale.json"
    py = sys.executable
    rows: dict[str, dict[str, Any]] = {}
    log(f"scaling: {n} marked trivial tests, --boxlite-replicas {', '.join(map(str, args.replicas))}")
    timed_pytest("scaling warm-up", pytest_cmd(py), plain, n, args.timeout, timing)
    for _ in range(args.scale_repeat):
        res = timed_pytest("unmarked", pytest_cmd(py), plain, n, args.timeout, timing)
        row = rows.setdefault("unmarked", {"label": f"{n} unmarked", "runs": [], "command": shlex.join(pytest_cmd(py))})
        row["runs"].append(res)
        log(f"  {n} unmarked: {res['wall']:.2f} s")
        for r in args.replicas:
            label = f"{n} marked, replicas {r}"

            def boxed_run(r: int = r, label: str = label) -> dict[str, Any]:
                home = root / "homes" / f"scale-r{r}-{len(homes)}"
                homes.append(home)
                cmd = pytest_cmd(py, "--boxlite-replicas", str(r), "--boxlite-home", str(home))
                res = timed_pytest(label, cmd, marked, n, args.timeout, timing)
                res["leak_check"] = leak_check(label, home)
                res["command"] = shlex.join(cmd)
                shutil.rmtree(home, ignore_errors=True)
                return res

            res = with_retry(label, boxed_run, retries)
            command = res.pop("command")
            row = rows.setdefault(f"r{r}", {"label": label, "replicas": r, "runs": [], "command": command})
            row["runs"].append(res)
            log(f"  {label}: {res['wall']:.2f} s, leak check: no boxes")
    base = rows["unmarked"]
    base_wall = statistics.median(x["wall"] for x in base["runs"])
    base_p50 = statistics.median(t for x in base["runs"] for t in x["host"])
    first = f"r{args.replicas[0]}"
    first_wall = statistics.median(x["wall"] for x in rows[first]["runs"])
    for key, row in rows.items():
        row["wall"] = statistics.median(x["wall"] for x in row["runs"])
        row["p50"] = statistics.median(t for x in row["runs"] for t in x["host"])
        row["per_test"] = row["wall"] / n
        if key != "unmarked":
            row["vs_first"] = row["wall"] / first_wall
            row["vs_unmarked"] = row["wall"] / base_wall
            row["overhead"] = (row["wall"] - base_wall) / n
            row["overhead_p50"] = row["p50"] - base_p50
            row["summary"] = row["runs"][-1]["summary"]
        for x in row["runs"]:
            x["host"] = {"n": len(x["host"]), "p50": statistics.median(x["host"])}
    return {"tests": n, "first": first, "rows": rows}


# -- memory ---------------------------------------------------------------------
def children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids, from ``/proc/*/stat`` (the field after the parenthesised command name)."""
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def descendants(root: int, kids: dict[int, list[int]]) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def proc_memory(pid: int) -> tuple[int, int | None] | None:
    """(RSS kB, PSS kB or None) of one process; None if it is gone or a zombie."""
    rss = pss = None
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                value = int(rest.split()[0])
                rss, pss = (value, pss) if key == "Rss" else (rss, value)
    if rss is not None:
        return rss, pss
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    vmrss = next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:")), None)
    # No VmRSS: a zombie (the worker reaps a finished test's box when it forks the next one).
    return None if vmrss is None else (vmrss, None)


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def box_memory(home: Path, name: str) -> dict[str, Any]:
    """PSS/RSS summed over the box's bwrap process (info.json pid) and all its descendants."""
    info = json.loads((home / "namespace" / name / "info.json").read_text())
    pids = descendants(int(info["pid"]), children_map())
    rss = pss = 0
    pss_ok = True
    procs = []
    for pid in pids:
        mem = proc_memory(pid)
        if mem is None:
            continue
        rss += mem[0]
        if mem[1] is None:
            pss_ok = False
        else:
            pss += mem[1]
        procs.append({"pid": pid, "rss_kb": mem[0], "pss_kb": mem[1], "cmd": cmdline(pid)[:160]})
    return {"name": name, "processes": len(procs), "rss_kb": rss, "pss_kb": pss if pss_ok else None, "procs": procs}


def host_helpers(home: Path, name: str) -> dict[str, Any]:
    """Host processes outside the box that serve it: the stdio bridge (``guest/attach.py <box>/agent.sock``)."""
    sock = str(home / "namespace" / name / "agent.sock")
    rss = pss = 0
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and sock in cmdline(int(entry.name)):
            mem = proc_memory(int(entry.name))
            if mem is not None:
                n += 1
                rss += mem[0]
                pss += mem[1] or 0
    return {"processes": n, "rss_kb": rss, "pss_kb": pss}


def settle(home: Path, names: list[str], timeout: float = 15.0) -> None:
    """Wait until the boxes' process trees stop changing (a booting agent, a worker still importing)."""
    deadline = time.monotonic() + timeout
    last: list[Any] = []
    stable = 0
    while time.monotonic() < deadline and stable < 3:
        time.sleep(0.25)
        now = [(m["processes"], m["rss_kb"] // 1024) for m in (box_memory(home, n) for n in names)]
        stable = stable + 1 if now == last else 0
        last = now


def bench_memory_plain(args: argparse.Namespace, root: Path, homes: list[Path]) -> list[dict[str, Any]]:
    home = root / "homes" / "memory-plain"
    homes.append(home)
    token = secrets.token_hex(3)
    rt = open_runtime("namespace", home, f"benchtable{token}")
    attempted: list[str] = []
    try:
        for i in range(args.memory_boxes):
            name = f"pbx-benchmem{token}-{i}"
            attempted.append(name)
            rt.create_box(BoxSpec(), name, timeout=60.0)
        settle(home, attempted)
        boxes = [box_memory(home, name) for name in attempted]
        for b in boxes:
            b["host"] = host_helpers(home, b["name"])
        log(f"  {len(boxes)} plain boxes: PSS " + ", ".join(fmt_mib(b["pss_kb"]) for b in boxes) + " MiB")
        return boxes
    finally:
        with deferred_signals():
            for name in attempted:
                try:
                    rt.remove_box(name)
                except Exception as exc:  # noqa: BLE001 - keep removing the rest
                    log(f"  warning: removing {name} failed: {exc}")
            rt.close()


def bench_memory_worker(args: argparse.Namespace, root: Path, homes: list[Path]) -> list[dict[str, Any]]:
    """The boxes of a pytest run, measured while its warm test worker waits for the next boxed test."""
    attempt = len(homes)
    home = root / "homes" / f"memory-worker-{attempt}"
    homes.append(home)
    work, flags = root / f"memory-suite-{attempt}", root / f"memory-flags-{attempt}"
    work.mkdir()
    flags.mkdir()
    (work / "pytest.ini").write_text("[pytest]\n")
    (work / "test_hold.py").write_text(HOLD_SUITE)
    cmd = pytest_cmd(sys.executable, "--boxlite-home", str(home))
    env = clean_env(BENCH_MEM_DIR=str(flags), BENCH_MEM_HOLD="120")
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        boxes: list[dict[str, Any]] = []
        try:
            deadline = time.monotonic() + 120
            while not (flags / "ready").exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            if (flags / "ready").exists():
                names = sorted(p.parent.name for p in (home / "namespace").glob("*/info.json"))
                settle(home, names)
                boxes = [box_memory(home, name) for name in names]
                for b in boxes:
                    b["host"] = host_helpers(home, b["name"])
        finally:
            (flags / "done").write_text("")
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
            out.seek(0)
            text = out.read().decode(errors="replace")
        bm.check_passed("memory: pytest run with a warm worker box", cmd, proc.returncode, text, False, 2, 120)
    leak_check("memory: pytest run", home)
    if not boxes:
        raise Skipped("the pytest run had no box while its host test waited")
    log(
        f"  pytest run: {len(boxes)} box(es): PSS "
        + ", ".join(fmt_mib(b["pss_kb"]) for b in boxes)
        + f" MiB; {bm.summary_line(text) or ''}"
    )
    return boxes


def memory_summary(boxes: list[dict[str, Any]]) -> dict[str, Any]:
    pss = [b["pss_kb"] for b in boxes if b["pss_kb"] is not None]
    return {
        "boxes": len(boxes),
        # PSS needs every process's smaps_rollup; where one was unreadable, the box counts its RSS instead.
        "pss_mib": statistics.fmean(b["pss_kb"] if b["pss_kb"] is not None else b["rss_kb"] for b in boxes) / 1024,
        "pss_complete": len(pss) == len(boxes),
        "rss_mib": statistics.fmean(b["rss_kb"] for b in boxes) / 1024,
        "processes": statistics.fmean(b["processes"] for b in boxes),
        "host_pss_mib": statistics.fmean(b["host"]["pss_kb"] for b in boxes) / 1024,
        "host_processes": statistics.fmean(b["host"]["processes"] for b in boxes),
        "detail": boxes,
    }


def host_file_io(size: int, repeat: int, root: Path) -> dict[str, float]:
    """Write/read ``size`` bytes to a file on the host (page cache): the transfer rows' baseline."""
    data = os.urandom(size)
    path = root / "host-io.bin"
    writes, reads = [], []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        path.write_bytes(data)
        t1 = time.perf_counter()
        if path.read_bytes() != data:
            raise RuntimeError("host file read back different bytes")
        t2 = time.perf_counter()
        writes.append(t1 - t0)
        reads.append(t2 - t1)
    path.unlink()
    mib = size / MIB
    return {"write_mib_s": mib / statistics.median(writes[1:]), "read_mib_s": mib / statistics.median(reads[1:])}


# -- the run ------------------------------------------------------------------
def measure_issue15(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """bench_issue15.py's rows, with this script's pytest 8 environment and pytest-isolate."""
    sub = argparse.Namespace(
        tests=args.i15_tests,
        repeat=args.i15_repeat,
        sandbox_tests=args.i15_sandbox_tests,
        big=args.i15_big,
        big_repeat=args.i15_big_repeat,
        timeout=args.timeout * 4,
    )
    venv8, iso, notes = bench_issue15.peers(args.retry_isolate, args.timeout)
    work = root / "issue15"
    work.mkdir()
    res = bench_issue15.measure(sub, work, venv8, iso)
    res["notes"] = notes
    return res


def measure(args: argparse.Namespace, root: Path, homes: list[Path]) -> dict[str, Any]:
    res: dict[str, Any] = {"skipped": {}, "retries": []}
    if args.only == "issue15":
        res["issue15"] = measure_issue15(args, root)
        return res
    v = args.verbose
    t = args.timeout * 4

    pool = run_script(
        "bench_pool.py", ["--runtime", "namespace", "--leases", str(args.leases), "--cold", str(args.cold)], root, t, v
    )
    res["pool"] = pool
    runtime = run_script(
        "bench_runtime.py",
        ["--runtime", "namespace", "--repeat", "20", "--boxes", str(args.boxes), "--io-repeat", "3"],
        root,
        t,
        v,
    )
    res["runtime"] = runtime
    for script, data in (("bench_pool.py", pool), ("bench_runtime.py", runtime)):
        why = data["runtimes"]["namespace"].get("skipped")
        if why:
            raise RunFailed(script, [script], f"the namespace runtime was skipped: {why}", "")
    res["host_io"] = host_file_io(20 * MIB, 3, root)
    marker_args = ["--tests", str(args.tests), "--per-module", str(args.per_module), "--repeat", str(args.repeat)]
    marker_args += ["--timeout", f"{args.timeout:g}"]
    res["marker"] = with_retry(
        "bench_marker.py", lambda: run_script("bench_marker.py", marker_args, root, t * 3, v), res["retries"]
    )
    try:
        res["isolate"] = bench_isolate(args, root)
    except Skipped as exc:
        log(f"pytest-isolate: skipped: {exc}")
        res["skipped"]["isolate"] = str(exc)
    res["scaling"] = bench_scaling(args, root, homes, res["retries"])
    res["issue15"] = measure_issue15(args, root)
    log(f"memory: {args.memory_boxes} plain boxes, and a pytest run's warm worker box")
    res["memory_plain"] = memory_summary(bench_memory_plain(args, root, homes))
    try:
        boxes = with_retry("memory: a pytest run", lambda: bench_memory_worker(args, root, homes), res["retries"])
        res["memory_worker"] = memory_summary(boxes)
    except Skipped as exc:
        res["skipped"]["memory_worker"] = str(exc)
    for home in homes:
        if home.exists():
            leak_check(f"home {home.name}", home)
    res["leak_checks"] = {home.name: "no boxes" for home in homes}
    return res


# -- report -------------------------------------------------------------------
Row = tuple[str, str, str, str, str]


def table(res: dict[str, Any], meta: dict[str, Any]) -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    notes: list[str] = []

    def section(title: str) -> None:
        rows.append((title, "", "", "", ""))

    # leases and boxes
    ns = res["pool"]["runtimes"]["namespace"]
    rt = res["runtime"]["runtimes"]["namespace"]
    warm, cold = ns["warm_lease"]["p50"], ns["cold_lease"]["p50"]
    create = rt["create_start"]["p50"]
    section("leases and boxes (namespace runtime)")
    rows.append(("  warm lease p50", "1x", fmt_time(warm), "reference", f"pool.lease(), n={ns['warm_lease']['n']}"))
    rows.append(
        (
            "  warm lease p50, health-checked",
            fmt_ratio(div(ns["warm_lease_checked"]["p50"], warm)),
            fmt_time(ns["warm_lease_checked"]["p50"]),
            "/ warm lease",
            "a box that sat warm > 2 s",
        )
    )
    rows.append(
        ("  cold lease p50", fmt_ratio(div(cold, warm)), fmt_time(cold), "/ warm lease", "the lease boots a box")
    )
    rows.append(
        (
            "  cold box start p50",
            fmt_ratio(div(create, warm)),
            fmt_time(create),
            "/ warm lease",
            f"create+start, n={rt['create_start']['n']}; "
            f"the pool's inline boot p50 {fmt_time(ns['boot_cold_pool']['p50'])}",
        )
    )

    # per-test overhead
    mk = res["marker"]["rows"]
    boxed = mk["boxed"]
    n = res["marker"]["meta"]["tests"]
    section(f"per-test cost of a trivial test ({n} tests; p50 over its unmarked base; wall-based in the note)")
    rows.append(
        (
            "  unmarked, p50 per test",
            "1x",
            fmt_time(mk["unmarked"]["p50"]),
            "reference",
            f"wall {mk['unmarked']['wall']:.2f} s",
        )
    )
    rows.append(
        (
            "  boxed (--boxlite), p50 per test",
            fmt_ratio(div(boxed["p50"], mk["unmarked"]["p50"])),
            fmt_time(boxed["p50"]),
            "/ unmarked",
            f"overhead p50 {fmt_delta(boxed['overhead_p50'])}, wall {fmt_delta(boxed['overhead'])}/test",
        )
    )
    alternatives: list[tuple[str, float | None, float | None, str]] = []
    if "forked" in mk:
        f = mk["forked"]
        alternatives.append(("  pytest-forked overhead p50", f["overhead_p50"], f["overhead"], "pytest 8 venv"))
    else:
        reasons = "; ".join(res["marker"]["meta"]["skipped"]) or "not measured"
        rows.append(("  pytest-forked overhead p50", "skipped", "", "", reasons))
    if "isolate" in res:
        iso = res["isolate"]
        alternatives.append(
            ("  pytest-isolate overhead p50", iso["overhead_p50"], iso["overhead"], f"{iso['version']}, pytest 8 venv")
        )
    else:
        rows.append(("  pytest-isolate overhead p50", "skipped", "", "", res["skipped"].get("isolate", "")))
    sub = mk["subprocess"]
    alternatives.append(
        ("  python -m pytest <nodeid> overhead p50", sub["overhead_p50"], sub["overhead"], "one process per test")
    )
    rows.append(
        (
            "  boxed (--boxlite) overhead p50",
            "1x",
            fmt_delta(boxed["overhead_p50"]),
            "reference",
            f"wall {fmt_delta(boxed['overhead'])}/test",
        )
    )
    for label, p50, wall, note in alternatives:
        rows.append(
            (
                label,
                fmt_ratio(div(p50, boxed["overhead_p50"])),
                fmt_delta(p50),
                "/ boxed overhead",
                f"wall {fmt_delta(wall)}/test; {note}",
            )
        )
    module = mk["module"]
    rows.append(
        (
            "  --boxlite-scope=module overhead p50",
            fmt_ratio(div(module["overhead_p50"], boxed["overhead_p50"])),
            fmt_delta(module["overhead_p50"]),
            "/ boxed overhead",
            f"wall {fmt_delta(module['overhead'])}/test; one box per module",
        )
    )

    # scaling
    sc = res["scaling"]
    first = sc["rows"][sc["first"]]
    section(f"scaling: {sc['tests']} trivial @pytest.mark.boxlite tests (wall of one pytest run)")
    base = sc["rows"]["unmarked"]
    rows.append((f"  {sc['tests']} unmarked", "", f"{base['wall']:.2f} s", "", "the base of 'x unmarked'"))
    for key, row in sc["rows"].items():
        if key == "unmarked":
            continue
        rows.append(
            (
                f"  --boxlite-replicas {row['replicas']}",
                fmt_ratio(row["vs_first"]),
                f"{row['wall']:.2f} s",
                f"/ replicas {first['replicas']}",
                f"{row['vs_unmarked']:.1f}x unmarked; wall {fmt_delta(row['overhead'])}/test, "
                f"p50 {fmt_delta(row['overhead_p50'])}",
            )
        )

    # transfer
    host = res["host_io"]
    section("file transfer, 20 MiB (Sandbox.write_bytes / read_bytes, sha256-checked)")
    for op in ("write", "read"):
        rate = rt[f"{op}_20mib_mib_s"]
        bad = rt[f"{op}_20mib"].get("sha256_mismatches", 0)
        rows.append(
            (
                f"  {op}_bytes host -> box" if op == "write" else f"  {op}_bytes box -> host",
                fmt_ratio(div(rate, host[f"{op}_mib_s"])),
                f"{rate:.1f} MiB/s",
                f"/ host file {op}",
                f"{rate * MIB / 1e6:.1f} MB/s; host file {op} {host[f'{op}_mib_s']:,.0f} MiB/s"
                + (f"; sha256 MISMATCH {bad}" if bad else ""),
            )
        )

    # memory
    plain = res["memory_plain"]
    section("resident memory per warm box (PSS summed over bwrap and its descendants)")
    rows.append(
        (
            "  plain box (NamespaceRuntime.create_box)",
            "1x",
            f"{plain['pss_mib']:.1f} MiB",
            "reference",
            f"{plain['boxes']} boxes; RSS {plain['rss_mib']:.1f} MiB; {plain['processes']:.0f} processes"
            + ("" if plain["pss_complete"] else "; some PSS unreadable: RSS used"),
        )
    )
    if "memory_worker" in res:
        wk = res["memory_worker"]
        rows.append(
            (
                "  test-worker box of a pytest run",
                fmt_ratio(div(wk["pss_mib"], plain["pss_mib"])),
                f"{wk['pss_mib']:.1f} MiB",
                "/ plain box",
                f"{wk['boxes']} box(es); RSS {wk['rss_mib']:.1f} MiB; {wk['processes']:.0f} processes; "
                f"+ host-side stdio bridge {wk['host_pss_mib']:.1f} MiB PSS"
                + ("" if wk["pss_complete"] else "; some PSS unreadable: RSS used"),
            )
        )
    else:
        rows.append(("  test-worker box of a pytest run", "skipped", "", "", res["skipped"]["memory_worker"]))

    # targets
    over = boxed["overhead_p50"]
    vs_sub = div(sub["overhead_p50"], over)
    scale_default = sc["rows"].get("r2")
    cross = (
        f"; cross-check, {sc['tests']} marked with replicas 2: +{fmt_time(scale_default['overhead_p50'])}"
        if scale_default
        else ""
    )
    notes.append("issue 6 targets (namespace runtime, warm pool):")
    notes.append(
        f"  marked trivial test p50 overhead over unmarked <= {TARGET_OVERHEAD * 1e3:.0f} ms: "
        f"{fmt_time(over)} -> {'holds' if over <= TARGET_OVERHEAD else 'DOES NOT HOLD'}{cross}"
    )
    holds = vs_sub is not None and vs_sub >= TARGET_VS_SUBPROCESS
    notes.append(
        f"  >= {TARGET_VS_SUBPROCESS:.0f}x cheaper than python -m pytest <nodeid> per test (p50 overhead): "
        f"{fmt_ratio(vs_sub)} -> {'holds' if holds else 'DOES NOT HOLD'}"
    )
    notes.append(
        f"  warm lease p50 <= {TARGET_WARM_LEASE * 1e3:.0f} ms: {fmt_time(warm)} -> "
        f"{'holds' if warm <= TARGET_WARM_LEASE else 'DOES NOT HOLD'}"
    )
    for retry in res["retries"]:
        notes.append(f"RETRIED once after a failed run: {retry['what']}: {retry['reason']}")
    if boxed.get("boxlite"):
        last = [s for s in boxed["boxlite"] if s]
        if last:
            notes.append(f"pytest-boxlite summary (--boxlite, last run): {last[-1]}")
    return rows, notes


def render(report: dict[str, Any]) -> str:
    meta, res = report["meta"], report["results"]
    issue15 = [*res["issue15"].get("notes", []), *bench_issue15.render(res["issue15"])] if "issue15" in res else []
    if "pool" not in res:  # --only issue15
        load, end = meta["loadavg_start"], meta["loadavg_end"]
        head = f"load average at start: {load[0]:.2f}, at the end: {end[0]:.2f}, on {meta['cpus']} CPUs"
        return "\n".join([head, f"runtime: {meta['runtime']}; took {meta['elapsed']:.0f} s", "", *issue15])
    rows, notes = table(res, meta)
    header: Row = ("measure", "ratio", "value", "ratio is", "note")
    measured = [header, *(r for r in rows if any(r[1:]))]
    widths = [max(len(r[i]) for r in measured) for i in range(len(header))]

    def line(r: Row) -> str:
        if not any(r[1:]):
            return r[0]
        cells = [c.rjust(w) if i in (1, 2) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        return "  ".join(cells).rstrip()

    load, end = meta["loadavg_start"], meta["loadavg_end"]
    out = [
        f"pytest-boxlite vs the alternatives: python {meta['python']}, pytest {meta['pytest']}, {meta['platform']}",
        f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {meta['cpus']} CPUs "
        f"(at the end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}); a shared machine: absolute times are noisy, "
        "ratios are the headline",
        f"runtime: {meta['runtime']}; took {meta['elapsed']:.0f} s",
        "",
        line(header),
        line(tuple("-" * w for w in widths)),  # type: ignore[arg-type]
        *(line(r) for r in rows),
        "",
        *notes,
        "",
        "p50 per test = host-side logstart->logfinish p50 (bench_marker.py's conftest); overhead p50 = minus its "
        "unmarked base's p50 (pytest 8 venv for forked/isolate); wall +X/test = (wall - base wall) / tests",
        "sources (each run with --json; their temporary files are removed):",
        *(f"  {c}" for c in meta["commands"]),
        "",
        *issue15,
    ]
    return "\n".join(out)


# -- main -----------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    def replicas(text: str) -> list[int]:
        return [positive(x) for x in text.split(",")]

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tests", type=positive, default=20, help="trivial tests of the per-test rows (default: 20)")
    p.add_argument("--per-module", type=positive, default=10, help="tests per module (default: 10)")
    p.add_argument("--repeat", type=positive, default=2, help="interleaved runs of the per-test rows (default: 2)")
    p.add_argument("--scale-tests", type=positive, default=200, help="marked tests of the scaling rows (default: 200)")
    p.add_argument("--replicas", type=replicas, default=[1, 2, 4], help="scaling replicas (default: 1,2,4)")
    p.add_argument("--scale-repeat", type=positive, default=1, help="runs of each scaling row (default: 1)")
    p.add_argument("--leases", type=positive, default=30, help="warm leases timed (default: 30)")
    p.add_argument("--cold", type=positive, default=10, help="cold leases timed (default: 10)")
    p.add_argument("--boxes", type=positive, default=5, help="boxes created for the cold-start row (default: 5)")
    p.add_argument("--memory-boxes", type=positive, default=3, help="plain boxes measured for memory (default: 3)")
    p.add_argument("--timeout", type=float, default=180.0, help="bound on each pytest run, seconds (default: 180)")
    p.add_argument("--retry-isolate", action="store_true", help="try pip install pytest-isolate again")
    p.add_argument("--only", choices=("issue15",), help="measure only this section")
    bench_issue15.add_arguments(p, prefix="i15-")
    p.add_argument("-v", "--verbose", action="store_true", help="also copy each sub-script's own table to stderr")
    p.add_argument("--json", metavar="PATH", type=Path, help="also write every result, samples included, as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return cli(
        parse_args, run, interrupted="the boxes made so far were removed and the temporary directory deleted", argv=argv
    )


def run(args: argparse.Namespace) -> int:
    import pytest

    from pytest_boxlite.runtimes import choose

    started = time.monotonic()
    try:
        choice = choose("auto")
        runtime = f"{choice.kind} ({choice.reason})"
    except Exception as exc:  # noqa: BLE001 - shown; the boxed runs fail on it
        runtime = f"unavailable: {exc}"
    meta: dict[str, Any] = {
        "python": platform.python_version(),
        "pytest": pytest.__version__,
        "platform": platform.platform(),
        "loadavg_start": loadavg(),
        "cpus": os.cpu_count(),
        "runtime": runtime,
        "argv": sys.argv,
    }
    log(f"load average at start: {' '.join(f'{x:.2f}' for x in meta['loadavg_start'])} on {meta['cpus']} CPUs")
    root = Path(tempfile.mkdtemp(prefix="pbx-bench-table-"))
    (root / "homes").mkdir()
    homes: list[Path] = []
    try:
        try:
            res = measure(args, root, homes)
        except RunFailed as exc:
            log(f"error: {exc}")
            log(f"command: {shlex.join(exc.cmd)}")
            log(f"output tail:\n{exc.output[-bm.TAIL :]}")
            return 1
    finally:
        with deferred_signals():
            for home in homes:
                if home.exists():
                    # Only a run stopped half-way leaves anything here: reap it before removal.
                    with contextlib.suppress(Exception):
                        cmd = [sys.executable, "-m", "pytest_boxlite", "--home", str(home), "clean"]
                        run_bounded(cmd, cwd=HERE, env=clean_env(), timeout=60)
            shutil.rmtree(root, ignore_errors=True)
    meta["loadavg_end"] = loadavg()
    meta["elapsed"] = time.monotonic() - started
    if "pool" in res:
        commands = [res["pool"]["_command"], res["runtime"]["_command"], res["marker"]["_command"]]
        if "isolate" in res:
            commands += list(res["isolate"]["commands"].values())
        commands += [row["command"] for row in res["scaling"]["rows"].values()]
        meta["commands"] = commands
    report = {"meta": meta, "results": res}
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
