"""A test's fresh box is laid out straight in a root directory of its own (guest/layers.py's
``_fresh_box_in_new_root``), from the warm interpreter's mount table read once
(``remember_warm_mounts``): what each box sees, and when that table is read again.

Real boxed-test sub-runs, and the table's watch in a real mount namespace of its own
(``unshare -rm``: root's, or an ordinary user's where user namespaces are allowed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from subruns import SubRun

pytestmark = pytest.mark.timeout(180)

BOXED = """
import os

def _fresh():
    # A fresh tmpfs: nothing of the box's making (its staging area, its new root's mount point).
    assert os.listdir("/run") == [], os.listdir("/run")
    assert not os.path.lexists("/pbx-root-mark"), "a top-level entry of the test before"
    assert not os.path.lexists("/dev/pbx-dev-mark"), "a /dev file of the test before"
    for name in ("null", "zero", "urandom", "pts", "shm"):
        assert os.path.lexists("/dev/" + name), name
    with open("/dev/null", "w") as fh:
        fh.write("x")

def test_first():
    _fresh()
    os.mkdir("/pbx-root-mark")
    open("/dev/pbx-dev-mark", "w").close()
    open("/run/pbx-run-mark", "w").close()

def test_second():
    _fresh()
"""


@pytest.mark.parametrize("scope", ["test", "module"])
def test_a_boxed_test_starts_with_an_empty_run_and_its_own_root(tmp_path: Path, scope: str) -> None:
    (tmp_path / "test_fresh_root_box.py").write_text(BOXED)
    args = ["--boxlite", "-p", "no:randomly"]
    if scope == "module":
        # Module scope: one box for both tests, so the second sees the first's marks; only the
        # first test's view (an empty /run) is asked for.
        args += ["--boxlite-scope=module", "-k", "test_first"]
    run = SubRun(tmp_path, tmp_path / "bxh", "root", *args, "test_fresh_root_box.py")
    assert run.wait(150) == 0, run.output
    assert ("2 passed" if scope == "test" else "1 passed") in run.output, run.output


WATCH = r"""
import ctypes, os, sys, tempfile
from pytest_boxlite.guest import layers

layers.remember_warm_mounts()
first = layers._WARM_MOUNTS[0]
layers.remember_warm_mounts()
assert layers._WARM_MOUNTS[0] is first, "read again with no mount changed"
point = tempfile.mkdtemp()
assert not any(row[0] == point for row in first)
assert layers.LIBC.mount(b"tmpfs", point.encode(), b"tmpfs", 0, None) == 0, os.strerror(ctypes.get_errno())
layers.remember_warm_mounts()
table, propagates, fd = layers._WARM_MOUNTS
assert table is not first and any(row[0] == point for row in table), "a new mount not seen"
assert table == layers._mount_table()
taken = layers._take_warm_mounts()
assert taken is not None and taken[0] is table
try:
    os.fstat(fd)
except OSError:
    pass
else:
    raise AssertionError("the warm interpreter's mountinfo descriptor is still open in the box")
assert layers._take_warm_mounts() is None
print("watch ok")
"""


def test_the_warm_mount_table_is_read_again_only_after_a_mount_changed(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("util-linux's unshare is not installed")
    probe = subprocess.run([unshare, "-rm", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace can be made here: {probe.stderr.decode(errors='replace').strip()}")
    script = tmp_path / "watch.py"
    script.write_text(textwrap.dedent(WATCH))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([unshare, "-rm", sys.executable, str(script)], capture_output=True, timeout=60, env=env)
    assert done.returncode == 0 and b"watch ok" in done.stdout, done.stdout + done.stderr
