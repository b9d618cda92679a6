"""Whole sessions: real pytest sub-runs with real boxes, each in its own ``--boxlite-home``.

Plain behaviour runs in-process (``pytester.runpytest``); whatever needs a
process to die, be signalled or outlive the run uses ``subprocess``.  Every
wait is a poll with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from subruns import HOLDER, QUIET, plans_grew, process_gone, sub_env, wait_until

from pytest_boxlite import ledger
from pytest_boxlite.runtimes import choose, probe

SUMMARY = re.compile(
    r"boxes booted (?P<booted>\d+), leased (?P<leased>\d+), reused (?P<reused>\d+), "
    r"warm-lease hit rate (?P<rate>\d+%|n/a), lease wait p50 [\d.]+ ms max [\d.]+ ms, leaked (?P<leaked>\d+)"
)


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m pytest_boxlite --home HOME ...``."""
    return subprocess.run(
        [sys.executable, "-m", "pytest_boxlite", "--home", str(home), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=sub_env(),
    )


def box_pid(home: Path, name: str) -> int:
    info = json.loads((home / "namespace" / f"{name}.ctl" / "info.json").read_text())
    return int(info["pid"])


class Holder:
    """A pytest subprocess running HOLDER in ``home``; its output goes to a log file."""

    def __init__(self, pytester: pytest.Pytester, home: Path, tag: str, *args: str) -> None:
        pytester.makepyfile(**{f"test_hold_{tag}": HOLDER})
        self.marker = pytester.path / f"{tag}.held"
        self.release_file = pytester.path / f"{tag}.release"
        self.log_path = pytester.path / f"{tag}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in wait()/kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={home}", f"test_hold_{tag}.py", *args],
            cwd=pytester.path,
            env=sub_env(HOLD_MARKER=str(self.marker), HOLD_RELEASE=str(self.release_file)),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_holding(self, timeout: float = 60.0) -> str:
        """Wait until the test holds its box; return the box's name."""
        ok = wait_until(lambda: self.marker.exists() or self.proc.poll() is not None, timeout)
        assert ok and self.marker.exists(), f"the held test never started (rc={self.proc.poll()}):\n{self.output}"
        assert wait_until(lambda: bool(self.marker.read_text()), 5)
        return self.marker.read_text()

    def release(self) -> None:
        self.release_file.write_text("go")

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    """Holder subprocesses of a test, killed at teardown if a failure left them running."""
    started: list[Holder] = []
    yield started
    for h in started:
        h.kill()


def run_inprocess(pytester: pytest.Pytester, home: Path, *args: str) -> pytest.RunResult:
    return pytester.runpytest(*QUIET, f"--boxlite-home={home}", *args)


def summary_of(result: pytest.RunResult) -> re.Match[str]:
    for line in result.outlines:
        m = SUMMARY.search(line)
        if m:
            return m
    raise AssertionError("no boxlite summary line:\n" + "\n".join(result.outlines))


# -- fixtures ------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_boxlite_sandbox_is_pristine_per_test(pytester: pytest.Pytester, home: Path) -> None:
    pytester.makepyfile(
        """
        NAMES = []

        def test_one(boxlite_sandbox):
            NAMES.append(boxlite_sandbox.name)
            assert not boxlite_sandbox.exists("/workspace/from-test-one")
            boxlite_sandbox.write_file("/workspace/from-test-one", "1")
            boxlite_sandbox.write_file("/etc/from-test-one", "1")
            assert boxlite_sandbox.exists("/workspace/from-test-one")

        def test_two(boxlite_sandbox):
            NAMES.append(boxlite_sandbox.name)
            assert not boxlite_sandbox.exists("/workspace/from-test-one")
            assert not boxlite_sandbox.exists("/etc/from-test-one")
            assert NAMES[0] != NAMES[1]
        """
    )
    result = run_inprocess(pytester, home)
    result.assert_outcomes(passed=2)
    assert not Path("/etc/from-test-one").exists(), "a write in a box reached the host"
    assert ledger.scan(home) == []


