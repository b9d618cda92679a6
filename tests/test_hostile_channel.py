"""A hostile boxed test attacks the host<->guest channel of boxed tests (issue 12, item 5).

Every attack runs inside a real boxed test (``@pytest.mark.boxlite``) of a real pytest sub-run,
and writes straight onto the stream the host reads:

* fork mode (``--boxlite-scope=test``, namespace runtime): the test process holds the socket to the
  host; the attack writes raw bytes on its descriptor, or well-formed messages through the
  ``GuestPlugin`` instance's ``send`` (found with ``gc.get_objects()``);
* module scope (``--boxlite-scope=module``): the test runs in the warm interpreter that holds the
  execnet channel; the attack sends any object on that channel, or messages through ``send``;
* worker scope with xdist (``--boxlite-scope=worker -n 2``): the test runs in an xdist worker in a
  box; the attack speaks on pytest-xdist's own channel (``WorkerInteractor``).  Worker scope without
  xdist has no channel to attack: the whole session runs in the box and the host reads its exit status.

The host must bound what it reads, parse it defensively and never follow it as a path: a
malformed, oversized or foreign message fails that one test with a clear report, the session goes
on (exit status 1, never 3 / INTERNALERROR), the next test runs and passes, and nothing the guest
sends writes outside the host's intended places.  The host's peak RSS (``VmHWM``, written by the
sub-run's own conftest in ``pytest_unconfigure``) shows whether memory stayed bounded.

Where the host is wrong the test is ``xfail(strict=True)`` with the reason (none is left: xdist's
own worker channel under ``--boxlite-scope=worker -n N``, which xdist trusts, is checked by
:mod:`pytest_boxlite.xdist_guard`).  The fork-mode checks need a working per-test fork.  Sub-runs are
grouped (one per scope, plus one for each attack that stops the whole session today) so the file
stays within a few minutes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from subruns import REAL_DATA_HOME, sub_env

from pytest_boxlite import ledger

pytestmark = pytest.mark.reliability

#: Most the host pytest may hold at its peak, in KiB.  An idle host run peaks near 40 MiB; a
#: forked box's line is cut at 16 MiB (``LINE_CAP``), so bounded parsing stays far below this.
HOST_RSS_BOUND_KIB = 200 * 1024

# --------------------------------------------------------------------------------------------
# the sub-run's files

CONFTEST = """
import os
from pathlib import Path

GUEST = os.environ.get("PYTEST_BOXLITE_GUEST") == "1"

if not GUEST and os.environ.get("HOSTILE_COVERAGE"):
    # Coverage measured on the host, so the host merges what boxes send (pytest-cov does the same).
    import coverage

    _cov = coverage.Coverage(data_file=os.environ["HOSTILE_COVERAGE"], source=[os.path.dirname(__file__)])
    _cov.start()


def pytest_unconfigure(config):
    # The host's own peak RSS (not its children's): what the guest's bytes made the host hold.
    if not GUEST:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                Path(os.environ["HOSTILE_HWM"]).write_text(line.split()[1])
"""

#: Imported by nobody: if the host imports it on a guest's word, it leaves a file on the host.
CANARY = """
from pathlib import Path

Path(__file__).with_name("canary-imported").write_text("the host imported a module a guest named")


class CanaryWarning(Warning):
    pass
"""

#: The guest side (``hostile.py``): how a hostile test reaches the stream the host reads.
GUEST_HELPERS = '''
import gc
import os
import sys
import time

import pytest

from pytest_boxlite.guest import messages as m

MB = 1 << 20


def closure_cells(f):
    return dict(zip(f.__code__.co_freevars, (c.cell_contents for c in f.__closure__ or ())))


def plugin():
    found = [o for o in gc.get_objects() if type(o).__name__ == "GuestPlugin"]
    assert len(found) == 1, found
    return found[0]


def send(name, **fields):
    """A well-formed message, through the guest's own sender (JSON line or execnet)."""
    plugin().send(name, **fields)


def _transport():
    # GuestPlugin.send is a locked wrapper around the fork's JSON writer (closure ``out``) or
    # around the warm interpreter's ``channel.send`` (closure ``self``: the plugin's channel).
    cells = closure_cells(closure_cells(plugin().send)["send"])
    if "out" not in cells and "self" in cells:
        return {"channel": cells["self"].channel}
    return cells


