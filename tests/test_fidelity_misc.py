"""Fidelity odds and ends (issue 23, items 4, 5, 6 and part of 10), each a real pytest sub-run with
real namespace boxes and a ``--boxlite-home`` of its own, left empty afterwards:

- ``--boxlite`` with tests that lease sandboxes: they run on the host, with one summary line;
- ``--boxlite-scope=worker`` and marker arguments: ``env=`` and the timeouts hold per test, what a
  shared box cannot hold is a usage error naming the test (with and without ``-n 2``);
- debuggers: ``breakpoint()``/``pdb.set_trace()`` in a box and ``--pdb``, driven through a pty;
- ``pytest.exit()`` under ``-n 2`` ends the run as it does unboxed;
- ``boxlite_pool``'s ``image=`` (a warning where images are unused, an error for a malformed
  name), ``update_file`` with text, and a marker's ``memory=`` that cannot hold for an ordinary user.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
import subruns
from subruns import QUIET, sub_env

from pytest_boxlite import ledger

pytestmark = pytest.mark.timeout(240)

RUNTIME = ("--boxlite-runtime=namespace",)


class SubRun(subruns.SubRun):
    base_args = RUNTIME
    wait_timeout = 150.0


def write(directory: Path, name: str, source: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(textwrap.dedent(source))


def finished(run: SubRun) -> tuple[int, str]:
    rc = run.wait()
    return rc, run.output


def no_leftovers(home: Path, output: str) -> None:
    assert ledger.scan(home) == [], f"boxes left behind in {home}\n{output[-3000:]}"


XDIST = pytest.mark.parametrize("xdist", [(), ("-n", "2")], ids=["plain", "n2"])


# --------------------------------------------------------------------------
# item 4: --boxlite and the sandbox fixtures

SANDBOX_TESTS = """
import os

import pytest

IN_BOX = "PYTEST_BOXLITE_GUEST"


@pytest.fixture(scope="module")
def shared(boxlite_pool):
    # The user's own fixture that leases from the pool: its tests need the host too.
    with boxlite_pool.sandbox() as sb:
        yield sb


def test_plain_is_boxed():
    assert os.environ.get(IN_BOX) == "1"


def test_sandbox(boxlite_sandbox):
    assert IN_BOX not in os.environ
    assert boxlite_sandbox.run(["true"]).ok


def test_module_sandbox(boxlite_module_sandbox):
    assert IN_BOX not in os.environ
    assert boxlite_module_sandbox.run(["true"]).ok


def test_through_a_fixture(shared):
    assert IN_BOX not in os.environ
    assert shared.run(["true"]).ok
"""

ON_HOST_LINE = (
    "boxlite: 3 tests ran on the host, not in a box: they use boxlite_module_sandbox, boxlite_pool, "
    "boxlite_sandbox, whose sandboxes are boxes from the host's pool (a box starts no boxes)"
)


@XDIST
def test_boxlite_runs_tests_that_lease_sandboxes_on_the_host(tmp_path: Path, home: Path, xdist: Sequence[str]) -> None:
    """Under --boxlite a test that needs a sandbox fixture (directly or through the user's own
    fixture) runs on the host and its sandboxes work; the others are boxed; one line says so."""
    write(tmp_path, "test_sandboxes.py", SANDBOX_TESTS)
    rc, out = finished(SubRun(tmp_path, home, "all", "--boxlite", *xdist, "test_sandboxes.py"))
    assert rc == 0, out
    assert re.search(r"\b4 passed\b", out), out
    assert out.count("ran on the host, not in a box") == 1, out
    assert ON_HOST_LINE in out, out
    no_leftovers(home, out)


SWITCH_CONFTEST = """
import os, sys

def pytest_configure(config):
    if os.environ.get("PYTEST_BOXLITE_GUEST") != "1" and os.environ.get("USER_SWITCH"):
        sys.setswitchinterval(float(os.environ["USER_SWITCH"]))

def pytest_collection_finish(session):
    if os.environ.get("PYTEST_BOXLITE_GUEST") != "1":
        print("\\nSWITCH at collection %r" % sys.getswitchinterval())

