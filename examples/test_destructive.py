"""Tests that would damage the machine they run on.  In a box, they pass and the host stays as it was."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

# Root in the box (the box's own user namespace): what these tests do needs root, yet none of it
# is root on the host, and the host user needs no privilege for it.
pytestmark = pytest.mark.boxlite(user="root")


def test_rm_rf_a_directory(host_sentinel: dict[str, object]) -> None:
    target = Path(str(host_sentinel["dir"]))
    assert any(target.iterdir()), "the box sees the host's files (copy-on-write)"
    shutil.rmtree(target)
    assert not target.exists()


def test_rm_rf_the_project_itself() -> None:
    here = Path(__file__).resolve().parent
    shutil.rmtree(here)
    assert not here.exists()


def test_edit_etc() -> None:
    if not os.access("/etc/hosts", os.W_OK):
        # On a non-root host the box's root is the host user in a user namespace: files the host's
        # root owns stay read-only in the box (README, "Runtimes"); with root on the host they are
        # copy-on-write like the rest.
        pytest.skip("non-root host: root-owned host files are read-only inside its boxes")
    with open("/etc/hosts", "a") as fh:
        fh.write("10.66.66.66 evil.example\n")
    Path("/etc/pytest-boxlite-example").write_text("written by a test\n")
    assert "evil.example" in Path("/etc/hosts").read_text()


def test_kill_processes(host_sentinel: dict[str, object]) -> None:
    victims = [subprocess.Popen(["sleep", "300"]) for _ in range(3)]
    subprocess.run(["pkill", "-9", "sleep"], check=False)
    for v in victims:
        assert v.wait(timeout=10) == -signal.SIGKILL
    # The host's process is not even visible from inside the box.
    with pytest.raises(ProcessLookupError):
        os.kill(int(str(host_sentinel["pid"])), signal.SIGKILL)


def test_fill_tmp() -> None:
    chunk = b"\0" * (1 << 20)
    with open("/tmp/filler", "wb") as fh:
        for _ in range(200):
            fh.write(chunk)
    assert os.path.getsize("/tmp/filler") == 200 << 20


def test_change_hostname() -> None:
    socket.sethostname("pwned-by-a-test")
    assert socket.gethostname() == "pwned-by-a-test"
