"""Reliability and security suite (issue 7): faults, misbehaving guests, hostile input, escapes, stress.

Everything here uses real sandboxes and real pytest sub-runs, each sub-run
with a ``--boxlite-home`` of its own that must be empty of boxes afterwards.
Run it alone with ``pytest -m reliability``.

Escape attempts are tried per runtime, both in boxes made directly through
the runtime (the ``Sandbox`` API) and in boxed tests (``@pytest.mark.boxlite``,
which on the namespace runtime run in boxes forked from a warm interpreter).
The ``vm`` variants skip with the probe's reason where no micro-VM can boot.

Every wait is a poll with a deadline; timings are asserted only as generous
upper bounds that prove "no hang", because the machines are shared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BoxFactory, skip_unless_vm_ok
from subruns import HOLDER, QUIET, SubRun, TcpServer, pids_with, process_gone, pytest_argv, sub_env, wait_until

from pytest_boxlite import ledger
from pytest_boxlite.errors import BoxliteError, BoxTimeoutError, ConfigError, InvalidPathError, SandboxFileError
from pytest_boxlite.runtimes.namespace import limits_for
from pytest_boxlite.runtimes.namespace.zygote import is_zygote_name
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec

pytestmark = pytest.mark.reliability

RUNTIME_KINDS = ["namespace", "vm"]
SUMMARY = re.compile(r"boxes booted \d+, .*leased (?P<leased>\d+), .*leaked (?P<leaked>\d+)")


# --------------------------------------------------------------------------
# helpers


def no_leftovers(home: Path) -> None:
    rows = ledger.scan(home)
    assert rows == [], f"boxes left behind in {home}: {rows}"


def box_pids(home: Path) -> dict[str, int]:
    """Name -> host pid of every namespace box recorded under ``home``."""
    out = {}
    state = home / "namespace"
    for d in sorted(state.iterdir()) if state.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, KeyError):
            # A box's host-private record lives in <name>.ctl/, out of the guest's reach.
            out[d.name] = int(json.loads((d.with_name(d.name + ".ctl") / "info.json").read_text())["pid"])
    return out


def summary_leaked(output: str) -> str:
    m = SUMMARY.search(output)
    assert m, "no boxlite summary line:\n" + output[-5000:]
    return m["leaked"]


def skip_unless_runtime(kind: str) -> None:
    if kind == "vm":
        skip_unless_vm_ok()


@pytest.fixture
def host_sleeper() -> Iterator[tuple[int, str]]:
    """A host process with a unique tag in its command line: ``(pid, tag)``."""
    tag = f"pbx-host-sleeper-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", tag])
    try:
        yield proc.pid, tag
    finally:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def ssh_secret() -> Iterator[Path]:
    """A secret file in the host user's ``~/.ssh`` (made if absent); both removed afterwards.

    As root that is /root/.ssh; an ordinary user cannot even look into /root, so its own home's.
    """
    ssh = Path("/root/.ssh") if os.geteuid() == 0 else Path.home() / ".ssh"
    created = not ssh.exists()
    ssh.mkdir(mode=0o700, exist_ok=True)
    secret = ssh / f"pbx-secret-{uuid.uuid4().hex[:12]}"
    try:
        secret.write_text("SECRET-KEY-MATERIAL\n")
        secret.chmod(0o600)
        yield secret
    finally:
        with contextlib.suppress(OSError):
            secret.unlink()
        if created:
            with contextlib.suppress(OSError):
                ssh.rmdir()


@contextlib.contextmanager
def host_victim() -> Iterator[Path]:
    """A host file outside /tmp (which boxes see copy-on-write), removed afterwards.

    As root it lives in /var/tmp.  An ordinary user's box maps only that user (as uid 0), so a
    write below a root-owned directory fails with EOVERFLOW (overlayfs cannot copy /var/tmp up with
    an owner the box cannot map): its victim lives in its own home, whose copy-up it can do.
    """
    parent = Path("/var/tmp") if os.geteuid() == 0 else Path.home()
    d = parent / f"pbx-escape-{uuid.uuid4().hex[:12]}"
    d.mkdir()
    victim = d / "victim.txt"
    try:
        victim.write_text("host original\n")
        victim.chmod(0o640)
        yield victim
    finally:
        shutil.rmtree(d, ignore_errors=True)


@dataclasses.dataclass
class Case:
    """One testcase of a junit xml file."""

    outcome: str
    message: str
    properties: dict[str, str]
    system_out: str


def junit_cases(path: Path) -> dict[str, Case]:
    """Test name -> outcome, failure text, properties and captured stdout."""
    out = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or "") + "\n" + (el.text or "")
                break
        props = {p.get("name", ""): p.get("value", "") for p in tc.iter("property")}
        system_out = "".join(el.text or "" for el in tc.iter("system-out"))
        out[tc.get("name", "")] = Case(outcome, message, props, system_out)
    return out


def host_cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()


# --------------------------------------------------------------------------
# 1. process faults


class Holder(SubRun):
    """A sub-run whose one test holds a leased box until released."""

    def __init__(self, pytester: pytest.Pytester, home: Path, tag: str, *args: str) -> None:
        pytester.makepyfile(**{f"test_hold_{tag}": HOLDER})
        self.marker = pytester.path / f"{tag}.held"
        self.release_file = pytester.path / f"{tag}.release"
        env = sub_env(HOLD_MARKER=str(self.marker), HOLD_RELEASE=str(self.release_file))
        super().__init__(pytester.path, home, tag, f"test_hold_{tag}.py", *args, env=env)

    def wait_holding(self, timeout: float = 60.0) -> str:
        ok = wait_until(lambda: self.marker.exists() or self.proc.poll() is not None, timeout)
        assert ok and self.marker.exists(), f"the held test never started (rc={self.proc.poll()}):\n{self.output}"
        assert wait_until(lambda: bool(self.marker.read_text()), 5)
        return self.marker.read_text()

    def release(self) -> None:
        self.release_file.write_text("go")


def boxes_of(home: Path, owner: str | None) -> dict[str, ledger.Leftover]:
    return {r.name: r for r in ledger.scan(home) if r.owner == owner}


def pool_boxes_running(home: Path, owner: str | None) -> int:
    """How many of ``owner``'s pool boxes run (not the zygote its sandbox boxes are forked from)."""
    return sum(r.running for n, r in boxes_of(home, owner).items() if not is_zygote_name(n))