def pytest_unconfigure(config):
    if os.environ.get("PYTEST_BOXLITE_GUEST") != "1":
        print("\\nSWITCH at unconfigure %r" % sys.getswitchinterval())
"""

SWITCH_TESTS = """
import os, sys

EXPECTED = float(os.environ.get("USER_SWITCH") or 0.005)

def test_boxed():
    assert os.environ.get("PYTEST_BOXLITE_GUEST") == "1"
    assert sys.getswitchinterval() == 0.005

def test_sandbox_on_the_host(boxlite_sandbox):
    assert sys.getswitchinterval() == EXPECTED
    assert boxlite_sandbox.run(["true"]).ok
    sys.setswitchinterval(0.003)

def test_boxed_between():
    assert sys.getswitchinterval() == 0.005

def test_next_on_the_host_sees_what_the_last_one_set(boxlite_sandbox):
    assert sys.getswitchinterval() == 0.003
"""


@pytest.mark.parametrize("user", ["", "0.002"], ids=["default", "users-own"])
def test_host_threads_switch_fast_but_host_tests_see_the_users_interval(tmp_path: Path, home: Path, user: str) -> None:
    """While boxes are made (collection, the run) the host switches threads every 0.5 ms, so its
    box threads are not held up by the main thread; a test run on the host sees the user's own
    interval (the default, one a conftest set, then the one an earlier test set), and the
    session leaves that value behind."""
    write(tmp_path, "conftest.py", SWITCH_CONFTEST)
    write(tmp_path, "test_switch.py", SWITCH_TESTS)
    env = sub_env(USER_SWITCH=user)
    rc, out = finished(SubRun(tmp_path, home, "switch", "--boxlite", "-s", "test_switch.py", env=env))
    assert rc == 0, out
    assert re.search(r"\b4 passed\b", out), out
    assert "SWITCH at collection 0.0005" in out, out
    assert "SWITCH at unconfigure 0.003" in out, out
    no_leftovers(home, out)


MODULE_A = """
import os, time

def test_a1():
    open("/tmp/from-a", "w").write("a")  # the next module's box, made meanwhile, must not see it
    time.sleep(0.6)

def test_a2():
    time.sleep(0.6)

def test_a3(record_property):
    record_property("a3_start", float(open("/proc/uptime").read().split()[0]))
"""

MODULE_B = """
import os, time

def test_b(record_property):
    assert not os.path.exists("/tmp/from-a")
    # When this box was made: its pid 1's start, in clock ticks after boot (as /proc/uptime counts).
    ticks = int(open("/proc/1/stat").read().rsplit(")", 1)[1].split()[19])
    record_property("b_born", ticks / os.sysconf("SC_CLK_TCK"))
"""


def test_module_scope_makes_the_next_modules_box_while_a_module_runs(tmp_path: Path, home: Path) -> None:
    """In module scope the next module's box is forked early in the module before it (not during
    its last test only, which is shorter than making a box), and is as pristine as ever."""
    write(tmp_path, "test_a.py", MODULE_A)
    write(tmp_path, "test_b.py", MODULE_B)
    xml = tmp_path / "junit.xml"
    args = (
        "--boxlite",
        "--boxlite-scope=module",
        f"--junitxml={xml}",
        "-o",
        "junit_family=legacy",
        "test_a.py",
        "test_b.py",
    )
    rc, out = finished(SubRun(tmp_path, home, "ahead", *args))
    assert rc == 0, out
    assert re.search(r"\b4 passed\b", out), out
    props = {
        m[0]: float(m[1]) for m in re.findall(r'<property name="(a3_start|b_born)" value="([0-9.]+)"', xml.read_text())
    }
    assert props["b_born"] < props["a3_start"] - 0.3, (props, out)  # a2 sleeps 0.6 s
    no_leftovers(home, out)


MARKED_SANDBOX = """
import pytest


@pytest.fixture
def tool(boxlite_sandbox):
    return boxlite_sandbox


@pytest.mark.boxlite
def test_marked(tool):
    pass
