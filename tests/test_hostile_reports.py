"""A hostile boxed test sends warnings, reports and frames the host must not trust (issue 22, items 2, 3, 6).

Each case runs as a real boxed test in a real pytest sub-run and speaks on the stream the host
reads, as :mod:`test_hostile_channel` does (its ``hostile.py`` guest helpers are reused: a message
through the guest's own sender, raw bytes on a forked box's socket, an object on the execnet
channel).  Every sub-run must end with the hostile test failed with a report that says what was
wrong, every other test with its own outcome, no INTERNALERROR, no box left, and the host unchanged:

* warnings: a warning naming a host file (a secret, ``/dev/zero``) is shown with the source line the
  box sent, and the host never reads the file it names; an honest warning keeps its line;
* malformed reports: a skip whose ``longrepr`` is not ``(path, line, reason)`` (``-rs`` and
  ``--junitxml`` unpack it), a lone surrogate (``-n 2``: the host-side xdist worker's execnet send),
  attributes that hide the report's methods, wrong types: with and without ``-n``;
* bounds: an 800 MB frame on a boxed test's one transport (the fork's JSON stream, a fresh fork's
  or, ``--boxlite-fresh=boot``, an in-place fork's) is refused before it is buffered, the host's peak RSS
  under 150 MB (``ru_maxrss`` of the sub-run's process tree, from a wrapper's
  ``getrusage(RUSAGE_CHILDREN)``, and the host pytest's own ``VmHWM``); on a real popen gateway
  (no box: the unit layer of that bound), execnet's receiver is held back while the host takes
  nothing, and the vm bridge's frame decoder and backlog are cut at their caps;
* the box log a failure report quotes: only what its own test logged, control characters escaped;
* session budgets: report text, warnings and cache values over the session's budget fail the test
  that overflows it.  The sub-run's host conftest lowers the budgets (``SESSION_*`` of
  :mod:`pytest_boxlite.remote.transport`) so that a few MiB reach them in seconds; the real
  budgets are the same code with larger numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from subruns import REAL_DATA_HOME, sub_env
from test_hostile_channel import GUEST_HELPERS, Case, junit_cases

from pytest_boxlite import ledger

pytestmark = [pytest.mark.reliability, pytest.mark.escapes]

#: Most the host (and, for ru_maxrss, any process of the sub-run's tree) may hold at its peak, KiB.
RSS_BOUND_KIB = 150 * 1024

CONFTEST = """
import os
from pathlib import Path

GUEST = os.environ.get("PYTEST_BOXLITE_GUEST") == "1"

if not GUEST and os.environ.get("HOSTILE_BUDGETS"):
    # Lowered so a few MiB reach them: the budgets' mechanism, not their size, is under test.
    from pytest_boxlite.remote import transport

    transport.SESSION_REPORT_BYTES = 4 << 20
    transport.SESSION_WARNINGS = 5
    transport.SESSION_CACHE_BYTES = 2 << 20


def pytest_unconfigure(config):
    if not GUEST:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                Path(os.environ["HOSTILE_HWM"]).write_text(line.split()[1])
"""

#: Every test file's imports (``hostile.py``: the guest helpers of test_hostile_channel).
HEADER = "from hostile import *  # noqa: F403\nfrom hostile import _transport\nimport warnings\n"

#: Runs the sub-run and writes the peak RSS of its whole process tree (KiB) to argv[1].
MEASURE = """
import resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
with open(sys.argv[1], "w") as fh:
    fh.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(rc)
