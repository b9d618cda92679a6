"""One owner per step of a boxed item's run (issue 22): the path of an item through ``remote/``.

The executor (``remote/executor.py``) drives an item's run; each step is one call into the module
that owns it, which returns to the executor without calling another step's module:

- lease: the executor itself (the pool is not in ``remote/``);
- fork / send RUN: ``worker_host`` (``ForkedBoxes.fork``, ``run_in``): every boxed test runs in a
  fork of a warm interpreter, fresh or in place, whose messages come on its socket;
- drain: ``transport.drain`` (reading and bounding the box's messages);
- end: ``worker_host`` (``ForkedBoxes.end``: kill or reap the box, its exit, its log);
- report: ``reports.finish`` (the complete reports for what the box said and how it ended);
- and, where a warm interpreter set fixtures up for its forks, their teardown at the last test
  that can use them: ``worker_host`` (``TEARDOWN_SHARED``) and ``transport`` (the box's report rebuilt).

Measured in real sub-runs (namespace runtime): a profile hook (``sys.setprofile``) on the host's
thread, installed around ``BoxedExecutor.run_protocol`` by the project's conftest, writes down
which module of ``remote/`` runs (the innermost frame of one of them), a new entry each time that
module changes.  Each scope and mode the executor serves is run: test scope (forked boxes, one
made ahead), module scope (one forked box for a module's tests), ``--boxlite-fresh=boot`` (an
in-place fork of a leased box's warm interpreter per test), ``--boxlite-scope=worker`` (the whole
session runs in one box: no item passes through the executor), and a boxed test that takes
``boxlite_sandbox`` (it runs on the host: none either).
"""

from __future__ import annotations

import itertools
import json
import textwrap
from pathlib import Path

import pytest
from subruns import SubRun, sub_env

from pytest_boxlite import ledger

pytestmark = pytest.mark.timeout(240)

#: Installed on the host only (the box's pytest loads the same conftest): records, per item that
#: ``run_protocol`` runs, the sequence of ``remote/`` modules it passed through.
CONFTEST = '''
import json
import os
import sys
from pathlib import Path

import pytest

PATHS = {}

if os.environ.get("PYTEST_BOXLITE_GUEST") != "1":
    import pytest_boxlite.remote as remote
    from pytest_boxlite.remote import executor

    REMOTE = str(Path(remote.__file__).parent) + os.sep

    def _owner(frame):
        """The innermost frame of remote/: its module (its file's stem) and function, or None."""
        while frame is not None:
            code = frame.f_code
            if code.co_filename.startswith(REMOTE):
                module = code.co_filename[len(REMOTE):].rsplit(".", 1)[0]
                return module, getattr(code, "co_qualname", code.co_name)
            frame = frame.f_back
        return None

    _run_protocol = executor.BoxedExecutor.run_protocol

    def run_protocol(self, item, *args, **kwargs):
        seen = []

        def profile(frame, event, arg):
            if event == "call":
                owner = _owner(frame)
            elif event == "return":
                owner = _owner(frame.f_back)
            else:
                return
            # A stay: one module, named with the function it was entered by.
            if owner is not None and (not seen or seen[-1].split(":")[0] != owner[0]):
                seen.append(":".join(owner))

        sys.setprofile(profile)
        try:
            return _run_protocol(self, item, *args, **kwargs)
        finally:
            sys.setprofile(None)
            PATHS[item.nodeid] = seen

    executor.BoxedExecutor.run_protocol = run_protocol
    Path(os.environ["ITEM_PATH_OUT"]).write_text("{}")  # a host that runs no item writes none

    def pytest_sessionfinish(session):
        Path(os.environ["ITEM_PATH_OUT"]).write_text(json.dumps(PATHS))
'''

TESTS = """
import os

import pytest

pytestmark = pytest.mark.boxlite


def test_one():
    pass


def test_two():
    pass


def test_fails():
    assert False, "as it should"


"""
#: The box's test process ends without a word: the host ends the box and says how.  Not under
#: --boxlite-scope=worker: there the whole session would end with it.
DIES = """

def test_dies():
    os._exit(3)
"""

SANDBOX = """
def test_leases(boxlite_sandbox):
    assert boxlite_sandbox.name
"""

#: What a fork step reads of the box's stream as the box connects: its TOKEN, through transport's
#: ForkStream (the fork stream's frame bound lives there). Whether it happens in a test's own step
#: depends on when its box connects (a box made ahead may have connected during an earlier one).
HANDSHAKE = ("ForkStream.", "__init__", "messages")  # qualnames; function names before Python 3.11
#: The modules that own the steps of a boxed item's run.
E, W, T, R = "executor", "worker_host", "transport", "reports"
OWNERS = (E, W, T, R)
#: The warm interpreters' lifecycle (``remote/warm.py``): no step of its own.  It is reached within
#: a ``worker_host`` step (a fork asks for its warm interpreter, an end kills a broken box), or by
#: the pool as a lease boots a box (its hook starts the box's warm interpreter: :data:`WARM_BOOT`).
WARM = "warm"
WARM_BOOT = "warm:WarmInterpreters.start"


def warm_only_within_forks(path: list[str]) -> None:
    """Every stay in :data:`WARM` but a box's boot is entered from ``worker_host`` and returns to
    it: the executor never reaches the warm interpreters directly on an item's path."""
    mods = [stay.partition(":")[0] for stay in path]
    for i, module in enumerate(mods):
        if module == WARM and path[i] != WARM_BOOT:
            assert 0 < i < len(mods) - 1 and mods[i - 1] == W and mods[i + 1] == W, path


