"""Plugin matrix and fidelity core (issue 11): the same small projects run plain and boxed must agree.

Tier marker ``plugins``; run it in a virtual environment of its own with ``pip install -e '.[test,matrix]'``::

    python -m pytest tests/test_plugin_matrix.py -m plugins -p no:randomly -p no:asyncio

(in this project's own session pytest-randomly would reorder it, and pytest-asyncio's start-up deprecation
warning is an error under our ``filterwarnings``; the sub-runs get both plugins as a user would).  Checks
of a plugin of the ``matrix`` extra skip, with the install hint, where it is missing.

Every check is a real ``python -m pytest`` subprocess in a ``pytester`` directory: once plain (the plugin
installed, not asked to box) and once per boxed mode (``--boxlite``, where cheap also
``--boxlite --boxlite-scope=module``), with real namespace boxes and a private ``--boxlite-home`` that must
be empty afterwards.  Per-test outcomes come from ``--junitxml`` (written by the host), and what a plugin
makes visible (coverage total, rerun count, report file, random seed) is compared between the runs.

Checks that fail on the current plugin are marked ``xfail(strict=True, reason="issue 11: ...")``: the
tier stays green, and each one turns into a failure the moment its cause is fixed, so that the mark is
removed with the fix.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from subruns import REAL_DATA_HOME

from pytest_boxlite import ledger

pytestmark = [pytest.mark.plugins, pytest.mark.timeout(240)]

#: pytest-randomly reorders and reseeds every sub-run it is not told to stay out of.
NO_RANDOMLY = ("-p", "no:randomly")
#: Boxed modes compared with the plain run; module scope where a project has several tests per module.
BOXED = ("--boxlite",)
MODULE = ("--boxlite", "--boxlite-scope=module")
SUB_TIMEOUT = 150.0
try:
    import pytest_asyncio  # type: ignore[import-not-found, unused-ignore]  # noqa: F401

    #: Without it pytest-asyncio warns at every start (its deprecation of an unset loop scope).
    ASYNCIO_QUIET: tuple[str, ...] = ("-o", "asyncio_default_fixture_loop_scope=function")
except ImportError:
    ASYNCIO_QUIET = ()
#: pytest-rerunfailures' xdist workers dial the controller over TCP; only the check about that keeps it.
NO_RERUNS = ("-p", "no:rerunfailures")
BOOTED = re.compile(r"boxes booted (\d+)")


def xfail11(why: str) -> pytest.MarkDecorator:
    """A check that fails on the current plugin: strict, so that a fix turns it into a failure."""
    return pytest.mark.xfail(strict=True, reason=f"issue 11: {why}")


def need(module: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed: pip install -e '.[matrix]'")


class Run:
    """One finished sub-run: exit status, output, and per-test outcomes from its junit XML."""

    def __init__(self, proc: subprocess.CompletedProcess[str], xml: Path) -> None:
        self.ret = proc.returncode
        self.output = proc.stdout
        self.cases: dict[str, list[str]] = {}
        self.order: list[str] = []
        self.props: dict[str, dict[str, str]] = {}
        self.messages: dict[str, str] = {}
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                key = f"{case.get('classname')}::{case.get('name')}"
                outcome, msg = "passed", ""
                for child in case:
                    if child.tag in ("failure", "error"):
                        outcome, msg = ("failed" if child.tag == "failure" else "error"), child.get("message") or ""
                    elif child.tag == "skipped":
                        outcome = "xfail" if child.get("type") == "pytest.xfail" else "skipped"
                        msg = child.get("message") or ""
                    elif child.tag == "properties":
                        self.props[key] = {p.get("name", ""): p.get("value", "") for p in child}
                self.cases.setdefault(key, []).append(outcome)
                self.messages.setdefault(key, msg)
                self.order.append(key)

    def outcome(self, name: str) -> list[str]:
        """Outcomes of the one test whose id ends with ``name`` (``::test_x`` or ``::test_x[1]``)."""
        hits = [k for k in self.cases if k.endswith("::" + name)]
        assert len(hits) == 1, f"{name!r}: {hits or 'not in the junit XML'}\n{self.tail()}"
        return self.cases[hits[0]]

    def prop(self, name: str, key: str) -> str:
        hits = [k for k in self.props if k.endswith("::" + name)]
        assert len(hits) == 1, f"{name!r} recorded no properties\n{self.tail()}"
        return self.props[hits[0]][key]

    def tail(self, n: int = 6000) -> str:
        return self.output[-n:]

    def summary(self) -> dict[str, int]:
        """The final ``N passed, M failed ...`` line as a dict (like ``RunResult.parseoutcomes``)."""
        for line in reversed(self.output.splitlines()):
            if re.search(r"\d+ (passed|failed|errors?|skipped|xfailed|xpassed|rerun)", line) and " in " in line:
                return {
                    ("error" if w == "errors" else w): int(n)
                    for n, w in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|rerun)", line)
                }
        return {}


class Project:
    """A ``pytester`` directory and a runner that starts ``python -m pytest`` in it, bounded."""

    def __init__(self, path: Path, home: Path) -> None:
        self.path = path
        self.home = home
        self._n = 0

    def run(self, *args: str, env: dict[str, str] | None = None, timeout: float = SUB_TIMEOUT) -> Run:
        self._n += 1
        xml = self.path / f"junit-{self._n}.xml"
        boxed = any(a.startswith("--boxlite") for a in args)
        cmd = [sys.executable, "-m", "pytest", *NO_RANDOMLY, *ASYNCIO_QUIET, f"--junitxml={xml}", "-rA", *args]
        if boxed:
            cmd.append(f"--boxlite-home={self.home}")
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONHASHSEED"))}
        full_env["XDG_DATA_HOME"] = REAL_DATA_HOME
        full_env.update(env or {})
        try:
            proc = subprocess.run(
                cmd,
                cwd=self.path,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            pytest.fail(f"sub-run {' '.join(cmd[3:])} ran over {timeout} s:\n{out[-4000:]}")
        assert ledger.scan(self.home) == [], f"boxes left behind in {self.home}\n{proc.stdout[-4000:]}"
        return Run(proc, xml)

    def files(self, **files: str) -> None:
        for name, text in files.items():
            p = self.path / (name if "." in name else name + ".py")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(textwrap.dedent(text))


@pytest.fixture
def proj(
    pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Project:
    """A fresh project directory; sub-runs use the user's default temp root, as a user's run would."""
    monkeypatch.delenv("PYTEST_DEBUG_TEMPROOT", raising=False)
    return Project(pytester.path, tmp_path_factory.mktemp("bxh"))


def same_outcomes(plain: Run, boxed: Run) -> None:
    assert plain.cases, f"the plain run reported no test\n{plain.tail()}"
    assert boxed.cases == plain.cases, f"plain {plain.cases}\nboxed {boxed.cases}\n{boxed.tail()}"


def booted(run: Run) -> int:
    return sum(int(n) for n in BOOTED.findall(run.output))


# --------------------------------------------------------------------------
# the plugin matrix

TIMEOUT_TESTS = """
    import time

    def test_slow():
        time.sleep(5)

    def test_fast():
        pass