"""


@dataclasses.dataclass
class Sub:
    work: Path
    returncode: int
    output: str
    cases: dict[str, Case]
    host_hwm_kib: int
    tree_maxrss_kib: int
    leftovers: list[ledger.Leftover]

    def tail(self) -> str:
        return self.output[-4000:]

    def case(self, name: str) -> Case:
        assert name in self.cases, f"no report for {name} (ran: {sorted(self.cases)})\n{self.tail()}"
        return self.cases[name]

    def failed(self, name: str, says: str) -> None:
        case = self.case(name)
        assert case.outcome in ("failed", "error"), f"{name}: {case.outcome}\n{self.tail()}"
        assert says in case.message, f"{name}: the report does not say {says!r}:\n{case.message[-3000:]}"

    def outcome(self, name: str, outcome: str) -> None:
        case = self.case(name)
        assert case.outcome == outcome, f"{name}: {case.outcome}, expected {outcome}\n{case.message[-3000:]}"

    def went_on(self) -> None:
        """The session survived: no INTERNALERROR, exit status 1 (tests failed), no box left."""
        assert "INTERNALERROR" not in self.output, self.tail()
        assert self.returncode == pytest.ExitCode.TESTS_FAILED, f"exit status {self.returncode}\n{self.tail()}"
        assert self.leftovers == []


def boxed(name: str, body: str, fixtures: str = "") -> str:
    return (
        f"\n\n@pytest.mark.boxlite\ndef {name}({fixtures}):\n{textwrap.indent(textwrap.dedent(body).strip(), '    ')}\n"
    )


def sub_run(work: Path, tests: dict[str, str], *args: str, timeout: float = 240.0, **env: str) -> Sub:
    """``tests`` (file -> test functions, ``hostile.py`` imported) as a pytest sub-run with ``args``."""
    work.mkdir(parents=True)
    (work / "conftest.py").write_text(CONFTEST)
    (work / "hostile.py").write_text(GUEST_HELPERS)
    (work / "measure.py").write_text(MEASURE)
    for file_name, source in tests.items():
        (work / file_name).write_text(HEADER + source)
    home, junit, log = work / "bxh", work / "junit.xml", work / "run.log"
    hwm, maxrss = work / "hwm", work / "maxrss"
    argv = [
        sys.executable, str(work / "measure.py"), str(maxrss),
        sys.executable, "-m", "pytest", "-p", "no:hypothesispytest", "-p", "no:benchmark", "-p", "no:randomly",
        f"--boxlite-home={home}", "--boxlite-lease-timeout=60", "--boxlite-timeout=90",
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
                pytest.fail(
                    f"the sub-run did not finish within {timeout:.0f}s:\n{log.read_text(errors='replace')[-4000:]}"
                )
        leftovers = ledger.scan(home)
    finally:
        if home.exists():
            ledger.reconcile(home, include_kept=True)
    text = log.read_text(errors="replace")
    return Sub(work, rc, text, junit_cases(junit), _kib(hwm), _kib(maxrss), leftovers)


def _kib(path: Path) -> int:
    """A number of KiB the sub-run wrote to ``path`` (-1: it wrote none)."""
    return int(path.read_text()) if path.exists() else -1


# --------------------------------------------------------------------------------------------
# warnings: the host prints the box's line, and reads no file a box names


def warning_tests(secret: Path) -> dict[str, str]:
    return {
        "test_warn.py": boxed(
            "test_warning_names_a_host_secret",
            f"send(m.WARNING, message='hostile-secret', category='UserWarning', module='builtins', "
            f"filename={str(secret)!r}, lineno=1, nodeid='')",
        )
        + boxed(
            "test_warning_names_dev_zero",
            "send(m.WARNING, message='hostile-zero', category='UserWarning', module='builtins', "
            "filename='/dev/zero', lineno=1, nodeid='')",
        )
        + boxed("test_warning_honest", "warnings.warn('honest-warning')  # HONEST-SOURCE-LINE")
        + boxed("test_warning_last", "assert os.environ.get('PYTEST_BOXLITE_GUEST') == '1'"),
    }


@pytest.mark.escape_row("forged-warning")
def test_warnings_carry_the_box_line_and_the_host_reads_no_file(tmp_path: Path) -> None:
    # A host file the box names as a warning's source: before the fix the warnings summary
    # printed its first line (read through linecache on the host); /dev/zero grew the host to GBs.
    secret = tmp_path / "host-only" / "id_rsa"
    secret.parent.mkdir()
    secret.write_text("HOSTSECRET-7f3a9 must never be printed\n")
    run = sub_run(tmp_path / "warn", warning_tests(secret), timeout=180)
    assert "INTERNALERROR" not in run.output, run.tail()
    assert run.returncode == pytest.ExitCode.OK, run.tail()
    assert run.leftovers == []
    for name in ("names_a_host_secret", "names_dev_zero", "honest", "last"):
        run.outcome(f"test_warning_{name}", "passed")
    assert "hostile-secret" in run.output and "hostile-zero" in run.output, run.tail()
    assert "HOSTSECRET" not in run.output, run.tail()
    # The honest warning's source line came from the box (the host read no file for it).
    assert "HONEST-SOURCE-LINE" in run.output, run.tail()
    assert 0 < run.host_hwm_kib < RSS_BOUND_KIB, f"host peak RSS {run.host_hwm_kib} KiB"


# --------------------------------------------------------------------------------------------
# malformed reports: each fails its own test; the session goes on, with and without -n

REPORT_CASES: dict[str, tuple[str, str, str | None]] = {
    # name -> (fixtures, guest code, what the failure says; None: an honest test, its own outcome)
    "skip_two_tuple": (
        "request",
        "send(m.REPORT, data=report(request, outcome='skipped', longrepr=('x.py', 1)))",
        "not a skip's (path, line, reason)",
    ),
    "skip_wrong_types": (
        "request",
        "send(m.REPORT, data=report(request, outcome='skipped', longrepr=(1, 'x', None)))",
        "not a skip's (path, line, reason)",
    ),
    "failed_with_skip_tuple": (
        "request",
        "send(m.REPORT, data=report(request, outcome='failed', longrepr=('x.py', 1, 'r')))",
        "not a skip's",
    ),
    "wasxfail_not_text": (
        "request",
        "send(m.REPORT, data=report(request, outcome='skipped', longrepr=('x.py', 1, 'r'), wasxfail=5))",
        "wasxfail",
    ),
    "hides_a_method": (
        "request",
        "send(m.REPORT, data=report(request, outcome='failed', longrepr='x', toterminal=5))",
        "hide the report's own",
    ),
    "crash_message_not_text": (
        "request",
        """
        entry = {"type": "ReprEntry", "data": {"lines": ["E x"], "reprfuncargs": None, "reprlocals": None,
                                               "reprfileloc": None, "style": "long"}}
        longrepr = {"reprcrash": {"path": "x.py", "lineno": 1, "message": 5},
                    "reprtraceback": {"reprentries": [entry], "extraline": None, "style": "long"},
                    "sections": [], "chain": None}
        send(m.REPORT, data=report(request, outcome="failed", longrepr=longrepr))
        """,
        "crash location",
    ),
    "number_too_big": ("request", "send(m.REPORT, data=report(request, duration=10 ** 40))", "number that big"),
    "lone_surrogate": ("", "assert False, 'bad text \\ud800 here'", "bad text"),
    "honest_skip": ("", "pytest.skip('honest reason')", None),
}


def report_tests() -> dict[str, str]:
    files = {}
    for i, (name, (fixtures, code, _)) in enumerate(REPORT_CASES.items()):
        files[f"test_r{i:02d}_{name}.py"] = boxed(f"test_{name}", code, fixtures) + boxed(
            f"test_{name}_next", "assert os.environ.get('PYTEST_BOXLITE_GUEST') == '1'"
        )
    return files


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "n2"])
@pytest.mark.escape_row("malformed-reports")
def test_malformed_reports_fail_that_test_only(tmp_path: Path, xdist: bool) -> None:
    if xdist:
        pytest.importorskip("xdist")
    run = sub_run(tmp_path / "reports", report_tests(), *(["-n", "2"] if xdist else []), timeout=300)
    run.went_on()
    for name, (_, _, says) in REPORT_CASES.items():
        if says is not None:
            run.failed(f"test_{name}", says)
        run.outcome(f"test_{name}_next", "passed")
    run.outcome("test_honest_skip", "skipped")
    # -rs still gives pytest's own summary line for a real skip.
    assert "SKIPPED [1]" in run.output and "honest reason" in run.output, run.tail()


# --------------------------------------------------------------------------------------------
# frames over the cap, on each transport, refused before they are buffered

FRAME_TESTS = {
    "test_frame.py": boxed(
        "test_frame_800mb",
        """
        import struct

        chunk = b"x" * MB
        t = _transport()
        if fork_mode():
            fd = t["out"].fileno()  # a JSON line that never ends
            header = b""
        else:
            # execnet's frame header (type, channel, length) announcing 800 MB on the warm
            # interpreter's channel; the payload is written 1 MB at a time (never held whole).
            from execnet.gateway_base import Message

            channel = t["channel"]
            fd = channel.gateway._io.outfile.fileno()
            header = struct.pack("!bii", Message.CHANNEL_DATA, channel.id, 800 * MB)
        try:
            os.write(fd, header)
            for _ in range(800):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        except OSError:
            pass  # the host hung up
        time.sleep(60)
        """,
    )
    + boxed("test_frame_800mb_next", "assert os.environ.get('PYTEST_BOXLITE_GUEST') == '1'"),
}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param((), f"longer than {16 << 20} bytes", id="fork-stream"),
        # A booted box's test runs in an in-place fork: its messages travel on the same stream
        # (the execnet channel carries control only; its frame cap is checked below).
        pytest.param(("--boxlite-fresh=boot",), f"longer than {16 << 20} bytes", id="booted-fork-stream"),
    ],
)
@pytest.mark.escape_row("channel-frames")
def test_oversized_frame_is_refused_before_it_is_read(tmp_path: Path, args: tuple[str, ...], says: str) -> None:
    run = sub_run(tmp_path / "frame", FRAME_TESTS, "--boxlite", *args, timeout=240)
    run.went_on()
    run.failed("test_frame_800mb", says)
    run.outcome("test_frame_800mb_next", "passed")
    assert 0 < run.host_hwm_kib < RSS_BOUND_KIB, f"host pytest's peak RSS {run.host_hwm_kib} KiB"
    assert 0 < run.tree_maxrss_kib < RSS_BOUND_KIB, f"the sub-run's peak RSS (ru_maxrss) {run.tree_maxrss_kib} KiB"


@pytest.mark.escape_row("channel-frames", runtime="host")
def test_execnet_receiver_is_held_back_while_the_host_takes_nothing() -> None:
    """A real popen gateway sends 40 messages of 4 MB at once: while the host takes none, the
    receiver thread queues at most ``QUEUED_CAP`` of them (before: all 40, 160 MB in the host);
    each still arrives, in order, once taken."""
    import execnet

    from pytest_boxlite.remote.warm import FrameCap

    gw = execnet.makegateway("popen")
    try:
        frames = FrameCap(gw)
        channel = gw.remote_exec("for i in range(40):\n    channel.send(str(i) * (4 << 20))")
        frames.watch(channel)
        time.sleep(2.0)  # ample for 160 MB through a pipe: a receiver not held back has read it all
        queued = channel._items.qsize()
        # At most a few frames (each under the frame cap): 8 x 16 MiB is what the host may hold.
        assert queued <= FrameCap.QUEUED_CAP <= 8, f"{queued} messages queued in the host, none taken"
        got = [channel.receive(30) for _ in range(40)]
        for i, x in enumerate(got):  # whole, and in the order sent
            assert len(x) == len(str(i)) * (4 << 20) and x.startswith(str(i) * 2), (i, x[:20])
    finally:
        frames.release()
        gw.exit()


@pytest.mark.escape_row("channel-frames", runtime="host")
def test_execnet_frame_over_the_cap_is_refused_before_it_is_read() -> None:
    import execnet

    from pytest_boxlite.remote.warm import FrameCap

    gw = execnet.makegateway("popen")
    try:
        frames = FrameCap(gw, cap=1 << 20)
        channel = gw.remote_exec("channel.send(b'x' * (2 << 20))")
        frames.watch(channel)
        with pytest.raises((EOFError, OSError, execnet.RemoteError)):
            channel.receive(30)
        assert frames.refused is not None and "over the cap of 1048576 bytes" in frames.refused
    finally:
        frames.release()
        with contextlib.suppress(Exception):
            gw.exit()


# --------------------------------------------------------------------------------------------
# session budgets (lowered in the sub-run: 4 MiB of report text, 5 warnings, 2 MiB of cache values)

PRINT = "print('s' * 900_000)"  # about 0.9 MB in the call report and again in the teardown's
BUDGET_TESTS = {
    "test_b1_sections.py": "".join(boxed(f"test_sections_{i}", PRINT) for i in range(4))
    + boxed("test_sections_quiet", "pass"),
    "test_b2_warnings.py": "".join(
        boxed(f"test_warns_{i}", "for k in range(3):\n    warnings.warn(f'budget-warning-{k}')") for i in range(2)
    ),
    "test_b3_cache.py": "".join(
        boxed(f"test_cache_{i}", f"request.config.cache.set('hostile/big{i}', 'c' * 900_000)", "request")
        for i in range(3)
    ),
}


@pytest.mark.escape_row("session-budget")
def test_session_budgets_fail_the_test_that_overflows_them(tmp_path: Path) -> None:
    run = sub_run(tmp_path / "budget", BUDGET_TESTS, timeout=300, HOSTILE_BUDGETS="1")
    run.went_on()
    # Report text: two tests fit in 4 MiB, the third goes over, and so does the fourth; a quiet one fits.
    run.outcome("test_sections_0", "passed")
    run.outcome("test_sections_1", "passed")
    run.failed("test_sections_2", "over the session's budget")
    run.failed("test_sections_3", "over the session's budget")
    run.outcome("test_sections_quiet", "passed")
    # Warnings: 5 in the session; the second test's third is one too many.
    run.outcome("test_warns_0", "passed")
    run.failed("test_warns_1", "over the session's budget")
    # Cache values: 2 MiB in the session; the third 0.9 MB value is refused and not written.
    run.outcome("test_cache_0", "passed")
    run.outcome("test_cache_1", "passed")
    run.failed("test_cache_2", "over the session's budget")
    cache = run.work / ".pytest_cache" / "v" / "hostile"
    assert sorted(p.name for p in cache.iterdir()) == ["big0", "big1"]
    assert sum(p.stat().st_size for p in cache.iterdir()) < 2 << 20


@pytest.mark.escape_row("session-budget")
def test_session_budgets_are_split_among_xdist_workers(tmp_path: Path) -> None:
    """Under ``-n 2`` each worker keeps its own budget and the controller receives both: each may
    keep half, so the session's sum stays within the caps (4 MiB of report text, 2 MiB of cache
    values here).  Without the split each worker kept the whole cap: all four 1.8 MB section tests
    passed (7.2 MB through the controller) and all three cache values were written."""
    tests = {name: BUDGET_TESTS[name] for name in ("test_b1_sections.py", "test_b3_cache.py")}
    run = sub_run(tmp_path / "split", tests, "-n", "2", timeout=300, HOSTILE_BUDGETS="1")
    run.went_on()
    names = [f"test_sections_{i}" for i in range(4)]
    kept = [n for n in names if run.case(n).outcome == "passed"]
    assert len(kept) <= 2, f"{kept} kept: more than 4 MiB through the controller\n{run.tail()}"
    for name in set(names) - set(kept):
        run.failed(name, "this xdist worker's boxed tests (1/2 of it)")
    run.outcome("test_sections_quiet", "passed")
    cache = run.work / ".pytest_cache" / "v" / "hostile"
    written = list(cache.iterdir()) if cache.is_dir() else []
    assert sum(p.stat().st_size for p in written) < 2 << 20, [p.name for p in written]
    assert len(written) <= 2


# --------------------------------------------------------------------------------------------
# the vm bridge (host side of a VM's stdio): what it holds of a box's output is bounded too.
# Its parts without a VM: the shim's frame decoder and the backlog between the SDK and the client.


@pytest.mark.escape_row("channel-frames", runtime="host")
def test_vm_bridge_refuses_an_endless_frame_before_joining_it() -> None:
    from pytest_boxlite.runtimes._vmbridge import FRAME_CAP, BridgeStreamError, FrameDecoder

    decoder = FrameDecoder()
    decoder.feed("QUJD")  # a frame begun, no newline yet
    with pytest.raises(BridgeStreamError, match="longer than"):
        decoder.feed("A" * FRAME_CAP)
    assert len(decoder.pending) == 4, "the over-long text was joined before it was refused"


@pytest.mark.escape_row("channel-frames", runtime="host")
def test_vm_bridge_backlog_is_cut_at_its_cap() -> None:
    from pytest_boxlite.runtimes._vmbridge import Backlog

    backlog = Backlog(cap=10)
    assert backlog.put("a" * 6)
    assert not backlog.put("b" * 6), "a backlog over its cap took more"
    assert not backlog.put("c"), "a cut backlog took more"
    assert backlog.overflowed
    assert backlog.get() == "a" * 6  # what was queued before the cut is still written
    assert backlog.get() is None  # then the stream ends


# --------------------------------------------------------------------------------------------
# the box log a failure report quotes: its own test's, with control characters escaped

LOG_WRITER = """
def write_log(data):
    # The test's own stderr outside pytest's capture (what FDCapture saved of fd 2): the box's log.
    import gc

    saved = [o.targetfd_save for o in gc.get_objects() if type(o).__name__ == "FDCapture" and o.targetfd == 2]
    for fd in saved:
        os.write(fd, data)
