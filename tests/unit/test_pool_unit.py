"""Unit tests of :class:`pytest_boxlite.pool.BoxPool` on the in-memory fake runtime.

The same pool is tested against real namespace boxes in ``tests/test_pool.py``; here the
runtime is :class:`fakes.FakeRuntime`, so faults (failing, slow or hung boots and destroys,
boxes dying) can be injected exactly, and every test runs in well under a second.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import pytest
from fakes import FakeBox, FakeRuntime, RecordingLifecycle
from subruns import wait_until

from pytest_boxlite import errors
from pytest_boxlite.pool import BoxPool, DefaultLifecycle, Lease
from pytest_boxlite.runtimes.base import BoxHandle
from pytest_boxlite.spec import BoxSpec

SPEC = BoxSpec()
OTHER = BoxSpec(env=(("UNIT_SPEC", "other"),))
THIRD = BoxSpec(env=(("UNIT_SPEC", "third"),))

PoolFactory = Callable[..., BoxPool]

pytestmark = pytest.mark.timeout(30)
#: The pool works in background threads: poll briefly and often until a state is reached.
settle = functools.partial(wait_until, timeout=5.0, interval=0.002)


def fake(lease: Lease) -> FakeBox:
    """The fake box behind a lease."""
    assert isinstance(lease.handle, FakeBox)
    return lease.handle


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    """Run ``fn()`` in a daemon thread; its result or exception lands in the returned dict."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# -- the cap -----------------------------------------------------------------------


def test_cap_holds_across_specs_under_concurrent_leases(make_pool: PoolFactory, fake_runtime: FakeRuntime) -> None:
    """8 threads lease boxes of three specs: never more live boxes than max_boxes, none left after shutdown."""
    fake_runtime.boot_delay = 0.001
    max_boxes, threads, rounds = 3, 8, 25
    pool = make_pool(max_boxes=max_boxes, lease_timeout=10)
    pool.prewarm(SPEC)
    specs = [SPEC, OTHER, THIRD]
    problems: list[str] = []
    held: set[str] = set()
    lock = threading.Lock()

    def work(i: int) -> None:
        try:
            for r in range(rounds):
                spec = specs[(i + r) % len(specs)]
                lease = pool.lease(spec)
                box = fake(lease)
                with lock:
                    if box.name in held:
                        problems.append(f"{box.name} leased twice at once")
                    held.add(box.name)
                if box.spec != spec:
                    problems.append(f"asked for {spec.describe()}, got {box.spec.describe()}")
                if box.dead:
                    problems.append(f"{box.name} handed out destroyed")
                with lock:
                    held.discard(box.name)
                lease.release()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            problems.append(f"worker {i} failed: {exc!r}")

    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(20)
    assert not any(w.is_alive() for w in workers), "workers did not finish"
    assert problems == []
    assert pool.stats.leased == threads * rounds
    assert fake_runtime.max_live <= max_boxes
    assert pool.stats.max_live <= max_boxes
    assert pool.stats.reused == 0
    assert pool.stats.booted == len(fake_runtime.created) >= threads * rounds
    pool.shutdown()
    assert pool.live == 0
    assert fake_runtime.boxes == {}
    assert pool.destroy_errors == []


def test_lease_at_cap_times_out_with_a_clear_error(make_pool: PoolFactory, lifecycle: RecordingLifecycle) -> None:
    pool = make_pool(max_boxes=1, lease_timeout=0.3)
    held = pool.lease(SPEC)
    t0 = time.monotonic()
    with pytest.raises(errors.LeaseTimeoutError) as excinfo:
        pool.lease(OTHER)  # the only box is leased: nothing to evict
    waited = time.monotonic() - t0
    assert 0.25 <= waited < 3, waited
    msg = str(excinfo.value)
    assert f"no box of {OTHER.describe()} became available within 0s" in msg
    assert "all 1 boxes are in use (1 leased, 0 booting)" in msg
    assert "--boxlite-max-boxes" in msg and "--boxlite-lease-timeout" in msg
    assert isinstance(excinfo.value, errors.BoxliteError)
    assert isinstance(excinfo.value, TimeoutError)
    # The owner was asked to let a box go before the lease gave up.
    assert lifecycle.steps("relieve")[0] == OTHER.describe()
    # The per-call timeout overrides the pool's.
    t0 = time.monotonic()
    with pytest.raises(errors.LeaseTimeoutError):
        pool.lease(SPEC, timeout=0.05)
    # The pool's is 5 s: a bound well under it, and far over 0.05 s for a loaded machine.
    assert time.monotonic() - t0 < 4.0, "the per-call timeout was not used"
    assert pool.live == 1
    assert pool.stats.leased == 1
    held.release()