"""


@pytest.mark.parametrize("mode", [pytest.param(BOXED, id="boxed")])
def test_pytest_timeout(proj: Project, mode: tuple[str, ...]) -> None:
    """``--timeout=1`` fails a 5 s test plain, and boxed."""
    need("pytest_timeout")
    proj.files(test_t=TIMEOUT_TESTS)
    plain = proj.run("--timeout=1")
    assert plain.outcome("test_slow") == ["failed"] and "Timeout" in plain.messages["test_t::test_slow"], plain.tail()
    boxed = proj.run("--timeout=1", *mode)
    same_outcomes(plain, boxed)
    assert "Timeout" in boxed.messages["test_t::test_slow"], boxed.tail()


ASYNC_TESTS = """
    import asyncio

    async def test_async_sleep():
        await asyncio.sleep(0.01)
        assert asyncio.get_running_loop() is not None

    async def test_async_fails():
        await asyncio.sleep(0)
        assert 1 == 2
"""


@pytest.mark.parametrize("mode", [pytest.param(BOXED, id="boxed")])
def test_pytest_asyncio_auto_mode(proj: Project, mode: tuple[str, ...]) -> None:
    """``--asyncio-mode=auto`` runs unmarked async tests: one passes, one fails, plain and boxed."""
    need("pytest_asyncio")
    proj.files(test_a=ASYNC_TESTS)
    plain = proj.run("--asyncio-mode=auto")
    assert plain.outcome("test_async_sleep") == ["passed"], plain.tail()
    assert plain.outcome("test_async_fails") == ["failed"], plain.tail()
    boxed = proj.run("--asyncio-mode=auto", *mode)
    same_outcomes(plain, boxed)


RERUN_TESTS = """
    CALLS = {"flaky": 0}

    def test_always_fails():
        assert False, "fails every time"

    def test_flaky():
        # State of the test process, as in the usual flaky test: passes the second time it runs there.
        CALLS["flaky"] += 1
        assert CALLS["flaky"] >= 2

    def test_ok():
        pass
"""


def test_rerunfailures_worker_scope_needs_network(proj: Project) -> None:
    """Worker boxes without network cannot reach the controller that rerunfailures' workers dial:
    the run stops at once with a usage error naming the fix, not an INTERNALERROR per worker."""
    need("pytest_rerunfailures")
    proj.files(test_r=RERUN_TESTS)
    run = proj.run("--boxlite-scope=worker", "-n", "2")
    assert "--boxlite-network=on" in run.tail() and "rerunfailures" in run.tail(), run.tail()
    assert "INTERNALERROR" not in run.tail(), run.tail()


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(BOXED, id="boxed"),
        pytest.param(MODULE, id="module"),
        # Its xdist workers dial the controller over 127.0.0.1: worker boxes need the host's network
        # (without it the run stops with a usage error: test_rerunfailures_worker_scope_needs_network).
        pytest.param(("--boxlite-scope=worker", "--boxlite-network=on", "-n", "2"), id="worker-n2"),
    ],
)
def test_pytest_rerunfailures(proj: Project, mode: tuple[str, ...]) -> None:
    """``--reruns 2``: a failing test runs three times, a flaky one passes on its rerun, plain and boxed.

    With pytest-xdist active, pytest-rerunfailures' workers open a TCP connection to the controller at
    start-up, whether or not ``--reruns`` is given: in worker scope that connection starts in the box.
    """
    need("pytest_rerunfailures")
    proj.files(test_r=RERUN_TESTS)
    plain = proj.run("--reruns", "2", *(("-n", "2") if "-n" in mode else ()))
    assert plain.summary() == {"failed": 1, "passed": 2, "rerun": 3}, plain.tail()
    boxed = proj.run("--reruns", "2", *mode)
    assert boxed.summary() == plain.summary(), boxed.tail()
    assert boxed.outcome("test_always_fails")[-1] == "failed", boxed.tail()
    assert boxed.outcome("test_flaky")[-1] == "passed", boxed.tail()


COV_PKG = """
    def covered(x):
        if x > 0:
            return "pos"
        return "neg"

    def uncovered(x):
        y = x * 2
        z = y + 1
        return z
