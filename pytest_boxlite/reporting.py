"""Report header and terminal summary lines."""

from __future__ import annotations

import shlex
import statistics
from typing import Any

import pytest

from pytest_boxlite.runtimes import kind_notes
from pytest_boxlite.session import BoxliteSession


def header(session: BoxliteSession, *, controller: bool = False) -> list[str]:
    """``boxlite: runtime=... (why) image=... replicas=...``."""
    c = session.choice
    caveat, unused_image = kind_notes(c.kind)
    why = c.reason + (f"; {caveat}" if caveat else "")
    per = " per worker" if controller else ""
    s = session.settings
    image = s.image + (f" (unused: {unused_image})" if unused_image else "")
    return [
        f"boxlite: runtime={c.kind} ({why})",
        f"boxlite: image={image} replicas={s.replicas}{per} network={'on' if s.network else 'off'} home={session.home}",
    ]


def merge_stats(many: list[dict[str, Any]]) -> dict[str, Any]:
    """Add up the stats of several processes (xdist workers)."""
    out: dict[str, Any] = {"lease_waits": []}
    for st in many:
        for k, v in st.items():
            if isinstance(v, list):
                out[k] = out.get(k, []) + v
            elif k == "max_live":
                out[k] = max(out.get(k, 0), v)
            else:
                out[k] = out.get(k, 0) + v
    return out


def summary_line(stats: dict[str, Any], leaked: int) -> str:
    waits = stats.get("lease_waits") or []
    leased = stats.get("leased", 0)
    hits = stats.get("warm_hits", 0)
    rate = f"{100.0 * hits / leased:.0f}%" if leased else "n/a"
    p50 = statistics.median(waits) * 1000 if waits else 0.0
    mx = max(waits) * 1000 if waits else 0.0
    forked = ""
    if stats.get("forked"):
        fw = stats.get("fork_waits") or [0.0]
        forked = f"forked {stats['forked']} (overhead p50 {statistics.median(fw) * 1000:.1f} ms), "
    return (
        f"boxes booted {stats.get('booted', 0)}, {forked}leased {leased}, reused {stats.get('reused', 0)}, "
        f"warm-lease hit rate {rate}, lease wait p50 {p50:.1f} ms max {mx:.1f} ms, leaked {leaked}"
    )


def summary(terminalreporter: pytest.TerminalReporter, session: BoxliteSession) -> None:
    """The ``boxlite`` section at the end of the run (only when boxes were used)."""
    rep = session.report
    stats = merge_stats([rep.stats, *rep.worker_stats]) if rep.worker_stats else rep.stats
    used = bool(stats.get("booted") or stats.get("leased") or stats.get("forked"))
    if not used and not rep.leaked and not rep.reconciled and not rep.kept:
        return  # no box was used: nothing to say
    tr = terminalreporter
    tr.section("boxlite", sep="-")
    if stats:
        tr.write_line(summary_line(stats, len(rep.leaked)))
    if rep.leaked:
        tr.write_line(f"LEAKED boxes (removed at exit): {', '.join(rep.leaked)}", red=True)
    if rep.reconciled:
        tr.write_line(f"removed {len(rep.reconciled)} leftover box(es) of dead sessions: {', '.join(rep.reconciled)}")
    home = "" if session.settings.sources.get("home") == "default" else f" --home {shlex.quote(str(session.home))}"
    for name in rep.kept:
        tr.write_line(
            f"kept box {name} (failed test): enter it with `python -m pytest_boxlite{home} shell {name}`, "
            f"remove it with `python -m pytest_boxlite{home} clean {name}`"
        )
