"""The native pid 1 of a test's box (guest/_init: boxclone.c, boxinit.c; issue 42).

Where the package was built with a C compiler, guest/fresh.py's clone_box makes a test's box with
box_clone: pid 1 shares the warm interpreter's memory, forks the test process and executes
boxinit, which does BareInit's duties.  These tests hold both pid 1s to the same duties (the
namespaces, pid and parent, the id maps of a root test's nested namespace, forwarded signals,
reaped orphans, the exit status) and check what only the native one could get wrong: the warm
interpreter's signal mask and dumpability after the clone, and that pid 1 holds nothing of the
warm interpreter's once it runs boxinit.  ``PYTEST_BOXLITE_NATIVE_INIT=0`` is the off switch.

Real clones in a fresh interpreter (as tests/test_fresh_clone.py), and real boxed sub-runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from subruns import SubRun, sub_env

from pytest_boxlite import guest

NATIVE = guest.native_init()
needs_native = pytest.mark.skipif(isinstance(NATIVE, str), reason=f"no native pid 1 here: {NATIVE}")
MODES = [pytest.param("native", marks=needs_native), "python"]

SCRIPT = r"""
import ctypes
import os
import signal
import sys
import time

from pytest_boxlite.guest import boxinit, fresh, ids

ns = {**vars(ids), **vars(boxinit), **vars(fresh)}
what = sys.argv[1]
root = os.geteuid() == 0
# A descriptor of the warm interpreter's that no box may keep (not close-on-exec, as a C
# library's may be): pid 1 must not hold it.
leak_r, leak_w = os.pipe()
os.set_inheritable(leak_w, True)
mapper = ns["IdMapper"]() if root else None
nested = ns["IdMapper"](proc=False) if root else None
init = ns["BareInit"]([signal.SIGTERM, signal.SIGINT], list(mapper.fds()) if root else [], nested,
                      mapper.id_maps() if root else None)
helper = ns["native_init"]()
outer = {n: os.readlink("/proc/self/ns/" + n) for n in ("pid", "user", "mnt", "uts", "ipc")}
pid = ns["clone_box"](False, mapper, False, init=init)
if pid == ns["IN_TEST"]:
    libc = ctypes.CDLL(None, use_errno=True)
    out = []
    try:
        # The box's own /proc, in its mount namespace (as _fresh_box mounts it).
        assert libc.mount(b"none", b"/", None, (1 << 14) | (1 << 18), None) == 0
        assert libc.mount(b"proc", b"/proc", b"proc", 0, None) == 0, ctypes.get_errno()
        inner = {n: os.readlink("/proc/self/ns/" + n) for n in outer}
        same = [n for n in outer if inner[n] == outer[n]]
        out.append("same_ns=%s" % ",".join(same))
        out.append("pid=%d ppid=%d" % (os.getpid(), os.getppid()))
        with open("/proc/1/cmdline", "rb") as fh:
            out.append("pid1=%s" % os.path.basename(fh.read().split(b"\0")[0]).decode())
        if nested is not None:
            # A root test's nested user namespace: pid 1 writes its maps (serve_nested).
            nested.request(libc, 0x00020000)
            with open("/proc/self/uid_map") as fh:
                out.append("nested_map=%s" % "_".join(fh.read().split()))
        try:
            # pid 1 closes the nested mapper's ends just after it answers: wait for that (bounded).
            deadline = time.monotonic() + 5
            while True:
                fds = sorted(int(n) for n in os.listdir("/proc/1/fd"))
                if len(fds) <= 3 or not helper or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            out.append("pid1_fds=%s" % ",".join(map(str, fds)))
        except PermissionError:
            out.append("pid1_fds=sealed")
        with open("/proc/1/status") as fh:
            out.append("pid1_uid=%s" % [l.split()[1] for l in fh if l.startswith("Uid:")][0])
        if what == "orphans":
            # Three orphans, each ending after its parent: pid 1 reaps them.
            for _ in range(3):
                if os.fork() == 0:
                    if os.fork() == 0:
                        time.sleep(0.2)
                        os._exit(0)
                    os._exit(0)
                os.wait()
            time.sleep(0.6)
            zombies = []
            for p in os.listdir("/proc"):
                if p.isdigit():
                    with open("/proc/%s/stat" % p) as fh:
                        if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                            zombies.append(p)
            out.append("zombies=%d" % len(zombies))
    except BaseException as exc:
        out.append("error=%r" % (exc,))
    sys.stdout.write("TEST " + " ".join(out) + "\n")
    sys.stdout.flush()
    if what == "signal":
        sys.stdout.write("READY\n")
        sys.stdout.flush()
        time.sleep(30)
    os._exit(5)
init.discard()
if mapper is not None:
    mapper.serve(pid)
blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
dumpable = ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
# One write per line: the test process writes to the same pipe (print's two writes interleave).
blocked = sorted(int(s) for s in blocked)
sys.stdout.write("WARM helper=%s blocked=%s dumpable=%d\n" % (helper is not None, blocked, dumpable))
sys.stdout.flush()
if what == "signal":
    time.sleep(1.0)
    os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