"""
COV_TESTS = """
    import mypkg

    def test_pos():
        assert mypkg.covered(1) == "pos"
"""
COV_TOTAL = re.compile(r"^TOTAL\s+\d+\s+\d+\s+(\d+)%", re.M)


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(BOXED, id="boxed"),
        pytest.param(("--boxlite", "-n", "2"), id="boxed-n2"),
    ],
)
def test_pytest_cov_total(proj: Project, mode: tuple[str, ...]) -> None:
    """``--cov=mypkg``: the TOTAL line is the same plain and boxed (with and without ``-n 2``)."""
    need("pytest_cov")
    proj.files(**{"mypkg/__init__.py": COV_PKG, "test_c.py": COV_TESTS})
    args = ("--cov=mypkg", "--cov-report=term")
    plain = proj.run(*args)
    total = COV_TOTAL.search(plain.output)
    assert total, plain.tail()
    assert 40 <= int(total.group(1)) < 100, plain.tail()
    boxed = proj.run(*args, *mode)
    same_outcomes(plain, boxed)
    btotal = COV_TOTAL.search(boxed.output)
    assert btotal and btotal.group(1) == total.group(1), boxed.tail()


MOCK_TESTS = """
    import os

    def test_patch(mocker):
        m = mocker.patch("os.getcwd", return_value="/nowhere")
        assert os.getcwd() == "/nowhere"
        m.assert_called_once_with()

    def test_spy(mocker):
        spy = mocker.spy(os.path, "join")
        os.path.join("a", "b")
        assert spy.call_count == 1 and spy.spy_return == os.path.join("a", "b")

    def test_stub_fails(mocker):
        stub = mocker.stub(name="s")
        stub.assert_called_once()
"""


@pytest.mark.parametrize("mode", [pytest.param(BOXED, id="boxed"), pytest.param(MODULE, id="module")])
def test_pytest_mock(proj: Project, mode: tuple[str, ...]) -> None:
    """``mocker`` patch, spy and a failing stub assertion: same outcomes plain and boxed."""
    need("pytest_mock")
    proj.files(test_m=MOCK_TESTS)
    plain = proj.run()
    assert plain.outcome("test_stub_fails") == ["failed"] and plain.outcome("test_patch") == ["passed"], plain.tail()
    same_outcomes(plain, proj.run(*mode))


HYPOTHESIS_TESTS = """
    from hypothesis import given, settings, strategies as st

    @settings(derandomize=False, max_examples=200)
    @given(st.integers())
    def test_finds_counterexample(x):
        assert x < 1000

    @given(st.lists(st.integers()))
    def test_sorted_idempotent(xs):
        assert sorted(sorted(xs)) == sorted(xs)
"""


def hypothesis_examples(root: Path) -> list[Path]:
    d = root / ".hypothesis" / "examples"
    return [p for p in d.rglob("*") if p.is_file()] if d.is_dir() else []


@pytest.mark.parametrize("mode", [pytest.param(BOXED, id="boxed")])
def test_hypothesis_outcomes(proj: Project, mode: tuple[str, ...]) -> None:
    """A property with a counterexample fails, one without passes, plain and boxed."""
    need("hypothesis")
    proj.files(test_h=HYPOTHESIS_TESTS)
    plain = proj.run()
    assert plain.outcome("test_finds_counterexample") == ["failed"], plain.tail()
    # Hypothesis shrinks the counterexample to the boundary and prints it.
    assert re.search(r"x\s*=\s*1000\b", plain.output), plain.tail()
    boxed = proj.run(*mode)
    same_outcomes(plain, boxed)
    assert re.search(r"x\s*=\s*1000\b", boxed.output), boxed.tail()


@pytest.mark.parametrize(
    "mode",
    [pytest.param(BOXED, id="boxed")],
)
def test_hypothesis_database(proj: Project, mode: tuple[str, ...]) -> None:
    """The failing example is saved in the project's ``.hypothesis`` database by a boxed run too."""
    need("hypothesis")
    proj.files(test_h=HYPOTHESIS_TESTS)
    # Under CI (``CI`` and similar variables set) hypothesis loads its "ci" profile, which has no
    # database; the default profile, chosen explicitly, keeps one wherever this suite runs.
    args = ("-k", "counterexample", "--hypothesis-profile=default")
    plain = proj.run(*args)
    assert hypothesis_examples(proj.path), f"plain run saved no example\n{plain.tail()}"
    shutil.rmtree(proj.path / ".hypothesis")
    boxed = proj.run(*args, *mode)
    assert boxed.outcome("test_finds_counterexample") == ["failed"], boxed.tail()
    assert hypothesis_examples(proj.path), f"boxed run saved no example\n{boxed.tail()}"


