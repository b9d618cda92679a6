"""What each boxed test left behind (``--boxlite-side-effects``) and what it used (``--boxlite-usage``).

The box computes the list itself (:mod:`pytest_boxlite.guest.changes`: it sees its own writable
layers, process table and environment) and sends one ``CHANGES`` message at the test's end.  Here
the host checks that message (:func:`take`: every field's type and bound, or ``ValueError``, which
the transport turns into the test's failure), applies the ignore patterns again, and records the
result on the test's teardown report: the ``boxlite_side_effects`` property (``none`` for a clean
test; junitxml shows it), under ``fail`` a failed teardown naming what the test left, and the
usage properties.  The terminal summary (:func:`summary`) is made from the reports alone, so it
works the same on an xdist controller.  Every text that came from the box is escaped when shown.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

from pytest_boxlite._shown import shown
from pytest_boxlite.box_changes import FILES_CAP, NOTES_CAP, TEXT_CAP, Changes, take
from pytest_boxlite.guest.changes import _ignored as ignored  # the box's own rule, one copy
from pytest_boxlite.markers import SIDE_EFFECTS_ALL_OFF, SIDE_EFFECTS_MARKED

if TYPE_CHECKING:
    from pytest_boxlite.guest.changes import Watch
    from pytest_boxlite.settings import Settings

__all__ = ["FILES_CAP", "NOTES_CAP", "TEXT_CAP", "Changes", "take"]

MODES = ("off", "report", "fail")
PROPERTY = "boxlite_side_effects"
CPU_PROPERTY = "boxlite_cpu_s"
MEMORY_PROPERTY = "boxlite_peak_memory_mb"
PROCESSES_PROPERTY = "boxlite_max_processes"
#: Where the peak memory came from: ``cgroup`` (the box's own memory cgroup, what the test
#: allocated) or ``rusage`` (the test process's, its children included, the warm interpreter's
#: pages it was forked with included).
SOURCE_PROPERTY = "boxlite_peak_memory_from"
#: Where the CPU time came from: ``cgroup`` (the box's, every process of it) or ``rusage`` (the
#: test process's and its waited-for children's).
CPU_SOURCE_PROPERTY = "boxlite_cpu_from"
#: What the property says of a test that left nothing.
CLEAN = "none"

#: Tests the terminal summary lists in full, and lines per test.
SUMMARY_TESTS = 500
SUMMARY_LINES = 30

_MARKED_KEY = SIDE_EFFECTS_MARKED
#: A worker's box has no session of its own: its settings, for :func:`_settings_value`.
_WORKER_SETTINGS_KEY = pytest.StashKey["Settings"]()
_ALL_OFF_KEY = SIDE_EFFECTS_ALL_OFF


def _all_off(config: pytest.Config) -> bool:
    """Neither side effects (option or any marker) nor usage asked: the default, which then costs
    one stash lookup per call (decided once the session is there, after collection)."""
    off = config.stash.get(_ALL_OFF_KEY, None)
    if off is None:
        from pytest_boxlite.fixtures import SESSION_KEY

        if SESSION_KEY not in config.stash:
            return False  # not decided yet: ask the slow way
        off = (
            _settings_value(config, "side_effects", "off") == "off"
            and not _settings_value(config, "usage", 0)
            and not config.stash.get(_MARKED_KEY, False)
        )
        config.stash[_ALL_OFF_KEY] = off
    return off


def mode_for(config: pytest.Config, item: pytest.Item) -> str:
    """``item``'s mode: its marker's ``side_effects=``, else the session's option."""
    marker = item.get_closest_marker("boxlite")
    value = marker.kwargs.get("side_effects") if marker is not None else None
    if value in MODES:
        return str(value)
    return str(_settings_value(config, "side_effects", "off"))


def _settings_value(config: pytest.Config, name: str, default: Any) -> Any:
    from pytest_boxlite.fixtures import SESSION_KEY

    session = config.stash.get(SESSION_KEY, None)
    settings = session.settings if session is not None else config.stash.get(_WORKER_SETTINGS_KEY, None)
    value: Any = getattr(settings, name, default) if settings is not None else default
    return value


def ignore_patterns(config: pytest.Config) -> tuple[str, ...]:
    """The session's ``boxlite_side_effects_ignore`` patterns."""
    return tuple(_settings_value(config, "side_effects_ignore", ()))


def usage_count(config: pytest.Config) -> int:
    """``--boxlite-usage=N``: how many tests the usage table lists (0: no table, no usage asked)."""
    return int(_settings_value(config, "usage", 0) or 0)