@pytest.mark.timeout(120)
def test_boxlite_pool_sandbox_with_its_own_spec(pytester: pytest.Pytester, home: Path) -> None:
    pytester.makepyfile(
        """
        import pytest

        # namespace: "image ... has no effect" (shown, not raised: an in-process sub-run)
        @pytest.mark.filterwarnings("default::pytest.PytestWarning")
        def test_other_spec(boxlite_pool, boxlite_sandbox):
            with boxlite_pool.sandbox(env={"GREETING": "hello there"}) as sb:
                assert sb.execute_command("echo $GREETING").stdout.strip() == "hello there"
                assert sb.name != boxlite_sandbox.name
            assert boxlite_sandbox.execute_command("echo ${GREETING:-unset}").stdout.strip() == "unset"
            assert boxlite_pool.runtime in ("namespace", "vm")
            assert boxlite_pool.runtime_reason
            assert boxlite_pool.stats.leased == 2

        def test_lease_and_release(boxlite_pool):
            lease = boxlite_pool.lease(env={"X": "1"})
            try:
                assert lease.sandbox.execute_command("echo $X").stdout.strip() == "1"
            finally:
                lease.release()
        """
    )
    result = run_inprocess(pytester, home)
    result.assert_outcomes(passed=2)
    assert summary_of(result)["leaked"] == "0"
    assert ledger.scan(home) == []


@pytest.mark.timeout(120)
def test_module_sandbox_is_shared_within_a_module_only(pytester: pytest.Pytester, home: Path) -> None:
    pytester.makepyfile(
        test_shared_a="""
        NAMES = []

        def test_setup(boxlite_module_sandbox):
            NAMES.append(boxlite_module_sandbox.name)
            boxlite_module_sandbox.write_file("/workspace/expensive", "done once")

        def test_uses_setup(boxlite_module_sandbox):
            NAMES.append(boxlite_module_sandbox.name)
            assert boxlite_module_sandbox.read_file("/workspace/expensive") == "done once"
            assert NAMES[0] == NAMES[1]
        """,
        test_shared_b="""
        def test_other_module(boxlite_module_sandbox):
            assert not boxlite_module_sandbox.exists("/workspace/expensive")
        """,
    )
    result = run_inprocess(pytester, home)
    result.assert_outcomes(passed=3)
    assert summary_of(result)["leased"] == "2"
    assert ledger.scan(home) == []


# -- reporting -------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_report_header_and_summary(pytester: pytest.Pytester, home: Path) -> None:
    pytester.makepyfile(
        """
        def test_a(boxlite_sandbox):
            assert boxlite_sandbox.execute_command("echo a").stdout.strip() == "a"

        def test_b(boxlite_sandbox):
            assert boxlite_sandbox.execute_command("echo b").stdout.strip() == "b"

        def test_no_box():
            pass
        """
    )
    result = run_inprocess(pytester, home, "--boxlite-max-boxes=3")
    result.assert_outcomes(passed=3)
    choice = choose("auto")
    runtime_lines = [line for line in result.outlines if line.startswith("boxlite: runtime=")]
    assert len(runtime_lines) == 1, result.outlines
    assert runtime_lines[0].startswith(f"boxlite: runtime={choice.kind} (")
    assert choice.reason in runtime_lines[0]
    if choice.kind == "namespace":
        assert "weaker than a VM" in runtime_lines[0]
    result.stdout.fnmatch_lines(["boxlite: image=* max-boxes=3 *"])

    result.stdout.fnmatch_lines(["*- boxlite -*"])
    m = summary_of(result)
    assert m["leased"] == "2"
    assert int(m["booted"]) >= 2
    assert m["reused"] == "0"
    assert m["leaked"] == "0"
    assert m["rate"] != "n/a"
    assert ledger.scan(home) == []


