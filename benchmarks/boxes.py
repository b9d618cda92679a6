"""A box's own operations: start, exec, destroy (``box``); file transfers (``files``).

For every runtime that can run on this host (``vm`` is skipped, with the probe's reason, where no
micro-VM can boot):

* ``box``: cold box create+start, and destroy (p50 over ``--boxes`` boxes);
  ``Sandbox.run(["true"])`` p50/p90 and ``execute_command("true")`` p50 (``--repeat`` calls
  each, after a short warm-up); against the host's ``subprocess.run(["true"])``;
* ``files``: 1 MiB ``write_bytes`` / ``read_bytes`` (p50 over ``--io-repeat`` calls) and 20 MiB
  throughput, each round trip checked by sha256; against writing and reading the same bytes to a
  host file (page cache).

Boxes live in a temporary home that is removed at the end; every box is destroyed in ``finally``
blocks (Ctrl-C and SIGTERM included) and the runtime closed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from benchmarks._bench import Table, deferred_signals, fmt_time, log, machine_header, option, seconds, summary, table
from pytest_boxlite.errors import RuntimeUnavailableError
from pytest_boxlite.runtimes import BoxHandle, Runtime, open_runtime, probe
from pytest_boxlite.sandbox import ExecResult, Sandbox
from pytest_boxlite.spec import BoxSpec

T = TypeVar("T")
MIB = 1 << 20
SMALL = 1 * MIB
BIG = 20 * MIB
BIG_REPEAT = 3
WARMUP = 5
#: Start timeouts: a first vm boot may have to pull the image.
START_TIMEOUT = {"namespace": 60.0, "vm": 600.0}
RUNTIMES = ("namespace", "vm")
#: Bound on each 1/20 MiB transfer (the vm path base64-encodes through lossy text stdout).
IO_TIMEOUT = 120.0


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


# -- measurements -----------------------------------------------------------
def bench_host(repeat: int) -> dict[str, Any]:
    for _ in range(WARMUP):
        subprocess.run(["true"], check=True)
    samples = []
    for _ in range(repeat):
        dt, proc = timed(lambda: subprocess.run(["true"]))
        if proc.returncode != 0:
            raise RuntimeError(f"host `true` exited {proc.returncode}")
        samples.append(dt)
    return {"subprocess_true": summary(samples)}


def _exec_loop(fn: Callable[[], ExecResult], repeat: int, what: str) -> dict[str, Any]:
    """Time ``repeat`` calls of ``fn`` (after a warm-up).

    A call that hits its timeout is a *stall*: it is kept in the samples (it is
    what a caller waited) and counted, so one slow call neither aborts the run
    nor hides.  A non-zero exit of ``true`` is a broken box: that raises.
    """
    stalls = 0

    def one() -> float:
        nonlocal stalls
        dt, result = timed(fn)
        if result.timed_out:
            stalls += 1
            log(f"  warning: {what} hit its timeout after {dt:.2f} s (exit status {result.exit_code})")
        elif result.exit_code != 0:
            raise RuntimeError(f"{what} failed: exit {result.exit_code}, stderr {result.stderr[-500:]!r}")
        return dt

    for _ in range(WARMUP):
        one()
    warmup_stalls, stalls = stalls, 0
    stats = summary([one() for _ in range(repeat)])
    stats["stalls"] = stalls
    stats["warmup_stalls"] = warmup_stalls
    return stats


def _io_loop(sb: Sandbox, path: str, data: bytes, repeat: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Time ``repeat`` writes and reads of ``data``; every read is checked by sha256."""
    want = hashlib.sha256(data).hexdigest()
    sb.write_bytes(path, data)  # warm-up: directory creation, page cache, helper start
    sb.read_bytes(path)
    writes, reads = [], []
    mismatches = 0
    for _ in range(repeat):
        dt, _ = timed(lambda: sb.write_bytes(path, data))
        writes.append(dt)
        dt, got = timed(lambda: sb.read_bytes(path))
        reads.append(dt)
        mismatches += hashlib.sha256(got).hexdigest() != want
    read = summary(reads)
    read["sha256_mismatches"] = mismatches
    return summary(writes), read


def host_file_io(size: int, repeat: int) -> dict[str, float]:
    """Write/read ``size`` bytes to a file on the host (page cache): the transfer rows' baseline."""
    data = os.urandom(size)
    writes, reads = [], []
    with tempfile.TemporaryDirectory(prefix="pbx-bench-hostio-") as tmp:
        path = Path(tmp) / "host-io.bin"
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            path.write_bytes(data)
            t1 = time.perf_counter()
            if path.read_bytes() != data:
                raise RuntimeError("host file read back different bytes")
            t2 = time.perf_counter()
            writes.append(t1 - t0)
            reads.append(t2 - t1)
    mib = size / MIB
    return {"write_mib_s": mib / statistics.median(writes[1:]), "read_mib_s": mib / statistics.median(reads[1:])}


