"""How a boxed test's messages reach the host, and the loop that reads them.

:class:`ForkStream`: newline-delimited JSON on a Unix socket, from the fork that runs the test
(fresh or in place; the warm interpreter's execnet channel carries control messages only).

It yields ``(name, fields)`` pairs in the vocabulary of :mod:`pytest_boxlite.guest.messages`.
Everything from a box is hostile: :func:`drain` bounds what it reads, checks every message's name,
shape and node id, and turns anything unexpected into a failure of that one test (the session
goes on).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import inspect
import json
import os
import re
import reprlib
import socket
import stat
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import execnet
import pytest

from pytest_boxlite import side_effects
from pytest_boxlite.guest import messages as msg
from pytest_boxlite.remote.debug_relay import DebugRelay

#: The phases of a test's run, as its reports name them.
PHASES = ("setup", "call", "teardown")


class RefusedMessage(Exception):
    """A box sent something the host does not accept (malformed, oversized or foreign)."""


#: A deadline (``time.monotonic()``), or what gives it now: a test's deadline moves on while its
#: debugger waits for the user (see ``debug_relay``).
Deadline = float | Callable[[], float]


def _due(deadline: Deadline) -> float:
    return deadline() if callable(deadline) else deadline


class Stream(Protocol):
    def messages(self, deadline: Deadline) -> Iterator[tuple[str, dict[str, Any]]]:
        """Messages until the sender ends the stream; ``TimeoutError`` at ``deadline``."""
        ...


def _checked(message: object) -> tuple[str, dict[str, Any]]:
    if (
        not isinstance(message, (tuple, list))
        or len(message) != 2
        or not isinstance(message[0], str)
        or not isinstance(message[1], dict)
    ):
        raise RefusedMessage(f"a message that is not (name, fields): {reprlib.repr(message)}")
    return message[0], message[1]


class ForkStream:
    """JSON lines from a forked box.  The buffer grows linearly and no line exceeds LINE_CAP."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self._buf = bytearray()
        #: Called before each wait on the box (``DebugRelay.wait_input``: while the box's debugger
        #: waits for the user's line, that is what the host waits for).
        self.idle: Callable[[], None] | None = None

    def messages(self, deadline: Deadline) -> Iterator[tuple[str, dict[str, Any]]]:
        scanned = 0  # bytes of the buffer known to hold no newline: each byte is scanned once
        while True:
            end = self._buf.find(b"\n", scanned)
            while end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[: end + 1]
                scanned = 0
                try:
                    message = json.loads(line, object_hook=msg.untag)
                except (ValueError, TypeError, RecursionError) as exc:
                    raise RefusedMessage(f"a line that is not JSON ({type(exc).__name__}): {line[:200]!r}") from None
                yield _checked(message)
                end = self._buf.find(b"\n")
            scanned = len(self._buf)
            if len(self._buf) > msg.LINE_CAP:
                raise RefusedMessage(f"a message longer than {msg.LINE_CAP} bytes")
            if self.idle is not None:
                self.idle()
            left = _due(deadline) - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.conn.settimeout(left)
            chunk = self.conn.recv(1 << 16)
            if not chunk:
                return
            self._buf += chunk

    def answer(self, fields: dict[str, Any]) -> None:
        """Answer the box's debugger: one JSON line on its socket (guest/debugger.py's SocketAnswers)."""
        line = json.dumps([msg.DEBUG, fields]) + "\n"
        with contextlib.suppress(OSError):  # the box is gone: the stream says so next
            self.conn.sendall(line.encode())


