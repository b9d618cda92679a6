"""pytest-xdist (issue 5): ``-n 2`` sub-runs with per-worker pools, crashed workers, and workers in boxes.

Every check but the last is a real ``python -m pytest`` subprocess (``-n 2``
unless it is about running without xdist) with real namespace boxes and a
``--boxlite-home`` of its own; after every sub-run no box may be
left in it (``ledger.scan(home) == []``).  Tests that run on the host in a
worker report what they saw through ``record_property`` and ``--junitxml``
(writes made inside a box never reach the host).  Sub-runs cost seconds each
on a busy machine, so the checks are packed into few of them; every wait is a
poll with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
import subruns
from subruns import children_of, comm_of, pids_with, process_gone, sub_env, wait_until

from pytest_boxlite import ledger
from pytest_boxlite.runtimes.vm import prepare_home

pytestmark = pytest.mark.timeout(180)

#: The namespace runtime everywhere, also where micro-VMs boot: box names, forks and state dirs are checked.
RUNTIME = ("--boxlite-runtime=namespace",)

#: A box of an xdist worker: ``pbx-<session>-<worker>-<n>``, forked boxes add ``.<k>``.
WORKER_BOX = re.compile(r"^pbx-(?P<session>[0-9a-f]+)-(?P<worker>gw\d+)-(?P<seq>\d+)(?:\.\d+)?$")
#: The box of a whole worker (``--boxlite-scope=worker``): owner ``<session>-p<host pid>`` (the box
#: server of the worker's slot; a restarted worker gets the slot's next box, ``-2``, ...).
WORKER_SCOPE_BOX = re.compile(r"^pbx-(?P<session>[0-9a-f]+)-p(?P<pid>\d+)-(?P<seq>\d+)$")
SUMMARY = re.compile(
    r"boxes booted (?P<booted>\d+), (?:forked (?P<forked>\d+) \(overhead p50 [\d.]+ ms\), )?"
    r"leased (?P<leased>\d+), reused (?P<reused>\d+), warm-lease hit rate (?:\d+%|n/a), "
    r"lease wait p50 [\d.]+ ms max [\d.]+ ms, leaked (?P<leaked>\d+)"
)
PER_WORKER_HEADER = re.compile(r"^boxlite: image=.* max-boxes=2 per worker network=off home=", re.M)


# --------------------------------------------------------------------------
# helpers


def no_leftovers(home: Path, output: str = "") -> None:
    rows = ledger.scan(home)
    assert rows == [], f"boxes left behind in {home}: {rows}\n{output[-4000:]}"


def summary_of(output: str) -> re.Match[str]:
    m = SUMMARY.search(output)
    assert m, "no boxlite summary line:\n" + output[-5000:]
    return m


def write(directory: Path, name: str, source: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(textwrap.dedent(source))


class SubRun(subruns.SubRun):
    """A sub-run of this file: always on the namespace runtime, with more time to finish."""

    base_args = RUNTIME
    wait_timeout = 150.0


def junit_props(path: Path) -> dict[str, dict[str, str]]:
    """Test name -> its recorded properties, plus ``outcome`` (passed/failed/skipped)."""
    out: dict[str, dict[str, str]] = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        props = {p.get("name", ""): p.get("value", "") for p in tc.iter("property")}
        tags = {c.tag for c in tc}
        props["outcome"] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        out[tc.get("name", "")] = props
    return out


@pytest.fixture
def etc_probe() -> Iterator[Path]:
    """A unique path under the host's /etc that boxed tests write to; it must never appear on the host."""
    path = Path(f"/etc/pbx-xdist-probe-{uuid.uuid4().hex[:12]}")
    yield path
    with contextlib.suppress(OSError):
        path.unlink()


# --------------------------------------------------------------------------
# 1. -n 2 with marked tests and boxlite_sandbox: one owner per worker, controller without a pool

LEFTOVER_MAKER = """
import os, sys
from pathlib import Path
from pytest_boxlite.runtimes import open_runtime
from pytest_boxlite.spec import BoxSpec

rt = open_runtime("namespace", Path(sys.argv[1]), "deadbeef")
box = rt.create_box(BoxSpec(), "pbx-deadbeef-1", timeout=30)
print(box.name, flush=True)
os._exit(0)  # dies without cleaning up, like a crashed session
"""

PAIR = """

@pytest.mark.boxlite
def test_marked_{i}(record_property):
    name = socket.gethostname()
    record_property("pbx_host", name)
    assert name.startswith("pbx-") and name != HOST_HOSTNAME
    assert os.environ.get("PYTEST_BOXLITE_GUEST") == "1"


def test_sandbox_{i}(boxlite_sandbox, record_property):
    record_property("pbx_box", boxlite_sandbox.name)
    record_property("pbx_worker", os.environ["PYTEST_XDIST_WORKER"])
    record_property("pbx_leftover_seen", str(LEFTOVER.exists()))
    r = boxlite_sandbox.run(["hostname"])
    assert r.ok and r.stdout.strip() == boxlite_sandbox.name[:63], r
    live = sorted(p.name for p in (HOME / "namespace").iterdir() if not p.name.endswith(".ctl"))
    record_property("pbx_live", " ".join(live))
"""