RANDOMLY_TESTS = """
    import random

    def test_a(record_property):
        record_property("r", repr(random.random()))

    def test_b(record_property):
        record_property("r", repr(random.random()))

    def test_c(record_property):
        record_property("r", repr(random.random()))

    def test_d(record_property):
        record_property("r", repr(random.random()))
"""


@pytest.mark.parametrize("mode", [pytest.param(BOXED, id="boxed")])
def test_pytest_randomly_seed(proj: Project, mode: tuple[str, ...]) -> None:
    """``-p randomly --randomly-seed=1234``: same test order and same ``random.random()`` per test."""
    need("pytest_randomly")
    proj.files(test_rnd=RANDOMLY_TESTS)
    args = ("-p", "randomly", "--randomly-seed=1234")
    plain = proj.run(*args)
    again = proj.run(*args)
    values = {k: plain.prop(k.split("::")[-1], "r") for k in plain.cases}
    assert values == {k: again.prop(k.split("::")[-1], "r") for k in again.cases}, "randomly is not deterministic"
    boxed = proj.run(*args, *mode)
    same_outcomes(plain, boxed)
    assert boxed.order == plain.order, (plain.order, boxed.order)
    assert {k: boxed.prop(k.split("::")[-1], "r") for k in boxed.cases} == values, boxed.tail()


HTML_TESTS = """
    def test_html_ok():
        print("stdout-of-html-ok")

    def test_html_bad():
        assert 1 == 2, "html-bad-message"
"""


@pytest.mark.parametrize("mode", [pytest.param(BOXED, id="boxed")])
def test_pytest_html_report(proj: Project, mode: tuple[str, ...]) -> None:
    """``--html``: the report names both tests, their outcomes, the failure message and captured output."""
    need("pytest_html")
    proj.files(test_html=HTML_TESTS)

    def facts(run: Run, report: Path) -> dict[str, object]:
        text = report.read_text()
        data = re.search(r'data-jsonblob="([^"]*)"', text)
        assert data, f"no data blob in {report}\n{run.tail()}"
        blob = json.loads(html.unescape(data.group(1)))
        tests = {k.split("::")[-1]: [r["result"] for r in v] for k, v in blob["tests"].items()}
        return {
            "tests": tests,
            "message": "html-bad-message" in text,
            "captured": "stdout-of-html-ok" in text,
        }

    plain = proj.run("--html=plain.html", "--self-contained-html")
    want = facts(plain, proj.path / "plain.html")
    assert want == {
        "tests": {"test_html_ok": ["Passed"], "test_html_bad": ["Failed"]},
        "message": True,
        "captured": True,
    }, want
    boxed = proj.run("--html=boxed.html", "--self-contained-html", *mode)
    same_outcomes(plain, boxed)
    assert facts(boxed, proj.path / "boxed.html") == want


XDIST_TESTS = """
    import pytest

    @pytest.mark.parametrize("i", range(6))
    def test_worker(i, worker_id, record_property):
        record_property("worker", worker_id)
        assert i != 4
"""


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(("--boxlite", "-n", "2"), id="boxed-n2"),
        pytest.param(("--boxlite-scope=worker", "-n", "2"), id="worker-n2"),
    ],
)
def test_pytest_xdist(proj: Project, mode: tuple[str, ...]) -> None:
    """``-n 2``: same outcomes plain and boxed; boxed tests see their worker's id."""
    need("xdist")
    proj.files(test_x=XDIST_TESTS)
    plain = proj.run("-n", "2", *NO_RERUNS)
    assert plain.summary() == {"passed": 5, "failed": 1}, plain.tail()
    assert {plain.prop(k.split("::")[-1], "worker") for k in plain.cases} <= {"gw0", "gw1"}, plain.tail()
    boxed = proj.run(*mode, *NO_RERUNS)
    same_outcomes(plain, boxed)
    assert {boxed.prop(k.split("::")[-1], "worker") for k in boxed.cases} <= {"gw0", "gw1"}, boxed.tail()


# --------------------------------------------------------------------------
# fidelity core: one project, run plain, boxed and in module scope; each test checks one behaviour

CORE_CONFTEST = """
    def pytest_addoption(parser):
        parser.addoption("--myopt", default="unset")
"""
SUB_CONFTEST = """
    import pytest

    @pytest.fixture
    def subfix():
        return "from-sub-conftest"
"""
SUB_TEST = """
    def test_uses_subfix(subfix):
        assert subfix == "from-sub-conftest"
"""
CORE_TESTS = """
    import os
    import platform
    import signal
    import socket
    import sys
    import uuid
    import warnings

    import pytest

    def test_myopt(pytestconfig):
        assert pytestconfig.getoption("--myopt") == "given"

    def test_hashseed():
        assert os.environ.get("PYTHONHASHSEED") == "123"
        assert str(hash("pbx-hash")) == os.environ["PBX_EXPECTED_HASH"]

    def test_node():
        assert platform.node() == socket.gethostname()

    def test_not_pid1():
        assert os.getpid() != 1 and os.getppid() != 0

    def test_own_threads():
        import threading

        # Other plugins may start threads of their own (locally too); the box's are never listed.
        assert [t.name for t in threading.enumerate() if "boxlite" in t.name] == []

    def test_orphan_is_reaped():
        import subprocess
        import time

        # A grandchild whose parent has exited ends as an orphan: an init reaps it, so it is gone.
        out = subprocess.run(["sh", "-c", "sleep 0.2 & echo $!"], capture_output=True, text=True, check=True)
        orphan = int(out.stdout)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(orphan, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        raise AssertionError("the orphan %d was never reaped" % orphan)

    def test_warns():
        warnings.warn(UserWarning("pbx-warning-marker"))

    def test_cache(cache):
        cache.set("pbx/written", 42)
        assert cache.get("pbx/written", None) == 42

    def test_sigkill_self():
        os.kill(os.getpid(), signal.SIGKILL)

    @pytest.fixture(scope="module")
    def modfix():
        return uuid.uuid4().hex

    def test_mod_1(modfix, record_property):
        record_property("modfix", modfix)

    def test_mod_2(modfix, record_property):
        record_property("modfix", modfix)

    def test_mod_3(modfix, record_property):
        record_property("modfix", modfix)
"""
#: In a module of its own: in module scope, its collection failure poisons every test of its module.
GEN_TESTS = """
    import pytest

    @pytest.mark.parametrize("x", (i for i in range(3)))
    def test_generator_param(x):
        assert x in (0, 1, 2)

    def test_gen_neighbour():
        pass
"""
CRASH = "test_core.py::test_sigkill_self"


