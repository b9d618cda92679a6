"""The roles of a pytest process that boxes (see :mod:`pytest_boxlite.plugin`): the host of a
plain run or xdist worker (:class:`HostPlugin`) and the xdist controller (:class:`ControllerPlugin`).

Imported only where one is registered: a box's own pytest (and a run that only collects) loads
:mod:`pytest_boxlite.plugin` without this module and the pool, runtimes and remote execution it
brings, which would cost every box's start-up their import time for nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

from pytest_boxlite import reporting
from pytest_boxlite.errors import BoxliteError, ConfigError
from pytest_boxlite.fixtures import CALL_FAILED_KEY
from pytest_boxlite.markers import BoxPlan, plan_for, warn_at
from pytest_boxlite.pool import DefaultLifecycle
from pytest_boxlite.runtimes import BoxHandle, header_notes, preflight
from pytest_boxlite.session import BoxliteSession
from pytest_boxlite.settings import Settings
from pytest_boxlite.spec import BoxSpec
from pytest_boxlite.xdist_support import REMOTE_KEY, WorkerBoxServers

if TYPE_CHECKING:
    from pytest_boxlite.remote import BoxedExecutor, ForkedBoxes

_BOX_FIXTURES = frozenset({"boxlite_sandbox", "boxlite_module_sandbox", "boxlite_pool"})
_PLAN_KEY = pytest.StashKey[BoxPlan]()
#: The stand-in item through which the host tears down its own fixtures around boxed tests.
_SHADOW = "boxlite-shared-fixtures"


def _plan_of(item: pytest.Item) -> BoxPlan | None:
    """The plan made for ``item`` at collection (None: it runs on the host)."""
    return item.stash.get(_PLAN_KEY, None)


def _noop() -> None:
    """The stand-in item's test function (never called)."""


def _common(chain: list[Any], nextitem: pytest.Item | None) -> list[Any]:
    """The nodes of ``chain`` that stay set up when ``nextitem`` comes next (pytest's
    ``teardown_exact``: the common start of both chains)."""
    needed = nextitem.listchain() if nextitem is not None else []
    kept = []
    for node, other in zip(chain, needed, strict=False):
        if node is not other:
            break
        kept.append(node)
    return kept


class SigtermGuard:
    """Turns SIGTERM into an orderly interruption, so boxes are reaped; re-raised after cleanup."""

    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return  # someone else handles SIGTERM: leave it to them
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:
            pass  # not the main thread: signals are not ours to handle

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.received = True
        raise KeyboardInterrupt("SIGTERM")

    def restore(self) -> None:
        """Put the previous handler back; if SIGTERM came, die by it as pytest would have."""
        if self._previous is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if self.received:
            sys.stdout.flush()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


def worker_mounts_for(config: pytest.Config) -> tuple[str, ...]:
    """What a test worker's box mounts (see :func:`pytest_boxlite.remote.worker_mounts`), imported
    when a worker box is first wanted."""
    from pytest_boxlite.remote import worker_mounts

    return worker_mounts(config)


class _SessionRole:
    """What the host and the controller share: home, reconcile, header, summary, shutdown once."""

    NAME = "boxlite-role"

    def __init__(self, config: pytest.Config, session: BoxliteSession) -> None:
        self.config = config
        self.session = session
        self._sigterm = SigtermGuard()
        self._shut_down = False
        self._shutdown_lock = threading.Lock()

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        try:
            self.session.prepare_home()
        except (ConfigError, BoxliteError) as exc:
            if self.session.settings.sources["home"] != "default":
                raise pytest.UsageError(str(exc)) from None
            self.session.defer_error(exc)
            return
        self._home_ready()
        # A remote worker is the first owner on its host to see that home: it reconciles it, as the
        # controller does with the home that it shares with its local workers.
        workerinput = getattr(self.config, "workerinput", None)
        if workerinput is None or workerinput.get(REMOTE_KEY):
            self.session.reconcile()

    def _home_ready(self) -> None:
        """The home is usable and this process's owner lock held: boxes may start (before the
        reconcile of dead sessions' leftovers, which never touches a live owner's boxes)."""

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        lines = reporting.header(self.session, controller=isinstance(self, ControllerPlugin))
        lines += header_notes(self.session.choice.kind, self.session.default_spec)
        # No --pdb line: every boxed test's box, forked or booted, opens pytest's post-mortem on
        # this terminal (guest/debugger.py, remote/debug_relay.py).
        return lines

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
        reporting.summary(terminalreporter, self.session)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.shutdown()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.shutdown()
        self._sigterm.restore()

    def shutdown(self) -> None:
        """Reap everything (at session finish, or at unconfigure if the session never finished)."""
        with self._shutdown_lock:
            if self._shut_down:
                return
            self._shut_down = True
        self._shutdown()

    def _shutdown(self) -> None:
        self.session.shutdown()


