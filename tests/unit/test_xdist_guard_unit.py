"""Unit tests of :class:`pytest_boxlite.xdist_guard.WorkerGuard`, on a stand-in for xdist's
``WorkerController`` (a fake: it records what the guard lets through), with this run's real hooks
(to rebuild reports) and a fresh stash per test (the session's state the guards share).

Each check of an event's fields is fed here what a forged event carries; what it lets through is
what xdist's controller would take from an honest worker (the contract is read from the installed
xdist where it can be: its ``DSession`` handlers and their arguments).  The orders of events tested
here are also the ones xdist produces when it replaces crashed workers, which a real run reaches
only by chance.  The whole-session behaviour is ``tests/test_xdist.py`` (the attacks:
``test_worker_scope_forged_events_fail_their_test_only``) and
``tests/test_hostile_channel.py::test_worker_scope_xdist_channel_is_checked``.
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_boxlite.xdist_guard import EVENT_FIELDS, WorkerGuard, clean_workerinfo

xdist = pytest.importorskip("xdist")
from xdist.dsession import DSession  # noqa: E402 - after the skip
from xdist.workermanage import Marker  # noqa: E402

IDS = [f"test_a.py::test_t[{i}]" for i in range(8)]
ESC = "\x1b]52;c;cHduZWQ=\x07\x1b[2J\u202e"
INFO = {
    "version": "3.11.7 (main)\n[GCC 12]",
    "version_info": (3, 11, 7, "final", 0),
    "sysplatform": "linux",
    "platform": "Linux-6",
    "executable": "/usr/bin/python3",
    "cwd": "/p",
}
OUTPUT = {"exitstatus": 0, "shouldfail": False, "shouldstop": False}


@pytest.fixture
def config(pytestconfig: pytest.Config) -> Any:
    """A session's config as the guard uses it: the hooks, --maxfail, and a stash of its own."""
    return SimpleNamespace(hook=pytestconfig.hook, stash=pytest.Stash(), option=SimpleNamespace(maxfail=0))


class FakeNode:
    """What the guard needs of an xdist ``WorkerController``: the methods it wraps."""

    def __init__(self, config: Any, worker: str = "gw3") -> None:
        self.config = config
        self.gateway = SimpleNamespace(id=worker)
        self.passed: list[Any] = []
        self.sent: list[object] = []

    def process_from_remote(self, eventcall: Any) -> None:
        self.passed.append(eventcall)

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.append(list(indices))

    def send_runtest_all(self) -> None:
        self.sent.append("all")

    def send_steal(self, indices: list[int]) -> None:
        self.sent.append(("steal", list(indices)))

    def shutdown(self) -> None:
        self.sent.append("shutdown")


def location(nodeid: str) -> tuple[str, int, str]:
    return (nodeid.split("::")[0], 5, nodeid.split("::")[1])


def report(nodeid: str, when: str, outcome: str = "passed") -> dict[str, Any]:
    data: dict[str, Any] = {
        "$report_type": "TestReport",
        "nodeid": nodeid,
        "location": location(nodeid),
        "keywords": {},
        "outcome": outcome,
        "longrepr": None,
        "when": when,
        "sections": [],
        "duration": 0.001,
        "user_properties": [],
    }
    return {"data": data}


def collect_report(outcome: str = "failed", longrepr: object = "boom", kind: str = "CollectReport") -> dict[str, Any]:
    data = {"$report_type": kind, "nodeid": "test_b.py", "outcome": outcome, "longrepr": longrepr, "result": None}
    data["sections"] = []
    return {"data": data}


def started(config: Any, given: list[int] | None = None) -> tuple[FakeNode, WorkerGuard]:
    """A worker that said it is ready, collected IDS and was given ``given``."""
    node = FakeNode(config)
    guard = WorkerGuard(node)
    guard.process_from_remote(("workerready", {"workerinfo": dict(INFO)}))
    guard.process_from_remote(("collectionstart", {}))
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": IDS}))
    if given:
        node.send_runtest_some(given)
    node.passed.clear()
    return node, guard


def begin(guard: WorkerGuard, index: int) -> None:
    guard.process_from_remote(("logstart", {"nodeid": IDS[index], "location": location(IDS[index])}))