"""

LOG_TESTS = {
    "test_log.py": LOG_WRITER
    + boxed(
        "test_log_0_writes_junk",
        # The next test's box is forked ahead while this one runs: it is made before this writes.
        "time.sleep(0.5)\nwrite_log(b'PREV-TEST-JUNK\\n' * 100)",
    )
    + boxed("test_log_1_dies", "write_log(b'\\x1b[31mOWN-LOG-LINE\\x07\\n')\nos._exit(3)"),
}


@pytest.mark.escape_row("box-log")
def test_failure_report_quotes_its_own_box_log_escaped(tmp_path: Path) -> None:
    run = sub_run(tmp_path / "log", LOG_TESTS, "--boxlite", timeout=180)
    run.went_on()
    run.outcome("test_log_0_writes_junk", "passed")
    run.failed("test_log_1_dies", "status 3")
    section = run.output.split("test_log_1_dies", 1)[-1]
    assert "boxlite log of" in section, run.tail()
    assert "OWN-LOG-LINE" in section, run.tail()
    assert "\x1b[31m" not in run.output and "\x07" not in run.output, "a box's escape sequence reached the terminal"
    assert "\\x1b[31mOWN-LOG-LINE\\x07" in section, run.tail()
    assert "PREV-TEST-JUNK" not in section, "the report quotes what the test before it logged"