class ControllerPlugin(_SessionRole):
    """The xdist controller: no pool of its own; its workers each own theirs.

    Local workers (plain ``popen``) share this machine's home: the controller reconciles it before
    they start and reaps ``<session>-*`` in it after they end.  Remote workers (``socket=``,
    ``ssh=``, ...) box on their own hosts under their own homes and clean up there themselves; the
    controller marks them in ``workerinput`` and reports, per host, what they sent back.  With
    remote workers only, this machine's home is not touched at all.
    """

    NAME = "boxlite-controller"

    def __init__(self, config: pytest.Config, session: BoxliteSession) -> None:
        super().__init__(config, session)
        from pytest_boxlite.xdist_support import RemoteLedger, remote_specs, tx_specs

        self.remote = RemoteLedger()
        self._remote_specs = remote_specs(config)
        #: Some worker runs on this machine (then its home is prepared, reconciled and reaped here).
        self.has_local = len(self._remote_specs) < len(tx_specs(config)) or not self._remote_specs
        self._box_servers: WorkerBoxServers | None = None
        if session.settings.scope == "worker":
            from pytest_boxlite.xdist_support import box_worker_specs

            if config.pluginmanager.hasplugin("rerunfailures") and not session.settings.network:
                # Its xdist workers report to the controller over 127.0.0.1: fail now, not in every worker.
                raise pytest.UsageError(
                    "--boxlite-scope=worker: pytest-rerunfailures is installed, and its xdist workers connect "
                    "to the controller over 127.0.0.1, which a worker box without network cannot reach. "
                    "Add --boxlite-network=on (worker boxes then share the host's network), "
                    "or -p no:rerunfailures."
                )

            from pytest_boxlite import boxproc

            self._box_servers = box_worker_specs(session, config, boxproc.main)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self.has_local:
            super().pytest_sessionstart(session)

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        lines = super().pytest_report_header(config)
        if self._remote_specs:
            lines += reporting.remote_header(self._remote_specs, local=self.has_local)
        return lines

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
        reporting.summary(terminalreporter, self.session, remote=self.remote)

    def pytest_configure_node(self, node: Any) -> None:
        from pytest_boxlite.xdist_support import is_remote, spec_text

        node.workerinput["boxlite_session"] = self.session.session_id
        if self._box_servers is not None:
            # The worker is a session in a box: what it sends is the guest's (xdist trusts it).
            from pytest_boxlite.xdist_guard import guard

            guard(node)
        spec = spec_text(node.gateway.spec)
        if is_remote(spec):
            node.workerinput[REMOTE_KEY] = spec
            self.remote.specs[str(node.gateway.id)] = spec

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        from pytest_boxlite.xdist_support import WORKEROUTPUT_KEY

        worker = str(node.gateway.id)
        data = getattr(node, "workeroutput", {}).get(WORKEROUTPUT_KEY)
        remote_spec = self.remote.specs.get(worker)
        if remote_spec is not None and not (isinstance(data, dict) and self.remote.add(worker, data)):
            self.remote.silent.append((worker, remote_spec))
            return
        if isinstance(data, dict):
            from pytest_boxlite.xdist_support import clean_stats

            report = self.session.report
            if remote_spec is not None:
                # Another machine's counters: only numbers are added up; its box names are on its host's line.
                report.worker_stats.append(clean_stats(data.get("stats")))
                return
            report.worker_stats.append(data["stats"])
            report.leaked += data["leaked"]
            report.kept += data["kept"]

    def _shutdown(self) -> None:
        self.session.shutdown()
        if self._box_servers is not None:
            self._box_servers.stop()
        if self.has_local:
            self.session.reap_workers()


