"""The controller's check of what boxed xdist workers send (``--boxlite-scope=worker -n N``).

How it works, and why: ``docs/explanation/internals/xdist-guard.md``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import reprlib
import sys
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import pytest

from pytest_boxlite._shown import shown

#: What each event the controller handles carries: (required, optional) argument names, exactly as
#: an xdist 3.x worker sends them (``xdist/remote.py``).  Any other event is refused, among them
#: ``teardownreport`` and ``logwarning``, which ``WorkerController`` forwards but no ``DSession`` 3.x
#: handles (an AttributeError there), and ``errordown``, the controller's own.
EVENT_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "collectionstart": (frozenset(), frozenset()),
    "workerready": (frozenset({"workerinfo"}), frozenset()),
    "internal_error": (frozenset({"formatted_error"}), frozenset()),
    "workerfinished": (frozenset({"workeroutput"}), frozenset()),
    "logstart": (frozenset({"nodeid", "location"}), frozenset()),
    "logfinish": (frozenset({"nodeid", "location"}), frozenset()),
    "testreport": (frozenset({"data"}), frozenset({"item_index"})),
    "collectreport": (frozenset({"data"}), frozenset()),
    "collectionfinish": (frozenset({"ids"}), frozenset({"topdir"})),
    "runtest_protocol_complete": (frozenset({"item_index", "duration"}), frozenset()),
    "unscheduled": (frozenset({"indices"}), frozenset()),
    "warning_recorded": (frozenset({"warning_message_data", "when", "nodeid", "location"}), frozenset()),
}
KNOWN_EVENTS = frozenset(EVENT_FIELDS)

#: ``workerready``'s info (``xdist.remote.getinfodict``): key -> its type; ``version_info`` is
#: ``sys.version_info`` as a tuple.  Other keys are dropped, missing or mistyped ones replaced.
WORKERINFO_TEXT = ("version", "sysplatform", "platform", "executable", "cwd")
#: Longest text kept of a worker's words (info fields, warning fields, an internal error).
TEXT_CAP = 4096
#: Complaints kept per worker until a report carries them (the rest are counted).
COMPLAINTS_CAP = 10
#: Most node ids a worker may say it collected (xdist keeps them all).
COLLECTION_CAP = 1_000_000
#: Outcomes of a test's report (``rerun``: pytest-rerunfailures) and of a collection's (xdist's
#: controller asserts that a worker sends only the collections that did not pass).
TEST_OUTCOMES = ("passed", "failed", "skipped", "rerun")
COLLECT_OUTCOMES = ("failed", "skipped")
WARNING_WHEN = ("config", "collect", "runtest")
#: The first collection a worker of this session reported: the one xdist's scheduler numbers its
#: tests by (the first workers' collections must all be equal; a replacement's that differs is
#: ignored by xdist, which still sends it indices of this one).
_SCHEDULED = pytest.StashKey[list[str]]()
#: The name of the plugin that adds a crashed worker's refusals to xdist's crash report.
_NOTES_PLUGIN = "boxlite-xdist-guard"


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _location(value: object) -> tuple[str, int | None, str] | None:
    """A test's location as pytest makes it, ``(path, line or None, domain)``, its text escaped;
    ``None`` if it is not one."""
    if not (isinstance(value, (tuple, list)) and len(value) == 3):
        return None
    path, line, domain = value
    if not (isinstance(path, str) and isinstance(domain, str) and (line is None or _is_int(line))):
        return None
    if line is not None and not 0 <= line < 1 << 31:
        return None
    return (shown(path, line=True, limit=TEXT_CAP), line, shown(domain, line=True, limit=TEXT_CAP))


class WorkerGuard:
    """The check on one boxed worker's events (see the module's docstring)."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self.config: pytest.Config = node.config
        self._inner: Callable[[Any], None] = node.process_from_remote
        self._send_some: Callable[[Sequence[int]], None] = node.send_runtest_some
        self._send_all: Callable[[], None] = node.send_runtest_all
        self._send_steal: Callable[[Sequence[int]], None] | None = getattr(node, "send_steal", None)
        self._shutdown: Callable[[], None] = node.shutdown
        self.ids: list[str] | None = None  # what the worker said it collected
        self.given: Counter[int] = Counter()  # indices sent and not yet completed (no zero counts)
        # ``given`` changes in the controller's main thread (sends) and in execnet's receiver
        # thread (completions), which reads it too.
        self._lock = threading.Lock()
        # The node ids of every index sent.  xdist may send a replacement worker its tests before
        # that worker's collectionfinish arrives (another worker's collection reschedules them
        # all), so an index sent then is named once the worker's ids are known.
        self.given_ids: set[str] = set()
        self.sent: set[int] = set()
        self.sent_all = False
        self.steals: deque[frozenset[int]] = deque()  # steal requests not answered yet
        self.shutdown_asked = False
        self.ready = False  # a workerready went through
        self.running: str | None = None  # the test between its logstart and its logfinish
        self.current: tuple[str, Any] | None = None  # (nodeid, location) of the last logstart
        self.failed = 0  # failed reports let through (the controller's --maxfail counts them too)
        self.collect_errors: set[str] = set()  # the texts of the collection errors counted
        self.reported: set[str] = set()  # tests with a report since their logstart, not completed
        self.held_finish = False  # a workerfinished kept back until the worker really ends
        self.finished = False  # a workerfinished went through: the worker is gone for xdist
        self.complaints: list[str] = []
        self.dropped = 0
        self.crash_note: str | None = None  # the refusals for xdist's crash report of this worker
        node.process_from_remote = self.process_from_remote
        node.send_runtest_some = self.send_runtest_some
        node.send_runtest_all = self.send_runtest_all
        if self._send_steal is not None:
            node.send_steal = self.send_steal
        node.shutdown = self.shutdown

    # -- what the controller gives the worker -------------------------------------------------
    def send_runtest_some(self, indices: Sequence[int]) -> None:
        with self._lock:
            for i in indices:
                self.given[i] += 1
            self.sent.update(indices)
            self._name_given()
        self._send_some(indices)

    def send_runtest_all(self) -> None:
        with self._lock:
            self.sent_all = True
            if self.ids is not None:
                self.given.update(range(len(self.ids)))
            self._name_given()
        self._send_all()

    def send_steal(self, indices: Sequence[int]) -> None:
        self.steals.append(frozenset(indices))
        assert self._send_steal is not None
        self._send_steal(indices)

    def shutdown(self) -> None:
        self.shutdown_asked = True
        self._shutdown()

    def _name_given(self) -> None:
        """The node ids of the indices sent so far (none before the worker's collection), named
        as the controller numbered them: a worker that reports a collection of its own choosing
        cannot rename the tests it was given."""
        if self.ids is None:
            return
        ids = self._scheduled()
        if self.sent_all:
            self.given_ids.update(ids)
        self.given_ids.update(ids[i] for i in self.sent if 0 <= i < len(ids))

    def _scheduled(self) -> list[str]:
        return self.config.stash.get(_SCHEDULED, self.ids or [])

    def _pending_ids(self) -> set[str]:
        """The node ids of the tests given to the worker and not completed yet."""
        ids = self._scheduled()
        with self._lock:
            given = dict(self.given)
        return {ids[i] for i, n in given.items() if n > 0 and 0 <= i < len(ids)}

    @property
    def pending(self) -> int:
        """How many tests the worker was given and has not completed."""
        with self._lock:
            return sum(n for n in self.given.values() if n > 0)

    def _is_pending(self, index: object) -> bool:
        with self._lock:
            return _is_int(index) and self.given.get(index, 0) > 0

    # -- what the worker sends --------------------------------------------------------------
    def process_from_remote(self, eventcall: Any) -> None:
        """xdist's callback for each object from the worker (and the channel's end marker)."""
        if not (isinstance(eventcall, tuple) and len(eventcall) == 2):
            # xdist's end marker, or a guest's non-event: only the former is xdist's business.
            if eventcall.__class__.__module__.startswith("xdist"):
                self._at_end()
                self._inner(eventcall)
            elif not self.finished:
                self._complain(f"a message that is not an xdist event: {reprlib.repr(eventcall)}")
            return
        if self.finished:
            return  # xdist has let this worker go: nothing it says now reaches the session
        self.held_finish = False  # the worker speaks on: the workerfinished it sent was not its last
        name, kwargs = eventcall
        try:
            refused = self._check(name, kwargs)
        except Exception as exc:  # noqa: BLE001 - whatever a hostile event makes the check raise is its refusal
            refused = f"a {str(name)[:50]!r} event the controller could not read ({type(exc).__name__}: {exc})"
        if refused is not None:
            self._complain(refused)
            return
        if name == "testreport":
            self.reported.add(kwargs["data"]["nodeid"])
            if self.complaints:
                kwargs = self._carry_complaints(kwargs)
        if name in ("testreport", "collectreport") and kwargs["data"].get("outcome") == "failed":
            self._count_failure(name, kwargs["data"])
        if name == "workerfinished":
            if self._hold_finish(kwargs):
                return
            self._flush_at_end()
            self.finished = True
        self._inner((name, kwargs))

    def _count_failure(self, name: str, data: dict[str, Any]) -> None:
        """Count a failure as the controller will: it counts a collection error whose text it
        has seen before (from any worker) only once."""
        longrepr = data.get("longrepr")
        if name == "collectreport" and isinstance(longrepr, str):
            if longrepr in self.collect_errors:
                return
            self.collect_errors.add(longrepr)
        self.failed += 1

    def _check(self, name: object, kwargs: object) -> str | None:
        """Why the event ``name(**kwargs)`` is refused, or ``None`` when xdist may take it
        (``kwargs`` then holds what xdist is to take: neutralised fields replaced)."""
        if not isinstance(name, str) or name not in EVENT_FIELDS:
            return f"an unknown event {reprlib.repr(name)}"
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            return f"a {name!r} event whose arguments are not a dict of names"
        required, optional = EVENT_FIELDS[name]
        if not required <= kwargs.keys() <= required | optional:
            return f"a {name!r} event with the arguments {reprlib.repr(sorted(kwargs))}, not {sorted(required)}"
        check: Callable[[dict[str, Any]], str | None] = getattr(self, f"_check_{name}")
        return check(kwargs)

    def _check_collectionstart(self, kwargs: dict[str, Any]) -> str | None:
        return None  # xdist ignores it

    def _check_workerready(self, kwargs: dict[str, Any]) -> str | None:
        if self.ready:
            return "a second workerready (the controller would add the worker to its scheduler twice)"
        info, problems = clean_workerinfo(kwargs["workerinfo"])
        for problem in problems:
            self._complain(f"a workerready whose {problem}: replaced")
        kwargs["workerinfo"] = info
        self.ready = True
        return None

    def _check_internal_error(self, kwargs: dict[str, Any]) -> str | None:
        text = kwargs["formatted_error"]
        if not isinstance(text, str):
            return f"an internal_error whose text is not text: {reprlib.repr(text)}"
        # Never xdist's: it would drop the worker (and the tests it was given) and print the text raw.
        return f"an internal error of the worker's pytest (escaped):\n{shown(text, limit=TEXT_CAP)}"

    def _check_workerfinished(self, kwargs: dict[str, Any]) -> str | None:
        output = kwargs["workeroutput"]
        if not (isinstance(output, dict) and all(isinstance(k, str) for k in output)):
            self._complain(f"a workerfinished whose workeroutput is not a dict of names: {reprlib.repr(output)}")
            output = {}
        output = dict(output)
        status = output.get("exitstatus")
        if not (_is_int(status) and 0 <= status < 256):
            self._complain(f"a workerfinished whose exit status is {reprlib.repr(status)}: read as 1")
            status = 1
        elif status == pytest.ExitCode.INTERRUPTED:
            # xdist stops the whole session for it; a boxed worker never gets the user's Ctrl-C.
            self._complain(
                "a workerfinished saying the worker was interrupted (exit status 2), which stops the session"
            )
            status = 1
        output["exitstatus"] = status
        maxfail = getattr(getattr(self.config, "option", None), "maxfail", 0) or 0
        # The controller stops by itself once --maxfail failures came in (and then a worker that
        # stopped for its own count is taken at its word, as xdist does): only then may a worker's
        # request stand, which changes nothing.  Otherwise a box would stop the session.
        honoured = _is_int(maxfail) and maxfail > 0 and self.failed >= maxfail
        for key in ("shouldfail", "shouldstop"):
            value = output.get(key)
            if value is None or value is False or value == "":
                output[key] = False
            elif honoured and isinstance(value, (bool, str)):
                output[key] = value if isinstance(value, bool) else shown(value, line=True, limit=TEXT_CAP)
            else:
                self._complain(f"a workerfinished asking the session to stop ({key}={reprlib.repr(value)})")
                output[key] = False
        kwargs["workeroutput"] = output
        return None

    def _check_logstart(self, kwargs: dict[str, Any]) -> str | None:
        nodeid, location = kwargs["nodeid"], _location(kwargs["location"])
        if not isinstance(nodeid, str) or nodeid not in self._pending_ids():
            return f"a logstart for {reprlib.repr(nodeid)}, a test the controller did not give this worker to run"
        if location is None:
            return f"a logstart whose location is not (path, line, domain): {reprlib.repr(kwargs['location'])}"
        kwargs["location"] = location
        self.running = nodeid
        self.reported.discard(nodeid)
        self.current = (nodeid, location)
        return None

    def _check_logfinish(self, kwargs: dict[str, Any]) -> str | None:
        nodeid, location = kwargs["nodeid"], _location(kwargs["location"])
        if not isinstance(nodeid, str) or nodeid != self.running:
            return f"a logfinish for {reprlib.repr(nodeid)}, which is not the test this worker is running"
        if location is None:
            return f"a logfinish whose location is not (path, line, domain): {reprlib.repr(kwargs['location'])}"
        kwargs["location"] = location
        self.running = None
        return None

    def _check_testreport(self, kwargs: dict[str, Any]) -> str | None:
        data = kwargs["data"]
        if not isinstance(data, dict):
            return "a testreport without its report data"
        nodeid = data.get("nodeid")
        if nodeid not in self.given_ids:
            return f"a report for {reprlib.repr(nodeid)}, a test the controller did not give this worker"
        if nodeid != self.running:
            return f"a report for {reprlib.repr(nodeid)}, which is not the test this worker is running"
        index = kwargs.get("item_index")
        if index is not None and not self._is_pending(index):
            return f"a report for item index {reprlib.repr(index)}, which this worker was not given"
        if data.get("when") not in ("setup", "call", "teardown"):
            return f"a test's report of the phase {reprlib.repr(data.get('when'))}"
        rep = self._readable_report(data)
        if not isinstance(rep, pytest.TestReport) or rep.outcome not in TEST_OUTCOMES:
            return f"a testreport that is not a test's report: {reprlib.repr(data)}"
        return None

    def _check_collectreport(self, kwargs: dict[str, Any]) -> str | None:
        data = kwargs["data"]
        if not self.ready or self.ids is not None:
            return "a collectreport outside the worker's collection"
        if not isinstance(data, dict):
            return "a collectreport without its report data"
        rep = self._readable_report(data)
        if not isinstance(rep, pytest.CollectReport) or not isinstance(rep.nodeid, str):
            return f"a collectreport that is not a collection's report: {reprlib.repr(data)}"
        if rep.outcome not in COLLECT_OUTCOMES:
            # xdist asserts it: a worker reports only the collections that did not pass.
            return f"a collectreport whose outcome is {reprlib.repr(rep.outcome)}, not failed or skipped"
        longrepr = rep.longrepr
        skip = (
            isinstance(longrepr, tuple)
            and len(longrepr) == 3
            and isinstance(longrepr[0], str)
            and _is_int(longrepr[1])
            and isinstance(longrepr[2], str)
        )
        failure = isinstance(longrepr, str) or hasattr(longrepr, "toterminal")
        if not (skip if rep.outcome == "skipped" else failure):
            return f"a {rep.outcome} collectreport whose longrepr is {reprlib.repr(longrepr)}"
        sections = rep.sections
        if not (
            isinstance(sections, list)
            and len(sections) <= 1000
            and all(isinstance(s, tuple) and len(s) == 2 and all(isinstance(x, str) for x in s) for s in sections)
        ):
            return f"a collectreport whose sections are not (title, text) pairs: {reprlib.repr(sections)}"
        return None

    def _check_collectionfinish(self, kwargs: dict[str, Any]) -> str | None:
        ids = kwargs["ids"]
        if self.ids is not None:
            return "a second collectionfinish"
        if not self.ready:
            # The controller's scheduler asserts the worker was added first: an info of nothing.
            self._complain("a collectionfinish before its workerready")
            self._inner(("workerready", {"workerinfo": clean_workerinfo(None)[0]}))
            self.ready = True
        if not (isinstance(ids, list) and len(ids) <= COLLECTION_CAP and all(isinstance(i, str) for i in ids)):
            # An empty collection (unlike a missing one) keeps the scheduler going; it differs from
            # the other workers', which xdist reports as a collection error.
            self._complain("a collectionfinish whose ids are not a list of node ids: an empty collection instead")
            ids = []
        # A node id the worker names is printed by the controller: escaped here, it no longer
        # matches what the worker reports for it, whose reports are then refused.
        self.ids = [shown(i, line=True) for i in ids]
        kwargs["ids"] = self.ids
        self._flush_collection()
        kwargs.pop("topdir", None)
        self.config.stash.setdefault(_SCHEDULED, self.ids)
        with self._lock:
            if self.sent_all:
                self.given.update(range(len(self.ids)))
            self._name_given()
        return None

    def _flush_collection(self) -> None:
        """Complaints of the worker's collection (no test runs yet): a failed collection report
        named after the worker, which the controller shows as a collection error."""
        if not self.complaints:
            return
        data: dict[str, Any] = {
            "$report_type": "CollectReport",
            "nodeid": f"boxlite-worker-{self.node.gateway.id}",
            "outcome": "failed",
            "longrepr": self._text(),
            "result": None,
            "sections": [],
        }
        self.complaints, self.dropped = [], 0
        self._inner(("collectreport", {"data": data}))

    def _check_runtest_protocol_complete(self, kwargs: dict[str, Any]) -> str | None:
        index, duration = kwargs["item_index"], kwargs["duration"]
        if not (isinstance(duration, (int, float)) and not isinstance(duration, bool) and math.isfinite(duration)):
            return f"a runtest_protocol_complete whose duration is {reprlib.repr(duration)}"
        if not self._is_pending(index):
            return f"a runtest_protocol_complete for item index {reprlib.repr(index)}, which this worker was not given"
        ids = self._scheduled()
        name = ids[index] if 0 <= index < len(ids) else None
        if name not in self.reported:
            # The test would leave the controller's books with no report at all: it stays the
            # worker's, and fails when the worker ends (xdist's crash report of it).
            return f"a runtest_protocol_complete for {reprlib.repr(name)}, of which it sent no report"
        self.reported.discard(name)
        self._complete(index)
        kwargs["duration"] = max(0.0, float(duration))
        return None

    def _check_unscheduled(self, kwargs: dict[str, Any]) -> str | None:
        indices = kwargs["indices"]
        if not self.steals:
            return "an unscheduled event the controller did not ask for (it answers a steal)"
        if not (isinstance(indices, list) and all(_is_int(i) for i in indices)):
            return f"an unscheduled event whose indices are {reprlib.repr(indices)}"
        asked = self.steals[0]
        # xdist's worker gives back all the tests asked for or none.
        if indices and (
            set(indices) != asked or len(indices) != len(asked) or not all(self._is_pending(i) for i in asked)
        ):
            return f"an unscheduled event giving back {reprlib.repr(indices)}, not the {sorted(asked)} asked for"
        self.steals.popleft()
        for i in indices:
            self._complete(i)
        return None

    def _check_warning_recorded(self, kwargs: dict[str, Any]) -> str | None:
        data, when, nodeid, location = (kwargs[k] for k in ("warning_message_data", "when", "nodeid", "location"))
        if not isinstance(data, dict) or when not in WARNING_WHEN or not isinstance(nodeid, str):
            return "a warning_recorded not shaped as xdist sends it"
        where = None if location is None else _location(location)
        if location is not None and (where is None or where[1] is None):
            return f"a warning_recorded whose location is not (path, line, function): {reprlib.repr(location)}"
        kwargs.update(
            warning_message_data=plain_warning(data),
            nodeid=shown(nodeid, line=True, limit=TEXT_CAP),
            location=where,
        )
        return None

    def _complete(self, index: int) -> None:
        with self._lock:
            self.given[index] -= 1
            if self.given[index] <= 0:
                del self.given[index]

    def _readable_report(self, data: dict[str, Any]) -> object:
        """Read as xdist will, and check as a forked box's report is checked: a report the hook
        cannot rebuild, or whose fields other plugins would choke on (a skip's longrepr that is
        not ``(path, line, reason)``...), is refused here instead of an INTERNALERROR there."""
        from pytest_boxlite.remote.transport import _check_report_fields

        # A copy: pytest's rebuilding replaces the dict's longrepr in place, and xdist rebuilds it again.
        rep = self.config.hook.pytest_report_from_serializable(config=self.config, data=copy.deepcopy(data))
        if isinstance(rep, pytest.TestReport):
            _check_report_fields(rep)
        return rep

    # -- the worker's end -------------------------------------------------------------------
    def _hold_finish(self, kwargs: dict[str, Any]) -> bool:
        """Whether a (checked) workerfinished is kept back: while tests are pending, or before the
        controller asked the worker to end, xdist would take it as a clean end and fail on the
        tests it still counts as the worker's.  Unless the worker is stopping for the controller's
        own ``--maxfail`` (then xdist keeps them, as it does for an honest worker)."""
        output = kwargs["workeroutput"]
        if output["shouldfail"] or output["shouldstop"]:
            return False
        if self.pending == 0 and self.shutdown_asked:
            return False
        said = f"a workerfinished (exit status {output['exitstatus']})"
        if self.pending:
            self._complain(f"{said} while {self.pending} of the tests it was given had not run")
        else:
            self._complain(f"{said} the controller did not ask for")
        self.held_finish = True
        return True

    def _at_end(self) -> None:
        """The channel closed.  With tests pending, xdist's crash path fails the first (the one the
        worker was running) and gives the rest to other workers: the refusals go into that
        report.  Without, they come out as a report of their own."""
        if self.held_finish:
            self._let_go()
        if self.finished or not self.complaints:
            return
        if self.pending:
            self.crash_note = self._text()
            self.complaints, self.dropped = [], 0
        else:
            self._flush_at_end()

    def _let_go(self) -> None:
        """End the worker's gateway process (the attach client: its box server then destroys the
        box): after its workerfinished and its channel's end, xdist counts the worker as crashed
        and starts a replacement in the same box slot, which waits until this worker is gone; a
        worker whose pytest ended (``pytest.exit``) would otherwise live on in its box until the
        session's end.  Best effort through execnet's own ``kill`` of a popen gateway's I/O."""
        io = getattr(self.node.gateway, "_io", None)
        kill = getattr(io, "kill", None)
        if callable(kill):
            with contextlib.suppress(Exception):
                kill()

    def note_crash(self, report: pytest.TestReport) -> None:
        """Add the refusals that preceded this worker's crash to xdist's report of it."""
        note, self.crash_note = self.crash_note, None
        if note:
            report.longrepr = f"{report.longrepr}\n{note}"

    # -- a refused event fails the worker's test ----------------------------------------------
    def _complain(self, why: str) -> None:
        if len(self.complaints) < COMPLAINTS_CAP:
            self.complaints.append(why)
        else:
            self.dropped += 1

    def _text(self) -> str:
        more = f"\n(and {self.dropped} more)" if self.dropped else ""
        lines = "\n".join(f"- {shown(c, limit=2 * TEXT_CAP)}" for c in self.complaints)
        return (
            f"pytest-boxlite: the box of xdist worker {self.node.gateway.id} sent what the controller does "
            f"not accept, and it was refused:\n{lines}{more}"
        )

    def _carry_complaints(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The next report of a test fails with the complaints (once): the test whose box sent them."""
        data = dict(kwargs["data"])
        if data.get("when") not in ("call", "teardown"):
            return kwargs
        text = self._text()
        self.complaints, self.dropped = [], 0
        if data.get("outcome") == "failed":
            data["sections"] = [*list(data.get("sections") or []), ("boxlite", text)]
        else:
            data["outcome"], data["longrepr"] = "failed", text
        return {**kwargs, "data": data}

    def _flush_at_end(self) -> None:
        """Complaints no report carried (sent after the worker's last report): a failed teardown
        report of the last test the worker started, so they are not lost.  A worker that started
        none (every logstart refused) has them carried by a test it was given, else by a report
        named after the worker: never dropped in silence."""
        if not self.complaints:
            return
        if self.current is not None:
            nodeid, location = self.current
        elif self.given_ids:
            nodeid = min(self.given_ids)
            location = (nodeid.split("::", 1)[0], None, nodeid)
        else:
            nodeid = f"boxlite-worker-{self.node.gateway.id}"
            location = (nodeid, None, nodeid)
        data = {
            "$report_type": "TestReport",
            "nodeid": nodeid,
            "location": location,
            "keywords": {},
            "outcome": "failed",
            "longrepr": self._text(),
            "when": "teardown",
            "sections": [],
            "duration": 0.0,
            "user_properties": [],
        }
        self.complaints, self.dropped = [], 0
        self.failed += 1
        self._inner(("testreport", {"data": data}))


def clean_workerinfo(info: object) -> tuple[dict[str, Any], list[str]]:
    """``workerready``'s info as xdist's controller and terminal read it (``version`` is printed
    with ``-v``): its text fields escaped and bounded, ``version_info`` a tuple of
    ``(int, int, int, str, int)``, what is missing or mistyped replaced by ``"?"``; and what was
    replaced."""
    problems: list[str] = []
    given: dict[Any, Any] = info if isinstance(info, dict) else {}
    if not isinstance(info, dict):
        problems.append(f"workerinfo is not a dict: {reprlib.repr(info)}")
    out: dict[str, Any] = {}
    for key in WORKERINFO_TEXT:
        value = given.get(key)
        if isinstance(value, str):
            # The version's newlines stay: xdist replaces them when it prints it.
            out[key] = shown(value, line=key != "version", limit=TEXT_CAP)
        else:
            out[key] = "?"
            if given:
                problems.append(f"workerinfo[{key!r}] is not text: {reprlib.repr(value)}")
    vi = given.get("version_info")
    if (
        isinstance(vi, (tuple, list))
        and len(vi) == 5
        and all(_is_int(vi[i]) and 0 <= vi[i] < 1 << 16 for i in (0, 1, 2, 4))
        and isinstance(vi[3], str)
    ):
        out["version_info"] = (vi[0], vi[1], vi[2], shown(vi[3], line=True, limit=64), vi[4])
    else:
        out["version_info"] = (0, 0, 0, "?", 0)
        if given:
            problems.append(f"workerinfo['version_info'] is not a Python version: {reprlib.repr(vi)}")
    return out, problems


def _warning_class(module: object, name: object) -> type[Warning] | None:
    """The warning class ``module.name`` if that module is imported already and it is one; nothing
    is imported (xdist imports the module a worker names, and calls what it finds with the
    worker's arguments)."""
    mod = sys.modules.get(module) if isinstance(module, str) else None
    cls = getattr(mod, name, None) if isinstance(name, str) and not name.startswith("_") else None
    return cls if isinstance(cls, type) and issubclass(cls, Warning) else None


def plain_warning(data: dict[str, Any]) -> dict[str, Any]:
    """A worker's serialized warning made safe for ``xdist.workermanage.unserialize_warning_message``:
    its message and category only classes of warnings already imported here (else its text and
    ``UserWarning``), its source line the worker's text or empty (never read from a host file by
    ``warnings.formatwarning``), its file and source none, its fields text and numbers, every text
    escaped (the warnings summary prints them)."""

    def text(key: str) -> str:
        value = data.get(key)
        return shown(value, limit=65536) if isinstance(value, str) else ""

    message_module, message_class = data.get("message_module"), data.get("message_class_name")
    args = data.get("message_args")
    message_ok = (
        _warning_class(message_module, message_class) is not None
        and isinstance(args, (list, tuple))
        and all(isinstance(a, (str, int, float)) for a in args)
    )
    category_ok = _warning_class(data.get("category_module"), data.get("category_class_name")) is not None
    lineno = data.get("lineno")
    message_args = None
    if message_ok and isinstance(args, (list, tuple)):
        message_args = [shown(a, limit=65536) if isinstance(a, str) else a for a in args]
    out: dict[str, Any] = {
        "message_module": message_module if message_ok else None,
        "message_class_name": message_class if message_ok else None,
        "message_args": message_args,
        "message_str": text("message_str"),
        "category_module": data.get("category_module") if category_ok else "builtins",
        "category_class_name": data.get("category_class_name") if category_ok else "UserWarning",
        "filename": text("filename"),
        "lineno": lineno if _is_int(lineno) and 0 <= lineno < 1 << 31 else 0,
        "file": None,
        "line": text("line"),
        "source": None,
    }
    return out


class _CrashNotes:
    """xdist's ``pytest_handlecrashitem``: a crashed boxed worker's refusals go into the failed
    report xdist makes for the test it was running."""

    def __init__(self) -> None:
        self.guards: list[WorkerGuard] = []

    @pytest.hookimpl
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport, sched: object) -> None:
        node = getattr(report, "node", None)
        for g in self.guards:
            if g.node is node:
                g.note_crash(report)


def guard(node: Any) -> WorkerGuard:
    """Check every event of the boxed xdist worker ``node`` from now on (see :class:`WorkerGuard`)."""
    g = WorkerGuard(node)
    pm = node.config.pluginmanager
    notes = pm.get_plugin(_NOTES_PLUGIN)
    if notes is None:
        notes = _CrashNotes()
        pm.register(notes, _NOTES_PLUGIN)
    notes.guards.append(g)
    return g