def test_n2_marked_and_sandbox_tests_one_owner_per_worker(tmp_path: Path, home: Path) -> None:
    """-n 2: marked and sandbox tests pass, each worker is its own owner, the summary adds up the workers."""
    proj = tmp_path / "proj"
    # A real leftover of a dead session: the controller must reconcile it before the workers start.
    made = subprocess.run(
        [sys.executable, "-c", LEFTOVER_MAKER, str(home)], capture_output=True, text=True, timeout=60, env=sub_env()
    )
    assert made.returncode == 0 and made.stdout.strip() == "pbx-deadbeef-1", made
    rows = ledger.scan(home)
    assert [(r.name, r.owner_alive) for r in rows] == [("pbx-deadbeef-1", False)], rows

    head = f"""
        import os, socket
        from pathlib import Path
        import pytest

        HOME = Path({str(home)!r})
        LEFTOVER = HOME / "namespace" / "pbx-deadbeef-1"
        HOST_HOSTNAME = {socket.gethostname()!r}
    """
    # Interleaved, so that xdist's first chunks (two items per worker) give each worker both kinds.
    write(proj, "test_par.py", textwrap.dedent(head) + "".join(PAIR.format(i=i) for i in range(4)))
    junit = tmp_path / "junit.xml"
    run = SubRun(proj, home, "par", "-n", "2", f"--junitxml={junit}", "test_par.py")
    rc = run.wait()
    out = run.output
    assert rc == 0, out
    assert re.search(r"\b8 passed\b", out), out
    assert PER_WORKER_HEADER.search(out), out
    # Reconciled by the controller before any test ran (workers only ever clear their own owner id).
    assert out.count("leftover box(es) of dead sessions") == 1, out
    assert "removed 1 leftover box(es) of dead sessions: pbx-deadbeef-1" in out, out

    props = junit_props(junit)
    assert len(props) == 8 and all(p["outcome"] == "passed" for p in props.values()), props
    seen: dict[str, set[str]] = {"marked": set(), "sandbox": set()}
    sessions: set[str] = set()
    sandbox_names = []
    for name, p in props.items():
        if name.startswith("test_sandbox_"):
            m = WORKER_BOX.match(p["pbx_box"])
            assert m, p
            # The box belongs to the worker that leased it: owner <session>-<workerid>.
            assert m["worker"] == p["pbx_worker"], p
            assert p["pbx_leftover_seen"] == "False", "the leftover was still there when tests ran"
            seen["sandbox"].add(m["worker"])
            sandbox_names.append(p["pbx_box"])
            # The controller has no pool: every live box in the home belongs to a worker of this run.
            live = p["pbx_live"].split()
            assert p["pbx_box"] in live, p
            for box in live:
                lm = WORKER_BOX.match(box)
                assert lm, f"a box not owned by an xdist worker: {box} (live: {live})"
                sessions.add(lm["session"])
        else:
            m = WORKER_BOX.match(p["pbx_host"])
            assert m and "." in p["pbx_host"], p  # a fresh box forked per test
            seen["marked"].add(m["worker"])
        sessions.add(m["session"])
    assert len(sessions) == 1, f"one run, one session id: {sessions}"
    assert len(set(sandbox_names)) == 4, sandbox_names
    assert seen["marked"] == {"gw0", "gw1"}, seen
    assert seen["sandbox"] == {"gw0", "gw1"}, seen

    # The controller's summary adds up both workers' counters (each forked at least one box).
    s = summary_of(out)
    assert s["forked"] == "4", s.group(0)
    assert int(s["leased"]) >= 4, s.group(0)
    assert s["leaked"] == "0", s.group(0)
    assert out.count("boxes booted ") == 1, out
    no_leftovers(home, out)
    assert list((home / "sessions").glob("*.lock")) == [], "an owner lock outlived the run"


def test_n2_without_boxed_tests_creates_no_box_anywhere(tmp_path: Path, home: Path) -> None:
    """The controller runs no pool: with only unboxed tests, not one box is ever made, and nothing is said."""
    proj = tmp_path / "proj"
    write(
        proj,
        "test_plain.py",
        f"""
        import os
        from pathlib import Path
        import pytest

        HOME = Path({str(home)!r})

        @pytest.mark.parametrize("i", range(6))
        def test_plain(i):
            assert os.environ["PYTEST_XDIST_WORKER"] in ("gw0", "gw1")
            boxes = HOME / "namespace"
            assert not boxes.exists() or not any(boxes.iterdir())
        """,
    )
    run = SubRun(proj, home, "plain", "-n", "2", "test_plain.py")
    rc = run.wait()
    out = run.output
    assert rc == 0, out
    assert re.search(r"\b6 passed\b", out), out
    assert PER_WORKER_HEADER.search(out), out
    assert "boxes booted" not in out and "- boxlite -" not in out, out
    assert not (home / "namespace").exists() or not any((home / "namespace").iterdir())
    assert not (home / "vm").exists()
    no_leftovers(home, out)


