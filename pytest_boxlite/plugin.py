"""pytest hooks of pytest-boxlite.  Thin: the logic lives in the modules it calls."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from pytest_boxlite import ledger, reporting
from pytest_boxlite.errors import BoxliteError, ConfigError
from pytest_boxlite.fixtures import (  # noqa: F401 - fixtures are found as attributes of this plugin
    CALL_FAILED_KEY,
    SESSION_KEY,
    boxlite_module_sandbox,
    boxlite_pool,
    boxlite_sandbox,
)
from pytest_boxlite.marker_registration import MARKER_HELP as _MARKER_HELP
from pytest_boxlite.markers import BoxPlan, plan_for
from pytest_boxlite.pool import NoLifecycle
from pytest_boxlite.remote import BoxedExecutor, RemoteRunner, in_guest
from pytest_boxlite.runtimes import BoxHandle
from pytest_boxlite.session import BoxliteSession
from pytest_boxlite.settings import Settings, add_options, resolve
from pytest_boxlite.spec import BoxSpec

_BOX_FIXTURES = frozenset({"boxlite_sandbox", "boxlite_module_sandbox", "boxlite_pool"})
_SIGTERM_KEY = pytest.StashKey[dict[str, Any]]()
_PLAN_KEY = pytest.StashKey[BoxPlan]()
_EXECUTOR_KEY = pytest.StashKey[BoxedExecutor]()
_SHUT_DOWN_KEY = pytest.StashKey[bool]()


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """``--boxlite-scope=worker`` without ``-n``: run the whole session again inside one box."""
    if in_guest() or hasattr(config, "workerinput") or getattr(config.option, "numprocesses", None):
        return None
    if _boots_nothing(config):
        return None
    settings = resolve(config)
    if settings.scope != "worker":
        return None
    from pytest_boxlite.session_in_box import run_session_in_box

    return run_session_in_box(config, settings)


class GuestRole:
    """Registered inside a box's pytest (boxed tests, ``--boxlite-scope=worker``): the host boxes."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        # A --basetemp the host chose (or xdist's per-worker one) lies under the host's /tmp, which
        # the box does not share: make its parent, so tmp_path works as it does on the host.
        basetemp = item.config.option.basetemp
        if basetemp:
            Path(basetemp).resolve().parent.mkdir(parents=True, exist_ok=True)


def _boots_nothing(config: pytest.Config) -> bool:
    """Runs that only list or collect (--collect-only, --fixtures, --markers, --help, ...)."""
    opt = config.option
    names = ("collectonly", "showfixtures", "show_fixtures_per_test", "markers", "help", "version")
    return any(getattr(opt, n, False) for n in names)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER_HELP)
    if in_guest():
        config.pluginmanager.register(GuestRole(), "boxlite-guest")
        return  # inside a box's test worker: the host does the boxing
    if _boots_nothing(config):
        return
    settings = resolve(config)
    workerinput = getattr(config, "workerinput", None)
    session_id = workerinput.get("boxlite_session") if workerinput else None
    worker_id = workerinput.get("workerid") if workerinput else None
    try:
        boxed = _BoxedLifecycle(config, settings, session_id or ledger.new_session_id(), worker_id)
    except BoxliteError as exc:
        raise pytest.UsageError(str(exc)) from None
    session = boxed.session
    config.stash[SESSION_KEY] = session
    config.stash[_EXECUTOR_KEY] = boxed.executor
    if config.pluginmanager.hasplugin("xdist"):
        from pytest_boxlite.xdist_support import XdistHooks, box_worker_specs

        config.pluginmanager.register(XdistHooks(session), "boxlite-xdist")
        if settings.scope == "worker" and _is_controller(config):
            box_worker_specs(session, config)
    _install_sigterm(config)


class _BoxedLifecycle(NoLifecycle):
    """The pool's lifecycle for boxed tests: a warm interpreter in every ``worker`` box, and fork
    parents that give way when a lease of another spec is blocked at the cap.

    Builds the runner, the session and the executor, which it is the lifecycle of.
    """

    def __init__(self, config: pytest.Config, settings: Settings, session_id: str, worker_id: str | None) -> None:
        self.runner = RemoteRunner(config, boot_timeout=settings.boot_timeout)
        try:
            self.session = BoxliteSession(
                settings,
                session_id=session_id,
                worker_id=worker_id,
                lifecycle=self,
                worker_mounts=self.runner.mounts(),
            )
        except BaseException:
            self.runner.shutdown()
            raise
        self.executor = BoxedExecutor(self.runner, self.session)

    def after_boot(self, handle: BoxHandle, spec: BoxSpec) -> None:
        self.runner.start_worker(handle, spec)

    def before_destroy(self, handle: BoxHandle) -> None:
        self.runner.stop_worker(handle)

    def relieve(self, spec: BoxSpec) -> bool:
        return self.executor.release_template(spec)