@pytest.mark.timeout(180)
def test_kill9_mid_run_next_start_reconciles_and_spares_a_live_session(
    pytester: pytest.Pytester, home: Path, subruns: list[SubRun]
) -> None:
    """kill -9 with leased and warm boxes alive: the next start removes them all, but not a live session's boxes."""
    victim = Holder(pytester, home, "victim", "--boxlite-max-boxes=3")
    subruns.append(victim)
    live = Holder(pytester, home, "live")
    subruns.append(live)
    victim_box = victim.wait_holding()
    live_box = live.wait_holding()
    victim_owner, live_owner = ledger.owner_of(victim_box), ledger.owner_of(live_box)
    assert victim_owner and live_owner and victim_owner != live_owner

    # One leased box and two warm ones (max_boxes=3), all running, and the zygote they were forked from.
    assert wait_until(lambda: pool_boxes_running(home, victim_owner) == 3, 60), ledger.scan(home)
    victim_pids = {n: p for n, p in box_pids(home).items() if ledger.owner_of(n) == victim_owner}
    assert sum(map(is_zygote_name, victim_pids)) == 1, victim_pids
    assert wait_until(lambda: len([n for n in boxes_of(home, live_owner) if not is_zygote_name(n)]) == 2, 60)
    live_before = {n: p for n, p in box_pids(home).items() if ledger.owner_of(n) == live_owner}
    assert live_box in live_before

    os.kill(victim.pid, signal.SIGKILL)
    assert victim.wait(30) == -signal.SIGKILL
    # The watchdog pipe ends the dead session's boxes; their records stay until someone reconciles.
    assert wait_until(lambda: all(process_gone(p) for p in victim_pids.values()), 15), victim_pids
    dead = boxes_of(home, victim_owner)
    assert set(dead) == set(victim_pids) and not any(r.owner_alive for r in dead.values())

    # The next run's start reconciles: every leftover of the dead session goes, the live one stays.
    pytester.makepyfile(test_next="def test_next(boxlite_sandbox):\n    assert boxlite_sandbox.run(['true']).ok\n")
    result = pytester.runpytest(*QUIET, f"--boxlite-home={home}", "test_next.py")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    assert f"removed {len(victim_pids)} leftover box(es) of dead sessions" in out, out
    assert all(name in out for name in victim_pids), out
    assert summary_leaked(out) == "0"
    assert boxes_of(home, victim_owner) == {}

    rows = ledger.scan(home)
    assert {r.name for r in rows} == set(live_before), f"the live session's boxes were touched: {rows}"
    assert all(r.owner_alive and r.running for r in rows), rows
    assert box_pids(home) == live_before, "a live session's box was restarted"

    live.release()
    assert live.wait(60) == 0, live.output
    assert "1 passed" in live.output
    no_leftovers(home)


KEEPER = """
import os, time
from pathlib import Path

def test_guest_marks_its_box_kept(boxlite_sandbox):
    # The box's control directory is the host's state directory of the box, writable from inside.
    boxlite_sandbox.execute_command("echo from-the-guest > /run/pytest-boxlite/keep")
    Path(os.environ["HOLD_MARKER"]).write_text(boxlite_sandbox.name)
    time.sleep(120)
"""


@pytest.mark.timeout(120)
@pytest.mark.escape_row("keep-mark")
def test_kill9_leftovers_are_reaped_even_when_a_guest_marks_its_box_kept(
    pytester: pytest.Pytester, home: Path, subruns: list[SubRun]
) -> None:
    """Only the host may keep a box (``--boxlite-keep``); a guest must not outlive a killed session."""
    pytester.makepyfile(test_keeper=KEEPER)
    marker = pytester.path / "keeper.held"
    run = SubRun(pytester.path, home, "keeper", "test_keeper.py", env=sub_env(HOLD_MARKER=str(marker)))
    subruns.append(run)
    assert wait_until(lambda: (marker.exists() and bool(marker.read_text())) or run.proc.poll() is not None, 60)
    assert marker.exists(), run.output
    pids = box_pids(home)
    os.kill(run.pid, signal.SIGKILL)
    assert run.wait(30) == -signal.SIGKILL

    pytester.makepyfile(test_next="def test_next(boxlite_sandbox):\n    assert boxlite_sandbox.run(['true']).ok\n")
    result = pytester.runpytest(*QUIET, f"--boxlite-home={home}", "test_next.py")
    result.assert_outcomes(passed=1)
    no_leftovers(home)
    assert wait_until(lambda: all(process_gone(p) for p in pids.values()), 10), "a box outlived its killed session"


SIGNALLED = """
import os, subprocess, sys, time
import pytest

def test_warm_pool(boxlite_sandbox):
    assert boxlite_sandbox.run(["true"]).ok

@pytest.mark.boxlite
def test_boxed_sleeper():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", os.environ["PBX_TAG"]])
    time.sleep(120)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_mid_run_gives_pytests_exit_code_and_leaves_nothing(
    pytester: pytest.Pytester, home: Path, subruns: list[SubRun], sig: signal.Signals
) -> None:
    """SIGTERM or SIGINT while a boxed test runs (and warm boxes wait): pytest's own exit, every box reaped."""
    tag = f"pbx-signalled-{uuid.uuid4().hex}"
    pytester.makepyfile(test_signalled=SIGNALLED)
    run = SubRun(pytester.path, home, "signalled", "test_signalled.py", env=sub_env(PBX_TAG=tag))
    subruns.append(run)
    assert wait_until(lambda: bool(pids_with(tag)) or run.proc.poll() is not None, 60), run.output
    assert pids_with(tag), f"the boxed test never started:\n{run.output}"
    # The boxed test's warm interpreter and the fixture's warm pool box are both alive.
    assert wait_until(lambda: len(box_pids(home)) >= 2, 10), box_pids(home)
    boxes = box_pids(home)

    run.proc.send_signal(sig)
    rc = run.wait(60)
    if sig == signal.SIGTERM:
        assert rc == -signal.SIGTERM, f"rc={rc}\n{run.output}"
    else:
        assert rc == pytest.ExitCode.INTERRUPTED, f"rc={rc}\n{run.output}"
        assert "KeyboardInterrupt" in run.output
    no_leftovers(home)
    assert wait_until(lambda: all(process_gone(p) for p in boxes.values()), 10), boxes
    assert wait_until(lambda: not pids_with(tag), 10), "a process started in a box outlived the run"


XDIST_VICTIM = """
import os, socket, time
from pathlib import Path
import pytest

def test_victim(boxlite_sandbox):
    boxlite_sandbox.write_file("/workspace/x", "y")
    Path(os.environ["PBX_PIDFILE"]).write_text(str(os.getpid()))
    time.sleep(120)

@pytest.mark.parametrize("i", range(8))
def test_sandbox(i, boxlite_sandbox):
    assert boxlite_sandbox.run(["true"]).ok

@pytest.mark.boxlite
@pytest.mark.parametrize("i", range(4))
def test_boxed(i):
    assert socket.gethostname().startswith("pbx-")
"""


@pytest.mark.timeout(180)
def test_xdist_worker_sigkill_mid_test_completes_and_leaves_nothing(
    pytester: pytest.Pytester, home: Path, subruns: list[SubRun]
) -> None:
    pidfile = pytester.path / "victim.pid"
    pytester.makepyfile(test_xdist_victim=XDIST_VICTIM)
    run = SubRun(pytester.path, home, "xdist", "-n", "2", "test_xdist_victim.py", env=sub_env(PBX_PIDFILE=str(pidfile)))
    subruns.append(run)
    assert wait_until(lambda: (pidfile.exists() and bool(pidfile.read_text())) or run.proc.poll() is not None, 90)
    assert pidfile.exists(), run.output
    worker = int(pidfile.read_text())
    assert worker != run.pid
    os.kill(worker, signal.SIGKILL)

    rc = run.wait(150)
    out = run.output
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert re.search(r"worker '?gw\d'? crashed while running '?test_xdist_victim.py::test_victim'?", out), out
    assert re.search(r"\b1 failed, 12 passed\b", out), out
    no_leftovers(home)


# --------------------------------------------------------------------------
# 2. guest misbehaviour
#
# One sub-run holds every misbehaving test, each followed by a test that must pass (in a pristine
# box); the host-side tests below each check one cell of it.  The Sandbox-API tests come first:
# see test_fixture_leases_are_not_starved_by_boxed_tests for why their order matters today.