def bench_sandbox(sb: Sandbox, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.table == "files":
        return bench_files(sb, args)
    t = args.exec_timeout
    log(f"  run(['true']) x{args.repeat}")
    out["run_true"] = _exec_loop(lambda: sb.run(["true"], timeout=t), args.repeat, "run(['true'])")
    log(f"  execute_command('true') x{args.repeat}")
    out["execute_command_true"] = _exec_loop(
        lambda: sb.execute_command("true", timeout=t), args.repeat, "execute_command('true')"
    )
    return out


def bench_files(sb: Sandbox, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    log(f"  1 MiB write_bytes/read_bytes x{args.io_repeat}")
    out["write_1mib"], out["read_1mib"] = _io_loop(sb, "bench/small.bin", os.urandom(SMALL), args.io_repeat)

    log(f"  20 MiB write_bytes/read_bytes x{BIG_REPEAT}")
    w, r = _io_loop(sb, "bench/big.bin", os.urandom(BIG), BIG_REPEAT)
    out["write_20mib"], out["read_20mib"] = w, r
    out["write_20mib_mib_s"] = BIG / MIB / w["p50"]
    out["read_20mib_mib_s"] = BIG / MIB / r["p50"]
    sb.remove("bench")
    return out


def bench_runtime(kind: str, home: Path, token: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = BoxSpec(image=args.image) if args.image else BoxSpec()
    rt: Runtime = open_runtime(kind, home, f"bench{os.getpid()}")
    # Every name ever handed to create_box, so even a box whose handle never
    # came back (Ctrl-C inside create_box) is removed by name.
    attempted: list[str] = []
    live: dict[str, BoxHandle] = {}
    creates: list[float] = []
    destroys: list[float] = []
    result: dict[str, Any] = {"isolation": rt.isolation, "image": spec.image}

    def create(i: int) -> BoxHandle:
        name = f"pbx-bench{token}-{i}"
        attempted.append(name)
        dt, handle = timed(lambda: rt.create_box(spec, name, timeout=START_TIMEOUT[kind]))
        live[name] = handle
        creates.append(dt)
        log(f"  created {name} in {dt * 1e3:.1f} ms")
        return handle

    def destroy(handle: BoxHandle) -> None:
        dt, _ = timed(handle.destroy)
        del live[handle.name]
        destroys.append(dt)

    try:
        # Box 0 carries the workload; the others are created and destroyed one
        # at a time, so at most two boxes exist at once.
        work = create(0)
        for i in range(1, args.boxes):
            destroy(create(i))
        result.update(bench_sandbox(Sandbox(work, default_timeout=IO_TIMEOUT), args))
        destroy(work)
        result["create_start"] = summary(creates)
        result["destroy"] = summary(destroys)
        return result
    finally:
        with deferred_signals():
            for handle in list(live.values()):
                try:
                    handle.destroy()
                except Exception as exc:  # noqa: BLE001 - keep removing the rest
                    log(f"  warning: destroying {handle.name} failed: {exc}")
            for name in attempted:
                try:
                    rt.remove_box(name)
                except Exception as exc:  # noqa: BLE001 - keep removing the rest
                    log(f"  warning: removing {name} failed: {exc}")
            try:
                left = [b.name for b in rt.list_boxes() if b.name.startswith(f"pbx-bench{token}-")]
                if left:
                    log(f"  warning: boxes still listed after cleanup: {', '.join(left)}")
            finally:
                rt.close()


# -- report -----------------------------------------------------------------


def _note(stats: dict[str, Any]) -> str:
    notes = []
    if stats.get("stalls"):
        notes.append(f"{stats['stalls']} call(s) hit the timeout (max {stats['max']:.2f} s)")
    if "sha256_mismatches" in stats:
        bad = stats["sha256_mismatches"]
        notes.append(f"sha256 MISMATCH in {bad}/{stats['n']}" if bad else f"sha256 ok {stats['n']}/{stats['n']}")
    return "; ".join(notes)


def table_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    files = report["meta"]["table"] == "files"
    host = report["host"]
    rows: list[tuple[str, ...]] = []

    def row(runtime: str, metric: str, stats: dict[str, Any], base: float | None, key: str = "p50") -> None:
        rows.append(
            (runtime, f"{metric} {key}", str(stats["n"]), fmt_time(stats[key]),
             f"{stats[key] / base:.1f}x" if base else "-", _note(stats) if key == "p50" else "")
        )  # fmt: skip

    if files:
        for size in ("1mib", "20mib"):
            for op in ("write", "read"):
                rate = host[f"{op}_{size}"]["write_mib_s" if op == "write" else "read_mib_s"]
                rows.append(("host", f"file {op} {size[:-3]} MiB", "", f"{rate:,.0f} MiB/s", "1x", "page cache"))
    else:
        true = host["subprocess_true"]
        row("host", 'subprocess.run(["true"])', true, true["p50"])
        row("host", 'subprocess.run(["true"])', true, true["p90"], "p90")
    for kind, res in report["runtimes"].items():
        if "skipped" in res:
            rows.append((kind, "skipped", "", "", "", res["skipped"]))
            continue
        if files:
            for op in ("write", "read"):
                host_time = (1 << 20) / MIB / host[f"{op}_1mib"][f"{op}_mib_s"]
                row(kind, f"{op}_bytes 1 MiB", res[f"{op}_1mib"], host_time)
            for op in ("write", "read"):
                stats, rate = res[f"{op}_20mib"], res[f"{op}_20mib_mib_s"]
                vs = rate / host[f"{op}_20mib"][f"{op}_mib_s"]
                rows.append((kind, f"{op}_bytes 20 MiB", str(stats["n"]), f"{rate:.1f} MiB/s", f"{vs:.3f}x",
                             _note(stats)))  # fmt: skip
            continue
        true = host["subprocess_true"]
        row(kind, "create+start", res["create_start"], true["p50"])
        row(kind, 'run(["true"])', res["run_true"], true["p50"])
        row(kind, 'run(["true"])', res["run_true"], true["p90"], "p90")
        row(kind, 'execute_command("true")', res["execute_command_true"], true["p50"])
        row(kind, "destroy", res["destroy"], true["p50"])
    return rows


def render(report: dict[str, Any]) -> str:
    header = ("runtime", "metric", "n", "value", "vs host", "note")
    meta = report["meta"]
    vs = (
        "vs host = the time over the host file's (1 MiB), the rate over the host file's (20 MiB)"
        if meta["table"] == "files"
        else 'vs host = the time over host subprocess.run(["true"]) at the same percentile'
    )
    out = [f"vm probe: {meta['probe']}", vs, "", *table(header, table_rows(report), left=(0, 1, 5))]
    for kind, res in report["runtimes"].items():
        if "isolation" not in res:
            continue
        out.append(f"{kind}: {res['isolation']}")
        stalls = sum(res[m]["stalls"] for m in ("run_true", "execute_command_true") if m in res)
        if stalls:
            out.append(
                f"warning: {kind}: {stalls} of {2 * meta['repeat']} execs of `true` ran into the "
                f"{meta['exec_timeout']:g} s exec timeout (kept in the samples; see the note column)"
            )
    return "\n".join(out)


# -- main -------------------------------------------------------------------
def add_box(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime", choices=(*RUNTIMES, "all"), default="all", help="runtime(s) to measure (default: all)")
    option(p, "--repeat", 200, 20, help="exec calls per exec metric")
    option(p, "--boxes", 5, 3, help="boxes created/destroyed per runtime")
    option(p, "--exec-timeout", 5.0, type=seconds, help="timeout of each exec of `true`, in seconds")
    p.add_argument("--image", default=None, help="box image (default: the BoxSpec default; the vm runtime uses it)")


def add_files(p: argparse.ArgumentParser) -> None:
    add_box(p)
    option(p, "--io-repeat", 20, 3, help="1 MiB writes/reads")


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    if args.table == "files":
        args.boxes = 1
    pr = probe()
    report: dict[str, Any] = {
        "meta": {
            "table": args.table,
            "probe": pr.reason,
            "boxlite": pr.boxlite_version,
            "repeat": args.repeat,
            "boxes": args.boxes,
            "io_repeat": getattr(args, "io_repeat", None),
            "exec_timeout": args.exec_timeout,
            "unit": "seconds unless the key says otherwise",
        },
        "runtimes": {},
    }
    if args.table == "files":
        log("host: file write/read")
        report["host"] = {f"{op}_{name}": host_file_io(size, 3) for name, size in (("1mib", SMALL), ("20mib", BIG))
                          for op in ("write", "read")}  # fmt: skip
    else:
        log('host: subprocess.run(["true"])')
        report["host"] = bench_host(args.repeat)

    kinds = RUNTIMES if args.runtime == "all" else (args.runtime,)
    token = secrets.token_hex(3)
    home = Path(tempfile.mkdtemp(prefix="pbx-bench-"))
    try:
        for kind in kinds:
            if kind == "vm" and not pr.vm_ok:
                log(f"vm: skipped: {pr.reason}")
                report["runtimes"][kind] = {"skipped": pr.reason}
                continue
            log(f"{kind}:")
            try:
                report["runtimes"][kind] = bench_runtime(kind, home, token, args)
            except RuntimeUnavailableError as exc:
                log(f"{kind}: skipped: {exc}")
                report["runtimes"][kind] = {"skipped": str(exc)}
    finally:
        with deferred_signals():
            shutil.rmtree(home, ignore_errors=True)

    print("\n".join([*machine_header(), render(report)]), flush=True)
    bad = [
        k
        for k, r in report["runtimes"].items()
        if r.get("read_1mib", {}).get("sha256_mismatches") or r.get("read_20mib", {}).get("sha256_mismatches")
    ]
    if bad:
        log(f"error: read_bytes returned different bytes than were written ({', '.join(bad)})")
        return 1, report
    return 0, report


BOX = Table("box", "a box's start, exec of `true` and destroy, beside a host subprocess", __doc__ or "", add_box, run)
FILES = Table("files", "write_bytes/read_bytes of 1 and 20 MiB, beside a host file", __doc__ or "", add_files, run)
