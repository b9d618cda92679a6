"""The warm pool: boxes booted ahead of time, leased to one test each.

* A per-process cap (``max_boxes``) bounds live boxes: booting + warm +
  leased + being destroyed, across every spec.
* One warm queue per :class:`~pytest_boxlite.spec.BoxSpec`; a lease for a
  spec with no warm box boots one (cold), evicting an idle warm box of
  another spec when the cap is reached, or waits (bounded) for capacity.
* After a lease the box is destroyed in the background and the pool refilled;
  a box goes to a second lease only when both leases opt in (``reuse=True``)
  and it passes a health check.
* An idle reaper stops warm boxes nobody asked for within ``idle_timeout``.
* The pool's owner takes part in each box's life through one :class:`BoxLifecycle`
  given at construction (provision the spec, start something in a new box, stop it
  before the box goes, give back a box it holds when a lease is blocked at the cap).

No pytest import: this layer is driven by fixtures and the plugin.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from pytest_boxlite.errors import BoxliteError, LeaseTimeoutError
from pytest_boxlite.runtimes.base import BoxHandle, Runtime
from pytest_boxlite.sandbox import DEFAULT_TIMEOUT, Sandbox
from pytest_boxlite.spec import BoxSpec


@dataclasses.dataclass
class PoolStats:
    """Counters for the terminal summary."""

    booted: int = 0
    boot_failures: int = 0
    leased: int = 0
    warm_hits: int = 0
    reused: int = 0
    evicted: int = 0
    idle_reaped: int = 0
    unhealthy: int = 0
    destroyed: int = 0
    kept: list[str] = dataclasses.field(default_factory=list)
    lease_waits: list[float] = dataclasses.field(default_factory=list)
    boot_times: list[float] = dataclasses.field(default_factory=list)
    max_live: int = 0

    @property
    def hit_rate(self) -> float:
        return self.warm_hits / self.leased if self.leased else 0.0

    def wait_p50(self) -> float:
        return statistics.median(self.lease_waits) if self.lease_waits else 0.0

    def wait_max(self) -> float:
        return max(self.lease_waits, default=0.0)

    def asdict(self) -> dict[str, Any]:
        """A plain-data copy (lists copied too), e.g. to send from an xdist worker to the controller."""
        return dataclasses.asdict(self)


class BoxLifecycle(Protocol):
    """What the pool's owner does at each step of a box's life; one object, given at construction.

    The pool calls these from its own threads, never while it holds its lock.  Subclass
    :class:`DefaultLifecycle` to override only the steps you need.
    """

    def prepare(self, spec: BoxSpec) -> BoxSpec:
        """The spec to boot for a requested ``spec`` (e.g. one starting from a provisioned template).

        Called before every boot; may take long the first time.  Raising fails that boot.
        """
        ...

    def after_boot(self, handle: BoxHandle, spec: BoxSpec) -> None:
        """Called once a box of (prepared) ``spec`` accepts commands, before it is warm or leased.

        Raising fails the boot: the box is destroyed and the error goes to the lease.
        """
        ...

    def before_destroy(self, handle: BoxHandle) -> None:
        """Called before every destroy of a booted box (never for a kept one)."""
        ...

    def relieve(self, spec: BoxSpec) -> bool:
        """A lease of ``spec`` is blocked at the cap with nothing idle to evict: release a box held
        for the owner itself (a warm interpreter held for forking) if there is one.  Returns whether one was released
        (the pool looks again either way, and asks again only after its next wake-up)."""
        ...


class DefaultLifecycle:
    """The lifecycle that does nothing: boxes are booted as asked and destroyed as they are."""

    def prepare(self, spec: BoxSpec) -> BoxSpec:
        return spec

    def after_boot(self, handle: BoxHandle, spec: BoxSpec) -> None:
        return None

    def before_destroy(self, handle: BoxHandle) -> None:
        return None

    def relieve(self, spec: BoxSpec) -> bool:
        return False


@dataclasses.dataclass
class _Warm:
    handle: BoxHandle
    since: float
    reusable: bool = False


class Lease:
    """A leased box.  Use as a context manager, or call :meth:`release` yourself."""

    def __init__(
        self, pool: BoxPool, spec: BoxSpec, handle: BoxHandle, sandbox: Sandbox, waited: float, reuse: bool
    ) -> None:
        self.pool = pool
        self.spec = spec
        self.handle = handle
        self.sandbox = sandbox
        self.waited = waited
        self.reuse = reuse
        self._released = False

    def release(self, *, keep: bool = False) -> None:
        """Give the box back: destroyed in the background (or kept, or pooled for reuse)."""
        if self._released:
            return
        self._released = True
        try:
            # Processes it spawned are killed (and said so, in a warning) and its ports unpublished.
            self.sandbox.end("its box went back to the pool")
        finally:
            self.pool._give_back(self, keep=keep)

    def __enter__(self) -> Sandbox:
        return self.sandbox

    def __exit__(self, *exc: object) -> None:
        self.release()


class BoxPool:
    """Warm pool of boxes for one process.  Thread-safe; :meth:`shutdown` is idempotent."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        namer: Callable[[], str],
        max_boxes: int = 2,
        boot_timeout: float = 120.0,
        lease_timeout: float = 300.0,
        idle_timeout: float = 600.0,
        command_timeout: float = DEFAULT_TIMEOUT,
        health_timeout: float = 5.0,
        lifecycle: BoxLifecycle | None = None,
    ) -> None:
        if max_boxes < 1:
            raise ValueError("max_boxes must be at least 1")
        self.runtime = runtime
        self.max_boxes = max_boxes
        self.boot_timeout = boot_timeout
        self.lease_timeout = lease_timeout
        self.idle_timeout = idle_timeout
        self.command_timeout = command_timeout
        self.health_timeout = health_timeout
        self.stats = PoolStats()
        self._namer = namer
        #: The owner's steps around each boot and destroy (see :class:`BoxLifecycle`).
        self._lifecycle: BoxLifecycle = DefaultLifecycle() if lifecycle is None else lifecycle
        self._cond = threading.Condition()
        self._warm: dict[BoxSpec, collections.deque[_Warm]] = collections.defaultdict(collections.deque)
        self._booting: collections.Counter[BoxSpec] = collections.Counter()
        #: Background boots that will land in the warm queue, and leases waiting for them.
        self._filling: collections.Counter[BoxSpec] = collections.Counter()
        self._waiting: collections.Counter[BoxSpec] = collections.Counter()
        self._targets: dict[BoxSpec, int] = {}
        self._leased: dict[str, BoxHandle] = {}
        self._live = 0
        self._closed = False
        self._boot_errors: dict[BoxSpec, BaseException] = {}
        self._since: dict[str, float] = {}
        #: Warm boxes older than this (seconds) are health-checked before a lease.
        self.health_after = 2.0
        self.destroy_errors: list[str] = []
        # Boots and destroys run here; sized so a full refill can proceed at once.
        self._workers = concurrent.futures.ThreadPoolExecutor(max(2, max_boxes + 1), thread_name_prefix="boxlite-pool")
        self._reaper = threading.Thread(target=self._reap_idle, name="boxlite-idle-reaper", daemon=True)
        self._reaper.start()

    # -- public -----------------------------------------------------------
    @property
    def live(self) -> int:
        """Boxes alive now: booting, warm, leased or being destroyed."""
        with self._cond:
            return self._live

    def warm_count(self, spec: BoxSpec | None = None) -> int:
        with self._cond:
            if spec is not None:
                return len(self._warm[spec])
            return sum(len(q) for q in self._warm.values())

    def prewarm(self, spec: BoxSpec, count: int | None = None) -> None:
        """Keep ``count`` (default: ``max_boxes``) warm boxes of ``spec`` ready, booting in the background."""
        with self._cond:
            self._targets[spec] = min(self.max_boxes, self.max_boxes if count is None else count)
            self._fill_locked()

    def lease(self, spec: BoxSpec, *, timeout: float | None = None, reuse: bool = False) -> Lease:
        """Lease a pristine box of ``spec`` (or a healthy reused one when ``reuse``)."""
        start = time.monotonic()
        limit = self.lease_timeout if timeout is None else timeout
        deadline = start + limit
        while True:
            handle, kind, victim = self._acquire(spec, deadline, limit, reuse)
            if handle is None:
                # A cold lease: capacity is reserved for us (or handed over by an evicted box).
                if victim is not None:
                    self._destroy(victim, refill=False, release=False)
                try:
                    handle = self._boot(spec)
                finally:
                    with self._cond:
                        self._booting[spec] -= 1
            elif (
                kind == "reused" or time.monotonic() - self._since.pop(handle.name, 0.0) > self.health_after
            ) and not handle.alive(self.health_timeout):
                # A box that served a test, or sat in the pool a while, is checked before it is handed out.
                with self._cond:
                    self.stats.unhealthy += 1
                self._destroy_async(handle)
                continue
            waited = time.monotonic() - start
            with self._cond:
                closed = self._closed
                if not closed:
                    self._leased[handle.name] = handle
                    self.stats.leased += 1
                    self.stats.lease_waits.append(waited)
                    if kind == "warm":
                        self.stats.warm_hits += 1
                    elif kind == "reused":
                        self.stats.reused += 1
                    # Refill what this lease took, for prewarmed specs (others boot on demand).
                    self._fill_locked()
            if closed:
                # shutdown() ran while this box booted or was health-checked: it saw the box in
                # no queue, so it is destroyed here rather than handed out after the pool closed.
                self._destroy(handle, refill=False)
                raise BoxliteError("the box pool has been shut down")
            sandbox = Sandbox(handle, default_timeout=self.command_timeout)
            return Lease(self, spec, handle, sandbox, waited, reuse)

    @contextlib.contextmanager
    def sandbox(self, spec: BoxSpec, *, timeout: float | None = None, reuse: bool = False) -> Iterator[Sandbox]:
        """``with pool.sandbox(spec) as sb:`` leases a box and gives it back afterwards."""
        lease = self.lease(spec, timeout=timeout, reuse=reuse)
        try:
            yield lease.sandbox
        finally:
            lease.release()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Destroy every box this pool made and join its threads.  Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._targets.clear()
            doomed = [w.handle for q in self._warm.values() for w in q]
            self._warm.clear()
            doomed += list(self._leased.values())
            self._leased.clear()
            self._cond.notify_all()
        for h in doomed:
            self._destroy_async(h)
        self._workers.shutdown(wait=True)
        self._reaper.join(timeout)

    # -- internals --------------------------------------------------------
    def _acquire(
        self, spec: BoxSpec, deadline: float, limit: float, reuse: bool
    ) -> tuple[BoxHandle | None, str, BoxHandle | None]:
        """Take a warm box, or reserve capacity for a cold boot (``None``, maybe with a box to evict)."""
        waited = False  # a box that arrives while we wait is not a warm hit
        asked = False  # the owner was asked for relief since the last wake-up
        with self._cond:
            while True:
                if self._closed:
                    raise BoxliteError("the box pool has been shut down")
                q = self._warm[spec]
                for wanted in (True, False) if reuse else (False,):
                    for i, w in enumerate(q):
                        if w.reusable == wanted:
                            del q[i]
                            self._since[w.handle.name] = w.since
                            kind = "reused" if wanted else ("booted-for-us" if waited else "warm")
                            return w.handle, kind, None
                err = self._boot_errors.pop(spec, None)
                if err is not None:
                    raise err
                left = deadline - time.monotonic()
                if self._filling[spec] > self._waiting[spec] and left > 0:
                    # A box of this spec is already booting for the pool: wait for it rather than
                    # boot a second one (each boot costs CPU that the running tests need).
                    self._waiting[spec] += 1
                    try:
                        self._cond.wait(left)
                    finally:
                        self._waiting[spec] -= 1
                    waited = True
                    continue
                if self._live < self.max_boxes:
                    self._reserve_locked(spec)
                    return None, "cold", None
                if self._booting[spec] == 0:
                    # At the cap with nothing coming for this spec: take the place of an idle box this
                    # lease cannot use (another spec's, or one parked for reuse when reuse is not asked).
                    for other, oq in self._warm.items():
                        for i, w in enumerate(oq):
                            if other != spec or (w.reusable and not reuse):
                                del oq[i]
                                self.stats.evicted += 1
                                self._booting[spec] += 1
                                return None, "cold", w.handle
                if self._booting[spec] == 0 and not asked:
                    # Nothing idle to evict: ask the holder of long-lived leases to let one go.
                    self._cond.release()
                    try:
                        self._lifecycle.relieve(spec)
                    finally:
                        self._cond.acquire()
                    # Whether or not it freed a box, look again before waiting: the lock was
                    # dropped, so a box freed meanwhile sent its notification to nobody.
                    asked = True
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LeaseTimeoutError(
                        f"no box of {spec.describe()} became available within {limit:.0f}s: "
                        f"all {self.max_boxes} boxes are in use ({len(self._leased)} leased, "
                        f"{sum(self._booting.values())} booting). Raise --boxlite-max-boxes or "
                        "--boxlite-lease-timeout, or release boxes sooner."
                    )
                self._cond.wait(left)
                waited = True
                asked = False

    def _reserve_locked(self, spec: BoxSpec) -> None:
        self._live += 1
        self._booting[spec] += 1
        self.stats.max_live = max(self.stats.max_live, self._live)

    def _fill_locked(self) -> None:
        if self._closed:
            return
        for spec, target in self._targets.items():
            while len(self._warm[spec]) + self._booting[spec] < target and self._live < self.max_boxes:
                self._reserve_locked(spec)
                self._filling[spec] += 1
                self._workers.submit(self._fill_one, spec)

    def _fill_one(self, spec: BoxSpec) -> None:
        try:
            handle = self._boot(spec)
        except BaseException as exc:  # noqa: BLE001 - handed to the next lease of this spec, which raises it
            with self._cond:
                self._booting[spec] -= 1
                self._filling[spec] -= 1
                self._boot_errors[spec] = exc
                self._cond.notify_all()
            return
        with self._cond:
            self._booting[spec] -= 1
            self._filling[spec] -= 1
            if self._closed:
                closed = True
            else:
                closed = False
                self._warm[spec].append(_Warm(handle, time.monotonic()))
                self._cond.notify_all()
        if closed:
            self._destroy(handle, True)

    def _boot(self, spec: BoxSpec) -> BoxHandle:
        """Create one box; on failure the reserved capacity is returned."""
        t0 = time.monotonic()
        handle: BoxHandle | None = None
        try:
            booted = self._lifecycle.prepare(spec)
            handle = self.runtime.create_box(booted, self._namer(), timeout=self.boot_timeout)
            self._lifecycle.after_boot(handle, booted)
        except BaseException:
            if handle is not None:
                with contextlib.suppress(Exception):
                    handle.destroy()
            with self._cond:
                self._live -= 1
                self.stats.boot_failures += 1
                self._cond.notify_all()
            raise
        with self._cond:
            self.stats.booted += 1
            self.stats.boot_times.append(time.monotonic() - t0)
        return handle

    def _give_back(self, lease: Lease, *, keep: bool) -> None:
        handle = lease.handle
        with self._cond:
            if self._leased.pop(handle.name, None) is None:
                return  # shutdown() already destroyed it
            if keep:
                self.stats.kept.append(handle.name)
                self._live -= 1  # a kept box leaves the pool's accounting on purpose
                self._cond.notify_all()
                self._fill_locked()
            elif lease.reuse and not self._closed:
                self._warm[lease.spec].append(_Warm(handle, time.monotonic(), reusable=True))
                self._cond.notify_all()
                return
        if keep:
            handle.keep()
            return
        self._destroy_async(handle)

    def _destroy_async(self, handle: BoxHandle) -> None:
        try:
            self._workers.submit(self._destroy, handle, True)
        except RuntimeError:  # executor already shut down: do it here
            self._destroy(handle, True)

    def _destroy(self, handle: BoxHandle, refill: bool, release: bool = True) -> None:
        """Destroy a box; ``release=False`` hands its capacity to the caller instead of the pool."""
        try:
            self._lifecycle.before_destroy(handle)
            handle.destroy()
        except Exception as exc:  # noqa: BLE001 - recorded; the session's final scan counts what is left
            self.destroy_errors.append(f"{handle.name}: {exc}")
        with self._cond:
            if release:
                self._live -= 1
            self.stats.destroyed += 1
            self._cond.notify_all()
            if refill:
                self._fill_locked()

    def _reap_idle(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                self._cond.wait(1.0 if self.idle_timeout == 0 else min(1.0, self.idle_timeout / 4))
                if self._closed or self.idle_timeout <= 0:
                    continue
                now = time.monotonic()
                idle: list[BoxHandle] = []
                for spec, q in self._warm.items():
                    keep = [w for w in q if now - w.since < self.idle_timeout]
                    idle += [w.handle for w in q if now - w.since >= self.idle_timeout]
                    if len(keep) != len(q):
                        q.clear()
                        q.extend(keep)
                        # Nobody asked for this spec lately: stop refilling until someone does.
                        self._targets[spec] = 0
                self.stats.idle_reaped += len(idle)
            for h in idle:
                with contextlib.suppress(RuntimeError):
                    self._workers.submit(self._destroy, h, False)


def make_namer(owner: str) -> Callable[[], str]:
    """Box names ``pbx-<owner>-<n>``: the owner id lets any process trace a box to its session."""
    seq = itertools.count(1)
    lock = threading.Lock()

    def namer() -> str:
        with lock:
            return f"pbx-{owner}-{next(seq)}"

    return namer
