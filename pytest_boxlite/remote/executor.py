"""The runtest protocol of boxed items: which box runs a test (lease policy), and logging its reports.

:class:`BoxedExecutor` drives each step of a boxed item's run, one call each into the module that
owns it, which returns here without calling another step's module (``tests/test_item_path.py``
measures that order):

1. lease: the box (or fork parent) from the pool (:meth:`BoxedExecutor._lease`, ``_fork_parent``);
2. fork and send RUN: :class:`~.worker_host.RemoteRunner` (``fork``, ``run_in``, ``run_item``);
3. drain: :func:`.transport.drain` reads the test's messages, within every bound on them;
4. end: ``RemoteRunner.end`` kills or reaps the box and reads how it ended and its log;
5. report: :func:`.reports.finish` makes the complete reports, which are logged here (the shared
   fixtures a warm interpreter set up are torn down at the last test that can use them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pytest

from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.pool import Lease
from pytest_boxlite.remote import reports, transport
from pytest_boxlite.remote.transport import BoxSpoke
from pytest_boxlite.remote.worker_host import BoxRun, Ended, ForkedBox, RemoteRunner
from pytest_boxlite.spec import BoxSpec

if TYPE_CHECKING:
    from pytest_boxlite.markers import BoxPlan
    from pytest_boxlite.session import BoxliteSession


class WaitNotice:
    """Says through pytest's terminal reporter that the session is waiting for boxes.

    Nothing for waits under :attr:`AFTER` seconds or under ``-qq``; on a terminal one line that
    updates every second, elsewhere one line when the wait starts to show and one when it ends.
    """

    AFTER = 2.0

    def __init__(self, config: pytest.Config, what: str) -> None:
        tr = config.pluginmanager.get_plugin("terminalreporter")
        self.tr: Any = tr if tr is not None and config.option.verbose > -2 else None
        self.what = what
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.monotonic()
        self._shown = False

    def __enter__(self) -> WaitNotice:
        if self.tr is not None:
            self._thread = threading.Thread(target=self._run, name="boxlite-wait-notice", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        if self._done.wait(self.AFTER):
            return
        self._shown = True
        self.tr.ensure_newline()
        if not getattr(self.tr, "isatty", False):
            self.tr.write_line(f"boxlite: {self.what}...")
            return
        while not self._done.wait(1.0):
            self.tr.rewrite(f"boxlite: {self.what}... {time.monotonic() - self._start:.0f}s")

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self._shown:
            line = f"boxlite: {self.what}: done after {time.monotonic() - self._start:.1f}s"
            if getattr(self.tr, "isatty", False):
                self.tr.rewrite(line, erase=True)
                self.tr.write("\n")
            else:
                self.tr.write_line(line)


class BoxedExecutor:
    """Runs boxed items: per test in a box forked from a warm interpreter (its "fork parent"),
    per test in a leased box, or per module in one box."""

    KEEP_PROPERTY = "boxlite_box"

    def __init__(self, runner: RemoteRunner, session: BoxliteSession) -> None:
        self.config = runner.config
        self.runner = runner
        self.session = session
        self._held: tuple[str, BoxSpec, Lease] | None = None  # module scope: (module path, spec, lease)
        self._held_failed = False
        #: Warm interpreters that fresh boxes are forked from, one per spec (fork mode).
        self._fork_parents: dict[BoxSpec, Lease] = {}
        #: The forked box that runs the current module's tests (module scope, fork mode).
        self._held_fork: tuple[str, BoxSpec, ForkedBox] | None = None
        #: The module box's next test, when its RUN was sent as soon as the test before it ended
        #: (see ``_start_ahead``): its node id and its run.
        self._started_ahead: tuple[str, BoxRun] | None = None
        self._may_start_ahead: bool | None = None
        #: Why a box could not be had, and the first test that said so in full.
        self._lease_errors: dict[str, str] = {}
        #: Per test, each forked box inherits the fixtures wider than a function's from its warm
        #: interpreter, which sets them up once (``guest/worker.py``: ``_prepare``) and tears them
        #: down when pytest would (:meth:`teardown_shared`).  Module scope keeps one box per
        #: module: the box sets up its own, as booted boxes do.
        runner.share_fixtures = self.session.settings.scope == "test"
        #: Per fork parent (its box's name): its lease, and the node ids on which its warm
        #: interpreter may hold fixtures set up (the last forked item's collectors).
        self._shared: dict[str, tuple[Lease, list[str]]] = {}
        #: The collector of the last test forked per spec, the fixture names the tests forked
        #: under it asked for, and the parameter each wider fixture had last (see ``_ahead_ok``).
        self._group: dict[BoxSpec, tuple[Any, set[str], dict[str, Any]]] = {}

    def run_protocol(
        self,
        item: pytest.Item,
        plan: BoxPlan,
        nextitem: pytest.Item | None,
        next_plan: BoxPlan | None,
        *,
        then: tuple[pytest.Item, BoxPlan | None] | None = None,
        next_module: tuple[pytest.Item, BoxPlan | None] | None = None,
        teardown_host: Callable[[pytest.Item, pytest.Item | None], Sequence[pytest.TestReport]] | None = None,
    ) -> bool:
        """Run ``item`` in its box and log its reports.  ``then``: the item after ``nextitem`` and
        its plan, where the run order is known (its box can be made ahead too).  ``next_module``:
        in module scope, where the order is known, the first item after ``item``'s module and its
        plan (its module's box is made while this module's tests run).
        ``teardown_host``: what the host tears down of its own after ``item`` (fixtures that tests
        run on the host set up), as pytest would at ``item``'s teardown: its reports' outcome and
        output join ``item``'s teardown report, with those of warm interpreters' shared fixtures."""
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        module = _module_of(item)
        shared = (
            self.session.settings.scope == "module"
            and nextitem is not None
            and next_plan is not None
            and next_plan.spec == plan.spec
            and _module_of(nextitem) == module
        )
        out: list[pytest.TestReport]
        exit_with: tuple[str, int] | None = None
        lease: Lease | None = None
        box_name = ""
        try:
            if self.session.fork_boxes:
                lease = self._fork_parent(plan)
                if self._fork_refused(plan, lease):
                    lease = self._lease(module, plan)
            else:
                lease = self._lease(module, plan)
        except BoxliteError as exc:
            out = reports.failed_phase(item, "setup", self._lease_error(item, str(exc)), None, 0.0)
        else:
            box_name = lease.handle.name
        if lease is not None and self.session.fork_boxes:
            # The next tests' boxes are forked while this one runs, when they come from the same
            # warm interpreter and this box will not run them (module scope keeps one box per
            # module, so there only the next module's first test gets one).
            ahead: list[str] = []
            names, params = self._group_of(item, plan.spec)
            same = nextitem is not None and next_plan is not None and next_plan.spec == plan.spec
            first, first_plan = next_module if next_module is not None else (None, None)
            if shared and first is not None and first_plan is not None:
                # Module scope: the next module's box is forked while this module runs, not only
                # during its last test (a box takes longer to make than most tests take to run:
                # click's suite waited 21 ms at each of its 42 module changes).
                if first_plan.spec == plan.spec and self._ahead_ok(item, first, names, params):
                    ahead.append(first.nodeid)
            elif same and not shared and nextitem is not None and self._ahead_ok(item, nextitem, names, params):
                ahead.append(nextitem.nodeid)
                later, later_plan = then if then is not None else (None, None)
                per_test = self.session.settings.scope == "test"
                names_then = names | set(getattr(nextitem, "fixturenames", ()))
                params_then = {**params, **wide_params(nextitem)}
                if (
                    per_test
                    and later is not None
                    and later_plan is not None
                    and later_plan.spec == plan.spec
                    and self._ahead_ok(nextitem, later, names_then, params_then)
                ):
                    ahead.append(later.nodeid)
            if self.runner.share_fixtures:
                self._shared[lease.handle.name] = (lease, [n.nodeid for n in item.listchain()[:-1]])
            after = (nextitem, next_plan, then) if shared and nextitem is not None else None
            out, ended = self._run_forked(item, lease, plan, module, after, ahead)
            box_name, exit_with = ended.name, ended.exit
            if not ended.worker_alive:
                self._fork_parents.pop(plan.spec, None)
                self._shared.pop(lease.handle.name, None)
                lease.release()
        elif lease is not None:
            next_nodeid = nextitem.nodeid if shared and nextitem else None
            run = self.runner.run_item(item, lease, next_nodeid=next_nodeid, timeout=plan.timeout)
            out, ended = self._drain_end_report(item, run, last=True)
            exit_with = ended.exit
            self._held_failed |= any(r.failed for r in out)
            dead = not ended.worker_alive
            if not shared or dead or exit_with is not None:
                # With --boxlite-keep, a box in which any test failed outlives the run (a dead one cannot).
                self._drop(keep=self._held_failed and self.session.settings.keep and not dead)
        for rep in out:
            if rep.when == "teardown":
                # As runtestprotocol: a session about to stop (-x) tears everything down now.
                stopping = item.session.shouldfail or item.session.shouldstop
                target = None if stopping else nextitem
                extra = list(self.teardown_shared(item, target))
                if teardown_host is not None:
                    extra += teardown_host(item, target)
                merge_teardown(rep, extra)
                if box_name:
                    rep.user_properties.append((self.KEEP_PROPERTY, box_name))
            ihook.pytest_runtest_logreport(report=rep)
        if exit_with is not None:
            # As locally: pytest.exit() in a test ends the session with its return code.
            pytest.exit(exit_with[0], returncode=exit_with[1])
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _group_of(self, item: pytest.Item, spec: BoxSpec) -> tuple[set[str], dict[str, Any]]:
        """The fixture names asked for by the tests forked from ``spec``'s warm interpreter since
        its tests last changed collector, ``item``'s included, and the parameter each of their
        wider fixtures has there now (``item``'s, or the last test's that had one)."""
        parent, names, params = self._group.get(spec, (None, set(), {}))
        if parent is not item.parent:
            names, params = set(), {}
        names |= set(getattr(item, "fixturenames", ()))
        params.update(wide_params(item))
        self._group[spec] = (item.parent, names, params)
        return names, params

    def _ahead_ok(self, item: pytest.Item, nxt: pytest.Item, names: set[str], params: dict[str, Any]) -> bool:
        """Whether ``nxt``'s box may be forked while ``item`` runs.  With shared fixtures its warm
        interpreter sets up ``nxt``'s wider fixtures first: only when that changes nothing a
        running test could see, as far as the host can tell (the same collector, no fixture that
        no earlier test under it asked for, and each wider fixture with the parameter it has now:
        another one is torn down first, and with it what the running test may use, such as its
        files in the warm interpreter's /tmp, which a box sees through)."""
        if not self.runner.share_fixtures:
            return True
        if nxt.parent is not item.parent or not set(getattr(nxt, "fixturenames", ())) <= names:
            return False
        return all(name in params and params[name] == index for name, index in wide_params(nxt).items())

    def teardown_shared(self, item: pytest.Item, nextitem: pytest.Item | None) -> list[pytest.TestReport]:
        """Tear down, in every warm interpreter, the shared fixtures that ``nextitem`` does not
        need (all of them when it is ``None``), as pytest does at the teardown of ``item`` (the
        last test that could use them).  Returns a teardown report of ``item`` per warm
        interpreter that tore something down (its output and errors)."""
        keep = [n.nodeid for n in nextitem.listchain()] if nextitem is not None else []
        out: list[pytest.TestReport] = []
        for name, (lease, chain) in list(self._shared.items()):
            kept = [n for n in chain if n in keep]
            if len(kept) == len(chain):
                continue
            self._shared[name] = (lease, kept)
            timeout = max(self.session.settings.timeout, 30.0)
            try:
                data = self.runner.teardown_shared(lease.handle, keep, item.nodeid, timeout)
                rep = transport.kept_report(self.config, item, data) if data is not None else None
            except (BoxliteError, BoxSpoke) as exc:
                rep = reports.make_report(item, "teardown", "failed", f"shared fixtures' teardown: {exc}", None, 0.0)
                self._shared.pop(name, None)
                if name not in self.runner.live_workers():
                    # Its warm interpreter is gone: the next test gets a new one, not this dead box.
                    for spec, parent in list(self._fork_parents.items()):
                        if parent is lease:
                            self._release_parent(spec)
            if rep is not None:
                out.append(rep)
        return out

    def _run_forked(
        self,
        item: pytest.Item,
        lease: Lease,
        plan: BoxPlan,
        module: str,
        after: tuple[pytest.Item, BoxPlan | None, tuple[pytest.Item, BoxPlan | None] | None] | None,
        ahead: list[str],
    ) -> tuple[list[pytest.TestReport], Ended]:
        """Run ``item`` in a forked box: a new one per test, or the module's (module scope).

        ``after`` is the next item, its plan and what follows it (``run_protocol``'s ``then``)
        when the next item shares this box (module scope, same module and spec); ``ahead`` the
        node ids of the next tests that need new boxes of the same warm interpreter.
        """
        nextitem = after[0] if after is not None else None
        next_nodeid = nextitem.nodeid if nextitem is not None else None
        held = self._held_fork
        box = held[2] if held is not None and (held[0], held[1]) == (module, plan.spec) and held[2].alive else None
        started, self._started_ahead = self._started_ahead, None
        if box is not None and started is not None and started[0] == item.nodeid:
            run = started[1]
        elif box is not None and started is None:
            run = self.runner.run_in(box, item, next_nodeid=next_nodeid, timeout=plan.timeout, ahead=ahead)
        else:
            # A module box that runs another test than this one (started for a test pytest then
            # did not run next) is closed as well: this test gets a box of its own.
            self._close_fork()
            run = self.runner.fork(
                item, lease, network=plan.spec.network, next_nodeid=next_nodeid, timeout=plan.timeout, ahead=ahead
            )
        out, ended = self._drain_end_report(item, run, last=nextitem is None)
        # The module's box stays for its next test; one that ended (or is done) is forgotten.
        self._held_fork = (module, plan.spec, ended.box) if ended.box is not None else None
        if after is not None and ended.box is not None and ended.exit is None:
            self._start_ahead(ended.box, module, plan.spec, *after)
        return out, ended

    def _start_ahead(
        self,
        box: ForkedBox,
        module: str,
        spec: BoxSpec,
        nextitem: pytest.Item,
        next_plan: BoxPlan | None,
        then: tuple[pytest.Item, BoxPlan | None] | None,
    ) -> None:
        """Send the module box's next test its RUN now, as soon as the test before it has ended,
        so that the box runs it while this process logs the reports of the one before (the host's
        work and the box's then overlap instead of taking turns).

        Only where nothing this process does with those reports can decide that the next test
        does not run, or runs elsewhere: no ``-x``/``--maxfail``, ``--stepwise``, debugger or
        ``--boxlite-keep`` (a kept box must hold what its failed test left), and no plugin of its
        own around each test's run (one that runs a test again, as pytest-rerunfailures does).
        The module's last test is started in its turn (its RUN also forks the next box ahead).
        """
        later, later_plan = then if then is not None else (None, None)
        if (
            next_plan is None
            or later is None
            or later_plan is None
            or later_plan.spec != spec
            or _module_of(later) != module
            or not self._ahead_allowed()
        ):
            return
        run = self.runner.run_in(box, nextitem, next_nodeid=later.nodeid, timeout=next_plan.timeout)
        self._started_ahead = (nextitem.nodeid, run)

    #: Plugins whose ``pytest_runtest_protocol`` runs each test once, as it is: pytest's own, this
    #: plugin's and pytest-timeout's.
    _PROTOCOL_PLUGINS = frozenset(
        ("runner", "boxlite-host", "faulthandler", "unittest", "timeout", "assertion", "warnings", "logging-plugin")
    )

    def _ahead_allowed(self) -> bool:
        if self._may_start_ahead is None:
            opt = self.config.option
            pm = self.config.pluginmanager
            impls = {pm.get_name(impl.plugin) for impl in self.config.hook.pytest_runtest_protocol.get_hookimpls()}
            self._may_start_ahead = not (
                getattr(opt, "maxfail", 0)
                or getattr(opt, "stepwise", False)
                or getattr(opt, "usepdb", False)
                or getattr(opt, "trace", False)
                or self.session.settings.keep
                or not impls <= self._PROTOCOL_PLUGINS
            )
        return self._may_start_ahead

    def _drain_end_report(self, item: pytest.Item, run: BoxRun, *, last: bool) -> tuple[list[pytest.TestReport], Ended]:
        """The steps of a started run after the runner's: drain its messages (if it got as far as
        a stream), end its box (``last``: a forked box is closed even where it finished), and make
        its complete reports."""
        if run.stream is not None:
            deadline = run.start + run.timeout
            run.outcome = transport.drain(run.stream, item, deadline, box=run.handle.name, seq=run.seq)
        ended = self.runner.end(run, last=last)
        return reports.finish(item, run.outcome, ended), ended

    def _close_fork(self) -> None:
        self._started_ahead = None  # its box goes with it
        if self._held_fork is not None:
            box = self._held_fork[2]
            self._held_fork = None
            self.runner.close(box)

    def _lease_error(self, item: pytest.Item, why: str) -> str:
        """The failure text for a test that got no box: in full once, then a pointer to it.

        A failed ``--boxlite-setup`` fails every boxed test; its whole output belongs in one report.
        """
        first = self._lease_errors.setdefault(why, item.nodeid)
        if first == item.nodeid:
            return f"could not get a box: {why}"
        return f"could not get a box: {why.splitlines()[0][:300]} (the whole error is in the report of {first})"

    def _lease(self, module: str, plan: BoxPlan) -> Lease:
        if self._held is not None:
            held_module, held_spec, lease = self._held
            if held_module == module and held_spec == plan.spec:
                return lease
            self._drop(keep=self._held_failed and self.session.settings.keep)
        with WaitNotice(self.config, self._waiting_for()):
            lease = self.session.pool().lease(plan.spec)
        self._held = (module, plan.spec, lease)
        return lease

    def _fork_parent(self, plan: BoxPlan) -> Lease:
        """The warm interpreter to fork ``plan``'s box from, leased once per spec."""
        lease = self._fork_parents.get(plan.spec)
        if lease is not None:
            return lease
        if len(self._fork_parents) >= self.session.settings.replicas:
            # Make room under the cap: the oldest fork parent goes.
            self._release_parent(next(iter(self._fork_parents)))
        pool = self.session.pool()
        # The fork parent is held for the session: no spare box of this spec is needed (a warm or
        # booting one is still taken by the lease below).
        pool.prewarm(plan.spec, 0)
        with WaitNotice(self.config, self._waiting_for()):
            lease = pool.lease(plan.spec)
        self._fork_parents[plan.spec] = lease
        return lease

    def _fork_refused(self, plan: BoxPlan, lease: Lease) -> bool:
        """Whether the fork parent's kernel refused the fresh box's namespaces (a VM kernel without
        user namespaces): then the session boots a box per test from now on, saying so once."""
        why = self.runner.fork_problems.get(lease.handle.name)
        if why is None:
            return False
        self.session.refuse_fork(why)
        self._fork_parents.pop(plan.spec, None)
        self._shared.pop(lease.handle.name, None)
        lease.release()
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.ensure_newline()
            tr.write_line(f"boxlite: boxes cannot be forked per test here ({why}): each boxed test boots a box")
        return True

    def _waiting_for(self) -> str:
        if self.session.settings.setup:
            return "waiting for a box (the --boxlite-setup template is built once, then cached)"
        return "waiting for a box (booting, then collecting the session in it)"

    def _release_parent(self, spec: BoxSpec) -> None:
        lease = self._fork_parents.pop(spec)
        self._shared.pop(lease.handle.name, None)  # what its warm interpreter set up goes with it
        lease.release()

    def release_template(self, wanted: BoxSpec) -> bool:
        """Pool pressure callback: give back the oldest fork parent not of ``wanted``'s spec (and not
        the parent of the module box in use: its tests would lose their box mid-module)."""
        in_use = self._held_fork[1] if self._held_fork is not None else None
        for spec in list(self._fork_parents):
            if spec != wanted and spec != in_use:
                self._release_parent(spec)
                return True
        return False

    def _drop(self, *, keep: bool) -> None:
        if self._held is not None:
            _, _, lease = self._held
            self._held = None
            self._held_failed = False
            lease.release(keep=keep)

    def close(self) -> None:
        self._close_fork()
        self._drop(keep=self._held_failed and self.session.settings.keep)
        for lease in self._fork_parents.values():
            lease.release()
        self._fork_parents.clear()
        self._shared.clear()


def _module_of(item: pytest.Item) -> str:
    """The node id of ``item``'s file (what a module's box is kept for)."""
    return item.nodeid.split("::", 1)[0]


def wide_params(item: pytest.Item) -> dict[str, Any]:
    """The parameter (its index) of each of ``item``'s fixtures wider than a function's that is
    parametrized for it, directly or indirectly.  Reads what pytest 8.0 to 9 have and no public
    API offers: ``Function._fixtureinfo.name2fixturedefs`` (the last definition of a name is the
    one used), ``FixtureDef.scope`` and ``CallSpec2.indices`` (as guest/worker.py does)."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", None)
    indices = getattr(getattr(item, "callspec", None), "indices", None)
    if not isinstance(defs, dict) or not isinstance(indices, dict):
        return {}
    return {
        name: index
        for name, index in indices.items()
        if defs.get(name) and getattr(defs[name][-1], "scope", "function") != "function"
    }


def merge_teardown(report: pytest.TestReport, extra: Sequence[pytest.TestReport]) -> None:
    """Add to a boxed test's teardown report what was torn down after it elsewhere (a warm
    interpreter's shared fixtures, the host's own): their output, and their errors, as one
    teardown that failed anywhere fails."""
    for rep in extra:
        report.sections.extend(rep.sections)
        if not rep.failed:
            continue
        if report.failed:
            report.longrepr = f"{report.longreprtext}\n\n{rep.longreprtext}"
        else:
            report.outcome = "failed"
            report.longrepr = rep.longrepr
