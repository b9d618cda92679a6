"""The warm pool: a lease when a warm box is ready against one that must boot.

For every runtime that can run on this host (``vm`` is skipped, with the
probe's reason, where no micro-VM can boot) it drives
:class:`~pytest_boxlite.pool.BoxPool` directly, on a runtime opened on a
temporary home:

* **warm lease**: the pool is prewarmed to ``--replicas`` boxes; before each
  sample the script waits until ``pool.warm_count(spec) == replicas`` (so the
  refill of the previous lease is done), then times ``pool.lease(spec)``; the
  box is released (destroyed in the background, and the pool refills);
  (``pool.health_after`` is set to infinity for these samples, so a slow
  refill never turns one into a health-checked lease);
* **warm lease, health-checked**: the same, with ``pool.health_after = 0`` so
  every lease runs the health check a box gets when it sat warm for a while
  (more than 2 s by default: the first leases of a pytest session pay it);
* **cold lease**: a second pool that is never prewarmed; before each sample
  the script waits until it has no live box, so every ``lease()`` boots one;
* **boot**: ``pool.stats.boot_times`` of both pools (create + start of one box;
  the warm pool's boots run in the background, next to destroys).

The headline is the ratio cold / warm lease p50.  Every box is destroyed and the temporary home
removed in ``finally`` blocks (Ctrl-C and SIGTERM included).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._bench import Table, deferred_signals, fmt_time, log, machine_header, option, summary, table
from pytest_boxlite.errors import RuntimeUnavailableError
from pytest_boxlite.pool import BoxPool, make_namer
from pytest_boxlite.runtimes import Runtime, open_runtime, probe
from pytest_boxlite.spec import BoxSpec

RUNTIMES = ("namespace", "vm")
#: Bound on one boot; a first vm boot may have to pull the image.
BOOT_TIMEOUT = {"namespace": 60.0, "vm": 600.0}
WARMUP = 3


# -- helpers ----------------------------------------------------------------


def wait_until(cond: Callable[[], bool], pool: BoxPool, timeout: float, what: str) -> None:
    """Poll ``cond`` (every 0.5 ms: the pool has no public event for it); fail on a boot error or timeout."""
    deadline = time.monotonic() + timeout
    failures = pool.stats.boot_failures
    while not cond():
        if pool.stats.boot_failures != failures:
            raise RuntimeError(f"a box failed to boot while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.0005)


# -- measurements -----------------------------------------------------------
def time_leases(pool: BoxPool, spec: BoxSpec, n: int, ready: Callable[[], bool], what: str) -> dict[str, Any]:
    """Time ``n`` leases (after a warm-up), each taken once ``ready()`` holds."""
    callers: list[float] = []
    waits: list[float] = []
    warm_hits = 0
    for i in range(WARMUP + n):
        wait_until(ready, pool, pool.boot_timeout * 2, what)
        hits = pool.stats.warm_hits
        t0 = time.perf_counter()
        lease = pool.lease(spec)
        dt = time.perf_counter() - t0
        lease.release()
        if i >= WARMUP:
            callers.append(dt)
            waits.append(lease.waited)
            warm_hits += pool.stats.warm_hits - hits
    out = summary(callers)
    out["pool_wait_p50"] = statistics.median(waits)
    out["warm_hits"] = warm_hits
    return out


def bench_runtime(kind: str, home: Path, token: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = BoxSpec(image=args.image) if args.image else BoxSpec()
    prefix = f"pbx-bench{token}"
    rt: Runtime = open_runtime(kind, home, f"bench{token}")
    pools: list[BoxPool] = []
    replicas: int = args.replicas
    result: dict[str, Any] = {"isolation": rt.isolation, "replicas": replicas}

    def make_pool(tag: str) -> BoxPool:
        pool = BoxPool(
            rt,
            namer=make_namer(f"bench{token}{tag}"),
            max_boxes=args.replicas,
            boot_timeout=BOOT_TIMEOUT[kind],
            lease_timeout=BOOT_TIMEOUT[kind] * 2,
            idle_timeout=0,  # never reap: the waits between samples must not empty the pool
        )
        pools.append(pool)
        return pool

    try:
        warm = make_pool("w")

        def full() -> bool:
            return warm.warm_count(spec) == replicas

        warm.prewarm(spec)
        log(f"  prewarming {args.replicas} box(es)")
        wait_until(full, warm, BOOT_TIMEOUT[kind] * 2, "the first warm boxes")
        log(f"  warm lease x{args.leases}")
        # Pure warm path first: no health check, whatever the refill took.
        warm.health_after = float("inf")
        result["warm_lease"] = time_leases(warm, spec, args.leases, full, "a full warm pool")
        log(f"  warm lease, health-checked x{args.leases}")
        warm.health_after = 0.0
        result["warm_lease_checked"] = time_leases(warm, spec, args.leases, full, "a full warm pool")
        warm.shutdown()
        result["boot_warm_pool"] = summary(list(warm.stats.boot_times))
        result["unhealthy"] = warm.stats.unhealthy

        cold = make_pool("c")
        log(f"  cold lease x{args.cold}")
        result["cold_lease"] = time_leases(cold, spec, args.cold, lambda: cold.live == 0, "the pool to be empty")
        cold.shutdown()
        result["boot_cold_pool"] = summary(list(cold.stats.boot_times))
        result["ratio_cold_warm_p50"] = result["cold_lease"]["p50"] / result["warm_lease"]["p50"]
        return result
    finally:
        with deferred_signals():
            for pool in pools:
                try:
                    pool.shutdown()
                except Exception as exc:  # noqa: BLE001 - keep cleaning up
                    log(f"  warning: pool shutdown failed: {exc}")
            try:
                left = [b.name for b in rt.list_boxes() if b.name.startswith(prefix)]
                for name in left:
                    log(f"  warning: box {name} still listed after the pool shut down; removing it")
                    with contextlib.suppress(Exception):
                        rt.remove_box(name)
                result["leftover_boxes"] = left
            finally:
                rt.close()


# -- report -----------------------------------------------------------------
def table_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for kind, res in report["runtimes"].items():
        if "skipped" in res:
            rows.append((kind, "skipped", "", "", "", res["skipped"]))
            continue

        def row(metric: str, stats: dict[str, Any], note: str = "", kind: str = kind) -> None:
            rows.append((kind, metric, str(stats["n"]), fmt_time(stats["p50"]), fmt_time(stats["p90"]), note))

        for key, label in (("warm_lease", "warm lease"), ("warm_lease_checked", "warm lease, health-checked")):
            st = res[key]
            note = f"pool's own wait p50 {fmt_time(st['pool_wait_p50'])}; warm hits {st['warm_hits']}/{st['n']}"
            row(label, st, note)
        st = res["cold_lease"]
        row("cold lease (no warm box)", st, f"warm hits {st['warm_hits']}/{st['n']}")
        row("boot, warm pool (background)", res["boot_warm_pool"], "create+start, next to destroys and refills")
        row("boot, cold pool (inline)", res["boot_cold_pool"], "create+start, inside lease()")
        ratio = res["ratio_cold_warm_p50"]
        rows.append((kind, "cold / warm lease p50", "", f"{ratio:,.0f}x", "", "headline"))
    return rows


def render(report: dict[str, Any]) -> str:
    meta = report["meta"]
    out = [
        f"pool: boxlite {meta['boxlite']}; vm probe: {meta['probe']}",
        f"replicas={meta['replicas']}; lease times are measured by the caller around pool.lease()",
        "",
        *table(("runtime", "metric", "n", "p50", "p90", "note"), table_rows(report), left=(0, 1, 5)),
    ]
    for kind, res in report["runtimes"].items():
        if "isolation" in res:
            out.append(f"{kind}: {res['isolation']}")
        if res.get("leftover_boxes"):
            out.append(f"LEAK: {kind}: boxes left after shutdown: {', '.join(res['leftover_boxes'])}")
    return "\n".join(out)


# -- main -------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime", choices=(*RUNTIMES, "all"), default="all", help="runtime(s) to measure (default: all)")
    option(p, "--leases", 50, 10, help="warm leases timed, each kind")
    option(p, "--cold", 20, 5, help="cold leases timed")
    option(p, "--replicas", 2, help="pool size (the plugin's default)")
    p.add_argument("--image", default=None, help="box image (default: the BoxSpec default; the vm runtime uses it)")


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    pr = probe()
    report: dict[str, Any] = {
        "meta": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "boxlite": pr.boxlite_version,
            "probe": pr.reason,
            "loadavg_start": os.getloadavg(),
            "cpus": os.cpu_count(),
            "replicas": args.replicas,
            "leases": args.leases,
            "cold": args.cold,
            "unit": "seconds unless the key says otherwise",
        },
        "runtimes": {},
    }
    kinds = RUNTIMES if args.runtime == "all" else (args.runtime,)
    token = secrets.token_hex(3)
    home = Path(tempfile.mkdtemp(prefix="pbx-bench-pool-"))
    failed = False
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
            except Exception as exc:  # noqa: BLE001 - a failed measurement fails the run, after cleanup
                log(f"{kind}: FAILED: {type(exc).__name__}: {exc}")
                report["runtimes"][kind] = {"skipped": f"FAILED: {type(exc).__name__}: {exc}"}
                failed = True
    finally:
        with deferred_signals():
            shutil.rmtree(home, ignore_errors=True)

    print("\n".join([*machine_header(), render(report)]), flush=True)
    leaked = [k for k, r in report["runtimes"].items() if r.get("leftover_boxes")]
    if leaked:
        log(f"error: boxes were left after the pool shut down ({', '.join(leaked)})")
    return (1 if failed or leaked else 0), report


POOL = Table(
    "pool", "warm and cold leases of the box pool, and the boots behind them", __doc__ or "", add_arguments, run
)
