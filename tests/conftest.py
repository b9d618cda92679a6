"""Shared fixtures: real runtimes and real boxes, created fast and never leaked.

Every box made here is named ``pbx-test<session hex>-<n>`` so that the
session-end safety net can find (and remove) anything a failing test left.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from subruns import REAL_DATA_HOME, SubRun, TcpServer

from pytest_boxlite import ledger
from pytest_boxlite.runtimes import Runtime, open_runtime, probe
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec

#: ``namespace-forked``: the namespace runtime with forking on (as a session has it), so its
#: sandbox boxes are forked from a zygote; ``namespace`` boots each box.
RUNTIME_KINDS = ["namespace", "namespace-forked", "vm"]
#: Unique per test session (and per xdist worker): part of every box name.
SESSION_HEX = uuid.uuid4().hex[:8]
BOX_PREFIX = f"pbx-test{SESSION_HEX}-"
_counter = itertools.count(1)

#: Bound on box creation: a namespace box starts in ~0.1 s.
CREATE_TIMEOUT = 30.0


def new_box_name() -> str:
    """A box name unique within this test session."""
    return f"{BOX_PREFIX}{next(_counter)}"


def skip_unless_vm_ok() -> None:
    """Skip the calling test when this host cannot boot a micro-VM, saying why."""
    p = probe()
    if not p.vm_ok:
        pytest.skip(f"micro-VMs cannot boot here: {p.reason}")


def skip_unless_real_sdk_opens() -> None:
    """Skip the calling test where the real boxlite SDK refuses to open any runtime, saying why.

    BoxLite checks /dev/kvm at every ``Boxlite(...)`` and raises ``UnsupportedError: KVM is
    available but access is denied`` when the device exists but this user cannot read and write
    it (an ordinary user outside the group owning it): even bookkeeping is out of reach then.
    """
    dev = "/dev/kvm"
    if os.path.exists(dev) and not os.access(dev, os.R_OK | os.W_OK):
        pytest.skip(
            f"the real boxlite SDK refuses to open without /dev/kvm access (uid {os.getuid()} cannot read and "
            f"write {dev}: it is not in the group owning it)"
        )


class _Runtimes:
    """Runtimes opened lazily, one per kind, all closed at session end."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.owner = "t" + SESSION_HEX
        self._open: dict[str, Runtime] = {}

    def get(self, kind: str) -> Runtime:
        if kind not in self._open:
            if kind == "vm" and not probe().vm_ok:
                # No micro-VM boots here: the vm code path runs on the SDK double (tests only).
                import sdk_double

                from pytest_boxlite.runtimes.vm import VmRuntime, prepare_home

                self._open[kind] = VmRuntime(prepare_home(self.home, self.owner), sdk=sdk_double)
            elif kind == "namespace-forked":
                rt = open_runtime("namespace", self.home, owner=self.owner)
                rt.allow_forked_boxes(True)
                self._open[kind] = rt
            else:
                self._open[kind] = open_runtime(kind, self.home, owner=self.owner)
        return self._open[kind]

    def close_all(self) -> None:
        for rt in self._open.values():
            try:
                # Safety net: a box a test failed to destroy must not outlive the session.
                for rec in rt.list_boxes():
                    if rec.name.startswith(BOX_PREFIX):
                        rt.remove_box(rec.name)
            finally:
                rt.close()
        self._open.clear()