def fork_mode():
    return "out" in _transport()


def raw(data):
    """Bytes straight onto the fork's socket, or any object onto the execnet channel."""
    t = _transport()
    if "out" in t:
        view = memoryview(data)
        fd = t["out"].fileno()
        while view:
            view = view[os.write(fd, view):]
    else:
        t["channel"].send(data)


def xdist_worker():
    """--boxlite-scope=worker -n N: pytest-xdist's worker end, which holds the channel to the controller."""
    found = [o for o in gc.get_objects() if type(o).__name__ == "WorkerInteractor"]
    assert len(found) == 1, found
    return found[0]


def report(request, **changes):
    """This test's own report, serialized by pytest, with ``changes``."""
    rep = pytest.TestReport(
        nodeid=request.node.nodeid, location=request.node.location, keywords={},
        outcome="passed", longrepr=None, when="call",
    )
    data = request.config.hook.pytest_report_to_serializable(config=request.config, report=rep)
    data.update(changes)
    return data


def next_nodeid(request):
    return request.node.nodeid + "_next"


@pytest.fixture
def done_early():
    send(m.DONE)  # before any report of this test


@pytest.fixture
def after_done(request):
    """Messages after this test's DONE, for the test that follows."""
    stale = report(request, nodeid=next_nodeid(request), outcome="failed",
                   longrepr="stale report sent after DONE by the previous test")
    if fork_mode():
        # A grandchild writes on the inherited socket once this test has ended.
        fd = _transport()["out"].fileno()
        if os.fork() == 0:
            time.sleep(1.0)
            import json
            try:
                lines = [json.dumps([m.REPORT, {"data": stale}]), json.dumps([m.DONE, {}]), ""]
                os.write(fd, "\\n".join(lines).encode())
            finally:
                os._exit(0)
        return
    p = plugin()
    own = p.send

    def send_then_more(name, **fields):
        own(name, **fields)
        if name == m.DONE:
            p.send = own
            own(m.REPORT, data=stale)
            own(m.DONE)

    p.send = send_then_more
