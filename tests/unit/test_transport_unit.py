"""The host's reading of one boxed test's stream (``remote/transport.drain``), against fake streams.

Every message of a run carries the run's sequence number; what an earlier run left behind (a
lingering thread of the test before, a late ``DONE``) carries an older one and must change nothing
of this run.  A real box sends such messages only by a race, never at a chosen point, and no real
box floods stale messages or times out on cue: a scripted stream (a fake, for this unit layer)
injects them.  The item and its config are real (the running test's own); reports are real
``TestReport`` objects, serialized by pytest's own hook as the box serializes them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import pytest

from pytest_boxlite.guest import messages as msg
from pytest_boxlite.remote import transport
from pytest_boxlite.remote.transport import STALE_CAP, Deadline, drain

Message = tuple[str, dict[str, Any]]
When = Literal["setup", "call", "teardown"]
PHASES: tuple[When, ...] = ("setup", "call", "teardown")


class ScriptedStream:
    """A :class:`~pytest_boxlite.remote.transport.Stream` whose ``messages`` call number ``n``
    yields ``scripts[n]``'s messages, then raises its exception (``None``: the stream ends).
    ``read`` counts the messages handed out: what the host read of the box."""

    def __init__(self, *scripts: tuple[Iterable[Message], BaseException | None]) -> None:
        self.scripts = list(scripts)
        self.read = 0

    def messages(self, deadline: Deadline) -> Iterator[Message]:
        assert self.scripts, "the host read the stream more times than the test scripted"
        found, end = self.scripts.pop(0)
        for message in found:
            self.read += 1
            yield message
        if end is not None:
            raise end


@pytest.fixture
def item(request: pytest.FixtureRequest) -> pytest.Item:
    """The running test's own item: a real one, with this session's config (an inline pytester
    run for an item costs seconds on a loaded machine)."""
    node = request.node
    assert isinstance(node, pytest.Item)
    return node


def report(item: pytest.Item, when: When, seq: int) -> Message:
    """A ``REPORT`` of ``item``'s phase ``when`` as a box sends it."""
    rep = pytest.TestReport(item.nodeid, item.location, {}, "passed", None, when)
    data = item.config.hook.pytest_report_to_serializable(config=item.config, report=rep)
    return msg.REPORT, {"data": data, "seq": seq}


def whole_run(item: pytest.Item, seq: int) -> list[Message]:
    return [*(report(item, when, seq) for when in PHASES), (msg.DONE, {"seq": seq})]


def test_messages_of_an_earlier_run_change_nothing(item: pytest.Item) -> None:
    """An earlier run's error, exit, reports and ``DONE`` (and messages with no number, or a
    number of another type) are dropped: this run ends at its own ``DONE``, with its own reports."""
    stale: list[Message] = [
        (msg.ERROR, {"text": "the test before broke", "seq": 1}),
        (msg.EXIT, {"reason": "the test before called pytest.exit()", "returncode": 3, "seq": 1}),
        report(item, "call", 1),
        (msg.DONE, {"seq": 1}),
        (msg.DONE, {}),
        (msg.DONE, {"seq": "2"}),
    ]
    stream = ScriptedStream(([*stale, *whole_run(item, 2)], None))
    out = drain(stream, item, float("inf"), box="b", seq=2)
    assert (out.done, out.error, out.exit, out.refused) == (True, None, None, None)
    assert [r.when for r in out.reports] == ["setup", "call", "teardown"]
    assert stream.read == len(stale) + 4


def test_stale_messages_up_to_the_cap_are_dropped_and_the_run_goes_on(item: pytest.Item) -> None:
    stale = [(msg.OUTPUT, {"text": "x", "seq": 1})] * STALE_CAP
    out = drain(ScriptedStream(([*stale, *whole_run(item, 2)], None)), item, float("inf"), box="b", seq=2)
    assert out.done and out.refused is None


def test_a_flood_of_stale_messages_fails_the_test_and_reading_stops(item: pytest.Item) -> None:
    """One message over :data:`STALE_CAP`: the test fails saying so, and the host reads no further
    (the stream never ends by itself here)."""
    flood = itertools.repeat((msg.OUTPUT, {"text": "x", "seq": 1}))
    stream = ScriptedStream((flood, None))
    out = drain(stream, item, float("inf"), box="b", seq=2)
    assert out.refused == f"more than {STALE_CAP} messages that belong to no running test"
    assert not out.done
    assert stream.read == STALE_CAP + 1


def test_after_a_timeout_only_this_runs_last_words_are_kept(item: pytest.Item) -> None:
    """The stream times out; the host reads on for this run's ``LASTWORDS`` only (an earlier run's,
    and anything else, are passed over)."""
    late: list[Message] = [
        (msg.LASTWORDS, {"when": "call", "out": "the test before's words", "seq": 1}),
        report(item, "call", 2),  # too late: the test has timed out already
        (msg.LASTWORDS, {"when": "call", "out": "mine", "seq": 2}),
        (msg.LASTWORDS, {"when": "call", "out": "said twice", "seq": 2}),
    ]
    stream = ScriptedStream(([report(item, "setup", 2)], TimeoutError()), (late, None))
    out = drain(stream, item, float("inf"), box="b", seq=2)
    assert out.timed_out and not out.done
    assert out.last_words == [("Captured stdout call", "mine")]
    assert [r.when for r in out.reports] == ["setup"]
    assert stream.read == 1 + 3  # it stopped at its own last words


def test_waiting_for_last_words_reads_a_bounded_number_of_messages(item: pytest.Item) -> None:
    flood = itertools.repeat((msg.LASTWORDS, {"when": "call", "out": "not mine", "seq": 1}))
    stream = ScriptedStream(([], TimeoutError()), (flood, None))
    out = drain(stream, item, float("inf"), box="b", seq=2)
    assert out.timed_out and out.last_words == []
    assert stream.read == transport._LAST_WORDS_READS + 1


def test_a_stream_that_breaks_is_a_hang_up(item: pytest.Item) -> None:
    broken = EOFError("the box's channel closed")
    out = drain(ScriptedStream(([report(item, "setup", 2)], broken)), item, float("inf"), box="b", seq=2)
    assert out.hung_up is broken and not out.done and out.refused is None


def test_done_without_setup_or_teardown_reports_is_refused(item: pytest.Item) -> None:
    stream = ScriptedStream(([report(item, "call", 2), (msg.DONE, {"seq": 2})], None))
    out = drain(stream, item, float("inf"), box="b", seq=2)
    assert not out.done and out.refused == "DONE without a setup or teardown report"


def test_an_unknown_message_of_this_run_fails_the_test(item: pytest.Item) -> None:
    stream = ScriptedStream(([("FORK", {"seq": 2}), *whole_run(item, 2)], None))
    out = drain(stream, item, float("inf"), box="b", seq=2)
    assert out.refused == "an unexpected message 'FORK' while running a test"
    assert stream.read == 1