def run_test(guard: WorkerGuard, index: int, outcome: str = "passed") -> None:
    nodeid = IDS[index]
    begin(guard, index)
    for when in ("setup", "call", "teardown"):
        guard.process_from_remote(("testreport", report(nodeid, when, outcome if when == "call" else "passed")))
    guard.process_from_remote(("logfinish", {"nodeid": nodeid, "location": location(nodeid)}))
    guard.process_from_remote(("runtest_protocol_complete", {"item_index": index, "duration": 0.001}))


def names(node: FakeNode) -> list[str]:
    return [e[0] for e in node.passed if isinstance(e, tuple)]


def failed_reports(node: FakeNode) -> list[dict[str, Any]]:
    return [e[1]["data"] for e in node.passed if e[0] == "testreport" and e[1]["data"]["outcome"] == "failed"]


ONE_TEST = ["logstart", "testreport", "testreport", "testreport", "logfinish", "runtest_protocol_complete"]


# -- the contract is xdist's ----------------------------------------------------------------------


def test_the_events_are_the_ones_the_installed_xdist_controller_handles() -> None:
    """Every event the guard lets through has a handler in xdist's ``DSession`` taking exactly the
    arguments the guard requires (``collectionstart`` is dropped by ``WorkerController``), and every
    handler but ``errordown`` (the controller's own) is an event the guard checks."""
    handlers = {n.removeprefix("worker_") for n in dir(DSession) if n.startswith("worker_")}
    assert handlers - {"errordown"} == set(EVENT_FIELDS) - {"collectionstart"}
    # WorkerController passes these straight on as keyword arguments: any other name is a TypeError there.
    for name in ("workerready", "internal_error", "logstart", "logfinish", "runtest_protocol_complete", "unscheduled"):
        params = set(inspect.signature(getattr(DSession, f"worker_{name}")).parameters) - {"self", "node"}
        required, optional = EVENT_FIELDS[name]
        assert params == required and not optional, name


@pytest.mark.parametrize("name", ["bogus", "teardownreport", "logwarning", "errordown", "warning_captured", 5])
def test_an_event_the_controller_does_not_handle_is_refused(config: Any, name: object) -> None:
    node, guard = started(config, [0])
    guard.process_from_remote((name, {}))
    assert node.passed == []
    assert "unknown event" in guard.complaints[0]


@pytest.mark.parametrize(
    "event",
    [
        ("logstart", {"nodeid": IDS[0], "location": location(IDS[0]), "extra": 1}),
        ("runtest_protocol_complete", {"item_index": 0}),
        ("workerfinished", {}),
        ("internal_error", {"formatted_error": "x", "more": 2}),
        ("unscheduled", {"indices": [], "node": None}),
    ],
)
def test_arguments_other_than_xdists_are_refused(config: Any, event: tuple[str, dict[str, Any]]) -> None:
    node, guard = started(config, [0])
    guard.process_from_remote(event)
    assert node.passed == [] and "with the arguments" in guard.complaints[0]


# -- logstart / logfinish / reports ----------------------------------------------------------------


@pytest.mark.parametrize(
    "where",
    [None, "test_a.py", ("test_a.py", 5), ("test_a.py", "5", "t"), ("test_a.py", True, "t"), (1, 5, "t"), {"a": 1}],
)
def test_a_location_that_is_not_path_line_domain_is_refused(config: Any, where: object) -> None:
    node, guard = started(config, [0])
    guard.process_from_remote(("logstart", {"nodeid": IDS[0], "location": where}))
    assert node.passed == []
    assert "location is not (path, line, domain)" in guard.complaints[0]


def test_a_location_is_taken_as_a_tuple_with_its_text_escaped(config: Any) -> None:
    node, guard = started(config, [0])
    guard.process_from_remote(("logstart", {"nodeid": IDS[0], "location": ["test_a.py", None, f"t{ESC}"]}))
    (event,) = node.passed
    assert event[1]["location"] == ("test_a.py", None, "t\\x1b]52;c;cHduZWQ=\\x07\\x1b[2J\\u202e")
    assert not guard.complaints