@pytest.fixture(scope="session")
def boxlite_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private BoxLite home directory for this test session (never the user's own)."""
    return tmp_path_factory.mktemp("boxlite-home")


@pytest.fixture(scope="session")
def runtimes(boxlite_home: Path) -> Iterator[_Runtimes]:
    """Lazily opened runtimes, one per kind, closed (and swept of leftover boxes) at session end."""
    rts = _Runtimes(boxlite_home)
    try:
        yield rts
    finally:
        rts.close_all()


@pytest.fixture(scope="session", params=RUNTIME_KINDS)
def runtime_kind(request: pytest.FixtureRequest) -> str:
    """Each runtime kind in turn; ``vm`` runs on the SDK double (``tests/sdk_double``) where no VM can boot."""
    kind: str = request.param
    return kind


@pytest.fixture(scope="session")
def runtime(runtimes: _Runtimes, runtime_kind: str) -> Runtime:
    """The open runtime of the current :func:`runtime_kind`."""
    return runtimes.get(runtime_kind)


@pytest.fixture(scope="session", params=["booted", "forked"])
def namespace_mode(request: pytest.FixtureRequest) -> str:
    """How the namespace runtime makes sandbox boxes: ``booted`` (bubblewrap each) or ``forked``
    (from the spec's zygote, as a session does): every guarantee must hold both ways."""
    mode: str = request.param
    return mode


@pytest.fixture(scope="session")
def namespace_runtime(runtimes: _Runtimes, namespace_mode: str) -> Runtime:
    """The namespace runtime, for tests that are about that runtime only (booted and forked boxes)."""
    return runtimes.get("namespace" if namespace_mode == "booted" else "namespace-forked")


BoxFactory = Callable[..., Sandbox]


def _box_factory(rt: Runtime) -> Iterator[BoxFactory]:
    handles = []

    def make(spec: BoxSpec | None = None, **sandbox_kwargs: object) -> Sandbox:
        handle = rt.create_box(spec or BoxSpec(), new_box_name(), timeout=CREATE_TIMEOUT)
        handles.append(handle)
        return Sandbox(handle, **sandbox_kwargs)  # type: ignore[arg-type]

    try:
        yield make
    finally:
        errors = []
        for handle in handles:
            try:
                handle.destroy()
            except Exception as exc:  # noqa: BLE001 - destroy every box, then report
                errors.append(exc)
        if errors:
            raise errors[0]


@pytest.fixture
def make_box(runtime: Runtime) -> Iterator[BoxFactory]:
    """Create extra boxes of the current runtime (``make_box(spec)``); all destroyed at teardown."""
    yield from _box_factory(runtime)


@pytest.fixture
def make_namespace_box(namespace_runtime: Runtime) -> Iterator[BoxFactory]:
    """Create namespace boxes (``make_namespace_box(spec)``); all destroyed at teardown."""
    yield from _box_factory(namespace_runtime)


@pytest.fixture
def sandbox(runtime: Runtime) -> Iterator[Sandbox]:
    """A fresh box of the current runtime with the default spec, destroyed after the test."""
    handle = runtime.create_box(BoxSpec(), new_box_name(), timeout=CREATE_TIMEOUT)
    try:
        yield Sandbox(handle)
    finally:
        handle.destroy()


@pytest.fixture
def ns_sandbox(namespace_runtime: Runtime) -> Iterator[Sandbox]:
    """A fresh namespace box with the default spec, destroyed after the test."""
    handle = namespace_runtime.create_box(BoxSpec(), new_box_name(), timeout=CREATE_TIMEOUT)
    try:
        yield Sandbox(handle)
    finally:
        handle.destroy()


# =====================================================================================================
# Shared by the sub-run suites (session, options, reliability, xdist): one copy of each fixture.
# This block is separate from the runtime fixtures above; keep the two apart.
# =====================================================================================================


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``PYTEST_BOXLITE_*`` from the outer environment leaks into a test or its sub-runs.

    ``XDG_DATA_HOME`` is pinned to the real one: pytester changes ``$HOME``, and bwrap is found
    in boxlite's data directory under the real home.
    """
    for key in list(os.environ):
        if key.startswith("PYTEST_BOXLITE_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_DATA_HOME", REAL_DATA_HOME)


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A private boxlite home; whatever a failing test left there is removed afterwards.

    The name is short on purpose: unix socket paths under it must stay within 108 bytes.
    """
    h = tmp_path / "bxh"
    yield h
    if h.exists():
        ledger.reconcile(h, include_kept=True)


@pytest.fixture
def subruns(home: Path) -> Iterator[list[SubRun]]:
    """Sub-runs of a test, killed at teardown (before ``home`` is swept) if a failure left them running."""
    started: list[SubRun] = []
    yield started
    for s in started:
        s.kill()


@pytest.fixture
def tcp_server() -> Iterator[TcpServer]:
    """A TCP server on the host's 127.0.0.1 that records what each connection sends."""
    server = TcpServer()
    try:
        yield server
    finally:
        server.close()


#: The test files that take most of the suite's time (on 2 cores the whole suite takes about half
#: an hour): real pytest sub-runs of whole sessions (xdist, worker scope, fault injection, hostile
#: boxes and channels, images, services, debuggers on a pty, the pool's stress test, the VM code
#: path on the SDK double, the plugin matrix).
#: They get the ``slow`` marker, so ``python -m pytest -m "not slow"`` is the quick tier (under ten
#: minutes on 2 cores); CI runs everything.
SLOW_FILES = frozenset(
    {
        "test_all_homes_masked.py",
        "test_benchmarks_cli.py",
        "test_boxed_coverage.py",
        "test_env_deny.py",
        "test_escape_table.py",
        "test_escapes.py",
        "test_examples_safety.py",
        "test_fidelity_misc.py",
        "test_fixture_scopes.py",
        "test_fork_deadlock.py",
        "test_fresh_clone.py",
        "test_home_full.py",
        "test_hostile_boxes.py",
        "test_hostile_channel.py",
        "test_hostile_home.py",
        "test_hostile_images.py",
        "test_hostile_mounts.py",
        "test_hostile_relay.py",
        "test_hostile_reports.py",
        "test_images_marker.py",
        "test_images_namespace.py",
        "test_images_store.py",
        "test_images_unpack.py",
        "test_item_path.py",
        "test_marker.py",
        "test_nonroot.py",
        "test_pdb_relay.py",
        "test_plugin_matrix.py",
        "test_pool.py",
        "test_reliability.py",
        "test_rest_runtime.py",
        "test_rest_session.py",
        "test_sandbox_project.py",
        "test_services_fixtures.py",
        "test_services_hostile.py",
        "test_services_image.py",
        "test_services_reach.py",
        "test_session.py",
        "test_side_effects.py",
        "test_startup_cost.py",
        "test_template_links.py",
        "test_templates_keys.py",
        "test_timeout_output.py",
        "test_vm_fork.py",
        "test_vm_images.py",
        "test_vm_marker.py",
        "test_vm_selftest.py",
        "test_vm_templates.py",
        "test_xdist.py",
        "test_xdist_remote.py",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``slow`` marker on every test of :data:`SLOW_FILES` (see the README's quick tier)."""
    slow = pytest.mark.slow
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(slow)