"""


def test_an_explicit_marker_on_a_sandbox_test_is_a_usage_error(tmp_path: Path, home: Path) -> None:
    write(tmp_path, "test_marked.py", MARKED_SANDBOX)
    rc, out = finished(SubRun(tmp_path, home, "marked", "test_marked.py"))
    assert rc == pytest.ExitCode.USAGE_ERROR, out
    assert (
        "test_marked.py::test_marked: @pytest.mark.boxlite: it uses boxlite_sandbox (directly or through its "
        "fixtures), which leases boxes from the host's pool, and a test in a box cannot start boxes"
    ) in out, out
    assert "Remove the marker" in out, out
    no_leftovers(home, out)


# --------------------------------------------------------------------------
# item 5: --boxlite-scope=worker and marker arguments

WORKER_ARGS = """
import os
import time

import pytest


@pytest.mark.boxlite(env={"PBX_MARKER_ENV": "set"})
def test_env_is_set():
    assert os.environ.get("PBX_MARKER_ENV") == "set"


def test_env_is_not_left_behind():
    assert "PBX_MARKER_ENV" not in os.environ


@pytest.mark.boxlite(timeout=2)
def test_marker_timeout():
    time.sleep(60)


@pytest.mark.boxlite
def test_default_timeout():
    time.sleep(60)


def test_unmarked_has_no_bound():
    time.sleep(5)  # longer than --boxlite-timeout: an unmarked test is not boxed in the other scopes
"""


@XDIST
def test_worker_scope_honours_env_and_timeouts(tmp_path: Path, home: Path, xdist: Sequence[str]) -> None:
    """env= is set for its test only; timeout= and --boxlite-timeout interrupt a test that sleeps
    for a minute (a sub-run that ignored them would outlast its wait)."""
    write(tmp_path, "test_worker_args.py", WORKER_ARGS)
    run = SubRun(
        tmp_path, home, "args", "--boxlite-scope=worker", "--boxlite-timeout=4", "-p", "no:randomly", *xdist,
        "test_worker_args.py",
    )  # fmt: skip
    rc, out = finished(run)
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert re.search(r"\b2 failed, 3 passed\b", out), out
    for name, bound in (("test_marker_timeout", 2), ("test_default_timeout", 4)):
        # Under -n the failure's body starts with the worker's line ("[gw0] linux -- Python ...").
        body = rf"_ {name} _+\n(?:\[gw\d+\] .*\n)?\[boxlite\] timed out after {bound}s; the test was interrupted"
        assert re.search(body, out), out
    no_leftovers(home, out)


REFUSED = """
import pytest


@pytest.mark.boxlite(memory=512)
def test_needs_memory():
    pass


def test_other():
    pass
"""


@XDIST
def test_worker_scope_refuses_what_a_shared_box_cannot_hold(tmp_path: Path, home: Path, xdist: Sequence[str]) -> None:
    write(tmp_path, "test_refused.py", REFUSED)
    rc, out = finished(SubRun(tmp_path, home, "refused", "--boxlite-scope=worker", *xdist, "test_refused.py"))
    assert rc == pytest.ExitCode.USAGE_ERROR, out
    assert (
        "test_refused.py::test_needs_memory: @pytest.mark.boxlite: memory=512 cannot hold under --boxlite-scope=worker"
    ) in out, out
    assert "--boxlite-memory=512" in out, out
    assert "passed" not in out, out  # refused before any test ran
    no_leftovers(home, out)


STUBBORN = """
import time

import pytest


@pytest.mark.boxlite(timeout=1)
def test_stubborn():
    try:
        time.sleep(60)
    except BaseException:
        time.sleep(60)  # swallows the interruption


def test_after():
    pass
