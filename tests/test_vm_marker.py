"""Boxed tests (``@pytest.mark.boxlite``, ``--boxlite``, the ``boxlite_sandbox`` fixture) on the vm runtime.

Real pytest sub-runs with ``--boxlite-runtime=vm``, where the vm runtime runs on
the boxlite SDK double (``tests/sdk_double/site``): the test worker is started
through the VM stdio bridge (base64 framing, execnet over SDK exec streams),
in every scope.  The sub-runs put this checkout on ``PYTHONPATH`` (for the double's
``sitecustomize``); the plugin's own directory and editable installs' sources are mounted
into boxes by the host in any case (``remote.worker_host.worker_mounts``).
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
from subruns import QUIET, sub_env

from pytest_boxlite import ledger

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def double_env() -> dict[str, str]:
    """A sub-run environment in which every Python process of the run uses the SDK double."""
    path = [str(ROOT), str(TESTS), str(TESTS / "sdk_double" / "site")]
    return sub_env(PYTHONPATH=os.pathsep.join(path), BOXLITE_SDK_DOUBLE="1")


BOXED = textwrap.dedent(
    """
    import os
    import pytest

    def in_double_box():
        # Not /run/boxlite-double: a box forked per test has a /run of its own.
        return os.environ.get("PYTEST_BOXLITE_GUEST") == "1" and os.uname().nodename != HOST_NODENAME

    @pytest.mark.boxlite
    def test_boxed_passes(tmp_path):
        assert in_double_box()
        (tmp_path / "f").write_text("x")
        with open("/etc/pbx-written", "w") as fh:  # the guest's own root is writable
            fh.write("x")

    @pytest.mark.boxlite
    def test_boxed_fails():
        assert in_double_box()
        assert 1 == 2, "expected failure"

    @pytest.mark.boxlite
    def test_boxed_project_is_read_only():
        # On vm the project is mounted read-only (not copy-on-write as on namespace): review #30.
        with pytest.raises(OSError) as info:
            open("written-by-guest", "w")
        assert "Read-only" in str(info.value)

    def test_fixture(boxlite_sandbox):
        assert boxlite_sandbox.runtime == "vm"
        r = boxlite_sandbox.run(["sh", "-c", "cat; pwd"], timeout=30)
        assert r.ok and r.stdout == "/workspace\\n"
    """
)


@pytest.mark.parametrize("scope", ["test", "module", "worker"])
def test_boxed_tests_on_vm(tmp_path: Path, scope: str) -> None:
    import subprocess

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "test_boxed.py").write_text(BOXED.replace("HOST_NODENAME", repr(os.uname().nodename)))
    home = tmp_path / "home"
    env = double_env()
    argv = [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={home}"]
    argv += ["--boxlite-runtime=vm", f"--boxlite-scope={scope}", "-rA", "test_boxed.py"]
    if scope == "worker":
        # The whole session runs in one box, where the plugin is passive: no boxlite_sandbox there.
        argv += ["-k", "not fixture"]
    r = subprocess.run(argv, cwd=proj, env=env, capture_output=True, text=True, timeout=200)
    out = r.stdout + r.stderr
    passed = 2 if scope == "worker" else 3
    assert f"1 failed, {passed} passed" in out, out
    assert "expected failure" in out
    if scope != "worker":
        assert "boxlite SDK double" in out  # the report header names the runtime and why
    assert not (proj / "written-by-guest").exists()
    assert ledger.scan(home) == [], f"boxes left behind:\n{out}"


def test_xdist_workers_on_vm(tmp_path: Path) -> None:
    """``--boxlite -n 2``: each xdist worker runs boxed tests on its own vm home; nothing leaks."""
    import subprocess

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "test_x.py").write_text(
        "import os, pytest\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_x(i):\n"
        f"    assert os.environ.get('PYTEST_BOXLITE_GUEST') == '1' and os.uname().nodename != {os.uname().nodename!r}\n"
    )
    home = tmp_path / "home"
    argv = [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={home}", "--boxlite-runtime=vm"]
    argv += ["--boxlite", "-n", "2", "test_x.py"]
    r = subprocess.run(argv, cwd=proj, env=double_env(), capture_output=True, text=True, timeout=200)
    out = r.stdout + r.stderr
    assert "6 passed" in out and "leaked 0" in out, out
    assert ledger.scan(home) == []


def test_setup_on_vm_builds_one_template_and_boxes_clone_it(tmp_path: Path) -> None:
    """``--boxlite-setup`` on vm: the setup runs once (a template box, exported), every box of the
    run is cloned from it and sees the setup's result; the archive is kept for the next session."""
    import subprocess

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "test_setup.py").write_text(
        "import os, pytest\n"
        "@pytest.mark.parametrize('i', range(3))\n"
        "@pytest.mark.boxlite\n"
        "def test_sees_setup(i):\n"
        "    assert open('/etc/pbx-setup-marker').read() == 'set up\\n'\n"
    )
    home = tmp_path / "home"
    argv = [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={home}", "--boxlite-runtime=vm"]
    argv += ["--boxlite-setup", "echo 'set up' > /etc/pbx-setup-marker", "test_setup.py"]
    r = subprocess.run(argv, cwd=proj, env=double_env(), capture_output=True, text=True, timeout=200)
    out = r.stdout + r.stderr
    assert "3 passed" in out, out
    archives = list((home / "vm-templates").glob("*.boxlite"))
    assert len(archives) == 1, (archives, out)
    assert ledger.scan(home) == [], f"boxes left behind:\n{out}"
