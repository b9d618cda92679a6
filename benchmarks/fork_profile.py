"""Per-phase profile of one boxed trivial test (``--boxlite``, a fresh forked box per test), and the
physical floor of the same steps on this machine, measured alone.

**Profile.**  It writes ``N`` trivial tests into one module and runs them ``R`` times with
``python -m pytest --boxlite`` (namespace runtime).  A generated ``conftest.py`` stamps
``time.monotonic()`` (one clock for the host and every box: pid and user namespaces do not change
CLOCK_MONOTONIC) at fixed points:

* on the host: ``logstart``, ``run_in`` (the RUN sent to the test's box, made ahead and accepted),
  the FORK round trip for the next test's box (``_fork_ahead``), the box's messages drained, the
  reports settled, ``logreport``, ``logfinish``;
* in the box: the code the host sends to the box's interpreter is extended (only in this run: the
  conftest wraps ``WarmInterpreters.__init__``) with wrappers around ``clone_box`` (which also numbers
  the boxes, so every stamp says which box it is from), ``os.fork``, the fresh box's steps and the
  guest's runtest protocol; the warm interpreter's ``RUSAGE_CHILDREN`` at each clone gives the CPU
  of the boxes it has reaped.  Each stamp also carries the process's own CPU time and page faults
  (a clone starts both at zero).  The warm interpreter and each box's pid 1 write their stamps to
  a duplicate of the warm interpreter's stderr (its box log, which pytest's capture never
  redirects), read by the host at the end; a box's test process points that descriptor at its
  own log, so its stamps come back on its teardown report (``user_properties``).

Three tables, medians over the steady-state tests (the first ``--skip`` of each run are left out:
the fork parent's boot and its first boxes): the test's own path (the phases the host waits
through, from its logstart to the next test's, with the box that ran it), and the making of a box
(clone -> pid 1 -> the test process waiting for its RUN), which runs while the test before it runs,
and the CPU and page faults of the box's test process by step, beside its pid 1's.

**Floor.**  The same steps alone, inside a pytest session of a module of ``N`` tests in this process
(pytest imported, the module collected: as large as a box's warm interpreter): a fork and the
parent's wait; a fork whose child unshares new user, mount, uts, ipc, pid and net namespaces; the
same plus id maps, a tmpfs and an overlay mount; a fork that also forks a pid 1 in the new pid
namespace; a ``posix_spawn`` of ``/bin/sh``; guest/fresh.py's ``clone_box`` (one clone(2) into the
box's namespaces, ids mapped); and a fork that runs one trivial test's runtest protocol (what
pytest-forked pays per test).  Wall and CPU (the parent's and its reaped children's), medians of
``--floor-reps`` each.  Root only for the mount steps (skipped otherwise, with the reason).

Standard library only, besides pytest and pytest_boxlite.  Progress to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks._bench import (
    QUIET_ARGS,
    RunFailed,
    Table,
    clean_env,
    failure_text,
    leak_check,
    log,
    machine_header,
    option,
    run_bounded,
    seconds,
)

ARGS = QUIET_ARGS

#: Appended to the guest's bootstrap before its last statement (``if __name__ == "__channelexec__":``):
#: it wraps the bootstrap's ``prepare``, after which the guest modules are importable.
GUEST_PROBE = r"""
import os as _pbx_os
import resource as _pbx_resource
import time as _pbx_time

_PBX_FD = _pbx_os.dup(2)
_pbx_os.environ["PBXPROF_FD"] = str(_PBX_FD)
_PBX_BOX = [0]  # the box a stamp belongs to: set in each box's pid 1, inherited by its test process


def _pbx_mark(label):
    # The process's own CPU beside the clock: a clone starts at zero, so a box's stamps say
    # what each of its phases cost it (a wait for the host costs none).
    ru = _pbx_resource.getrusage(_pbx_resource.RUSAGE_SELF)
    line = "PBXPROF %d %s %.9f %.9f %d\n" % (
        _PBX_BOX[0], label, _pbx_time.monotonic(), _pbx_time.process_time(), ru.ru_minflt
    )
    _pbx_os.write(_PBX_FD, line.encode())
    _PBX_KEPT.append(line)


# A box's test process points every descriptor on the warm interpreter's stderr (this one's too) at
# its own log, which the host keeps to itself: its stamps go back on its teardown report
# (user_properties, see the conftest) from this list, which the conftest finds on the os module.
_PBX_KEPT = []
_pbx_os._pbx_kept = _PBX_KEPT


