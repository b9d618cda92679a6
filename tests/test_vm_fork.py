"""Fork-per-test inside a booted VM (issue 15's vm goal), on the SDK double.

Real pytest sub-runs with ``--boxlite-runtime=vm`` on the double (``tests/sdk_double``): a boxed
test runs in a box forked inside the booted guest, whose connection reaches the host through the
fork relay (``runtimes/_forkrelay.py``, ``guest/relay.py``) over the SDK's exec stdio.  The
double's guest has overlays (its system directories) and also plain writable mounts that are no
overlay, as a VM's disk is: ``/root`` and ``/home`` are ext4 binds and ``/`` is a tmpfs, so the
pristine-box checks below exercise the non-overlay path of ``guest/fresh.py`` (``renew_all``:
overlays of those mounts, and a pivot into an overlay of ``/``).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from subruns import QUIET, pids_with, process_gone, sub_env, wait_until
from test_vm_marker import double_env

from pytest_boxlite import ledger

pytestmark = pytest.mark.timeout(300)

#: In the command line of every guest relay and of the host helper that carries its stdio.
RELAY_TAG = "/run/boxlite-relay-"

OUTCOMES = textwrap.dedent(
    """
    import os, signal, pytest

    def test_passes():
        assert os.environ.get("PYTEST_BOXLITE_GUEST") == "1"

    def test_fails():
        assert 1 == 2, "expected failure"

    def test_skips():
        pytest.skip("skipped in the box")

    @pytest.mark.xfail(reason="known")
    def test_xfails():
        assert False

    def test_exits_hard():
        os._exit(3)

    def test_killed_by_a_signal():
        os.kill(os.getpid(), signal.SIGKILL)

    @pytest.fixture
    def broken():
        raise RuntimeError("fixture broke")

    def test_error_in_setup(broken):
        pass
    """
)

PRISTINE = textwrap.dedent(
    """
    import os, pytest

    # /root and /home: plain ext4 binds in the double's guest (no overlay), / a plain tmpfs (as a
    # VM's disk is no overlay); /etc, /usr, /var: overlays; /tmp, /workspace: tmpfs.
    PLACES = ["/tmp/pbx", "/workspace/pbx", "/root/pbx", "/home/pbx", "/etc/pbx", "/var/pbx", "/usr/pbx", "/pbx"]

    @pytest.mark.parametrize("i", range(3))
    def test_sees_nothing_of_the_test_before(i):
        for path in PLACES:
            assert not os.path.exists(path), path + " was left by an earlier test"
            with open(path, "w") as fh:
                fh.write(str(i))
        for path in ("/root/pbx-dir", "/pbx-dir"):
            assert not os.path.exists(path), path + " was left by an earlier test"
            os.mkdir(path)
    """
)

MODULE_A = textwrap.dedent(
    """
    import os, pytest

    @pytest.fixture(scope="module")
    def once():
        with open("/root/pbx-setups", "a") as fh:
            fh.write("x")
        return True

    def test_a1(once):
        assert open("/root/pbx-setups").read() == "x"
        open("/root/pbx-module-a", "w").close()

    def test_a2(once):
        assert open("/root/pbx-setups").read() == "x", "the module fixture was set up twice"
        assert os.path.exists("/root/pbx-module-a"), "tests of one module share their box"
    """
)

MODULE_B = textwrap.dedent(
    """
    import os

    def test_b1():
        assert not os.path.exists("/root/pbx-module-a"), "another module's box leaked in"
        assert not os.path.exists("/root/pbx-setups")
    """
)

#: In the sub-run: after the plugin shut down, the relay threads still alive in this process.
THREADS_CONFTEST = textwrap.dedent(
    """
    import threading
    import pytest

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(config):
        left = [t.name for t in threading.enumerate() if t.name.startswith("boxlite-forkrelay")]
        print("RELAY-THREADS-LEFT=%d %s" % (len(left), left))
    """
)


def run(proj: Path, home: Path, *args: str, runtime: str = "vm", timeout: float = 240) -> str:
    env = double_env() if runtime == "vm" else sub_env()
    argv = [sys.executable, "-m", "pytest", *QUIET, "-p", "no:randomly", f"--boxlite-home={home}"]
    argv += [f"--boxlite-runtime={runtime}", "-rA", *args]
    r = subprocess.run(argv, cwd=proj, env=env, capture_output=True, text=True, timeout=timeout)
    return r.stdout + r.stderr


def stat(out: str, name: str) -> int | None:
    """A figure of the session's ``boxes booted N, forked M, ...`` line (``forked`` absent: 0)."""
    line = next((x for x in out.splitlines() if x.startswith("boxes booted ")), None)
    if line is None:
        return None
    m = re.search(rf"\b{name} (\d+)", line)
    return int(m.group(1)) if m else 0


