"""Reports the host makes itself, and the words for how a box's test process ended."""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

PHASES = ("setup", "call", "teardown")


def describe_status(code: int | None, *, forked: bool = False) -> str:
    """'exited with status 3' / 'was killed by SIGSEGV'.

    A forked box's init exits with 128+N when the test process dies by signal N (pid 1 of a pid
    namespace cannot die by its own signal), so for forks such codes name the signal.
    """
    if code is None:
        return "died"
    if forked and 128 < code <= 128 + 64:
        code = 128 - code
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def how_it_died(status_file: Path, wait: float = 2.0) -> str:
    """How a warm interpreter ended, read from the attach bridge's status file (bounded wait)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(status_file, "rb") as fh:  # written by our host-side bridge, not the guest
                return describe_status(int(fh.read(32).strip()))
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return describe_status(None)
            time.sleep(0.02)


def make_report(
    item: pytest.Item,
    when: str,
    outcome: str,
    why: str | None,
    log: tuple[str, str] | None,
    duration: float,
    captured: Sequence[tuple[str, str]] = (),
) -> pytest.TestReport:
    """A report for a phase the box did not report itself (``why`` says what happened; ``captured``:
    what the test printed and logged in it, as the box sent it at a timeout)."""
    sections = [*captured, log] if why is not None and log is not None else list(captured)
    return pytest.TestReport(
        nodeid=item.nodeid,
        location=item.location,
        keywords={k: 1 for k in item.keywords},
        outcome=outcome,  # type: ignore[arg-type]
        longrepr=f"[boxlite] {why}" if why else None,
        when=when,  # type: ignore[arg-type]
        sections=sections,
        duration=duration,
        user_properties=list(item.user_properties),
    )


def failed_phase(
    item: pytest.Item,
    when: str,
    why: str,
    log: tuple[str, str] | None,
    duration: float,
    captured: Sequence[tuple[str, str]] = (),
) -> list[pytest.TestReport]:
    """``when`` failed with ``why``; a passed teardown follows so the item is complete."""
    reports = [make_report(item, when, "failed", why, log, duration, captured)]
    if when != "teardown":
        reports.append(make_report(item, "teardown", "passed", None, None, 0.0))
    return reports


def complete(
    item: pytest.Item,
    reports: list[pytest.TestReport],
    why: str,
    log: tuple[str, str] | None,
    duration: float,
    *,
    must_fail: bool = False,
    captured: Sequence[tuple[str, str]] = (),
) -> list[pytest.TestReport]:
    """Add failed reports for the phases the box did not finish.

    ``must_fail``: the test fails even where every phase it reported passed (the box sent something
    the host refused after them: a warning or cache values over a budget); it fails at teardown.
    ``captured``: the sections of what the test printed and logged in the phase it did not finish
    (its timeout's last words), in the failed report.
    """
    done = {r.when for r in reports}
    if "setup" not in done:
        return reports + failed_phase(item, "setup", why, log, duration, captured)
    out = list(reports)
    if "call" not in done and all(r.passed for r in reports):
        out.append(make_report(item, "call", "failed", why, log, duration, captured))
    if must_fail and not any(r.failed for r in out):
        last = make_report(item, "teardown", "failed", why, log, duration, captured)
        return [r for r in out if r.when != "teardown"] + [last]
    if "teardown" not in done:
        out.append(make_report(item, "teardown", "passed", None, None, 0.0))
    return out