"""


@XDIST
def test_worker_scope_ends_the_box_of_a_test_that_ignores_its_timeout(
    tmp_path: Path, home: Path, xdist: Sequence[str]
) -> None:
    """As the other scopes kill a timed-out test's box, the worker's box ends when the test does
    not stop after being interrupted, saying why (with -n, xdist reports the crash and a new worker
    runs the rest; without, the session's box is the worker's and the run ends there)."""
    write(tmp_path, "test_stubborn.py", STUBBORN)
    run = SubRun(tmp_path, home, "stubborn", "--boxlite-scope=worker", "-p", "no:randomly", *xdist, "test_stubborn.py")
    rc, out = finished(run)
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert (
        "boxlite: test_stubborn.py::test_stubborn timed out after 1s and did not stop within 5s of being "
        "interrupted; ending this worker's box"
    ) in out, out
    if xdist:
        assert "crashed while running 'test_stubborn.py::test_stubborn'" in out, out
        assert re.search(r"\b1 failed, 1 passed\b", out), out
    no_leftovers(home, out)


# --------------------------------------------------------------------------
# item 6: debuggers and pytest.exit


def run_in_pty(
    argv: Sequence[str], cwd: Path, *, answers: Sequence[tuple[bytes, bytes]] = (), timeout: float = 120.0
) -> tuple[int, str]:
    """Run ``argv`` on a new pseudo-terminal, as from a user's shell; each ``(prompt, reply)`` of
    ``answers`` is typed once ``prompt`` appears after the previous reply.  Its exit code and output."""
    rc, out = subruns.run_in_pty(argv, cwd, [(p, r, 0.0) for p, r in answers], timeout, columns=200)
    return rc, out.decode(errors="replace").replace("\r\n", "\n")


def pytest_argv(home: Path, *args: str) -> list[str]:
    return subruns.pytest_argv(home, *RUNTIME, "-p", "no:randomly", *args)


DEBUGGED = """
import pytest

breakpoint()


@pytest.mark.boxlite
def test_boxed():
    pass


def test_local():
    pass
"""


@pytest.mark.parametrize("fresh", ["fork", "boot"])
def test_breakpoint_in_a_boxed_test_says_why_and_how(tmp_path: Path, home: Path, fresh: str) -> None:
    """On a terminal, a breakpoint() in module-level code of a boxed test's module: the host's
    collection gets its debugger (the terminal works, ``c``); the box's own collection, outside any
    test's run (whose debugger is relayed, tests/test_pdb_relay.py), has no terminal of the user's,
    so the boxed test errors at once naming the line and the way out, in forked and booted boxes
    alike; no second prompt, no BdbQuit."""
    write(tmp_path, "test_dbg.py", DEBUGGED)
    argv = pytest_argv(home, f"--boxlite-fresh={fresh}", "test_dbg.py")
    rc, out = run_in_pty(argv, tmp_path, answers=[(b"(Pdb) ", b"c\n")])
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert re.search(r"\b1 passed, 1 error\b", out), out
    assert (
        f"a debugger was asked for at {tmp_path / 'test_dbg.py'}:4, outside any test's run in a box of pytest-boxlite"
    ) in out, out
    assert f"run it unboxed: pytest -p no:boxlite {tmp_path / 'test_dbg.py'}" in out, out
    assert out.count("(Pdb) ") == 1, out  # the host's own collection's
    assert "BdbQuit" not in out, out
    no_leftovers(home, out)


PDB_FAILS = """
import pytest


@pytest.mark.boxlite
def test_boxed_fails():
    assert 1 == 2


def test_local_fails():
    assert 3 == 4
"""


def test_pdb_with_boxed_tests_says_so_where_it_would_debug(tmp_path: Path, home: Path) -> None:
    """--pdb on a terminal, and boxed tests that get no box (a ``--boxlite-setup`` that fails):
    no box can open their post-mortem (a box does for the tests it runs, tests/test_pdb_relay.py),
    so each such failure gets a line naming it and how to debug it here; a local failure still
    gets pdb's post-mortem; no header line (boxes relay --pdb)."""
    write(tmp_path, "test_pdb.py", PDB_FAILS)
    argv = pytest_argv(home, "--boxlite-setup", "exit 3", "--pdb", "test_pdb.py")
    rc, out = run_in_pty(argv, tmp_path, answers=[(b"(Pdb) ", b"c\n")])
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert "does not enter boxed tests" not in out, out

    def told(name: str) -> bool:
        return (
            f"boxlite: --pdb: test_pdb.py::{name} failed before a box could open its debugger here; "
            f"to debug it: pytest -p no:boxlite --pdb test_pdb.py::{name}"
        ) in out

    assert told("test_boxed_fails"), out
    assert not told("test_local_fails"), out
    assert out.count("PDB post_mortem") == 1, out  # the local failure's
    no_leftovers(home, out)