def _install_sigterm(config: pytest.Config) -> None:
    """Turn SIGTERM into an orderly interruption, so boxes are reaped; re-raised after cleanup."""
    state: dict[str, Any] = {"received": False, "previous": None}
    config.stash[_SIGTERM_KEY] = state
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # someone else handles SIGTERM: leave it to them
    except ValueError:
        return

    def on_sigterm(signum: int, frame: object) -> None:
        state["received"] = True
        raise KeyboardInterrupt("SIGTERM")

    with contextlib.suppress(ValueError):  # not the main thread
        state["previous"] = signal.signal(signal.SIGTERM, on_sigterm)


def _is_controller(config: pytest.Config) -> bool:
    """True for the xdist controller (it runs no pool); False for workers and plain runs."""
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "dist", "no") != "no")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    box = config.stash.get(SESSION_KEY, None)
    if box is None:
        return
    try:
        box.prepare_home()
    except (ConfigError, BoxliteError) as exc:
        if box.settings.sources["home"] != "default":
            raise pytest.UsageError(str(exc)) from None
        box.defer_error(exc)
        return
    if not hasattr(config, "workerinput"):
        box.reconcile()


def pytest_itemcollected(item: pytest.Item) -> None:
    box = item.config.stash.get(SESSION_KEY, None)
    if box is None or _is_controller(item.config):
        return
    # Start booting while collection goes on; bad marker arguments are reported after collection.
    # Only the session's default specs are kept warm: a test with its own image, cpus, ... boots
    # its box on demand instead of evicting the boxes everyone else is waiting for.
    with contextlib.suppress(pytest.UsageError):
        plan = plan_for(item, box)
        if plan is not None:
            if plan.spec == box.default_worker_spec:
                box.want(plan.spec)
            return
    if _BOX_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        box.want(box.default_spec)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    box = config.stash.get(SESSION_KEY, None)
    if box is None or _is_controller(config):
        return
    has_timeout = config.pluginmanager.hasplugin("timeout")
    for item in items:
        plan = plan_for(item, box)
        if plan is None:
            continue
        item.stash[_PLAN_KEY] = plan
        if has_timeout:
            # pytest-timeout acts inside the box; on the host it could only kill the whole session.
            item.add_marker(pytest.mark.timeout(0), append=False)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    plan = item.stash.get(_PLAN_KEY, None)
    if plan is None:
        return None
    next_plan = nextitem.stash.get(_PLAN_KEY, None) if nextitem is not None else None
    return item.config.stash[_EXECUTOR_KEY].run_protocol(item, plan, nextitem, next_plan)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if report.when == "call" and report.failed:
        item.stash[CALL_FAILED_KEY] = True
    return report


def pytest_report_header(config: pytest.Config) -> list[str]:
    box = config.stash.get(SESSION_KEY, None)
    if box is None:
        return []
    lines = reporting.header(box, controller=_is_controller(config))
    if config.option.usepdb:
        lines.append(
            "boxlite: --pdb does not enter boxed tests (they run in a box without this terminal); "
            "to debug one here, run it with -p no:boxlite"
        )
    return lines


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    box = config.stash.get(SESSION_KEY, None)
    if box is not None:
        reporting.summary(terminalreporter, box)


def _shutdown(config: pytest.Config) -> None:
    """Reap everything (at session finish, or at unconfigure if the session never finished).  Once."""
    box = config.stash.get(SESSION_KEY, None)
    if box is None or config.stash.get(_SHUT_DOWN_KEY, False):
        return
    config.stash[_SHUT_DOWN_KEY] = True
    executor = config.stash[_EXECUTOR_KEY]
    executor.close()
    box.shutdown()
    executor.runner.shutdown()
    if executor.runner.forks:
        box.report.stats.update(forked=executor.runner.forks, fork_waits=list(executor.runner.fork_waits))
    if _is_controller(config):
        box.reap_workers()
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        from pytest_boxlite.xdist_support import WORKEROUTPUT_KEY

        rep = box.report
        workeroutput[WORKEROUTPUT_KEY] = {"stats": rep.stats, "leaked": rep.leaked, "kept": rep.kept}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    _shutdown(session.config)


def pytest_unconfigure(config: pytest.Config) -> None:
    _shutdown(config)
    state = config.stash.get(_SIGTERM_KEY, None)
    if state is None:
        return
    if state["previous"] is not None:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, state["previous"])
    if state["received"]:
        # Die by SIGTERM as pytest would have without us, now that the boxes are gone.
        sys.stdout.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
