"""``--boxlite-scope=worker``: the whole session runs again inside one box (without xdist:
:func:`run_session_in_box`), and, in that box or in each xdist worker's, :class:`WorkerScopeGuest`
holds each test to its marker's arguments.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_boxlite.markers import USAGE_ATTR
from pytest_boxlite.settings import Settings


def run_session_in_box(config: pytest.Config, settings: Settings) -> int:
    """Re-run this pytest command inside a box; its output goes straight to this terminal."""
    # Imported here: a worker box's own pytest imports this module for WorkerScopeGuest alone.
    from pytest_boxlite import ledger
    from pytest_boxlite.runtimes import choose
    from pytest_boxlite.spec import minimal_dirs
    from pytest_boxlite.xdist_support import boxproc_argv

    home = Path(settings.home).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    ledger.reconcile(home)
    # A virtual environment's interpreter (``<venv>/bin``) is on no sys.path entry: mount the venv.
    venv = [sys.prefix] if sys.prefix != sys.base_prefix else []
    cmd = boxproc_argv(
        settings,
        session_id=ledger.new_session_id(),
        home=home,
        runtime=choose(settings.runtime).kind,
        mounts=minimal_dirs([str(config.rootpath), str(config.invocation_params.dir), *venv, *sys.path]),
        cwd=str(config.invocation_params.dir),
    )
    # pytest keeps capturing stdin (fd 0 on /dev/null) after start-up: the session's box must get
    # the terminal itself, or input() and pdb in it read end-of-file.
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)
    from pytest_boxlite.side_effects import output_env  # the run's output is not a test's side effect

    env = {**os.environ, **output_env()}
    proc = subprocess.Popen([*cmd, "--", sys.executable, "-m", "pytest", *config.invocation_params.args], env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # The session inside got the same Ctrl-C from the terminal; let it finish cleaning up.
        return proc.wait(timeout=60)


#: The signal the timeout watchdog sends to the test's (main) thread.  A real-time signal, not
#: SIGALRM: tests that use ``signal.alarm``/``setitimer`` themselves keep them to themselves.
_TIMEOUT_SIGNAL = signal.SIGRTMIN + 5
#: After the timeout interrupted the test, how long it has to finish before its worker's box ends
#: (a test stuck in native code, or one that swallows the interruption).
_GRACE = 5.0
#: What a worker box cannot give a test other than the whole run has (the box is the worker's).
_PER_BOX = (("image", "image"), ("cpus", "cpus"), ("memory", "memory"), ("network", "network"))


def _flag(arg: str, value: object) -> str:
    """The command-line option that gives every box of the run ``arg=value``."""
    shown = ("on" if value else "off") if isinstance(value, bool) else str(value)
    return f"--boxlite-{arg}={shown}"


class WorkerScopeGuest:
    """Per-test marker arguments inside a ``--boxlite-scope=worker`` box (the session's or an xdist
    worker's): ``env=`` is set for the test, ``timeout=`` (and ``--boxlite-timeout``) bounds it as
    in the other scopes; arguments a shared box cannot hold per test (``image``, ``cpus``,
    ``memory``, ``network``, ``user``) are a usage error naming the test, unless they equal the
    worker box's own.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._main = threading.get_ident()
        #: The test now running, once its timeout expired outside a phase (raised at the next one).
        self._expired: str | None = None
        #: The running test's node id and timeout while its watchdog runs.
        self._current: tuple[str, float] | None = None
        self._in_phase = False
        signal.signal(_TIMEOUT_SIGNAL, self._on_timeout)

    # -- refusing what cannot hold ------------------------------------------------------------
    def _refusal(self, item: pytest.Item, kwargs: dict[str, Any]) -> str | None:
        for arg, setting in _PER_BOX:
            if arg in kwargs and kwargs[arg] != getattr(self.settings, setting):
                have = getattr(self.settings, setting)
                return (
                    f"{arg}={kwargs[arg]!r} cannot hold under --boxlite-scope=worker: every test of a worker "
                    f"runs in that worker's one box, which has {arg}="
                    f"{'the runtime default' if have is None else repr(have)}. Run the test with "
                    f"--boxlite-scope=test or module, or give the whole run {_flag(arg, kwargs[arg])}"
                )
        if "user" in kwargs:
            return (
                f"user={kwargs['user']!r} cannot hold under --boxlite-scope=worker: a worker's box runs "
                "every test as the user the run started as. Run the test with --boxlite-scope=test or module"
            )
        return None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        from pytest_boxlite.markers import marker_kwargs

        refused = []
        for item in items:
            # A bad argument is a usage error as in the other scopes, and so is one that cannot hold.
            try:
                why = self._refusal(item, marker_kwargs(item))
                if why is not None:
                    raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.boxlite: {why}")
            except pytest.UsageError as exc:
                if not hasattr(config, "workerinput"):
                    raise
                refused.append((item, str(exc)))
        if refused:
            # An xdist worker that raises here breaks the controller (an INTERNALERROR that names no
            # test): each refusal goes to it as a collection error instead, every worker runs
            # nothing, and the controller ends the session as a usage error (plugin.py).
            for item, why in refused:
                report = pytest.CollectReport(item.nodeid, "failed", why, [])
                setattr(report, USAGE_ATTR, True)
                config.hook.pytest_collectreport(report=report)
            config.hook.pytest_deselected(items=list(items))
            items[:] = []

    # -- env= and the timeout, per test --------------------------------------------------------
    def _bound(self, item: pytest.Item) -> float | None:
        marker = item.get_closest_marker("boxlite")
        if marker is None and not self.settings.all:
            return None  # not a boxed test in the other scopes: no bound there either
        timeout = marker.kwargs.get("timeout") if marker is not None else None
        return float(timeout if timeout is not None else self.settings.timeout)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
        marker = item.get_closest_marker("boxlite")
        env = dict(marker.kwargs.get("env") or {}) if marker is not None else {}
        with _environ(env), self._watchdog(item, self._bound(item)):
            return (yield)

    @contextlib.contextmanager
    def _watchdog(self, item: pytest.Item, timeout: float | None) -> Iterator[None]:
        if timeout is None or threading.get_ident() != self._main:
            yield
            return
        done = threading.Event()

        def expire() -> None:
            if done.wait(timeout):
                return
            signal.pthread_kill(self._main, _TIMEOUT_SIGNAL)
            if done.wait(_GRACE):
                return
            # It did not stop: end this worker's box, as the other scopes kill a timed-out test's box.
            _last_words(
                item,
                f"boxlite: {item.nodeid} timed out after {timeout:.0f}s and did not stop within "
                f"{_GRACE:.0f}s of being interrupted; ending this worker's box",
            )
            os._exit(1)

        self._current = (item.nodeid, timeout)
        watcher = threading.Thread(target=expire, name="boxlite-timeout", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            self._current = None
            self._expired = None

    def _message(self) -> str:
        timeout = self._current[1] if self._current is not None else 0.0
        return (
            f"[boxlite] timed out after {timeout:.0f}s; the test was interrupted "
            "(--boxlite-timeout or the marker's timeout)"
        )

    def _on_timeout(self, signum: int, frame: object) -> None:
        if self._current is None:
            return  # the test ended while the signal was on its way
        if not self._in_phase:
            self._expired = self._message()  # between phases, in pytest's own code: fail the next one
            return
        pytest.fail(self._message(), pytrace=False)

    @contextlib.contextmanager
    def _phase(self) -> Iterator[None]:
        if self._expired is not None:
            pytest.fail(self._expired, pytrace=False)
        self._in_phase = True
        try:
            yield
        finally:
            self._in_phase = False

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, Any, Any]:
        with self._phase():
            return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, Any]:
        with self._phase():
            return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
        with self._phase():
            return (yield)


