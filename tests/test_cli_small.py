"""The command line's smaller items (issue 23, item 10): an unreadable home is a clear error, not a
traceback; ``--home`` after the sub-command; a kept box's summary line names its test; ``shell``
from a terminal runs on a pty of the box's own (job control, Ctrl-C reaches the foreground job).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from subruns import QUIET, sub_env

from pytest_boxlite import ledger

pytestmark = pytest.mark.timeout(180)

CLI = [sys.executable, "-m", "pytest_boxlite"]

KEEP = """
import pytest

def test_sandbox_fails(boxlite_sandbox):
    boxlite_sandbox.write_file("/workspace/evidence", "kept state")
    assert False, "failing on purpose"

@pytest.mark.boxlite
def test_boxed_fails():
    assert False, "failing on purpose too"

def test_passes(boxlite_sandbox):
    pass
"""
KEPT = re.compile(
    r"kept box (?P<name>pbx-\S+) \(failed test\): enter it with `[^`]+`, remove it with `[^`]+`(?P<rest>.*)"
)


def _cli(*args: str, env: dict[str, str] | None = None, wrap: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*wrap, *CLI, *args],
        env=env or sub_env(),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """``(home, the run's output)`` of a session that kept the boxes of its two failed tests."""
    root = tmp_path_factory.mktemp("kept")
    home = root / "bxh"
    (root / "test_keep.py").write_text(KEEP)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *QUIET, "-p", "no:randomly", f"--boxlite-home={home}", "--boxlite-keep"],
        cwd=root,
        env=sub_env(),
        capture_output=True,
        text=True,
        timeout=150,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    try:
        yield home, proc.stdout
    finally:
        ledger.reconcile(home, include_kept=True)


def test_a_kept_boxs_summary_line_names_its_test(kept: tuple[Path, str]) -> None:
    _, out = kept
    lines = {m["name"]: m["rest"] for m in KEPT.finditer(out)}
    assert len(lines) == 2, out
    assert sorted(lines.values()) == [
        "; it ran test_keep.py::test_boxed_fails",
        "; it ran test_keep.py::test_sandbox_fails",
    ], out


def _unreadable_wrap() -> tuple[str, ...]:
    """How to run the command line so that a mode-000 directory of ours is unreadable to it: as
    root, in a user namespace of its own (no capability over the host's files); else as we are."""
    if os.geteuid() != 0:
        return ()
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--user", "true"], capture_output=True).returncode != 0:
        pytest.skip("root, and no `unshare --user` to drop the override of file permissions")
    return (unshare, "--user", "--")


@pytest.mark.parametrize("command", [["doctor"], ["ls"], ["clean"], ["clean", "--templates"], ["shell", "pbx-x-1"]])
def test_an_unreadable_home_is_a_clear_error(tmp_path: Path, command: list[str]) -> None:
    """Another user's home under a directory this user may not enter (as ``/root`` is)."""
    wrap = _unreadable_wrap()
    theirs = tmp_path / "theirs"
    home = theirs / "bxh"
    (home / "namespace").mkdir(parents=True)
    theirs.chmod(0)
    try:
        r = _cli("--home", str(home), *command, wrap=wrap)
    finally:
        theirs.chmod(0o700)
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out
    if command == ["doctor"]:
        assert r.returncode == 0, out
        assert re.search(rf"home: +{re.escape(str(home))} \(NOT usable by uid \d+: Permission denied", out), out
    else:
        assert r.returncode == 1, out
        assert f"error: {command[0]} could not use the boxlite home {home}: Permission denied" in r.stderr, out
        assert "name a home of your own with --home" in r.stderr


def test_doctor_says_a_home_it_cannot_read(tmp_path: Path) -> None:
    wrap = _unreadable_wrap()
    home = tmp_path / "bxh"
    home.mkdir()
    home.chmod(0)
    try:
        r = _cli("--home", str(home), "doctor", wrap=wrap)
    finally:
        home.chmod(0o700)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(rf"home: +{re.escape(str(home))} \(exists, NOT readable by uid \d+\)", r.stdout), r.stdout


