"""The runtest protocol of boxed items: which box runs a test (lease policy), and logging its reports."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import pytest

from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.pool import Lease
from pytest_boxlite.remote import reports
from pytest_boxlite.remote.worker_host import ForkedBox, RemoteRunner
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
        #: Why a box could not be had, and the first test that said so in full.
        self._lease_errors: dict[str, str] = {}

    def run_protocol(
        self,
        item: pytest.Item,
        plan: BoxPlan,
        nextitem: pytest.Item | None,
        next_plan: BoxPlan | None,
        *,
        then: tuple[pytest.Item, BoxPlan | None] | None = None,
    ) -> bool:
        """Run ``item`` in its box and log its reports.  ``then``: the item after ``nextitem`` and
        its plan, where the run order is known (its box can be made ahead too)."""
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        module = item.nodeid.split("::", 1)[0]
        shared = (
            self.session.settings.scope == "module"
            and nextitem is not None
            and next_plan is not None
            and next_plan.spec == plan.spec
            and nextitem.nodeid.split("::", 1)[0] == module
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
            if nextitem is not None and next_plan is not None and next_plan.spec == plan.spec and not shared:
                ahead.append(nextitem.nodeid)
                later, later_plan = then if then is not None else (None, None)
                per_test = self.session.settings.scope == "test"
                if per_test and later is not None and later_plan is not None and later_plan.spec == plan.spec:
                    ahead.append(later.nodeid)
            out, box_name, exit_with = self._run_forked(item, lease, plan, module, nextitem if shared else None, ahead)
            if lease.handle.name not in self.runner.live_workers():
                self._fork_parents.pop(plan.spec, None)
                lease.release()
        elif lease is not None:
            next_nodeid = nextitem.nodeid if shared and nextitem else None
            out, exit_with = self.runner.run_item(item, lease, next_nodeid=next_nodeid, timeout=plan.timeout)
            self._held_failed |= any(r.failed for r in out)
            dead = lease.handle.name not in self.runner.live_workers()
            if not shared or dead or exit_with is not None:
                # With --boxlite-keep, a box in which any test failed outlives the run (a dead one cannot).
                self._drop(keep=self._held_failed and self.session.settings.keep and not dead)
        for rep in out:
            if rep.when == "teardown" and box_name:
                rep.user_properties.append((self.KEEP_PROPERTY, box_name))
            ihook.pytest_runtest_logreport(report=rep)
        if exit_with is not None:
            # As locally: pytest.exit() in a test ends the session with its return code.
            pytest.exit(exit_with[0], returncode=exit_with[1])
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _run_forked(
        self,
        item: pytest.Item,
        lease: Lease,
        plan: BoxPlan,
        module: str,
        nextitem: pytest.Item | None,
        ahead: list[str],
    ) -> tuple[list[pytest.TestReport], str, tuple[str, int] | None]:
        """Run ``item`` in a forked box: a new one per test, or the module's (module scope).

        ``nextitem`` is the next item when it shares this box (module scope, same module and spec);
        ``ahead`` the node ids of the next tests that need new boxes of the same warm interpreter.
        """
        next_nodeid = nextitem.nodeid if nextitem is not None else None
        held = self._held_fork
        if held is not None and (held[0], held[1]) == (module, plan.spec) and held[2].alive:
            box = held[2]
            out, exit_with = self.runner.run_in(box, item, next_nodeid=next_nodeid, timeout=plan.timeout, ahead=ahead)
        else:
            self._close_fork()
            forked, out, exit_with = self.runner.fork(
                item, lease, network=plan.spec.network, next_nodeid=next_nodeid, timeout=plan.timeout, ahead=ahead
            )
            name = forked.name if forked is not None else f"{lease.handle.name}.{self.runner.forks}"
            if forked is None:
                return out, name, exit_with
            box = forked
            self._held_fork = (module, plan.spec, box)
        if nextitem is None or exit_with is not None or not box.alive:
            self._close_fork()
        return out, box.name, exit_with

    def _close_fork(self) -> None:
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
            oldest = next(iter(self._fork_parents))
            self._fork_parents.pop(oldest).release()
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

    def release_template(self, wanted: BoxSpec) -> bool:
        """Pool pressure callback: give back the oldest fork parent not of ``wanted``'s spec (and not
        the parent of the module box in use: its tests would lose their box mid-module)."""
        in_use = self._held_fork[1] if self._held_fork is not None else None
        for spec in list(self._fork_parents):
            if spec != wanted and spec != in_use:
                self._fork_parents.pop(spec).release()
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
