"""The runtest protocol of boxed items: which box runs a test (lease policy), and logging its reports.

:class:`BoxedExecutor` drives each step of a boxed item's run, one call each into the module that
owns it, which returns here without calling another step's module (``tests/test_item_path.py``
measures that order):

1. lease: the box (or warm interpreter) from the pool (:meth:`BoxedExecutor._lease`);
2. fork and send RUN: :class:`~.worker_host.ForkedBoxes` (``fork``, ``run_in``): a fresh fork
   of a warm interpreter, or an in-place fork of a booted box's (``--boxlite-fresh=boot``,
   ``--boxlite-keep``, a kernel that refuses fresh forks);
3. drain: :func:`.transport.drain` reads the test's messages, within every bound on them;
4. end: ``ForkedBoxes.end`` kills or reaps the box and reads how it ended and its log;
5. report: :func:`.reports.finish` makes the complete reports, which are logged here (the shared
   fixtures a warm interpreter set up are torn down at the last test that can use them).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pytest

from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.lookahead import Ahead, LookAhead, RunOrder, Step, early_runs_allowed, module_of, same_box
from pytest_boxlite.pool import Lease
from pytest_boxlite.remote import reports, transport
from pytest_boxlite.remote.transport import RefusedMessage
from pytest_boxlite.remote.worker_host import BoxRun, Ended, ForkedBox, ForkedBoxes
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
    """Runs boxed items: per test in a box forked from a warm interpreter, per test in a leased
    box, or per module in one box."""

    KEEP_PROPERTY = "boxlite_box"

    def __init__(
        self, runner: ForkedBoxes, session: BoxliteSession, plan_of: Callable[[pytest.Item], BoxPlan | None]
    ) -> None:
        self.config = runner.config
        self.runner = runner
        self.session = session
        #: The plan of an item (None: it runs on the host), as the host made it at collection.
        self._plan_of = plan_of
        #: Module scope, booted boxes: the leased box that runs the current module's tests.
        self._held: _HeldLease | None = None
        #: Warm interpreters that fresh boxes are forked from, one per spec (fork mode).
        self._warm_interpreters: dict[BoxSpec, Lease] = {}
        #: Module scope, fork mode: the forked box that runs the current module's tests.
        self._held_fork: _HeldFork | None = None
        #: The module box's next test, when its RUN was sent as soon as the test before it ended.
        self._early_run: _EarlyRun | None = None
        self._may_run_early: bool | None = None
        #: Why a box could not be had, and the first test that said so in full.
        self._lease_errors: dict[str, str] = {}
        #: Per test, each forked box inherits the fixtures wider than a function's from its warm
        #: interpreter, which sets them up once (``guest/worker.py``: ``_prepare``) and tears them
        #: down when pytest would (:meth:`teardown_shared`).  Module scope keeps one box per
        #: module: the box sets up its own, as booted boxes do.
        runner.share_fixtures = self.session.settings.scope == "test"
        #: Per warm interpreter (its box's name): what it may hold set up.
        self._shared: dict[str, _Shared] = {}
        self._planner = LookAhead(scope=self.session.settings.scope, share_fixtures=runner.share_fixtures)
        #: An xdist worker learns its next items from the controller as it goes: it knows no order.
        self._order: RunOrder[pytest.Item] = RunOrder(known=getattr(self.config, "workerinput", None) is None)

    def run_protocol(
        self,
        item: pytest.Item,
        plan: BoxPlan,
        nextitem: pytest.Item | None,
        *,
        teardown_host: Callable[[pytest.Item, pytest.Item | None], Sequence[pytest.TestReport]] | None = None,
    ) -> bool:
        """Run ``item`` in its box and log its reports, in five steps:

        1. lease: the warm interpreter to fork ``item``'s box from, or a booted box (one per
           module in module scope);
        2. look ahead: what to do for the next tests while this one runs (:mod:`..lookahead`);
        3. run: fork the box or send RUN, drain its messages, end the box, make the reports;
        4. keep or let go: the module's box stays for its next test (whose RUN may be sent now),
           a box or warm interpreter that is done goes;
        5. log the reports, ``item``'s teardown report with what was torn down after it: the
           warm interpreters' shared fixtures and the host's own (``teardown_host``, as pytest
           would at ``item``'s teardown).
        """
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        ended: Ended | None = None
        try:
            lease = self._lease(item, plan)
        except BoxliteError as exc:
            out = reports.failed_phase(item, "setup", self._lease_error(item, str(exc)), None, 0.0)
        else:
            forked = self.session.fork_boxes
            look = self._look_ahead(item, plan, nextitem, forked=forked)
            run = self._start_forked(item, plan, lease, look) if forked else self._start_booted(item, plan, lease, look)
            out, ended = self._drain_end_report(item, run, last=not look.ahead.same_box)
            if forked:
                self._keep_forked(item, plan, lease, look, ended)
            else:
                self._keep_booted(look, ended, out)
        self._log(item, nextitem, out, ended.name if ended is not None else "", teardown_host)
        if ended is not None and ended.exit is not None:
            # As locally: pytest.exit() in a test ends the session with its return code.
            pytest.exit(ended.exit[0], returncode=ended.exit[1])
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    # -- 1. lease ----------------------------------------------------------------------------
    def _lease(self, item: pytest.Item, plan: BoxPlan) -> Lease:
        """The warm interpreter to fork ``item``'s box from, or else a booted box for it."""
        if self.session.fork_boxes:
            lease = self._warm_interpreter(plan)
            if not self._fork_refused(plan, lease):
                return lease
        return self._module_lease(module_of(item.nodeid), plan)

    def _module_lease(self, module: str, plan: BoxPlan) -> Lease:
        """A booted box for a test of ``module``: the one held for it (module scope), or a new one."""
        if self._held is not None:
            if self._held.holds(module, plan.spec):
                return self._held.lease
            self._drop()
        with WaitNotice(self.config, self._waiting_for()):
            lease = self.session.pool().lease(plan.spec)
        self._held = _HeldLease(module, plan.spec, lease)
        return lease

    def _warm_interpreter(self, plan: BoxPlan) -> Lease:
        """The warm interpreter to fork ``plan``'s box from, leased once per spec."""
        lease = self._warm_interpreters.get(plan.spec)
        if lease is not None:
            return lease
        if len(self._warm_interpreters) >= self.session.settings.max_boxes:
            # Make room under the cap: the oldest warm interpreter goes.
            self._release_warm(next(iter(self._warm_interpreters)))
        pool = self.session.pool()
        # The warm interpreter is held for the session: no spare box of this spec is needed (a
        # warm or booting one is still taken by the lease below).
        pool.prewarm(plan.spec, 0)
        with WaitNotice(self.config, self._waiting_for()):
            lease = pool.lease(plan.spec)
        self._warm_interpreters[plan.spec] = lease
        return lease

    def _fork_refused(self, plan: BoxPlan, lease: Lease) -> bool:
        """Whether the warm interpreter's kernel refused the fresh box's namespaces (a VM kernel
        without user namespaces): then the session boots a box per test from now on, saying so once."""
        why = self.runner.warm.fork_problems.get(lease.handle.name)
        if why is None:
            return False
        self.session.refuse_fork(why)
        self._warm_interpreters.pop(plan.spec, None)
        self._shared.pop(lease.handle.name, None)
        lease.release()
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.ensure_newline()
            tr.write_line(f"boxlite: boxes cannot be forked per test here ({why}): each boxed test boots a box")
        return True

    def _lease_error(self, item: pytest.Item, why: str) -> str:
        """The failure text for a test that got no box: in full once, then a pointer to it.

        A failed ``--boxlite-setup`` fails every boxed test; its whole output belongs in one report.
        """
        first = self._lease_errors.setdefault(why, item.nodeid)
        if first == item.nodeid:
            return f"could not get a box: {why}"
        return f"could not get a box: {why.splitlines()[0][:300]} (the whole error is in the report of {first})"

    def _waiting_for(self) -> str:
        if self.session.settings.setup:
            return "waiting for a box (the --boxlite-setup template is built once, then cached)"
        return "waiting for a box (booting, then collecting the session in it)"

    # -- 2. look ahead -------------------------------------------------------------------------
    def _look_ahead(self, item: pytest.Item, plan: BoxPlan, nextitem: pytest.Item | None, *, forked: bool) -> _Look:
        """What the planner says to do for the next tests while ``item`` runs, with those tests."""
        next_plan = self._plan_of(nextitem) if nextitem is not None else None
        if not forked:
            # A booted box is made ahead by the pool: only whether the next test shares it matters.
            nxt = Step(nextitem.nodeid, next_plan.spec) if nextitem is not None and next_plan is not None else None
            kept = same_box(Step(item.nodeid, plan.spec), nxt, scope=self.session.settings.scope)
            return _Look(Ahead(same_box=kept), nextitem, next_plan, None)
        items = item.session.items
        module_scope = self.session.settings.scope == "module"
        first = self._order.after_module(items, item) if module_scope else None
        then = self._order.after(items, nextitem)
        ahead = self._planner.plan(
            _step(item, plan),
            self._step(nextitem),
            self._step(then),
            self._step(first),
            early_runs=module_scope and self._early_runs_allowed(),
        )
        return _Look(ahead, nextitem, next_plan, then)

    def _step(self, item: pytest.Item | None) -> Step | None:
        """``item`` as the planner sees it; None where there is no such item or it runs on the host."""
        plan = self._plan_of(item) if item is not None else None
        return _step(item, plan) if item is not None and plan is not None else None

    def _early_runs_allowed(self) -> bool:
        """Whether a module box's next test may get its RUN as soon as the test before it ended
        (worked out at the first test: the plugins around each test's run are registered by then)."""
        if self._may_run_early is None:
            opt = self.config.option
            pm = self.config.pluginmanager
            impls = self.config.hook.pytest_runtest_protocol.get_hookimpls()
            self._may_run_early = early_runs_allowed(
                maxfail=getattr(opt, "maxfail", 0),
                stepwise=getattr(opt, "stepwise", False),
                debugger=getattr(opt, "usepdb", False) or getattr(opt, "trace", False),
                keep=self.session.settings.keep,
                protocol_plugins={str(pm.get_name(impl.plugin)) for impl in impls},
            )
        return self._may_run_early

    # -- 3. run --------------------------------------------------------------------------------
    def _start_booted(self, item: pytest.Item, plan: BoxPlan, lease: Lease, look: _Look) -> BoxRun:
        """Start ``item`` in an in-place fork of the leased box's warm interpreter: the module's
        (module scope: one fork serves its tests, which keep their module's state), or a new one."""
        next_nodeid = look.nextitem.nodeid if look.ahead.same_box and look.nextitem is not None else None
        held = self._held
        box = held.box if held is not None and held.lease is lease and held.box is not None else None
        if box is not None and box.alive:
            return self.runner.run_in(box, item, next_nodeid=next_nodeid, timeout=plan.timeout)
        network = plan.spec.network
        return self.runner.fork(
            item, lease, network=network, next_nodeid=next_nodeid, timeout=plan.timeout, in_place=True
        )

    def _start_forked(self, item: pytest.Item, plan: BoxPlan, lease: Lease, look: _Look) -> BoxRun:
        """Start ``item`` in a forked box: a new one per test, or the module's (module scope),
        where its RUN may already have been sent (step 4 of the test before)."""
        if self.runner.share_fixtures:
            # What the warm interpreter may hold set up once it has forked this box.
            self._shared[lease.handle.name] = _Shared(lease, [n.nodeid for n in item.listchain()[:-1]])
        next_nodeid = look.nextitem.nodeid if look.ahead.same_box and look.nextitem is not None else None
        ahead = list(look.ahead.fork)
        held = self._held_fork
        box = held.box if held is not None and held.holds(module_of(item.nodeid), plan.spec) else None
        early, self._early_run = self._early_run, None
        if box is not None and early is not None and early.nodeid == item.nodeid:
            return early.run
        if box is not None and early is None:
            return self.runner.run_in(box, item, next_nodeid=next_nodeid, timeout=plan.timeout, ahead=ahead)
        # A module box that runs another test than this one (started for a test pytest then did
        # not run next) is closed as well: this test gets a box of its own.
        self._close_fork()
        return self.runner.fork(
            item, lease, network=plan.spec.network, next_nodeid=next_nodeid, timeout=plan.timeout, ahead=ahead
        )

    def _drain_end_report(self, item: pytest.Item, run: BoxRun, *, last: bool) -> tuple[list[pytest.TestReport], Ended]:
        """The steps of a started run after the runner's: drain its messages (if it got as far as
        a stream), end its box (``last``: a forked box is closed even where it finished), and make
        its complete reports."""
        if run.stream is not None:
            deadline = run.start + run.timeout
            run.outcome = transport.drain(run.stream, item, deadline, box=run.handle.name, seq=run.seq)
        ended = self.runner.end(run, last=last)
        return reports.finish(item, run.outcome, ended), ended

    # -- 4. keep or let go -----------------------------------------------------------------------
    def _keep_forked(self, item: pytest.Item, plan: BoxPlan, lease: Lease, look: _Look, ended: Ended) -> None:
        """The module's forked box stays for its next test (one that ended is forgotten), which
        gets its RUN now where the planner said so: the box runs it while this process logs the
        reports of the one before (the host's work and the box's then overlap).  A warm
        interpreter that died goes."""
        self._held_fork = _HeldFork(module_of(item.nodeid), plan.spec, ended.box) if ended.box is not None else None
        box, nxt, next_plan, then = ended.box, look.nextitem, look.next_plan, look.then
        early = look.ahead.early_run and ended.exit is None
        if early and box is not None and nxt is not None and next_plan is not None and then is not None:
            run = self.runner.run_in(box, nxt, next_nodeid=then.nodeid, timeout=next_plan.timeout)
            self._early_run = _EarlyRun(nxt.nodeid, run)
        if not ended.worker_alive:
            self._warm_interpreters.pop(plan.spec, None)
            self._shared.pop(lease.handle.name, None)
            lease.release()

    def _keep_booted(self, look: _Look, ended: Ended, out: Sequence[pytest.TestReport]) -> None:
        """The module's leased box stays for its next test, unless it died or the test called
        ``pytest.exit``; with ``--boxlite-keep`` a box in which any test failed outlives the run
        (a dead one cannot)."""
        held = self._held
        if held is None:
            return
        held.box = ended.box
        held.failed |= any(r.failed for r in out)
        dead = not ended.worker_alive
        if not look.ahead.same_box or dead or ended.exit is not None:
            self._drop(keep=held.failed and self.session.settings.keep and not dead)

    # -- 5. log ----------------------------------------------------------------------------------
    def _log(
        self,
        item: pytest.Item,
        nextitem: pytest.Item | None,
        out: Sequence[pytest.TestReport],
        box_name: str,
        teardown_host: Callable[[pytest.Item, pytest.Item | None], Sequence[pytest.TestReport]] | None,
    ) -> None:
        """Log ``item``'s reports; its teardown report gets what was torn down after it elsewhere."""
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
            item.ihook.pytest_runtest_logreport(report=rep)

    def teardown_shared(self, item: pytest.Item, nextitem: pytest.Item | None) -> list[pytest.TestReport]:
        """Tear down, in every warm interpreter, the shared fixtures that ``nextitem`` does not
        need (all of them when it is ``None``), as pytest does at the teardown of ``item`` (the
        last test that could use them).  Returns a teardown report of ``item`` per warm
        interpreter that tore something down (its output and errors)."""
        keep = [n.nodeid for n in nextitem.listchain()] if nextitem is not None else []
        out: list[pytest.TestReport] = []
        for name, shared in list(self._shared.items()):
            kept = [n for n in shared.chain if n in keep]
            if len(kept) == len(shared.chain):
                continue
            shared.chain = kept
            timeout = max(self.session.settings.timeout, 30.0)
            try:
                data = self.runner.teardown_shared(shared.lease.handle, keep, item.nodeid, timeout)
                rep = transport.kept_report(self.config, item, data) if data is not None else None
            except (BoxliteError, RefusedMessage) as exc:
                rep = reports.make_report(item, "teardown", "failed", f"shared fixtures' teardown: {exc}", None, 0.0)
                self._shared.pop(name, None)
                if name not in self.runner.warm.live():
                    # Its warm interpreter is gone: the next test gets a new one, not this dead box.
                    for spec, lease in list(self._warm_interpreters.items()):
                        if lease is shared.lease:
                            self._release_warm(spec)
            if rep is not None:
                out.append(rep)
        return out

    # -- letting go ------------------------------------------------------------------------------
    def _close_fork(self) -> None:
        self._early_run = None  # its box goes with it
        if self._held_fork is not None:
            box = self._held_fork.box
            self._held_fork = None
            self.runner.close(box)

    def _release_warm(self, spec: BoxSpec) -> None:
        lease = self._warm_interpreters.pop(spec)
        self._shared.pop(lease.handle.name, None)  # what it set up goes with it
        lease.release()

    def release_warm_interpreter(self, wanted: BoxSpec) -> bool:
        """Pool pressure callback: give back the oldest warm interpreter not of ``wanted``'s spec
        (and not the one of the module box in use: its tests would lose their box mid-module)."""
        in_use = self._held_fork.spec if self._held_fork is not None else None
        for spec in list(self._warm_interpreters):
            if spec != wanted and spec != in_use:
                self._release_warm(spec)
                return True
        return False

    def _drop(self, *, keep: bool | None = None) -> None:
        """Give back the module's leased box; ``keep`` (by default: a test in it failed, under
        ``--boxlite-keep``) keeps it after the run."""
        held, self._held = self._held, None
        if held is not None:
            if held.box is not None:
                self.runner.close(held.box)  # the in-place fork ends before its box is let go
            held.lease.release(keep=held.failed and self.session.settings.keep if keep is None else keep)

    def close(self) -> None:
        self._close_fork()
        self._drop()
        for lease in self._warm_interpreters.values():
            lease.release()
        self._warm_interpreters.clear()
        self._shared.clear()


@dataclasses.dataclass
class _HeldLease:
    """Module scope, booted boxes: the leased box that runs a module's tests."""

    module: str
    spec: BoxSpec
    lease: Lease
    #: A test in it failed (with ``--boxlite-keep`` the box outlives the run).
    failed: bool = False
    #: The in-place fork that runs the module's tests, open for the next one (see ``ForkedBoxes.end``).
    box: ForkedBox | None = None

    def holds(self, module: str, spec: BoxSpec) -> bool:
        return (self.module, self.spec) == (module, spec)


@dataclasses.dataclass(frozen=True)
class _HeldFork:
    """Module scope, fork mode: the forked box that runs a module's tests."""

    module: str
    spec: BoxSpec
    box: ForkedBox

    def holds(self, module: str, spec: BoxSpec) -> bool:
        return (self.module, self.spec) == (module, spec) and self.box.alive


@dataclasses.dataclass(frozen=True)
class _EarlyRun:
    """The module box's next test, whose RUN was sent as soon as the test before it ended."""

    nodeid: str
    run: BoxRun


@dataclasses.dataclass
class _Shared:
    """What a warm interpreter may hold set up: the node ids of the last forked item's
    collectors, on which its shared fixtures hang."""

    lease: Lease
    chain: list[str]


@dataclasses.dataclass(frozen=True)
class _Look:
    """Step 2's answer: the planner's, with the tests it is about."""

    ahead: Ahead
    nextitem: pytest.Item | None
    next_plan: BoxPlan | None
    #: The test after ``nextitem``, where the run order is known (fork mode only).
    then: pytest.Item | None


def _step(item: pytest.Item, plan: BoxPlan) -> Step:
    return Step(item.nodeid, plan.spec, item.parent, frozenset(getattr(item, "fixturenames", ())), wide_params(item))


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