def fork_fields(config: pytest.Config) -> dict[str, Any]:
    """What a ``FORK`` request adds: ``changes`` when a forked box must keep its upper layers."""
    if _all_off(config):
        return {}
    if _settings_value(config, "side_effects", "off") != "off" or config.stash.get(_MARKED_KEY, False):
        return {"changes": True}
    return {}


def run_fields(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """What a ``RUN`` adds for ``item``: nothing when neither side effects nor usage are asked."""
    if _all_off(config):
        return {}
    files = mode_for(config, item) != "off"
    usage = usage_count(config) > 0
    if not files and not usage:
        return {}
    return {"changes": {"files": files, "ignore": list(ignore_patterns(config)), "usage": usage}}


def memory_text(usage: dict[str, int]) -> str:
    """``: its peak ..., its limit ...`` from a box's cgroup usage (``ForkCell.usage``), or ``""``."""
    parts = [
        f"its {what} {usage[key] / (1 << 20):.1f} MiB"
        for key, what in (("peak_memory", "peak"), ("memory_limit", "limit"))
        if key in usage
    ]
    return ": " + ", ".join(parts) if parts else ""


def apply(
    item: pytest.Item,
    changes: Changes | None,
    reports: list[pytest.TestReport],
    box_usage: dict[str, int] | None = None,
) -> list[pytest.TestReport]:
    """Record ``changes`` on ``item``'s teardown report (the last of ``reports``): properties, and
    under ``fail`` a failed teardown naming what the test left.  ``box_usage``: what the box's own
    cgroups counted (``ForkCell.usage``), preferred to the test process's rusage where present."""
    config = item.config
    if changes is None and _all_off(config):
        return reports
    teardown = next((r for r in reversed(reports) if r.when == "teardown"), None)
    if teardown is None:
        return reports
    mode = mode_for(config, item)
    if mode != "off":
        if changes is None:
            teardown.user_properties.append((PROPERTY, "unknown: the box sent no list"))
        else:
            patterns = ignore_patterns(config)
            root = str(config.rootpath)
            changes.files = [f for f in changes.files if not ignored(f[2], patterns, [(root, "")])]
            lines = changes.lines()
            text = "\n".join(lines) if lines else CLEAN
            if changes.notes:
                text += "\n" + "\n".join(f"note: {shown(n, line=True)}" for n in changes.notes)
            teardown.user_properties.append((PROPERTY, text))
            if mode == "fail" and lines:
                why = "[boxlite] this test left side effects (--boxlite-side-effects=fail):\n" + "\n".join(
                    "  " + line for line in lines
                )
                if teardown.passed:
                    teardown.outcome = "failed"
                    teardown.longrepr = why
                else:
                    teardown.sections.append(("boxlite side effects", why))
    if changes is not None and changes.cpu_s is not None and usage_count(config) > 0:
        teardown.user_properties.extend(usage_properties(changes, box_usage or {}))
    return reports


def usage_properties(changes: Changes, box_usage: dict[str, int]) -> list[tuple[str, str]]:
    """The usage properties of one test: each figure from the box's own cgroup where it has one
    (``box_usage``: ``ForkCell.usage``), else from the test process's rusage, and where each came from."""
    out = []
    if "cpu_ns" in box_usage:
        out += [(CPU_PROPERTY, f"{box_usage['cpu_ns'] / 1e9:.3f}"), (CPU_SOURCE_PROPERTY, "cgroup")]
    elif changes.cpu_s is not None:
        out += [(CPU_PROPERTY, f"{changes.cpu_s:.3f}"), (CPU_SOURCE_PROPERTY, "rusage")]
    if "peak_memory" in box_usage:
        out += [(MEMORY_PROPERTY, f"{box_usage['peak_memory'] / (1 << 20):.1f}"), (SOURCE_PROPERTY, "cgroup")]
    elif changes.peak_kib is not None:
        out += [(MEMORY_PROPERTY, f"{changes.peak_kib / 1024:.1f}"), (SOURCE_PROPERTY, "rusage")]
    if "max_processes" in box_usage:
        out.append((PROCESSES_PROPERTY, str(box_usage["max_processes"])))
    return out


def _props(rep: pytest.TestReport) -> dict[str, str]:
    out = {}
    for prop in getattr(rep, "user_properties", ()):
        if isinstance(prop, tuple) and len(prop) == 2 and isinstance(prop[0], str):
            out[prop[0]] = str(prop[1])
    return out


def summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The ``boxlite side effects`` section (each test that left something, sorted by test) and
    the ``--boxlite-usage`` table, from the teardown reports' properties."""
    seen: dict[str, dict[str, str]] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if getattr(rep, "when", None) == "teardown":
                props = _props(rep)
                if PROPERTY in props or CPU_PROPERTY in props:
                    seen[rep.nodeid] = props
    _side_effects_section(terminalreporter, seen)
    _usage_section(terminalreporter, seen)
    if not seen:
        from pytest_boxlite.fixtures import SESSION_KEY

        session = terminalreporter.config.stash.get(SESSION_KEY, None)
        if session is not None:
            hint(terminalreporter, session.settings)


def hint(tr: pytest.TerminalReporter, settings: Settings) -> None:
    """The default (``off``, not set anywhere)'s one line pointing at the option, where a run
    could use it: boxed tests failed in boxes that several tests share (``--boxlite-scope=module``
    or ``worker``), where what one test left can fail the next.  In a box per test nothing of an
    earlier boxed test is left, so a failure there is no order's doing: no line."""
    if settings.sources.get("side_effects", "default") != "default" or settings.scope not in ("module", "worker"):
        return
    failed = {
        rep.nodeid
        for key in ("failed", "error")
        for rep in tr.stats.get(key, ())
        if isinstance(getattr(rep, "nodeid", None), str) and getattr(rep, "when", None) in ("setup", "call", "teardown")
    }
    if failed:
        n = len(failed)
        tr.write_line(
            f"boxlite: {n} test{'s' if n != 1 else ''} failed in boxes shared by several tests "
            f"(--boxlite-scope={settings.scope}): --boxlite-side-effects=report lists what each test left for the next"
        )


def _side_effects_section(tr: pytest.TerminalReporter, seen: dict[str, dict[str, str]]) -> None:
    checked = {n: p[PROPERTY] for n, p in seen.items() if PROPERTY in p}
    if not checked:
        return
    plural = "s" if len(checked) != 1 else ""
    # A clean test's value is "none", then its notes (what could not be seen): counted, not listed.
    dirty = sorted(n for n, text in checked.items() if text.split("\n", 1)[0] != CLEAN)
    notes: dict[str, int] = {}
    for nodeid, text in checked.items():
        if nodeid not in dirty:
            for line in text.split("\n")[1:]:
                notes[line] = notes.get(line, 0) + 1
    if dirty:
        tr.write_sep("=", "boxlite side effects")
        for nodeid in dirty[:SUMMARY_TESTS]:
            tr.write_line(shown(nodeid, line=True))
            lines = checked[nodeid].split("\n")
            for line in lines[:SUMMARY_LINES]:
                tr.write_line(f"    {line}")
            if len(lines) > SUMMARY_LINES:
                tr.write_line(f"    ... {len(lines) - SUMMARY_LINES} more")
        if len(dirty) > SUMMARY_TESTS:
            tr.write_line(f"... {len(dirty) - SUMMARY_TESTS} more tests with side effects (see the junitxml property)")
        tr.write_line(f"boxlite: {len(dirty)} of {len(checked)} boxed test{plural} left side effects")
    else:
        tr.write_line(f"boxlite: no side effects in {len(checked)} boxed test{plural}")
    for line, count in sorted(notes.items())[:NOTES_CAP]:
        tr.write_line(f"boxlite: {line.removeprefix('note: ')} ({count} clean test{'s' if count != 1 else ''})")


def _usage_section(tr: pytest.TerminalReporter, seen: dict[str, dict[str, str]]) -> None:
    n = usage_count(tr.config)
    rows = []
    memory_from, cpu_from = set(), set()
    for nodeid, props in seen.items():
        try:
            row = (float(props.get(MEMORY_PROPERTY, "0")), float(props[CPU_PROPERTY]), nodeid)
        except (KeyError, ValueError):
            continue
        rows.append((*row, props.get(PROCESSES_PROPERTY, "-")))
        memory_from.add(props.get(SOURCE_PROPERTY, "rusage"))
        cpu_from.add(props.get(CPU_SOURCE_PROPERTY, "rusage"))
    if n <= 0 or not rows:
        return
    tr.write_sep("=", f"boxlite usage: top {min(n, len(rows))} boxed tests by peak memory")
    for line in usage_header(memory_from, cpu_from, counted=sum(r[3] != "-" for r in rows), rows=len(rows)):
        tr.write_line(line)
    tr.write_line(f"{'peak MiB':>9} {'CPU s':>8} {'procs':>6}  test")
    for mem, cpu, nodeid, procs in sorted(rows, key=lambda r: (-r[0], -r[1], r[2]))[:n]:
        tr.write_line(f"{mem:9.1f} {cpu:8.3f} {shown(procs, line=True, limit=6):>6}  {shown(nodeid, line=True)}")


def usage_header(memory_from: set[str], cpu_from: set[str], *, counted: int, rows: int) -> list[str]:
    """The usage table's lines saying where its figures came from (``cgroup``, ``rusage``)."""
    memory = {
        "cgroup": "peak memory from each box's own memory cgroup (what its test allocated)",
        "rusage": "peak memory from the test process's rusage, its children included (the warm interpreter's "
        "pages it was forked with counted)",
    }
    cpu = {
        "cgroup": "CPU time from each box's own cgroup (every process of the box)",
        "rusage": "CPU time from the test process's rusage, its children included (those it waited for)",
    }
    out = [f"({memory.get(s, s)})" for s in sorted(memory_from)]
    out += [f"({cpu.get(s, s)})" for s in sorted(cpu_from)]
    if counted == rows:
        out.append("(processes: the most the box's pids cgroup held at once)")
    elif counted:
        out.append(
            "(processes: the most the box's pids cgroup held at once; -: not counted for that test, a box "
            "without a pids cgroup or a later test of a module's box, whose peak counts from the box's start)"
        )
    else:
        out.append(
            "(processes: not counted: no box had a pids cgroup with pids.peak: an ordinary user's boxes, a "
            "kernel without pids.peak, a booted or VM box)"
        )
    return out


class WorkerScopeWatch:
    """In a ``--boxlite-scope=worker`` box (the session's, or an xdist worker's): each test's side
    effects and usage, as the host records them in the other scopes.  One box runs every test, so
    a test's side effects are what changed in it between the test's start and its end: the
    project, the home, /tmp, /run and /dev compared whole (``guest/changes.worker_places``), its
    processes, environment, directory and umask.  Usage: the test process's rusage.  Registered in
    every worker box (plugin.py); it decides once, after collection, whether anything is asked
    (the option, ``--boxlite-usage`` or a test's marker), and otherwise does nothing per test."""

    NAME = "boxlite-worker-side-effects"

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        config.stash[_WORKER_SETTINGS_KEY] = settings
        self.quiet = _output_inodes(os.environ.pop(OUTPUT_ENV, ""))
        self.active = False
        self._watch: Watch | None = None
        #: The last test's walks' end (``Watch.kept``): the next test's start, not walked again.
        self._kept: Any = None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        marked = any(
            m.kwargs.get("side_effects") in ("report", "fail") for item in items for m in item.iter_markers("boxlite")
        )
        self.active = self.settings.side_effects != "off" or self.settings.usage > 0 or marked

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
        previous, self._kept = self._kept, None
        if self.active:
            fields = run_fields(self.config, item)
            if fields:
                from pytest_boxlite.guest.changes import Watch, worker_places

                places = worker_places(item.config) if fields["changes"]["files"] else None
                fields["changes"]["quiet"] = self.quiet
                self._watch = Watch([], fields["changes"], item.config, True, places=places, previous=previous)
        try:
            return (yield)
        finally:
            if self._watch is not None:  # the test ended before its teardown's report
                self._watch.close()
                self._watch = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
        report: pytest.TestReport = yield
        watch = self._watch
        if report.when == "teardown" and watch is not None:
            self._watch = None
            fields = watch.finish()
            # Its end is the next test's start (pytest's own hooks run in between, no test code).
            self._kept = watch.kept
            # What the marker's env= set for the test is the plugin's, put back after it.
            marker = item.get_closest_marker("boxlite")
            own = set((marker.kwargs.get("env") or {}) if marker is not None else ())
            fields["env"] = [e for e in fields.get("env", []) if e[0] not in own]
            apply(item, take(fields), [report])
        return report

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.active and not hasattr(self.config, "workerinput"):  # xdist: the controller says it
            hint(terminalreporter, self.settings)


#: The variable through which ``--boxlite-scope=worker`` tells its box the inode numbers of the
#: files the run's output goes to (see :func:`output_env`).
OUTPUT_ENV = "PYTEST_BOXLITE_OUTPUT_INODES"


def output_env() -> dict[str, str]:
    """For the box that runs a whole session (``session_in_box``): the inode numbers of the regular
    files this process's stdout and stderr go to (``pytest > out.log``).  The box shows such a file,
    in the project, growing as the host writes it: not a test's side effect."""
    inodes = []
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            inodes.append(str(st.st_ino))
    return {OUTPUT_ENV: ",".join(inodes)} if inodes else {}


def _output_inodes(text: str) -> list[int]:
    """:data:`OUTPUT_ENV`'s value: at most two inode numbers; anything else is dropped."""
    return [int(p) for p in text.split(",")[:2] if p.isdigit() and len(p) < 20]
