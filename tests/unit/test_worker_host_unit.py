"""The host's reading of a warm interpreter's FORKED answers, against a fake channel.

A warm interpreter runs the project's collection in its box, so its answers are the box's word.
No real box produces forged answers on demand (a forked test cannot reach the warm channel: see
``test_hostile_channel.py::test_forged_fork_answer_fails_no_more_than_a_test``), so a fake channel
injects them here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pytest_boxlite.guest import messages as msg
from pytest_boxlite.remote.warm import WarmInterpreter
from pytest_boxlite.remote.worker_host import ForkedBox, ForkedBoxes


class FakeChannel:
    """Answers ``receive`` from a script; records what is sent."""

    def __init__(self, *answers: tuple[str, Any]) -> None:
        self.answers = list(answers)
        self.sent: list[object] = []

    def receive(self, timeout: float) -> tuple[str, Any]:
        return self.answers.pop(0)

    def send(self, item: object) -> None:
        self.sent.append(item)


def bare_runner() -> ForkedBoxes:
    # Only the parts _sync and _reap_lingering use: a runner without config, gateways or boxes.
    runner = object.__new__(ForkedBoxes)
    runner._lingering = []
    runner._pending = {}
    return runner


def pending_box(worker: WarmInterpreter, n: int) -> ForkedBox:
    return ForkedBox(f"box.{n}", handle=None, worker=worker, child=-1, stream=None, oom_before=0)  # type: ignore[arg-type]


def test_forged_ended_list_is_read_as_pids_only() -> None:
    garbage = [[1], {"a": 1}, "2", 10**40, 1.5, None, True, 7] * 1000
    worker = WarmInterpreter(gateway=None, channel=None, pid=0, status_file=Path("/nonexistent"))
    worker.channel = FakeChannel((msg.FORKED, {"pid": 11, "ended": garbage}), (msg.FORKED, {"pid": 12, "ended": "x"}))
    runner = bare_runner()
    lingering_pid, other_pid = 7, 8
    runner._lingering = [(worker, lingering_pid, float("inf")), (worker, other_pid, float("inf"))]
    boxes = [pending_box(worker, 1), pending_box(worker, 2)]
    runner._pending[worker] = list(boxes)
    runner._sync(worker, 1.0)
    assert [b.child for b in boxes] == [11, 12] and [b.error for b in boxes] == [None, None]
    # 7 (an int among the garbage) was said to have ended; 8 was not, and is still watched.
    assert runner._lingering == [(worker, other_pid, float("inf"))]