def test_lease_times_out_while_the_only_box_is_still_booting(make_pool: PoolFactory, fake_runtime: FakeRuntime) -> None:
    fake_runtime.boot_delay = 1.0
    pool = make_pool(max_boxes=1, lease_timeout=0.2)
    pool.prewarm(SPEC)
    with pytest.raises(errors.LeaseTimeoutError, match=r"\(0 leased, 1 booting\)"):
        pool.lease(SPEC)
    assert fake_runtime.boot_attempts == 1, "the lease booted a second box instead of waiting for the first"


def test_lease_at_cap_gets_the_capacity_a_release_frees(make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=1, lease_timeout=5)
    held = pool.lease(SPEC)

    def release_later() -> None:
        time.sleep(0.1)
        held.release()

    t, _ = in_thread(release_later)
    lease = pool.lease(OTHER)
    t.join(5)
    assert lease.waited >= 0.08, "the lease did not wait for the release"
    assert fake(held).dead
    assert fake(lease).spec == OTHER
    assert pool.live == 1
    lease.release()


def test_lease_waits_for_the_box_booting_for_it_rather_than_boot_another(
    make_pool: PoolFactory, fake_runtime: FakeRuntime
) -> None:
    fake_runtime.boot_delay = 0.1
    pool = make_pool(max_boxes=2)
    pool.prewarm(SPEC, count=1)
    lease = pool.lease(SPEC)
    assert fake_runtime.boot_attempts == 1
    assert pool.stats.warm_hits == 0, "a box that arrived while the lease waited is not a warm hit"
    lease.release()


def test_warm_lease_is_a_hit_and_the_pool_refills(make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=2)
    pool.prewarm(SPEC)
    assert settle(lambda: pool.warm_count(SPEC) == 2)
    lease = pool.lease(SPEC)
    assert pool.stats.warm_hits == 1
    assert settle(lambda: pool.warm_count(SPEC) == 1 and pool.live == 2)
    lease.release()
    assert settle(lambda: pool.warm_count(SPEC) == 2), "the pool did not refill after the release"
    assert pool.live == 2


# -- eviction and relief ---------------------------------------------------------------


def test_lease_of_another_spec_at_the_cap_evicts_an_idle_warm_box(
    make_pool: PoolFactory, fake_runtime: FakeRuntime, lifecycle: RecordingLifecycle
) -> None:
    pool = make_pool(max_boxes=1)
    pool.prewarm(SPEC)
    assert settle(lambda: pool.warm_count(SPEC) == 1)
    (warm,) = fake_runtime.boxes
    lease = pool.lease(OTHER)
    assert pool.stats.evicted == 1
    assert warm not in fake_runtime.boxes
    assert fake(lease).spec == OTHER
    # The evicted box was gone before the new one booted: the cap held at every moment.
    assert fake_runtime.max_live == 1
    assert lifecycle.steps("before_destroy") == [warm]
    assert lifecycle.steps("relieve") == [], "the owner was asked for relief although a box was idle"
    lease.release()


def test_a_box_parked_for_reuse_is_evicted_for_a_pristine_lease(make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=1)
    first = pool.lease(SPEC, reuse=True)
    first.release()
    second = pool.lease(SPEC, timeout=1)
    assert second.handle.name != first.handle.name
    assert fake(first).dead
    assert pool.stats.evicted == 1
    second.release()


def test_blocked_lease_asks_the_owner_to_let_a_held_box_go(
    make_pool: PoolFactory, lifecycle: RecordingLifecycle
) -> None:
    pool = make_pool(max_boxes=1, lease_timeout=2)
    parent = pool.lease(SPEC)  # a box the owner holds for itself (a fork parent)
    given: list[BoxSpec] = []

    def give_way(spec: BoxSpec) -> bool:
        if given:
            return False  # like the executor: one fork parent, given back once
        given.append(spec)
        parent.release()
        return True

    lifecycle.on_relieve = give_way
    lease = pool.lease(OTHER)
    assert given == [OTHER]
    assert fake(parent).dead
    assert fake(lease).spec == OTHER
    lease.release()


def test_capacity_freed_while_the_owner_is_asked_for_relief_is_not_missed(
    make_pool: PoolFactory, lifecycle: RecordingLifecycle
) -> None:
    """The pool drops its lock to ask for relief: a box destroyed meanwhile must wake the lease."""
    pool = make_pool(max_boxes=1, lease_timeout=3)
    other = pool.lease(SPEC)

    def nothing_to_give(spec: BoxSpec) -> bool:
        if not fake(other).dead:
            # Meanwhile another thread's lease ends and its box is destroyed (the pool notifies now).
            t, _ = in_thread(other.release)
            t.join(5)
            assert settle(lambda: pool.live == 0)
        return False

    lifecycle.on_relieve = nothing_to_give
    t0 = time.monotonic()
    lease = pool.lease(OTHER)
    assert time.monotonic() - t0 < 1.0, "the lease slept through the capacity freed while it asked for relief"
    lease.release()


