"""Fixture scopes around boxed tests mean what they mean locally (issue 23, items 2 and 3).

Real sub-runs of one project whose modules and classes mix tests run on the host with
``@pytest.mark.boxlite`` tests in every order.  Its session, module and class fixtures print a
line when they are set up and torn down (``SETUP mod box test_m1 <token>``), naming the side that
ran them (host or box), and every test prints the tokens it got.  A boxed test cannot write host
files: what it saw comes back in its reports' captured output, where pytest puts a fixture's output
(the setup of the first test that needed it, the teardown of the last).

Per scope of a boxed test's box (see the README's table):

- ``test`` (fork): session, package, module and class fixtures are set up once per warm
  interpreter (worker) in it, and torn down there when pytest would; each test's box is forked
  from that state: the same values, the files they made, nothing an earlier test wrote.
- ``module``: one box per module sets up the module's fixtures, session ones included.
- ``--boxlite-fresh=boot``: every box sets up what its tests need (one test per box).
- ``worker``: the whole session runs in the worker's box, as locally.

On the host, the host's own fixtures are set up and torn down exactly when pytest would, boxed
tests in between or not ("previous item was not torn down properly" was the error).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from subruns import QUIET, SubRun, sub_env

from pytest_boxlite import ledger

pytestmark = pytest.mark.timeout(240)

CONFTEST = """
import os
import uuid

import pytest

SIDE = "box" if os.environ.get("PYTEST_BOXLITE_GUEST") == "1" else "host"


def _say(what, kind, where, tok):
    print(f"{what} {kind} {SIDE} {where} {tok}")


@pytest.fixture(scope="session")
def sess(tmp_path_factory):
    tok = uuid.uuid4().hex[:8]
    made = tmp_path_factory.mktemp("sess")
    (made / "token").write_text(tok)
    _say("SETUP", "sess", "-", tok)
    yield tok, made
    _say("TEARDOWN", "sess", "-", tok)


@pytest.fixture(scope="module")
def mod(request, sess):
    tok = uuid.uuid4().hex[:8]
    where = request.module.__name__
    _say("SETUP", "mod", where, tok)
    yield tok
    _say("TEARDOWN", "mod", where, tok)
    if getattr(request.module, "FAIL_TEARDOWN", None) == SIDE:
        raise RuntimeError(f"teardown of mod failed on the {SIDE} side")


@pytest.fixture(scope="class")
def klass(request):
    tok = uuid.uuid4().hex[:8]
    where = request.cls.__name__
    _say("SETUP", "klass", where, tok)
    yield tok
    _say("TEARDOWN", "klass", where, tok)


@pytest.fixture
def use(request, sess, mod):
    stok, made = sess
    # The session fixture's files are seen: made where it ran (in the box: by its warm interpreter).
    assert (made / "token").read_text() == stok
    if SIDE == "box" and os.environ.get("FRESH_PER_TEST") == "1":
        # ... and nothing an earlier boxed test wrote there (a box per test).
        assert not (made / "by-a-test").exists(), "an earlier test's file"
        (made / "by-a-test").write_text(request.node.nodeid)
    klass = request.getfixturevalue("klass") if request.cls is not None else "-"
    print(f"USE {request.node.nodeid} {SIDE} sess={stok} mod={mod} klass={klass}")