def expected_hash() -> str:
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run(
        [sys.executable, "-c", "print(hash('pbx-hash'))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return out.stdout.strip()


@pytest.fixture(scope="module")
def core_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Run, Path]]]:
    """The core project run plain, ``--boxlite`` and ``--boxlite --boxlite-scope=module`` (once per module).

    The self-killing test would end the whole plain session (that is what it does locally), so the plain
    and module runs deselect it; only the fork-per-test run includes it, where it must be reported as
    crashed.  Yields ``{mode: (run, project dir)}``, each mode in a project directory of its own.
    """
    expected = expected_hash()
    mp = pytest.MonkeyPatch()
    mp.delenv("PYTEST_DEBUG_TEMPROOT", raising=False)
    out: dict[str, tuple[Run, Path]] = {}
    try:
        for mode, args in (
            ("plain", ("--deselect", CRASH)),
            ("boxed", BOXED),
            ("module", (*MODULE, "--deselect", CRASH)),
        ):
            d = tmp_path_factory.mktemp(f"core-{mode}")
            for name, text in {
                "conftest.py": CORE_CONFTEST,
                "sub/conftest.py": SUB_CONFTEST,
                "sub/test_sub_a.py": SUB_TEST,
                "sub/test_sub_b.py": SUB_TEST,
                "test_core.py": CORE_TESTS,
                "test_gen.py": GEN_TESTS,
            }.items():
                (d / name).parent.mkdir(parents=True, exist_ok=True)
                (d / name).write_text(textwrap.dedent(text))
            runner = Project(d, tmp_path_factory.mktemp("bxh"))
            out[mode] = (
                runner.run("--myopt=given", *args, env={"PYTHONHASHSEED": "123", "PBX_EXPECTED_HASH": expected}),
                d,
            )
        yield out
    finally:
        mp.undo()


def core_check(core_runs: dict[str, tuple[Run, Path]], mode: str, test: str, want: str = "passed") -> Run:
    plain = core_runs["plain"][0]
    if test != "test_sigkill_self":
        assert plain.outcome(test) == [want], f"plain: {plain.tail()}"
    run = core_runs[mode][0]
    assert run.outcome(test) == [want], (
        f"{mode}: {run.messages.get(next((k for k in run.cases if k.endswith(test)), ''))}"
    )
    return run


def core_params(*xfail_modes: tuple[str, str]) -> pytest.MarkDecorator:
    """Parametrize over boxed and module mode; ``(mode, why)`` pairs mark one mode xfail."""
    reasons = dict(xfail_modes)
    return pytest.mark.parametrize(
        "mode",
        [pytest.param(m, id=m, marks=[xfail11(reasons[m])] if m in reasons else []) for m in ("boxed", "module")],
    )


@core_params()
def test_conftest_option_reaches_boxed_test(core_runs: dict[str, tuple[Run, Path]], mode: str) -> None:
    """``--myopt=given`` (a conftest ``addoption``) is what a boxed test's ``getoption`` returns."""
    core_check(core_runs, mode, "test_myopt")


@core_params()
def test_pythonhashseed_acts(core_runs: dict[str, tuple[Run, Path]], mode: str) -> None:
    """``PYTHONHASHSEED=123`` gives a boxed test the same ``hash()`` as a local one."""
    core_check(core_runs, mode, "test_hashseed")


@core_params()
def test_platform_node_is_hostname(core_runs: dict[str, tuple[Run, Path]], mode: str) -> None:
    """``platform.node() == socket.gethostname()`` inside a box."""
    core_check(core_runs, mode, "test_node")


@core_params()
def test_test_process_is_not_pid1(core_runs: dict[str, tuple[Run, Path]], mode: str) -> None:
    """A boxed test's process is not pid 1 and has a parent."""
    core_check(core_runs, mode, "test_not_pid1")


@core_params()
def test_boxed_test_sees_only_its_own_threads(core_runs: dict[str, tuple[Run, Path]], mode: str) -> None:
    """``threading.enumerate()`` in a boxed test with a timeout lists no thread of the box's (the
    one that watches the timeout is none of the test's), as locally."""
    core_check(core_runs, mode, "test_own_threads")