def test_only_the_test_being_run_may_be_started_or_reported(config: Any) -> None:
    """A worker may report on the test it is running, not rewrite one it completed (nor one it
    was given but has not started)."""
    node, guard = started(config, [0, 1])
    run_test(guard, 0)
    assert names(node) == ONE_TEST
    node.passed.clear()
    guard.process_from_remote(("testreport", report(IDS[0], "call", "failed")))  # done already
    guard.process_from_remote(("testreport", report(IDS[1], "call")))  # not started
    guard.process_from_remote(("logstart", {"nodeid": IDS[0], "location": location(IDS[0])}))  # done already
    assert node.passed == []
    assert [c.split(",")[1] for c in guard.complaints] == [
        " which is not the test this worker is running",
        " which is not the test this worker is running",
        " a test the controller did not give this worker to run",
    ]


def test_a_report_of_no_test_phase_or_outcome_is_refused(config: Any) -> None:
    node, guard = started(config, [0])
    begin(guard, 0)
    node.passed.clear()
    bad_when = report(IDS[0], "collect")
    bad_outcome = report(IDS[0], "call", "bogus")
    not_a_test = report(IDS[0], "call")
    not_a_test["data"]["$report_type"] = "CollectReport"
    for event in (bad_when, bad_outcome, not_a_test):
        guard.process_from_remote(("testreport", event))
    assert node.passed == [] and len(guard.complaints) == 3


# -- workerready, collection ----------------------------------------------------------------------


@pytest.mark.parametrize("info", ["hostile", None, [1, 2], {"version": 5, "version_info": "3.11"}])
def test_a_workerready_of_no_info_dict_is_given_one(config: Any, info: object) -> None:
    """xdist writes into the info and prints its version (-v): a worker's is replaced, field by
    field, and its first report fails saying so."""
    node = FakeNode(config)
    guard = WorkerGuard(node)
    guard.process_from_remote(("workerready", {"workerinfo": info}))
    ((name, kwargs),) = node.passed
    clean = kwargs["workerinfo"]
    assert name == "workerready" and isinstance(clean, dict)
    assert set(clean) == {*INFO} and clean["version_info"] == (0, 0, 0, "?", 0)
    clean["id"] = "gw3"  # what xdist does with it
    assert guard.complaints and "workerinfo" in guard.complaints[0]


def test_a_workerready_info_is_escaped_and_an_honest_one_kept(config: Any) -> None:
    info, problems = clean_workerinfo({**INFO, "executable": f"/bin/py{ESC}", "extra": object()})
    assert problems == []
    assert info["executable"] == "/bin/py\\x1b]52;c;cHduZWQ=\\x07\\x1b[2J\\u202e"
    assert info["version"] == INFO["version"]  # its newline stays: xdist replaces it when it prints
    assert {k: v for k, v in info.items() if k != "executable"} == {k: v for k, v in INFO.items() if k != "executable"}


def test_a_second_workerready_is_refused(config: Any) -> None:
    node, guard = started(config, [0])
    guard.process_from_remote(("workerready", {"workerinfo": "hostile"}))
    assert node.passed == [] and "a second workerready" in guard.complaints[0]


def test_a_collection_before_workerready_gets_a_workerready_first(config: Any) -> None:
    node = FakeNode(config)
    guard = WorkerGuard(node)
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": IDS}))
    assert names(node) == ["workerready", "collectreport", "collectionfinish"]
    assert "before its workerready" in node.passed[1][1]["data"]["longrepr"]
    guard.process_from_remote(("workerready", {"workerinfo": dict(INFO)}))
    assert len(node.passed) == 3


@pytest.mark.parametrize(
    ("rep", "says"),
    [
        (collect_report("passed", None), "outcome is 'passed'"),
        (collect_report("passed", [1]), "outcome is 'passed'"),
        (collect_report("skipped", ["a", 1, "b"]), "longrepr"),
        (collect_report("skipped", "why"), "longrepr"),
        (collect_report("failed", [1, 2]), "longrepr"),
        (collect_report("failed", None), "longrepr"),
        (collect_report("failed", "x", kind="TestReport"), "could not read"),
        ({"data": "x"}, "without its report data"),
    ],
)
def test_a_collectreport_is_a_failed_or_skipped_collection(config: Any, rep: dict[str, Any], says: str) -> None:
    """xdist asserts a collection report did not pass, and keys its errors by their longrepr: a
    passed one, an unhashable or unprintable longrepr are refused; the refusal is a collection
    error named after the worker (no test runs yet)."""
    node = FakeNode(config)
    guard = WorkerGuard(node)
    guard.process_from_remote(("workerready", {"workerinfo": dict(INFO)}))
    guard.process_from_remote(("collectreport", rep))
    assert names(node) == ["workerready"]
    assert says in guard.complaints[0], guard.complaints
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": IDS}))
    assert names(node) == ["workerready", "collectreport", "collectionfinish"]
    data = node.passed[1][1]["data"]
    assert (data["nodeid"], data["outcome"]) == ("boxlite-worker-gw3", "failed")
    assert config.hook.pytest_report_from_serializable(config=config, data=data).failed