# -- boot failures ---------------------------------------------------------------------


def test_cold_boot_failure_reaches_the_lease_and_returns_the_capacity(
    make_pool: PoolFactory, fake_runtime: FakeRuntime, lifecycle: RecordingLifecycle
) -> None:
    fake_runtime.fail_boots(1, errors.BoxStartError("image pull failed"))
    pool = make_pool(max_boxes=1)
    with pytest.raises(errors.BoxStartError, match="image pull failed"):
        pool.lease(SPEC)
    assert pool.stats.boot_failures == 1
    assert pool.live == 0
    assert lifecycle.steps("after_boot") == []
    lease = pool.lease(SPEC, timeout=1)  # the capacity came back
    assert pool.stats.booted == 1
    lease.release()


def test_background_boot_failure_goes_to_the_next_lease_once(make_pool: PoolFactory, fake_runtime: FakeRuntime) -> None:
    fake_runtime.fail_boots(1, errors.BoxStartError("no such image"))
    pool = make_pool(max_boxes=1)
    pool.prewarm(SPEC)
    assert settle(lambda: pool.stats.boot_failures == 1)
    assert pool.live == 0
    with pytest.raises(errors.BoxStartError, match="no such image"):
        pool.lease(SPEC)
    lease = pool.lease(SPEC, timeout=1)
    lease.release()


def test_a_lease_waiting_for_a_failing_boot_gets_its_error(make_pool: PoolFactory, fake_runtime: FakeRuntime) -> None:
    fake_runtime.boot_delay = 0.1
    fake_runtime.fail_boots(1, errors.BoxStartError("kernel panic"))
    pool = make_pool(max_boxes=1, lease_timeout=5)
    pool.prewarm(SPEC)
    t0 = time.monotonic()
    with pytest.raises(errors.BoxStartError, match="kernel panic"):
        pool.lease(SPEC)
    assert time.monotonic() - t0 < 4, "the lease did not hear of the failed boot it waited for"  # its bound: 5 s


def test_after_boot_failure_destroys_the_box_and_fails_the_lease(
    make_pool: PoolFactory, fake_runtime: FakeRuntime, lifecycle: RecordingLifecycle
) -> None:
    lifecycle.boot_error = errors.BoxliteError("pytest did not start inside the box")
    pool = make_pool(max_boxes=1)
    with pytest.raises(errors.BoxliteError, match="pytest did not start"):
        pool.lease(SPEC)
    assert fake_runtime.created and fake_runtime.boxes == {}, "the half-started box was left behind"
    assert pool.live == 0
    assert pool.stats.boot_failures == 1


def test_boot_slower_than_the_boot_timeout_fails_and_returns_the_capacity(
    make_pool: PoolFactory, fake_runtime: FakeRuntime
) -> None:
    fake_runtime.boot_delay = 3.0
    pool = make_pool(max_boxes=1, boot_timeout=0.05)
    t0 = time.monotonic()
    with pytest.raises(errors.BoxStartError, match="did not start within"):
        pool.lease(SPEC)
    assert time.monotonic() - t0 < 2.5, "the pool did not bound the boot by its boot timeout"  # the boot: 3 s
    assert pool.live == 0
    assert pool.stats.boot_failures == 1


# -- reuse and health ----------------------------------------------------------------------


def test_reuse_needs_both_leases_to_opt_in(make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=2)
    names = []
    for reuse in (False, True, False):
        lease = pool.lease(SPEC, reuse=reuse)
        names.append(lease.handle.name)
        lease.release()
    # The box of the reuse=True lease was neither given to the plain lease after it nor taken
    # from the plain lease before it.
    assert len(set(names)) == 3, names
    assert pool.stats.reused == 0
    again = pool.lease(SPEC, reuse=True)  # both sides opt in: the parked box serves again
    assert again.handle.name == names[1]
    assert not fake(again).dead
    assert pool.stats.reused == 1
    again.release()