def outcomes(out: str) -> dict[str, str]:
    """``nodeid -> outcome`` from the ``-rA`` short summary."""
    found = {}
    for line in out.splitlines():
        m = re.match(r"(PASSED|FAILED|SKIPPED|XFAIL|ERROR) (?:\[\d+\] )?(\S+?\.py(?:::\S+)?)", line)
        if m:
            found[m.group(2)] = m.group(1)
    return found


def project(tmp_path: Path, **files: str) -> Path:
    proj = tmp_path / "proj"
    proj.mkdir()
    for name, text in files.items():
        (proj / f"{name}.py").write_text(text)
    (proj / "conftest.py").write_text(THREADS_CONFTEST)
    return proj


def assert_nothing_left(out: str, home: Path) -> None:
    assert "RELAY-THREADS-LEFT=0 " in out, out
    assert wait_until(lambda: pids_with(RELAY_TAG) == [], 10), f"relay processes left: {pids_with(RELAY_TAG)}"
    assert ledger.scan(home) == [], f"boxes left behind:\n{out}"


def test_outcomes_on_vm_are_those_on_namespace(tmp_path: Path) -> None:
    proj = project(tmp_path, test_outcomes=OUTCOMES)
    vm = run(proj, tmp_path / "vm-home", "--boxlite", "test_outcomes.py")
    ns = run(proj, tmp_path / "ns-home", "--boxlite", "test_outcomes.py", runtime="namespace")
    got = outcomes(vm)
    assert got == outcomes(ns), f"vm:\n{vm}\nnamespace:\n{ns}"
    assert got == {
        "test_outcomes.py::test_passes": "PASSED",
        "test_outcomes.py::test_fails": "FAILED",
        "test_outcomes.py": "SKIPPED",  # -rA names a skip by its file and line
        "test_outcomes.py::test_xfails": "XFAIL",
        "test_outcomes.py::test_exits_hard": "FAILED",
        "test_outcomes.py::test_killed_by_a_signal": "FAILED",
        "test_outcomes.py::test_error_in_setup": "ERROR",
    }, vm
    assert "exited with status 3" in vm and "expected failure" in vm and "fixture broke" in vm
    # One boot for the whole run; every test in a box forked inside it.
    assert stat(vm, "booted") == 1 and stat(vm, "forked") == 7, vm
    assert_nothing_left(vm, tmp_path / "vm-home")


def test_each_forked_box_is_pristine_on_vm(tmp_path: Path) -> None:
    proj = project(tmp_path, test_pristine=PRISTINE)
    home = tmp_path / "home"
    out = run(proj, home, "--boxlite", "test_pristine.py")
    assert "3 passed" in out, out
    assert stat(out, "booted") == 1 and stat(out, "forked") == 3, out
    assert_nothing_left(out, home)