MISBEHAVING = r'''
import os, socket, subprocess, sys
import pytest

# A bounded fork bomb: a small interpreter forks until fork fails; each child is a `cat`
# blocked on a pipe, so the children cost little memory and the pids limit is what stops it.
BOMB = """
import os
r, w = os.pipe()
children = 0
err = None
while children < 10000:
    try:
        pid = os.fork()
    except OSError as exc:
        err = exc
        break
    if pid == 0:
        os.dup2(r, 0)
        os.execv("/bin/cat", ["cat"])
    children += 1
os.close(w)
for _ in range(children):
    os.wait()
print(children, type(err).__name__, getattr(err, "errno", None))
"""

def pristine():
    assert socket.gethostname().startswith("pbx-")
    assert os.listdir("/workspace") == []
    assert not os.path.exists("/run/pbx-polluted"), "a file written to /run by an earlier test"
    assert not os.path.exists("/dev/pbx-polluted"), "a file written to /dev by an earlier test"
    assert open("/dev/null").read() == "" and os.path.isdir("/dev/pts"), os.listdir("/dev")
    assert subprocess.run(["true"]).returncode == 0

def test_a1_sandbox_stdout_flood(boxlite_sandbox, record_property):
    sb = boxlite_sandbox
    r = sb.execute_command("yes xxxxxxxxxxxxxxx | head -c 104857600", timeout=120)
    record_property("stdout_len", len(r.stdout_bytes))
    record_property("max_output", sb.max_output)
    assert r.exit_code == 0 and not r.timed_out, r
    assert r.truncated and r.stdout_truncated and not r.stderr_truncated
    assert 0 < len(r.stdout_bytes) <= sb.max_output

def test_a2_next(boxlite_sandbox):
    assert boxlite_sandbox.execute_command("echo ok").stdout == "ok\n"

def test_b1_sandbox_delete_own_workspace(boxlite_sandbox):
    sb = boxlite_sandbox
    sb.write_file("/workspace/precious", "x")
    assert sb.execute_command("rm -rf /workspace").exit_code == 0
    assert not sb.exists("/workspace")
    assert sb.execute_command("echo alive").stdout == "alive\n"
    sb.write_file("/workspace/again/f", "y")
    assert sb.read_file("/workspace/again/f") == "y"

def test_b2_next(boxlite_sandbox):
    assert boxlite_sandbox.list_dir("/workspace") == []

@pytest.mark.boxlite
def test_c1_fork_bomb(record_property):
    r = subprocess.run([sys.executable, "-I", "-S", "-c", BOMB], capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr
    children, exc, err = r.stdout.split()
    record_property("children", children)
    assert exc in ("BlockingIOError", "OSError") and int(err) == 11, r.stdout  # EAGAIN: the pids cgroup
    assert int(children) < 10000

@pytest.mark.boxlite
def test_c2_next():
    pristine()

@pytest.mark.boxlite(memory=128)
def test_d1_memory_hog():
    hog = []
    while True:
        hog.append(bytearray(16 << 20))

@pytest.mark.boxlite
def test_d2_next():
    pristine()

@pytest.mark.boxlite(timeout=2)
def test_e1_endless_loop():
    while True:
        pass

@pytest.mark.boxlite
def test_e2_next():
    pristine()

@pytest.mark.boxlite
def test_f1_stdout_flood():
    chunk = "x" * (1 << 20)
    for _ in range(100):
        sys.stdout.write(chunk)

@pytest.mark.boxlite
def test_f2_next():
    pristine()

@pytest.mark.boxlite
def test_g1_delete_own_workspace():
    with open("/workspace/precious", "w") as f:
        f.write("x")
    os.chdir("/workspace")
    subprocess.run(["rm", "-rf", "/workspace"])  # the mount point itself stays ("busy")
    assert not os.path.exists("/workspace/precious")
    # The box still works: new processes, new files.
    os.chdir("/")
    assert subprocess.run(["sh", "-c", "echo alive"], capture_output=True, text=True).stdout == "alive\n"
    os.makedirs("/workspace/again", exist_ok=True)
    with open("/workspace/again/f", "w") as f:
        f.write("y")

@pytest.mark.boxlite
def test_g2_next():
    pristine()

@pytest.mark.boxlite
def test_h1_write_to_run():
    with open("/run/pbx-polluted", "w") as f:
        f.write("left by test_h1")
    with open("/dev/pbx-polluted", "w") as f:  # /dev was one tmpfs shared by every forked box
        f.write("left by test_h1")

@pytest.mark.boxlite
def test_h2_next():
    pristine()

@pytest.mark.boxlite
def test_i1_wipe_run():
    subprocess.run("rm -rf /run/* /run/.[!.]*", shell=True)

@pytest.mark.boxlite
def test_i2_next():
    pristine()
'''

RUSAGE_WRAPPER = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.call(sys.argv[1:])\n"
    "sys.stderr.write('PBX-MAXRSS-KB %d\\n' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(rc)\n"
)