@core_params()
def test_boxed_test_s_orphans_are_reaped(core_runs: dict[str, tuple[Run, Path]], mode: str) -> None:
    """A process a boxed test left as an orphan is reaped when it ends (by the box's pid 1), as
    an init reaps it locally: it does not stay a zombie the test can still signal."""
    core_check(core_runs, mode, "test_orphan_is_reaped")


@core_params()
def test_cache_fixture_and_merge(core_runs: dict[str, tuple[Run, Path]], mode: str) -> None:
    """The ``cache`` fixture works in a box and what it sets reaches the host's ``.pytest_cache``."""
    core_check(core_runs, mode, "test_cache")
    plain_dir, mode_dir = core_runs["plain"][1], core_runs[mode][1]
    assert (plain_dir / ".pytest_cache" / "v" / "pbx" / "written").read_text().strip() == "42"
    assert (mode_dir / ".pytest_cache" / "v" / "pbx" / "written").read_text().strip() == "42"


@core_params()
def test_warnings_summary(core_runs: dict[str, tuple[Run, Path]], mode: str) -> None:
    """A boxed test's ``warnings.warn`` appears in the warnings summary, as locally."""
    plain = core_check(core_runs, "plain", "test_warns")
    assert "pbx-warning-marker" in plain.output, plain.tail()
    run = core_check(core_runs, mode, "test_warns")
    assert "warnings summary" in run.output and "pbx-warning-marker" in run.output, run.tail()


@core_params()
def test_generator_parametrize(core_runs: dict[str, tuple[Run, Path]], mode: str) -> None:
    """``parametrize("x", <generator>)``: all three cases pass boxed."""
    for i in range(3):
        core_check(core_runs, mode, f"test_generator_param[{i}]")


@core_params()
def test_subdirectory_conftest_fixture(core_runs: dict[str, tuple[Run, Path]], mode: str) -> None:
    """A fixture of ``sub/conftest.py`` is found by the tests of both ``sub/`` modules."""
    run = core_runs[mode][0]
    plain = core_runs["plain"][0]
    subs = sorted(k for k in plain.cases if k.startswith("sub."))
    assert len(subs) == 2 and all(plain.cases[k] == ["passed"] for k in subs), plain.tail()
    assert {k: run.cases.get(k) for k in subs} == {k: ["passed"] for k in subs}, [run.messages.get(k) for k in subs]


def test_sigkill_self_is_a_crash(core_runs: dict[str, tuple[Run, Path]]) -> None:
    """``os.kill(os.getpid(), SIGKILL)`` in a boxed test: reported failed (crashed), the session goes on."""
    run = core_check(core_runs, "boxed", "test_sigkill_self", want="failed")
    assert re.search(r"crash|signal|SIGKILL|-9", run.messages[CRASH.replace(".py", "").replace("/", ".")]), run.tail()


@core_params()
def test_module_fixture_set_up_once(core_runs: dict[str, tuple[Run, Path]], mode: str) -> None:
    """A module-scoped fixture has one value for the module's three tests, plain and boxed (module
    scope shares a box; a box per test is forked from the warm interpreter that set it up once)."""
    plain = core_runs["plain"][0]
    assert len({plain.prop(f"test_mod_{i}", "modfix") for i in (1, 2, 3)}) == 1, plain.tail()
    run = core_runs[mode][0]
    values = {run.prop(f"test_mod_{i}", "modfix") for i in (1, 2, 3)}
    assert len(values) == 1, values


@core_params()
def test_core_outcomes_match_plain(core_runs: dict[str, tuple[Run, Path]], mode: str) -> None:
    """Every core test has the same outcome boxed as plain (the self-killing test aside: plain cannot run it)."""
    plain, run = core_runs["plain"][0], core_runs[mode][0]
    got = {k: v for k, v in run.cases.items() if not k.endswith("test_sigkill_self")}
    assert got == plain.cases, {k: (plain.cases.get(k), got.get(k)) for k in set(plain.cases) | set(got)}


# --------------------------------------------------------------------------
# fidelity core: separate runs

EXIT_TESTS = """
    import pytest

    def test_exits():
        pytest.exit("stop here", returncode=7)

    def test_after():
        pass
"""


@pytest.mark.parametrize("mode", [pytest.param(BOXED, id="boxed")])
def test_pytest_exit_returncode(proj: Project, mode: tuple[str, ...]) -> None:
    """``pytest.exit(returncode=7)`` in a test ends the session with status 7; the next test never runs."""
    proj.files(test_exit=EXIT_TESTS)
    plain = proj.run()
    assert plain.ret == 7 and "test_after" not in " ".join(plain.cases), plain.tail()
    boxed = proj.run(*mode)
    assert boxed.ret == 7, boxed.tail()
    assert not any(k.endswith("test_after") for k in boxed.cases), boxed.tail()


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("--collect-only",), id="collect-only"),
        pytest.param(("--fixtures",), id="fixtures"),
    ],
)
def test_collect_only_and_fixtures_boot_nothing(proj: Project, args: tuple[str, ...]) -> None:
    """``--boxlite --collect-only`` / ``--fixtures`` boot no box and say nothing about boxes."""
    proj.files(test_c="def test_one():\n    pass\n")
    run = proj.run("--boxlite", *args)
    assert run.ret == 0, run.tail()
    assert booted(run) == 0 and "forked" not in run.output, run.tail()
    marker = "test_one" if args == ("--collect-only",) else "tmp_path"
    assert marker in run.output, run.tail()