def test_an_honest_collectreport_goes_through_during_the_collection_only(config: Any) -> None:
    node = FakeNode(config)
    guard = WorkerGuard(node)
    guard.process_from_remote(("workerready", {"workerinfo": dict(INFO)}))
    guard.process_from_remote(("collectreport", collect_report("failed", "ImportError: x")))
    guard.process_from_remote(("collectreport", collect_report("skipped", ["test_b.py", 1, "Skipped: no"])))
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": IDS}))
    guard.process_from_remote(("collectreport", collect_report("failed", "late")))
    assert names(node) == ["workerready", "collectreport", "collectreport", "collectionfinish"]
    assert "outside the worker's collection" in guard.complaints[0]


def test_node_ids_are_escaped_and_the_worker_cannot_use_the_raw_ones(config: Any) -> None:
    node = FakeNode(config)
    guard = WorkerGuard(node)
    guard.process_from_remote(("workerready", {"workerinfo": dict(INFO)}))
    guard.process_from_remote(("collectionfinish", {"ids": [f"test_a.py::t{ESC}"]}))
    assert node.passed[-1][1]["ids"] == ["test_a.py::t\\x1b]52;c;cHduZWQ=\\x07\\x1b[2J\\u202e"]
    node.send_runtest_some([0])
    guard.process_from_remote(("logstart", {"nodeid": f"test_a.py::t{ESC}", "location": ("test_a.py", 1, "t")}))
    assert names(node) == ["workerready", "collectionfinish"] and guard.complaints


# -- what only the controller decides --------------------------------------------------------------


def test_unscheduled_only_answers_a_steal_with_all_or_nothing(config: Any) -> None:
    node, guard = started(config, [0, 1, 2, 3])
    guard.process_from_remote(("unscheduled", {"indices": [2, 3]}))  # never asked
    assert node.passed == [] and "did not ask for" in guard.complaints.pop()
    node.send_steal([2, 3])
    guard.process_from_remote(("unscheduled", {"indices": [2]}))  # not what was asked
    guard.process_from_remote(("unscheduled", {"indices": [2, 3, 3]}))
    guard.process_from_remote(("unscheduled", {"indices": "2,3"}))
    assert node.passed == [] and len(guard.complaints) == 3
    guard.process_from_remote(("unscheduled", {"indices": [3, 2]}))
    assert names(node) == ["unscheduled"] and guard.pending == 2
    node.send_steal([1])
    guard.process_from_remote(("unscheduled", {"indices": []}))  # the worker ran it already
    assert names(node) == ["unscheduled", "unscheduled"] and guard.pending == 2


@pytest.mark.parametrize("duration", [math.nan, math.inf, "1", True, None])
def test_a_completion_of_no_duration_is_refused(config: Any, duration: object) -> None:
    node, guard = started(config, [0])
    guard.process_from_remote(("runtest_protocol_complete", {"item_index": 0, "duration": duration}))
    assert node.passed == [] and guard.pending == 1


def test_a_test_completed_without_any_report_stays_pending(config: Any) -> None:
    """A worker that marks a test done without reporting it (the running one, or the next it was
    given) would leave it with no report at all: refused, the test stays the worker's."""
    node, guard = started(config, [0, 1])
    begin(guard, 0)
    guard.process_from_remote(("logfinish", {"nodeid": IDS[0], "location": location(IDS[0])}))
    guard.process_from_remote(("runtest_protocol_complete", {"item_index": 0, "duration": 0.1}))
    guard.process_from_remote(("runtest_protocol_complete", {"item_index": 1, "duration": 0.1}))
    assert names(node) == ["logstart", "logfinish"] and guard.pending == 2
    assert all("of which it sent no report" in c for c in guard.complaints)
    run_test(guard, 0)  # reported now: done
    assert guard.pending == 1 and names(node)[-1] == "runtest_protocol_complete"