def _pbx_wrap(module, name, label=None):
    inner = getattr(module, name)
    label = label or name.strip("_")

    def wrapped(*a, **k):
        _pbx_mark(label + ">")
        try:
            return inner(*a, **k)
        finally:
            _pbx_mark(label + "<")

    setattr(module, name, wrapped)


_pbx_fork = _pbx_os.fork


def _pbx_fork_marked():
    _pbx_mark("fork>")
    pid = _pbx_fork()
    _pbx_mark("fork<" + ("parent" if pid else "child"))
    return pid


_pbx_os.fork = _pbx_fork_marked
_pbx_exit = _pbx_os._exit


def _pbx_exit_marked(code):
    _pbx_mark("exit")
    _pbx_exit(code)


_pbx_os._exit = _pbx_exit_marked
_PBX_MOUNTS = []


def _pbx_install():
    # Wrap the guest modules' box phases (once the bootstrap has put the host's sys.path in place).
    from pytest_boxlite.guest import forks, layers

    mount_inner = layers._mount

    def mount(libc, src, target, fstype, flags, data):
        t = _pbx_time.monotonic()
        try:
            return mount_inner(libc, src, target, fstype, flags, data)
        finally:
            _PBX_MOUNTS.append(_pbx_time.monotonic() - t)

    layers._mount = mount
    clone_inner = forks.clone_box

    def clone_box(*a, **k):
        # The boxes this interpreter made and reaped so far, CPU seconds (each parent in a box waits
        # for its child, so a reaped box's whole tree is counted).
        ru = _pbx_resource.getrusage(_pbx_resource.RUSAGE_CHILDREN)
        _pbx_os.write(_PBX_FD, ("PBXCPU %d %.6f\n" % (_PBX_BOX[0], ru.ru_utime + ru.ru_stime)).encode())
        _PBX_BOX[0] += 1
        _pbx_mark("clone>")
        pid = clone_inner(*a, **k)
        if pid <= 0:  # 0: the box's pid 1; IN_TEST (-1): its test process, forked by a bare init
            _pbx_os.environ["PBXPROF_BOX"] = str(_PBX_BOX[0])
            del _PBX_KEPT[:]  # the warm interpreter's, sent already
        _pbx_mark("clone<" + ("parent" if pid > 0 else "child"))
        return pid

    forks.clone_box = clone_box
    for n in ("_cut_channel", "fresh_box", "enter_test_namespaces", "_init"):
        _pbx_wrap(forks, n)
    fresh_inner = forks.fresh_box

    def fresh_box(*a, **k):
        try:
            return fresh_inner(*a, **k)
        finally:
            line = "PBXMOUNTS %d %d %.9f\n" % (_PBX_BOX[0], len(_PBX_MOUNTS), sum(_PBX_MOUNTS))
            _pbx_os.write(_PBX_FD, line.encode())
            del _PBX_MOUNTS[:]

    forks.fresh_box = fresh_box


_pbx_prepare = prepare


def prepare(cfg):
    _pbx_prepare(cfg)
    _pbx_install()