@dataclasses.dataclass
class Outcome:
    """What one test's stream said before it ended."""

    reports: list[pytest.TestReport] = dataclasses.field(default_factory=list)
    done: bool = False
    error: str | None = None
    exit: tuple[str, int] | None = None
    refused: str | None = None  # why the stream was refused (RefusedMessage)
    timed_out: bool = False
    hung_up: BaseException | None = None  # the channel broke (the box died)
    warnings: int = 0
    warning_bytes: int = 0
    side_messages: int = 0
    report_bytes: int = 0
    #: At a timeout: what the test had printed and logged in its running phase (``LASTWORDS``),
    #: as report sections.
    last_words: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    #: What the test left behind and used (``CHANGES``, checked: :mod:`pytest_boxlite.side_effects`).
    changes: side_effects.Changes | None = None
    #: Seconds the relayed debugger waited at its prompt for the user: the box's overhead cannot
    #: be told from it (``--pdb``'s prompt lies outside every report's duration).
    paused: float = 0.0


#: Reports of one boxed test (subtests and reruns make many) and their total text the host keeps.
REPORTS_CAP = 100_000
REPORT_BYTES_CAP = 64 << 20

#: Warnings of one boxed test the host keeps (the terminal reporter holds every one); the rest
#: are counted and said in one warning.
WARNINGS_CAP = 1000

#: Messages of earlier runs (left behind by a test's lingering thread) dropped before giving up.
STALE_CAP = 1000

#: What the host keeps of all boxed tests of one session together (each test is within its own
#: caps above; these bound the sum): report text (the terminal reporter holds every report, passed
#: ones included), warnings and the bytes of ``config.cache`` values written for boxes.  The test
#: whose message would go over one fails, saying so; what it sent is not kept.
SESSION_REPORT_BYTES = 256 << 20
SESSION_WARNINGS = 10_000
SESSION_WARNING_BYTES = 64 << 20
SESSION_CACHE_BYTES = 64 << 20


@dataclasses.dataclass
class SessionBudget:
    """What this session's host has kept so far of what boxes sent (see ``SESSION_*``).

    ``share``: under ``pytest -n N`` every xdist worker keeps its own budget and the controller
    receives all of them, so each worker may keep ``1/N`` of each ``SESSION_*`` cap: the session's
    sum stays within the caps (a worker that gets the heaviest tests reaches its share first).
    """

    report_bytes: int = 0
    warnings: int = 0
    warning_bytes: int = 0
    cache_bytes: int = 0
    share: int = 1

    def cap(self, total: int) -> int:
        """This process's part of the session-wide cap ``total``."""
        return total // self.share

    def take_report(self, size: int, what: str = "report text") -> None:
        """Count ``size`` bytes of report text, or raise :class:`RefusedMessage` (naming ``what``) over the budget."""
        if self.report_bytes + size > self.cap(SESSION_REPORT_BYTES):
            raise over_budget(what, self.report_bytes, size, SESSION_REPORT_BYTES, self.share)
        self.report_bytes += size


_BUDGET_KEY = pytest.StashKey[SessionBudget]()


def session_budget(config: pytest.Config) -> SessionBudget:
    """This session's :class:`SessionBudget` (kept in ``config.stash``: one per session, not per module)."""
    budget = config.stash.get(_BUDGET_KEY, None)
    if budget is None:
        budget = config.stash[_BUDGET_KEY] = SessionBudget(share=_workers(config))
    return budget


def _workers(config: pytest.Config) -> int:
    """How many xdist workers share this session's budgets: 1 unless this process is one of them."""
    workerinput = getattr(config, "workerinput", None)  # set by pytest-xdist on its workers
    count = workerinput.get("workercount") if isinstance(workerinput, dict) else None
    return count if isinstance(count, int) and count > 0 else 1


def over_budget(what: str, used: int | str, adding: int, cap: int, share: int = 1) -> RefusedMessage:
    """The clear failure of the test whose message would take the session over a budget
    (``share``: the xdist workers that split it, see :class:`SessionBudget`)."""
    whose = "all boxed tests of this session" if share == 1 else f"this xdist worker's boxed tests (1/{share} of it)"
    return RefusedMessage(
        f"{what} over the session's budget: {adding} more after {used} of {cap // share} kept for {whose} "
        f"(the session's cap, {cap}, bounds the host's memory and disk); what this message held was not kept"
    )