def test_a_box_that_died_during_its_test_is_not_reused(
    make_pool: PoolFactory, fake_runtime: FakeRuntime, lifecycle: RecordingLifecycle
) -> None:
    pool = make_pool(max_boxes=2)
    first = pool.lease(SPEC, reuse=True)
    fake(first).die()  # the box crashes mid-test
    first.release()
    second = pool.lease(SPEC, reuse=True)
    assert second.handle.name != first.handle.name
    assert pool.stats.unhealthy == 1
    assert pool.stats.reused == 0
    assert settle(lambda: first.handle.name not in fake_runtime.boxes)
    assert first.handle.name in lifecycle.steps("before_destroy")
    second.release()


def test_a_warm_box_that_died_in_the_pool_is_never_handed_out(
    make_pool: PoolFactory, fake_runtime: FakeRuntime
) -> None:
    pool = make_pool(max_boxes=2)
    pool.health_after = 0  # check every warm box, however fresh
    pool.prewarm(SPEC)
    assert settle(lambda: pool.warm_count(SPEC) == 2)
    dead = set(fake_runtime.boxes)
    for name in dead:
        fake_runtime.kill(name)
    for _ in range(3):
        lease = pool.lease(SPEC)
        assert lease.handle.name not in dead
        lease.release()
    assert pool.stats.unhealthy == 2


def test_a_box_dying_mid_test_is_destroyed_at_release(
    make_pool: PoolFactory, fake_runtime: FakeRuntime, lifecycle: RecordingLifecycle
) -> None:
    pool = make_pool(max_boxes=1)
    lease = pool.lease(SPEC)
    fake(lease).die()
    with pytest.raises(errors.BoxDeadError):
        lease.sandbox.execute_command("true")
    lease.release()
    assert settle(lambda: fake_runtime.boxes == {} and pool.live == 0)
    assert lifecycle.steps("before_destroy") == [lease.handle.name]


# -- idle reaping ---------------------------------------------------------------------


def test_idle_reaper_stops_warm_boxes_and_stops_refilling(make_pool: PoolFactory, fake_runtime: FakeRuntime) -> None:
    pool = make_pool(max_boxes=2, idle_timeout=0.2)
    pool.prewarm(SPEC)
    assert settle(lambda: pool.warm_count(SPEC) == 2)
    assert settle(lambda: pool.live == 0, timeout=3), f"warm boxes outlived the idle timeout (live={pool.live})"
    assert settle(lambda: fake_runtime.boxes == {})
    assert pool.stats.idle_reaped == 2
    booted = pool.stats.booted
    time.sleep(0.3)
    assert pool.stats.booted == booted, "the pool booted boxes nobody asked for"
    lease = pool.lease(SPEC)  # a lease still works, but does not restart the prewarming
    time.sleep(0.1)
    assert pool.stats.booted == booted + 1, "the pool refilled a spec it had stopped keeping warm"
    lease.release()


def test_idle_timeout_zero_never_reaps(make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=1, idle_timeout=0)
    pool.prewarm(SPEC)
    assert settle(lambda: pool.warm_count(SPEC) == 1)
    time.sleep(1.1)  # longer than one reaper tick
    assert pool.warm_count(SPEC) == 1
    assert pool.stats.idle_reaped == 0


def test_a_leased_box_is_never_reaped(make_pool: PoolFactory) -> None:
    pool = make_pool(max_boxes=1, idle_timeout=0.1)
    lease = pool.lease(SPEC)
    time.sleep(0.3)
    assert not fake(lease).dead
    assert pool.stats.idle_reaped == 0
    lease.release()


# -- the lifecycle ------------------------------------------------------------------------


def test_lifecycle_steps_wrap_every_box(make_pool: PoolFactory, fake_runtime: FakeRuntime) -> None:
    seen_alive: list[bool] = []

    class Checking(RecordingLifecycle):
        """Also notes whether the box still existed when ``before_destroy`` ran."""

        def before_destroy(self, handle: BoxHandle) -> None:
            seen_alive.append(handle.name in fake_runtime.boxes)
            super().before_destroy(handle)

    lifecycle = Checking()
    provisioned = BoxSpec(env=(("PROVISIONED", "1"),))
    lifecycle.prepared[SPEC] = provisioned
    pool = make_pool(max_boxes=1, lifecycle=lifecycle)
    lease = pool.lease(SPEC)
    assert fake(lease).spec == provisioned, "the box was not booted from the prepared spec"
    assert lease.spec == SPEC, "the lease must keep the spec that was asked for"
    assert lifecycle.steps("prepare") == [SPEC.describe()]
    assert lifecycle.steps("after_boot") == [lease.handle.name]
    lease.release()
    assert settle(lambda: pool.live == 0)
    assert lifecycle.steps("before_destroy") == [lease.handle.name]
    assert seen_alive == [True], "before_destroy ran after the box was gone"


