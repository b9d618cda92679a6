"""In-place forks (issue 41, item 1): with ``--boxlite-fresh=boot`` and ``--boxlite-keep`` a boxed
test runs in a plain fork of its booted box's warm interpreter, and keeps what those options promise.

Real sub-runs on the namespace runtime: a kept box holds the files its failed test wrote (and only
that test's); boot mode's module scope runs a module's tests in one fork, which keeps their module
state; and the test's messages travel on the fork's socket, not the warm interpreter's channel (on
the old path a booted box's test ran in the warm interpreter and sent them on its channel: the
last test fails there).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from subruns import SubRun
from test_session import cli

from pytest_boxlite import ledger

pytestmark = pytest.mark.timeout(180)

KEEP = """
import pytest

pytestmark = pytest.mark.boxlite


def test_passes():
    open("/tmp/pass-evidence", "w").write("passed")


def test_fails():
    open("/tmp/evidence", "w").write("written by test_fails")
    assert False, "failing on purpose"
"""

MODULE_STATE = """
import os

import pytest

pytestmark = pytest.mark.boxlite
SEEN = []


def test_one():
    SEEN.append(os.getpid())


def test_two():
    assert SEEN == [os.getpid()], SEEN
"""

ON_THE_SOCKET = """
import gc

import pytest

pytestmark = pytest.mark.boxlite


def closure(f):
    return dict(zip(f.__code__.co_freevars, (c.cell_contents for c in f.__closure__ or ())))


def test_messages_go_on_the_forks_socket():
    plugin = [o for o in gc.get_objects() if type(o).__name__ == "GuestPlugin"]
    assert len(plugin) == 1, plugin
    # GuestPlugin.send is a locked wrapper around the fork's JSON writer (closure ``out``), or on
    # the old path around the warm interpreter's ``channel.send``.
    sender = closure(closure(plugin[0].send)["send"])
    assert "out" in sender and "channel" not in sender, sorted(sender)
"""


def run(tmp_path: Path, home: Path, tag: str, body: str, *args: str) -> tuple[int, str]:
    proj = tmp_path / tag
    proj.mkdir()
    (proj / f"test_{tag}.py").write_text(textwrap.dedent(body))
    sub = SubRun(proj, home, tag, "-p", "no:randomly", "-p", "no:xdist", *args)
    return sub.wait(150), sub.output


def test_a_kept_box_holds_what_its_failed_test_wrote(tmp_path: Path, home: Path) -> None:
    rc, out = run(tmp_path, home, "keep", KEEP, "--boxlite-keep")
    assert rc == 1, out
    kept = re.findall(r"kept box (pbx-\S+) \(failed test\).*it ran test_keep\.py::test_fails", out)
    assert len(kept) == 1, out  # only the failed test's box
    try:
        shown = cli(home, "shell", kept[0], "cat", "/tmp/evidence")
        assert shown.stdout == "written by test_fails", shown.stdout + shown.stderr
        # The passing test ran in a box of its own, which went.
        other = cli(home, "shell", kept[0], "cat", "/tmp/pass-evidence")
        assert "passed" not in other.stdout, other.stdout
    finally:
        cli(home, "clean", kept[0])
    assert ledger.scan(home) == []


@pytest.mark.parametrize(("scope", "passed"), [("module", 2), ("test", 1)])
def test_boot_module_scope_runs_a_module_in_one_fork(tmp_path: Path, home: Path, scope: str, passed: int) -> None:
    rc, out = run(tmp_path, home, "state", MODULE_STATE, "--boxlite-fresh=boot", f"--boxlite-scope={scope}")
    assert f"{passed} passed" in out, out
    assert rc == (0 if scope == "module" else 1), out
    assert ledger.scan(home) == []


@pytest.mark.parametrize("args", [("--boxlite-fresh=boot",), ("--boxlite-keep",), ()], ids=["boot", "keep", "fresh"])
def test_a_boxed_tests_messages_travel_on_its_forks_socket(tmp_path: Path, home: Path, args: tuple[str, ...]) -> None:
    rc, out = run(tmp_path, home, "socket", ON_THE_SOCKET, *args)
    assert rc == 0 and "1 passed" in out, out
    assert ledger.scan(home) == []
