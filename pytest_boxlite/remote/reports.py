"""Reports the host makes itself: an item's complete reports once its box has ended
(:func:`finish`), and those for what a box did not report."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pytest

from pytest_boxlite import side_effects

if TYPE_CHECKING:
    from pytest_boxlite.remote.transport import Outcome
    from pytest_boxlite.remote.worker_host import Ended

TIMED_OUT = "timed out after {:.0f}s; the box was killed (--boxlite-timeout or the marker's timeout)"


def finish(item: pytest.Item, out: Outcome, ended: Ended) -> list[pytest.TestReport]:
    """The complete reports of ``item``'s run: what its box said (``out``, as drained), completed
    with failed reports that say what happened where it did not finish (``ended``: how the box
    ended, its log), or its setup's failure where it could not be run."""
    if ended.failure is not None:
        return failed_phase(item, "setup", ended.failure, ended.log, ended.duration)
    if out.error is not None:
        return failed_phase(item, "setup", out.error, ended.log, ended.duration)
    if out.done or out.exit is not None:
        return side_effects.apply(item, out.changes, out.reports, ended.usage)
    if out.timed_out:
        why = TIMED_OUT.format(ended.timeout)
    elif out.refused is not None:
        why = f"the box sent {out.refused}; the box was killed"
    else:
        why = ended.how
    # What the host refused (or a timeout) fails the test even after phases that passed.
    refused = out.timed_out or out.refused is not None
    return complete(item, out.reports, why, ended.log, ended.duration, must_fail=refused, captured=out.last_words)


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