def test_internal_error_fails_the_running_test_with_its_text_escaped(config: Any) -> None:
    """xdist would print the text raw as an INTERNALERROR and drop the worker with its tests."""
    node, guard = started(config, [0, 1])
    begin(guard, 0)
    guard.process_from_remote(("internal_error", {"formatted_error": f"Traceback{ESC}\nboom"}))
    assert "internal_error" not in names(node)
    for when in ("setup", "call", "teardown"):
        guard.process_from_remote(("testreport", report(IDS[0], when)))
    (failed,) = failed_reports(node)
    assert failed["when"] == "call" and "\x1b" not in failed["longrepr"] and "\u202e" not in failed["longrepr"]
    assert "Traceback\\x1b]52;c;cHduZWQ=\\x07\\x1b[2J\\u202e\nboom" in failed["longrepr"]


def test_a_workerfinished_never_stops_the_session(config: Any) -> None:
    """shouldstop, shouldfail and an exit status of 2 (xdist stops every worker for each) are
    cleared; missing fields that xdist reads are filled in; the complaints fail a test."""
    node, guard = started(config, [0])
    run_test(guard, 0)
    node.shutdown()
    hostile = {"exitstatus": 2, "shouldfail": "stop!", "shouldstop": ["x"], "boxlite": {"stats": {}}}
    guard.process_from_remote(("workerfinished", {"workeroutput": hostile}))
    assert names(node)[-2:] == ["testreport", "workerfinished"]
    output = node.passed[-1][1]["workeroutput"]
    assert output == {"exitstatus": 1, "shouldfail": False, "shouldstop": False, "boxlite": {"stats": {}}}
    (failed,) = failed_reports(node)
    assert failed["nodeid"] == IDS[0] and failed["longrepr"].count("\n- ") == 3, failed["longrepr"]
    guard.process_from_remote(("testreport", report(IDS[0], "call")))  # xdist has let the worker go
    assert names(node)[-1] == "workerfinished"


@pytest.mark.parametrize("output", [{}, {"exitstatus": "0"}, "done", {1: 2}])
def test_a_workerfinished_missing_what_xdist_reads_is_completed(config: Any, output: object) -> None:
    node, guard = started(config, [])
    node.shutdown()
    guard.process_from_remote(("workerfinished", {"workeroutput": output}))
    passed = node.passed[-1][1]["workeroutput"]
    assert {k: passed[k] for k in OUTPUT} == {"exitstatus": 1, "shouldfail": False, "shouldstop": False}
    assert failed_reports(node)[0]["nodeid"] == "boxlite-worker-gw3"


def test_a_forged_workerfinished_mid_test_only_fails_that_test(config: Any) -> None:
    """Held while tests are pending: the worker speaks on, so it was no end."""
    node, guard = started(config, [0, 1])
    begin(guard, 0)
    guard.process_from_remote(("workerfinished", {"workeroutput": {**OUTPUT, "shouldstop": "hostile"}}))
    assert "workerfinished" not in names(node)
    for when in ("setup", "call", "teardown"):
        guard.process_from_remote(("testreport", report(IDS[0], when)))
    guard.process_from_remote(("logfinish", {"nodeid": IDS[0], "location": location(IDS[0])}))
    guard.process_from_remote(("runtest_protocol_complete", {"item_index": 0, "duration": 0.1}))
    run_test(guard, 1)
    (failed,) = failed_reports(node)
    assert failed["nodeid"] == IDS[0] and "shouldstop='hostile'" in failed["longrepr"]
    assert "2 of the tests it was given had not run" in failed["longrepr"]
    node.shutdown()
    guard.process_from_remote(("workerfinished", {"workeroutput": dict(OUTPUT)}))
    assert names(node)[-1] == "workerfinished"


