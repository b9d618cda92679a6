"""Fixtures of the unit layer: pools and sessions on the in-memory :class:`fakes.FakeRuntime`."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator

import pytest
from fakes import FakeRuntime, RecordingLifecycle

from pytest_boxlite.pool import BoxPool, make_namer

_pool_ids = itertools.count(1)


@pytest.fixture
def fake_runtime() -> FakeRuntime:
    """A fresh in-memory runtime (boots take no time unless a test says otherwise)."""
    return FakeRuntime()


@pytest.fixture
def lifecycle() -> RecordingLifecycle:
    """A lifecycle that records every call the pool makes."""
    return RecordingLifecycle()


@pytest.fixture
def make_pool(fake_runtime: FakeRuntime, lifecycle: RecordingLifecycle) -> Iterator[Callable[..., BoxPool]]:
    """``make_pool(max_boxes=..., ...)``: pools on the fake runtime, shut down at teardown.

    Teardown also checks that no pool thread outlives its pool.
    """
    pools: list[BoxPool] = []

    def make(**kwargs: object) -> BoxPool:
        kwargs.setdefault("namer", make_namer(f"unit{next(_pool_ids)}"))
        kwargs.setdefault("lifecycle", lifecycle)
        kwargs.setdefault("boot_timeout", 5.0)
        kwargs.setdefault("lease_timeout", 5.0)
        kwargs.setdefault("idle_timeout", 0)
        pool = BoxPool(fake_runtime, **kwargs)  # type: ignore[arg-type] # keyword arguments of several types
        pools.append(pool)
        return pool

    before = set(threading.enumerate())
    yield make
    fake_runtime.unhang()  # a test that hung destroys must not make its teardown wait
    for pool in pools:
        pool.shutdown(timeout=5.0)
    left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("boxlite-") and t.is_alive()]
    assert left == [], f"pool threads outlived shutdown: {left}"