def test_home_after_the_sub_command(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    for args, shown in (
        (["doctor", "--home", str(second)], second),
        (["--home", str(first), "doctor"], first),
        (["--home", str(first), "doctor", "--home", str(second)], second),
    ):
        r = _cli(*args)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"home:       {shown} (" in r.stdout, (args, r.stdout)
    first.mkdir(mode=0o700)
    r = _cli("ls", "--home", str(first))
    assert r.returncode == 0 and r.stdout.strip() == "no boxes", r.stdout + r.stderr


class _Terminal:
    """The command line on a pty of the host (as a user's terminal), driven by what it prints."""

    def __init__(self, *args: str) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal
            try:
                env = sub_env()
                os.execvpe(CLI[0], [*CLI, *args], env)
            finally:
                os._exit(127)
        self.seen = ""

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def expect(self, pattern: str, timeout: float = 20.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.seen)
            if m:
                self.seen = self.seen[m.end() :]
                return m
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.seen!r}"
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:
                    chunk = b""
                assert chunk, f"the terminal closed before {pattern!r}: {self.seen!r}"
                self.seen += chunk.decode(errors="replace")

    def wait(self, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with_ready, _, _ = select.select([self.fd], [], [], 0.1)
            if with_ready:
                with contextlib.suppress(OSError):
                    os.read(self.fd, 4096)
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self.fd)
        raise AssertionError("the shell did not end")


def test_shell_from_a_terminal_has_job_control_and_ctrl_c(kept: tuple[Path, str]) -> None:
    home, out = kept
    name = next(m["name"] for m in KEPT.finditer(out) if "sandbox" in m["rest"])
    term = _Terminal("--home", str(home), "shell", name)
    try:
        term.expect(r"[#$] ")
        term.send("tty; echo flags=$-\n")
        assert term.expect(r"(/dev/pts/\d+|not a tty)")[1].startswith("/dev/pts/"), "no terminal in the box"
        assert "m" in term.expect(r"flags=(\w+)")[1], "an interactive shell without job control"
        term.expect(r"[#$] ")
        term.send("cat /workspace/evidence; echo; sleep 60\n")
        term.expect("kept state")
        time.sleep(0.5)
        started = time.monotonic()
        term.send("\x03")  # Ctrl-C: the foreground job (sleep) ends, the shell stays
        term.expect(r"[#$] ")
        term.send("echo status=$?\n")
        assert term.expect(r"status=(\d+)")[1] == "130"
        assert time.monotonic() - started < 30, "Ctrl-C did not reach the sleep"
        # The user's terminal is resized: the box's pty follows.
        fcntl.ioctl(term.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 41, 123, 0, 0))
        time.sleep(1.0)
        term.send("stty size\n")
        term.expect(r"41 123")
        term.expect(r"[#$] ")
        term.send("sleep 60 &\n")  # a job left behind must not keep the shell command open
        term.expect(r"[#$] ")
        term.send("exit 3\n")
        assert term.wait() == 3
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(term.pid, signal.SIGKILL)
            os.waitpid(term.pid, 0)


def test_help_is_plain_text_with_examples() -> None:
    """``--help`` printed the module's reST docstring (double backquotes) and no example."""
    r = _cli("--help")
    assert r.returncode == 0, r.stderr
    assert "``" not in r.stdout, r.stdout
    assert "python -m pytest_boxlite shell NAME" in r.stdout and "examples:" in r.stdout, r.stdout


def test_shell_without_a_name_says_what_it_needs(tmp_path: Path) -> None:
    """``shell`` alone claimed that ``command`` was required too (it never is)."""
    r = _cli("shell", "--home", str(tmp_path))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "shell needs the name of a running box" in r.stderr and "ls lists them" in r.stderr, r.stderr
    assert "command" not in r.stderr.split("NAME", 1)[0], r.stderr


def test_ls_of_a_home_that_is_not_there_is_an_error_not_a_clean_machine(tmp_path: Path) -> None:
    """A typo in ``--home`` (or the environment's home) printed "no boxes", as for a clean machine."""
    missing = tmp_path / "typo"
    r = _cli("ls", "--home", str(missing))
    assert r.returncode == 2 and f"no boxlite home at {missing} (--home)" in r.stderr, (r.stdout, r.stderr)
    r = _cli("ls", env=sub_env(PYTEST_BOXLITE_HOME=str(missing)))
    assert r.returncode == 2 and "PYTEST_BOXLITE_HOME" in r.stderr, (r.stdout, r.stderr)
    # The default home before any run is a clean machine, and says so.
    r = _cli("ls", env=sub_env(XDG_CACHE_HOME=str(tmp_path / "cache"), HOME=str(tmp_path / "h")))
    assert r.returncode == 0 and "no boxes" in r.stdout, (r.stdout, r.stderr)