def drain(stream: Stream, item: pytest.Item, deadline: float, *, box: str, seq: int) -> Outcome:
    """Read one test's messages until ``DONE``; never raises for what the box does.

    ``box`` names the box (its coverage data is kept in a file of its own until pytest-cov
    combines); ``seq`` is the run's number, which every message of this run carries.
    """
    out = Outcome()
    stale = 0
    # A boxed test's debugger is relayed to this terminal; the answers go back on the box's
    # socket (polled with stdin).
    if isinstance(stream, ForkStream):
        relay = DebugRelay(item, stream.answer, fd=stream.conn.fileno())
        stream.idle = relay.wait_input
    else:
        relay = DebugRelay(item, None)
    try:
        for name, fields in stream.messages(lambda: deadline + relay.paused):
            if fields.get("seq") != seq:
                stale += 1
                if stale > STALE_CAP:
                    raise RefusedMessage(f"more than {STALE_CAP} messages that belong to no running test")
                continue
            try:
                if name == msg.DEBUG:
                    relay.handle(fields)
                    continue
                if _handle(out, item, name, fields, box):
                    break
            except RefusedMessage:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever a box's message makes the host raise fails this test only
                raise RefusedMessage(
                    f"a {name[:50]!r} message the host could not take ({type(exc).__name__}: {exc})"
                ) from None
    except RefusedMessage as exc:
        out.refused = str(exc)
    except TimeoutError:
        out.timed_out = True
        if isinstance(stream, ForkStream):
            stream.idle = None
        relay.close()
        if not out.last_words:
            _await_last_words(stream, item, out, seq)
    except (EOFError, OSError, execnet.RemoteError, execnet.HostNotFound) as exc:
        out.hung_up = exc
    finally:
        # The test is done (or its box): nothing more is relayed, and pytest's capture is back on.
        if isinstance(stream, ForkStream):
            stream.idle = None
        relay.close()
        out.paused = relay.paused
    dropped = out.warnings - WARNINGS_CAP
    if dropped > 0 or out.warning_bytes > msg.WRITE_BACK_BYTES:
        _relay_warning(
            item,
            {
                "message": f"pytest-boxlite: this boxed test recorded {out.warnings} warnings "
                f"({out.warning_bytes} bytes of text); only the first ones within "
                f"{WARNINGS_CAP} warnings and {msg.WRITE_BACK_BYTES} bytes are kept",
                "category": "PytestWarning",
                "module": "pytest",
            },
        )
    if out.done and out.error is None and out.exit is None:
        missing = [w for w in ("setup", "teardown") if w not in {r.when for r in out.reports}]
        if missing:
            out.done = False
            out.refused = f"DONE without a {' or '.join(missing)} report"
    return out


#: After a test's timeout, how long the host waits for the box's ``LASTWORDS`` before it kills the
#: box: the box sends them when the same bound passes by its own clock (a few ms later).
LAST_WORDS_GRACE = 2.0
#: Messages read (and dropped) while waiting for them: what a box could send in that time is bounded.
_LAST_WORDS_READS = 1000


def _await_last_words(stream: Stream, item: pytest.Item, out: Outcome, seq: int) -> None:
    """Read on for :data:`LAST_WORDS_GRACE` seconds, for this run's ``LASTWORDS`` only: the test
    has timed out already, so nothing else it sends now counts; never raises."""
    try:
        for n, (name, fields) in enumerate(stream.messages(time.monotonic() + LAST_WORDS_GRACE)):
            if n >= _LAST_WORDS_READS:
                return
            if name == msg.LASTWORDS and fields.get("seq") == seq:
                out.last_words = _last_words(item.config, fields)
                return
    except (RefusedMessage, TimeoutError, EOFError, OSError, execnet.RemoteError, execnet.HostNotFound):
        return