"""

# Host and boxed tests in every order: a boxed test last in a module (the case), first,
# between host tests, last in a class followed by a host test, and a module of boxed tests only.
MODULES = {
    "test_m1": """
        import pytest

        def test_a(use): pass

        @pytest.mark.boxlite
        def test_b(use): pass

        @pytest.mark.boxlite
        def test_c(use): pass

        def test_d(use): pass

        @pytest.mark.boxlite
        def test_e(use): pass
    """,
    "test_m2": """
        import pytest

        @pytest.mark.boxlite
        def test_a(use): pass

        def test_b(use): pass
    """,
    "test_m3": """
        import pytest

        class TestC:
            def test_a(self, use): pass

            @pytest.mark.boxlite
            def test_b(self, use): pass

        def test_c(use): pass

        class TestE:
            @pytest.mark.boxlite
            def test_a(self, use): pass

            def test_b(self, use): pass
    """,
    "test_m4": """
        import pytest

        pytestmark = pytest.mark.boxlite

        def test_a(use): pass

        class TestD:
            # Asked for by name here; by request.getfixturevalue in ``use`` for the next test.
            def test_a(self, use, klass): pass

            def test_b(self, use): pass

        def test_b(use): pass
    """,
}

_EVENT = re.compile(r"^(SETUP|TEARDOWN) (sess|mod|klass) (host|box) (\S+) ([0-9a-f]{8})$", re.M)
_USE = re.compile(r"^USE (\S+) (host|box) sess=(\w+) mod=(\w+) klass=(\S+)$", re.M)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "conftest.py").write_text(CONFTEST)
    for name, body in MODULES.items():
        (proj / f"{name}.py").write_text(textwrap.dedent(body))
    return proj


def sub_run(proj: Path, home: Path, tag: str, *args: str, fresh: bool = False) -> str:
    """A real ``python -m pytest`` of the project (-rA: every test's captured output is printed).
    ``fresh``: every boxed test has a box of its own (it checks that it sees no earlier test's file)."""
    env = sub_env(FRESH_PER_TEST="1") if fresh else None
    run = SubRun(proj, home, tag, "-rA", "-p", "no:randomly", *args, env=env)
    rc = run.wait(200)
    out = run.output
    assert "previous item was not torn down properly" not in out, out
    assert rc == 0, out
    assert ledger.scan(home) == [], f"boxes left behind in {home}"
    return out


def events(out: str) -> Counter[tuple[str, str, str, str]]:
    """How often each fixture was set up / torn down: (what, kind, side, where)."""
    return Counter((what, kind, side, where) for what, kind, side, where, _ in _EVENT.findall(out))


def uses(out: str) -> dict[str, tuple[str, str, str, str]]:
    """Per test: the side it ran on and the session, module and class tokens it got."""
    found = {nodeid: (side, s, m, k) for nodeid, side, s, m, k in _USE.findall(out)}
    assert len(found) == 16, out
    return found


def balanced(counts: Counter[tuple[str, str, str, str]]) -> None:
    """Every fixture set up was torn down, as often."""
    for (what, kind, side, where), n in counts.items():
        if what == "SETUP":
            assert counts[("TEARDOWN", kind, side, where)] == n, (kind, side, where, counts)


def host_side(counts: Counter[tuple[str, str, str, str]]) -> dict[tuple[str, str, str], int]:
    return {(what, kind, where): n for (what, kind, side, where), n in counts.items() if side == "host"}


#: The host's own fixtures in every mode: what a local run of the host's tests sets up.
HOST_EXPECTED = {
    ("SETUP", "sess", "-"): 1,
    ("TEARDOWN", "sess", "-"): 1,
    **{(w, "mod", m): 1 for w in ("SETUP", "TEARDOWN") for m in ("test_m1", "test_m2", "test_m3")},
    **{(w, "klass", c): 1 for w in ("SETUP", "TEARDOWN") for c in ("TestC", "TestE")},
}


def test_default_scope_sets_wider_fixtures_up_once_and_each_side_tears_down_when_pytest_would(
    project: Path, home: Path
) -> None:
    out = sub_run(project, home, "test", fresh=True)
    counts = events(out)
    balanced(counts)
    # In the box: one warm interpreter set each fixture up once (they ran once per test before).
    box = {(what, kind, where): n for (what, kind, side, where), n in counts.items() if side == "box"}
    assert box == {
        **{(w, "sess", "-"): 1 for w in ("SETUP", "TEARDOWN")},
        **{(w, "mod", m): 1 for w in ("SETUP", "TEARDOWN") for m in ("test_m1", "test_m2", "test_m3", "test_m4")},
        **{(w, "klass", c): 1 for w in ("SETUP", "TEARDOWN") for c in ("TestC", "TestD", "TestE")},
    }, out
    assert host_side(counts) == HOST_EXPECTED, out
    found = uses(out)
    for side in ("host", "box"):
        # Every test of a side got the same session fixture, and per module the same module fixture.
        assert len({s for sd, s, _, _ in found.values() if sd == side}) == 1, (side, found)
        for module in MODULES:
            mods = {m for n, (sd, _, m, _) in found.items() if sd == side and n.startswith(module + ".py")}
            assert len(mods) <= 1, (side, module, found)
    assert found["test_m4.py::TestD::test_a"][3] == found["test_m4.py::TestD::test_b"][3]


def test_teardown_errors_go_to_the_last_test_of_the_scope_on_either_side(project: Path, home: Path) -> None:
    # test_m1 ends with a boxed test: the host's module fixture fails its teardown there; test_m2
    # ends with a host test: the box's module fixture fails its teardown there.
    m1 = project / "test_m1.py"
    m1.write_text(m1.read_text() + '\nFAIL_TEARDOWN = "host"\n')
    m2 = project / "test_m2.py"
    m2.write_text(m2.read_text() + '\nFAIL_TEARDOWN = "box"\n')
    env = sub_env(FRESH_PER_TEST="1")
    run = SubRun(project, home, "fail", "-rA", "-p", "no:randomly", "test_m1.py", "test_m2.py", env=env)
    rc = run.wait(200)
    out = run.output
    assert rc == 1, out
    assert "previous item was not torn down properly" not in out, out
    errors = re.findall(r"^ERROR (\S+) - (.*)$", out, re.M)
    assert [nodeid for nodeid, _ in errors] == ["test_m1.py::test_e", "test_m2.py::test_b"], out
    assert errors[0][1].startswith("RuntimeError: teardown of mod failed on the h"), out
    assert errors[1][1].startswith("Failed: RuntimeError: teardown of mod failed on th"), out
    # The whole error, in the report of the test it belongs to.
    assert re.search(r"_+ ERROR at teardown of test_e _+\n(.*\n)*?E +RuntimeError: .*the host side", out), out
    box_error = r"_+ ERROR at teardown of test_b _+\n(.*\n)*?E +RuntimeError: .*the box side"
    assert re.search(box_error, out), out
    assert "7 passed, 2 errors" in out, out
    assert ledger.scan(home) == []


@pytest.mark.parametrize("mode", ["module", "boot"])
def test_module_scope_and_booted_boxes_keep_the_host_exact(project: Path, home: Path, mode: str) -> None:
    args = ("--boxlite-scope=module",) if mode == "module" else ("--boxlite-fresh=boot",)
    out = sub_run(project, home, mode, *args, fresh=mode == "boot")
    counts = events(out)
    balanced(counts)
    assert host_side(counts) == HOST_EXPECTED, out
    found = uses(out)
    box_tests = [n for n, (side, *_) in found.items() if side == "box"]
    box_setups = {k: n for (what, k, side, _), n in counts.items() if side == "box" and what == "SETUP"}
    box_mods = Counter(
        where for (what, k, side, where), n in counts.items() if (what, k, side) == ("SETUP", "mod", "box")
    )
    if mode == "boot":
        # A booted box per test: each sets up what its test needs.
        assert sum(n for (w, k, s, _), n in counts.items() if (w, k, s) == ("SETUP", "sess", "box")) == len(box_tests)
    else:
        # One box per run of a module's boxed tests: module fixtures once per box.
        assert box_mods == Counter({"test_m1": 1, "test_m2": 1, "test_m3": 1, "test_m4": 1}), out
        m4 = {m for n, (side, _, m, _) in found.items() if n.startswith("test_m4.py")}
        assert len(m4) == 1, found
    assert box_setups, out


def test_xdist_workers_each_set_wider_fixtures_up_once(project: Path, home: Path) -> None:
    pytest.importorskip("xdist")
    out = sub_run(project, home, "n2", "-n", "2", "--dist=loadfile", fresh=True)
    counts = events(out)
    balanced(counts)
    found = uses(out)
    box_sessions = {s for side, s, _, _ in found.values() if side == "box"}
    setups = sum(n for (w, k, s, _), n in counts.items() if (w, k, s) == ("SETUP", "sess", "box"))
    # One warm interpreter per worker (loadfile keeps a module on one worker): at most two.
    assert 1 <= setups == len(box_sessions) <= 2, out
    for module in MODULES:
        mods = {m for n, (sd, _, m, _) in found.items() if sd == "box" and n.startswith(module + ".py")}
        assert len(mods) <= 1, (module, found)


@pytest.mark.parametrize("n", [None, "2"])
def test_worker_scope_runs_fixtures_as_locally(project: Path, home: Path, n: str | None) -> None:
    if n is not None:
        pytest.importorskip("xdist")
    args = ["--boxlite-scope=worker"] + (["-n", n, "--dist=loadfile"] if n else [])
    out = sub_run(project, home, f"worker{n}", *args)
    counts = events(out)
    balanced(counts)
    found = uses(out)
    assert {side for side, *_ in found.values()} == {"box"}, found
    sessions = {s for _, s, _, _ in found.values()}
    # The session once per worker's box; every module and class fixture once, as locally.
    assert counts[("SETUP", "sess", "box", "-")] == len(sessions) == (1 if n is None else len(sessions)) <= 2, out
    assert {(k, where): c for (w, k, _, where), c in counts.items() if w == "SETUP" and k != "sess"} == {
        **{("mod", m): 1 for m in MODULES},
        ("klass", "TestC"): 1,
        ("klass", "TestD"): 1,
        ("klass", "TestE"): 1,
    }, out


WARNING_CONFTEST = """
import warnings

import pytest


@pytest.fixture(scope="session")
def noisy():
    warnings.warn(DeprecationWarning("shown, as for the first test that used it"))
    return 1


@pytest.fixture(scope="module")
def strict():
    warnings.warn(RuntimeWarning("made an error by the ini's filterwarnings"))
    return 2
"""

WARNING_TESTS = """
import pytest

pytestmark = pytest.mark.boxlite

def test_noisy(noisy): pass

def test_noisy_again(noisy): pass

def test_strict(strict): pass
"""


def test_a_shared_fixtures_warnings_are_filtered_and_shown_as_locally(tmp_path: Path, home: Path) -> None:
    proj = tmp_path / "warn"
    proj.mkdir()
    (proj / "conftest.py").write_text(WARNING_CONFTEST)
    (proj / "test_w.py").write_text(WARNING_TESTS)
    (proj / "pytest.ini").write_text("[pytest]\nfilterwarnings =\n    error::RuntimeWarning\n")
    local = subprocess.run(
        [sys.executable, "-m", "pytest", *QUIET, "-rA", "-p", "no:randomly", "-p", "no:boxlite"],
        cwd=proj,
        env=sub_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert local.returncode == 1, local.stdout + local.stderr
    run = SubRun(proj, home, "boxed", "-rA", "-p", "no:randomly")
    assert run.wait(200) == 1, run.output
    outs = {"local": local.stdout, "boxed": run.output}
    for out in outs.values():
        assert re.search(r"^ERROR test_w.py::test_strict - RuntimeWarning: made an error", out, re.M), out
        assert re.search(r"^test_w.py::test_noisy\n +.*DeprecationWarning: shown, as for the first", out, re.M), out
        assert "1 error" in out and "2 passed" in out, out
    assert ledger.scan(home) == []


PARAM_TESTS = """
import os

import pytest

pytestmark = pytest.mark.boxlite


@pytest.fixture(scope="module", params=["a", "b"])
def letter(request):
    return request.param, os.getpid()


@pytest.fixture(scope="module")
def extra():
    return "x", os.getpid()


@pytest.fixture(scope="module")
def base(request):
    return request.param * 10, os.getpid()


# Each value was made before the box was forked (in the warm interpreter: another pid than the
# test's), with the parameter of this test.
@pytest.mark.parametrize("i", [1, 2])
def test_one(letter, i, request):
    assert letter[0] == request.node.callspec.params["letter"]
    assert letter[1] != os.getpid()


def test_two(letter, extra, request):
    assert (letter[0], extra[0]) == (request.node.callspec.params["letter"], "x")
    assert os.getpid() not in (letter[1], extra[1])


@pytest.mark.parametrize("base", [1, 2], indirect=True)
@pytest.mark.parametrize("j", [1, 2])
def test_indirect(base, j, request):
    assert base[0] == request.node.callspec.params["base"] * 10
    assert base[1] != os.getpid()
"""


def test_parametrized_module_fixtures_reach_each_box_with_their_own_parameter(tmp_path: Path, home: Path) -> None:
    # The warm interpreter sets up an item's wider fixtures before forking its box, and skips that
    # when the item before it needed the same ones with the same parameters: one parametrized
    # anew (directly or indirectly), or one more fixture, must still reach the box set up.
    proj = tmp_path / "params"
    proj.mkdir()
    (proj / "test_p.py").write_text(PARAM_TESTS)
    run = SubRun(proj, home, "boxed", "-rA", "-p", "no:randomly", "-v")
    assert run.wait(200) == 0, run.output
    assert "10 passed" in run.output, run.output
    names = ("test_one[a-1]", "test_one[b-2]", "test_two[a]", "test_two[b]", "test_indirect[1-1]", "test_indirect[2-2]")
    for name in names:
        assert re.search(rf"^PASSED test_p.py::{re.escape(name)}$", run.output, re.M), run.output
    assert ledger.scan(home) == []


TMP_PARAM_TESTS = """
import os
import shutil
import tempfile
import time

import pytest

pytestmark = pytest.mark.boxlite


@pytest.fixture(scope="module", params=["a", "b", "c"])
def data_dir(request):
    made = tempfile.mkdtemp(prefix="pbx_param_%s_" % request.param)
    with open(os.path.join(made, "token"), "w") as f:
        f.write(request.param)
    yield made, request.param
    shutil.rmtree(made)


@pytest.mark.parametrize("i", range(3))
def test_reads(data_dir, i):
    time.sleep(0.3)  # the next tests' boxes are made meanwhile
    made, param = data_dir
    with open(os.path.join(made, "token")) as f:
        assert f.read() == param
"""


def test_a_running_box_keeps_its_parametrized_fixture_while_the_next_param_is_set_up(
    tmp_path: Path, home: Path
) -> None:
    # The warm interpreter sets up the next test's wider fixtures before forking its box, while
    # the test before it runs: for another parameter of a module fixture that means tearing down
    # the one the running test uses (its files in the warm /tmp, which the box sees through).
    # Such a box is made in its turn instead.
    proj = tmp_path / "tmpparams"
    proj.mkdir()
    (proj / "test_t.py").write_text(TMP_PARAM_TESTS)
    run = SubRun(proj, home, "boxed", "-rA", "-p", "no:randomly")
    assert run.wait(200) == 0, run.output
    assert "9 passed" in run.output, run.output
    assert ledger.scan(home) == []


THREAD_CONFTEST = """
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class Hello(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"hello from the fixture's thread"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def http_server():
    # What pytest-httpserver and live_server fixtures do: a server on a thread of the session.
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    thread = threading.Thread(target=server.serve_forever, name="fixture-http", daemon=True)
    thread.start()
    yield server.server_address
    server.shutdown()
    thread.join(10)
    server.server_close()
    print("HTTP SERVER STOPPED")


@pytest.fixture(scope="module")
def greeting(http_server):
    # A wider fixture that depends on the threaded one: set up in the box with it.
    return "hello", http_server


@pytest.fixture(scope="module")
def worker_queue():
    import queue

    jobs, done = queue.Queue(), queue.Queue()

    def work():
        while (job := jobs.get()) is not None:
            done.put(job * 2)

    thread = threading.Thread(target=work, name="fixture-queue", daemon=True)
    thread.start()
    yield jobs, done
    jobs.put(None)
    thread.join(10)


@pytest.fixture(scope="module")
def plain():
    return threading.active_count()
"""

THREAD_TESTS = """
import urllib.request

import pytest

pytestmark = pytest.mark.boxlite


def get(address):
    with urllib.request.urlopen("http://%s:%d/" % address, timeout=10) as answer:
        return answer.read().decode()


def test_session_server(http_server):
    assert get(http_server) == "hello from the fixture's thread"


def test_dependent_fixture(greeting):
    word, address = greeting
    assert word in get(address)


@pytest.mark.parametrize("n", [1, 2])
def test_queue_worker(worker_queue, n):
    jobs, done = worker_queue
    jobs.put(n)
    assert done.get(timeout=10) == 2 * n


def test_plain_fixture_still_shared(plain):
    assert plain >= 1
"""


def test_a_wider_fixtures_threads_are_alive_in_each_box(tmp_path: Path, home: Path) -> None:
    """A session or module fixture that starts a thread (a server, a queue worker) is set up in
    each test's box, where the thread is alive, instead of once in the warm interpreter, whose
    forks would have no thread: the tests pass boxed as unboxed, and the summary names the
    fixtures once.  (Issue 44, fidelity 3: the forked box refused connections, the queue hung.)"""
    proj = tmp_path / "threads"
    proj.mkdir()
    (proj / "conftest.py").write_text(THREAD_CONFTEST)
    (proj / "test_t.py").write_text(THREAD_TESTS)
    local = subprocess.run(
        [sys.executable, "-m", "pytest", *QUIET, "-p", "no:randomly", "-p", "no:boxlite"],
        cwd=proj,
        env=sub_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert local.returncode == 0, local.stdout + local.stderr
    run = SubRun(proj, home, "boxed", "-rA", "-p", "no:randomly", "-W", "error")
    assert run.wait(200) == 0, run.output
    out = run.output
    assert "5 passed" in out, out
    assert ledger.scan(home) == []
    # One note for all tests concerned, naming the fixtures; the plain fixture is not named.
    notes = re.findall(r"pytest-boxlite: fixtures? ([\w, ]+) started threads", out)
    assert notes and set(", ".join(notes).split(", ")) == {"http_server", "worker_queue"}, out
    # Each box set the server up and stopped it itself (the warm interpreter's copy was ended).
    assert out.count("HTTP SERVER STOPPED") >= 2, out