IN_SESSION_BOX = """
import os


def test_debugged():
    assert os.environ.get("PYTEST_BOXLITE_GUEST") == "1"  # in the session's box
    x = 41
    breakpoint()
    assert x == 42  # set at the prompt


def test_fails():
    assert 3 == 4
"""


@pytest.mark.parametrize("capture", ["--capture=fd", "-s"])
def test_worker_scope_debugs_in_the_box_on_this_terminal(tmp_path: Path, home: Path, capture: str) -> None:
    """The whole session in one box (--boxlite-scope=worker, no -n) is handed the terminal itself
    (stdin too, which the host's pytest keeps on /dev/null while it captures): breakpoint() gets a
    working pdb (a value set at its prompt holds) and --pdb its post-mortem, in the box, as locally."""
    write(tmp_path, "test_in_box.py", IN_SESSION_BOX)
    argv = pytest_argv(home, "--boxlite-scope=worker", capture, "--pdb", "test_in_box.py")
    answers = [(b"(Pdb) ", b"x = 42\n"), (b"(Pdb) ", b"c\n"), (b"(Pdb) ", b"c\n")]
    rc, out = run_in_pty(argv, tmp_path, answers=answers)
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert re.search(r"\b1 failed, 1 passed\b", out), out
    assert "PDB post_mortem" in out, out
    assert "[boxlite]" not in out and "failed in a box" not in out, out
    no_leftovers(home, out)


EXITS = """
import time

import pytest


def test_exit():
    pytest.exit("enough", returncode=7)


@pytest.mark.parametrize("i", range(6))
def test_slow(i):
    time.sleep(1)
"""