def test_a_kept_box_leaves_the_pool_alive(
    make_pool: PoolFactory, fake_runtime: FakeRuntime, lifecycle: RecordingLifecycle
) -> None:
    pool = make_pool(max_boxes=1)
    lease = pool.lease(SPEC)
    lease.release(keep=True)
    assert fake(lease).kept
    assert pool.stats.kept == [lease.handle.name]
    assert pool.live == 0, "a kept box still counts against the cap"
    assert lifecycle.steps("before_destroy") == []
    other = pool.lease(SPEC, timeout=1)
    other.release()
    pool.shutdown()
    assert list(fake_runtime.boxes) == [lease.handle.name]


def test_pool_without_a_lifecycle_boots_the_spec_as_asked(fake_runtime: FakeRuntime) -> None:
    pool = BoxPool(fake_runtime, namer=lambda: "pbx-unit-plain-1", max_boxes=1)
    try:
        assert isinstance(DefaultLifecycle().prepare(SPEC), BoxSpec)
        lease = pool.lease(SPEC)
        assert fake(lease).spec == SPEC
        lease.release()
    finally:
        pool.shutdown()
    assert fake_runtime.boxes == {}


# -- shutdown ---------------------------------------------------------------------------------


def test_shutdown_destroys_leased_and_warm_boxes_once(make_pool: PoolFactory, fake_runtime: FakeRuntime) -> None:
    pool = make_pool(max_boxes=3)
    pool.prewarm(SPEC, count=2)
    held = pool.lease(OTHER)
    assert settle(lambda: pool.warm_count(SPEC) == 2)
    pool.shutdown()
    pool.shutdown()  # idempotent
    assert fake_runtime.boxes == {}
    assert pool.live == 0
    assert pool.stats.destroyed == 3
    with pytest.raises(errors.BoxliteError, match="shut down"):
        pool.lease(SPEC, timeout=1)
    held.release()  # its box is already gone: not counted twice
    assert pool.live == 0
    assert pool.stats.destroyed == 3


def test_shutdown_wakes_a_lease_waiting_at_the_cap(make_pool: PoolFactory, lifecycle: RecordingLifecycle) -> None:
    pool = make_pool(max_boxes=1, lease_timeout=10)
    pool.lease(SPEC)
    t, out = in_thread(lambda: pool.lease(OTHER))
    assert settle(lambda: bool(lifecycle.steps("relieve"))), "the second lease never blocked"
    t0 = time.monotonic()
    pool.shutdown()
    t.join(5)
    assert not t.is_alive()
    assert time.monotonic() - t0 < 2
    assert isinstance(out.get("error"), errors.BoxliteError) and "shut down" in str(out["error"])


def test_a_cold_lease_that_finishes_booting_after_shutdown_fails_and_leaves_nothing(
    make_pool: PoolFactory, fake_runtime: FakeRuntime
) -> None:
    fake_runtime.boot_delay = 0.3
    pool = make_pool(max_boxes=1)
    t, out = in_thread(lambda: pool.lease(SPEC))
    assert settle(lambda: fake_runtime.boot_attempts == 1)
    pool.shutdown()
    t.join(5)
    assert isinstance(out.get("error"), errors.BoxliteError), f"a lease succeeded after shutdown: {out}"
    assert "shut down" in str(out["error"])
    assert fake_runtime.boxes == {}, "the box booted during shutdown was left behind"
    assert pool.live == 0


def test_a_background_boot_that_lands_after_shutdown_is_destroyed(
    make_pool: PoolFactory, fake_runtime: FakeRuntime
) -> None:
    fake_runtime.boot_delay = 0.2
    pool = make_pool(max_boxes=2)
    pool.prewarm(SPEC)
    assert settle(lambda: fake_runtime.boot_attempts == 2)
    pool.shutdown()  # waits for the boots in flight, then destroys what they made
    assert fake_runtime.boxes == {}
    assert len(fake_runtime.created) == 2
    assert pool.live == 0


def test_a_hung_destroy_is_recorded_and_does_not_hang_shutdown(
    make_pool: PoolFactory, fake_runtime: FakeRuntime
) -> None:
    pool = make_pool(max_boxes=1)
    lease = pool.lease(SPEC)
    fake_runtime.hang_destroys(0.2)
    t0 = time.monotonic()
    pool.shutdown()
    assert time.monotonic() - t0 < 2
    assert len(pool.destroy_errors) == 1
    assert lease.handle.name in pool.destroy_errors[0] and "did not finish" in pool.destroy_errors[0]
    # The box is still there: the session's final scan must find it (see test_session_unit).
    assert list(fake_runtime.boxes) == [lease.handle.name]
    assert pool.live == 0
