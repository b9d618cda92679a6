"""Whole pytest sessions with ``--boxlite-url``: boxed tests on the SDK double's BoxLite server.

Real pytest sub-runs (the plugin as users run it) against the double's server, a separate process
whose boxes outlive the session that made them, as on a ``boxlite serve`` host.  Checked: boxed
tests and the sandbox fixture run in remote boxes with the project uploaded (no host volumes);
the report header names the server without its key; the key is in no output, no junitxml and no
box; ``ls``/``clean`` work against the server; a session killed with SIGKILL leaves boxes that the
server's timers stop and delete by themselves, and the next session reaps what is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sdk_double.rest import ServerProcess
from subruns import QUIET, wait_until
from test_vm_marker import double_env

pytestmark = pytest.mark.timeout(300)
KEY = "blk_session_7f3e2a9d41c6"

BOXED = textwrap.dedent(
    """
    import os
    import pytest

    def in_remote_box():
        # Not /run/boxlite-double: a box forked per test has a /run of its own.
        return os.environ.get("PYTEST_BOXLITE_GUEST") == "1" and os.uname().nodename != HOST_NODENAME

    @pytest.mark.boxlite
    def test_boxed_passes():
        assert in_remote_box()
        assert "BOXLITE_API_KEY" not in os.environ  # the key never reaches a box
        # The project is an uploaded copy: writable in the box, the host's stays as it is.
        with open("written-by-guest", "w") as fh:
            fh.write("x")

    @pytest.mark.boxlite
    def test_boxed_fails():
        assert in_remote_box()
        assert 1 == 2, "expected failure"

    def test_fixture(boxlite_sandbox):
        assert boxlite_sandbox.run(["echo", "hi"]).stdout == "hi\\n"
        assert boxlite_sandbox.runtime == "vm"
    """
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path / "server-host", key=KEY)
    try:
        yield srv
    finally:
        srv.stop()


def _env(**extra: str) -> dict[str, str]:
    env = double_env()
    env.update(extra)
    return env


def _cli(home: Path, url: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pytest_boxlite", f"--home={home}", f"--url={url}", *args]
    return subprocess.run(argv, env=_env(**env), capture_output=True, text=True, timeout=120)


def test_boxed_suite_on_a_remote_server(server: ServerProcess, tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "test_boxed.py").write_text(BOXED.replace("HOST_NODENAME", repr(os.uname().nodename)))
    home = tmp_path / "home"
    xml = tmp_path / "report.xml"
    argv = [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={home}", f"--boxlite-url={server.url}"]
    argv += ["--boxlite-max-boxes=1", "-rA", "-v", f"--junitxml={xml}", "test_boxed.py"]
    r = subprocess.run(argv, cwd=proj, env=_env(BOXLITE_API_KEY=KEY), capture_output=True, text=True, timeout=280)
    out = r.stdout + r.stderr
    assert "1 failed, 2 passed" in out, out
    assert "expected failure" in out
    assert f"remote BoxLite server {server.url}" in out  # the header: which server, how many boxes
    assert "up to 1 boxes per pytest process" in out
    assert not (proj / "written-by-guest").exists()
    for text in (out, xml.read_text()):
        assert KEY not in text
    assert server.boxes() == [], f"boxes left on the server:\n{out}"
    assert "leaked 0" in out or "leaked" not in out

    # ls/clean against the server; the key from the environment, never printed.
    ls = _cli(home, server.url, "ls", BOXLITE_API_KEY=KEY)
    assert ls.returncode == 0 and f"server {server.url}: 0 box(es)" in ls.stdout, ls.stdout + ls.stderr
    bad = _cli(home, server.url, "ls", BOXLITE_API_KEY="blk_wrong_00")
    assert bad.returncode == 1 and "auth: unauthorized" in bad.stderr and "blk_wrong_00" not in bad.stderr


def test_a_killed_sessions_boxes_die_on_the_server(server: ServerProcess, tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "test_slow.py").write_text(
        "import time, pytest\n"
        "@pytest.mark.boxlite\n"
        "@pytest.mark.parametrize('i', range(2))\n"
        "def test_slow(i):\n"
        "    time.sleep(120)\n"
    )
    home = tmp_path / "home"
    argv = [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={home}", f"--boxlite-url={server.url}"]
    argv += ["--boxlite-max-boxes=2", "test_slow.py"]
    env = _env(BOXLITE_API_KEY=KEY, PYTEST_BOXLITE_REST_LEASE="2")
    with subprocess.Popen(
        argv, cwd=proj, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    ) as proc:
        try:
            assert wait_until(lambda: any(b["status"] == "running" for b in server.boxes()), timeout=120)
            time.sleep(1.0)  # let the test start in its box
            os.killpg(proc.pid, signal.SIGKILL)  # the whole session dies at once, as a cancelled CI job does
        finally:
            with_kill = proc.poll() is None
            if with_kill:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    killed_scratch = list((home / "rest").iterdir())
    assert len(killed_scratch) == 1  # the killed session's local scratch (bridge sockets)
    names = {b["name"] for b in server.boxes()}
    assert names and all(n.startswith("pbx-") for n in names)
    # Nobody renews their leases: the server stops them, then deletes them, by itself.
    assert wait_until(lambda: server.boxes() == [], timeout=60), server.boxes()
    log = server.log()
    for name in names:
        assert f"auto-stopped {name}" in log and f"auto-deleted {name}" in log
    # The next session on this machine finds nothing of it (and says nothing about the key).
    clean = _cli(home, server.url, "clean", BOXLITE_API_KEY=KEY)
    assert clean.returncode == 0 and "removed 0 box(es)" in clean.stdout, clean.stdout + clean.stderr
    assert KEY not in clean.stdout + clean.stderr
    assert not killed_scratch[0].exists()  # and its local leftovers went with it


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--boxlite-url=http://127.0.0.1:9", "--boxlite-scope=worker"], {}, "cannot run on a --boxlite-url server"),
        (["--boxlite-credential-file=/nonexistent"], {}, "is only used with --boxlite-url"),
        (["--boxlite-url=http://me:blk_inurl_55@127.0.0.1:9", "--boxlite"], {}, "must not carry credentials"),
        (["--boxlite-url=http://127.0.0.1:9", "--boxlite-runtime=namespace", "--boxlite"], {}, "cannot be combined"),
        (["--boxlite"], {"PYTEST_BOXLITE_URL": "http://127.0.0.1:9", "BOXLITE_API_KEY": KEY}, "cannot be used"),
    ],
    ids=["worker-scope", "credential-without-url", "key-in-url", "namespace", "unreachable"],
)
def test_bad_remote_settings_are_clear_errors(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    argv = [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={tmp_path / 'home'}", *args, "test_one.py"]
    r = subprocess.run(argv, cwd=tmp_path, env=_env(**env), capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and message in out, out
    assert KEY not in out and "blk_inurl_55" not in out


def test_xdist_workers_share_one_server(server: ServerProcess, tmp_path: Path) -> None:
    """``-n 2 --boxlite-url``: each worker holds its own boxes on the one server; nothing is left there."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "test_x.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_x(boxlite_sandbox, i):\n"
        "    assert boxlite_sandbox.run(['sh', '-c', 'echo $((6*7))']).stdout == '42\\n'\n"
    )
    home = tmp_path / "home"
    argv = [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={home}", f"--boxlite-url={server.url}"]
    argv += ["-n", "2", "--boxlite-max-boxes=1", "test_x.py"]
    r = subprocess.run(argv, cwd=proj, env=_env(BOXLITE_API_KEY=KEY), capture_output=True, text=True, timeout=280)
    out = r.stdout + r.stderr
    assert "4 passed" in out, out
    assert KEY not in out
    assert server.boxes() == [], out
    log = server.log().splitlines()
    owners = {n.rsplit("-", 1)[0] for n in (line.split()[1] for line in log if line.startswith("created "))}
    assert len(owners) == 2 and all(o.endswith(("-gw0", "-gw1")) for o in owners), log  # one per worker
    assert not [line for line in log if line.startswith("auto-")]  # nothing was left for the timers