# --------------------------------------------------------------------------
# 2. crashed workers (os._exit, SIGKILL) and --max-worker-restart

CRASHERS = """
import os, time
from pathlib import Path
import pytest

HOME = Path(os.environ["PBX_HOME"])


def test_exit(boxlite_sandbox):
    boxlite_sandbox.write_file("/workspace/x", "y")
    os._exit(1)  # the worker process itself dies while holding a box


def test_killed(boxlite_sandbox):
    boxlite_sandbox.write_file("/workspace/x", "y")
    Path(os.environ["PBX_PIDFILE"]).write_text(str(os.getpid()))
    time.sleep(120)


@pytest.mark.parametrize("i", range(8))
def test_after(i, boxlite_sandbox, record_property):
    worker = os.environ["PYTEST_XDIST_WORKER"]
    record_property("pbx_worker", worker)
    record_property("pbx_box", boxlite_sandbox.name)
    assert boxlite_sandbox.run(["true"]).ok
    # Hold the first workers a while for a replacement worker to come up, so that it gets work too.
    # Under heavy load it may come later than that: then the outer test checks what it can.
    deadline = time.monotonic() + 60
    while worker in ("gw0", "gw1") and not list(HOME.glob("sessions/*-gw[2-9].lock")):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert boxlite_sandbox.run(["cat", "/workspace/none"]).exit_code != 0
"""


def test_crashed_workers_leave_no_box_and_restarted_workers_get_fresh_owners(
    tmp_path: Path, home: Path, subruns: list[SubRun]
) -> None:
    """os._exit in a worker and SIGKILL of a worker mid-test: the run finishes, the controller reaps their boxes."""
    proj = tmp_path / "proj"
    write(proj, "test_crash.py", CRASHERS)
    pidfile = tmp_path / "victim.pid"
    junit = tmp_path / "junit.xml"
    run = SubRun(
        proj,
        home,
        "crash",
        "-n",
        "2",
        "--max-worker-restart=2",
        f"--junitxml={junit}",
        "test_crash.py",
        env=sub_env(PBX_PIDFILE=str(pidfile), PBX_HOME=str(home)),
    )
    subruns.append(run)
    assert wait_until(lambda: (pidfile.exists() and bool(pidfile.read_text())) or run.proc.poll() is not None, 120)
    assert pidfile.exists(), run.output
    victim = int(pidfile.read_text())
    assert victim != run.pid
    held = [r.name for r in ledger.scan(home) if r.owner_alive]
    os.kill(victim, signal.SIGKILL)

    rc = run.wait()
    out = run.output
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert re.search(r"\b2 failed, 8 passed\b", out), out
    exited = re.search(r"worker '?(gw\d+)'? crashed while running '?test_crash.py::test_exit'?", out)
    killed = re.search(r"worker '?(gw\d+)'? crashed while running '?test_crash.py::test_killed'?", out)
    assert exited and killed, out
    assert exited[1] != killed[1], out
    assert out.count("replacing crashed worker") == 2, out
    assert process_gone(victim)

    props = junit_props(junit)
    assert props["test_exit"]["outcome"] == "failed" and props["test_killed"]["outcome"] == "failed", props
    after = {n: p for n, p in props.items() if n.startswith("test_after")}
    assert len(after) == 8 and all(p["outcome"] == "passed" for p in after.values()), after
    crashed = {exited[1], killed[1]}
    sessions = set()
    restarted_boxes = []
    for p in after.values():
        m = WORKER_BOX.match(p["pbx_box"])
        assert m and m["worker"] == p["pbx_worker"], p
        sessions.add(m["session"])
        if p["pbx_worker"] not in ("gw0", "gw1"):
            restarted_boxes.append(p["pbx_box"])
    assert len(sessions) == 1, sessions
    (session,) = sessions
    # A restarted worker is a new owner with boxes of its own, and its tests pass.  (The inner tests
    # hold the first workers up to 60 s for it; on a machine loaded enough that it came later, the
    # original workers ran everything and there is nothing to check here.)
    # The first crash hit one of the original workers; its replacement did not take over its owner id.
    assert exited[1] in ("gw0", "gw1"), out
    assert all(ledger.owner_of(b) not in (f"{session}-gw0", f"{session}-gw1") for b in restarted_boxes), restarted_boxes

    # The crashed workers' boxes were there when the victim died, and the controller reaped them.
    crashed_owners = {f"{session}-{w}" for w in crashed}
    assert any(ledger.owner_of(n) == f"{session}-{killed[1]}" for n in held), (held, killed[1])
    leaked_line = re.search(r"LEAKED boxes \(removed at exit\): (.*)", out)
    assert leaked_line, out
    leaked = [n.strip() for n in leaked_line[1].split(",")]
    assert {ledger.owner_of(n) for n in leaked} == crashed_owners, leaked
    assert summary_of(out)["leaked"] == str(len(leaked)), out
    no_leftovers(home, out)