def _last_words(item: pytest.Item, message: str) -> None:
    """Before the process ends unflushed (``os._exit``): what the test printed (pytest captures it at
    the descriptor level, where it would be lost) and ``message``, on the real stderr, as
    pytest-timeout's thread method does."""
    captured = ""
    capman = item.config.pluginmanager.getplugin("capturemanager")
    with contextlib.suppress(Exception):  # best effort: the process ends either way
        if capman is not None:
            capman.suspend_global_capture(in_=True)
            out, err = capman.read_global_capture()
            captured = out + err
    with contextlib.suppress(Exception):
        if not hasattr(item.config, "workerinput"):
            # The session's own report so far (an xdist worker's stdout is its channel: left alone).
            reporter = item.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.flush()
            sys.stdout.flush()
        sys.stderr.write(f"{captured}\n{message}\n")
        sys.stderr.flush()


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``env`` set for the block, and what was there before put back after it."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class WorkerRefusals:
    """On an xdist controller: a test whose marker arguments a worker refused (a collection error,
    see :class:`WorkerScopeGuest` and ``markers.MarkerCheck``) ends the session with the usage
    error's exit status, as it does without xdist."""

    def __init__(self) -> None:
        self.refused = False

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed and getattr(report, USAGE_ATTR, False) is True:
            self.refused = True

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.refused:
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