def _last_words(config: pytest.Config, fields: dict[str, Any]) -> list[tuple[str, str]]:
    """A ``LASTWORDS`` message as the sections pytest gives a phase (``Captured stdout call``, ...):
    text only, each capped, within the session's report budget (else none)."""
    when = fields.get("when")
    when = when if when in PHASES else "call"
    sections: list[tuple[str, str]] = []
    for key, title in (("out", "stdout"), ("err", "stderr"), ("log", "log")):
        text = fields.get(key)
        if isinstance(text, str) and text:
            sections.append((f"Captured {title} {when}", msg.cap(_text(text))))
    size = sum(len(c) for _, c in sections)
    try:
        session_budget(config).take_report(size, "the timed-out test's output")
    except RefusedMessage as refused:
        return [("boxlite", str(refused))]
    return sections


def kept_report(config: pytest.Config, item: pytest.Item, data: object) -> pytest.TestReport:
    """A report a box sent outside a test's stream (the shared fixtures' teardown), rebuilt and
    checked as every report is, and kept within the session's report budget (else ``RefusedMessage``)."""
    rep = _report(config, item, data)
    session_budget(config).take_report(report_size(rep))
    return rep


def report_size(rep: pytest.TestReport) -> int:
    """The text of ``rep`` the host keeps (what the session's report budget counts)."""
    # longreprtext renders through a new TerminalWriter even when there is nothing to render: a
    # passed test's report (most of them) has no longrepr, and so no text.
    failure = len(rep.longreprtext) if rep.longrepr is not None else 0
    return failure + sum(len(c) for _, c in rep.sections)


def _handle(out: Outcome, item: pytest.Item, name: str, fields: dict[str, Any], box: str) -> bool:
    """Act on one message of the running test; True when it ends the test (``DONE``)."""
    config = item.config
    if name == msg.REPORT:
        # Many reports are legitimate (a subtest each, reruns); their total size is what is bounded.
        rep = _report(config, item, fields.get("data"))
        size = report_size(rep)
        out.report_bytes += size
        if len(out.reports) >= REPORTS_CAP or out.report_bytes > REPORT_BYTES_CAP:
            raise RefusedMessage(f"more than {REPORTS_CAP} reports or {REPORT_BYTES_CAP} bytes of them for one test")
        session_budget(config).take_report(size)
        out.reports.append(rep)
    elif name == msg.WARNING:
        text_size = len(str(fields.get("message", ""))) + len(str(fields.get("line", "")))
        out.warnings += 1
        out.warning_bytes += text_size
        if out.warnings <= WARNINGS_CAP and out.warning_bytes <= msg.WRITE_BACK_BYTES:
            budget = session_budget(config)
            most = budget.cap(SESSION_WARNINGS)
            if budget.warnings >= most or budget.warning_bytes + text_size > budget.cap(SESSION_WARNING_BYTES):
                used = f"{budget.warnings} warnings and {budget.warning_bytes} bytes"
                raise over_budget(f"a warning (at most {most})", used, text_size, SESSION_WARNING_BYTES, budget.share)
            budget.warnings += 1
            budget.warning_bytes += text_size
            _relay_warning(item, fields)
    elif name == msg.OUTPUT:
        _relay_output(config, fields)
    elif name == msg.LASTWORDS:
        # Sent as the bound passes by the box's clock, which may be before the host's: kept for the
        # timeout's report (the first only); a test that finishes in time reports its own output.
        if not out.last_words:
            out.last_words = _last_words(config, fields)
    elif name in (msg.CACHE, msg.COVERAGE, msg.FILES):
        # The guest sends each at most once per test: more is a flood (of the host's disk).
        out.side_messages += 1
        if out.side_messages > 10:
            raise RefusedMessage("more than 10 cache/coverage/file messages for one test")
        if name == msg.CACHE:
            _store_cache(config, fields.get("values"))
        elif name == msg.COVERAGE:
            _store_coverage(config, fields, box)
        else:
            _store_files(config, fields.get("files"))
    elif name == msg.CHANGES:
        if out.changes is not None:
            raise RefusedMessage("a second changes message for one test")
        try:
            out.changes = side_effects.take(fields)
        except ValueError as exc:
            raise RefusedMessage(f"a changes message the host refused: {exc}") from None
    elif name == msg.EXIT:
        code = fields.get("returncode")
        if code is None:
            code = int(pytest.ExitCode.INTERRUPTED)  # pytest.exit() without one: what pytest ends with
        if not isinstance(code, int) or isinstance(code, bool):
            raise RefusedMessage(f"pytest.exit() with a returncode that is not an int: {reprlib.repr(code)}")
        out.exit = (str(fields.get("reason", ""))[:1000], code)
    elif name == msg.ERROR:
        out.error = str(fields.get("text", ""))[: msg.FIELD_CAP]
    elif name == msg.DONE:
        out.done = True
        return True
    else:
        raise RefusedMessage(f"an unexpected message {name[:50]!r} while running a test")
    return False


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _report(config: pytest.Config, item: pytest.Item, data: object) -> pytest.TestReport:
    # Any report kind the host's plugins can rebuild is fine (pytest's subtests send their own);
    # what comes back must be a TestReport of the running item.
    if not isinstance(data, dict):
        raise RefusedMessage(f"a report that is not a TestReport (not a mapping): {reprlib.repr(data)}")
    data = _plain(data, 0)
    try:
        rep = config.hook.pytest_report_from_serializable(config=config, data=data)
    except Exception as exc:  # noqa: BLE001 - whatever the box's bytes make pytest raise fails this test only
        raise RefusedMessage(f"a report pytest could not read ({type(exc).__name__}: {exc})") from None
    if not isinstance(rep, pytest.TestReport) or rep.nodeid != item.nodeid or rep.when not in PHASES:
        got = type(rep).__name__, getattr(rep, "nodeid", None), getattr(rep, "when", None)
        raise RefusedMessage(
            f"a report that is not a TestReport of the running test: {got!r} while running {item.nodeid!r}"
        )
    _check_report_fields(rep)
    # The guest caps these; a hostile one may not have: cap again.
    rep.sections = [(str(t)[:200], msg.cap(str(c))) for t, c in rep.sections]
    if rep.longrepr is not None and len(rep.longreprtext) > msg.FIELD_CAP:
        rep.longrepr = msg.cap(rep.longreprtext, "of this failure")
    return rep