def test_no_boxlite_keeps_marker_registered(proj: Project) -> None:
    """``-p no:boxlite --strict-markers``: a ``@pytest.mark.boxlite`` test runs, unboxed."""
    proj.files(test_m="import pytest\n\n@pytest.mark.boxlite\ndef test_marked():\n    pass\n")
    run = proj.run("-p", "no:boxlite", "--strict-markers")
    assert run.ret == 0 and run.outcome("test_marked") == ["passed"], run.tail()


TMP_TESTS = """
    import pytest

    @pytest.mark.parametrize("i", range(4))
    def test_tmp(tmp_path, i):
        (tmp_path / "f").write_text(str(i))
        assert (tmp_path / "f").read_text() == str(i)
"""


def test_tmp_path_in_worker_scope_n2(proj: Project) -> None:
    """``--boxlite-scope=worker -n 2``: ``tmp_path`` works in every test (default temp root)."""
    need("xdist")
    proj.files(test_tmp=TMP_TESTS)
    plain = proj.run("-n", "2", *NO_RERUNS)
    assert plain.summary() == {"passed": 4}, plain.tail()
    same_outcomes(plain, proj.run("--boxlite-scope=worker", "-n", "2", *NO_RERUNS))


# --------------------------------------------------------------------------
# options of pytest itself, one project run plain and boxed with all of them

OPTS_MODULE = '''
    """A module with doctests."""

    def double(x):
        """
        >>> double(2)
        4
        """
        return 2 * x

    def wrong(x):
        """
        >>> wrong(2)
        5
        """
        return x
'''
OPTS_TESTS = """
    import logging
    import sys
    import unittest

    import pytest

    @pytest.mark.xfail(reason="expected")
    def test_xfail_runs_with_runxfail():
        assert False

    def test_info_log_captured(caplog):
        logging.getLogger("pbx").info("pbx-info-record")
        assert "pbx-info-record" in caplog.text

    def test_live_output():
        print("pbx-live-output-line")

    def test_devmode():
        assert sys.flags.dev_mode

    class TestUnit(unittest.TestCase):
        def test_ok(self):
            self.assertEqual(1 + 1, 2)

        def test_fails(self):
            self.assertEqual(1 + 1, 3)

        @unittest.skip("not today")
        def test_skipped(self):
            pass
"""
OPTS_ARGS = ("--doctest-modules", "--runxfail", "--log-level=INFO", "-s")


@pytest.fixture(scope="module")
def opts_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """The options project run plain and ``--boxlite`` with ``OPTS_ARGS`` and ``PYTHONDEVMODE=1``."""
    mp = pytest.MonkeyPatch()
    mp.delenv("PYTEST_DEBUG_TEMPROOT", raising=False)
    out: dict[str, Run] = {}
    try:
        for mode, args in (("plain", ()), ("boxed", BOXED)):
            p = Project(tmp_path_factory.mktemp(f"opts-{mode}"), tmp_path_factory.mktemp("bxh"))
            p.files(mymod=OPTS_MODULE, test_opts=OPTS_TESTS)
            out[mode] = p.run(*OPTS_ARGS, *args, env={"PYTHONDEVMODE": "1"})
        yield out
    finally:
        mp.undo()


@pytest.mark.parametrize(
    "test",
    [
        "double",  # doctest items: ids end with ::mymod.double
        "wrong",
        "test_xfail_runs_with_runxfail",
        "test_info_log_captured",
        "test_devmode",
        "test_ok",
        "test_fails",
        "test_skipped",
    ],
)
def test_pytest_options_and_items_boxed(opts_runs: dict[str, Run], test: str) -> None:
    """``--doctest-modules``, ``--runxfail``, ``--log-level=INFO``, ``PYTHONDEVMODE`` and unittest items:
    each test's outcome boxed is the plain one (which is checked against what the option means)."""
    want = {
        "double": "passed",
        "wrong": "failed",
        "test_xfail_runs_with_runxfail": "failed",
        "test_info_log_captured": "passed",
        "test_devmode": "passed",
        "test_ok": "passed",
        "test_fails": "failed",
        "test_skipped": "skipped",
    }[test]
    plain, boxed = opts_runs["plain"], opts_runs["boxed"]
    name = f"mymod.{test}" if test in ("double", "wrong") else test
    assert plain.outcome(name) == [want], plain.tail()
    assert boxed.outcome(name) == [want], boxed.messages.get(next((k for k in boxed.cases if k.endswith(name)), ""))


def test_live_output_with_s(opts_runs: dict[str, Run]) -> None:
    """Under ``-s`` a boxed test's print reaches the host's terminal."""
    assert "pbx-live-output-line" in opts_runs["plain"].output
    assert "pbx-live-output-line" in opts_runs["boxed"].output, opts_runs["boxed"].tail()


LF_TESTS = """
    def test_pass():
        pass

    def test_fail():
        assert 0
"""


@pytest.mark.parametrize("mode", [pytest.param(BOXED, id="boxed")])
def test_last_failed_after_boxed_run(proj: Project, mode: tuple[str, ...]) -> None:
    """``--lf`` after a boxed run re-runs only the test that failed in the box."""
    proj.files(test_lf=LF_TESTS)
    first = proj.run(*mode)
    assert first.summary() == {"passed": 1, "failed": 1}, first.tail()
    again = proj.run("--lf", *mode)
    assert list(again.cases) == ["test_lf::test_fail"], again.tail()
    assert again.summary() == {"failed": 1}, again.tail()


