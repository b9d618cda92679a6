"""guest/forks.py's ``_Forked``, alone: how a warm interpreter keeps the exit codes of its boxes.

The class runs in the warm interpreter; here its children are real processes.  What this layer
forces, which a real run only meets on a busy machine, is the order: a box whose test died before
the warm interpreter read the next FORK is reaped by that FORK, and the host asks how it ended
(WAIT) only after more.
"""

from __future__ import annotations

import os
import time
from typing import Any

from pytest_boxlite.guest.forks import _Forked


def _load() -> dict[str, Any]:
    return {"_Forked": _Forked}


def _child(code: int, hold: tuple[int, int] | None = None) -> int:
    pid = os.fork()
    if pid == 0:
        if hold is not None:
            os.close(hold[1])
            os.read(hold[0], 1)  # until the test closes its end
        os._exit(code)
    return pid


def _reaped(forked: Any, pid: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if pid in forked.reap():
            return True
        time.sleep(0.01)
    return False


def test_a_box_reaped_by_later_forks_keeps_its_exit_code() -> None:
    """CI once reported a boxed ``os._exit(3)`` as 'the test process in the box died': the next
    FORK reaped its box and the one after it forgot the code before the host's WAIT came."""
    forked = _load()["_Forked"]()
    pid = _child(3)
    forked.add(pid)
    assert _reaped(forked, pid)
    forked.reap()
    forked.reap()
    assert forked.wait(pid, timeout=0) == 3
    assert forked.wait(pid + 1_000_000, timeout=0) is None  # no box of this interpreter's


def test_the_codes_of_the_last_kept_reaped_boxes_are_kept_and_running_ones_stay() -> None:
    forked = _load()["_Forked"]()
    forked.KEPT = 2
    r, w = os.pipe()
    try:
        running = _child(0, hold=(r, w))
        forked.add(running)
        done = [_child(code) for code in (10, 11, 12)]
        for pid in done:
            forked.add(pid)
            assert _reaped(forked, pid)
        forked.reap()
        assert forked.codes == {running: None, done[1]: 11, done[2]: 12}
        assert forked.wait(running, timeout=0) is None
    finally:
        os.close(w)
        os.close(r)
    assert forked.wait(running, timeout=10) == 0
