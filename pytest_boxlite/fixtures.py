"""Public fixtures: ``boxlite_sandbox``, ``boxlite_module_sandbox`` and ``boxlite_pool``."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    # Types only: this module is loaded with the plugin in every pytest process, a box's included,
    # which never leases (the host does): the pool and sessions are imported where they are used.
    from pytest_boxlite.pool import Lease, PoolStats
    from pytest_boxlite.sandbox import Sandbox
    from pytest_boxlite.session import BoxliteSession
    from pytest_boxlite.spec import BoxSpec

SESSION_KEY = pytest.StashKey["BoxliteSession"]()
#: Makes the host role of a run without ``--boxlite`` that has not needed one yet (see
#: ``plugin.LazyHost``) and returns its session.
PROMOTE_KEY = pytest.StashKey[Callable[[], "BoxliteSession"]]()
#: The call-phase report of an item, so fixtures can tell whether the test failed.
CALL_FAILED_KEY = pytest.StashKey[bool]()


def get_session(config: pytest.Config) -> BoxliteSession:
    try:
        return config.stash[SESSION_KEY]
    except KeyError:
        promote = config.stash.get(PROMOTE_KEY, None)
        if promote is not None:
            return promote()
        from pytest_boxlite.spec import in_guest

        if in_guest(config):
            # Tests that ask for the fixtures as arguments run on the host; this one got here some
            # other way (request.getfixturevalue) or the whole session runs in a box.
            raise pytest.UsageError(
                "pytest-boxlite: this test runs in a box, and a box cannot lease boxes (boxes do not nest). "
                "Under --boxlite or the boxlite marker, a test that takes boxlite_sandbox, "
                "boxlite_module_sandbox or boxlite_pool as an argument (or through its fixtures) runs on "
                "the host; with --boxlite-scope=worker the whole session is in a box: use "
                "--boxlite-scope=test or module for tests that lease sandboxes."
            ) from None
        raise pytest.UsageError("pytest-boxlite is not active in this process") from None


class BoxlitePool:
    """Lease boxes with other specs than the session default.

    ``with boxlite_pool.sandbox(image="python:3.12-slim", cpus=2) as sb:``
    leases a pristine box and destroys it afterwards.  ``reuse=True`` opts in
    to sharing: the box goes back to the pool after use and may be handed
    (health-checked) to another ``reuse=True`` lease.
    """

    def __init__(self, session: BoxliteSession) -> None:
        self._session = session

    def spec(
        self,
        *,
        image: str | None = None,
        cpus: int | None = None,
        memory: int | None = None,
        env: Mapping[str, str] | None = None,
        network: bool | None = None,
    ) -> BoxSpec:
        """The session's default box spec with the given fields changed."""
        return self._spec("boxlite_pool.spec", image=image, cpus=cpus, memory=memory, env=env, network=network)

    def _spec(
        self,
        what: str,
        *,
        image: str | None = None,
        cpus: int | None = None,
        memory: int | None = None,
        env: Mapping[str, str] | None = None,
        network: bool | None = None,
    ) -> BoxSpec:
        spec = self._session.spec_for(
            image=image, cpus=cpus, memory=memory, env=tuple((env or {}).items()) or None, network=network
        )
        unused = self._session.unused_image(spec.image, what) if image is not None else None
        if unused:
            _warn_at_caller(unused)
        return spec

    def lease(self, *, timeout: float | None = None, reuse: bool = False, **spec: Any) -> Lease:
        """Lease a box; call ``release()`` on the result (or use :meth:`sandbox`)."""
        return self._lease("boxlite_pool.lease", timeout, reuse, spec)

    def _lease(self, what: str, timeout: float | None, reuse: bool, spec: dict[str, Any]) -> Lease:
        return self._session.pool().lease(self._spec(what, **spec), timeout=timeout, reuse=reuse)

    @contextlib.contextmanager
    def sandbox(self, *, timeout: float | None = None, reuse: bool = False, **spec: Any) -> Iterator[Sandbox]:
        """Lease a box for the ``with`` block."""
        lease = self._lease("boxlite_pool.sandbox", timeout, reuse, spec)
        try:
            yield lease.sandbox
        finally:
            lease.release()

    @property
    def stats(self) -> PoolStats:
        """Counters of this process's pool (booted, leased, warm hits, ...)."""
        return self._session.pool().stats

    @property
    def runtime(self) -> str:
        """``"vm"`` or ``"namespace"``, and why: see :attr:`runtime_reason`."""
        return self._session.choice.kind

    @property
    def runtime_reason(self) -> str:
        return self._session.choice.reason


def _warn_at_caller(message: str) -> None:
    """Warn at the first frame outside this plugin and ``contextlib`` (the test's ``with`` line)."""
    frame = sys._getframe(1)
    here = os.path.dirname(__file__)
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(here) or frame.f_code.co_filename == contextlib.__file__
    ):
        frame = frame.f_back
    warnings.warn_explicit(
        pytest.PytestWarning(message),
        category=pytest.PytestWarning,
        filename=frame.f_code.co_filename,
        lineno=frame.f_lineno,
    )


@pytest.fixture(scope="session")
def boxlite_pool(pytestconfig: pytest.Config) -> BoxlitePool:
    """Session-wide access to the warm pool of boxes.

    Lease boxes with other specs: ``with boxlite_pool.sandbox(image=..., cpus=...,
    memory=..., env={...}, network=True) as sb:``.  Share one box across a module
    or the session by leasing it in a fixture of that scope (see the README).
    """
    return BoxlitePool(get_session(pytestconfig))


def _leased_sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    session = get_session(request.config)
    lease = session.pool().lease(session.default_spec)
    try:
        yield lease.sandbox
    finally:
        failed = request.node.stash.get(CALL_FAILED_KEY, False)
        if session.settings.keep and failed:
            # The summary's "kept box" line names this test (reporting.BOX_PROPERTY).
            request.node.user_properties.append(("boxlite_box", lease.handle.name))
        lease.release(keep=session.settings.keep and failed)


@pytest.fixture
def boxlite_sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    """A pristine box for this test, leased from the session's warm pool.

    Full file and exec contract: ``run``, ``execute_command``, ``read_file``,
    ``write_file``, ``read_bytes``, ``write_bytes``, ``upload``, ``download``,
    ``exists``, ``remove``, ``list_dir``, ``glob``, ``grep``.  The box is
    destroyed after the test (kept with ``--boxlite-keep`` if the test failed).
    """
    yield from _leased_sandbox(request)


@pytest.fixture(scope="module")
def boxlite_module_sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    """One box shared by every test of a module, for expensive setup done once.

    Tests using it see each other's changes, in order; use ``boxlite_sandbox``
    when a test needs a pristine box.
    """
    yield from _leased_sandbox(request)