sys.stdout.write("STATUS %d\n" % os.waitstatus_to_exitcode(status))
"""


def _run(mode: str, what: str = "plain") -> dict[str, str]:
    env = dict(os.environ, PYTEST_BOXLITE_NATIVE_INIT="1" if mode == "native" else "0")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, what],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    fields: dict[str, str] = {}
    for line in done.stdout.splitlines():
        for word in line.split()[1:]:
            key, _, value = word.partition("=")
            fields[key] = value
        if line.startswith("STATUS"):
            fields["status"] = line.split()[1]
    assert "status" in fields, (done.stdout, done.stderr)
    return fields


@pytest.mark.parametrize("mode", MODES)
def test_pid1_duties_native_and_python(mode: str) -> None:
    """Either pid 1: new namespaces, the test process is pid 2 with pid 1 its parent (getppid()
    as today), a root test's nested maps are written, the box exits as its test process exits,
    and the warm interpreter comes back with its own signal mask and still dumpable."""
    got = _run(mode)
    assert got["same_ns"] == "", got
    assert got["pid"] == "2" and got["ppid"] == "1", got
    assert got["pid1"] == ("boxinit" if mode == "native" else Path(sys.executable).name), got
    if os.geteuid() == 0:
        assert got["nested_map"] == "0_0_4294967295", got
    assert got["status"] == "5", got
    assert got["helper"] == str(mode == "native"), got
    assert got["blocked"] == "[]" and got["dumpable"] == "1", got


@needs_native
def test_native_pid1_holds_nothing_of_the_warm_interpreter() -> None:
    """boxinit keeps only stdin, stdout and stderr (and, for a root test, its nested mapper's two
    ends until it has served them): not the warm interpreter's other descriptors, an inheritable
    one included, which the Python pid 1 keeps.  A test that is not root cannot look at all."""
    got = _run("native")
    if os.geteuid() != 0:
        assert got["pid1_fds"] == "sealed", got
        return
    assert got["pid1_fds"] == "0,1,2", got  # the nested mapper's ends are closed once served
    assert got["pid1_uid"] == "0", got
    old = _run("python")
    assert len(old["pid1_fds"].split(",")) > 3, old  # what the native pid 1 drops


@pytest.mark.parametrize("mode", MODES)
def test_pid1_forwards_signals_and_exits_128_plus_n(mode: str) -> None:
    """SIGTERM sent to the box's pid 1 from outside reaches the test process; the box exits 143."""
    got = _run(mode, "signal")
    assert got["status"] == "143", got


@pytest.mark.parametrize("mode", MODES)
def test_pid1_reaps_orphans(mode: str) -> None:
    got = _run(mode, "orphans")
    assert got["zombies"] == "0", got
    assert got["status"] == "5", got


def test_native_init_says_why_not(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The host's view (doctor, the report header): switched off, or not built."""
    monkeypatch.setenv(guest.NATIVE_INIT_ENV, "0")
    assert "switched off" in guest.pid1_line()
    monkeypatch.delenv(guest.NATIVE_INIT_ENV)
    monkeypatch.setattr(guest, "_HERE", tmp_path)
    assert guest.native_init() == "not built (no C compiler when the package was installed)"
    assert guest.pid1_line().startswith("python (BareInit")


def test_boxinit_refuses_bad_arguments(tmp_path: Path) -> None:
    """boxinit run by hand (not by box_clone) exits 70 at once, having done nothing."""
    if isinstance(NATIVE, str):
        pytest.skip(NATIVE)
    for argv in ([], ["1"], ["x", "0", "3", "-", "-", "-", "-"], ["0", "0", "3", "-", "-", "-", "-"]):
        done = subprocess.run([str(NATIVE[1]), *argv], capture_output=True, timeout=10, check=False)
        assert done.returncode == 70, (argv, done)


BOXED = """
import os

def test_pid1():
    with open("/proc/1/cmdline", "rb") as fh:
        name = os.path.basename(fh.read().split(b"\\0")[0]).decode()
    print("PID1=%s PPID=%d PID=%d" % (name, os.getppid(), os.getpid()))
"""


@pytest.mark.parametrize("mode", MODES)
def test_boxed_test_sees_its_pid1(mode: str, tmp_path: Path, home: Path, subruns: list[SubRun]) -> None:
    """A real ``--boxlite`` run: the test's pid 1 is the one the report header names, and the
    test's parent is pid 1 either way."""
    (tmp_path / "test_it.py").write_text(BOXED)
    env = sub_env(**{guest.NATIVE_INIT_ENV: "1" if mode == "native" else "0"})
    run = SubRun(tmp_path, home, mode, "--boxlite", "-s", "test_it.py", env=env)
    subruns.append(run)
    rc = run.wait(180)
    out = run.output
    assert rc == 0, out
    assert "PPID=1 PID=2" in out, out
    assert ("PID1=boxinit" in out) == (mode == "native"), out
    assert f"boxlite: pid 1: {mode}" in out, out


NOEXEC = r"""
set -e
mount -t tmpfs -o noexec tmpfs "$1"
mkdir -p "$1/pytest_boxlite/guest"
: > "$1/pytest_boxlite/__init__.py"
cp "$2" "$3" "$5/boxinit.py" "$5/caps.py" "$5/linux.py" "$1/pytest_boxlite/guest/"
cd "$1"
PYTHONPATH="$1" "$4" -c '
import sys
from pytest_boxlite.guest import boxinit
assert boxinit.__file__.startswith(sys.argv[1]), boxinit.__file__  # the copy on the noexec mount
print("helper", boxinit.native_init(), boxinit._NATIVE["why"])
' "$1"
"""


@needs_native
def test_boxinit_on_a_noexec_mount_means_the_python_pid1(tmp_path: Path) -> None:
    """A package on a noexec mount: the warm interpreter must not hand pid 1 a boxinit it cannot
    execute (every box would end at once); it runs the Python pid 1 and says why."""
    assert not isinstance(NATIVE, str)
    where = tmp_path / "noexec"
    where.mkdir()
    argv = ["unshare", "-r", "-m", "sh", "-c", NOEXEC, "sh", str(where), str(NATIVE[0]), str(NATIVE[1])]
    argv += [sys.executable, str(guest.path("boxinit").parent)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        pytest.skip("no unshare(1) here")
    if done.returncode != 0 and "mount" in done.stderr:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert "helper None" in done.stdout and "noexec" in done.stdout, done.stdout