'''

#: name -> (fixtures, guest code).  Each attack is followed by ``test_<name>_next``, which must pass.
ATTACKS: dict[str, tuple[str, str]] = {
    "garbage": ("", "raw(b'42\\n' if fork_mode() else 42)"),
    "non_json": ("", "raw(b'\\xff\\xfe{not json\\n' if fork_mode() else b'\\xff\\xfe{not json')"),
    "line_300mb": (
        "",
        """
        chunk = b"x" * MB
        if fork_mode():
            try:
                for _ in range(300):
                    raw(chunk)  # no newline, ever
            except OSError:
                pass  # the host hung up
        else:
            raw(chunk.decode() * 300)
        time.sleep(60)
        """,
    ),
    "unknown_name": ("", "send('bogus-message', x=1)"),
    "foreign_nodeid": ("request", "send(m.REPORT, data=report(request, nodeid='test_hostile.py::test_ghost'))"),
    "not_a_testreport": (
        "request",
        "send(m.REPORT, data={'$report_type': 'CollectReport', 'nodeid': request.node.nodeid, "
        "'outcome': 'passed', 'longrepr': None, 'result': [], 'sections': []})",
    ),
    "data_not_a_dict": ("", "send(m.REPORT, data='passed')"),
    "when_not_a_phase": ("request", "send(m.REPORT, data=report(request, when='collect'))"),
    "longrepr_100mb": ("request", "send(m.REPORT, data=report(request, outcome='failed', longrepr='x' * (100 * MB)))"),
    "section_100mb": (
        "request",
        "send(m.REPORT, data=report(request, sections=[('Captured stdout call', 'y' * (100 * MB))]))",
    ),
    "cache_ok": ("", "send(m.CACHE, values={'hostile/ok': 42})"),
    "cache_dotdot": ("", "send(m.CACHE, values={'../../../hostile-dotdot': 1})"),
    "cache_dotdot_inner": ("", "send(m.CACHE, values={'hostile/../../../../hostile-dotdot': 1})"),
    "cache_absolute": ("request", "send(m.CACHE, values={str(request.config.rootpath / 'hostile-absolute'): 1})"),
    "cache_nul": ("", "send(m.CACHE, values={'hostile/a\\x00b': 1})"),
    "cache_100mb": ("", "send(m.CACHE, values={'hostile/big': 'z' * (100 * MB)})"),
    "warning_not_a_warning": (
        "",
        "send(m.WARNING, message='hostile-not-a-warning', category='ValueError', module='builtins', "
        "filename='/etc/passwd', lineno='x', nodeid='test_hostile.py::test_ghost')",
    ),
    "warning_unimported_module": (
        "",
        "send(m.WARNING, message='hostile-unimported', category='CanaryWarning', module='hostile_canary', "
        "filename='x.py', lineno=1, nodeid='')",
    ),
    "output_not_text": ("", "send(m.OUTPUT, stream='stdout', text=['not', 'text'])"),
    "done_early": ("done_early", "pass"),
    "after_done": ("after_done", "pass"),
    "exit_not_int": ("", "send(m.EXIT, reason='hostile', returncode='7')"),
    "pytest_exit_7": ("", "pytest.exit('hostile exit', returncode=7)"),
    # -- what stops the whole session today: one sub-run each ---------------------------------
    "json_deep": (
        "",
        """
        if fork_mode():
            raw(b"[" * 200000 + b"\\n")
        else:
            deep = []
            for _ in range(5000):
                deep = [deep]
            sys.setrecursionlimit(50000)  # the guest's serializer recurses; the host's reader does not
            raw(deep)
        """,
    ),
    "warm_channel_from_fork": (
        "",
        """
        # The forked test still holds the warm interpreter's execnet channel (inherited fds): what it
        # sends there is read by the host as the warm interpreter's answer to its next request.
        channel = closure_cells(type(plugin()).fork)["channel"]
        channel.send("not a reply")
        """,
    ),
    "warm_forked_garbage": (
        "",
        """
        # A forged answer to the host's next FORK, its list of ended boxes full of what is no pid.
        channel = closure_cells(type(plugin()).fork)["channel"]
        channel.send((m.FORKED, {"pid": 1, "ended": [[1], {"a": 1}, "2", 10**40, 1.5, None] * 1000}))
        """,
    ),
    "xdist_foreign_nodeid": (
        "request",
        "xdist_worker().sendevent('testreport', data=report(request, nodeid='test_hostile.py::test_ghost'))",
    ),
    "xdist_unknown_event": ("", "xdist_worker().channel.send(('bogus-event', {}))"),
    # xdist's controller imports the module a worker's warning names and calls what it finds with
    # the worker's arguments: os.system would run a command on the host.
    "xdist_warning_runs_host_code": (
        "request",
        """
        data = {"message_module": "os", "message_class_name": "system",
                "message_args": ["touch " + os.environ["PBX_HOST_MARK"]], "message_str": "hostile-warning",
                "category_module": "builtins", "category_class_name": "UserWarning",
                "filename": os.environ["PBX_HOST_FILE"], "lineno": 1, "file": None, "line": None, "source": None}
        xdist_worker().sendevent("warning_recorded", warning_message_data=data, when="runtest",
                                 nodeid=request.node.nodeid, location=request.node.location)
        """,
    ),
    "xdist_skip_longrepr": (
        "request",
        "xdist_worker().sendevent('testreport', data=report(request, outcome='skipped', longrepr=['a', 'b']))",
    ),
    "done_then_linger": (
        "",
        """
        import ctypes

        # PR_SET_NAME: findable in the host's /proc, by a name no other run on the host uses.
        ctypes.CDLL(None).prctl(15, os.environ["PBX_LINGER"].encode(), 0, 0, 0)
        send(m.DONE)
        time.sleep(300)
        """,
    ),
    "cache_key_file_and_dir": ("", "send(m.CACHE, values={'hostile/f': 1, 'hostile/f/g': 2})"),
    "json_tuple_tag": ("", "raw(b'{\"__tuple__\": 5}\\n' if fork_mode() else ('report', {'data': 5}))"),
    "sections_not_pairs": ("request", "send(m.REPORT, data=report(request, sections=[1]))"),
    "user_properties_not_pairs": (
        "request",
        "send(m.REPORT, data=report(request, when='teardown', user_properties='x'))",
    ),
    "longrepr_malformed": (
        "request",
        """
        entry = {"type": "ReprEntry", "data": {"lines": 5, "reprfuncargs": None, "reprlocals": None,
                                               "reprfileloc": None, "style": "long"}}
        longrepr = {"reprcrash": {"path": "x.py", "lineno": 1, "message": "m"},
                    "reprtraceback": {"reprentries": [entry], "extraline": None, "style": "long"},
                    "sections": [], "chain": None}
        send(m.REPORT, data=report(request, outcome="failed", longrepr=longrepr))
        """,
    ),
    "duration_not_a_number": ("request", "send(m.REPORT, data=report(request, duration='slow'))"),
    "outcome_not_an_outcome": ("request", "send(m.REPORT, data=report(request, outcome='bogus'))"),
    "coverage_etc_passwd": ("", "send(m.COVERAGE, arcs=False, files={'/etc/passwd': [1]})"),
    "coverage_dotdot": (
        "request",
        "send(m.COVERAGE, arcs=False, files={str(request.config.rootpath) + '/../../../etc/hostile.py': [1]})",
    ),
    "coverage_huge_list": (
        "request",
        "send(m.COVERAGE, arcs=False, files={str(request.node.path): list(range(1, 1000001))})",
    ),
    "coverage_huge_lineno": (
        "request",
        "send(m.COVERAGE, arcs=False, files={str(request.node.path): [10 ** 30]})",
    ),
    "warning_flood": (
        "",
        "for i in range(150):\n    send(m.WARNING, message='w' * (MB - 300), category='UserWarning', "
        "module='builtins', filename='x.py', lineno=i, nodeid='')",
    ),
}


def attack_files(names: list[str]) -> dict[str, str]:
    """The sub-run's test files: one module per attack (so module scope gives each its own box), in
    order, each with the attack as a boxed test followed by a boxed test that must pass."""
    files = {}
    for i, name in enumerate(names):
        fixtures, code = ATTACKS[name]
        body = textwrap.indent(textwrap.dedent(code).strip(), "    ")
        files[f"test_hostile_{i:02d}_{name}.py"] = (
            "from hostile import *  # noqa: F403\n"
            f"\n\n@pytest.mark.boxlite\ndef test_{name}({fixtures}):\n{body}\n"
            f"\n\n@pytest.mark.boxlite\ndef test_{name}_next():\n"
            "    assert os.environ.get('PYTEST_BOXLITE_GUEST') == '1'\n"
        )
    return files


# --------------------------------------------------------------------------------------------
# running a sub-run


@dataclasses.dataclass
class Case:
    outcome: str  # passed, failed, error, skipped
    message: str


@dataclasses.dataclass
class Run:
    """One finished sub-run: its exit status, output, testcases and the host's peak RSS."""

    work: Path
    returncode: int
    output: str
    cases: dict[str, Case]
    host_rss_kib: int
    leftovers: list[ledger.Leftover]

    def case(self, name: str) -> Case:
        assert name in self.cases, f"no report at all for {name} (ran: {sorted(self.cases)})\n{self.tail()}"
        return self.cases[name]

    def tail(self) -> str:
        return self.output[-4000:]

    def contained(self, name: str, says: str | None) -> None:
        """The attack failed with a report saying ``says`` (or passed, for ``None``), the next one passed."""
        case = self.case(f"test_{name}")
        if says is None:
            assert case.outcome == "passed", f"{name}: {case.outcome}\n{case.message[-3000:]}"
        else:
            assert case.outcome in ("failed", "error"), f"{name}: {case.outcome}, expected a failure\n{self.tail()}"
            assert says in case.message, f"{name}: the report does not say {says!r}:\n{case.message[-3000:]}"
        after = self.case(f"test_{name}_next")
        assert after.outcome == "passed", f"the test after {name}: {after.outcome}\n{after.message[-3000:]}"

    def session_went_on(self) -> None:
        assert "INTERNALERROR" not in self.output, self.tail()
        assert self.returncode == pytest.ExitCode.TESTS_FAILED, f"exit status {self.returncode}\n{self.tail()}"


def junit_cases(path: Path) -> dict[str, Case]:
    if not path.exists():
        return {}
    out = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or "") + "\n" + (el.text or "")
                break
        if tc.get("name"):  # junitxml also writes an empty testcase when pytest.exit stops a session
            out[tc.get("name", "")] = Case(outcome, message)
    return out


#: An unboxed test (run without ``--boxlite``): no process named ``$PBX_LINGER`` is left on the host.
HOST_CHECK_LINGER = """
import os
import time


def comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def test_no_lingering_box_process():
    deadline = time.monotonic() + 5.0
    while True:
        left = [p for p in os.listdir("/proc") if p.isdigit() and comm(p) == os.environ["PBX_LINGER"]]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"forked boxes still running after their test ended: host pids {left}"
"""


def run_attacks(
    work: Path,
    names: list[str],
    *args: str,
    timeout: float = 240.0,
    boxlite_all: bool = True,
    extra_files: dict[str, str] | None = None,
    **env: str,
) -> Run:
    """Run ``names`` as boxed tests in a pytest sub-run of their own (``args`` add to ``--boxlite``).

    ``extra_files`` are written beside them; without ``boxlite_all`` their unmarked tests run on the host.
    """
    work.mkdir(parents=True)
    for file_name, source in (extra_files or {}).items():
        (work / file_name).write_text(source)
    (work / "conftest.py").write_text(CONFTEST)
    (work / "hostile_canary.py").write_text(CANARY)
    (work / "hostile.py").write_text(GUEST_HELPERS)
    for file_name, source in attack_files(names).items():
        (work / file_name).write_text(source)
    home, junit, log, hwm = work / "bxh", work / "junit.xml", work / "run.log", work / "hwm"
    argv = [
        sys.executable, "-m", "pytest", "-p", "no:hypothesispytest", "-p", "no:benchmark", "-p", "no:randomly",
        f"--boxlite-home={home}", *(["--boxlite"] if boxlite_all else []),
        "--boxlite-lease-timeout=60", "--boxlite-timeout=90",
        "--tb=short", "-rA", f"--junitxml={junit}", *args,
    ]  # fmt: skip
    environ = sub_env(HOSTILE_HWM=str(hwm), XDG_DATA_HOME=REAL_DATA_HOME, **env)
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, cwd=work, env=environ, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
                tail = log.read_text(errors="replace")[-4000:]
                pytest.fail(f"the sub-run did not finish within {timeout:.0f}s:\n{tail}")
        leftovers = ledger.scan(home)
    finally:
        if home.exists():  # whatever a failed sub-run left is removed
            ledger.reconcile(home, include_kept=True)
    text = log.read_text(errors="replace")
    rss = int(hwm.read_text()) if hwm.exists() else -1
    return Run(work, rc, text, junit_cases(junit), rss, leftovers)


def xfail(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=reason)


# --------------------------------------------------------------------------------------------
# fork mode (the default scope): the test process holds the socket the host reads

FORK_ATTACKS = [
    "garbage", "non_json", "line_300mb", "unknown_name", "foreign_nodeid", "not_a_testreport",
    "data_not_a_dict", "when_not_a_phase", "longrepr_100mb", "section_100mb", "cache_ok", "cache_dotdot",
    "cache_dotdot_inner", "cache_absolute", "cache_nul", "cache_100mb", "warning_not_a_warning",
    "warning_unimported_module", "output_not_text", "after_done", "done_early",
]  # fmt: skip

#: attack -> what the failure report must say (None: the test passes, the message is harmless).
FORK_EXPECT: dict[str, str | None] = {
    "garbage": "not (name, fields)",
    "non_json": "not JSON",
    "line_300mb": f"longer than {16 << 20} bytes",
    "unknown_name": "unexpected message 'bogus-message'",
    "foreign_nodeid": "test_ghost",
    "not_a_testreport": "not a TestReport",
    "data_not_a_dict": "not a TestReport",
    "when_not_a_phase": "'collect'",
    "longrepr_100mb": "longer than",
    "section_100mb": "longer than",
    "cache_ok": None,
    "cache_dotdot": "not a plain relative name",
    "cache_dotdot_inner": "not a plain relative name",
    "cache_absolute": "not a plain relative name",
    "cache_nul": "not a plain relative name",
    "cache_100mb": "longer than",
    "warning_not_a_warning": None,
    "warning_unimported_module": None,
    "output_not_text": "not text",
    "after_done": None,
}


@pytest.fixture(scope="module")
def fork_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_attacks(tmp_path_factory.mktemp("hostile") / "fork", FORK_ATTACKS)


@pytest.mark.parametrize("name", list(FORK_EXPECT))
@pytest.mark.escape_row("malformed-reports", "channel-frames", "channel-paths")
def test_fork_attack_fails_that_test_only(fork_run: Run, name: str) -> None:
    fork_run.contained(name, FORK_EXPECT[name])


@pytest.mark.escape_row("channel-frames", "channel-paths")
def test_fork_attacks_leave_the_host_bounded_and_clean(fork_run: Run) -> None:
    fork_run.session_went_on()
    assert fork_run.leftovers == []
    assert 0 < fork_run.host_rss_kib < HOST_RSS_BOUND_KIB, f"host peak RSS {fork_run.host_rss_kib} KiB"
    work = fork_run.work
    # Cache keys stay under .pytest_cache/v; the plain one is stored where a local run stores it.
    assert (work / ".pytest_cache" / "v" / "hostile" / "ok").read_text().strip() == "42"
    for outside in (work / "hostile-absolute", work.parent / "hostile-dotdot", work.parent.parent / "hostile-dotdot"):
        assert not outside.exists(), outside
    assert not (work / ".pytest_cache" / "v" / "hostile" / "big").exists()
    # Warnings: relayed as UserWarning; the module a guest named is never imported on the host.
    assert "UserWarning: hostile-not-a-warning" in fork_run.output, fork_run.tail()
    assert "UserWarning: hostile-unimported" in fork_run.output, fork_run.tail()
    assert not (work / "canary-imported").exists()
    assert "test_ghost" not in fork_run.cases


@pytest.mark.escape_row("malformed-reports")
def test_fork_done_before_any_report_fails_the_test(fork_run: Run) -> None:
    fork_run.contained("done_early", "DONE")


# --------------------------------------------------------------------------------------------
# module scope: the test runs in the warm interpreter holding the execnet channel

#: What differs from fork mode: the channel (objects, not lines; shared by the tests of a module).
MODULE_ATTACKS = [
    "garbage", "unknown_name", "foreign_nodeid", "not_a_testreport", "cache_100mb", "line_300mb",
    "done_early", "after_done", "exit_not_int",
]  # fmt: skip

MODULE_EXPECT: dict[str, str | None] = {
    "garbage": "not (name, fields)",
    "unknown_name": "unexpected message 'bogus-message'",
    "foreign_nodeid": "test_ghost",
    "not_a_testreport": "not a TestReport",
    # Module scope runs in a forked box too: the fork stream's line cap answers first.
    "cache_100mb": "longer than",
    "line_300mb": "longer than",
}


@pytest.fixture(scope="module")
def module_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_attacks(tmp_path_factory.mktemp("hostile") / "module", MODULE_ATTACKS, "--boxlite-scope=module")


@pytest.mark.parametrize("name", list(MODULE_EXPECT))
@pytest.mark.escape_row("malformed-reports", "channel-frames")
def test_module_scope_attack_fails_that_test_only(module_run: Run, name: str) -> None:
    module_run.contained(name, MODULE_EXPECT[name])


@pytest.mark.escape_row("malformed-reports")
def test_module_scope_session_goes_on(module_run: Run) -> None:
    module_run.session_went_on()
    assert module_run.leftovers == []


@pytest.mark.escape_row("channel-frames")
def test_module_scope_host_memory_stays_bounded(module_run: Run) -> None:
    assert 0 < module_run.host_rss_kib < HOST_RSS_BOUND_KIB, f"host peak RSS {module_run.host_rss_kib} KiB"


@pytest.mark.escape_row("malformed-reports")
def test_module_scope_messages_after_done_do_not_reach_the_next_test(module_run: Run) -> None:
    module_run.contained("after_done", None)


@pytest.mark.escape_row("malformed-reports")
def test_module_scope_done_before_any_report_fails_the_test(module_run: Run) -> None:
    module_run.contained("done_early", "DONE")


@pytest.mark.escape_row("malformed-reports")
def test_module_scope_exit_with_a_non_int_code_fails_that_test(module_run: Run) -> None:
    module_run.contained("exit_not_int", "returncode")


@pytest.mark.parametrize("scope", ["test", "module"])
def test_pytest_exit_in_a_boxed_test_ends_the_session_with_its_code(tmp_path: Path, scope: str) -> None:
    run = run_attacks(tmp_path / "exit", ["pytest_exit_7"], f"--boxlite-scope={scope}")
    assert run.returncode == 7, run.tail()
    assert "hostile exit" in run.output, run.tail()
    assert "test_pytest_exit_7_next" not in run.cases, "the session went on after pytest.exit"


# --------------------------------------------------------------------------------------------
# attacks that stop the whole session today (INTERNALERROR): a sub-run each


@pytest.mark.parametrize(
    ("scope", "says"),
    [
        pytest.param(
            "test",
            "JSON",
        ),
        pytest.param(
            "module",
            "not JSON",  # module scope runs in a forked box: the same stream as per-test boxes
        ),
    ],
)
@pytest.mark.escape_row("malformed-reports")
def test_deeply_nested_message_fails_that_test_only(tmp_path: Path, scope: str, says: str) -> None:
    run = run_attacks(tmp_path / "deep", ["json_deep"], f"--boxlite-scope={scope}")
    run.session_went_on()
    run.contained("json_deep", says)


@pytest.mark.escape_row("malformed-reports")
def test_fork_cannot_speak_for_the_warm_interpreter(tmp_path: Path) -> None:
    run = run_attacks(tmp_path / "warm", ["warm_channel_from_fork"])
    assert "INTERNALERROR" not in run.output, run.tail()
    assert run.returncode in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED), run.tail()
    assert run.case("test_warm_channel_from_fork_next").outcome == "passed", run.tail()


@pytest.mark.escape_row("malformed-reports")
def test_forged_fork_answer_fails_no_more_than_a_test(tmp_path: Path) -> None:
    # Boxes are forked one test ahead: the forged answer is read as the answer of a FORK sent two
    # tests later, so tests follow it.
    after = "".join(f"def test_after_{i}():\n    pass\n\n\n" for i in range(4))
    run = run_attacks(tmp_path / "forged", ["warm_forked_garbage"], extra_files={"test_hostile_99_after.py": after})
    assert "INTERNALERROR" not in run.output, run.tail()
    assert run.returncode in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED), run.tail()
    assert run.case("test_after_3").outcome == "passed", run.tail()
    assert run.leftovers == []


@pytest.mark.escape_row("malformed-reports")
def test_worker_scope_xdist_channel_is_checked(tmp_path: Path) -> None:
    """--boxlite-scope=worker -n 2: each xdist worker is a session in a box, and xdist trusts its
    workers (without pytest_boxlite.xdist_guard a report for a node id never sent was logged as
    PASSED, an unknown event was an INTERNALERROR, then a KeyError in xdist's bookkeeping)."""
    pytest.importorskip("xdist")
    # Without the guard the session hangs (xdist's INTERNALERROR, then a replaced worker) until
    # the sub-run's bound: 60 s, not the default 240 s, is enough to see what this checks.
    run = run_attacks(
        tmp_path / "xdist",
        ["xdist_foreign_nodeid", "xdist_unknown_event"],
        "--boxlite-scope=worker",
        "-n",
        "2",
        timeout=60.0,
    )
    assert "test_ghost" not in run.cases, "a report for a test the host never ran was accepted"
    run.session_went_on()
    run.contained("xdist_foreign_nodeid", "test_ghost")
    run.contained("xdist_unknown_event", "bogus-event")


@pytest.mark.escape_row("malformed-reports")
@pytest.mark.escape_row("forged-warning")
def test_worker_scope_xdist_warnings_and_reports_cannot_act_on_the_host(tmp_path: Path) -> None:
    """--boxlite-scope=worker -n 2: a worker's warning that names ``os.system`` and a host secret
    as its file (xdist would import and call the one and the warnings summary read the other), and
    a skip whose longrepr is no (path, line, reason): nothing runs or is read on the host, the
    session goes on (without the guard the command ran on the host)."""
    pytest.importorskip("xdist")
    mark, secret = tmp_path / "host-mark", tmp_path / "host-secret.txt"
    secret.write_text("host-secret-line-31337\n")
    run = run_attacks(
        tmp_path / "xdist-warn",
        ["xdist_warning_runs_host_code", "xdist_skip_longrepr"],
        "--boxlite-scope=worker",
        "-n",
        "2",
        timeout=120.0,
        PBX_HOST_MARK=str(mark),
        PBX_HOST_FILE=str(secret),
    )
    assert "hostile-warning" in run.output, run.tail()  # the warning came, as its text
    assert not mark.exists(), "a worker's warning ran a command on the host"
    assert "host-secret-line-31337" not in run.output, run.tail()
    run.session_went_on()
    run.contained("xdist_skip_longrepr", "not shaped as pytest")
    assert run.case("test_xdist_warning_runs_host_code_next").outcome == "passed", run.tail()


@pytest.mark.escape_row("lingering-box")
def test_fork_is_gone_once_its_test_is_over(tmp_path: Path) -> None:
    run = run_attacks(
        tmp_path / "linger",
        ["done_then_linger"],
        boxlite_all=False,
        extra_files={"test_hostile_99_host_check.py": HOST_CHECK_LINGER},
        # Unique per run (15 bytes at most, the kernel's comm size): CI runs other suites beside this one.
        PBX_LINGER=f"pbx-l{os.getpid() % 10**8:08d}"[:15],
    )
    assert "INTERNALERROR" not in run.output, run.tail()
    assert run.leftovers == []
    assert run.case("test_no_lingering_box_process").outcome == "passed", run.tail()


@pytest.mark.escape_row("channel-paths")
def test_fork_cache_conflict_under_w_error_fails_that_test_only(tmp_path: Path) -> None:
    run = run_attacks(tmp_path / "conflict", ["cache_key_file_and_dir"], "-W", "error::pytest.PytestCacheWarning")
    assert "INTERNALERROR" not in run.output, run.tail()
    assert run.returncode in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED), run.tail()
    assert run.case("test_cache_key_file_and_dir_next").outcome == "passed", run.tail()


@pytest.mark.escape_row("malformed-reports")
def test_fork_bad_tuple_tag_fails_that_test_only(tmp_path: Path) -> None:
    run = run_attacks(tmp_path / "tag", ["json_tuple_tag"])
    run.session_went_on()
    run.contained("json_tuple_tag", "JSON")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            "sections_not_pairs",
        ),
        pytest.param(
            "user_properties_not_pairs",
        ),
        pytest.param(
            "longrepr_malformed",
        ),
        pytest.param(
            "duration_not_a_number",
        ),
        pytest.param(
            "outcome_not_an_outcome",
        ),
    ],
)
@pytest.mark.escape_row("malformed-reports")
def test_fork_report_fields_are_checked(tmp_path: Path, name: str) -> None:
    run = run_attacks(tmp_path / name, [name])
    run.session_went_on()
    run.contained(name, "report")


@pytest.mark.escape_row("channel-paths")
def test_fork_coverage_paths_stay_in_the_project(tmp_path: Path) -> None:
    coverage = pytest.importorskip("coverage")
    data_file = tmp_path / "cov" / ".coverage"
    run = run_attacks(
        tmp_path / "cov",
        ["coverage_etc_passwd", "coverage_dotdot", "coverage_huge_list"],
        HOSTILE_COVERAGE=str(data_file),
    )
    run.session_went_on()
    run.contained("coverage_etc_passwd", "outside the project")
    run.contained("coverage_dotdot", "outside the project")
    run.contained("coverage_huge_list", None)
    measured = set()
    for f in data_file.parent.glob(".coverage.*"):
        data = coverage.CoverageData(basename=str(f))
        data.read()
        measured |= set(data.measured_files())
    root = str(tmp_path / "cov") + os.sep
    assert measured, "no coverage data from the box reached the host"
    assert all(n.startswith(root) for n in measured), measured


@pytest.mark.escape_row("malformed-reports")
def test_fork_coverage_huge_line_number_fails_that_test_only(tmp_path: Path) -> None:
    pytest.importorskip("coverage")
    run = run_attacks(
        tmp_path / "covnum", ["coverage_huge_lineno"], HOSTILE_COVERAGE=str(tmp_path / "covnum" / ".coverage")
    )
    run.session_went_on()
    run.contained("coverage_huge_lineno", "coverage")


@pytest.mark.escape_row("session-budget")
def test_fork_message_flood_keeps_host_memory_bounded(tmp_path: Path) -> None:
    run = run_attacks(tmp_path / "flood", ["warning_flood"])
    assert "INTERNALERROR" not in run.output, run.tail()
    assert 0 < run.host_rss_kib < HOST_RSS_BOUND_KIB, f"host peak RSS {run.host_rss_kib} KiB"