_SURROGATES = re.compile("[\ud800-\udfff]")
#: Deepest nesting of a report's serialized form (pytest's own is about 8 deep; chained
#: exceptions add a level or two each).
_REPORT_DEPTH = 64


def _text(value: str) -> str:
    """``value`` encodable as UTF-8: a lone surrogate (``"\\ud800"``, or a byte a decoder escaped)
    becomes U+FFFD, so no plugin's encoder on the host (execnet's under ``-n``, junitxml) fails on it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATES.sub("\ufffd", value)
    return value


def _plain(obj: object, depth: int) -> Any:
    """A copy of a box's serialized report made of JSON's types only (tuples too, as pytest uses
    them), every string encodable and every int of a sane size; anything else fails the test."""
    kind = type(obj)
    if kind is str:
        return _text(obj)  # type: ignore[arg-type]
    if obj is None or kind is bool or kind is float:
        return obj
    if kind is int:
        if abs(obj) >= 1 << 63:  # type: ignore[arg-type]
            raise RefusedMessage(f"a report with a number that big: {reprlib.repr(obj)}")
        return obj
    if depth >= _REPORT_DEPTH:
        raise RefusedMessage(f"a report nested deeper than {_REPORT_DEPTH} levels")
    if kind is list or kind is tuple:
        items = [_plain(x, depth + 1) for x in obj]  # type: ignore[attr-defined]
        return items if kind is list else tuple(items)
    if kind is dict:
        out = {}
        for key, value in obj.items():  # type: ignore[attr-defined]
            if type(key) is not str:
                raise RefusedMessage(f"a report with a key that is not text: {reprlib.repr(key)}")
            out[_text(key)] = _plain(value, depth + 1)
        return out
    raise RefusedMessage(f"a report with a value of type {kind.__name__[:50]}: {reprlib.repr(obj)}")


#: Attributes of a rebuilt TestReport that are its own (pytest's fields, and what its plugins add:
#: ``wasxfail``); any other (pytest's subtests add theirs) may not hide what the class defines
#: (a method: ``toterminal=5`` would break the terminal reporter).
_REPORT_FIELDS = frozenset(vars(pytest.TestReport("x", ("x", None, "x"), {}, "passed", None, "call"))) | {"wasxfail"}


#: Outcomes a boxed test's report may have: pytest's, and pytest-rerunfailures' "rerun".
OUTCOMES = ("passed", "failed", "skipped", "rerun")


def _check_report_fields(rep: pytest.TestReport) -> None:
    """The fields other plugins unpack (junitxml, terminal, -r) have the shapes pytest gives them."""
    pairs = (
        isinstance(rep.sections, list)
        and all(isinstance(x, tuple) and len(x) == 2 and all(isinstance(y, str) for y in x) for x in rep.sections)
        and isinstance(rep.user_properties, list)
        and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in rep.user_properties)
    )
    location = rep.location
    located = (
        isinstance(location, tuple)
        and len(location) == 3
        and isinstance(location[0], str)
        and (location[1] is None or _is_int(location[1]))
        and isinstance(location[2], str)
    )
    shaped = (
        rep.outcome in OUTCOMES
        and isinstance(rep.duration, (int, float))
        and isinstance(rep.keywords, dict)
        and (rep.longrepr is None or isinstance(rep.longrepr, (str, tuple)) or hasattr(rep.longrepr, "toterminal"))
    )
    if not (pairs and located and shaped):
        raise RefusedMessage(f"a report whose fields are not shaped as pytest's: {reprlib.repr(vars(rep))}")
    hiding = [k for k in vars(rep) if k not in _REPORT_FIELDS and hasattr(type(rep), k)]
    if hiding:
        raise RefusedMessage(f"a report with attributes that hide the report's own: {reprlib.repr(hiding)}")
    wasxfail = vars(rep).get("wasxfail")
    if wasxfail is not None and not isinstance(wasxfail, str):
        raise RefusedMessage(f"a report whose wasxfail is not text: {reprlib.repr(wasxfail)}")
    longrepr = rep.longrepr
    if isinstance(longrepr, tuple) or (rep.outcome == "skipped" and wasxfail is None):
        # A skip's (path, line, reason), as pytest makes it: -rs and junitxml unpack exactly that.
        skip = (
            isinstance(longrepr, tuple)
            and len(longrepr) == 3
            and isinstance(longrepr[0], str)
            and _is_int(longrepr[1])
            and isinstance(longrepr[2], str)
        )
        if not skip or rep.outcome != "skipped":
            shape = reprlib.repr(longrepr)
            raise RefusedMessage(
                f"a {rep.outcome!r} report whose longrepr is not a skip's (path, line, reason): {shape}"
            )
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and not (
        isinstance(getattr(crash, "path", None), str)
        and _is_int(getattr(crash, "lineno", None))
        and isinstance(getattr(crash, "message", None), str)
    ):
        raise RefusedMessage(f"a report whose crash location is not (path, line, message): {reprlib.repr(vars(crash))}")
    if len(rep.sections) > 1000 or len(rep.user_properties) > 10_000:
        raise RefusedMessage("a report with more than 1000 sections or 10000 properties")


def _category(module: object, qualname: object) -> type[Warning]:
    """The warning class the guest named, if the host already has it; never imports anything."""
    mod = sys.modules.get(module) if isinstance(module, str) else None
    obj: object = mod
    for part in str(qualname).split(".") if mod is not None else ():
        # getattr_static: a module's __getattr__ (a lazy import) must not run on a box's word.
        obj = inspect.getattr_static(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, Warning) else UserWarning


def _relay_warning(item: pytest.Item, fields: dict[str, Any]) -> None:
    """Record a warning from the box on the host, as pytest's warnings plugin does for local tests."""
    category = _category(fields.get("module"), fields.get("category"))
    text = msg.cap(str(fields.get("message", "")), "of this warning")
    try:
        message = category(text)
    except Exception:  # noqa: BLE001 - a warning class whose constructor wants more than a message
        message, category = UserWarning(text), UserWarning
    # ``line``: the source line, as the box read it.  Given (even empty), formatwarning prints it
    # instead of reading ``filename`` through linecache on the host: a box names any file it likes.
    line = fields.get("line")
    wm = warnings.WarningMessage(
        message=message,
        category=category,
        filename=str(fields.get("filename", "?"))[:4096],
        lineno=_int(fields.get("lineno"), 0),
        line=line.strip().split("\n", 1)[0][:1000] if isinstance(line, str) else "",
    )
    item.ihook.pytest_warning_recorded.call_historic(
        kwargs=dict(warning_message=wm, when="runtest", nodeid=item.nodeid, location=None)
    )