def run_bounded(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run ``argv`` in a session of its own; on timeout kill the whole group and fail with its output."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        tail = (out + err).decode(errors="replace")[-5000:]
        pytest.fail(f"the sub-run did not finish within {timeout:.0f}s (deadlock or hang):\n{tail}")
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


@dataclasses.dataclass(repr=False)
class Misbehaviour:
    """The misbehaving sub-run: its testcases, output, peak host RSS and what it left."""

    cases: dict[str, Case]
    output: str
    returncode: int
    maxrss_kb: int
    elapsed: float
    leftovers: list[ledger.Leftover]

    def case(self, name: str, outcome: str) -> Case:
        case = self.cases[name]
        assert case.outcome == outcome, f"{name}: {case.outcome} (expected {outcome})\n{case.message[-3000:]}"
        return case

    def next_passed(self, name: str) -> None:
        """The test after a misbehaving one passed: its box was pristine and worked."""
        self.case(name, "passed")


@pytest.fixture(scope="module")
def misbehaviour(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Misbehaviour]:
    work = tmp_path_factory.mktemp("misbehaving")
    home = work / "bxh"
    (work / "test_misbehaving.py").write_text(MISBEHAVING)
    junit = work / "junit.xml"
    argv = pytest_argv(
        home,
        "test_misbehaving.py",
        "--tb=short",
        f"--junitxml={junit}",
        "-o",
        "junit_logging=system-out",
        "--boxlite-lease-timeout=60",  # a starved lease fails in a minute instead of five
    )
    t0 = time.monotonic()
    try:
        rc, out, err = run_bounded([sys.executable, "-c", RUSAGE_WRAPPER, *argv], work, sub_env(), 280)
        elapsed = time.monotonic() - t0
        rss = re.search(r"PBX-MAXRSS-KB (\d+)", err)
        assert rss, err[-3000:]
        yield Misbehaviour(junit_cases(junit), out + err, rc, int(rss[1]), elapsed, ledger.scan(home))
    finally:
        if home.exists():
            ledger.reconcile(home, include_kept=True)


@pytest.mark.timeout(300)
def test_misbehaving_run_completes_without_leftovers(misbehaviour: Misbehaviour) -> None:
    assert misbehaviour.leftovers == []
    assert summary_leaked(misbehaviour.output) == "0"
    assert len(misbehaviour.cases) == 18, sorted(misbehaviour.cases)
    assert misbehaviour.returncode == pytest.ExitCode.TESTS_FAILED  # the hog and the loop fail, as they should
    assert misbehaviour.elapsed < 240, f"the run took {misbehaviour.elapsed:.0f}s"


@pytest.mark.timeout(300)
@pytest.mark.escape_row("lingering-box")
def test_fork_bomb_is_stopped_by_the_pids_limit(misbehaviour: Misbehaviour) -> None:
    bomb = misbehaviour.case("test_c1_fork_bomb", "passed")
    # Stopped by the box's pids limit (4096), long before the bound of 10000.
    assert 100 < int(bomb.properties["children"]) < 4096, bomb.properties
    misbehaviour.next_passed("test_c2_next")


@pytest.mark.timeout(300)
def test_memory_hog_is_oom_killed_and_reported(misbehaviour: Misbehaviour) -> None:
    missing = [m for m in limits_for(BoxSpec(memory_mib=128)).missing if m.startswith("memory")]
    if missing:
        # The run said so in its header instead of pretending the cap holds.
        header = re.search(r"^boxlite: limits not enforced: .*$", misbehaviour.output, re.M)
        assert header and "memory" in header[0], misbehaviour.output[:3000]
        v = "v2" if Path("/sys/fs/cgroup/cgroup.controllers").exists() else "v1"
        pytest.skip(
            f"no memory cgroup for uid {os.getuid()} on this host (cgroup {v}, no delegation: {missing[0]}): "
            "the OOM cap cannot be enforced, so there is no OOM kill to report"
        )
    hog = misbehaviour.case("test_d1_memory_hog", "failed")
    assert "OOM" in hog.message and "memory cap" in hog.message, hog.message
    misbehaviour.next_passed("test_d2_next")


@pytest.mark.timeout(300)
def test_endless_loop_is_killed_by_the_timeout_and_reported(misbehaviour: Misbehaviour) -> None:
    loop = misbehaviour.case("test_e1_endless_loop", "failed")
    assert "timed out after 2s" in loop.message and "killed" in loop.message, loop.message
    misbehaviour.next_passed("test_e2_next")


@pytest.mark.timeout(300)
def test_stdout_flood_is_cut_without_hang_or_host_memory_blowup(misbehaviour: Misbehaviour) -> None:
    flood = misbehaviour.case("test_f1_stdout_flood", "passed").system_out
    m = re.search(r"\[pytest-boxlite: (\d+) more characters of this section were cut\]", flood)
    assert m and int(m[1]) > 90 * (1 << 20), flood[-500:]
    assert len(flood) < 2 * (1 << 20)
    assert len(misbehaviour.output) < 8 * (1 << 20), "the terminal got the whole flood"
    rss_mib = misbehaviour.maxrss_kb // 1024
    assert rss_mib < 600, f"peak RSS of the host pytest was {rss_mib} MiB"
    misbehaviour.next_passed("test_f2_next")


@pytest.mark.timeout(300)
def test_boxed_test_deleting_its_workspace(misbehaviour: Misbehaviour) -> None:
    misbehaviour.case("test_g1_delete_own_workspace", "passed")
    misbehaviour.next_passed("test_g2_next")


@pytest.mark.timeout(300)
def test_sandbox_stdout_flood_is_truncated_and_flagged(misbehaviour: Misbehaviour) -> None:
    flood = misbehaviour.case("test_a1_sandbox_stdout_flood", "passed")
    assert 0 < int(flood.properties["stdout_len"]) <= int(flood.properties["max_output"])
    misbehaviour.next_passed("test_a2_next")


@pytest.mark.timeout(300)
def test_sandbox_deleting_its_workspace(misbehaviour: Misbehaviour) -> None:
    misbehaviour.case("test_b1_sandbox_delete_own_workspace", "passed")
    misbehaviour.next_passed("test_b2_next")


@pytest.mark.timeout(300)
@pytest.mark.escape_row("sibling-boxes")
def test_boxed_test_writes_to_run_do_not_reach_the_next_boxed_test(misbehaviour: Misbehaviour) -> None:
    """A boxed test's box must be as pristine as a new one: /run and /dev included."""
    misbehaviour.case("test_h1_write_to_run", "passed")
    misbehaviour.next_passed("test_h2_next")


@pytest.mark.timeout(300)
def test_boxed_test_wiping_run_does_not_break_the_next_boxed_test(misbehaviour: Misbehaviour) -> None:
    """``rm -rf /run/*`` in one boxed test (an installer's clean-up gone wrong) must not break the next."""
    misbehaviour.case("test_i1_wipe_run", "passed")
    misbehaviour.next_passed("test_i2_next")


STARVED = """
import pytest

@pytest.mark.boxlite
def test_boxed_default():
    pass

@pytest.mark.boxlite(memory=256)
def test_boxed_with_its_own_spec():
    pass

def test_fixture_after(boxlite_sandbox):
    assert boxlite_sandbox.run(["true"]).ok
"""


@pytest.mark.timeout(90)
# An ordinary user's memory=256 is not enforced: its warning is shown, not raised (an in-process sub-run).
@pytest.mark.filterwarnings("default:.*is not enforced here:pytest.PytestWarning")
def test_fixture_leases_are_not_starved_by_boxed_tests(pytester: pytest.Pytester, home: Path) -> None:
    """With the default --boxlite-max-boxes (2), boxed tests of two specs must not keep every box from later fixtures.

    ``--boxlite-lease-timeout=20`` makes a starved lease fail in 20 s instead of the default 300 s.
    """
    pytester.makepyfile(test_starved=STARVED)
    t0 = time.monotonic()
    result = pytester.runpytest(*QUIET, f"--boxlite-home={home}", "--boxlite-lease-timeout=20")
    no_leftovers(home)
    assert time.monotonic() - t0 < 80
    result.assert_outcomes(passed=3)


# --------------------------------------------------------------------------
# 3. hostile input through the Sandbox API


@pytest.mark.timeout(60)
def test_dotdot_paths_are_normalized(sandbox: Sandbox) -> None:
    sb = sandbox
    tag = uuid.uuid4().hex[:10]
    sb.write_file("/workspace/a/b/../../c.txt", "c")
    assert sb.read_file("/workspace/c.txt") == "c"
    assert not sb.exists("/workspace/a/b/c.txt")
    assert sb.list_dir("/workspace") == ["/workspace/c.txt"]
    # Relative paths resolve against the workdir, and `..` cannot climb above /.
    sb.write_file(f"../../../../../../etc/pbx-dotdot-{tag}", "in the box")
    assert sb.read_file(f"/etc/pbx-dotdot-{tag}") == "in the box"
    assert sb.read_file(f"/../../etc/./pbx-dotdot-{tag}") == "in the box"
    assert not Path(f"/etc/pbx-dotdot-{tag}").exists(), "a write in a box reached the host"
    assert sb.list_dir("/..", max_depth=1) == sb.list_dir("/", max_depth=1)
    assert sb.run(["pwd"], cwd="..").stdout == "/\n"
    assert sb.glob("/workspace/a/..", "*.txt").items == ["/workspace/c.txt"]
    assert [m.path for m in sb.grep("/workspace/a/b/../..", "c").items] == ["/workspace/c.txt"]


@pytest.mark.timeout(60)
def test_nul_bytes_in_paths_are_invalid(sandbox: Sandbox, tmp_path: Path) -> None:
    sb = sandbox
    bad = "/workspace/nul\0byte"
    calls: list[Callable[[], object]] = [
        lambda: sb.read_file(bad),
        lambda: sb.read_bytes(bad),
        lambda: sb.write_file(bad, "x"),
        lambda: sb.write_bytes(bad, b"x"),
        lambda: sb.exists(bad),
        lambda: sb.remove(bad),
        lambda: sb.list_dir(bad),
        lambda: sb.glob(bad, "*"),
        lambda: sb.grep(bad, "x"),
        lambda: sb.download(bad, tmp_path / "d"),
        lambda: sb.upload(tmp_path, bad),
        lambda: sb.run(["true"], cwd=bad),
    ]
    for call in calls:
        with pytest.raises(InvalidPathError, match="NUL"):
            call()
    with pytest.raises(ConfigError, match="NUL"):
        sb.run(["echo", "a\0b"])
    assert sb.list_dir("/workspace") == []  # nothing was created by any of them


@pytest.mark.timeout(60)
def test_newlines_in_paths_work(sandbox: Sandbox) -> None:
    sb = sandbox
    path = "/workspace/line\nbreak/file\nname.txt"
    sb.write_file(path, "needle\n")
    assert sb.read_file(path) == "needle\n"
    assert sb.exists(path)
    assert path in sb.list_dir("/workspace")
    assert sb.glob("/workspace", "**/*.txt").items == [path]
    assert sb.grep("/workspace", "needle").items == [(path, 1, "needle")]
    assert sb.run(["cat", path]).stdout == "needle\n"
    sb.remove("/workspace/line\nbreak")
    assert sb.list_dir("/workspace") == []


def assert_name_too_long(call: Callable[[], object]) -> None:
    """``call`` fails promptly with a file error carrying ENAMETOOLONG (and nothing vaguer)."""
    t0 = time.monotonic()
    error: BoxliteError | None = None
    try:
        call()
    except BoxliteError as exc:
        error = exc
    assert time.monotonic() - t0 < 20
    assert error is not None, "no error for a name longer than the system allows"
    if not isinstance(error, SandboxFileError):
        pytest.fail(f"{type(error).__name__} instead of an ENAMETOOLONG file error: ...{str(error)[-600:]}")
    assert isinstance(error, OSError)
    assert error.errno == errno.ENAMETOOLONG, error


@pytest.mark.timeout(60)
def test_4kb_file_names_are_clear_errors_without_hanging(sandbox: Sandbox) -> None:
    sb = sandbox
    long_name = "/workspace/" + "n" * 4096
    assert_name_too_long(lambda: sb.write_file(long_name, "x"))
    assert_name_too_long(lambda: sb.write_bytes("/workspace/sub/" + "n" * 4096, b"x"))
    assert_name_too_long(lambda: sb.read_file(long_name))
    assert_name_too_long(lambda: sb.remove(long_name))
    assert_name_too_long(lambda: sb.list_dir(long_name))
    assert sb.exists(long_name) is False
    # The longest legal name still works, and the box is fine.
    sb.write_file("/workspace/" + "n" * 255, "ok")
    assert sb.read_file("/workspace/" + "n" * 255) == "ok"
    assert sb.execute_command("echo fine").stdout == "fine\n"


@pytest.mark.timeout(60)
def test_4kb_paths_of_short_components_are_clear_errors_without_hanging(sandbox: Sandbox) -> None:
    sb = sandbox
    long_path = "/workspace/" + "d/" * 2100 + "f"  # every component short, the whole longer than PATH_MAX
    assert_name_too_long(lambda: sb.read_file(long_path))
    assert_name_too_long(lambda: sb.write_file(long_path, "x"))
    assert sb.execute_command("echo fine").stdout == "fine\n"


@pytest.mark.timeout(60)
def test_symlink_loops_under_glob_and_grep_return(sandbox: Sandbox) -> None:
    sb = sandbox
    setup = (
        "mkdir -p /workspace/loop/sub && cd /workspace/loop && "
        "ln -s . self && ln -s .. sub/up && ln -s /workspace/loop sub/abs && "
        "ln -s a b && ln -s b a && ln -s sub/up sub/up2 && echo needle > sub/file.txt"
    )
    assert sb.execute_command(setup).ok
    t0 = time.monotonic()
    paths, truncated = sb.glob("/workspace/loop", "**/*", include_dirs=True, timeout=20)
    assert not truncated
    assert sorted(paths) == [
        "/workspace/loop/a",
        "/workspace/loop/b",
        "/workspace/loop/self",
        "/workspace/loop/sub",
        "/workspace/loop/sub/abs",
        "/workspace/loop/sub/file.txt",
        "/workspace/loop/sub/up",
        "/workspace/loop/sub/up2",
    ]
    assert sb.grep("/workspace/loop", "needle", timeout=20).items == [("/workspace/loop/sub/file.txt", 1, "needle")]
    assert sb.grep("/workspace", "needle", glob="*.txt", timeout=20).items == [
        ("/workspace/loop/sub/file.txt", 1, "needle")
    ]
    assert len(sb.list_dir("/workspace/loop", max_depth=50, timeout=20)) == 8
    assert time.monotonic() - t0 < 40
    # Reading through a loop is a clear file error (ELOOP), not a hang.
    with pytest.raises(SandboxFileError) as info:
        sb.read_file("/workspace/loop/a")
    assert info.value.errno == errno.ELOOP


COUNT_AGENT_FORKS = """
import os
n = 0
for p in os.listdir('/proc'):
    try:
        n += p.isdigit() and b'guest/agent.py' in open('/proc/%s/cmdline' % p, 'rb').read()
    except OSError:
        pass
print(n)
"""


@pytest.mark.timeout(60)
def test_catastrophic_grep_pattern_is_bounded_by_the_timeout(sandbox: Sandbox) -> None:
    sb = sandbox

    def agent_processes() -> str:
        # The agent and the file helpers it forks share its command line.
        return str(sb.run([sb.handle.guest_python, "-c", COUNT_AGENT_FORKS], timeout=20).stdout.strip())

    baseline = agent_processes() if sb.runtime == "namespace" else ""
    sb.write_file("/workspace/evil.txt", "a" * 40 + "b\n")
    t0 = time.monotonic()
    with pytest.raises(BoxTimeoutError, match="did not finish within 2s"):
        sb.grep("/workspace", "(a+)+$", timeout=2)
    assert time.monotonic() - t0 < 15
    # The box still works, and the runaway matcher was killed, not left burning a CPU.
    assert sb.execute_command("echo alive", timeout=20).stdout == "alive\n"
    assert sb.grep("/workspace", "b$", timeout=20).items == [("/workspace/evil.txt", 1, "a" * 40 + "b")]
    if sb.runtime == "namespace":
        assert wait_until(lambda: agent_processes() == baseline, 10), "the timed-out grep still runs in the box"


#: (where the value comes from, option name, bad value, why it is bad)
BAD_OPTIONS = [
    ("cli", "max_boxes", "0", "must be at least 1"),
    ("cli", "network", "maybe", "must be one of: on, off"),
    ("cli", "lease_timeout", "inf", "must be a number of seconds > 0"),
    ("env", "timeout", "soon", "must be a number"),
    ("env", "scope", "session", "must be one of: test, module, worker"),
    ("ini", "memory", "12", "must be at least 64 (MiB)"),
    ("ini", "runtime", "qemu", "must be one of: auto, vm, namespace"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("source", "name", "value", "reason"), [pytest.param(*case, id=f"{case[1]}-{case[0]}") for case in BAD_OPTIONS]
)
def test_invalid_option_values_are_usage_errors(
    pytester: pytest.Pytester,
    home: Path,
    monkeypatch: pytest.MonkeyPatch,
    source: str,
    name: str,
    value: str,
    reason: str,
) -> None:
    """A bad value stops the run (exit 4) with a message naming the option, the value and its source."""
    flag = "--boxlite-" + name.replace("_", "-")
    args = [f"--boxlite-home={home}"]
    if source == "cli":
        args.append(f"{flag}={value}")
        where = f"the command line ({flag})"
    elif source == "env":
        monkeypatch.setenv(f"PYTEST_BOXLITE_{name.upper()}", value)
        where = f"environment variable PYTEST_BOXLITE_{name.upper()}"
    else:
        pytester.makeini(f"[pytest]\nboxlite_{name} = {value}\n")
        where = f"ini key boxlite_{name}"
    pytester.makepyfile("def test_never_runs(boxlite_sandbox):\n    raise AssertionError('must not run')\n")
    result = pytester.runpytest(*QUIET, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert f"{flag}: bad value {value!r} from {where}: {reason}" in err, err
    assert "Traceback" not in err + result.stdout.str()
    assert "must not run" not in result.stdout.str()
    no_leftovers(home)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("marker", "names"),
    [
        pytest.param("cpu=2", ["cpu"], id="unknown-argument"),
        pytest.param("memory=12", ["memory", "12"], id="memory-too-small"),
        pytest.param("timeout=-1", ["timeout", "-1"], id="negative-timeout"),
        pytest.param("network='yes'", ["network", "'yes'"], id="network-not-bool"),
        pytest.param("'python:3.12'", ["positional"], id="positional"),
    ],
)
def test_invalid_marker_arguments_are_usage_errors_naming_the_test(
    pytester: pytest.Pytester, home: Path, marker: str, names: list[str]
) -> None:
    pytester.makepyfile(
        test_marked=f"""
        import pytest

        def test_fine(boxlite_sandbox):
            pass

        @pytest.mark.boxlite({marker})
        def test_bad_marker():
            raise AssertionError("must not run")
        """
    )
    result = pytester.runpytest(*QUIET, f"--boxlite-home={home}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    lines = [ln for ln in err.splitlines() if "test_marked.py::test_bad_marker" in ln and "@pytest.mark.boxlite" in ln]
    assert lines, err
    assert all(any(n in ln for ln in lines) for n in names), err
    assert "Traceback" not in err + result.stdout.str()
    assert "passed" not in result.stdout.str()
    no_leftovers(home)


NONEXISTENT_IMAGE_TESTS = """
import socket
import pytest

def test_fixture(boxlite_sandbox):
    assert boxlite_sandbox.run(["true"]).ok

@pytest.mark.filterwarnings("default::pytest.PytestWarning")  # namespace: "has no effect" (shown, not raised)
def test_pool_with_another_missing_image(boxlite_pool):
    with boxlite_pool.sandbox(image="also-does-not-exist:0") as sb:
        assert sb.execute_command("echo ok").stdout == "ok\\n"

@pytest.mark.boxlite
def test_boxed():
    assert socket.gethostname().startswith("pbx-")
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", RUNTIME_KINDS)
def test_nonexistent_image(pytester: pytest.Pytester, home: Path, kind: str) -> None:
    """namespace: a usage error naming the image; vm: it would fail at boot (needs a VM)."""
    skip_unless_runtime(kind)
    pytester.makepyfile(test_image=NONEXISTENT_IMAGE_TESTS)
    result = pytester.runpytest(
        *QUIET, f"--boxlite-home={home}", f"--boxlite-runtime={kind}", "--boxlite-image=does-not-exist:nope"
    )
    out = result.stdout.str()
    if kind == "namespace":
        # Boxes are on the image asked for (issue 25): one that cannot be had is a usage error at start.
        assert result.ret == pytest.ExitCode.USAGE_ERROR, out
        assert "image 'does-not-exist:nope' cannot be used" in result.stderr.str(), out
    else:
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        assert "does-not-exist:nope" in out
    no_leftovers(home)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["regular-file", "under-a-file", "read-only-dir", "sysfs", "env-regular-file"])
def test_unwritable_home_is_a_clear_usage_error(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    immutable: Path | None = None
    if how in ("regular-file", "env-regular-file"):
        target = a_file
    elif how == "under-a-file":
        target = a_file / "home"
    elif how == "sysfs":
        target = Path("/sys") / f"pbx-home-{uuid.uuid4().hex[:8]}"
    else:
        # Root ignores permission bits: an immutable directory is read-only even for root.
        immutable = tmp_path / "read-only"
        immutable.mkdir()
        if subprocess.run(["chattr", "+i", str(immutable)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not available here")
        target = immutable / "home"
    pytester.makepyfile("def test_never_runs(boxlite_sandbox):\n    raise AssertionError('must not run')\n")
    try:
        if how.startswith("env-"):
            monkeypatch.setenv("PYTEST_BOXLITE_HOME", str(target))
            result = pytester.runpytest(*QUIET)
        else:
            result = pytester.runpytest(*QUIET, f"--boxlite-home={target}")
    finally:
        if immutable is not None:
            subprocess.run(["chattr", "-i", str(immutable)], check=True)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    err = result.stderr.str()
    assert f"--boxlite-home {target} is not usable" in err, err
    assert "writable directory" in err
    assert "Traceback" not in err + result.stdout.str()
    assert "must not run" not in result.stdout.str()
    assert a_file.read_text() == "not a directory"
    if immutable is not None:
        assert list(immutable.iterdir()) == []


# --------------------------------------------------------------------------
# 4. escape attempts: boxes made through the runtime (Sandbox API)


def py(sb: Sandbox, code: str, *args: str, timeout: float = 30) -> Any:
    return sb.run([sb.handle.guest_python, "-c", textwrap.dedent(code), *args], timeout=timeout)


@pytest.mark.timeout(60)
@pytest.mark.escape_row("host-files")
def test_escape_write_host_paths(make_box: BoxFactory) -> None:
    tag = uuid.uuid4().hex[:10]
    with host_victim() as victim:
        before = (victim.read_bytes(), victim.stat().st_mode, victim.stat().st_mtime_ns)
        sb = make_box()
        d = str(victim.parent)
        r = sb.execute_command(
            f"echo overwritten > {victim} && chmod 777 {victim} && cat {victim} && rm -f {victim} && "
            f"echo planted > {d}/planted && rm -rf {d} && test ! -e {d} && "
            f"echo planted > /etc/pbx-escape-{tag} && echo planted > /usr/pbx-escape-{tag} && echo done",
            timeout=30,
        )
        if sb.runtime == "namespace":
            # Copy-on-write: every write succeeds in the box...
            assert r.ok and r.stdout == "overwritten\ndone\n", r
        # ...and none reaches the host.
        assert (victim.read_bytes(), victim.stat().st_mode, victim.stat().st_mtime_ns) == before
        assert sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"]
        assert not Path(f"/etc/pbx-escape-{tag}").exists()
        assert not Path(f"/usr/pbx-escape-{tag}").exists()


@pytest.mark.timeout(60)
@pytest.mark.escape_row("host-processes")
def test_escape_see_host_processes(sandbox: Sandbox, host_sleeper: tuple[int, str]) -> None:
    sleeper_pid, tag = host_sleeper
    me = host_cmdline(os.getpid())
    r = py(
        sandbox,
        """
        import os, sys
        cmds = {}
        for p in os.listdir('/proc'):
            if p.isdigit():
                try:
                    cmds[p] = open('/proc/%s/cmdline' % p, 'rb').read().replace(b'\\0', b' ').decode(errors='replace')
                except OSError:
                    pass
        print(len(cmds))
        for p, c in cmds.items():
            print(p, c)
        """,
    )
    assert r.ok, r.stderr
    count, *lines = r.stdout.splitlines()
    assert int(count) < 20, lines
    assert not any(tag in line for line in lines), "a host process is visible in the box"
    assert not any(line.split(" ", 1)[-1].strip() == me for line in lines), "the host test process is visible"
    # Nor can the box signal it: that pid is not in the box's pid namespace (or is another process).
    kill = sandbox.execute_command(f"kill -9 {sleeper_pid}", timeout=20)
    time.sleep(0.2)
    assert not process_gone(sleeper_pid), "a box killed a host process"
    if str(sleeper_pid) not in {line.split(" ", 1)[0] for line in lines}:
        assert kill.exit_code != 0


@pytest.mark.timeout(60)
@pytest.mark.escape_row("loopback-off", "loopback-on")
def test_escape_reach_host_loopback(make_box: BoxFactory, tcp_server: TcpServer) -> None:
    """network off (default): the host's loopback is unreachable; network on shares the host's network namespace."""
    connect = """
        import socket, sys
        try:
            s = socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=3)
        except OSError as exc:
            print('failed', type(exc).__name__)
            sys.exit(1)
        s.sendall(sys.argv[2].encode())
        s.close()
        print('connected')
        """
    off = make_box()
    r = py(off, connect, str(tcp_server.port), "box-network-off")
    assert r.exit_code == 1 and r.stdout.startswith("failed"), r
    on = make_box(BoxSpec(network=True))
    r = py(on, connect, str(tcp_server.port), "box-network-on")
    assert r.ok and r.stdout == "connected\n", r
    assert tcp_server.got(b"box-network-on")
    assert b"box-network-off" not in tcp_server.received


@pytest.mark.timeout(60)
@pytest.mark.escape_row("home-secrets")
def test_escape_read_home_secrets(make_box: BoxFactory) -> None:
    with ssh_secret() as secret:
        sb = make_box()  # made after the secret exists: the mask is decided when a box is made
        for ssh in {"/root/.ssh", str(Path.home() / ".ssh"), str(secret.parent)}:
            if sb.exists(ssh):
                assert sb.list_dir(ssh) == [], f"{ssh} is visible in the box"
        r = sb.execute_command(f"cat {secret}; cat ~/.ssh/{secret.name}", timeout=20)
        assert r.exit_code != 0 and "SECRET" not in r.stdout
        if sb.exists(str(secret.parent)):  # a VM image has none: nothing of the host's there to read
            assert sb.grep(str(secret.parent), "SECRET-KEY-MATERIAL", timeout=30).items == []
        sb.write_file(f"{secret.parent}/planted-{secret.name}", "x")
        assert not (secret.parent / f"planted-{secret.name}").exists()
        assert secret.read_text() == "SECRET-KEY-MATERIAL\n"


@pytest.mark.timeout(60)
@pytest.mark.escape_row("sysctl-hostname-clock")
def test_escape_change_host_time_or_hostname(sandbox: Sandbox) -> None:
    host = socket.gethostname()
    wall0, mono0 = time.time(), time.monotonic()
    r = sandbox.execute_command("date -s '2001-01-01 00:00:00'", timeout=20)
    assert r.exit_code != 0, r
    drift = (time.time() - wall0) - (time.monotonic() - mono0)
    assert abs(drift) < 5, f"the host clock moved by {drift:.0f}s"
    assert int(sandbox.execute_command("date +%Y", timeout=20).stdout) > 2001
    r = py(sandbox, "import socket; socket.sethostname('pbx-escaped'); print(socket.gethostname())")
    if sandbox.runtime == "namespace":
        # Root of a namespace box holds Docker's default capabilities (no CAP_SYS_ADMIN): EPERM.
        assert not r.ok and "PermissionError" in r.stderr, r
    else:
        assert r.ok and r.stdout == "pbx-escaped\n", r
        assert sandbox.execute_command("hostname", timeout=20).stdout == "pbx-escaped\n"
    assert socket.gethostname() == host


# --------------------------------------------------------------------------
# 4. escape attempts: boxed tests (@pytest.mark.boxlite), one sub-run per runtime

BOXED_ESCAPES = r"""
import os, signal, socket, subprocess, time
import pytest

pytestmark = pytest.mark.boxlite
ENV = os.environ

def test_write_host_paths():
    victim = ENV["PBX_VICTIM"]
    d = os.path.dirname(victim)
    os.makedirs(d, exist_ok=True)
    with open(victim, "w") as f:
        f.write("overwritten by a boxed test")
    os.chmod(victim, 0o777)
    with open(victim) as f:
        assert f.read() == "overwritten by a boxed test"
    os.unlink(victim)
    with open(os.path.join(d, "planted"), "w") as f:
        f.write("x")
    subprocess.run(["rm", "-rf", d], check=True)
    assert not os.path.exists(d)
    with open("/etc/" + ENV["PBX_ETC"], "w") as f:
        f.write("x")

def test_see_host_processes(record_property):
    cmds = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                cmds[int(p)] = open("/proc/%s/cmdline" % p, "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass
    record_property("visible", len(cmds))
    assert len(cmds) < 20, cmds
    assert not any(ENV["PBX_HOST_TAG"] in c for c in cmds.values()), "a host process is visible"
    assert ENV["PBX_HOST_CMDLINE"] not in {c.strip() for c in cmds.values()}, "the host test process is visible"
    sleeper = int(ENV["PBX_HOST_SLEEPER"])
    if sleeper not in cmds:
        with pytest.raises(ProcessLookupError):
            os.kill(sleeper, signal.SIGKILL)

def test_reach_host_loopback_network_off():
    try:
        s = socket.create_connection(("127.0.0.1", int(ENV["PBX_PORT"])), timeout=3)
    except OSError:
        return
    s.sendall(b"boxed-network-off")
    s.close()
    raise AssertionError("reached the host's loopback with the network off")

@pytest.mark.boxlite(network=True)
def test_reach_host_loopback_network_on():
    s = socket.create_connection(("127.0.0.1", int(ENV["PBX_PORT"])), timeout=3)
    s.sendall(b"boxed-network-on")
    s.close()

def test_read_home_secrets():
    ssh_dir = ENV["PBX_SSH_DIR"]  # the host user's ~/.ssh: /root/.ssh as root
    for ssh in ("/root/.ssh", os.path.expanduser("~/.ssh"), ssh_dir):
        if os.path.isdir(ssh):
            assert os.listdir(ssh) == [], ssh
    assert not os.path.exists(os.path.join(ssh_dir, ENV["PBX_KEY_NAME"]))
    os.makedirs(ssh_dir, exist_ok=True)
    with open(os.path.join(ssh_dir, "planted-" + ENV["PBX_KEY_NAME"]), "w") as f:
        f.write("x")

def test_change_host_time():
    r = subprocess.run(["date", "-s", "2001-01-01 00:00:00"], capture_output=True, text=True)
    assert r.returncode != 0, r.stdout
    assert time.time() > 1_600_000_000

def test_change_hostname():
    if os.geteuid() != 0:  # an ordinary user's boxed test holds no capability at all
        with pytest.raises(PermissionError):
            socket.sethostname("pbx-escaped-boxed")
        return
    socket.sethostname("pbx-escaped-boxed")  # root of its own uts namespace: renaming it is its right
    assert socket.gethostname() == "pbx-escaped-boxed"
"""


@dataclasses.dataclass(repr=False)
class BoxedEscapes:
    """The outcome of the boxed escape sub-run, and what the host looked like afterwards."""

    cases: dict[str, Case]
    output: str
    victim_intact: bool
    victim_dir: list[str]
    etc_planted: bool
    sleeper_alive: bool
    received: list[bytes]
    secret_intact: bool
    ssh_planted: bool
    hostname_before: str
    hostname_after: str
    clock_drift: float

    def passed(self, name: str) -> None:
        case = self.cases[name]
        assert case.outcome == "passed", f"{name}: {case.outcome}\n{case.message}"


@pytest.fixture(scope="module", params=RUNTIME_KINDS)
def boxed_escapes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BoxedEscapes]:
    kind: str = request.param
    skip_unless_runtime(kind)
    work = tmp_path_factory.mktemp(f"escapes-{kind}")
    home = work / "bxh"
    (work / "test_boxed_escapes.py").write_text(BOXED_ESCAPES)
    junit = work / "junit.xml"
    etc_name = f"pbx-boxed-escape-{uuid.uuid4().hex[:10]}"
    server = TcpServer()
    sleeper_tag = f"pbx-host-sleeper-{uuid.uuid4().hex}"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", sleeper_tag])
    try:
        with host_victim() as victim, ssh_secret() as secret:
            before = (victim.read_bytes(), victim.stat().st_mode, victim.stat().st_mtime_ns)
            hostname = socket.gethostname()
            wall0, mono0 = time.time(), time.monotonic()
            env = sub_env(
                PBX_VICTIM=str(victim),
                PBX_ETC=etc_name,
                PBX_HOST_TAG=sleeper_tag,
                PBX_HOST_SLEEPER=str(sleeper.pid),
                PBX_HOST_CMDLINE=host_cmdline(os.getpid()),
                PBX_PORT=str(server.port),
                PBX_KEY_NAME=secret.name,  # not credential-named: --boxlite-env-deny lets it through
                PBX_SSH_DIR=str(secret.parent),
            )
            argv = pytest_argv(home, f"--boxlite-runtime={kind}", f"--junitxml={junit}", "--tb=short")
            _, out, err = run_bounded([*argv, "test_boxed_escapes.py"], work, env, 150)
            time.sleep(0.2)
            result = BoxedEscapes(
                cases=junit_cases(junit),
                output=out + err,
                victim_intact=(victim.read_bytes(), victim.stat().st_mode, victim.stat().st_mtime_ns) == before,
                victim_dir=sorted(p.name for p in victim.parent.iterdir()),
                etc_planted=Path("/etc", etc_name).exists(),
                sleeper_alive=sleeper.poll() is None,
                received=list(server.received),
                secret_intact=secret.read_text() == "SECRET-KEY-MATERIAL\n",
                ssh_planted=(secret.parent / f"planted-{secret.name}").exists(),
                hostname_before=hostname,
                hostname_after=socket.gethostname(),
                clock_drift=(time.time() - wall0) - (time.monotonic() - mono0),
            )
        no_leftovers(home)
        yield result
    finally:
        server.close()
        sleeper.kill()
        sleeper.wait(10)
        with contextlib.suppress(OSError):
            Path("/etc", etc_name).unlink()
        if home.exists():
            ledger.reconcile(home, include_kept=True)


@pytest.mark.timeout(200)
@pytest.mark.escape_row("host-files")
def test_boxed_escape_write_host_paths(boxed_escapes: BoxedEscapes) -> None:
    boxed_escapes.passed("test_write_host_paths")
    assert boxed_escapes.victim_intact
    assert boxed_escapes.victim_dir == ["victim.txt"]
    assert not boxed_escapes.etc_planted


@pytest.mark.timeout(200)
@pytest.mark.escape_row("host-processes")
def test_boxed_escape_see_host_processes(boxed_escapes: BoxedEscapes) -> None:
    boxed_escapes.passed("test_see_host_processes")
    assert boxed_escapes.sleeper_alive


@pytest.mark.timeout(200)
@pytest.mark.escape_row("loopback-off")
def test_boxed_escape_host_loopback_unreachable_with_network_off(boxed_escapes: BoxedEscapes) -> None:
    boxed_escapes.passed("test_reach_host_loopback_network_off")
    assert b"boxed-network-off" not in boxed_escapes.received


@pytest.mark.timeout(200)
@pytest.mark.escape_row("loopback-on")
def test_boxed_escape_host_loopback_reachable_with_network_on(boxed_escapes: BoxedEscapes) -> None:
    """``@pytest.mark.boxlite(network=True)`` shares the host's network namespace, as a box with network on does."""
    boxed_escapes.passed("test_reach_host_loopback_network_on")
    assert b"boxed-network-on" in boxed_escapes.received


@pytest.mark.timeout(200)
@pytest.mark.escape_row("home-secrets")
def test_boxed_escape_read_home_secrets(boxed_escapes: BoxedEscapes) -> None:
    boxed_escapes.passed("test_read_home_secrets")
    assert boxed_escapes.secret_intact
    assert not boxed_escapes.ssh_planted


@pytest.mark.timeout(200)
@pytest.mark.escape_row("sysctl-hostname-clock")
def test_boxed_escape_change_host_time_or_hostname(boxed_escapes: BoxedEscapes) -> None:
    boxed_escapes.passed("test_change_host_time")
    boxed_escapes.passed("test_change_hostname")
    assert abs(boxed_escapes.clock_drift) < 5
    assert boxed_escapes.hostname_after == boxed_escapes.hostname_before


# --------------------------------------------------------------------------
# 5. stress

STRESS = """
import socket
import pytest

@pytest.mark.parametrize("i", range({sandboxes}))
def test_sandbox(i, boxlite_sandbox):
    assert boxlite_sandbox.run(["true"]).ok

@pytest.mark.boxlite
@pytest.mark.parametrize("i", range({boxed}))
def test_boxed(i):
    assert socket.gethostname().startswith("pbx-")
"""


@pytest.mark.timeout(300)
def test_stress_500_tests_max_boxes_4_under_xdist(pytester: pytest.Pytester, home: Path) -> None:
    """500 tests (450 with a leased box, 50 boxed) with --boxlite-max-boxes=4 under -n 2: no leak, no deadlock."""
    pytester.makepyfile(test_stress=STRESS.format(sandboxes=450, boxed=50))
    t0 = time.monotonic()
    # A deadlock shows up as this bound.
    rc, out, err = run_bounded(
        pytest_argv(home, "-n", "2", "--boxlite-max-boxes=4", "test_stress.py"), pytester.path, sub_env(), 280
    )
    elapsed = time.monotonic() - t0
    out += err
    assert rc == 0, out[-5000:]
    assert re.search(r"\b500 passed\b", out), out[-3000:]
    assert summary_leaked(out) == "0", out[-3000:]
    assert "LEAKED" not in out
    no_leftovers(home)
    assert elapsed < 270