def test_pytest_exit_under_n2_ends_the_run_as_unboxed(tmp_path: Path, home: Path) -> None:
    """Whatever xdist makes of a worker's pytest.exit() unboxed (the exit code, the run stopping),
    boxed tests under -n 2 give the same in the default scope.  In the worker scope the whole
    worker is a box, and a box never stops the session (docs/explanation/escapes.md, the xdist
    rows): the test that called pytest.exit() fails, saying why, and every other test runs."""
    write(tmp_path, "test_exits.py", EXITS)
    # Unboxed: without this plugin, so without its options (SubRun passes --boxlite-home).
    plain_run = subprocess.run(
        [sys.executable, "-m", "pytest", *QUIET, "-p", "no:boxlite", "-p", "no:randomly", "-n", "2"],
        cwd=tmp_path, env=sub_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    plain_rc, plain = plain_run.returncode, plain_run.stdout + plain_run.stderr
    assert "6 passed" not in plain, plain
    rc, out = finished(SubRun(tmp_path, home, "test", "--boxlite", "-p", "no:randomly", "-n", "2"))
    assert rc == plain_rc, f"unboxed: {plain_rc}, boxed (test scope): {rc}\n{out}"
    assert "6 passed" not in out, out
    no_leftovers(home, out)
    rc, out = finished(
        SubRun(tmp_path, home, "worker", "--boxlite", "--boxlite-scope=worker", "-p", "no:randomly", "-n", "2", "-rf")
    )
    assert rc == 1, out
    assert re.search(r"^FAILED test_exits.py::test_exit\b", out, re.M) and "6 passed" in out, out
    no_leftovers(home, out)


# --------------------------------------------------------------------------
# item 10: boxlite_pool's image=, update_file with text, a memory= that cannot hold

POOL_TESTS = """
import pytest


def test_other_image(boxlite_pool):
    # No registry here: an image that cannot be had fails the test that asks for it (issue 25).
    with pytest.raises(Exception, match="image 'alpine:3' cannot be used"):
        boxlite_pool.sandbox(image="alpine:3").__enter__()


def test_malformed_image_name(boxlite_pool):
    with pytest.raises(Exception, match="'Not An Image' is not an OCI image reference"):
        boxlite_pool.spec(image="Not An Image")


def test_update_file_takes_text_and_bytes(boxlite_sandbox):
    boxlite_sandbox.update_file("/workspace/f.txt", "text \\u00e9\\n")
    assert boxlite_sandbox.read_bytes("/workspace/f.txt") == "text \\u00e9\\n".encode()
    boxlite_sandbox.update_file("/workspace/f.txt", b"\\x00\\xff")
    assert boxlite_sandbox.read_bytes("/workspace/f.txt") == b"\\x00\\xff"
"""


def test_pool_image_warns_where_unused_and_malformed_names_fail(tmp_path: Path, home: Path) -> None:
    write(tmp_path, "test_pool_image.py", POOL_TESTS)
    rc, out = finished(SubRun(tmp_path, home, "pool", "-p", "no:randomly", "test_pool_image.py"))
    assert rc == 0, out
    assert re.search(r"\b3 passed\b", out) and "has no effect" not in out, out
    no_leftovers(home, out)


MARKER_IMAGE = """
import pytest


@pytest.mark.boxlite(image="alpine:3")
def test_marker_image():
    pass
"""


def test_a_collection_warning_made_an_error_is_a_usage_error(tmp_path: Path, home: Path) -> None:
    """filterwarnings=error (this suite's own setting, and many projects'): the marker's image
    warning, given in a collection hook, stops the run as a usage error naming the test and the
    filter that lets it pass, not an INTERNALERROR."""
    write(tmp_path, "test_marker_image.py", MARKER_IMAGE)
    as_errors = ("-W", "error::pytest.PytestWarning")
    rc, out = finished(SubRun(tmp_path, home, "image-error", *as_errors, "test_marker_image.py"))
    assert rc == pytest.ExitCode.USAGE_ERROR, out
    # No registry here: the marker's image cannot be had, a usage error naming the test (issue 25).
    assert "ERROR: test_marker_image.py::test_marker_image: @pytest.mark.boxlite: image 'alpine:3' cannot be" in out
    assert "INTERNALERROR" not in out, out
    no_leftovers(home, out)


MEMORY_TESTS = """
import pytest


@pytest.mark.boxlite(memory=512)
def test_asks_for_memory():
    pass


@pytest.mark.boxlite
def test_default_memory():
    pass
"""


def test_a_memory_request_that_cannot_hold_warns_per_test(tmp_path: Path, home: Path) -> None:
    """Where memory caps cannot hold (an ordinary user without a delegated cgroup: CI's ordinary-user
    job), the header names the default's; a test that asks for memory of its own gets a warning
    naming it and why.  Where they hold (root), no test is warned."""
    write(tmp_path, "test_memory.py", MEMORY_TESTS)
    rc, out = finished(SubRun(tmp_path, home, "memory", "test_memory.py"))
    assert rc == 0, out
    if "boxlite: limits not enforced: memory" in out:
        assert re.search(
            r"test_memory\.py:5: PytestWarning: test_memory\.py::test_asks_for_memory: "
            r"@pytest\.mark\.boxlite\(memory=512\) is not enforced here: memory 512 MiB \(no cgroup",
            out,
        ), out
        assert out.count("is not enforced here") == 1, out  # not for the test that asks for nothing
        assert re.search(r"\b2 passed, 1 warning\b", out), out
        # Warnings made errors: a usage error naming the test (in a collection hook it was an INTERNALERROR).
        as_errors = ("-W", "error::pytest.PytestWarning")
        rc, out = finished(SubRun(tmp_path, home, "memory-error", *as_errors, "test_memory.py"))
        assert rc == pytest.ExitCode.USAGE_ERROR, out
        assert "ERROR: test_memory.py::test_asks_for_memory: @pytest.mark.boxlite(memory=512) is not enforced" in out
        assert "INTERNALERROR" not in out, out
    else:
        assert "is not enforced here" not in out, out
        assert re.search(r"\b2 passed in\b", out), out
    no_leftovers(home, out)


# --------------------------------------------------------------------------
# issue 44, item 3b: a pytest that a boxed test starts is an ordinary pytest, not the box's own

INNER_RUN_TESTS = '''
import os

pytest_plugins = ["pytester"]

INNER = """
import os
import pdb


def test_inner(request):
    print("INNER-ROLE", os.environ.get("PYTEST_BOXLITE_ROLE"), request.config.pluginmanager.has_plugin("boxlite-guest"))
    pdb.set_trace()  # what a debugger test does: unboxed, pytest says stdin is captured
"""


def check(result, debugger_said):
    out = result.stdout.str()
    assert "INNER-ROLE None False" in out, out
    assert "a debugger was asked for" not in out, out
    assert debugger_said in out, out
    result.assert_outcomes(failed=1)


def test_subprocess_pytest(pytester):
    pytester.makepyfile(test_inner=INNER)
    # As unboxed: the inner pytest's stdin is at its end, pdb quits.
    check(pytester.runpytest_subprocess("-p", "no:cacheprovider"), "bdb.BdbQuit")


def test_in_process_pytest(pytester):
    pytester.makepyfile(test_inner=INNER)
    check(pytester.runpytest_inprocess("-p", "no:cacheprovider"), "reading from stdin while output is captured")


def test_the_outer_test_knows_where_it_runs():
    # The public variable stays: it says where a process runs, and gives no pytest a role.
    assert os.environ.get("PYTEST_BOXLITE_GUEST") == os.environ.get("OUTER_EXPECTS_GUEST")
    assert "PYTEST_BOXLITE_ROLE" not in os.environ
'''


@pytest.mark.parametrize(
    "mode",
    [(), ("--boxlite",), ("--boxlite", "-n", "2"), ("--boxlite", "--boxlite-scope=worker")],
    ids=["unboxed", "boxed", "boxed-n2", "worker-scope"],
)
def test_a_pytest_started_by_a_boxed_test_acts_as_unboxed(tmp_path: Path, home: Path, mode: Sequence[str]) -> None:
    """Issue 44 (3b): the box's environment marked every process in it as the box's own pytest,
    so a pytest that a boxed test runs (pytester, in-process or as a subprocess) refused
    ``pdb.set_trace()`` with the plugin's own message (or read end-of-file under ``-n 2``)
    where unboxed it behaves as pytest does. Now the inner run is as unboxed, in every mode."""
    write(tmp_path, "test_inner_runs.py", INNER_RUN_TESTS)
    env = sub_env(OUTER_EXPECTS_GUEST="1" if mode else "")
    if not mode:
        env.pop("OUTER_EXPECTS_GUEST")
    run = SubRun(tmp_path, home, "inner", *mode, "-p", "pytester", "test_inner_runs.py", env=env)
    rc, out = finished(run)
    assert rc == 0, out
    assert re.search(r"\b3 passed\b", out), out
    no_leftovers(home, out)


BOX_START = """
import sys

import pytest

import pytest_boxlite.guest.worker  # noqa: F401 - what a box's bootstrap imports before pytest starts

sys.exit(pytest.main(["-p", "pytest_boxlite", "-W", "error", "-q", "-p", "no:cacheprovider", sys.argv[1]]))
"""


def test_a_box_starts_pytest_after_importing_the_package_without_a_warning(tmp_path: Path) -> None:
    """A box's bootstrap imports the guest code (the package) before its pytest starts; pytest warns
    of a package it marks for rewriting that is imported already, and under ``filterwarnings =
    error`` (this project's, and many projects') that warning stopped every boxed test from
    starting where the plugin was installed from a wheel (its package is then marked, as ``-p``
    marks it here)."""
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    (tmp_path / "start.py").write_text(BOX_START)
    r = subprocess.run(
        [sys.executable, str(tmp_path / "start.py"), str(tmp_path / "test_one.py")],
        cwd=tmp_path, env=sub_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "1 passed" in r.stdout
