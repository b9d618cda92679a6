"""guest/fresh.py's clone_box: one clone(2) into a fresh box's namespaces, or fork + unshare + fork
where it knows no clone number, with the same result: the child is pid 1 of a new pid namespace in
a new user namespace, with the ids a box gets, and the parent sees its exit status."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import os
import sys

from pytest_boxlite.guest import fresh, ids

ns = {**vars(ids), **vars(fresh)}
if sys.argv[1] == "forks":
    ns["_SYS_CLONE"].clear()  # the path of a machine whose clone(2) number it does not know
if sys.argv[1] == "thread":
    # A thread started after fresh.py was loaded (as a conftest may start one): fork(3)'s path.
    import threading, time
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
outer = {n: os.readlink("/proc/self/ns/" + n) for n in ("pid", "user", "mnt", "uts", "ipc", "net")}
mapper = ns["IdMapper"]() if os.geteuid() == 0 else None
uid = os.geteuid()
pid = ns["clone_box"](False, mapper)
if pid == 0:
    inner = {n: os.readlink("/proc/self/ns/" + n) for n in outer}
    with open("/proc/self/uid_map") as fh:
        uid_map = fh.read().split()
    want_map = ["0", "0", "4294967295"] if uid == 0 else [str(uid), str(uid), "1"]
    # Root's network namespace is made one level down, in the test process (enter_test_namespaces).
    fails = [n for n in outer if (inner[n] == outer[n]) != (n == "net" and uid == 0)]
    if os.getpid() != 1:
        fails.append("pid %d" % os.getpid())
    if uid_map != want_map:
        fails.append("uid_map %s" % uid_map)
    if os.geteuid() != uid:
        fails.append("euid %d" % os.geteuid())
    sys.stdout.write(" ".join(fails) + "\n")
    sys.stdout.flush()
    os._exit(9 if fails else 7)
# clone(2) returns pid 1 of the new pid namespace itself; fork(3)'s path returns the process in
# between, still in this one (it waits for pid 1, so it is there to look at).
direct = os.readlink("/proc/%d/ns/pid" % pid) != outer["pid"] if mapper is not None or sys.argv[1] != "clone" else None
if mapper is not None:
    mapper.serve(pid)
_, status = os.waitpid(pid, 0)
print("status", os.waitstatus_to_exitcode(status), "direct", direct)
"""


def _userns_possible() -> bool:
    """Whether this process may make user namespaces (root, or unprivileged ones allowed)."""
    if os.geteuid() == 0:
        return True
    try:
        with open("/proc/sys/kernel/unprivileged_userns_clone") as fh:
            return fh.read().strip() == "1"
    except OSError:
        return True  # no such switch: the kernel allows them


def run_script(script: str, path: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a new interpreter, with the ``path`` to take."""
    if path == "clone" and os.uname().machine not in ("x86_64", "aarch64", "riscv64", "ppc64le", "ppc64"):
        pytest.skip(f"no clone(2) number for {os.uname().machine}: the fork path is the one used")
    return subprocess.run(
        [sys.executable, "-c", script, path],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(sys.platform != "linux", reason="Linux namespaces")
@pytest.mark.skipif(not _userns_possible(), reason="user namespaces are not allowed here")
@pytest.mark.parametrize("path", ["clone", "forks", "thread"])
def test_clone_box_child_is_pid_1_of_new_namespaces(path: str) -> None:
    """Either path makes the same box; a thread the interpreter did not have at load time sends
    it down fork(3)'s path (a bare clone(2) could copy a libc lock that thread holds)."""
    proc = run_script(SCRIPT, path)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    # The child's line (what differs from a fresh box: nothing), then the parent's.
    direct = {"clone": "True" if os.geteuid() == 0 else "None", "forks": "False", "thread": "False"}[path]
    assert lines == ["", f"status 7 direct {direct}"], (lines, proc.stderr)


FAILING = r"""
import os
import sys

from pytest_boxlite.guest import fresh, ids

ns = {**vars(ids), **vars(fresh)}
if sys.argv[1] == "forks":
    ns["_SYS_CLONE"].clear()
me = os.getpid()
pid = ns["clone_box"](False, None)  # root without a mapper: the child cannot map its ids
print("returned in", "the parent" if os.getpid() == me else "the child")
sys.stdout.flush()
if pid:
    _, status = os.waitpid(pid, 0)
    print("status", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="root's id maps (Linux)")
@pytest.mark.parametrize("path", ["clone", "forks"])
def test_clone_box_child_that_cannot_start_exits_instead_of_returning(path: str) -> None:
    """A child whose first steps fail must never return into the caller (the warm interpreter's loop)."""
    proc = run_script(FAILING, path)
    assert proc.stdout.splitlines() == ["returned in the parent", "status 70"], (proc.stdout, proc.stderr)
    assert "the fresh box could not start" in proc.stderr
