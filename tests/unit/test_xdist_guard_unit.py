"""Unit tests of :class:`pytest_boxlite.xdist_guard.WorkerGuard`, on a stand-in for xdist's
``WorkerController`` (a fake: it records what the guard lets through), with this run's real hooks
(to rebuild reports) and a fresh stash per test (the session's state the guards share).

The orders of events tested here are the ones xdist produces when it replaces crashed workers,
which a real run reaches only by chance: the whole-session behaviour is
``tests/test_xdist.py::test_worker_scope_restarted_worker_gets_a_fresh_box`` and the attacks are
``tests/test_hostile_channel.py::test_worker_scope_xdist_channel_is_checked``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pytest_boxlite.xdist_guard import WorkerGuard

IDS = [f"test_a.py::test_t[{i}]" for i in range(8)]


@pytest.fixture
def config(pytestconfig: pytest.Config) -> Any:
    """A session's config as the guard uses it: the hooks, and a stash of its own."""
    return SimpleNamespace(hook=pytestconfig.hook, stash=pytest.Stash())


class FakeNode:
    """What the guard needs of an xdist ``WorkerController``: the three methods it wraps."""

    def __init__(self, config: Any, worker: str = "gw3") -> None:
        self.config = config
        self.gateway = SimpleNamespace(id=worker)
        self.passed: list[tuple[str, dict[str, Any]]] = []
        self.sent: list[object] = []

    def process_from_remote(self, eventcall: Any) -> None:
        self.passed.append(eventcall)

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.append(list(indices))

    def send_runtest_all(self) -> None:
        self.sent.append("all")


def report(nodeid: str, when: str, outcome: str = "passed") -> dict[str, Any]:
    location = (nodeid.split("::")[0], 5, nodeid.split("::")[1])
    data: dict[str, Any] = {
        "$report_type": "TestReport",
        "nodeid": nodeid,
        "location": location,
        "keywords": {},
        "outcome": outcome,
        "longrepr": None,
        "when": when,
        "sections": [],
        "duration": 0.001,
        "user_properties": [],
    }
    return {"data": data}


def run_test(guard: WorkerGuard, index: int) -> None:
    nodeid = IDS[index]
    location = (nodeid.split("::")[0], 5, nodeid.split("::")[1])
    guard.process_from_remote(("logstart", {"nodeid": nodeid, "location": location}))
    for when in ("setup", "call", "teardown"):
        guard.process_from_remote(("testreport", report(nodeid, when)))
    guard.process_from_remote(("logfinish", {"nodeid": nodeid, "location": location}))
    guard.process_from_remote(("runtest_protocol_complete", {"item_index": index, "duration": 0.001}))


def names(node: FakeNode) -> list[str]:
    return [e[0] for e in node.passed]


@pytest.mark.parametrize("before", [True, False], ids=["tests-sent-before-collection", "after"])
def test_tests_given_before_the_workers_collection_are_its_own(config: Any, before: bool) -> None:
    """A replacement worker may be sent its tests before its collectionfinish arrives (xdist
    reschedules on every node when another one's collection comes in): its reports of them are
    the controller's tests, not forgeries."""
    node = FakeNode(config)
    guard = WorkerGuard(node)
    guard_send = node.send_runtest_some  # the guard's wrapper, installed on the node
    if before:
        guard_send([6, 7])
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": IDS}))
    if not before:
        guard_send([6, 7])
    run_test(guard, 6)
    run_test(guard, 7)
    guard.process_from_remote(("workerfinished", {"workeroutput": {"exitstatus": 0}}))
    assert node.sent == [[6, 7]]
    one_test = ["logstart", "testreport", "testreport", "testreport", "logfinish", "runtest_protocol_complete"]
    assert names(node) == ["collectionfinish", *one_test, *one_test, "workerfinished"]
    outcomes = [e[1]["data"]["outcome"] for e in node.passed if e[0] == "testreport"]
    assert outcomes == ["passed"] * 6
    assert not guard.complaints


def test_send_all_before_the_collection_names_every_test(config: Any) -> None:
    node = FakeNode(config)
    guard = WorkerGuard(node)
    node.send_runtest_all()
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": IDS}))
    run_test(guard, 3)
    assert "runtest_protocol_complete" in names(node)
    assert not guard.complaints


def test_a_test_never_given_is_still_refused(config: Any) -> None:
    node = FakeNode(config)
    guard = WorkerGuard(node)
    node.send_runtest_some([6])
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": IDS}))
    run_test(guard, 2)  # the controller gave it 6, not 2
    assert names(node) == ["collectionfinish"]
    assert guard.complaints


def test_complaints_with_no_test_started_still_fail_a_report(config: Any) -> None:
    """Every logstart refused and then the worker ends: the complaints come out as a failed
    report of a test it was given (never dropped in silence)."""
    node = FakeNode(config)
    guard = WorkerGuard(node)
    node.send_runtest_some([6])
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": IDS}))
    run_test(guard, 2)
    guard.process_from_remote(("workerfinished", {"workeroutput": {"exitstatus": 0}}))
    assert names(node) == ["collectionfinish", "testreport", "workerfinished"]
    data = node.passed[1][1]["data"]
    assert (data["nodeid"], data["outcome"], data["when"]) == (IDS[6], "failed", "teardown")
    assert "did not give this worker" in data["longrepr"]
    assert config.hook.pytest_report_from_serializable(config=config, data=data).failed


def test_complaints_of_a_worker_given_nothing_name_the_worker(config: Any) -> None:
    node = FakeNode(config)
    guard = WorkerGuard(node)
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": IDS}))
    guard.process_from_remote(("no-such-event", {}))
    guard.process_from_remote(("workerfinished", {"workeroutput": {"exitstatus": 0}}))
    data = node.passed[1][1]["data"]
    assert data["nodeid"] == "boxlite-worker-gw3"
    assert data["outcome"] == "failed" and "unknown event" in data["longrepr"]


def test_a_replacement_cannot_rename_the_tests_it_is_given(config: Any) -> None:
    """The indices the controller sends are its own numbering (the first collection): a later
    worker that says it collected other names cannot report on those names."""
    first = WorkerGuard(FakeNode(config, "gw0"))
    first.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": IDS}))
    node = FakeNode(config)
    guard = WorkerGuard(node)
    forged = [*IDS[:6], "test_a.py::test_important", "test_a.py::test_t[7]"]
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": forged}))
    node.send_runtest_some([6])
    guard.process_from_remote(("testreport", report("test_a.py::test_important", "call")))
    assert names(node) == ["collectionfinish"]
    assert "test_important" in guard.complaints[0]
    guard.process_from_remote(("testreport", report(IDS[6], "call")))  # the test it was given
    assert names(node) == ["collectionfinish", "testreport"]
