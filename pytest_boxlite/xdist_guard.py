"""The controller's check of what boxed xdist workers send (``--boxlite-scope=worker -n N``).

In worker scope each xdist worker is a pytest session inside a box, so every event on its execnet
channel is the guest's to forge.  pytest-xdist trusts its workers: a report for a test it never
sent them is logged as that test's outcome, and an unknown or malformed event is an INTERNALERROR
that replaces the worker and then breaks xdist's own bookkeeping.  :class:`WorkerGuard` stands
between each boxed worker's channel and xdist's ``WorkerController.process_from_remote``: an event
that is not one of xdist's, not shaped as xdist sends it, or about a test the controller did not
give that worker, is dropped, and the test the worker was running fails with a report that says
what it sent (the session goes on).  What it lets through is exactly what xdist would have taken.

xdist has no public hook for this: the guard replaces the bound ``process_from_remote`` (and the
two ``send_runtest_*`` methods, to learn what each worker was given) on the node instance, in
``pytest_configure_node``, which xdist calls before it sets the channel's callback.
"""

from __future__ import annotations

import copy
import reprlib
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest

#: The events an xdist 3.x worker sends (``xdist/remote.py``); any other is refused (``logwarning``
#: too: no 3.x worker sends it, and the controller has no handler left for it).
KNOWN_EVENTS = frozenset(
    {
        "collectionstart",
        "workerready",
        "internal_error",
        "workerfinished",
        "logstart",
        "logfinish",
        "testreport",
        "collectreport",
        "teardownreport",
        "collectionfinish",
        "runtest_protocol_complete",
        "unscheduled",
        "warning_recorded",
    }
)

#: Complaints kept per worker until a report carries them (the rest are counted).
COMPLAINTS_CAP = 10
#: Most node ids a worker may say it collected (xdist keeps them all).
COLLECTION_CAP = 1_000_000
#: The first collection a worker of this session reported: the one xdist's scheduler numbers its
#: tests by (the first workers' collections must all be equal; a replacement's that differs is
#: ignored by xdist, which still sends it indices of this one).
_SCHEDULED = pytest.StashKey[list[str]]()