"""

CONFTEST = r'''
"""benchmarks profile-fork: per-phase stamps (host side, and the guest's runtest protocol)."""

import json
import os
import resource
import time

import pytest

GUEST = bool(os.environ.get("PYTEST_BOXLITE_GUEST"))
MARKS = []
LOGS = {}
CPU = []  # the host process's CPU seconds at each logstart
KEPT = []  # the boxes' test processes' stamps, from their teardown reports


def mark(label, nodeid=None):
    if label == "logstart":
        CPU.append(time.process_time())
    if GUEST:
        fd = os.environ.get("PBXPROF_FD")
        if fd:
            box = int(os.environ.get("PBXPROF_BOX", "0"))
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            line = "PBXPROF %d %s %.9f %.9f %d\n" % (box, label, time.monotonic(), time.process_time(), faults)
            os.write(int(fd), line.encode())
            getattr(os, "_pbx_kept", []).append(line)
    else:
        MARKS.append((label, time.monotonic(), nodeid))


if not GUEST:
    from pytest_boxlite.remote import transport as tp
    from pytest_boxlite.remote import warm as wm
    from pytest_boxlite.remote import worker_host as wh

    PROBE = os.environ["PBXPROF_GUEST_PROBE"]
    _init = wm.WarmInterpreters.__init__

    def __init__(self, *a, **k):
        _init(self, *a, **k)
        tail = 'if __name__ == "__channelexec__":'
        assert self._source.count(tail) == 1, "the guest source changed: update benchmarks/fork_profile.py"
        self._source = self._source.replace(tail, open(PROBE).read() + "\n" + tail)

    wm.WarmInterpreters.__init__ = __init__

    def wrap(owner, name, label):
        inner = getattr(owner, name)

        def wrapped(*a, **k):
            mark(label + ">")
            try:
                return inner(*a, **k)
            finally:
                mark(label + "<")

        setattr(owner, name, wrapped)

    for _name, _label in (
        ("_reap_lingering", "host.reap"),
        ("_accept_fork", "host.accept"),
        ("_settle", "host.settle"),
        ("close", "host.close"),
        ("run_in", "host.run_in"),
        ("_fork_ahead", "host.ahead"),
        ("end", "host.end"),
    ):
        wrap(wh.ForkedBoxes, _name, _label)
    # The executor calls the drain on the transport module (one owner per step), so it is wrapped there.
    wrap(tp, "drain", "host.drain")
    _fork = wh.ForkedBoxes.fork

    def fork(self, item, lease, **k):
        LOGS[lease.handle.name] = str(getattr(lease.handle, "log_path", ""))
        return _fork(self, item, lease, **k)

    wh.ForkedBoxes.fork = fork
    _box = wh.ForkedBox

    def forked_box(*a, **k):
        mark("host.forked")  # built right after FORKED is received
        return _box(*a, **k)

    wh.ForkedBox = forked_box


def pytest_runtest_logstart(nodeid, location):
    mark("logstart", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    mark("logfinish", nodeid)


def pytest_runtest_logreport(report):
    mark("logreport." + report.when)
    for key, lines in report.user_properties:
        if key == "pbxprof" and not GUEST:
            KEPT.extend(lines)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if GUEST and call.when == "teardown":
        mark("makereport.teardown")
        report.user_properties.append(("pbxprof", list(getattr(os, "_pbx_kept", []))))
    return report


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    mark("guest.protocol>" if GUEST else "host.protocol>")
    try:
        return (yield)
    finally:
        mark("guest.protocol<" if GUEST else "host.protocol<")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    mark("test.call>")
    try:
        return (yield)
    finally:
        mark("test.call<")


def pytest_sessionfinish(session):
    if GUEST:
        return
    guest = []
    box_cpu = []
    lines = list(KEPT)
    for name, path in LOGS.items():
        try:
            lines += open(path).read().splitlines()
        except OSError as exc:
            raise RuntimeError(f"fork_profile: cannot read the log of {name}: {exc}") from exc
    for line in lines:
        f = line.split()
        if len(f) == 6 and f[0] == "PBXPROF":
            guest.append((f[2], float(f[3]), int(f[1]), float(f[4]), int(f[5])))
        elif len(f) == 4 and f[0] == "PBXMOUNTS":
            guest.append(("mounts:%s" % f[2], float(f[3]), int(f[1]), 0.0, 0))
        elif len(f) == 3 and f[0] == "PBXCPU":
            box_cpu.append(float(f[2]))
    with open(os.environ["PBXPROF_OUT"], "w") as fh:
        json.dump({"host": MARKS, "guest": guest, "host_cpu": CPU, "box_cpu": box_cpu}, fh)
'''


def write_suite(work: Path, n: int) -> None:
    work.mkdir(parents=True)
    (work / "pytest.ini").write_text("[pytest]\n")
    (work / "conftest.py").write_text(CONFTEST)
    (work / "pbx_guest_probe.py.txt").write_text(GUEST_PROBE)
    (work / "test_trivial.py").write_text("".join(f"def test_{i}():\n    pass\n\n\n" for i in range(n)))


def timelines(data: dict[str, Any]) -> tuple[list[list[tuple[str, float]]], dict[int, list[tuple[str, float]]]]:
    """Each test's stamps in time order (logstart of one test to logstart of the next: the host's,
    and those of the box that ran the test), and every box's own stamps, by box."""
    host = data["host"]
    starts = [t for label, t, _ in host if label == "logstart"]
    host_events = sorted(((label, t) for label, t, _ in host), key=lambda e: e[1])
    boxes: dict[int, list[tuple[str, float]]] = defaultdict(list)
    mounts: list[tuple[int, float]] = []
    cpu: dict[int, dict[str, tuple[float, int]]] = defaultdict(dict)
    for label, t, box, used, faults in data["guest"]:
        if label.startswith("mounts:"):
            mounts.append((int(label.split(":")[1]), t))  # (count, seconds): not a stamp
        else:
            boxes[box].append(("box." + label, t))
            cpu[box].setdefault("box." + label, (used, faults))
    for stamps in boxes.values():
        stamps.sort(key=lambda e: e[1])
    ran = {
        box: next(t for label, t in stamps if label == "box.guest.protocol>")
        for box, stamps in boxes.items()
        if any(label == "box.guest.protocol>" for label, _ in stamps)
    }
    out = []
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else float("inf")
        mine = [b for b, t in ran.items() if start <= t < end]
        events = [e for e in host_events if start <= e[1] < end]
        for b in mine[:1]:
            events += [e for e in boxes[b] if start <= e[1] < end]
        out.append(sorted(events, key=lambda e: e[1]))
    data["_mounts"] = mounts
    data["_cpu"] = cpu
    return out, boxes


#: The test's own path (critical: the host waits through each): (name, from stamp, to stamp).
PHASES: list[tuple[str, str, str]] = [
    ("host: logstart -> RUN sent (the box made ahead, accepted)", "logstart", "host.run_in>"),
    ("host: RUN sent -> the box's runtest protocol starts", "host.run_in>", "box.guest.protocol>"),
    ("  (of which: FORK request for the next test's box)", "host.ahead>", "host.ahead<"),
    ("box: runtest setup + its report", "box.guest.protocol>", "box.test.call>"),
    ("box: the test itself", "box.test.call>", "box.test.call<"),
    ("box: call/teardown reports", "box.test.call<", "box.guest.protocol<"),
    ("reports -> host (DONE read)", "box.guest.protocol<", "host.drain<"),
    ("host: settle, close, log the reports", "host.drain<", "logfinish"),
    ("host: to the next test", "logfinish", "next logstart"),
]
#: Making one box (while the test before it runs): (name, from stamp, to stamp).
BOX_PHASES: list[tuple[str, str, str]] = [
    ("clone of the warm interpreter (parent's side)", "box.clone>", "box.clone<parent"),
    ("clone -> pid 1 runs, ids mapped", "box.clone>", "box.clone<child"),
    ("pid 1: connect to the host, cut the channel", "box.clone<child", "box.cut_channel<"),
    ("pid 1: fresh layers, masks, tmpfs, /proc, hostname", "box.fresh_box>", "box.fresh_box<"),
    ("pid 1: fork of the test process", "box.fork>", "box.fork<child"),
    ("test process: own user namespace (root)", "box.enter_test_namespaces>", "box.enter_test_namespaces<"),
    ("box made: clone -> test process waits for its RUN", "box.clone>", "box.enter_test_namespaces<"),
]

#: The CPU of a box's test process by phase (its own clock, zero at its fork): (name, from, to).
TEST_CPU_PHASES: list[tuple[str, str, str]] = [
    ("fork -> it runs (faults of the return to Python)", "", "box.clone<child"),
    ("connect to the host, cut the channel", "box.clone<child", "box.cut_channel<"),
    ("fresh layers, masks, tmpfs, /proc, hostname", "box.fresh_box>", "box.fresh_box<"),
    ("own user namespace (root)", "box.enter_test_namespaces>", "box.enter_test_namespaces<"),
    ("TOKEN, RUN read, before the protocol", "box.enter_test_namespaces<", "box.guest.protocol>"),
    ("runtest protocol, to its teardown report", "box.guest.protocol>", "box.makereport.teardown"),
    ("  (of which: setup and its report)", "box.guest.protocol>", "box.test.call>"),
    ("  (of which: the test, its report, teardown)", "box.test.call>", "box.makereport.teardown"),
    ("the test process, fork to its teardown report", "", "box.makereport.teardown"),
    ("its pid 1 (a bare init), clone to _exit", "", "box.exit"),
]


def cpu_phases(
    cpu: dict[int, dict[str, tuple[float, int]]], skip: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each test-process phase's CPU seconds and page faults over the steady-state boxes."""
    found: dict[str, list[float]] = defaultdict(list)
    faults: dict[str, list[float]] = defaultdict(list)
    for box in sorted(cpu)[skip:]:
        at = {"": (0.0, 0), **cpu[box]}
        for name, a, b in TEST_CPU_PHASES:
            if a in at and b in at:
                found[name].append(at[b][0] - at[a][0])
                faults[name].append(at[b][1] - at[a][1])
    return found, faults


def _first(stamps: list[tuple[str, float]]) -> dict[str, float]:
    at: dict[str, float] = {}
    for label, t in stamps:
        at.setdefault(label, t)
    return at


def phases(
    lines: list[list[tuple[str, float]]], boxes: dict[int, list[tuple[str, float]]], skip: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], list[float]]:
    """Each phase's durations over the steady-state tests and boxes, and the per-test intervals."""
    gaps: dict[str, list[float]] = defaultdict(list)
    box_gaps: dict[str, list[float]] = defaultdict(list)
    intervals = []
    steady = lines[skip:-1]  # the last test's interval runs into the session's end
    for i, line in enumerate(steady):
        nxt = lines[skip + i + 1][0][1]
        intervals.append(nxt - line[0][1])
        at = _first([*line, ("next logstart", nxt)])
        for name, a, b in PHASES:
            if a in at and b in at:
                gaps[name].append(at[b] - at[a])
    for box in sorted(boxes)[skip:]:
        at = _first(boxes[box])
        for name, a, b in BOX_PHASES:
            if a in at and b in at:
                box_gaps[name].append(at[b] - at[a])
    return gaps, box_gaps, intervals


def profile(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    work = root / "suite"
    write_suite(work, args.tests)
    merged: dict[str, list[float]] = defaultdict(list)
    merged_box: dict[str, list[float]] = defaultdict(list)
    merged_cpu: dict[str, list[float]] = defaultdict(list)
    merged_faults: dict[str, list[float]] = defaultdict(list)
    intervals: list[float] = []
    mounts: list[tuple[int, float]] = []
    walls = []
    host_cpu: list[float] = []
    box_cpu: list[float] = []
    for r in range(args.runs):
        home = root / f"home{r}"
        out = root / f"marks{r}.json"
        cmd = [sys.executable, "-m", "pytest", *ARGS, "--boxlite", "--boxlite-home", str(home)]
        # The pid 1 switch is kept: profiling the Python pid 1 (which stamps its phases) asks for it.
        keep = {k: os.environ[k] for k in ("PYTEST_BOXLITE_NATIVE_INIT",) if k in os.environ}
        env = clean_env(PBXPROF_OUT=str(out), PBXPROF_GUEST_PROBE=str(work / "pbx_guest_probe.py.txt"), **keep)
        rc, text, wall, timed_out = run_bounded(cmd, cwd=work, env=env, timeout=args.timeout)
        if rc != 0 or timed_out or not out.exists():
            raise RunFailed("profile run", cmd, "timed out" if timed_out else f"exit status {rc}", text)
        leak_check("profile run", home)
        walls.append(wall)
        data = json.loads(out.read_text())
        host_cpu += [
            b - a for a, b in zip(data["host_cpu"][args.skip :], data["host_cpu"][args.skip + 1 :], strict=False)
        ]
        box_cpu += [b - a for a, b in zip(data["box_cpu"][args.skip :], data["box_cpu"][args.skip + 1 :], strict=False)]
        lines, boxes = timelines(data)
        gaps, box_gaps, iv = phases(lines, boxes, args.skip)
        mounts += data["_mounts"][args.skip :]
        intervals += iv
        for k, v in gaps.items():
            merged[k] += v
        for k, v in box_gaps.items():
            merged_box[k] += v
        used, faulted = cpu_phases(data["_cpu"], args.skip)
        for k, v in used.items():
            merged_cpu[k] += v
        for k, v in faulted.items():
            merged_faults[k] += v
        log(f"  run {r + 1}/{args.runs}: {wall:.2f} s, median interval {statistics.median(iv) * 1e3:.2f} ms")
    n_tests = len(intervals)

    def rows(found: dict[str, list[float]], names: list[str]) -> list[dict[str, Any]]:
        return [
            {"phase": k, "p50": statistics.median(found[k]), "n": len(found[k]), "mean": statistics.fmean(found[k])}
            for k in names
            if found.get(k)
        ]

    table = rows(merged, [name for name, _, _ in PHASES])
    box_table = rows(merged_box, [name for name, _, _ in BOX_PHASES])
    return {
        "tests": args.tests,
        "runs": args.runs,
        "walls": walls,
        "interval_p50": statistics.median(intervals),
        "interval_mean": statistics.fmean(intervals),
        "steady_tests": n_tests,
        # Reaped boxes lag a test or two behind the forks; over the run the medians still tell.
        "host_cpu_p50": statistics.median(host_cpu) if host_cpu else None,
        "box_cpu_p50": statistics.median(box_cpu) if box_cpu else None,
        "phases": table,
        "box_phases": box_table,
        "test_cpu": rows(merged_cpu, [name for name, _, _ in TEST_CPU_PHASES]),
        "test_faults": {k: statistics.median(v) for k, v in merged_faults.items() if v},
        "mounts": {
            "count": statistics.median(c for c, _ in mounts) if mounts else None,
            "p50": statistics.median(t for _, t in mounts) if mounts else None,
        },
        "command": shlex.join([Path(sys.executable).name, "-m", "pytest", *ARGS, "--boxlite"]),
    }


# -- floor ----------------------------------------------------------------------
CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWUTS = 0x10000000, 0x00020000, 0x04000000
CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID = 0x08000000, 0x40000000, 0x20000000
ALL_NS = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWPID


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _timed_child(body: Any, reps: int, make: Any = None) -> tuple[list[float], list[float]]:
    """``make()`` (default: fork) a child that runs ``body()`` and exits 0 (1 on error); the parent
    waits.  Wall seconds each, and CPU seconds each (the parent's and the reaped children's)."""
    out, cpu = [], []
    make = make or (lambda: (os.fork(), None))
    for _ in range(reps):
        c0 = _children_cpu() + _self_cpu()
        t = time.monotonic()
        pid, after = make()
        if pid == 0:
            code = 1
            try:
                body()
                code = 0
            except BaseException:  # noqa: BLE001 - printed; the parent fails on the exit status
                import traceback

                traceback.print_exc()  # the parent raises on the status; this says why
            finally:
                os._exit(code)
        if after is not None:
            after(pid)
        _, status = os.waitpid(pid, 0)
        out.append(time.monotonic() - t)
        cpu.append(_children_cpu() + _self_cpu() - c0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"floor step failed in the child (status {status})")
    return out, cpu


def floor(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    work = root / "floor-suite"
    work.mkdir()
    (work / "pytest.ini").write_text("[pytest]\n")
    (work / "test_floor.py").write_text("".join(f"def test_{i}():\n    pass\n\n\n" for i in range(args.tests)))
    result: dict[str, Any] = in_session(work, lambda items: floor_steps(args, root, work, items))
    return result


def floor_steps(args: argparse.Namespace, root: Path, work: Path, items: list[Any]) -> dict[str, Any]:
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret: int, what: str) -> None:
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def unshare() -> None:
        check(libc.unshare(ALL_NS), "unshare")

    def unshare_mounts() -> None:
        uid, gid = os.geteuid(), os.getegid()
        unshare()
        # Map this process's own ids (one line each, written by itself): files can then be made.
        for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as fh:
                fh.write(text)
        check(libc.mount(None, b"/", None, (1 << 14) | (1 << 18), None), "make / private")
        stage = str(root / "stage").encode()
        check(libc.mount(b"tmpfs", stage, b"tmpfs", 0, b"mode=0700"), "tmpfs")
        for d in (b"u", b"w"):
            os.mkdir(stage + b"/" + d)
        opts = b"lowerdir=" + str(work).encode() + b",upperdir=" + stage + b"/u,workdir=" + stage + b"/w,userxattr"
        check(libc.mount(b"overlay", str(work).encode(), b"overlay", 0, opts), "overlay")

    def pid1() -> None:
        unshare()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

    def spawn_sh() -> None:
        pid = os.posix_spawn("/bin/sh", ["sh", "-c", "true"], {})
        os.waitpid(pid, 0)

    (root / "stage").mkdir()
    # The box's own primitive: guest/fresh.py's clone_box (one clone(2) into new namespaces; root's
    # ids mapped by this process, as the warm interpreter maps a box's).
    from pytest_boxlite.guest import boxinit, fresh, ids

    def clone_box() -> tuple[int, Any]:
        mapper = ids.IdMapper() if os.geteuid() == 0 else None
        pid = fresh.clone_box(False, mapper)
        return pid, (mapper.serve if mapper is not None and pid else None)

    import signal

    def boxed_init(native: bool) -> Any:
        """clone_box as a test's box is made: pid 1 (native boxinit, or the Python BareInit) forks
        the test process, which here only exits; the box exits with it."""

        def make() -> tuple[int, Any]:
            if native:
                boxinit._NATIVE.clear()
            else:
                boxinit._NATIVE.update(helper=None, why="the Python pid 1's step")
            mapper = ids.IdMapper() if os.geteuid() == 0 else None
            init = boxinit.BareInit([signal.SIGTERM], list(mapper.fds()) if mapper else [])
            pid = fresh.clone_box(False, mapper, init=init)
            if pid == boxinit.IN_TEST:
                return 0, None
            init.discard()
            return pid, (mapper.serve if mapper is not None else None)

        return make

    def run_test() -> None:
        item = items[0]
        item.ihook.pytest_runtest_protocol(item=item, nextitem=None)

    steps: list[tuple[str, Any, bool, Any]] = [
        ("fork + _exit + wait (warm interpreter)", lambda: None, False, None),
        ("  + unshare(user, mnt, uts, ipc, pid, net)", unshare, False, None),
        ("  + id maps, make / private, a tmpfs and an overlay mount", unshare_mounts, True, None),
        ("  + unshare, fork pid 1 and wait for it", pid1, False, None),
        ("  + posix_spawn /bin/sh -c true and wait", spawn_sh, False, None),
        ("fresh.clone_box (new namespaces, ids mapped) + _exit", lambda: None, False, clone_box),
        ("  + pid 1 (Python BareInit) forks the test process", lambda: None, False, boxed_init(False)),
        ("  + pid 1 (native boxinit) forks the test process", lambda: None, False, boxed_init(True)),
        ("fork + runtest protocol of a trivial test (pytest-forked)", run_test, False, None),
    ]
    rss = 0
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    out: dict[str, Any] = {"rss_kib": rss, "steps": []}
    for label, body, needs_root, make in steps:
        if needs_root and os.geteuid() != 0:
            out["steps"].append({"step": label, "skipped": "needs root"})
            continue
        if "native boxinit" in label:
            boxinit._NATIVE.clear()
            if boxinit.native_init() is None:
                out["steps"].append({"step": label, "skipped": str(boxinit._NATIVE["why"])})
                continue
        times, cpu = _timed_child(body, args.floor_reps, make)
        out["steps"].append(
            {"step": label, "p50": statistics.median(times), "cpu_p50": statistics.median(cpu), "n": len(times)}
        )
    return out


def in_session(work: Path, fn: Any) -> Any:
    """``fn(items)`` inside a pytest session of the floor suite, in this process (pytest imported,
    the module collected: as large as a box's warm interpreter), instead of its run loop."""
    import pytest

    done: list[Any] = []

    class Floor:
        @pytest.hookimpl(tryfirst=True)
        def pytest_runtestloop(self, session: pytest.Session) -> bool:
            done.append(fn(session.items))
            return True

    rc = pytest.main(["-qq", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", str(work)], plugins=[Floor()])
    if not done:
        raise RuntimeError(f"the floor suite's session ended before measuring (exit {rc})")
    return done[0]


def _phase_line(row: dict[str, Any]) -> str:
    """One phase's row: its name, p50 and mean in milliseconds, and how many samples."""
    return f"  {row['phase']:<58} {row['p50'] * 1e3:8.2f}ms {row['mean'] * 1e3:8.2f}ms {row['n']:>5}"


def render(res: dict[str, Any]) -> str:
    lines = []
    p = res.get("profile")
    if p:
        lines.append(
            f"profile: {p['steady_tests']} steady-state tests ({p['runs']} runs of {p['tests']}; walls "
            + ", ".join(f"{w:.2f} s" for w in p["walls"])
            + ")"
        )
        lines.append(f"  command: {p['command']}")
        lines.append(f"  {'the test (the host waits through each phase)':<58} {'p50':>9} {'mean':>9} {'n':>5}")
        total = 0.0
        for row in p["phases"]:
            if not row["phase"].startswith(" "):
                total += row["p50"]
            lines.append(_phase_line(row))
        lines.append(f"  {'sum of the phase medians':<58} {total * 1e3:8.2f}ms")
        lines.append(
            f"  {'logstart -> next logstart (per test)':<58} {p['interval_p50'] * 1e3:8.2f}ms "
            f"{p['interval_mean'] * 1e3:8.2f}ms"
        )
        lines.append(f"  {'its box, made while the test before it runs':<58}")
        for row in p["box_phases"]:
            lines.append(_phase_line(row))
        if p["host_cpu_p50"] is not None and p["box_cpu_p50"] is not None:
            lines.append(
                f"  CPU per test: host process {p['host_cpu_p50'] * 1e3:.2f} ms, boxes "
                f"{p['box_cpu_p50'] * 1e3:.2f} ms (p50; the boxes: rusage of the reaped forks)"
            )
        if p.get("test_cpu"):
            lines.append(f"  {'CPU of its test process (its own clock, zero at its fork)':<58}")
            for row in p["test_cpu"]:
                faults = p["test_faults"].get(row["phase"])
                lines.append(_phase_line(row) + (f"  {faults:6.0f} page faults (p50)" if faults is not None else ""))
        m = p["mounts"]
        if m["count"] is not None:
            together = f"{m['p50'] * 1e3:.2f} ms together (p50)"
            lines.append(f"  mounts in the fresh box: {m['count']:.0f} per test, {together}")
    f = res.get("floor")
    if f:
        lines.append("")
        lines.append(f"floor on this machine, each step alone (warm interpreter: RSS {f['rss_kib'] / 1024:.0f} MiB)")
        for s in f["steps"]:
            if "skipped" in s:
                lines.append(f"  {s['step']:<58} skipped: {s['skipped']}")
            else:
                lines.append(
                    f"  {s['step']:<58} {s['p50'] * 1e3:8.2f}ms  CPU {s['cpu_p50'] * 1e3:6.2f}ms  (n={s['n']})"
                )
        bound = isolation_floor(f["steps"])
        if bound is not None:
            lines.append(
                f"  isolation floor: pytest-forked's fork + runtest, plus new namespaces and a pid 1 "
                f"(no mount, no message): CPU {bound[0] * 1e3:.2f} ms, {bound[1]:.2f}x pytest-forked's"
            )
    return "\n".join(lines)


def isolation_floor(steps: list[dict[str, Any]]) -> tuple[float, float] | None:
    """The least CPU a boxed test can cost with its own namespaces, from the floor steps: what
    pytest-forked pays (a fork and the runtest protocol) plus what a new pid namespace adds to a
    bare fork (the unshare, and its pid 1: in pure Python, another fork of the interpreter),
    before any mount or message; and that over pytest-forked's.  None where a step is missing."""
    cpu = {s["step"].strip(): s["cpu_p50"] for s in steps if "cpu_p50" in s}
    base = cpu.get("fork + _exit + wait (warm interpreter)")
    # The native pid 1 where it runs (a box as --boxlite makes it, no copy of the interpreter for
    # pid 1), else pure Python's.
    pid1 = cpu.get("+ pid 1 (native boxinit) forks the test process") or cpu.get(
        "+ unshare, fork pid 1 and wait for it"
    )
    forked = cpu.get("fork + runtest protocol of a trivial test (pytest-forked)")
    if base is None or pid1 is None or not forked:
        return None
    total = forked + max(pid1 - base, 0.0)
    return total, total / forked


def add_arguments(p: argparse.ArgumentParser) -> None:
    option(p, "--tests", 100, 20, help="trivial tests in the module")
    option(p, "--runs", 3, 1, help="pytest runs")
    option(p, "--skip", 5, type=int, help="first tests of each run left out")
    option(p, "--floor-reps", 50, 10, help="repetitions of each floor step")
    p.add_argument("--no-floor", action="store_true", help="profile only")
    p.add_argument("--no-profile", action="store_true", help="floor only")
    option(p, "--timeout", 300.0, type=seconds, help="bound on each pytest run, seconds")


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    root = Path(tempfile.mkdtemp(prefix="pbx-profile-"))
    res: dict[str, Any] = {"loadavg_start": os.getloadavg()}
    try:
        if not args.no_profile:
            try:
                res["profile"] = profile(args, root)
            except RunFailed as exc:
                log(failure_text(exc))
                return 1, res
        if not args.no_floor:
            res["floor"] = floor(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()
    print("\n".join([*machine_header(), render(res)]), flush=True)
    return 0, res


PROFILE_FORK = Table("profile-fork", "per-phase profile of one boxed test, and the floor of each step alone",
                     __doc__ or "", add_arguments, run)  # fmt: skip
