"""The warm pool (:class:`pytest_boxlite.pool.BoxPool`) against real namespace boxes.

Every test gets its own home directory and runtime, so counting the boxes on
disk (``runtime.list_boxes()``) counts exactly the boxes of the pool under test.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from subruns import plans_grew, record_fork_plans, wait_until

from pytest_boxlite import errors
from pytest_boxlite.pool import BoxPool, make_namer
from pytest_boxlite.runtimes.namespace import NamespaceRuntime
from pytest_boxlite.spec import BoxSpec

SPEC = BoxSpec()
#: A second spec: differs from SPEC only by its environment, so it gets its own warm queue.
OTHER_SPEC = BoxSpec(env=(("POOL_TEST_SPEC", "other"),))
POOL_THREAD_PREFIXES = ("boxlite-pool", "boxlite-idle-reaper")

PoolFactory = Callable[..., BoxPool]


def box_names(rt: NamespaceRuntime) -> set[str]:
    return {rec.name for rec in rt.list_boxes()}


def pool_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(POOL_THREAD_PREFIXES)}


@pytest.fixture
def ns_home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def rt(ns_home: Path) -> Iterator[NamespaceRuntime]:
    """A namespace runtime in a private home; any box a failing test left is removed afterwards."""
    runtime = NamespaceRuntime(ns_home)
    try:
        yield runtime
    finally:
        for rec in runtime.list_boxes():
            runtime.remove_box(rec.name)
        runtime.close()


@pytest.fixture
def make_pool(rt: NamespaceRuntime) -> Iterator[PoolFactory]:
    """``make_pool(max_boxes=..., ...)``: pools on ``rt``, all shut down at teardown."""
    pools: list[BoxPool] = []

    def make(**kwargs: object) -> BoxPool:
        kwargs.setdefault("namer", make_namer(uuid.uuid4().hex[:8]))
        kwargs.setdefault("boot_timeout", 30.0)
        kwargs.setdefault("lease_timeout", 60.0)
        pool = BoxPool(rt, **kwargs)  # type: ignore[arg-type]
        pools.append(pool)
        return pool

    try:
        yield make
    finally:
        for pool in pools:
            pool.shutdown()


# -- the cap -----------------------------------------------------------------


@pytest.mark.timeout(150)
def test_stress_cap_holds_and_nothing_is_left(rt: NamespaceRuntime, make_pool: PoolFactory) -> None:
    """8 threads x 50 lease/release with max_boxes=3: never more than 3 live boxes, zero left after shutdown."""
    max_boxes, threads, rounds = 3, 8, 50
    pool = make_pool(max_boxes=max_boxes)
    pool.prewarm(SPEC)

    samples: list[tuple[int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((pool.live, len(rt.list_boxes())))
            time.sleep(0.005)

    held: set[str] = set()
    held_lock = threading.Lock()
    problems: list[str] = []

    def work() -> None:
        try:
            for _ in range(rounds):
                lease = pool.lease(SPEC)
                name = lease.handle.name
                with held_lock:
                    if name in held:
                        problems.append(f"{name} leased twice at once")
                    held.add(name)
                    concurrently = len(held)
                if concurrently > max_boxes:
                    problems.append(f"{concurrently} leases held at once")
                with held_lock:
                    held.discard(name)
                lease.release()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            problems.append(f"worker failed: {exc!r}")

    sampler = threading.Thread(target=sample, name="stress-sampler", daemon=True)
    sampler.start()
    workers = [threading.Thread(target=work, name=f"stress-{i}", daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    stop.set()
    sampler.join(10)

    assert not any(w.is_alive() for w in workers), "stress workers did not finish within 120 s"
    assert problems == []
    assert pool.stats.leased == threads * rounds
    assert samples, "the sampler took no samples"
    assert max(live for live, _ in samples) <= max_boxes
    assert max(on_disk for _, on_disk in samples) <= max_boxes
    assert pool.stats.max_live <= max_boxes
    assert pool.stats.booted >= threads * rounds  # no box went to a second lease

    pool.shutdown()
    assert pool.live == 0
    assert rt.list_boxes() == []
    assert pool.destroy_errors == []


@pytest.mark.timeout(60)
def test_lease_at_cap_waits_then_times_out_clearly(make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=1, lease_timeout=0.6)
    held = pool.lease(SPEC)
    t0 = time.monotonic()
    with pytest.raises(errors.LeaseTimeoutError) as excinfo:
        pool.lease(SPEC)
    waited = time.monotonic() - t0
    assert waited >= 0.5, "the lease gave up before its timeout"
    assert waited < 30, "the lease waited far beyond its timeout"
    msg = str(excinfo.value)
    assert "no box of" in msg
    assert "boxes are in use" in msg
    assert "--boxlite-max-boxes" in msg
    assert "--boxlite-lease-timeout" in msg
    # A lease timeout is a BoxliteError (and a TimeoutError) that callers can catch generically.
    assert isinstance(excinfo.value, errors.BoxliteError)
    assert isinstance(excinfo.value, TimeoutError)
    assert pool.live == 1
    held.release()


@pytest.mark.timeout(60)
def test_lease_at_cap_gets_the_capacity_freed_by_a_release(make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=1)
    held = pool.lease(SPEC)
    released = threading.Event()

    def release_later() -> None:
        time.sleep(0.3)
        released.set()
        held.release()

    releaser = threading.Thread(target=release_later, daemon=True)
    releaser.start()
    lease = pool.lease(SPEC, timeout=30)
    releaser.join(10)
    assert released.is_set(), "the second lease did not wait for the first box to be released"
    assert lease.handle.name != held.handle.name
    assert lease.sandbox.execute_command("echo ok").stdout.strip() == "ok"
    assert pool.live <= 1
    lease.release()


# -- specs and eviction ------------------------------------------------------


@pytest.mark.timeout(60)
def test_lease_of_other_spec_at_cap_evicts_an_idle_warm_box(rt: NamespaceRuntime, make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=1)
    pool.prewarm(SPEC)
    assert wait_until(lambda: pool.warm_count(SPEC) == 1), "the pool never warmed a box"
    (warm_name,) = box_names(rt)

    lease = pool.lease(OTHER_SPEC, timeout=20)
    assert pool.stats.evicted == 1
    assert lease.handle.name != warm_name
    assert warm_name not in box_names(rt), "the evicted warm box is still on disk"
    assert pool.live == 1
    assert len(rt.list_boxes()) == 1
    # The box really is of the other spec.
    assert lease.sandbox.execute_command("echo $POOL_TEST_SPEC").stdout.strip() == "other"
    lease.release()


@pytest.mark.timeout(60)
def test_each_spec_gets_its_own_boxes(make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=2)
    with pool.sandbox(SPEC) as a, pool.sandbox(OTHER_SPEC) as b:
        assert a.execute_command("echo ${POOL_TEST_SPEC:-default}").stdout.strip() == "default"
        assert b.execute_command("echo ${POOL_TEST_SPEC:-default}").stdout.strip() == "other"
        assert a.name != b.name


# -- reuse -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_without_reuse_a_box_never_serves_two_leases(rt: NamespaceRuntime, make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=2)
    pool.prewarm(SPEC)
    seen: list[str] = []
    # One side opting in is not enough: a reuse=True lease neither gets the box of a plain lease
    # before it, nor gives its own box to the plain leases after it.
    for reuse in (False, True, False, False):
        lease = pool.lease(SPEC, reuse=reuse, timeout=20)
        seen.append(lease.handle.name)
        assert not lease.sandbox.exists("/workspace/used-before"), "a leased box was not pristine"
        lease.sandbox.write_file("/workspace/used-before", "x")
        lease.release()
    assert len(set(seen)) == len(seen), f"a box was handed out twice: {seen}"
    assert pool.stats.reused == 0


@pytest.mark.timeout(60)
def test_reuse_opt_in_on_both_leases_gets_the_same_box(make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=2)
    first = pool.lease(SPEC, reuse=True)
    first.sandbox.write_file("/workspace/state", "from the first lease")
    name = first.handle.name
    first.release()

    second = pool.lease(SPEC, reuse=True)
    assert second.handle.name == name
    assert second.sandbox.read_file("/workspace/state") == "from the first lease"
    assert pool.stats.reused == 1
    second.release()


@pytest.mark.timeout(60)
def test_reused_box_is_health_checked_before_it_is_handed_out(rt: NamespaceRuntime, make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=2)
    first = pool.lease(SPEC, reuse=True)
    name = first.handle.name
    first.release()
    # Fault injection: kill the pooled box behind the pool's back, as a crash would.
    rt.remove_box(name)

    second = pool.lease(SPEC, reuse=True, timeout=20)
    assert second.handle.name != name
    assert second.handle.alive()
    assert pool.stats.unhealthy == 1
    assert second.sandbox.execute_command("echo alive").stdout.strip() == "alive"
    second.release()


@pytest.mark.timeout(60)
def test_idle_reusable_box_does_not_block_a_pristine_lease_at_the_cap(make_pool: PoolFactory) -> None:
    """A box parked for reuse is idle capacity: a non-reuse lease of the same spec must not starve behind it."""
    pool = make_pool(max_boxes=1, idle_timeout=0)
    first = pool.lease(SPEC, reuse=True)
    name = first.handle.name
    first.release()
    second = pool.lease(SPEC, timeout=5)
    assert second.handle.name != name
    second.release()


@pytest.mark.timeout(60)
def test_dead_warm_box_is_never_handed_out(rt: NamespaceRuntime, make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=2)
    pool.health_after = 0  # check every warm box, however fresh
    pool.prewarm(SPEC)
    assert wait_until(lambda: pool.warm_count(SPEC) == 2), "the pool never warmed its boxes"
    dead = box_names(rt)
    assert len(dead) == 2
    # Fault injection: kill the warm boxes behind the pool's back (the real runtime's removal).
    for name in dead:
        rt.remove_box(name)

    for _ in range(3):
        lease = pool.lease(SPEC, timeout=20)
        assert lease.handle.name not in dead
        assert lease.sandbox.execute_command("echo ok").stdout.strip() == "ok"
        lease.release()
    assert pool.stats.unhealthy == 2


# -- idle reaper and shutdown ------------------------------------------------


@pytest.mark.timeout(60)
def test_idle_reaper_stops_warm_boxes(rt: NamespaceRuntime, make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=2, idle_timeout=0.5)
    pool.prewarm(SPEC)
    assert wait_until(lambda: pool.warm_count(SPEC) == 2), "the pool never warmed its boxes"
    assert wait_until(lambda: pool.live == 0, timeout=15), f"warm boxes outlived the idle timeout (live={pool.live})"
    assert wait_until(lambda: rt.list_boxes() == [], timeout=5)
    assert pool.stats.idle_reaped >= 2
    # Nobody asked for boxes lately: the pool must not boot them again on its own.
    time.sleep(0.5)
    assert pool.live == 0
    # ...but a lease still works, and reopens the spec.
    with pool.sandbox(SPEC) as sb:
        assert sb.execute_command("echo back").stdout.strip() == "back"


@pytest.mark.timeout(60)
def test_idle_timeout_zero_never_reaps(make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=1, idle_timeout=0)
    pool.prewarm(SPEC)
    assert wait_until(lambda: pool.warm_count(SPEC) == 1)
    time.sleep(1.2)  # longer than one reaper tick
    assert pool.warm_count(SPEC) == 1
    assert pool.stats.idle_reaped == 0


@pytest.mark.timeout(60)
def test_shutdown_is_idempotent_joins_threads_and_leaves_no_boxes(rt: NamespaceRuntime) -> None:
    before = pool_threads()
    pool = BoxPool(rt, namer=make_namer(uuid.uuid4().hex[:8]), max_boxes=3, boot_timeout=30)
    try:
        pool.prewarm(SPEC, count=2)
        held = pool.lease(OTHER_SPEC)
        assert wait_until(lambda: pool.warm_count(SPEC) >= 1)
        assert pool_threads() - before, "the pool started no threads to check"
    finally:
        pool.shutdown()
    pool.shutdown()  # idempotent: no error, nothing more to do

    leftover = {t.name for t in pool_threads() - before if t.is_alive()}
    assert leftover == set()
    assert rt.list_boxes() == []
    assert pool.live == 0
    with pytest.raises(errors.BoxliteError, match="shut down"):
        pool.lease(SPEC, timeout=1)
    # A lease released after shutdown (its box was already destroyed) must not be counted twice.
    held.release()
    assert pool.live == 0
    assert pool.stats.destroyed == 3


# -- speed -------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_warm_lease_is_faster_than_cold(make_pool: PoolFactory) -> None:
    n = 5
    warm_pool = make_pool(max_boxes=1, idle_timeout=0)
    warm_pool.prewarm(SPEC)
    warm: list[float] = []
    for _ in range(n):
        assert wait_until(lambda: warm_pool.warm_count(SPEC) == 1), "the pool did not refill"
        lease = warm_pool.lease(SPEC)
        warm.append(lease.waited)
        lease.release()
    assert warm_pool.stats.warm_hits == n

    cold_pool = make_pool(max_boxes=1)  # never prewarmed: every lease boots its box
    cold: list[float] = []
    for _ in range(n):
        lease = cold_pool.lease(SPEC)
        cold.append(lease.waited)
        lease.release()
        assert wait_until(lambda: cold_pool.live == 0)
    assert cold_pool.stats.warm_hits == 0
    assert statistics.median(warm) < statistics.median(cold), f"warm {warm} vs cold {cold}"


# -- boxes forked from a zygote ---------------------------------------------------


@pytest.mark.timeout(150)
def test_a_forking_runtime_refills_the_pool_with_pristine_forked_boxes(
    rt: NamespaceRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With forking on (as a session has it), every box the pool boots after the first is forked from
    one zygote; each lease is pristine, concurrent leases stay under the cap, and once the pool and
    the zygote are stopped nothing is left."""
    rt.allow_forked_boxes(True)
    # A new zygote comes only with a plan that hides a path no zygote hid before (another session's
    # home, started meanwhile: CI runs jobs side by side): counted, so that one is no failure here.
    plans = record_fork_plans(rt, monkeypatch)
    pool = BoxPool(rt, namer=make_namer(uuid.uuid4().hex[:8]), max_boxes=3, boot_timeout=30, lease_timeout=60)
    zygotes: set[str | None] = set()
    seen_boxes: set[str] = set()
    errors_seen: list[BaseException] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            lease = pool.lease(SPEC)
            try:
                sb = lease.sandbox
                r = sb.execute_command(f"ls /etc/pbx-pool-* 2>/dev/null; echo {i} > /etc/pbx-pool-{i}")
                assert r.ok and r.stdout == "", f"lease {i} saw another lease's file: {r.stdout!r}"
                with lock:
                    zygotes.add(getattr(lease.handle, "forked_from", None))
                    seen_boxes.add(lease.handle.name)
            finally:
                lease.release()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors_seen.append(exc)

    try:
        pool.prewarm(SPEC, count=2)
        for _ in range(4):
            threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert pool.live <= 3
        assert errors_seen == []
        assert len(seen_boxes) == 24, "a box served two leases"
        grew = plans_grew([p.hidden for p in plans])
        assert 1 <= len(zygotes) <= 1 + grew and None not in zygotes, (zygotes, grew)
        assert pool.stats.boot_failures == 0
    finally:
        pool.shutdown()
        rt.stop_forking()
    assert rt.list_boxes() == []
