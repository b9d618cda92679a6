"""A boxed test cannot reach the next test or the host through what its box shares (issue 22, 3 and 4).

Real sub-runs, boxed tests forked per test from a warm interpreter (namespace runtime, the default
``--boxlite-scope=test``):

* a test that leaves 4,000 threads, or a third of its memory cap, behind and never lets its box end
  (``os._exit`` replaced) does not make the next, innocent test fail: each forked box has cgroups
  of its own, and a box that is done is killed whole before the next test runs;
* a test (and the warm interpreter's conftest) that writes megabytes to its stderr and to every
  descriptor it inherited fills no host disk: the host-side box log stays within its cap, no
  descriptor of a host file is open in the box (nor reachable through its init's /proc entry), and
  another test's failure report quotes that test's own output, not the flood.

As root, and (the output part: an ordinary user has no cgroups here) as ``boxuser``.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from subruns import QUIET, SubRun
from test_nonroot import USER, Workdir

pytestmark = [pytest.mark.escapes, pytest.mark.timeout(300)]

#: What attach.py lets the host-side box log grow to (its cap), and slack for the runtime's own lines.
LOG_BOUND = (4 << 20) + (256 << 10)
FLOOD_MARK = "HOSTILE-FLOOD-7d1e"

LINGER = """
import os
import threading
import time

import pytest


def never_end():
    # The box's end is os._exit in the guest's loop: replaced, the box would go on forever.
    os._exit = lambda code: time.sleep(3600)
"""

STARVING = (
    LINGER
    + """

@pytest.mark.boxlite
def test_1_leaves_threads_behind():
    threads = []
    try:
        while len(threads) < 5000:
            t = threading.Thread(target=time.sleep, args=(3600,), daemon=True)
            t.start()
            threads.append(t)
    except RuntimeError:
        pass  # the box's pids cap: every process it may have is taken now
    assert len(threads) > 3000
    never_end()