def _relay_output(config: pytest.Config, fields: dict[str, Any]) -> None:
    """With ``-s``: print what the boxed test printed, where a local test's output would appear."""
    text = fields.get("text")
    if not isinstance(text, str):
        raise RefusedMessage("live output that is not text")
    text = text[: 1 << 17]  # the guest sends at most 64 KiB a message
    if fields.get("stream") == "stderr":
        sys.stderr.write(text)
        sys.stderr.flush()
    else:
        # Through pytest's terminal writer, so the progress lines around it stay in step.
        config.get_terminal_writer().write(text, flush=True)


_CACHE_KEY = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


def _store_cache(config: pytest.Config, values: object) -> None:
    """Store a box's ``config.cache`` values in the host's cache, as the test would have locally.

    Keys become paths under the cache directory: only plain relative names are accepted.
    """
    cache = getattr(config, "cache", None)
    if cache is None:
        return
    if not isinstance(values, dict) or len(values) > 1000:
        raise RefusedMessage("cache values that are not a small dict")
    total = 0
    for key, value in values.items():
        if not isinstance(key, str) or len(key) > 500 or not _CACHE_KEY.match(key) or ".." in key.split("/"):
            raise RefusedMessage(f"a cache key that is not a plain relative name: {str(key)[:200]!r}")
        size = len(json.dumps(value))
        if size > msg.FIELD_CAP:
            raise RefusedMessage(f"a cache value over {msg.FIELD_CAP} bytes for {key!r}")
        total += size
    # Every value is checked before any is stored: a message over the budget stores nothing.
    budget = session_budget(config)
    if budget.cache_bytes + total > budget.cap(SESSION_CACHE_BYTES):
        raise over_budget("cache values", budget.cache_bytes, total, SESSION_CACHE_BYTES, budget.share)
    budget.cache_bytes += total
    for key, value in values.items():
        cache.set(key, value)