@pytest.mark.timeout(120)
def test_no_box_no_summary_and_no_boot(pytester: pytest.Pytester, home: Path) -> None:
    """A run that asks for no box boots none and prints no boxlite section."""
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = run_inprocess(pytester, home)
    result.assert_outcomes(passed=1)
    assert not any(SUMMARY.search(line) for line in result.outlines)
    assert not (home / "namespace").exists() or not any((home / "namespace").iterdir())


# -- keep ------------------------------------------------------------------------

KEEP = """
def test_fails(boxlite_sandbox):
    boxlite_sandbox.write_file("/workspace/evidence", "kept state")
    assert False, "failing on purpose"

def test_passes(boxlite_sandbox):
    boxlite_sandbox.write_file("/workspace/evidence", "not kept")
"""
KEPT_LINE = re.compile(
    r"kept box (?P<name>pbx-\S+) \(failed test\): enter it with `(?P<enter>[^`]+)`, remove it with `(?P<remove>[^`]+)`"
)


def run_keep_session(pytester: pytest.Pytester, home: Path) -> tuple[subprocess.CompletedProcess[str], re.Match[str]]:
    pytester.makepyfile(test_keep=KEEP)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={home}", "--boxlite-keep", "test_keep.py"],
        cwd=pytester.path,
        env=sub_env(),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    m = KEPT_LINE.search(proc.stdout)
    assert m, "no 'kept box' line:\n" + proc.stdout
    return proc, m


