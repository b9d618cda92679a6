"""Report header and terminal summary lines."""

from __future__ import annotations

import shlex
import statistics
from typing import TYPE_CHECKING, Any

import pytest

from pytest_boxlite.runtimes import images_on_request, kind_notes
from pytest_boxlite.session import BoxliteSession

if TYPE_CHECKING:
    from pytest_boxlite.xdist_support import RemoteLedger


def header(session: BoxliteSession, *, controller: bool = False) -> list[str]:
    """``boxlite: runtime=... (why) image=... max-boxes=...``."""
    c = session.choice
    caveat, unused_image = kind_notes(c.kind)
    why = c.reason + (f"; {caveat}" if caveat else "")
    per = " per worker" if controller else ""
    s = session.settings
    image = s.image + (f" (unused: {unused_image})" if unused_image else "")
    if images_on_request(c.kind):
        # Boxes show the host's files unless an image is asked for; then its digest says which.
        root = session.default_spec.root
        image = root.label() if root is not None else "host filesystem"
        if session.image_error is not None:
            image = _unusable(s.image, session.image_error)
    elif s.image.startswith(("oci:", "oci-archive:", "docker-archive:")) and not s.url:
        # vm: the local image's digest (resolved at start), or why it cannot be used
        image = (
            session.image_root(s.image).label()
            if session.image_error is None
            else _unusable(s.image, session.image_error)
        )
    from pytest_boxlite._homefs import limits as home_limits

    return [
        f"boxlite: runtime={c.kind} ({why})",
        f"boxlite: image={image} max-boxes={s.max_boxes}{per} network={'on' if s.network else 'off'}"
        f" home={session.home}",
        # Where this host cannot hold a home rule as designed, the run says so (see _homefs).
        *(f"boxlite: home rule not held as designed: {limit}" for limit in home_limits()),
    ]


def _unusable(image: str, error: str) -> str:
    """The header's image that cannot be used: said once, with why."""
    return f"{image} (cannot be used, no box will start: {error.removeprefix(f'image {image!r} cannot be used: ')})"


def remote_header(specs: list[str], *, local: bool) -> list[str]:
    """What a controller with remote workers says about where their boxes live."""
    where = "the lines above are this machine's (local workers)" if local else "nothing runs in this machine's home"
    return [
        f"boxlite: remote workers ({', '.join(dict.fromkeys(specs))}) box on their own hosts, each under "
        f"that host's home (its PYTEST_BOXLITE_HOME, ini boxlite_home or ~/.cache/pytest-boxlite; "
        f"--boxlite-home names a directory on this machine only); {where}"
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
        # Tests that sat at the debugger's prompt are not in fork_waits (remote.worker_host).
        fw = stats.get("fork_waits") or []
        overhead = f"{statistics.median(fw) * 1000:.1f} ms" if fw else "n/a"
        forked = f"forked {stats['forked']} (overhead p50 {overhead}), "
    return (
        f"boxes booted {stats.get('booted', 0)}, {forked}leased {leased}, reused {stats.get('reused', 0)}, "
        f"warm-lease hit rate {rate}, lease wait p50 {p50:.1f} ms max {mx:.1f} ms, leaked {leaked}"
    )


def summary(
    terminalreporter: pytest.TerminalReporter, session: BoxliteSession, *, remote: RemoteLedger | None = None
) -> None:
    """The ``boxlite`` section at the end of the run (only when boxes were used).

    ``remote``: a controller's record of its remote workers; one line per host (as the workers
    named it), and one per remote worker that went down without reporting.
    """
    rep = session.report
    stats = merge_stats([rep.stats, *rep.worker_stats]) if rep.worker_stats else rep.stats
    used = bool(stats.get("booted") or stats.get("leased") or stats.get("forked"))
    remote_said = remote is not None and remote.eventful
    if not used and not rep.leaked and not rep.reconciled and not rep.kept and not remote_said:
        return  # no box was used: nothing to say
    tr = terminalreporter
    tr.section("boxlite", sep="-")
    leaked = len(rep.leaked) + (sum(len(h.leaked) for h in remote.hosts.values()) if remote is not None else 0)
    if stats:
        tr.write_line(summary_line(stats, leaked))
    if rep.leaked:
        tr.write_line(f"LEAKED boxes (removed at exit): {', '.join(rep.leaked)}", red=True)
    if rep.reconciled:
        tr.write_line(f"removed {len(rep.reconciled)} leftover box(es) of dead sessions: {', '.join(rep.reconciled)}")
    if rep.fork_fallback:
        tr.write_line(f"sandbox boxes were booted, not forked from a warm box: {rep.fork_fallback}", yellow=True)
    home = "" if session.settings.sources.get("home") == "default" else f" --home {shlex.quote(str(session.home))}"
    failed_in = _failed_tests_by_box(tr) if rep.kept else {}
    for name in rep.kept:
        tests = failed_in.get(name)
        tr.write_line(
            f"kept box {name} (failed test): enter it with `python -m pytest_boxlite{home} shell {name}`, "
            f"remove it with `python -m pytest_boxlite{home} clean {name}`"
            + (f"; it ran {', '.join(tests)}" if tests else "")
        )
    if remote is not None:
        _remote_lines(tr, remote)


#: The report property naming the box a test ran in (``(BOX_PROPERTY, box name)`` in
#: ``user_properties``): boxed tests' teardown reports carry it, and a kept sandbox's test's.
BOX_PROPERTY = "boxlite_box"


def _failed_tests_by_box(tr: pytest.TerminalReporter) -> dict[str, list[str]]:
    """The failed tests of this run per box they ran in (from the reports' box property)."""
    boxes: dict[str, set[str]] = {}
    failed: set[str] = set()
    for reports in tr.stats.values():
        for r in reports:
            nodeid = getattr(r, "nodeid", None)
            if not isinstance(nodeid, str):
                continue
            if getattr(r, "failed", False):
                failed.add(nodeid)
            for prop in getattr(r, "user_properties", None) or ():
                if isinstance(prop, tuple) and len(prop) == 2 and prop[0] == BOX_PROPERTY and isinstance(prop[1], str):
                    boxes.setdefault(prop[1], set()).add(nodeid)
    return {box: sorted(ids & failed) for box, ids in boxes.items() if ids & failed}


def host_line(h: Any) -> str:
    """One remote host's line: who ran there, its home, and what its workers booted, leaked and kept."""
    line = (
        f"host {h.host} ({', '.join(h.workers)}; runtime={h.runtime} home={h.home}): boxes booted {h.booted}, "
        f"leaked {len(h.leaked)}, kept {len(h.kept)}"
    )
    if h.reconciled:
        line += f", removed {len(h.reconciled)} leftover box(es) of dead sessions there"
    return line


def _remote_lines(tr: pytest.TerminalReporter, remote: RemoteLedger) -> None:
    for _, h in sorted(remote.hosts.items()):
        tr.write_line(host_line(h))
        if h.leaked:
            tr.write_line(f"LEAKED boxes on host {h.host} (removed there at exit): {', '.join(h.leaked)}", red=True)
        for name in h.kept:
            tr.write_line(
                f"kept box {name} on host {h.host}: there, enter it with "
                f"`python -m pytest_boxlite --home {shlex.quote(h.home)} shell {name}`, remove it with "
                f"`python -m pytest_boxlite --home {shlex.quote(h.home)} clean {name}`"
            )
    for worker, spec in remote.silent:
        tr.write_line(
            f"worker {worker} ({spec}) went down without reporting: the next pytest-boxlite session on that "
            "host (or a replacement worker there) removes what it left",
            yellow=True,
        )