def test_a_worker_that_ends_with_tests_pending_is_a_crash_whose_report_says_why(config: Any) -> None:
    """workerfinished, then the channel ends: xdist's end marker goes through (xdist's crash path
    reports the running test failed and gives the others to other workers), and the refusals go
    into that crash report."""
    node, guard = started(config, [0, 1])
    killed: list[bool] = []
    node.gateway._io = SimpleNamespace(kill=lambda: killed.append(True))  # execnet's popen I/O
    begin(guard, 0)
    guard.process_from_remote(("workerfinished", {"workeroutput": {**OUTPUT, "shouldstop": "hostile"}}))
    assert not killed
    guard.process_from_remote(Marker.END)
    assert node.passed[-1] is Marker.END and "workerfinished" not in names(node)
    assert killed == [True]  # its process is let go: the replacement needs its box slot
    crash = pytest.TestReport(IDS[0], location(IDS[0]), {}, "failed", "worker 'gw3' crashed while running", "???")  # type: ignore[arg-type]
    guard.note_crash(crash)
    assert "crashed while running\npytest-boxlite:" in str(crash.longrepr)
    assert "shouldstop='hostile'" in str(crash.longrepr)


def test_a_worker_stopping_for_the_controllers_own_maxfail_is_taken_at_its_word(config: Any) -> None:
    """-x: the worker stops itself with tests pending and says so, as the controller (which
    counted the same failures) stops too: xdist then keeps the pending tests, as for any worker."""
    config.option.maxfail = 1
    node, guard = started(config, [0, 1, 2])
    run_test(guard, 0, "failed")
    output = {"exitstatus": 1, "shouldfail": "stopping after 1 failures", "shouldstop": False}
    guard.process_from_remote(("workerfinished", {"workeroutput": output}))
    assert node.passed[-1] == ("workerfinished", {"workeroutput": output})
    assert not guard.complaints


def test_a_collection_error_counts_for_maxfail(config: Any) -> None:
    """-x with a module that fails to import: the worker stops for it, as the controller does."""
    config.option.maxfail = 1
    node = FakeNode(config)
    guard = WorkerGuard(node)
    guard.process_from_remote(("workerready", {"workerinfo": dict(INFO)}))
    guard.process_from_remote(("collectreport", collect_report("failed", "ImportError: x")))
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": IDS}))
    node.send_runtest_some([0, 1])
    output = {"exitstatus": 1, "shouldfail": "stopping after 1 failures", "shouldstop": False}
    guard.process_from_remote(("workerfinished", {"workeroutput": output}))
    assert names(node)[-1] == "workerfinished" and not guard.complaints


def test_a_collection_error_sent_twice_counts_once_as_for_the_controller(config: Any) -> None:
    config.option.maxfail = 2
    node = FakeNode(config)
    guard = WorkerGuard(node)
    guard.process_from_remote(("workerready", {"workerinfo": dict(INFO)}))
    for _ in range(2):
        guard.process_from_remote(("collectreport", collect_report("failed", "ImportError: x")))
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": IDS}))
    node.send_runtest_some([0, 1])
    output = {"exitstatus": 1, "shouldfail": "stopping after 2 failures", "shouldstop": False}
    guard.process_from_remote(("workerfinished", {"workeroutput": output}))
    assert "workerfinished" not in names(node) and guard.failed == 1


def test_a_worker_may_not_stop_before_the_maxfail_count(config: Any) -> None:
    config.option.maxfail = 2
    node, guard = started(config, [0, 1, 2])
    run_test(guard, 0, "failed")
    output = {"exitstatus": 1, "shouldfail": "stopping after 1 failures", "shouldstop": False}
    guard.process_from_remote(("workerfinished", {"workeroutput": output}))
    assert "workerfinished" not in names(node) and guard.held_finish


def test_a_warning_is_shaped_and_escaped(config: Any) -> None:
    node, guard = started(config, [0])
    data = {"message_str": f"hi{ESC}", "filename": f"x{ESC}.py", "lineno": 3, "line": None}
    fields = {"warning_message_data": data, "when": "runtest", "nodeid": IDS[0]}
    guard.process_from_remote(("warning_recorded", {**fields, "location": ("x.py", 3, "f")}))
    (event,) = node.passed
    assert "\x1b" not in repr(event[1]) and "\\x1b]52" in event[1]["warning_message_data"]["message_str"]
    for bad in ({"when": "later"}, {"location": ("x.py", None, "f")}, {"nodeid": 5}, {"location": [1]}):
        guard.process_from_remote(("warning_recorded", {**fields, "location": None, **bad}))
    assert len(node.passed) == 1 and len(guard.complaints) == 4