# --------------------------------------------------------------------------
# 3. reliability: two concurrent runs in one home; Ctrl-C of an xdist run

CONCURRENT = """
import os, time
from pathlib import Path
import pytest

MEET = Path(os.environ["PBX_MEET"])
ME, OTHER = os.environ["PBX_TAG"], os.environ["PBX_OTHER"]


@pytest.mark.parametrize("i", range(4))
def test_concurrent(i, boxlite_sandbox, record_property):
    record_property("pbx_box", boxlite_sandbox.name)
    boxlite_sandbox.write_file("/workspace/mine", f"{ME}-{i}")
    (MEET / f"{ME}-{i}").write_text(boxlite_sandbox.name)
    # Both runs hold boxes at the same time: wait for the other run, then a little longer.
    deadline = time.monotonic() + 90
    while not list(MEET.glob(f"{OTHER}-*")):
        assert time.monotonic() < deadline, "the other run never started a test"
        time.sleep(0.05)
    time.sleep(1.0)
    assert boxlite_sandbox.read_file("/workspace/mine") == f"{ME}-{i}"
    assert boxlite_sandbox.run(["true"]).ok
"""


def test_two_concurrent_n2_runs_in_one_home_leave_each_other_alone(
    tmp_path: Path, home: Path, subruns: list[SubRun]
) -> None:
    meet = tmp_path / "meet"
    meet.mkdir()

    def start(tag: str, other: str) -> SubRun:
        proj = tmp_path / f"proj_{tag}"
        write(proj, "test_conc.py", CONCURRENT)
        env = sub_env(PBX_MEET=str(meet), PBX_TAG=tag, PBX_OTHER=other)
        run = SubRun(proj, home, tag, "-n", "2", f"--junitxml={tmp_path / f'{tag}.xml'}", "test_conc.py", env=env)
        subruns.append(run)
        return run

    a = start("a", "b")
    # B starts (and its controller reconciles the home) while A's tests hold their boxes.
    assert wait_until(lambda: len(list(meet.glob("a-*"))) >= 2 or a.proc.poll() is not None, 120), a.output
    assert a.proc.poll() is None, a.output
    runs = {"a": a, "b": start("b", "a")}
    codes = {tag: r.wait() for tag, r in runs.items()}
    outs = {tag: r.output for tag, r in runs.items()}
    for tag in runs:
        assert codes[tag] == 0, outs[tag]
        assert re.search(r"\b4 passed\b", outs[tag]), outs[tag]
        assert summary_of(outs[tag])["leaked"] == "0", outs[tag]
        assert "leftover box" not in outs[tag], outs[tag]
    sessions = {}
    for tag in runs:
        names = [p["pbx_box"] for p in junit_props(tmp_path / f"{tag}.xml").values()]
        matches = [WORKER_BOX.match(n) for n in names]
        assert all(matches), names
        sessions[tag] = {m["session"] for m in matches if m}
        assert len(sessions[tag]) == 1, names
    assert sessions["a"] != sessions["b"], sessions
    no_leftovers(home, outs["a"] + outs["b"])


INTERRUPTED = """
import os, subprocess, sys, time
from pathlib import Path
import pytest


def test_hold(boxlite_sandbox):
    boxlite_sandbox.write_file("/workspace/x", "y")
    Path(os.environ["PBX_DIR"], "sandbox.pid").write_text(f"{os.environ['PYTEST_XDIST_WORKER']} {os.getpid()}")
    time.sleep(120)


@pytest.mark.boxlite
def test_boxed_hold():
    # A process in the boxed test's box, tagged so that the host can see whether it outlives the run.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", os.environ["PBX_TAG"]])
    time.sleep(120)
"""