@pytest.mark.timeout(120)
def test_keep_keeps_failed_box_and_cli_lists_enters_and_cleans_it(pytester: pytest.Pytester, home: Path) -> None:
    proc, m = run_keep_session(pytester, home)
    name = m["name"]
    assert "leaked 0" in proc.stdout
    assert len(KEPT_LINE.findall(proc.stdout)) == 1, "only the failed test's box is kept"
    assert name in m["enter"] and "shell" in m["enter"]
    assert name in m["remove"] and "clean" in m["remove"]

    # Only the kept box is left, and it still runs after its pytest exited.
    rows = ledger.scan(home)
    assert [r.name for r in rows] == [name]
    assert rows[0].kept and rows[0].running and not rows[0].owner_alive

    ls = cli(home, "ls")
    assert ls.returncode == 0, ls.stderr
    lines = [line for line in ls.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, ls.stdout
    assert name in lines[0] and "kept" in lines[0] and "running" in lines[0] and "dead" in lines[0]

    # The failed test's state is there to be inspected.
    shell = cli(home, "shell", name, "cat", "/workspace/evidence")
    assert shell.returncode == 0, shell.stderr
    assert shell.stdout == "kept state"

    # A plain clean leaves kept boxes alone; --kept removes them.
    plain = cli(home, "clean")
    assert plain.returncode == 0, plain.stderr
    assert "removed 0 box(es)" in plain.stdout
    assert [r.name for r in ledger.scan(home)] == [name]

    pid = box_pid(home, name)
    kept = cli(home, "clean", "--kept")
    assert kept.returncode == 0, kept.stderr
    assert "removed 1 box(es)" in kept.stdout and name in kept.stdout
    assert ledger.scan(home) == []
    assert wait_until(lambda: process_gone(pid), 10), "the kept box still runs after clean --kept"
    assert cli(home, "ls").stdout.strip() == "no boxes"


@pytest.mark.timeout(120)
def test_keep_hints_work_as_printed(pytester: pytest.Pytester, home: Path) -> None:
    """The printed enter/remove commands work when pasted into a shell, whichever --boxlite-home the run used."""
    _, m = run_keep_session(pytester, home)
    name = m["name"]

    def run_printed(command: str, *extra: str) -> subprocess.CompletedProcess[str]:
        argv = shlex.split(command)
        assert argv[:3] == ["python", "-m", "pytest_boxlite"], command
        return subprocess.run(
            [sys.executable, *argv[1:], *extra], capture_output=True, text=True, timeout=60, env=sub_env()
        )

    enter = run_printed(m["enter"], "cat", "/workspace/evidence")
    assert enter.returncode == 0, f"`{m['enter']}` failed: {enter.stderr}"
    assert enter.stdout == "kept state"
    remove = run_printed(m["remove"])
    assert remove.returncode == 0, f"`{m['remove']}` failed: {remove.stderr}"
    assert ledger.scan(home) == [], f"`{m['remove']}` left {name} behind"


# -- leftovers and concurrent sessions -----------------------------------------------


@pytest.mark.timeout(120)
def test_leftovers_of_a_killed_session_are_reconciled_at_next_start(
    pytester: pytest.Pytester, home: Path, holders: list[Holder]
) -> None:
    a = Holder(pytester, home, "killed")
    holders.append(a)
    held = a.wait_holding()
    os.kill(a.proc.pid, signal.SIGKILL)
    assert a.wait(30) == -signal.SIGKILL

    rows = ledger.scan(home)
    assert held in {r.name for r in rows}, rows
    assert all(r.owner is not None and not r.owner_alive for r in rows), rows
    assert "dead" in cli(home, "ls").stdout

    pytester.makepyfile(test_next="def test_next(boxlite_sandbox):\n    assert boxlite_sandbox.exists('/workspace')\n")
    result = run_inprocess(pytester, home, "test_next.py")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*removed {len(rows)} leftover box(es) of dead sessions*{held}*"])
    assert summary_of(result)["leaked"] == "0"
    assert ledger.scan(home) == []
    assert list((home / "sessions").glob("*.lock")) == [], "the dead session's lock file was not cleaned up"


@pytest.mark.timeout(120)
def test_concurrent_live_session_is_never_touched(pytester: pytest.Pytester, home: Path, holders: list[Holder]) -> None:
    a = Holder(pytester, home, "live")
    holders.append(a)
    held = a.wait_holding()

    # Session B runs to completion in the same home while A holds its box.
    pytester.makepyfile(test_b="def test_b(boxlite_sandbox):\n    assert boxlite_sandbox.exists('/workspace')\n")
    result = run_inprocess(pytester, home, "test_b.py")
    result.assert_outcomes(passed=1)
    assert not any("leftover box" in line for line in result.outlines), result.outlines

    rows = {r.name: r for r in ledger.scan(home)}
    assert held in rows, f"session B removed live session A's box: {sorted(rows)}"
    assert rows[held].owner_alive and rows[held].running
    assert all(r.owner == rows[held].owner for r in rows.values()), "session B left boxes behind"

    # Nor may the CLI touch it.
    refused = cli(home, "clean", held)
    assert refused.returncode == 1
    assert "refusing" in refused.stderr and "alive" in refused.stderr
    assert "removed 0 box(es)" in cli(home, "clean").stdout
    assert held in {r.name for r in ledger.scan(home)}

    a.release()
    rc = a.wait(60)
    assert rc == 0, a.output
    assert "1 passed" in a.output
    assert ledger.scan(home) == []


# -- signals ---------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_sigterm_mid_run_reaps_every_box(pytester: pytest.Pytester, home: Path, holders: list[Holder]) -> None:
    a = Holder(pytester, home, "term")
    holders.append(a)
    held = a.wait_holding()
    assert held in {r.name for r in ledger.scan(home)}
    pid = box_pid(home, held)
    a.proc.send_signal(signal.SIGTERM)
    rc = a.wait(60)
    assert rc == -signal.SIGTERM, f"rc={rc}\n{a.output}"
    assert ledger.scan(home) == [], a.output
    assert wait_until(lambda: process_gone(pid), 10)


@pytest.mark.timeout(120)
def test_sigint_mid_run_reaps_every_box(pytester: pytest.Pytester, home: Path, holders: list[Holder]) -> None:
    a = Holder(pytester, home, "int")
    holders.append(a)
    held = a.wait_holding()
    pid = box_pid(home, held)
    a.proc.send_signal(signal.SIGINT)
    rc = a.wait(60)
    assert rc == pytest.ExitCode.INTERRUPTED, f"rc={rc}\n{a.output}"
    assert "KeyboardInterrupt" in a.output
    assert ledger.scan(home) == [], a.output
    assert wait_until(lambda: process_gone(pid), 10)


# -- the command line tool -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_doctor_prints_runtime_and_probe_reason(home: Path) -> None:
    out = cli(home, "doctor")
    assert out.returncode == 0, out.stderr
    p = probe()
    choice = choose("auto")
    lines = out.stdout.splitlines()
    runtime = [line for line in lines if line.startswith("runtime:")]
    assert len(runtime) == 1, out.stdout
    assert choice.kind in runtime[0] and choice.reason in runtime[0]
    vm = [line for line in lines if line.startswith("vm runtime:")]
    assert len(vm) == 1 and p.reason in vm[0], out.stdout
    assert any(line.startswith("bwrap:") for line in lines)
    assert f"home:       {home}" in out.stdout


@pytest.mark.timeout(60)
def test_ls_and_clean_on_an_empty_home(home: Path, tmp_path: Path) -> None:
    home.mkdir()
    for h in (home, tmp_path / "never-created"):
        ls = cli(h, "ls")
        if h == home:
            assert ls.returncode == 0, ls.stderr
            assert ls.stdout.strip() == "no boxes"
        else:  # a --home that is not there is more likely a typo than a clean machine: said so
            assert ls.returncode == 2 and f"no boxlite home at {h}" in ls.stderr, (ls.stdout, ls.stderr)
        clean = cli(h, "clean")
        assert clean.returncode == 0, clean.stderr
        assert clean.stdout.strip() == "removed 0 box(es)"
    with contextlib.suppress(FileNotFoundError):
        assert list((tmp_path / "never-created").iterdir()) == []


# -- sandbox boxes forked from a zygote ---------------------------------------------

FORKED = """
import json, os
from pathlib import Path

def _record(sb, i):
    seen = sb.execute_command("cat /etc/pbx-setup-mark 2>/dev/null; ls /etc/pbx-written-* 2>/dev/null; true").stdout
    sb.execute_command(f"echo {i} > /etc/pbx-written-{i}")
    with open(os.environ["RECORD"], "a") as fh:
        fh.write(json.dumps({"name": sb.name, "forked_from": sb.handle.forked_from, "seen": seen}) + "\\n")

def test_a(boxlite_sandbox):
    _record(boxlite_sandbox, "a")

def test_b(boxlite_sandbox):
    _record(boxlite_sandbox, "b")

def test_c(boxlite_sandbox):
    _record(boxlite_sandbox, "c")
"""


#: A plugin of the sub-run (``-p pbx_plans``): every fork plan the session's runtime makes, as the
#: sorted paths it hides, one JSON line each in ``$RECORD.plans``.
PLANS_PLUGIN = """
import json, os
from pytest_boxlite.runtimes.namespace.runtime import NamespaceRuntime

_real = NamespaceRuntime._fork_plan


def _recorded(self, spec):
    plan = _real(self, spec)
    with open(os.environ["RECORD"] + ".plans", "a") as fh:
        fh.write(json.dumps(sorted(plan.hidden)) + "\\n")
    return plan


NamespaceRuntime._fork_plan = _recorded
"""


def _plans_grew(record: Path) -> int:
    """:func:`subruns.plans_grew` of the fork plans the sub-run recorded (``-p pbx_plans``)."""
    path = Path(str(record) + ".plans")
    lines = path.read_text().splitlines() if path.exists() else []
    return plans_grew([set(json.loads(line)) for line in lines])


def _leaked(output: str) -> str:
    m = SUMMARY.search(output)
    assert m, "no boxlite summary line:\n" + output[-5000:]
    return m["leaked"]


def run_forked_session(
    pytester: pytest.Pytester, home: Path, *args: str, project: Path | None = None
) -> tuple[str, list[dict[str, object]]]:
    """Run FORKED in ``project`` (default: pytester's directory) with ``args``; its output and records."""
    project = project or pytester.path
    (project / "test_forked.py").write_text(FORKED)
    (project / "pbx_plans.py").write_text(PLANS_PLUGIN)
    record = project / "record.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *QUIET, "-p", "pbx_plans", f"--boxlite-home={home}", *args, "test_forked.py"],
        cwd=project,
        env={**sub_env(), "RECORD": str(record)},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, [json.loads(line) for line in record.read_text().splitlines()]


@pytest.mark.timeout(120)
def test_a_session_forks_its_sandboxes_from_one_zygote_and_leaves_nothing(
    pytester: pytest.Pytester, home: Path
) -> None:
    """A session's boxlite_sandbox boxes are forked (not booted), each pristine; the zygote is no
    leak, and nothing of the session is left once it ends."""
    out, rows = run_forked_session(pytester, home)
    assert len(rows) == 3
    assert all(r["forked_from"] for r in rows), rows
    grew = _plans_grew(pytester.path / "record.jsonl")
    assert 1 <= len({r["forked_from"] for r in rows}) <= 1 + grew, (rows, grew)
    assert all(r["seen"] == "" for r in rows), f"a box saw another box's file: {rows}"
    assert "not forked" not in out, out
    assert _leaked(out) == "0", out
    assert ledger.scan(home) == []
    assert cli(home, "ls").stdout.strip() == "no boxes"


@pytest.mark.timeout(240)
def test_setup_template_reaches_forked_sandboxes(pytester: pytest.Pytester, home: Path) -> None:
    """``--boxlite-setup``: the zygote starts from the template, so every forked box has its files."""
    # The setup runs in the invocation directory, which must be one boxes see (not under the host's /tmp).
    project = Path(tempfile.mkdtemp(prefix="pbx-setup-", dir="/var/tmp"))
    try:
        out, rows = run_forked_session(
            pytester, home, "--boxlite-setup", "echo provisioned > /etc/pbx-setup-mark", project=project
        )
    finally:
        shutil.rmtree(project, ignore_errors=True)
    assert all(r["forked_from"] for r in rows), rows
    assert all(r["seen"] == "provisioned\n" for r in rows), rows
    assert _leaked(out) == "0", out
    assert ledger.scan(home) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("option", ["--boxlite-keep", "--boxlite-fresh=boot"])
def test_keep_and_fresh_boot_boot_sandboxes_rather_than_forking_them(
    pytester: pytest.Pytester, home: Path, option: str
) -> None:
    """A forked box cannot outlive its session: under --boxlite-keep every box is booted; and
    --boxlite-fresh=boot asks for every box booted."""
    out, rows = run_forked_session(pytester, home, option)
    assert [r["forked_from"] for r in rows] == [None, None, None]
    assert all(r["seen"] == "" for r in rows), rows
    assert _leaked(out) == "0", out


REFUSING_CONFTEST = """
from pytest_boxlite.runtimes.namespace import runtime
from pytest_boxlite.runtimes.namespace.zygote import ForkRefused


def refuse(zygote, *args):
    raise ForkRefused(f"zygote {zygote.name} could not fork a box: clone: [Errno 1] simulated refusal")


# As a host that forbids what the fork needs (nested user namespaces, a mount) would answer.
runtime.fork_from = refuse
"""


@pytest.mark.timeout(120)
def test_a_refused_fork_boots_the_sandboxes_and_the_summary_says_why(pytester: pytest.Pytester, home: Path) -> None:
    pytester.makeconftest(REFUSING_CONFTEST)
    out, rows = run_forked_session(pytester, home)
    assert [r["forked_from"] for r in rows] == [None, None, None]
    assert all(r["seen"] == "" for r in rows), rows
    assert "sandbox boxes were booted, not forked from a warm box: zygote pbx-" in out, out
    assert "simulated refusal" in out
    assert _leaked(out) == "0", out
    assert ledger.scan(home) == []