def _coverage_roots(config: pytest.Config) -> tuple[str, ...]:
    """Where measured source files may lie: what the box sees of the host (project, sys.path)."""
    return tuple(os.path.join(os.path.abspath(p), "") for p in (str(config.rootpath), *sys.path) if p)


def _store_coverage(config: pytest.Config, fields: dict[str, Any], box: str) -> None:
    """Keep a box's coverage data beside the host's, where pytest-cov's combine step finds it.

    Written through coverage's API from plain numbers; file names must be Python files under the
    host directories the box sees (so a report never quotes another host file on a box's word).
    One data file per warm box, read before it is added to: every box forked from that warm box
    sends what it ran under the warm box's name, and each must add to the total, not replace it
    (coverage erases a data file it writes without having read it first).
    """
    coverage = sys.modules.get("coverage")
    cov = coverage.Coverage.current() if coverage is not None else None
    if coverage is None or cov is None:
        return  # coverage is not measured on the host: nothing to merge into
    files, arcs = fields.get("files"), fields.get("arcs")
    if not isinstance(files, dict) or not isinstance(arcs, bool) or len(files) > 100_000:
        raise RefusedMessage("coverage data that is not {file: lines}")
    roots = _coverage_roots(config)
    measured: dict[str, Any] = {}
    for name, found in files.items():
        ok_name = (
            isinstance(name, str) and name.endswith(".py") and os.path.normpath(name) == name and name.startswith(roots)
        )
        if not ok_name:
            raise RefusedMessage(f"coverage for a file outside the project and sys.path: {str(name)[:200]!r}")
        if not isinstance(found, list) or len(found) > 1_000_000:
            raise RefusedMessage(f"coverage data for {name!r} that is not a list")
        if arcs:
            if not all(isinstance(a, list) and len(a) == 2 and all(_is_line(x) for x in a) for a in found):
                raise RefusedMessage(f"coverage arcs for {name!r} that are not pairs of numbers")
            measured[name] = [(a, b) for a, b in found]
        else:
            if not all(_is_line(x) for x in found):
                raise RefusedMessage(f"coverage lines for {name!r} that are not numbers")
            measured[name] = found
    suffix = "boxlite." + re.sub(r"[^A-Za-z0-9_.-]", "_", box)[:100]
    data = coverage.CoverageData(basename=os.path.abspath(cov.config.data_file), suffix=suffix)
    data.read()  # what earlier tests of this warm box sent stays
    if arcs:
        data.add_arcs(measured)
    else:
        data.add_lines(measured)
    data.write()


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_line(x: object) -> bool:
    """A line number (negative in arcs: entries and exits) of a plausible source file."""
    return _is_int(x) and abs(x) <= 10_000_000  # type: ignore[arg-type]