def test_selftest_where_no_vm_boots_says_why_and_how_on() -> None:
    """``doctor --selftest`` tried to boot a VM here anyway and blamed the image registry."""
    from pytest_boxlite.runtimes import probe

    if probe().vm_ok:
        pytest.skip("this host boots micro-VMs: the selftest runs for real (tests/test_vm_selftest.py)")
    r = _cli("doctor", "--selftest")
    assert r.returncode == 1, (r.stdout, r.stderr)
    line = next(x for x in r.stdout.splitlines() if x.startswith("selftest:"))
    assert "not run" in line and probe().reason in line and "--boxlite-url" in line, line
    assert "registry" not in r.stdout.lower(), r.stdout
    assert line.count("cannot boot") == 1, line


def _kept_names(out: str) -> dict[str, str]:
    """``{test name: kept box name}`` from a run's kept-box summary lines."""
    return {m["rest"].rsplit("::", 1)[-1]: m["name"] for m in KEPT.finditer(out)}


def test_shell_of_a_kept_boxed_test_starts_in_the_tests_directory(kept: tuple[Path, str]) -> None:
    """``shell NAME`` of a kept boxed test started in /workspace, not where the test ran (issue
    44, item 7): the box's keep mark records the test's working directory.  A sandbox's box has
    none recorded: its own default."""
    home, out = kept
    names = _kept_names(out)
    r = _cli("--home", str(home), "shell", names["test_boxed_fails"], "pwd")
    assert (r.returncode, r.stdout) == (0, f"{home.parent}\n"), (r.stdout, r.stderr)
    r = _cli("--home", str(home), "shell", names["test_sandbox_fails"], "pwd")
    assert (r.returncode, r.stdout) == (0, "/workspace\n"), (r.stdout, r.stderr)


@pytest.mark.parametrize(
    "mark",
    [
        b'{"cwd": "etc"}',  # not absolute
        b'{"cwd": "/etc\\u0000x"}',  # a NUL
        b'{"cwd": "/etc\\u001b]0;x\\u0007"}',  # a terminal escape
        b'{"cwd": "/' + b"a" * 5000 + b'"}',  # longer than PATH_MAX
        b'{"cwd": ["/etc"]}',
        b"not json",
        b"link",  # the mark a link to a good one: never followed
    ],
)
def test_a_kept_boxs_hostile_working_directory_is_not_used(kept: tuple[Path, str], mark: bytes) -> None:
    """The keep mark lies in the home on disk: only an absolute, bounded path with no control
    character is taken (handed to the box's agent, never opened on the host)."""
    home, out = kept
    name = _kept_names(out)["test_boxed_fails"]
    path = home / "namespace" / f"{name}.keep"
    saved = path.read_bytes()
    good = home / "good-mark"
    try:
        path.unlink()
        if mark == b"link":
            good.write_bytes(b'{"cwd": "/etc"}')
            path.symlink_to(good)
        else:
            path.write_bytes(mark)
        r = _cli("--home", str(home), "shell", name, "pwd")
        assert (r.returncode, r.stdout) == (0, "/workspace\n"), (r.stdout, r.stderr)
    finally:
        path.unlink()
        path.write_bytes(saved)
        good.unlink(missing_ok=True)


def test_a_kept_boxs_directory_that_is_gone_falls_back_and_says_so(kept: tuple[Path, str]) -> None:
    home, out = kept
    name = _kept_names(out)["test_boxed_fails"]
    path = home / "namespace" / f"{name}.keep"
    saved = path.read_bytes()
    try:
        path.write_bytes(b'{"cwd": "/no/such/dir\\u00e9"}')
        r = _cli("--home", str(home), "shell", name, "pwd")
        assert (r.returncode, r.stdout) == (0, "/workspace\n"), (r.stdout, r.stderr)
        assert "/no/such/dir\u00e9 cannot be entered in the box: starting in its default directory" in r.stderr
    finally:
        path.write_bytes(saved)