class WorkerGuard:
    """The check on one boxed worker's events (see the module's docstring)."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self.config: pytest.Config = node.config
        self._inner: Callable[[Any], None] = node.process_from_remote
        self._send_some: Callable[[Sequence[int]], None] = node.send_runtest_some
        self._send_all: Callable[[], None] = node.send_runtest_all
        self.ids: list[str] | None = None  # what the worker said it collected
        self.given: Counter[int] = Counter()  # indices sent and not yet completed
        # The node ids of every index sent.  xdist may send a replacement worker its tests before
        # that worker's collectionfinish arrives (another worker's collection reschedules them
        # all), so an index sent then is named once the worker's ids are known.
        self.given_ids: set[str] = set()
        self.sent: set[int] = set()
        self.sent_all = False
        self.current: tuple[str, Any] | None = None  # (nodeid, location) of the last logstart
        self.complaints: list[str] = []
        self.dropped = 0
        node.process_from_remote = self.process_from_remote
        node.send_runtest_some = self.send_runtest_some
        node.send_runtest_all = self.send_runtest_all

    # -- what the controller gives the worker -------------------------------------------------
    def send_runtest_some(self, indices: Sequence[int]) -> None:
        for i in indices:
            self.given[i] += 1
        self.sent.update(indices)
        self._name_given()
        self._send_some(indices)

    def send_runtest_all(self) -> None:
        self.sent_all = True
        if self.ids is not None:
            self.given.update(range(len(self.ids)))
        self._name_given()
        self._send_all()

    def _name_given(self) -> None:
        """The node ids of the indices sent so far (none before the worker's collection), named
        as the controller numbered them: a worker that reports a collection of its own choosing
        cannot rename the tests it was given."""
        if self.ids is None:
            return
        ids = self.config.stash.get(_SCHEDULED, self.ids)
        if self.sent_all:
            self.given_ids.update(ids)
        self.given_ids.update(ids[i] for i in self.sent if 0 <= i < len(ids))

    # -- what the worker sends --------------------------------------------------------------
    def process_from_remote(self, eventcall: Any) -> None:
        """xdist's callback for each object from the worker (and the channel's end marker)."""
        if not (isinstance(eventcall, tuple) and len(eventcall) == 2):
            # xdist's end marker, or a guest's non-event: only the former is xdist's business.
            if eventcall.__class__.__module__.startswith("xdist"):
                self._flush_at_end()
                self._inner(eventcall)
            else:
                self._complain(f"a message that is not an xdist event: {reprlib.repr(eventcall)}")
            return
        name, kwargs = eventcall
        try:
            refused = self._check(name, kwargs)
        except Exception as exc:  # noqa: BLE001 - whatever a hostile event makes the check raise is its refusal
            refused = f"a {str(name)[:50]!r} event the controller could not read ({type(exc).__name__}: {exc})"
        if refused is not None:
            self._complain(refused)
            return
        if name in ("testreport", "teardownreport") and self.complaints:
            kwargs = self._carry_complaints(kwargs)
        if name == "workerfinished":
            self._flush_at_end()
        self._inner((name, kwargs))

    def _check(self, name: object, kwargs: object) -> str | None:
        """Why the event ``name(**kwargs)`` is refused, or ``None`` when xdist may take it."""
        if not isinstance(name, str) or name not in KNOWN_EVENTS:
            return f"an unknown event {reprlib.repr(name)}"
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            return f"a {name!r} event whose arguments are not a dict of names"
        if name == "collectionfinish":
            ids = kwargs.get("ids")
            if self.ids is not None:
                return "a second collectionfinish"
            if not isinstance(ids, list) or len(ids) > COLLECTION_CAP or not all(isinstance(i, str) for i in ids):
                return "a collectionfinish whose ids are not a list of node ids"
            self.ids = list(ids)
            self.config.stash.setdefault(_SCHEDULED, self.ids)
            if self.sent_all:
                self.given.update(range(len(self.ids)))
            self._name_given()
        elif name in ("testreport", "teardownreport"):
            data = kwargs.get("data")
            if not isinstance(data, dict):
                return f"a {name} without its report data"
            nodeid = data.get("nodeid")
            if nodeid not in self.given_ids:
                return f"a report for {reprlib.repr(nodeid)}, a test the controller did not give this worker"
            index = kwargs.get("item_index")
            if index is not None and (not isinstance(index, int) or self.given[index] <= 0):
                return f"a report for item index {reprlib.repr(index)}, which this worker was not given"
            self._readable_report(data)
        elif name == "collectreport":
            if not isinstance(kwargs.get("data"), dict):
                return "a collectreport without its report data"
            self._readable_report(kwargs["data"])
        elif name in ("logstart", "logfinish"):
            nodeid = kwargs.get("nodeid")
            if nodeid not in self.given_ids or set(kwargs) != {"nodeid", "location"}:
                return f"a {name} for {reprlib.repr(nodeid)}, a test the controller did not give this worker"
            if name == "logstart":
                self.current = (nodeid, kwargs["location"])
        elif name == "runtest_protocol_complete":
            index, duration = kwargs.get("item_index"), kwargs.get("duration")
            if set(kwargs) != {"item_index", "duration"} or not isinstance(duration, (int, float)):
                return "a runtest_protocol_complete not shaped as xdist sends it"
            if not isinstance(index, int) or self.given[index] <= 0:
                return (
                    f"a runtest_protocol_complete for item index {reprlib.repr(index)}, which this worker was not given"
                )
            self.given[index] -= 1
        elif name == "workerfinished":
            if not isinstance(kwargs.get("workeroutput"), dict):
                return "a workerfinished without its workeroutput"
        elif name == "workerready" and set(kwargs) - {"workerinfo"}:
            return "a workerready not shaped as xdist sends it"
        elif name == "warning_recorded":
            data = kwargs.get("warning_message_data")
            if not isinstance(data, dict) or set(kwargs) != {"warning_message_data", "when", "nodeid", "location"}:
                return "a warning_recorded not shaped as xdist sends it"
            kwargs["warning_message_data"] = plain_warning(data)
        elif name == "unscheduled" and not isinstance(kwargs.get("indices"), list):
            return "an unscheduled event without its indices"
        return None

    def _readable_report(self, data: dict[str, Any]) -> None:
        """Read as xdist will, and check as a forked box's report is checked: a report the hook
        cannot rebuild, or whose fields other plugins would choke on (a skip's longrepr that is
        not ``(path, line, reason)``...), is refused here instead of an INTERNALERROR there."""
        from pytest_boxlite.remote.transport import _check_report_fields

        # A copy: pytest's rebuilding replaces the dict's longrepr in place, and xdist rebuilds it again.
        rep = self.config.hook.pytest_report_from_serializable(config=self.config, data=copy.deepcopy(data))
        if isinstance(rep, pytest.TestReport):
            _check_report_fields(rep)

    # -- a refused event fails the worker's test ----------------------------------------------
    def _complain(self, why: str) -> None:
        if len(self.complaints) < COMPLAINTS_CAP:
            self.complaints.append(why)
        else:
            self.dropped += 1

    def _text(self) -> str:
        more = f"\n(and {self.dropped} more)" if self.dropped else ""
        lines = "\n".join(f"- {c}" for c in self.complaints)
        return (
            f"pytest-boxlite: the box of xdist worker {self.node.gateway.id} sent what the controller does "
            f"not accept, and it was dropped:\n{lines}{more}"
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
        self._inner(("testreport", {"data": data}))


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
    ``warnings.formatwarning``), its file and source none, its fields text and numbers."""

    def text(key: str) -> str:
        value = data.get(key)
        return value[:65536] if isinstance(value, str) else ""

    message_module, message_class = data.get("message_module"), data.get("message_class_name")
    args = data.get("message_args")
    message_ok = (
        _warning_class(message_module, message_class) is not None
        and isinstance(args, (list, tuple))
        and all(isinstance(a, (str, int, float)) for a in args)
    )
    category_ok = _warning_class(data.get("category_module"), data.get("category_class_name")) is not None
    lineno = data.get("lineno")
    out: dict[str, Any] = {
        "message_module": message_module if message_ok else None,
        "message_class_name": message_class if message_ok else None,
        "message_args": list(args) if message_ok and isinstance(args, (list, tuple)) else None,
        "message_str": text("message_str"),
        "category_module": data.get("category_module") if category_ok else "builtins",
        "category_class_name": data.get("category_class_name") if category_ok else "UserWarning",
        "filename": text("filename"),
        "lineno": lineno if isinstance(lineno, int) and not isinstance(lineno, bool) and 0 <= lineno < 1 << 31 else 0,
        "file": None,
        "line": text("line"),
        "source": None,
    }
    return out


def guard(node: Any) -> WorkerGuard:
    """Check every event of the boxed xdist worker ``node`` from now on (see :class:`WorkerGuard`)."""
    return WorkerGuard(node)