class HostPlugin(_SessionRole, DefaultLifecycle):
    """A plain run or an xdist worker: its boxes, the warm interpreters in them and boxed items.

    It is also the pool's lifecycle: a warm interpreter in every ``worker`` box, and warm
    interpreters held for forking that give way when a lease of another spec is blocked at the cap.
    """

    NAME = "boxlite-host"

    def __init__(self, config: pytest.Config, settings: Settings, session_id: str, worker_id: str | None) -> None:
        session = BoxliteSession(
            settings,
            session_id=session_id,
            worker_id=worker_id,
            lifecycle=self,
            worker_mounts=lambda: worker_mounts_for(config),
            project=config.rootpath,
        )
        super().__init__(config, session)
        # Made at the first box: a run that boxes nothing (the plugin is installed, the run does
        # not use it) pays neither execnet's import nor the guest sources' reading.
        self._remote: tuple[ForkedBoxes, BoxedExecutor] | None = None
        self._remote_lock = threading.Lock()
        #: Which of the default specs an unmarked item asked for at collection ("worker", "pool").
        self._wanted_early: set[str] = set()
        #: Shut down: a box that finishes booting after that (the session's starter thread) gets
        #: no runner, which nothing would ever shut down.
        self._remote_closed = False
        workerinput = getattr(config, "workerinput", None)
        #: A worker on another host than its controller (it cleans up on its host itself).
        self.remote = bool(workerinput and workerinput.get(REMOTE_KEY))
        #: The nodes on which tests run on this host may have set fixtures up (pytest's own
        #: SetupState, as far as its public hooks show: the chain the last such test left).
        self._host_stack: list[Any] = []  # pytest's nodes (no public type names them all)
        self._in_shadow = False
        if self.remote:
            from pytest_boxlite.xdist_support import watch_controller

            watch_controller(config, self._controller_lost)

    # Methods, not properties: pytest 8's fixture discovery reads every attribute of a plugin
    # object, which would make them at registration.
    def _runner(self) -> ForkedBoxes:
        """The warm interpreters in this process's boxes (made at first use)."""
        return self._remote_parts()[0]

    def _executor(self) -> BoxedExecutor:
        """Runs boxed items' protocols in boxes (made at first use)."""
        return self._remote_parts()[1]

    def _made(self) -> tuple[ForkedBoxes, BoxedExecutor] | None:
        """The runner and executor if they were made (never makes them)."""
        with self._remote_lock:
            return self._remote

    def _remote_parts(self) -> tuple[ForkedBoxes, BoxedExecutor]:
        # The session's starter thread (after_boot) and the main thread (a boxed item) may come first.
        with self._remote_lock:
            if self._remote is None:
                if self._remote_closed:
                    raise BoxliteError("the session has ended: no box is started for it any more")
                from pytest_boxlite.remote import BoxedExecutor, ForkedBoxes, WarmInterpreters

                s = self.session.settings
                warm = WarmInterpreters(self.config, boot_timeout=s.boot_timeout, env_deny=s.env_deny)
                runner = ForkedBoxes(warm)
                self._remote = runner, BoxedExecutor(runner, self.session, plan_of=_plan_of)
            return self._remote

    # -- the pool's lifecycle ---------------------------------------------------------------
    def after_boot(self, handle: BoxHandle, spec: BoxSpec) -> None:
        if spec.warm:  # a sandbox's box runs no warm interpreter: it needs no runner
            self._runner().warm.start(handle, spec)

    def before_destroy(self, handle: BoxHandle) -> None:
        remote = self._made()
        if remote is not None:  # no runner made: no warm interpreter to stop in any box
            remote[0].stop_warm(handle)

    def relieve(self, spec: BoxSpec) -> bool:
        remote = self._made()
        # No executor made: it holds no box (no warm interpreter) to release.
        return remote is not None and remote[1].release_warm_interpreter(spec)

    # -- hooks ----------------------------------------------------------------------------------
    def _home_ready(self) -> None:
        # Under --boxlite every test needs the default box: boot it now, so that its boot and the
        # box's own collection of the session overlap the host's collection (test modules that
        # import heavy libraries) and the reconcile, instead of starting at the first collected
        # item.  Only a run that collects and then deselects everything pays for a box it does not
        # use (--collect-only and the like register no HostPlugin at all: _boots_nothing).
        s = self.session.settings
        if s.all and s.scope in ("test", "module"):
            self.session.want(self.session.default_worker_spec)

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        # Start booting while collection goes on; bad marker arguments are reported after collection.
        # Only the session's default specs are kept warm: a test with its own image, cpus, ... boots
        # its box on demand instead of evicting the boxes everyone else is waiting for.
        if item.get_closest_marker("boxlite") is None:
            # An unmarked item wants one of two specs, the same for every such item (boxed under
            # --boxlite in the default worker box, unless it leases sandboxes): each is asked for
            # once, not worked out for every item (a suite collecting 33,000 items paid 0.3 s).
            pool = bool(_BOX_FIXTURES.intersection(getattr(item, "fixturenames", ())))
            if not pool and not self.session.settings.all:
                return
            which = "pool" if pool else "worker"
            if which not in self._wanted_early:
                self._wanted_early.add(which)
                if pool:
                    self.session.want(self.session.default_spec)
                else:
                    # A spec that cannot be made is reported after collection, by plan_for.
                    with contextlib.suppress(BoxliteError):
                        self.session.want(self.session.default_worker_spec)
            return
        with contextlib.suppress(pytest.UsageError):
            plan = plan_for(item, self.session)
            if plan is not None:
                if plan.spec == self.session.default_worker_spec:
                    self.session.want(plan.spec)
                return
        if _BOX_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            self.session.want(self.session.default_spec)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        has_timeout = config.pluginmanager.hasplugin("timeout")
        warned: set[str] = set()
        boxes_needed = False
        for item in items:
            boxes_needed = boxes_needed or bool(_BOX_FIXTURES.intersection(getattr(item, "fixturenames", ())))
            plan = plan_for(item, self.session)
            if plan is None:
                continue
            boxes_needed = True
            item.stash[_PLAN_KEY] = plan
            image = plan.spec.image
            # The pool fixture warns with the same text (BoxliteSession.unused_image).
            what = f"{item.nodeid}: @pytest.mark.boxlite"
            unused = None if image in warned else self.session.unused_image(image, what)
            if unused:
                # One warning per image: the test would otherwise run on the host's distribution unawares.
                warned.add(image)
                warn_at(item, unused, "has no effect on the")
            if has_timeout:
                # pytest-timeout acts inside the box; on the host it could only kill the whole session.
                item.add_marker(pytest.mark.timeout(0), append=False)
        if boxes_needed:
            # A host where boxes cannot work at all (no user namespaces, ...) stops the session here,
            # with the fix, instead of failing every test that needs a box.
            problem = preflight(self.session.choice.kind)
            if problem:
                raise pytest.UsageError(f"pytest-boxlite: {problem}")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        plan = item.stash.get(_PLAN_KEY, None)
        if plan is None:
            return None
        return self._executor().run_protocol(item, plan, nextitem, teardown_host=self._teardown_host)

    @pytest.hookimpl(wrapper=True, specname="pytest_runtest_protocol")
    def pytest_runtest_protocol_on_host(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, Any, Any]:
        """A test run on the host runs with the user's own thread switch interval (see _switch.py)."""
        if item.stash.get(_PLAN_KEY, None) is not None:
            return (yield)
        with self.session.host_code():
            return (yield)

    # -- fixtures around boxed tests: each side tears down what pytest would, when it would -------
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
        """A test run on the host: after pytest's own teardown, the warm interpreters tear down
        the shared fixtures ``nextitem`` does not need (``item`` was the last that could use
        them), their output and errors in ``item``'s teardown report."""
        if self._in_shadow:
            return (yield)
        try:
            result = yield
        except BaseException:
            self._host_stack = _common(item.listchain(), nextitem)
            self._teardown_boxes(item, nextitem, fail=False)
            raise
        self._host_stack = _common(item.listchain(), nextitem)
        self._teardown_boxes(item, nextitem, fail=True)
        return result

    def _teardown_boxes(self, item: pytest.Item, nextitem: pytest.Item | None, *, fail: bool) -> None:
        remote = self._made()
        if remote is None:
            return  # no box ever ran a test: no warm interpreter holds any fixture
        done = remote[1].teardown_shared(item, nextitem)
        for rep in done:
            for title, content in rep.sections:
                key = title.removeprefix("Captured ").removesuffix(" teardown")
                item.add_report_section("teardown", f"{key} (shared fixtures in box)", content)
        failed = [rep for rep in done if rep.failed]
        if failed and fail:
            # The box's own words first (the short summary shows that line), then its traceback.
            crash = getattr(failed[0].longrepr, "reprcrash", None)
            head = crash.message if crash is not None else failed[0].longreprtext.strip().split("\n")[-1]
            text = "\n\n".join(rep.longreprtext for rep in failed)
            pytest.fail(f"{head} (in the box's warm interpreter)\n\n{text}", pytrace=False)

    def _teardown_host(self, item: pytest.Item, nextitem: pytest.Item | None) -> list[pytest.TestReport]:
        """After the boxed ``item``: tear down what tests run on this host set up that
        ``nextitem`` does not need, as pytest would at ``item``'s teardown (``item`` ran in a box,
        so pytest's own teardown of it never ran here).  Returns its report (output, error), if
        anything was torn down.

        pytest tears nodes down only at an item's teardown: a stand-in item under the deepest
        node set up goes through the setup and teardown hooks (it asks for no fixture and pushes
        no new collector, so nothing of ``item`` is set up on the host), with the collector that
        stays as its next item (its chain is what teardown keeps).
        """
        kept = _common(self._host_stack, nextitem)
        if len(kept) == len(self._host_stack):
            return []
        top, self._host_stack = self._host_stack[-1], kept
        shadow = pytest.Function.from_parent(top, name=_SHADOW, callobj=_noop)
        shadow.fixturenames = []
        sections: list[tuple[str, str]] = []

        def add_section(when: str, key: str, content: str) -> None:
            if content and when == "teardown":
                sections.append((f"Captured {key} {when}", content))

        shadow.add_report_section = add_section  # type: ignore[method-assign]
        stop = (KeyboardInterrupt, SystemExit)
        target: Any = kept[-1] if kept else None
        self._in_shadow = True
        try:
            pytest.CallInfo.from_call(lambda: shadow.ihook.pytest_runtest_setup(item=shadow), "setup", reraise=stop)
            call = pytest.CallInfo.from_call(
                lambda: shadow.ihook.pytest_runtest_teardown(item=shadow, nextitem=target), "teardown", reraise=stop
            )
        finally:
            self._in_shadow = False
        report = pytest.TestReport.from_item_and_call(item, call)
        report.sections = sections
        return [report]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
        report = yield
        if report.when == "call" and report.failed:
            item.stash[CALL_FAILED_KEY] = True
        return report

    def _shutdown(self) -> None:
        with self._remote_lock:
            remote = self._remote
            self._remote_closed = True
        if remote is not None:
            remote[1].close()
        self.session.shutdown()
        if remote is not None:
            runner = remote[0]
            runner.shutdown()
            runner.warm.shutdown()
            if runner.forks:
                self.session.report.stats.update(forked=runner.forks, fork_waits=list(runner.fork_waits))
        if self.remote:
            # This host has no controller: reap what crashed workers of this session left in this home.
            self.session.reap_workers()
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:
            from pytest_boxlite.xdist_support import WORKEROUTPUT_KEY, worker_output

            workeroutput[WORKEROUTPUT_KEY] = worker_output(self.session, remote=self.remote)

    def _controller_lost(self) -> None:
        """The channel to the controller closed before this worker shut down: reap its boxes now."""
        if self._shut_down:
            return  # the normal order: boxes were reaped before the worker reported
        self.session.shutdown()
        self.session.reap_workers()
