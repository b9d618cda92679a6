"""The look-ahead planner (``pytest_boxlite/lookahead.py``): what to fork ahead, when a module
box's next RUN may be sent, and the run order it reads.  Pure: no box, no pytest item; tests are
described as ``Step``s and the run order as plain objects with a node id."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pytest_boxlite.lookahead import (
    PROTOCOL_PLUGINS,
    Ahead,
    LookAhead,
    RunOrder,
    Step,
    early_runs_allowed,
    same_box,
)
from pytest_boxlite.spec import BoxSpec

SPEC = BoxSpec()
OTHER = BoxSpec(env=(("UNIT_SPEC", "other"),))
CLASS_A, CLASS_B = object(), object()  # collectors, compared by identity


def step(
    nodeid: str, spec: BoxSpec = SPEC, parent: object = CLASS_A, fixtures: tuple[str, ...] = (), **wide: Any
) -> Step:
    return Step(nodeid, spec, parent, frozenset(fixtures), wide)


# -- same box --------------------------------------------------------------------------------------


def test_module_scope_keeps_the_box_for_the_next_test_of_the_same_module_and_spec() -> None:
    a1, a2 = step("a.py::t1"), step("a.py::t2")
    assert same_box(a1, a2, scope="module")
    assert not same_box(a1, a2, scope="test")
    assert not same_box(a1, step("b.py::t1"), scope="module")
    assert not same_box(a1, step("a.py::t2", OTHER), scope="module")
    assert not same_box(a1, None, scope="module")


# -- fork ahead, test scope ------------------------------------------------------------------------


def test_test_scope_forks_the_next_two_tests_of_the_same_warm_interpreter() -> None:
    planner = LookAhead(scope="test", share_fixtures=True)
    t1, t2, t3 = step("a.py::t1", fixtures=("f",)), step("a.py::t2", fixtures=("f",)), step("a.py::t3")
    assert planner.plan(t1, t2, t3) == Ahead(fork=("a.py::t2", "a.py::t3"))


def test_no_next_test_or_another_spec_forks_nothing() -> None:
    planner = LookAhead(scope="test", share_fixtures=True)
    assert planner.plan(step("a.py::t1"), None) == Ahead()
    assert planner.plan(step("a.py::t1"), step("a.py::t2", OTHER), step("a.py::t3")) == Ahead()


def test_the_test_after_next_needs_the_same_spec() -> None:
    planner = LookAhead(scope="test", share_fixtures=True)
    ahead = planner.plan(step("a.py::t1"), step("a.py::t2"), step("a.py::t3", OTHER))
    assert ahead.fork == ("a.py::t2",)


def test_a_fixture_no_earlier_test_asked_for_is_not_set_up_under_a_running_test() -> None:
    # With shared fixtures the warm interpreter sets up the next box's fixtures before forking it.
    planner = LookAhead(scope="test", share_fixtures=True)
    assert planner.plan(step("a.py::t1"), step("a.py::t2", fixtures=("db",))).fork == ()
    # Once a test under that collector asked for it, the next ones may be forked ahead.
    assert planner.plan(step("a.py::t2", fixtures=("db",)), step("a.py::t3", fixtures=("db",))).fork == ("a.py::t3",)
    # The test after next may use what the next one asks for.
    ahead = planner.plan(step("a.py::t3"), step("a.py::t4", fixtures=("web",)), step("a.py::t5", fixtures=("web",)))
    assert ahead.fork == ()
    ahead = planner.plan(step("a.py::t4", fixtures=("db",)), step("a.py::t5", fixtures=("web",)), step("a.py::t6"))
    assert ahead.fork == ()


def test_what_the_tests_asked_for_is_forgotten_when_the_collector_changes() -> None:
    planner = LookAhead(scope="test", share_fixtures=True)
    planner.plan(step("a.py::A::t1", fixtures=("db",)), None)
    nxt = step("a.py::B::t1", parent=CLASS_B, fixtures=("db",))
    # Another collector: never ahead (its fixtures are set up as the one before's go).
    assert planner.plan(step("a.py::A::t2"), nxt).fork == ()
    # Under the new collector, "db" was not asked for yet.
    first_b = step("a.py::B::t1", parent=CLASS_B)
    assert planner.plan(first_b, step("a.py::B::t2", parent=CLASS_B, fixtures=("db",))).fork == ()


def test_a_wider_fixture_with_another_parameter_is_not_forked_ahead() -> None:
    # Its other parameter tears the current one down first, under the running test.
    planner = LookAhead(scope="test", share_fixtures=True)
    t1 = step("a.py::t[0]", fixtures=("param",), param=0)
    assert planner.plan(t1, step("a.py::t[1]", fixtures=("param",), param=1)).fork == ()
    same = step("a.py::u[0]", fixtures=("param",), param=0)
    assert planner.plan(t1, same).fork == ("a.py::u[0]",)
    # A parameter none of the tests so far had.
    assert planner.plan(step("a.py::v"), step("a.py::w", other=2)).fork == ()


def test_without_shared_fixtures_any_next_test_of_the_spec_is_forked_ahead() -> None:
    planner = LookAhead(scope="test", share_fixtures=False)
    ahead = planner.plan(step("a.py::t1"), step("b.py::t1", parent=CLASS_B, fixtures=("db",), p=1), step("c.py::t"))
    assert ahead.fork == ("b.py::t1", "c.py::t")


# -- module scope ----------------------------------------------------------------------------------


def test_module_scope_forks_the_next_modules_box_while_this_module_runs() -> None:
    planner = LookAhead(scope="module", share_fixtures=False)
    a1, a2, a3, b1 = step("a.py::t1"), step("a.py::t2"), step("a.py::t3"), step("b.py::t1")
    assert planner.plan(a1, a2, a3, b1) == Ahead(same_box=True, fork=("b.py::t1",))
    assert planner.plan(a1, a2, a3, step("b.py::t1", OTHER)) == Ahead(same_box=True)
    assert planner.plan(a1, a2, a3, None) == Ahead(same_box=True)


def test_module_scope_forks_a_next_module_test_but_never_the_one_after() -> None:
    planner = LookAhead(scope="module", share_fixtures=False)
    ahead = planner.plan(step("a.py::t9"), step("b.py::t1"), step("b.py::t2"), step("b.py::t1"))
    assert ahead == Ahead(fork=("b.py::t1",))


def test_the_next_run_starts_early_only_in_the_module_box_and_where_allowed() -> None:
    planner = LookAhead(scope="module", share_fixtures=False)
    a1, a2, a3 = step("a.py::t1"), step("a.py::t2"), step("a.py::t3")
    assert planner.plan(a1, a2, a3, early_runs=True).early_run
    assert not planner.plan(a1, a2, a3, early_runs=False).early_run
    # The module's last test is started in its turn (its RUN forks the next module's box).
    assert not planner.plan(a1, a2, step("b.py::t1"), early_runs=True).early_run
    assert not planner.plan(a1, a2, step("a.py::t3", OTHER), early_runs=True).early_run
    assert not planner.plan(a1, a2, None, early_runs=True).early_run
    assert not planner.plan(a1, step("b.py::t1"), step("b.py::t2"), early_runs=True).early_run


@pytest.mark.parametrize(
    "blocker",
    [{"maxfail": 1}, {"stepwise": True}, {"debugger": True}, {"keep": True}, {"protocol_plugins": {"rerunfailures"}}],
)
def test_early_runs_are_refused_where_a_tests_reports_can_change_what_runs_next(blocker: dict[str, Any]) -> None:
    plain: dict[str, Any] = {
        "maxfail": 0,
        "stepwise": False,
        "debugger": False,
        "keep": False,
        "protocol_plugins": {"runner", "boxlite-host"},
    }
    assert early_runs_allowed(**plain)
    plugins = set(plain["protocol_plugins"]) | set(blocker.get("protocol_plugins", ()))
    assert not early_runs_allowed(**{**plain, **blocker, "protocol_plugins": plugins})


def test_pytests_own_protocol_plugins_allow_early_runs() -> None:
    assert early_runs_allowed(maxfail=0, stepwise=False, debugger=False, keep=False, protocol_plugins=PROTOCOL_PLUGINS)


# -- the run order ---------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Node:
    nodeid: str


class Counted(list[Node]):
    """The session's items, counting the reads of an item (the work the run order does)."""

    reads = 0

    def __getitem__(self, at: Any) -> Any:
        self.reads += 1
        return super().__getitem__(at)