def test_module_scope_on_vm(tmp_path: Path) -> None:
    proj = project(tmp_path, test_a=MODULE_A, test_b=MODULE_B)
    home = tmp_path / "home"
    out = run(proj, home, "--boxlite", "--boxlite-scope=module", "test_a.py", "test_b.py")
    assert "3 passed" in out, out
    assert stat(out, "booted") == 1 and stat(out, "forked") == 2, out  # a box per module
    assert_nothing_left(out, home)


def test_fresh_boot_boots_a_vm_per_test(tmp_path: Path) -> None:
    proj = project(tmp_path, test_pristine=PRISTINE)
    home = tmp_path / "home"
    out = run(proj, home, "--boxlite", "--boxlite-fresh=boot", "--boxlite-max-boxes=1", "test_pristine.py")
    assert "3 passed" in out, out  # each test in a box of its own: nothing of the test before
    booted = stat(out, "booted")
    assert booted is not None and booted >= 3 and stat(out, "forked") == 0, out
    assert_nothing_left(out, home)


def test_one_boot_per_xdist_worker(tmp_path: Path) -> None:
    proj = project(tmp_path, test_pristine=PRISTINE.replace("range(3)", "range(8)"))
    home = tmp_path / "home"
    out = run(proj, home, "--boxlite", "-n", "2", "test_pristine.py")
    assert "8 passed" in out, out
    assert stat(out, "booted") == 2 and stat(out, "forked") == 8, out
    assert ledger.scan(home) == [], out
    assert wait_until(lambda: pids_with(RELAY_TAG) == [], 10), pids_with(RELAY_TAG)


def test_kill9_of_the_session_leaves_no_relay(tmp_path: Path) -> None:
    proj = project(tmp_path, test_hang="import time\n\ndef test_hangs():\n    time.sleep(120)\n")
    home = tmp_path / "home"
    argv = [sys.executable, "-m", "pytest", *QUIET, "-p", "no:randomly", f"--boxlite-home={home}"]
    argv += ["--boxlite-runtime=vm", "--boxlite", "test_hang.py"]
    log = open(tmp_path / "run.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, cwd=proj, env=double_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: len(pids_with(RELAY_TAG)) >= 2, 120), (tmp_path / "run.log").read_text()
        relay = pids_with(RELAY_TAG)
        time.sleep(1.0)  # the test is running in its forked box by now
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    # The box's watchdog ends the guest (the guest relay with it); the host helper that carried the
    # relay's stdio loses its bridge and exits.
    assert wait_until(lambda: all(process_gone(p) for p in relay), 20), [p for p in relay if not process_gone(p)]
    # The next session reconciles what the dead one left.
    (proj / "test_hang.py").unlink()
    (proj / "test_ok.py").write_text("def test_ok():\n    pass\n")
    out = run(proj, home, "--boxlite", "test_ok.py")
    assert "1 passed" in out, out
    assert_nothing_left(out, home)


def test_a_guest_kernel_without_user_namespaces_boots_a_box_per_test(tmp_path: Path) -> None:
    """Where the VM's kernel refuses the forked box's namespaces (the double's guest made to refuse
    user namespaces), the warm interpreter says so once at start, the run says why in one line,
    and every boxed test gets a booted box instead: no test fails for it."""
    proj = project(tmp_path, test_pristine=PRISTINE)
    home = tmp_path / "home"
    env = {**double_env(), "BOXLITE_DOUBLE_NO_USERNS": "1"}
    argv = [sys.executable, "-m", "pytest", *QUIET, "-p", "no:randomly", f"--boxlite-home={home}"]
    argv += ["--boxlite-runtime=vm", "--boxlite", "-rA", "test_pristine.py"]
    r = subprocess.run(argv, cwd=proj, env=env, capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert "3 passed" in out, out
    notes = [line for line in out.splitlines() if "boxes cannot be forked per test here" in line]
    assert len(notes) == 1 and "unshare" in notes[0], out
    booted = stat(out, "booted")
    assert booted is not None and booted >= 3 and stat(out, "forked") == 0, out
    assert_nothing_left(out, home)