@pytest.mark.boxlite
def test_2_innocent_threads_and_a_process():
    import subprocess

    ts = [threading.Thread(target=time.sleep, args=(0.05,)) for _ in range(200)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    subprocess.run(["true"], check=True)


HOG = []


@pytest.mark.boxlite(memory=320)
def test_3_leaves_memory_behind():
    HOG.append(b"x" * (100 << 20))  # written, so resident: a third of the box's 320 MiB
    never_end()


@pytest.mark.boxlite(memory=320)
def test_4_innocent_memory():
    # Fits its box's cap alone; beside the 100 MiB left behind it would not, and by the time the
    # cap is reached it holds more than that: the OOM killer would pick it.
    data = b"y" * (250 << 20)
    assert len(data) == 250 << 20
"""
)

FLOOD_CONFTEST = """
import os

if os.path.isdir("/run/pytest-boxlite"):
    # In the warm box's interpreter only (a forked box has a /run of its own; the host none):
    # 12 MiB on its stderr, the host-side box log.
    blob = b"WARM-" + b"w" * 65531
    for _ in range(192):
        os.write(2, blob)
"""

FLOODING = (
    LINGER
    + f"""
import json
import stat

MARK = {FLOOD_MARK!r}.encode()


def _writable_fds():
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            st = os.fstat(fd)
            flags = int(open("/proc/self/fdinfo/%d" % fd).read().split("flags:")[1].split()[0], 8)
        except (OSError, IndexError, ValueError):
            continue
        if stat.S_ISSOCK(st.st_mode) or flags & 3 == os.O_RDONLY:
            continue  # its report stream, and what it can only read
        out.append((fd, st))
    return out


def test_1_floods_every_descriptor(record_property):
    fds = _writable_fds()
    files = [[st.st_dev, st.st_ino] for _, st in fds if stat.S_ISREG(st.st_mode)]
    record_property("files", json.dumps(files))
    init = []
    try:
        names = os.listdir("/proc/1/fd")  # the box's init: not this process, maybe not even listable
    except OSError:
        names = [str(n) for n in range(64)]
    for name in names:
        try:
            init.append(os.open("/proc/1/fd/" + name, os.O_WRONLY | os.O_APPEND))
        except OSError:
            pass
    record_property("init_fds_opened", len(init))
    blob = MARK * (65536 // len(MARK))
    streams = [fd for fd, st in fds if not stat.S_ISREG(st.st_mode)] + init
    for _ in range(256):  # 16 MiB into every pipe it holds (its stderr's copies among them)
        for fd in streams:
            try:
                os.write(fd, blob)
            except OSError:
                pass

    def flood():
        # On and on, into every descriptor (files too: a host file among them would fill the disk).
        while True:
            for fd in [fd for fd, _ in fds] + init:
                try:
                    os.write(fd, blob)
                except OSError:
                    pass
            time.sleep(0.005)

    threading.Thread(target=flood, daemon=True).start()
    time.sleep(0.2)
    never_end()


def test_2_innocent():
    pass


def test_3_crashes_with_its_own_words():
    import ctypes

    ctypes.string_at(0)  # faulthandler writes the crash on the box's own stderr
"""
)


class _LogWatch:
    """The largest box log seen under a boxlite home while a sub-run runs, and the logs' inodes."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.largest = 0
        self.inodes: set[tuple[int, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.02):
            for log in self.home.glob("namespace/*.ctl/box.log"):
                try:
                    st = log.stat()
                except OSError:
                    continue
                self.largest = max(self.largest, st.st_size)
                self.inodes.add((st.st_dev, st.st_ino))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def log_watch(home: Path) -> Iterator[_LogWatch]:
    watch = _LogWatch(home)
    yield watch
    watch.stop()


def _properties(junit: Path, name: str) -> dict[str, str]:
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.get("name") == name:
            return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
    raise AssertionError(f"no testcase {name} in {junit}")


def _check_flood_run(output: str, junit: Path, watch: _LogWatch) -> None:
    assert "1 failed, 2 passed" in output, output[-3000:]
    own = output.split("boxlite log of", 1)[-1]
    assert "Fatal Python error: Segmentation fault" in own, output[-3000:]
    assert "test_3_crashes_with_its_own_words" in own, output[-3000:]
    # The crash report quotes its own box's output, not what the test before it flooded.
    assert FLOOD_MARK not in output, output[-3000:]
    # Nothing in the box could open its init's descriptors, and none of its own is a host box log.
    props = _properties(junit, "test_1_floods_every_descriptor")
    assert props["init_fds_opened"] == "0", props
    files = {tuple(f) for f in json.loads(props["files"])}
    assert watch.inodes and not files & watch.inodes, (files, watch.inodes)
    # 12 MiB from the warm interpreter and 16 MiB (and a flood) from the test: the log stays capped.
    assert 0 < watch.largest <= LOG_BOUND, watch.largest


@pytest.mark.escape_row("lingering-box", users="root")
def test_a_lingering_test_does_not_starve_the_next(tmp_path: Path, home: Path, subruns: list[SubRun]) -> None:
    """4,000 threads or 100 MiB left running in a box that never ends: the next tests pass."""
    if os.geteuid() != 0:
        pytest.skip("cgroups for each forked box need root here (an ordinary user gets none)")
    (tmp_path / "test_starving.py").write_text(textwrap.dedent(STARVING))
    run = SubRun(tmp_path, home, "starving", "-q", "-p", "no:randomly", "test_starving.py")
    subruns.append(run)
    assert run.wait() == 0, run.output[-4000:]
    assert "4 passed" in run.output, run.output[-4000:]
    assert "leaked 0" in run.output, run.output[-2000:]


@pytest.mark.escape_row("inherited-descriptors", "box-log")
def test_output_and_descriptors_stay_in_their_own_box(
    tmp_path: Path, home: Path, subruns: list[SubRun], log_watch: _LogWatch
) -> None:
    """Floods of a test's stderr and inherited descriptors reach no host file and no other report."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(FLOOD_CONFTEST))
    (tmp_path / "test_flooding.py").write_text(textwrap.dedent(FLOODING))
    junit = tmp_path / "junit.xml"
    junit_args = (f"--junitxml={junit}", "-o", "junit_family=xunit1")
    run = SubRun(tmp_path, home, "flooding", "--boxlite", "-p", "no:randomly", *junit_args)
    subruns.append(run)
    run.wait()
    log_watch.stop()
    _check_flood_run(run.output, junit, log_watch)


#: The ordinary user's interpreter, with this project installed (``.ci/run`` and RULES.md make it).
USER_PYTHON = Path("/home/boxuser/venv/bin/python")


def _as_user() -> tuple[str, Workdir]:
    """The ordinary user's interpreter and a project directory of theirs (skips where there is none)."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("needs root and runuser to run a sub-session as an ordinary user")
    python = str(USER_PYTHON) if USER_PYTHON.exists() else sys.executable
    probe = subprocess.run(["runuser", "-u", USER, "--", python, "-c", "import pytest_boxlite"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"{USER} cannot import pytest_boxlite with {python}: {probe.stderr.decode()[-300:]}")
    return python, Workdir()


@pytest.mark.escape_row("lingering-box", users="user")
def test_a_lingering_test_does_not_starve_the_next_as_an_ordinary_user() -> None:
    """No cgroups for ``boxuser``: a box whose test is done is ended before the next test runs, so
    the threads it left do not count against the next test's process limit (``RLIMIT_NPROC``)."""
    import shutil

    python, work = _as_user()
    try:
        work.write("test_starving.py", STARVING)
        r = work.run(python, "-m", "pytest", *QUIET, "--basetemp", str(work.root / "bt"), "-p", "no:randomly")
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "4 passed" in out, out[-4000:]
    finally:
        shutil.rmtree(work.root, ignore_errors=True)


@pytest.mark.escape_row("inherited-descriptors", "box-log", users="user")
def test_output_and_descriptors_stay_in_their_own_box_as_an_ordinary_user() -> None:
    """The same as ``boxuser``: no cgroups, but the box's stderr is its own and the log capped."""
    import shutil

    python, work = _as_user()
    watch = _LogWatch(work.boxlite_home)
    try:
        work.write("conftest.py", FLOOD_CONFTEST)
        work.write("test_flooding.py", FLOODING)
        junit = work.root / "junit.xml"
        r = work.run(
            python, "-m", "pytest", *QUIET, "--basetemp", str(work.root / "bt"),
            "--boxlite", "-p", "no:randomly", f"--junitxml={junit}", "-o", "junit_family=xunit1", timeout=240,
        )  # fmt: skip
        watch.stop()
        _check_flood_run(r.stdout + r.stderr, junit, watch)
    finally:
        watch.stop()
        shutil.rmtree(work.root, ignore_errors=True)