def modules(path: list[str]) -> list[str]:
    """The modules of a path's stays (``module:function``), as steps: a stay in a module that owns
    no step (a helper of the step's module, such as transport's debugger relay) is part of the
    step that called it, and so is a fork step's reading of its box's TOKEN through transport's
    ForkStream (between two worker_host stays)."""
    owned = [(m, entry) for m, _, entry in (stay.partition(":") for stay in path) if m in OWNERS]
    out: list[str] = []
    for i, (module, entry) in enumerate(owned):
        handshake = module == T and entry.startswith(HANDSHAKE) and 0 < i < len(owned) - 1
        if handshake and owned[i - 1][0] == W and owned[i + 1][0] == W:
            continue
        if not out or out[-1] != module:
            out.append(module)
    return out


#: The steps of a boxed item's run, in order, as the module each is owned by: lease, fork and send
#: RUN, drain, end the box, report.
RUN = [E, W, E, T, E, W, E, R, E]
#: ... then, at the last test that can use them, the warm interpreter's shared fixtures' teardown.
RUN_THEN_SHARED = [*RUN, W, E, T, E]
NODEIDS = [f"test_a.py::{name}" for name in ("test_one", "test_two", "test_fails", "test_dies")]


def item_paths(tmp_path: Path, home: Path, tag: str, *args: str, files: dict[str, str]) -> dict[str, list[str]]:
    """Run a project of ``files`` (and the recording conftest) with ``args``: each item's path."""
    proj = tmp_path / tag
    proj.mkdir()
    (proj / "conftest.py").write_text(CONFTEST)
    for name, body in files.items():
        (proj / name).write_text(textwrap.dedent(body))
    out = proj / "paths.json"
    run = SubRun(proj, home, tag, "-p", "no:randomly", "-p", "no:xdist", *args, env=sub_env(ITEM_PATH_OUT=str(out)))
    rc = run.wait(200)
    assert rc == 1, run.output  # test_fails and test_dies fail; every other test passes
    dies = "def test_dies" in files.get("test_a.py", "")
    assert f"{1 + dies} failed" in run.output and ("exited with status 3" in run.output) == dies, run.output
    assert ledger.scan(home) == [], f"boxes left behind in {home}"
    raw: dict[str, list[str]] = json.loads(out.read_text())
    for nodeid, path in raw.items():  # the measurement, for -s
        print(f"{tag} {nodeid}: {' -> '.join(path)}")
        warm_only_within_forks(path)
    return {nodeid: modules(path) for nodeid, path in raw.items()}


def steps_only(path: list[str]) -> None:
    """Every stay outside the executor is one step: it returns to the executor, never to another
    step's module (no step calls another, nor back into the one that called it)."""
    assert path[0] == E and path[-1] == E, path
    assert all(a == E or b == E for a, b in itertools.pairwise(path)), path


def test_test_scope_forked_boxes(tmp_path: Path, boxlite_home: Path) -> None:
    paths = item_paths(tmp_path, boxlite_home, "test", files={"test_a.py": TESTS + DIES})
    assert list(paths) == NODEIDS
    for path in paths.values():
        steps_only(path)
    assert [paths[n] for n in NODEIDS[:-1]] == [RUN] * 3
    # The last test: its warm interpreter tears the session's fixtures down after it.
    assert paths["test_a.py::test_dies"] == RUN_THEN_SHARED


def test_module_scope_one_box_per_module(tmp_path: Path, boxlite_home: Path) -> None:
    paths = item_paths(tmp_path, boxlite_home, "module", "--boxlite-scope=module", files={"test_a.py": TESTS + DIES})
    assert list(paths) == NODEIDS
    for path in paths.values():
        steps_only(path)
    # The module's box sets its fixtures up itself: nothing shared to tear down.  Its next test is
    # sent its RUN (worker_host) once the one before has its reports, in the run of the one before,
    # except for the module's last test, which is started in its turn.
    one, two, fails, dies = (paths[n] for n in NODEIDS)
    assert one == [*RUN, W, E]
    assert two == [E, *RUN[3:], W, E]
    assert fails == [E, *RUN[3:]]
    assert dies == RUN


def test_boot_fresh_leased_boxes(tmp_path: Path, boxlite_home: Path) -> None:
    # One data path: a booted box's test runs in an in-place fork of its warm interpreter, the same
    # steps as a forked box's (no step of its own for the execnet channel).
    paths = item_paths(tmp_path, boxlite_home, "boot", "--boxlite-fresh=boot", files={"test_a.py": TESTS + DIES})
    assert list(paths) == NODEIDS
    for path in paths.values():
        steps_only(path)
        assert path == RUN


def test_worker_scope_and_sandbox_tests_do_not_pass_through_the_executor(tmp_path: Path, boxlite_home: Path) -> None:
    # The whole session runs in one box: its own pytest runs the items, the host none.
    assert item_paths(tmp_path, boxlite_home, "worker", "--boxlite-scope=worker", files={"test_a.py": TESTS}) == {}
    # Under --boxlite, a test that leases a sandbox runs on the host, as a local test does.
    files = {"test_a.py": TESTS + DIES, "test_sb.py": SANDBOX}
    paths = item_paths(tmp_path, boxlite_home, "sandbox", "--boxlite", files=files)
    assert list(paths) == NODEIDS, paths
