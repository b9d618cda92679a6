"""Unit tests of :class:`pytest_boxlite.session.BoxliteSession` on the in-memory fake runtime.

Whole sessions with real boxes are tested by ``tests/test_session.py``; here the session's
runtime is opened by a fake opener, so start errors, leaks and provisioning failures can be
produced exactly.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeBox, FakeRuntime, RecordingLifecycle
from subruns import wait_until

from pytest_boxlite import errors
from pytest_boxlite.pool import BoxLifecycle
from pytest_boxlite.runtimes import Choice, Runtime
from pytest_boxlite.runtimes.base import RawResult
from pytest_boxlite.session import BoxliteSession
from pytest_boxlite.settings import Settings
from pytest_boxlite.spec import BoxSpec

pytestmark = pytest.mark.timeout(30)
#: The pool works in background threads: poll briefly and often until a state is reached.
settle = functools.partial(wait_until, timeout=5.0, interval=0.002)

SessionFactory = Callable[..., BoxliteSession]


def make_settings(home: Path, **overrides: Any) -> Settings:
    """Settings as ``resolve`` would make them, every value from its default unless overridden."""
    values: dict[str, Any] = {
        "image": "python:3.11-slim",
        "max_boxes": 2,
        "runtime": "namespace",
        "cpus": None,
        "memory": None,
        "idle_timeout": 0.0,
        "timeout": 5.0,
        "network": False,
        "home": str(home),
        "keep": False,
        "all": False,
        "scope": "test",
        "setup": None,
        "boot_timeout": 5.0,
        "lease_timeout": 5.0,
    }
    values.update(overrides)
    return Settings(**values, sources={k: "default" for k in values})


class Opener:
    """A fake runtime opener: hands out ``runtime`` (or raises ``error``) and records its calls."""

    def __init__(self, runtime: FakeRuntime, error: BaseException | None = None, delay: float = 0.0) -> None:
        self.runtime = runtime
        self.error = error
        self.delay = delay
        self.calls: list[tuple[str, Path, str]] = []

    def __call__(self, kind: str, home: Path, owner: str) -> Runtime:
        self.calls.append((kind, home, owner))
        time.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return self.runtime


@pytest.fixture
def opener(fake_runtime: FakeRuntime) -> Opener:
    return Opener(fake_runtime)


@pytest.fixture
def make_session(tmp_path: Path, opener: Opener) -> Iterator[SessionFactory]:
    """``make_session(lifecycle=..., **settings)``: sessions on the fake runtime, shut down at teardown."""
    sessions: list[BoxliteSession] = []

    def make(lifecycle: BoxLifecycle | None = None, **overrides: Any) -> BoxliteSession:
        s = BoxliteSession(
            make_settings(tmp_path / "home", **overrides),
            session_id="0badcafe",
            worker_id=None,
            lifecycle=lifecycle,
            opener=opener,
        )
        sessions.append(s)
        return s

    yield make
    for s in sessions:
        s.shutdown()


# -- starting ------------------------------------------------------------------------


def test_want_opens_the_runtime_once_in_the_background_and_prewarms(
    make_session: SessionFactory, opener: Opener, fake_runtime: FakeRuntime
) -> None:
    session = make_session(max_boxes=2)
    session.prepare_home()
    assert not session.started
    session.want(session.default_spec)
    session.want(session.default_spec)  # once per spec
    pool = session.pool()
    assert settle(lambda: pool.warm_count(session.default_spec) == 2)
    assert opener.calls == [("namespace", session.home, "0badcafe")]
    assert all(name.startswith("pbx-0badcafe-") for name in fake_runtime.boxes)


def test_a_runtime_that_cannot_open_fails_every_lease_not_collection(
    make_session: SessionFactory, opener: Opener
) -> None:
    opener.error = errors.RuntimeUnavailableError("bwrap cannot create a user namespace here")
    session = make_session()
    session.want(session.default_spec)  # starts in the background: no error yet
    for _ in range(2):  # every test that asks for a box gets the reason
        with pytest.raises(errors.RuntimeUnavailableError, match="user namespace"):
            session.pool()
    assert len(opener.calls) == 1
    assert not session.started
    session.shutdown()
    assert session.report.leaked == []


def test_a_deferred_error_is_raised_to_every_lease_and_nothing_starts(
    make_session: SessionFactory, opener: Opener
) -> None:
    session = make_session()
    session.defer_error(errors.ConfigError("--boxlite-home /nope is not usable"))
    session.want(session.default_spec)
    for _ in range(2):
        with pytest.raises(errors.ConfigError, match="not usable"):
            session.pool(timeout=1)
    assert opener.calls == [], "the runtime was opened although the session could not start"
    assert not any(t.name == "boxlite-start" for t in threading.enumerate())


def test_shutdown_during_a_slow_start_leaves_nothing_running(
    make_session: SessionFactory, opener: Opener, fake_runtime: FakeRuntime
) -> None:
    opener.delay = 0.2
    session = make_session()
    session.prepare_home()
    session.want(session.default_spec)
    session.shutdown()  # while the runtime is still opening
    assert fake_runtime.boxes == {}
    assert fake_runtime.closed
    assert session.report.leaked == []
    session.want(BoxSpec(env=(("LATE", "1"),)))  # after shutdown: starts nothing
    assert len(opener.calls) == 1


# -- shutdown and leaks ------------------------------------------------------------------------


def test_shutdown_counts_and_reaps_the_boxes_the_pool_failed_to_destroy(
    make_session: SessionFactory, fake_runtime: FakeRuntime
) -> None:
    session = make_session(max_boxes=1)
    session.prepare_home()
    lease = session.pool().lease(session.default_spec)
    stranger = fake_runtime.create_box(BoxSpec(), "pbx-feedbeef-1", timeout=1)  # another session's box
    fake_runtime.hang_destroys(0.1)  # the pool's destroy of the leased box hangs, then gives up
    lease.release()
    assert settle(lambda: bool(session.pool().destroy_errors))
    fake_runtime.unhang()
    session.shutdown()
    assert session.report.leaked == [lease.handle.name]
    assert list(fake_runtime.boxes) == [stranger.name], "the leak was not reaped, or another owner's box was"
    assert fake_runtime.closed
    session.shutdown()  # idempotent
    assert session.report.leaked == [lease.handle.name]


def test_a_clean_session_reports_stats_and_no_leak(make_session: SessionFactory, fake_runtime: FakeRuntime) -> None:
    session = make_session(max_boxes=1)
    session.prepare_home()
    pool = session.pool()
    for _ in range(3):
        pool.lease(session.default_spec).release()
    session.shutdown()
    assert session.report.leaked == []
    stats = session.report.stats
    assert stats["booted"] == 3
    assert stats["leased"] == 3
    assert len(stats["lease_waits"]) == 3
    assert stats["max_live"] == 1
    assert fake_runtime.boxes == {}


def test_a_kept_box_is_reported_as_kept_not_leaked(make_session: SessionFactory, fake_runtime: FakeRuntime) -> None:
    session = make_session(max_boxes=1)
    session.prepare_home()
    lease = session.pool().lease(session.default_spec)
    lease.release(keep=True)
    session.shutdown()
    assert session.report.kept == [lease.handle.name]
    assert session.report.leaked == []
    assert list(fake_runtime.boxes) == [lease.handle.name]


# -- the lifecycle and provisioning ------------------------------------------------------


def test_the_owners_lifecycle_reaches_the_pool(
    make_session: SessionFactory, lifecycle: RecordingLifecycle, fake_runtime: FakeRuntime
) -> None:
    session = make_session(lifecycle=lifecycle, max_boxes=1)
    session.prepare_home()
    pool = session.pool()
    held = pool.lease(session.default_spec)
    assert lifecycle.steps("after_boot") == [held.handle.name]

    def give_way(spec: BoxSpec) -> bool:
        held.release()
        return True

    lifecycle.on_relieve = give_way
    other = pool.lease(session.default_worker_spec)  # blocked at the cap: the owner is asked
    assert lifecycle.steps("relieve") == [session.default_worker_spec.describe()]
    other.release()
    session.shutdown()
    assert set(lifecycle.steps("before_destroy")) == {held.handle.name, other.handle.name}


def test_setup_runs_in_each_vm_before_it_is_leased(
    make_session: SessionFactory, lifecycle: RecordingLifecycle, fake_runtime: FakeRuntime
) -> None:
    session = make_session(lifecycle=lifecycle, max_boxes=1, setup="pip install -e .")
    session.choice = Choice("vm", "unit test")  # the vm runtime provisions each box at boot
    session.prepare_home()
    lease = session.pool().lease(session.default_spec)
    assert isinstance(lease.handle, FakeBox)
    assert lease.handle.commands[0] == ["/bin/sh", "-c", "pip install -e ."]
    assert lifecycle.steps("after_boot") == [lease.handle.name], "the owner's step ran before provisioning"
    lease.release()


def test_a_failing_setup_fails_the_lease_with_its_output(
    make_session: SessionFactory, lifecycle: RecordingLifecycle, fake_runtime: FakeRuntime
) -> None:
    fake_runtime.exec_handler = lambda box, argv: RawResult(1, b"", b"ERROR: no such package", False, 0.1)
    session = make_session(lifecycle=lifecycle, max_boxes=1, setup="pip install nope")
    session.choice = Choice("vm", "unit test")
    session.prepare_home()
    with pytest.raises(errors.BoxStartError, match=r"(?s)--boxlite-setup 'pip install nope' failed.*no such package"):
        session.pool().lease(session.default_spec)
    assert lifecycle.steps("after_boot") == [], "the owner's step ran in a box whose setup failed"
    assert fake_runtime.boxes == {}


# -- how boxed tests get their fresh box ---------------------------------------------


def test_both_runtimes_can_fork() -> None:
    # Known before anything opens (the session plans with it); vm forks inside its booted VM.
    assert Choice("vm", "test").capabilities.fork
    assert Choice("namespace", "test").capabilities.fork


def test_boxed_tests_fork_unless_told_to_boot(make_session: SessionFactory) -> None:
    """A box is forked per test by default; ``--boxlite-fresh=boot`` (on vm: a VM per test),
    ``--boxlite-keep`` and worker scope boot boxes instead.  (namespace here: vm cannot be
    chosen on a host where no VM boots; both share this decision.)"""
    runtime = "namespace"
    assert make_session(runtime=runtime).fork_boxes
    assert make_session(runtime=runtime, scope="module").fork_boxes
    assert not make_session(runtime=runtime, fresh="boot").fork_boxes
    assert not make_session(runtime=runtime, scope="module", fresh="boot").fork_boxes
    assert not make_session(runtime=runtime, keep=True).fork_boxes
    assert not make_session(runtime=runtime, scope="worker").fork_boxes


def test_a_kernel_that_refuses_the_fork_makes_the_session_boot(make_session: SessionFactory) -> None:
    session = make_session()
    before = (session.fork_boxes, session.fork_refused)
    session.refuse_fork("unshare: no user namespaces")
    after = (session.fork_boxes, session.fork_refused)
    assert before == (True, None)
    assert after == (False, "unshare: no user namespaces")