def items(*nodeids: str) -> Counted:
    return Counted(Node(n) for n in nodeids)


def test_after_names_the_item_after_the_next_one() -> None:
    run = items("a.py::t1", "a.py::t2", "b.py::t1")
    order: RunOrder[Node] = RunOrder()
    assert order.after(run, run[0]) is run[1]
    assert order.after(run, run[2]) is None
    assert order.after(run, None) is None


def test_an_unknown_order_names_nothing() -> None:
    run = items("a.py::t1", "a.py::t2")
    order: RunOrder[Node] = RunOrder(known=False)
    assert order.after(run, run[0]) is None
    assert order.after_module(run, run[0]) is None


def test_an_item_that_is_not_the_sessions_stops_all_guessing() -> None:
    run = items("a.py::t1", "a.py::t2", "a.py::t3")
    order: RunOrder[Node] = RunOrder()
    assert order.after(run, Node("a.py::t2")) is None
    assert not order.known
    assert order.after(run, run[0]) is None


def test_a_changed_item_list_is_indexed_again() -> None:
    run = items("a.py::t1", "a.py::t2", "a.py::t3")
    order: RunOrder[Node] = RunOrder()
    assert order.after(run, run[0]) is run[1]
    run.insert(1, Node("a.py::new"))
    assert order.after(run, run[0]).nodeid == "a.py::new"  # type: ignore[union-attr]
    del run[2:]
    assert order.after(run, run[0]).nodeid == "a.py::new"  # type: ignore[union-attr]


def test_after_module_walks_each_module_once() -> None:
    n = 400
    run = items(*(f"a.py::t{i}" for i in range(n)), "b.py::t0", "a.py::late")
    order: RunOrder[Node] = RunOrder()
    run.reads = 0
    found = [order.after_module(run, run[i]) for i in range(n)]
    assert all(f is run[n] for f in found)
    # A walk per module, not per test: quadratic would be ~n*n/2 reads.
    assert run.reads < 6 * n, run.reads
    # A module whose items a plugin put apart: each stretch has its own next item.
    assert order.after_module(run, run[n]) is run[n + 1]
    assert order.after_module(run, run[n + 1]) is None