@pytest.mark.parametrize("target", ["controller", "process group"])
def test_ctrl_c_of_an_n2_run_leaves_zero_boxes(tmp_path: Path, home: Path, subruns: list[SubRun], target: str) -> None:
    """SIGINT mid-test (one worker in a sandbox test, the other in a boxed test): no box, no process survives."""
    proj = tmp_path / "proj"
    write(proj, "test_int.py", INTERRUPTED)
    pids = tmp_path / "pids"
    pids.mkdir()
    tag = f"pbx-xdist-int-{uuid.uuid4().hex}"
    env = sub_env(PBX_DIR=str(pids), PBX_TAG=tag)
    run = SubRun(proj, home, "int", "-n", "2", "test_int.py", env=env, new_session=target != "controller")
    subruns.append(run)
    pidfile = pids / "sandbox.pid"
    started = wait_until(lambda: (pidfile.exists() and bool(pids_with(tag))) or run.proc.poll() is not None, 120)
    assert started and run.proc.poll() is None, run.output
    assert wait_until(lambda: len(pidfile.read_text().split()) == 2, 5)
    sandbox_worker, worker_pid = pidfile.read_text().split()
    owners = {r.owner for r in ledger.scan(home)}
    # Both workers hold boxes (the boxed test's box is forked from a pool box, which is listed).
    assert owners and len(owners) == 2 and all(o and re.search(r"-gw[01]$", o) for o in owners), owners
    in_box = pids_with(tag)

    if target == "controller":
        os.kill(run.pid, signal.SIGINT)
    else:
        os.killpg(run.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    rc = run.wait(90)
    out = run.output
    assert rc == pytest.ExitCode.INTERRUPTED, f"rc={rc}\n{out}"
    assert "KeyboardInterrupt" in out, out
    no_leftovers(home, out)
    assert wait_until(lambda: process_gone(int(worker_pid)), 30), f"worker {sandbox_worker} outlived the run"
    assert wait_until(lambda: not pids_with(tag), 30), f"processes of the boxed test outlived the run: {in_box}"


# --------------------------------------------------------------------------
# 4. --boxlite-scope=worker: whole workers (or the whole session) inside boxes

IN_WORKER_BOX = """
import os, socket
from pathlib import Path
import pytest


@pytest.mark.parametrize("i", range(3))
def test_in_box_{tag}(i, record_property):
    name = socket.gethostname()
    record_property("pbx_host", name)
    record_property("pbx_worker", os.environ["PYTEST_XDIST_WORKER"])
    assert name.startswith("pbx-") and name != {host!r}
    Path({probe!r}).write_text(name)  # the host's /etc must never see this
    assert Path({probe!r}).read_text() == name
"""


@pytest.mark.parametrize("dist", ["load", "loadscope", "loadfile", "worksteal"])
def test_worker_scope_n2_each_worker_in_its_own_box(tmp_path: Path, home: Path, etc_probe: Path, dist: str) -> None:
    proj = tmp_path / "proj"
    for tag in ("one", "two"):
        write(proj, f"test_{tag}.py", IN_WORKER_BOX.format(tag=tag, host=socket.gethostname(), probe=str(etc_probe)))
    junit = tmp_path / "junit.xml"
    run = SubRun(proj, home, dist, "-n", "2", "--boxlite-scope=worker", f"--dist={dist}", f"--junitxml={junit}")
    rc = run.wait()
    out = run.output
    assert rc == 0, out
    assert re.search(r"\b6 passed\b", out), out
    assert PER_WORKER_HEADER.search(out), out
    assert not etc_probe.exists(), "a write to /etc inside a worker's box reached the host"

    props = junit_props(junit)
    assert len(props) == 6, props
    hosts: dict[str, set[str]] = {}
    sessions = set()
    for p in props.values():
        m = WORKER_SCOPE_BOX.match(p["pbx_host"])
        assert m and m["seq"] == "1", p  # the box its slot's server booted ahead
        sessions.add(m["session"])
        hosts.setdefault(p["pbx_worker"], set()).add(p["pbx_host"])
    assert set(hosts) == {"gw0", "gw1"}, hosts
    # One box per worker, for all of that worker's tests, and no two workers share one.
    assert all(len(h) == 1 for h in hosts.values()), hosts
    assert len({next(iter(h)) for h in hosts.values()}) == 2, hosts
    assert len(sessions) == 1, f"one run, one session id: {sessions}"
    no_leftovers(home, out)


RESTARTED_IN_BOX = """
import os, socket, time
import pytest

# The replacements collect late, gw3 later than gw2: xdist then sends gw3 its tests when gw2's
# collection comes in, before gw3's own (the order in which the box's channel guard once refused
# them as forged and two tests went missing).
time.sleep({"gw2": 1.0, "gw3": 2.5}.get(os.environ["PYTEST_XDIST_WORKER"], 0))


@pytest.mark.parametrize("i", range(8))
def test_t(i, record_property):
    worker = os.environ["PYTEST_XDIST_WORKER"]
    if worker in ("gw0", "gw1"):
        os._exit(1)  # each first worker crashes on its first test
    record_property("pbx_host", socket.gethostname())
    record_property("pbx_worker", worker)
"""


def test_worker_scope_restarted_worker_gets_a_fresh_box(tmp_path: Path, home: Path) -> None:
    proj = tmp_path / "proj"
    write(proj, "test_restart.py", RESTARTED_IN_BOX)
    junit = tmp_path / "junit.xml"
    run = SubRun(
        proj, home, "restart", "-n", "2", "--boxlite-scope=worker", "--max-worker-restart=2", f"--junitxml={junit}"
    )
    rc = run.wait()
    out = run.output
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert re.search(r"\b2 failed, 6 passed\b", out), out
    assert out.count("replacing crashed worker") == 2, out
    passed = [p for p in junit_props(junit).values() if p["outcome"] == "passed"]
    assert len(passed) == 6, passed
    hosts: dict[str, set[str]] = {}
    for p in passed:
        assert p["pbx_worker"] in ("gw2", "gw3"), p
        m = WORKER_SCOPE_BOX.match(p["pbx_host"])
        assert m and m["seq"] == "2", p  # its slot's second box: the crashed worker's box is gone
        hosts.setdefault(p["pbx_worker"], set()).add(p["pbx_host"])
    assert all(len(h) == 1 for h in hosts.values()), hosts
    assert len({next(iter(h)) for h in hosts.values()}) == len(hosts), hosts
    no_leftovers(home, out)


SERVERS_SEEN = """
import os, threading, time
from pathlib import Path

if os.environ.get("PBX_EXTRA_THREAD") and not os.environ.get("PYTEST_XDIST_WORKER"):
    # A thread in the controller before it configures (as some plugins start one).
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):
        return
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\\0")
        except (OSError, ValueError):
            continue
        if comm == "boxlite-server" and int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            print("SERVER", "exec" if b"pytest_boxlite.boxproc" in cmd else "fork")
"""


@pytest.mark.parametrize("thread", [False, True], ids=["forked", "threaded-controller"])
def test_worker_scope_box_servers_are_forks_of_a_single_threaded_controller(
    tmp_path: Path, home: Path, thread: bool
) -> None:
    """The box servers start as forks of the controller (no interpreter start before the box
    boots); a controller with another thread at the time (a fork could inherit a lock that thread
    holds) starts them as ``python -m pytest_boxlite.boxproc`` instead.  Both serve their workers."""
    proj = tmp_path / "proj"
    write(proj, "conftest.py", SERVERS_SEEN)
    write(proj, "test_w.py", "import pytest\n\n@pytest.mark.parametrize('i', range(4))\ndef test_w(i): pass\n")
    env = sub_env(PBX_EXTRA_THREAD="1") if thread else sub_env()
    run = SubRun(proj, home, "servers", "-n", "2", "--boxlite-scope=worker", "-s", env=env)
    rc = run.wait()
    out = run.output
    assert rc == 0, out
    assert re.search(r"\b4 passed\b", out), out
    how = "exec" if thread else "fork"
    assert out.count(f"SERVER {how}") == 2 and "SERVER " + ("fork" if thread else "exec") not in out, out
    no_leftovers(home, out)


KILLED_IN_BOX = """
import os, subprocess, sys, time
import pytest


@pytest.mark.parametrize("i", range(2))
def test_hold(i):
    # A process in the worker's box, tagged so that the host can see whether it outlives the run.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", os.environ["PBX_TAG"]])
    time.sleep(120)
"""


@pytest.mark.timeout(180)
def test_worker_scope_kill9_of_the_controller_leaves_no_box_server_or_box(
    tmp_path: Path, home: Path, subruns: list[SubRun]
) -> None:
    """The box servers of --boxlite-scope=worker die with their controller, even by SIGKILL, and take
    their boxes (and every process in them) and their sockets with them."""
    proj = tmp_path / "proj"
    write(proj, "test_killed.py", KILLED_IN_BOX)
    tag = f"pbx-worker-kill9-{uuid.uuid4().hex}"
    run = SubRun(proj, home, "kill9", "-n", "2", "--boxlite-scope=worker", "test_killed.py", env=sub_env(PBX_TAG=tag))
    subruns.append(run)
    held = wait_until(lambda: len(pids_with(tag)) == 2 or run.proc.poll() is not None, 120)
    assert held and run.proc.poll() is None, run.output
    # The servers are forks of the controller (their command line is its own), named in the
    # process table; the workers' attach clients name the servers' sockets.
    servers = [pid for pid in children_of(run.pid) if comm_of(pid) == "boxlite-server"]
    clients = [c for c in map(_cmdline, children_of(run.pid)) if "--via" in c]
    server_dirs = {Path(c[c.index("--via") + 1]).parent for c in clients}
    assert len(servers) == 2 and len(server_dirs) == 1, (servers, server_dirs)
    assert len(ledger.scan(home)) == 2

    os.kill(run.pid, signal.SIGKILL)
    assert run.wait(30) == -signal.SIGKILL
    assert wait_until(lambda: all(process_gone(p) for p in servers), 30), "a box server outlived its controller"
    assert wait_until(lambda: not pids_with(tag), 30), "processes in the workers' boxes outlived the run"
    # Destroyed by their servers, not merely left for the next reconcile.  A server whose destroy
    # failed keeps its directory and log, which say why (CI once left one box behind, unexplained).
    server_logs = "".join(
        f"\n--- {log}\n{log.read_text(errors='replace')[-3000:]}"
        for d in server_dirs
        if d.is_dir()
        for log in sorted(d.glob("*.log"))
    )
    no_leftovers(home, run.output + server_logs)
    assert wait_until(lambda: not any(d.exists() for d in server_dirs), 10), server_dirs


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


WHOLE_SESSION = """
import os, socket
from pathlib import Path


def test_where():
    name = socket.gethostname()
    print(f"PBX-HOSTNAME={{name}}")
    assert "PYTEST_XDIST_WORKER" not in os.environ
    Path({probe!r}).write_text(name)
    assert Path({probe!r}).read_text() == name


def test_fails():
    assert False, "meant to fail"
"""


def test_worker_scope_without_n_runs_the_session_in_one_box(tmp_path: Path, home: Path, etc_probe: Path) -> None:
    proj = tmp_path / "proj"
    write(proj, "test_whole.py", WHOLE_SESSION.format(probe=str(etc_probe)))
    run = SubRun(proj, home, "whole", "-s", "--boxlite-scope=worker", "test_whole.py")
    rc = run.wait()
    out = run.output
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert re.search(r"\b1 failed, 1 passed\b", out), out
    m = re.search(r"PBX-HOSTNAME=(\S+)", out)
    assert m and WORKER_SCOPE_BOX.match(m[1]) and m[1] != socket.gethostname(), out
    assert not etc_probe.exists(), "a write to /etc inside the session's box reached the host"
    no_leftovers(home, out)

    # Another exit code comes through as well: no test collected is 5.
    run = SubRun(proj, home, "none", "--boxlite-scope=worker", "-k", "no_such_test", "test_whole.py")
    rc = run.wait()
    assert rc == pytest.ExitCode.NO_TESTS_COLLECTED, run.output
    no_leftovers(home, run.output)


# --------------------------------------------------------------------------
# 4b. worker scope: a boxed worker's forged xdist events (issue 40, class 4)

#: The worker's side: each attack is a test that speaks on xdist's own channel to the controller
#: (``WorkerInteractor.sendevent``, found in the box's worker process).  The conftest forges a
#: collection report while gw1 collects, before any test runs.
FORGED_CONFTEST = """
import gc, os


def worker():
    found = [o for o in gc.get_objects() if type(o).__name__ == "WorkerInteractor"]
    assert len(found) == 1, found
    return found[0]


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER") == "gw1":
        data = {"$report_type": "CollectReport", "nodeid": "test_forged.py", "outcome": "passed",
                "longrepr": [1], "result": None, "sections": []}
        worker().sendevent("collectreport", data=data)
"""

FORGED_EVENTS = """
import os

import pytest

from conftest import worker

ESCAPES = "\\x1b]0;PBX-TITLE\\x07\\x1b]52;c;cGJ4\\x07"


def send(name, **kwargs):
    worker().sendevent(name, **kwargs)


def own_report(request):
    rep = pytest.TestReport(request.node.nodeid, request.node.location, {}, "passed", None, "call")
    return request.config.hook.pytest_report_to_serializable(config=request.config, report=rep)


def finish(**output):
    send("workerfinished", workeroutput={"exitstatus": 0, "shouldfail": False, "shouldstop": False, **output})


ATTACKS = {
    "logstart_location_none": lambda request: send("logstart", nodeid=request.node.nodeid, location=None),
    "logfinish_location_pair": lambda request: send("logfinish", nodeid=request.node.nodeid, location=("x.py", 1)),
    "unscheduled": lambda request: send("unscheduled", indices=[0, 1]),
    "collectreport_passed": lambda request: send("collectreport", data={
        "$report_type": "CollectReport", "nodeid": request.node.nodeid, "outcome": "passed", "longrepr": [1],
        "result": None, "sections": []}),
    "workerready_not_a_dict": lambda request: send("workerready", workerinfo="hostile"),
    "teardownreport": lambda request: send("teardownreport", data=own_report(request)),
    "internal_error": lambda request: send("internal_error", formatted_error=ESCAPES + "hostile internal error"),
    "shouldstop": lambda request: finish(shouldstop="hostile stop"),
    "interrupted": lambda request: finish(exitstatus=2, shouldfail="hostile fail"),
    "shouldstop_then_exit": lambda request: (finish(shouldstop="hostile stop"), os._exit(0)),
    # Not hostile: the test ends its worker's pytest, which says it finished and leaves its channel.
    "pytest_exit": lambda request: pytest.exit("a test's own exit", returncode=7),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attack(attack, request):
    ATTACKS[attack](request)


@pytest.mark.parametrize("i", range(8))
def test_plain(i):
    assert os.environ.get("PYTEST_BOXLITE_GUEST") == "1"
"""

#: attack -> what its failed report must say.
FORGED_SAYS = {
    "logstart_location_none": "a logstart whose location is not (path, line, domain): None",
    "logfinish_location_pair": "a logfinish whose location is not (path, line, domain)",
    "unscheduled": "an unscheduled event the controller did not ask for",
    "collectreport_passed": "a collectreport outside the worker's collection",
    "workerready_not_a_dict": "a second workerready",
    "teardownreport": "an unknown event 'teardownreport'",
    "internal_error": "\\x1b]0;PBX-TITLE\\x07\\x1b]52;c;cGJ4\\x07hostile internal error",
    "shouldstop": "asking the session to stop (shouldstop='hostile stop')",
    "interrupted": "interrupted (exit status 2)",
    "shouldstop_then_exit": "crashed while running",
    "pytest_exit": "a workerfinished (exit status 7) while",
}


def junit_failures(path: Path) -> dict[str, tuple[str, str]]:
    """Test name -> (outcome, failure text), every report of the run (a crashed test has two)."""
    out: dict[str, tuple[str, str]] = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        name = tc.get("name", "")
        bad = [c for c in tc if c.tag in ("failure", "error")]
        text = "\n".join((c.get("message") or "") + "\n" + (c.text or "") for c in bad)
        outcome = "failed" if bad else "skipped" if tc.find("skipped") is not None else "passed"
        if name in out and out[name][0] == "failed":
            outcome, text = "failed", out[name][1] + "\n" + text
        out[name] = (outcome, text)
    return out


@pytest.mark.escape_row("xdist-events")
@pytest.mark.escape_row("xdist-stop")
def test_worker_scope_forged_events_fail_their_test_only(tmp_path: Path, home: Path) -> None:
    """--boxlite-scope=worker -n 2: each forged event fails the test that sent it, saying what
    was refused (escaped), and the session and every other test go on.  Without the field checks
    of pytest_boxlite.xdist_guard, the first four (and a collection report that passed) were an
    INTERNALERROR with no test run, an internal_error printed its escapes raw and lost the test
    that sent it, and a workerfinished with shouldstop ended the session after a few tests.  A
    test's own ``pytest.exit`` in worker scope (an INTERNALERROR before) fails that test: the
    worker's end is a crash, its other tests go to its replacement."""
    pytest.importorskip("xdist")
    proj = tmp_path / "proj"
    write(proj, "conftest.py", FORGED_CONFTEST)
    write(proj, "test_forged.py", FORGED_EVENTS)
    junit = tmp_path / "junit.xml"
    run = SubRun(proj, home, "forged", "-n", "2", "--boxlite-scope=worker", "-rA", f"--junitxml={junit}")
    rc = run.wait()
    out = run.output
    assert "INTERNALERROR" not in out and "Interrupted" not in out, out[-6000:]
    assert rc == pytest.ExitCode.TESTS_FAILED, out[-6000:]
    cases = junit_failures(junit)
    for attack, says in FORGED_SAYS.items():
        outcome, text = cases.get(f"test_attack[{attack}]", ("missing", ""))
        assert outcome == "failed" and says in text, f"{attack}: {outcome}\n{text}\n{out[-6000:]}"
    # The escapes came out escaped, never raw (title, clipboard).
    assert "\x1b]" not in out and "\\x1b]0;PBX-TITLE" in out, out[-6000:]
    # The worker that ended mid-test was replaced; its crash report says what its box sent.
    assert out.count("replacing crashed worker") == 2, out[-6000:]
    assert "shouldstop='hostile stop'" in cases["test_attack[shouldstop_then_exit]"][1]
    # The collection report forged before any test ran: a collection error named after gw1.
    assert "boxlite-worker-gw1" in out and "whose outcome is 'passed'" in out, out[-6000:]
    plain = {n: c for n, c in cases.items() if n.startswith("test_plain")}
    assert len(plain) == 8 and all(c[0] == "passed" for c in plain.values()), plain
    no_leftovers(home, out)


# --------------------------------------------------------------------------
# 5. images: every worker's vm home shares one image store


def test_vm_homes_of_workers_share_one_image_store(tmp_path: Path) -> None:
    base = tmp_path / "bxh"
    a = prepare_home(base, "s1-gw0")
    b = prepare_home(base, "s1-gw1")
    assert a != b and a.parent == b.parent == base / "vm"
    for h in (a, b):
        assert (h / "images").is_symlink()
        assert (h / "images").resolve() == (base / "images").resolve()
    (a / "images" / "layer").write_text("blob")
    assert (b / "images" / "layer").read_text() == "blob"
    # Preparing a home again keeps the link (a restarted worker does not get a private store).
    assert prepare_home(base, "s1-gw0") == a and (a / "images").resolve() == (base / "images").resolve()
