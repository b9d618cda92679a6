"""Resident memory per warm box: plain boxes, and the warm test-worker box of a pytest run.

``--memory-boxes`` boxes are booted with ``NamespaceRuntime``; then a pytest run's boxes are
measured while it holds its session (a marked test, then an unmarked one that waits until the
measuring is done).  A box's processes are the bwrap process recorded in ``info.json`` in the
box's private control directory (``<home>/namespace/<name>.ctl``) and its descendants
(``/proc/*/stat`` parent links); their PSS (``/proc/<pid>/smaps_rollup``) and RSS are summed.
The host-side stdio bridge of each box is reported beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._bench import (
    QUIET_ARGS,
    RunFailed,
    Skipped,
    Table,
    Workdir,
    boxlite_summary,
    check_passed,
    clean_env,
    deferred_signals,
    div,
    failure_text,
    fmt_ratio,
    leak_check,
    log,
    machine_header,
    option,
    table,
)
from pytest_boxlite.runtimes import open_runtime
from pytest_boxlite.runtimes.namespace.layout import ctl_dir, read_private
from pytest_boxlite.spec import BoxSpec

HOLD_SUITE = '''\
"""benchmarks memory: a boxed test starts the warm worker box, then the host holds the session while it is measured."""

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
        assert time.monotonic() < deadline, "the benchmark never said it was done measuring"
        time.sleep(0.02)
'''


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
    info = json.loads(read_private(ctl_dir(home / "namespace" / name) / "info.json", 1 << 20))
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
    sock = str(ctl_dir(home / "namespace" / name) / "agent.sock")
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


def bench_memory_plain(args: argparse.Namespace, work: Workdir) -> list[dict[str, Any]]:
    home = work.home("memory-plain")
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


def bench_memory_worker(work: Workdir) -> list[dict[str, Any]]:
    """The boxes of a pytest run, measured while its warm test worker waits for the next boxed test."""
    home = work.home("memory-worker")
    suite, flags = work.root / f"memory-suite-{home.name}", work.root / f"memory-flags-{home.name}"
    suite.mkdir()
    flags.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "test_hold.py").write_text(HOLD_SUITE)
    cmd = [sys.executable, "-m", "pytest", *QUIET_ARGS, "--boxlite-home", str(home)]
    env = clean_env(BENCH_MEM_DIR=str(flags), BENCH_MEM_HOLD="120")
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            cmd, cwd=suite, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
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
                names = sorted(p.parent.name[: -len(".ctl")] for p in (home / "namespace").glob("*.ctl/info.json"))
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
        check_passed("memory: pytest run with a warm worker box", cmd, proc.returncode, text, False, 2, 120)
    leak_check("memory: pytest run", home)
    if not boxes:
        raise Skipped("the pytest run had no box while its host test waited")
    log(
        f"  pytest run: {len(boxes)} box(es): PSS "
        + ", ".join(fmt_mib(b["pss_kb"]) for b in boxes)
        + f" MiB; {boxlite_summary(text) or ''}"
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


def fmt_mib(kb: float | None) -> str:
    return "n/a" if kb is None else f"{kb / 1024:.1f}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    option(p, "--memory-boxes", 3, 1, help="plain boxes measured")


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    res: dict[str, Any] = {}
    with Workdir("memory") as work:
        log(f"memory: {args.memory_boxes} plain boxes, and a pytest run's warm worker box")
        try:
            res["plain"] = memory_summary(bench_memory_plain(args, work))
            try:
                res["worker"] = memory_summary(bench_memory_worker(work))
            except Skipped as exc:
                res["worker_skipped"] = str(exc)
        except RunFailed as exc:
            log(failure_text(exc))
            return 1, res
    plain = res["plain"]
    rows = [[
        "plain box (NamespaceRuntime.create_box)", "1x", f"{plain['pss_mib']:.1f} MiB",
        f"{plain['boxes']} boxes; RSS {plain['rss_mib']:.1f} MiB; {plain['processes']:.0f} processes"
        + ("" if plain["pss_complete"] else "; some PSS unreadable: RSS used"),
    ]]  # fmt: skip
    if "worker" in res:
        wk = res["worker"]
        rows.append([
            "test-worker box of a pytest run", fmt_ratio(div(wk["pss_mib"], plain["pss_mib"])),
            f"{wk['pss_mib']:.1f} MiB",
            f"{wk['boxes']} box(es); RSS {wk['rss_mib']:.1f} MiB; {wk['processes']:.0f} processes; "
            f"+ host-side stdio bridge {wk['host_pss_mib']:.1f} MiB PSS"
            + ("" if wk["pss_complete"] else "; some PSS unreadable: RSS used"),
        ])  # fmt: skip
    else:
        rows.append(["test-worker box of a pytest run", "skipped", "", res["worker_skipped"]])
    out = [*machine_header(), "resident memory per warm box (PSS summed over bwrap and its descendants)", "",
           *table(["box", "x plain", "PSS", "note"], rows, left=(0, 3))]  # fmt: skip
    print("\n".join(out), flush=True)
    return 0, res


MEMORY = Table("memory", "resident memory (PSS) of a warm box and of a pytest run's worker box", __doc__ or "",
               add_arguments, run)  # fmt: skip