# -- tests given around a worker's collection (xdist's replacements) -----------------------------


@pytest.mark.parametrize("before", [True, False], ids=["tests-sent-before-collection", "after"])
def test_tests_given_before_the_workers_collection_are_its_own(config: Any, before: bool) -> None:
    """A replacement worker may be sent its tests before its collectionfinish arrives (xdist
    reschedules on every node when another one's collection comes in): its reports of them are
    the controller's tests, not forgeries."""
    node = FakeNode(config)
    guard = WorkerGuard(node)
    guard_send = node.send_runtest_some  # the guard's wrapper, installed on the node
    guard.process_from_remote(("workerready", {"workerinfo": dict(INFO)}))
    if before:
        guard_send([6, 7])
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": IDS}))
    if not before:
        guard_send([6, 7])
    run_test(guard, 6)
    run_test(guard, 7)
    node.shutdown()
    guard.process_from_remote(("workerfinished", {"workeroutput": dict(OUTPUT)}))
    assert node.sent == [[6, 7], "shutdown"]
    assert names(node) == ["workerready", "collectionfinish", *ONE_TEST, *ONE_TEST, "workerfinished"]
    outcomes = [e[1]["data"]["outcome"] for e in node.passed if e[0] == "testreport"]
    assert outcomes == ["passed"] * 6
    assert not guard.complaints


def test_send_all_before_the_collection_names_every_test(config: Any) -> None:
    node = FakeNode(config)
    guard = WorkerGuard(node)
    guard.process_from_remote(("workerready", {"workerinfo": dict(INFO)}))
    node.send_runtest_all()
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": IDS}))
    run_test(guard, 3)
    assert "runtest_protocol_complete" in names(node)
    assert not guard.complaints and guard.pending == 7


def test_a_test_never_given_is_still_refused(config: Any) -> None:
    node, guard = started(config, [6])
    run_test(guard, 2)  # the controller gave it 6, not 2
    assert names(node) == []
    assert guard.complaints


def test_complaints_with_no_test_started_still_fail_a_report(config: Any) -> None:
    """Every logstart refused and then the worker ends: the complaints come out as a failed
    report of a test it was given (never dropped in silence)."""
    node, guard = started(config, [6])
    run_test(guard, 2)
    node.shutdown()
    guard.process_from_remote(("workerfinished", {"workeroutput": dict(OUTPUT)}))
    # Test 6 is still pending: the end is held, and the channel's end is xdist's crash.
    assert names(node) == []
    guard.process_from_remote(Marker.END)
    assert node.passed == [Marker.END] and "did not give this worker" in str(guard.crash_note)


def test_complaints_of_a_worker_given_nothing_name_the_worker(config: Any) -> None:
    node, guard = started(config)
    guard.process_from_remote(("no-such-event", {}))
    node.shutdown()
    guard.process_from_remote(("workerfinished", {"workeroutput": dict(OUTPUT)}))
    data = node.passed[0][1]["data"]
    assert data["nodeid"] == "boxlite-worker-gw3"
    assert data["outcome"] == "failed" and "unknown event" in data["longrepr"]
    assert config.hook.pytest_report_from_serializable(config=config, data=data).failed


def test_a_replacement_cannot_rename_the_tests_it_is_given(config: Any) -> None:
    """The indices the controller sends are its own numbering (the first collection): a later
    worker that says it collected other names cannot report on those names."""
    started(config)  # the first worker: its collection numbers the tests
    node = FakeNode(config)
    guard = WorkerGuard(node)
    forged = [*IDS[:6], "test_a.py::test_important", "test_a.py::test_t[7]"]
    guard.process_from_remote(("workerready", {"workerinfo": dict(INFO)}))
    guard.process_from_remote(("collectionfinish", {"topdir": "/p", "ids": forged}))
    node.send_runtest_some([6])
    guard.process_from_remote(("logstart", {"nodeid": "test_a.py::test_important", "location": ("a", 1, "b")}))
    assert names(node) == ["workerready", "collectionfinish"]
    assert "test_important" in guard.complaints[0]
    run_test(guard, 6)  # the test it was given
    assert names(node) == ["workerready", "collectionfinish", *ONE_TEST]
