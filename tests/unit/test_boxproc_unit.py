"""boxproc's cleanup against signals (the process-level behaviour is in tests/test_xdist.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pytest_boxlite import boxproc


def test_a_signal_during_a_destroy_ends_the_server_only_once_the_destroy_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A box's destroy runs once: cut short by SIGTERM, the cleanup's second call would not finish
    it, and its record stayed behind (CI: a box server killed with its controller, kill -9).  The
    destroy blocks the signal in its own thread, so the kernel hands it to another thread, and
    Python still runs the handler in the main thread: the handler must wait for the destroy."""
    monkeypatch.setattr(boxproc, "_ended_by", [])
    monkeypatch.setattr(boxproc, "_deferred", [], raising=False)
    monkeypatch.setattr(boxproc, "_destroying", [], raising=False)
    steps: list[str] = []

    class Box:
        name = "pbx-unit"

        def destroy(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:  # Python code, where a pending handler would run
                steps.append("working")
            steps.append("destroyed")

    # Another thread that takes signals, as a box server's worker thread does: started before the
    # destroy (a thread started during it would inherit the destroy's blocked signals).
    other = threading.Thread(target=time.sleep, args=(2.0,), daemon=True)
    other.start()
    previous = signal.signal(signal.SIGTERM, boxproc._exit_on_signal)
    try:
        with pytest.raises(SystemExit) as exc:
            boxproc._destroy(Box())  # type: ignore[arg-type]
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert steps[-1] == "destroyed"
    assert exc.value.code == 128 + signal.SIGTERM
    assert boxproc._ended_by == [signal.SIGTERM]
