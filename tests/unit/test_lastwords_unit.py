"""guest/lastwords.py's watcher, alone: one thread per process watches each test's deadline.

The module is loaded here as a copy of its own (its watcher is one per process: a copy starts
without one, whatever other tests of this process did).  The same behaviour is proven in real
boxes by tests/test_timeout_output.py (a boxed test's output at its timeout); this layer checks
the orders of tests and deadlines a real run cannot force.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from typing import Any

from pytest_boxlite import guest


class _Item:
    """An item whose config has no capture or logging plugin: the last words are empty."""

    class config:  # what LastWords reads: item.config.pluginmanager
        class pluginmanager:
            @staticmethod
            def getplugin(name: str) -> None:
                return None


def _load() -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("_lastwords_under_test", guest.path("lastwords"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _said(sent: list[str], tag: str, bound: float) -> float:
    start = time.monotonic()
    while tag not in sent and time.monotonic() - start < bound:
        time.sleep(0.005)
    return time.monotonic() - start


def test_each_run_speaks_at_its_own_deadline_and_never_after_it_stopped() -> None:
    last_words = _load()["LastWords"]
    sent: list[str] = []
    known, threads = threading.enumerate(), _os_threads()

    def run(tag: str, timeout: float | None) -> Any:
        return last_words(_Item, lambda name, **fields: sent.append(tag), timeout)

    stopped = run("stopped", 0.2)
    time.sleep(0.05)
    stopped.stop()
    run("due", 0.2)
    # The upper bounds only tell "said" from "never said" (the wait's 5 s): a loaded machine may be late.
    assert 0.15 < _said(sent, "due", 5) < 4.0
    paused = run("paused", 0.2)
    paused.pause()
    time.sleep(0.4)
    assert "paused" not in sent  # the clock stopped while the test waited for its user
    paused.resume()
    assert _said(sent, "paused", 5) < 4.0
    # A test with a long timeout, then one with a short one: the watcher, asleep until the long
    # deadline, is woken for the sooner one.
    for i in range(3):
        long = run("long", 100)
        time.sleep(0.02)
        long.stop()
        run(f"short{i}", 0.2)
        assert 0.15 < _said(sent, f"short{i}", 5) < 4.0  # not at the long deadline (100 s)
    untimed = run("untimed", None)
    untimed.pause()
    untimed.resume()
    untimed.stop()
    time.sleep(0.3)
    assert sent == ["due", "paused", "short0", "short1", "short2"]
    # One thread for every run of this process, and none a test can see through threading (a
    # boxed test's threading.enumerate() is what it is locally).
    assert _os_threads() == threads + 1
    assert threading.enumerate() == known