_FILE_PART = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def _store_files(config: pytest.Config, files: object) -> None:
    """Write files a box handed back (see ``messages.WRITE_BACK``) under the invocation directory.

    Only plain names below a WRITE_BACK directory, at most WRITE_BACK_FILES / _BYTES; every
    directory on the way must be a real directory (a link there is refused, never followed) and
    the file is opened with O_NOFOLLOW.
    """
    if not isinstance(files, dict) or len(files) > msg.WRITE_BACK_FILES:
        raise RefusedMessage("handed-back files that are not a small {path: data} mapping")
    total = 0
    base = Path(config.invocation_params.dir)
    for rel, encoded in files.items():
        parts = rel.split("/") if isinstance(rel, str) else []
        under = any(rel.startswith(top + "/") for top in msg.WRITE_BACK) if isinstance(rel, str) else False
        if not under or len(parts) > 8 or not all(_FILE_PART.match(p) and p not in (".", "..") for p in parts):
            raise RefusedMessage(f"a handed-back file outside {msg.WRITE_BACK}: {str(rel)[:200]!r}")
        try:
            data = base64.b64decode(str(encoded), validate=True)
        except ValueError:
            raise RefusedMessage(f"handed-back data for {rel!r} that is not base64") from None
        total += len(data)
        if total > msg.WRITE_BACK_BYTES:
            raise RefusedMessage(f"more than {msg.WRITE_BACK_BYTES} bytes of handed-back files")
        try:
            _write_below(base, parts, data)
        except OSError as exc:
            raise RefusedMessage(f"a handed-back file the host could not write ({rel!r}: {exc})") from None


def _write_below(base: Path, parts: list[str], data: bytes) -> None:
    """``base/parts...`` = data, creating real directories; refuses links on the way."""
    where = base
    for part in parts[:-1]:
        where = where / part
        try:
            st = os.lstat(where)
        except FileNotFoundError:
            os.mkdir(where, 0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise RefusedMessage(f"a handed-back file below {str(where)!r}, which is not a plain directory")
    fd = os.open(where / parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