def test_pdb_without_a_terminal_ends_as_unboxed(proj: Project) -> None:
    """``--boxlite --pdb`` with stdin at EOF (no terminal): no hang, and the same as unboxed: the
    box's post-mortem debugger reads EOF, quits, the failure is reported and the session stops
    with the same status.  (Booted boxes, which get no debugger, say why in one line each:
    tests/test_fidelity_misc.py.)"""
    proj.files(test_pdb="def test_bad():\n    assert 0\n\n\ndef test_after():\n    pass\n")
    local = proj.run("--pdb", timeout=90)
    boxed = proj.run("--boxlite", "--pdb", timeout=90)
    for run in (local, boxed):
        assert run.outcome("test_bad") == ["failed"], run.tail()
        assert "Quitting debugger" in run.output, run.tail()
    assert boxed.ret == local.ret, boxed.tail()
    ran_after = [{k: v for k, v in r.cases.items() if k.endswith("::test_after")} for r in (local, boxed)]
    assert ran_after[0] == ran_after[1], boxed.tail()
    assert not [ln for ln in boxed.output.splitlines() if ln.startswith("boxlite: --pdb")], boxed.tail()


SUBTEST_TESTS = """
    import unittest

    class TestSub(unittest.TestCase):
        def test_sub_all_pass(self):
            for i in range(3):
                with self.subTest(i=i):
                    self.assertLess(i, 3)

        def test_sub_one_fails(self):
            for i in range(3):
                with self.subTest(i=i):
                    self.assertNotEqual(i, 1)

    def test_subtests_fixture(subtests):
        for i in range(2):
            with subtests.test(msg="sub", i=i):
                assert i == 0
"""


def subfailed_lines(run: Run) -> list[str]:
    """``SUBFAILED ...`` summary lines up to the message, with subtest parameters unquoted.

    pytest's own ``SubtestContext`` applies ``saferepr`` to the parameters again when a serialized
    report is read back (``_from_json`` -> ``__post_init__``), so ``(i=1)`` reads ``(i='1')`` after
    any transport: pytest-xdist shows the same.  The values themselves must agree.  The message part is
    cut to the terminal's width after the (longer) quoted form: it is compared through the junit XML.
    """
    lines = (ln for ln in run.output.splitlines() if ln.startswith("SUBFAILED"))
    return sorted(re.sub(r"='([^']*)'", r"=\1", ln.split(" - ")[0]) for ln in lines)


def final_line(run: Run) -> str:
    """The last summary line without its timing: ``3 failed, 2 passed``."""
    for line in reversed(run.output.splitlines()):
        if re.search(r"\d+ (passed|failed)", line):
            return re.sub(r" in [\d.]+s.*", "", line).strip("= ")
    return ""


@pytest.mark.skipif(not hasattr(pytest, "Subtests"), reason="subtests are part of pytest from 9.0")
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(BOXED, id="boxed"),
        pytest.param(MODULE, id="module"),
    ],
)
def test_subtests_boxed(proj: Project, mode: tuple[str, ...]) -> None:
    """unittest ``subTest`` and pytest's ``subtests`` fixture: same per-test outcomes and summary as plain."""
    proj.files(test_sub=SUBTEST_TESTS)
    plain = proj.run()
    assert plain.outcome("test_sub_all_pass")[-1] == "passed", plain.tail()
    assert "failed" in plain.outcome("test_sub_one_fails"), plain.tail()
    subfailed = subfailed_lines(plain)
    assert len(subfailed) == 2, plain.tail()
    boxed = proj.run(*mode)
    same_outcomes(plain, boxed)
    assert final_line(boxed) == final_line(plain), boxed.tail()
    assert subfailed_lines(boxed) == subfailed, (subfailed, boxed.tail())
    assert boxed.messages == plain.messages


MANY_SUBTESTS = """
    import unittest

    class TestMany(unittest.TestCase):
        def test_many_pass(self):
            for i in range(150):
                with self.subTest(i=i):
                    self.assertGreaterEqual(i, 0)

        def test_last_of_many_fails(self):
            for i in range(150):
                with self.subTest(i=i):
                    self.assertLess(i, 149)
"""


@pytest.mark.skipif(not hasattr(pytest, "Subtests"), reason="subtests are part of pytest from 9.0")
@pytest.mark.parametrize("mode", [pytest.param(BOXED, id="boxed")])
def test_many_subtests_boxed(proj: Project, mode: tuple[str, ...]) -> None:
    """150 subtests in one test: the test is still reported, and a failure in the 150th is not lost."""
    proj.files(test_many=MANY_SUBTESTS)
    plain = proj.run()
    # pytest 9.2 counts the failed subtest as the failure and both tests as passed: "1 failed, 2 passed".
    assert "1 failed" in final_line(plain) and "SUBFAILED(i=149)" in plain.output, plain.tail()
    boxed = proj.run(*mode)
    assert final_line(boxed) == final_line(plain), boxed.tail()
    assert subfailed_lines(boxed) == subfailed_lines(plain), boxed.tail()
    same_outcomes(plain, boxed)
