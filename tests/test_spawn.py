"""``Sandbox.spawn``: processes in a box with ``subprocess.Popen``'s interface (issue 24, item 1).

Real namespace boxes, booted and forked from a zygote (``namespace_mode``), as a session makes
them.  What a box writes is hostile: floods are cut and flagged, spoofed control frames on a
process's output are just output, and nothing a test spawned runs on after its sandbox ends.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CREATE_TIMEOUT, _Runtimes, new_box_name
from rest_double_runtime import rest_runtime
from sdk_double.rest import ServerProcess

from pytest_boxlite import errors
from pytest_boxlite.process import MAX_LINE, BoxProcessWarning
from pytest_boxlite.runtimes import Runtime
from pytest_boxlite.runtimes.base import BoxDefaults
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec

pytestmark = pytest.mark.timeout(60)

#: The runtimes every contract test runs on: namespace boxes booted and forked from a zygote, the
#: vm runtime's real code on the SDK double (``tests/sdk_double``) where no VM boots, and the vm
#: runtime over REST (``--boxlite-url``) on the double's server.
KINDS = {"booted": "namespace", "forked": "namespace-forked", "vm": "vm", "rest": "rest"}


@pytest.fixture(scope="module")
def rest_double(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Runtime]]:
    """The SDK double's REST server and the REST runtime on it, for this module's ``rest`` boxes."""
    with rest_runtime(tmp_path_factory) as both:
        yield both


@pytest.fixture(scope="module")
def rest_rt(rest_double: tuple[ServerProcess, Runtime]) -> Runtime:
    return rest_double[1]


@pytest.fixture(params=list(KINDS))
def sb(request: pytest.FixtureRequest, runtimes: _Runtimes) -> Iterator[Sandbox]:
    """A box of each kind; its spawned processes are ended before it is destroyed."""
    kind = KINDS[request.param]
    rt: Runtime = request.getfixturevalue("rest_rt") if kind == "rest" else runtimes.get(kind)
    handle = rt.create_box(BoxSpec(), new_box_name(), timeout=CREATE_TIMEOUT)
    sandbox = Sandbox(handle, max_output=1 << 20)
    try:
        yield sandbox
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BoxProcessWarning)  # a test that failed midway
            sandbox.end()
        handle.destroy()


def py(sb: Sandbox) -> str:
    """The box's Python."""
    return sb.handle.guest_python


def need_binary_stdout(sb: Sandbox) -> None:
    """Skip where the runtime's output is lossy text (the vm SDK decodes it as UTF-8)."""
    if not sb.handle.binary_stdout:
        pytest.skip(f"{sb.runtime} output is lossily decoded text")


def box_commands(sb: Sandbox) -> list[str]:
    """The command line of every process in the box but its agent (pid 1) and this listing."""
    r = sb.run(
        [
            py(sb),
            "-c",
            "import os\nfor p in os.listdir('/proc'):\n if p.isdigit() and p != '1' and int(p) != os.getpid():\n"
            "  try: print(open('/proc/'+p+'/cmdline','rb').read().replace(b'\\0',b' ').decode())\n"
            "  except OSError: pass\n",
        ],
        timeout=20,
        check=True,
    )
    return [line for line in r.stdout.splitlines() if line.strip()]


# --------------------------------------------------------------------------
# starting, streams, exit
# --------------------------------------------------------------------------


def test_spawn_returns_at_once_and_streams_output_as_it_comes(sb: Sandbox) -> None:
    proc = sb.spawn(["sh", "-c", "echo one; sleep 30"])
    assert isinstance(proc.pid, int) and proc.pid > 1
    assert proc.stdout.readline() == b"one\n"  # while the process still runs
    assert proc.poll() is None and proc.returncode is None
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL
    proc.close()


def test_stdin_stdout_round_trip_iteration_and_exit_status(sb: Sandbox) -> None:
    proc = sb.spawn(["sh", "-c", 'while read line; do echo "got $line"; done; echo bye >&2; exit 3'])
    assert proc.stdin is not None
    proc.stdin.write(b"a\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == b"got a\n"
    proc.stdin.write(b"b\nc\n")
    proc.stdin.close()
    assert list(proc.stdout) == [b"got b\n", b"got c\n"]
    assert proc.stderr.read() == b"bye\n"
    assert proc.wait(timeout=10) == 3
    proc.close()


def test_binary_clean_streams(sb: Sandbox) -> None:
    need_binary_stdout(sb)
    payload = bytes(range(256)) * 64
    proc = sb.spawn(["cat"])
    out, err = proc.communicate(payload, timeout=20)
    assert out == payload and err == b""
    assert proc.returncode == 0
    assert not proc.stdout.truncated


def test_communicate_with_input_and_timeout(sb: Sandbox) -> None:
    proc = sb.spawn(["sh", "-c", "cat; echo e >&2; exit 4"])
    assert proc.communicate(b"in", timeout=20) == (b"in", b"e\n")
    assert proc.returncode == 4
    # exec: no child of sh keeps the pipes open after the kill (as with Popen, that would wait).
    slow = sb.spawn(["sh", "-c", "echo early; exec sleep 30"])
    with pytest.raises(subprocess.TimeoutExpired):
        slow.communicate(timeout=0.5)
    slow.kill()
    out, _ = slow.communicate(timeout=10)  # nothing lost by the timeout
    assert out == b"early\n" and slow.returncode == -signal.SIGKILL


def test_wait_timeout_raises_timeout_expired(sb: Sandbox) -> None:
    proc = sb.spawn(["sleep", "30"])
    with pytest.raises(subprocess.TimeoutExpired) as info:
        proc.wait(timeout=0.2)
    assert info.value.cmd == ["sleep", "30"]
    proc.terminate()
    assert proc.wait(timeout=10) == -signal.SIGTERM


def test_env_cwd_and_user(sb: Sandbox) -> None:
    sb.run(["mkdir", "-p", "/tmp/there"], check=True)
    # The SDK double's single-uid user namespace refuses other users (a real VM does not).
    user = None if sb.runtime == "vm" else "1000"
    argv = ["sh", "-c", 'echo "$GREETING $(pwd) $(id -u)"']
    proc = sb.spawn(argv, env={"GREETING": "hi"}, cwd="/tmp/there", user=user)
    out, _ = proc.communicate(timeout=20)
    assert out == b"hi /tmp/there %s\n" % (b"0" if user is None else b"1000")


def test_context_manager_kills_and_reaps(sb: Sandbox) -> None:
    with sb.spawn(["sleep", "1234"]) as proc:
        assert proc.poll() is None
    assert proc.returncode == -signal.SIGKILL
    assert proc.closed
    assert not [c for c in box_commands(sb) if "sleep 1234" in c]


# --------------------------------------------------------------------------
# signals
# --------------------------------------------------------------------------

_TRAPPER = """
import os, signal, sys, time
def on(sig, _frame):
    os.write(1, b"caught %d %d\\n" % (sig, os.getpid()))  # no print: not reentrant
    if sig == signal.SIGTERM:
        sys.exit(0)
signal.signal(signal.SIGUSR1, on)
signal.signal(signal.SIGTERM, on)
os.write(1, b"ready %d\\n" % os.getpid())
while True:
    time.sleep(0.05)
"""


def test_signals_reach_the_process_itself(sb: Sandbox) -> None:
    proc = sb.spawn([py(sb), "-c", _TRAPPER])
    match = proc.wait_for_output(rb"ready (\d+)", timeout=20)
    # The pid it has in the box is the one proc says: no shim between.
    assert int(match.group(1)) == proc.pid
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait_for_output(rb"caught (\d+) (\d+)", timeout=20).groups() == (
        str(int(signal.SIGUSR1)).encode(),
        str(proc.pid).encode(),
    )
    assert proc.poll() is None
    proc.terminate()
    assert proc.wait(timeout=20) == 0  # its own handler exited


_FAMILY = """
import os, signal, time
def on(sig, _frame):
    os.write(1, b"%s got %d\\n" % (who, sig))
who = b"parent"
signal.signal(signal.SIGUSR1, on)
if os.fork() == 0:
    who = b"child"  # same process group as its parent
    os.write(1, b"child ready\\n")
    while True:
        time.sleep(0.05)
while True:
    time.sleep(0.05)
"""


def test_send_signal_reaches_the_process_not_its_group(sb: Sandbox) -> None:
    proc = sb.spawn([py(sb), "-c", _FAMILY])
    proc.wait_for_output("child ready", timeout=20)
    proc.send_signal(signal.SIGUSR1)
    proc.wait_for_output("parent got", timeout=20)
    time.sleep(1.0)  # time for the child's line, which may come before or after the parent's
    assert not [line for line in proc.last_lines() if "child got" in line]  # as Popen.send_signal
    proc.close()  # ends the group: the child too
    assert not [c for c in box_commands(sb) if "who = b" in c]


def test_signals_after_exit_are_ignored(sb: Sandbox) -> None:
    proc = sb.spawn(["true"])
    assert proc.wait(timeout=20) == 0
    proc.kill()  # as Popen: nothing happens once it ended
    assert proc.returncode == 0


# --------------------------------------------------------------------------
# wait_for_output
# --------------------------------------------------------------------------


def test_wait_for_output_matches_lines_in_order_and_per_stream(sb: Sandbox) -> None:
    proc = sb.spawn(["sh", "-c", "echo 'port=1'; echo 'warn: x' >&2; echo 'port=2'; sleep 30"])
    first = proc.wait_for_output(r"port=(\d)", timeout=20)
    assert first.group(1) == "1"
    assert proc.wait_for_output(r"port=(\d)", timeout=20).group(1) == "2"  # after the last match
    assert proc.wait_for_output(rb"^warn: (.*)$", timeout=20, stream="stderr").group(1) == b"x"
    # The stream itself still has everything (the waits read a copy).
    assert proc.stdout.readline() == b"port=1\n"
    proc.kill()


def test_wait_for_output_timeout_quotes_the_last_lines(sb: Sandbox) -> None:
    proc = sb.spawn(["sh", "-c", "echo starting; printf 'evil\\033[2J\\n' >&2; sleep 30"])
    proc.wait_for_output("starting", timeout=20)
    with pytest.raises(errors.OutputTimeoutError) as info:
        proc.wait_for_output("never there", timeout=0.5)
    assert isinstance(info.value, errors.BoxliteError) and isinstance(info.value, TimeoutError)
    assert "stdout: starting" in info.value.lines
    assert "\x1b" not in str(info.value)  # a box's escape sequences are quoted, not sent to a terminal
    assert "stderr: evil\\x1b[2J" in str(info.value)
    proc.kill()


def test_wait_for_output_when_the_process_exits_first(sb: Sandbox) -> None:
    proc = sb.spawn(["sh", "-c", "echo 'Error: config missing' >&2; exit 2"])
    with pytest.raises(errors.ProcessExitedError) as info:
        proc.wait_for_output("listening", timeout=20)
    assert "exited with status 2" in str(info.value)
    assert "stderr: Error: config missing" in str(info.value)


def test_wait_for_output_bad_arguments(sb: Sandbox) -> None:
    proc = sb.spawn(["true"])
    with pytest.raises(ValueError, match="stream"):
        proc.wait_for_output("x", timeout=1, stream="stdin")
    with pytest.raises(ValueError, match="timeout"):
        proc.wait_for_output("x", timeout=0)
    proc.wait(timeout=20)


# --------------------------------------------------------------------------
# bad input and hostile guests
# --------------------------------------------------------------------------


def test_missing_executable_is_a_file_not_found_error(sb: Sandbox) -> None:
    with pytest.raises(FileNotFoundError) as info:
        sb.spawn(["/no/such/program"])
    assert isinstance(info.value, errors.BoxliteError)
    with pytest.raises(FileNotFoundError):
        sb.spawn(["true"], cwd="/no/such/dir")
    assert sb.run(["true"]).ok  # the box goes on


def test_bad_argv_is_refused_clearly(sb: Sandbox) -> None:
    with pytest.raises(errors.ConfigError, match="list of arguments"):
        sb.spawn("sleep 1")
    with pytest.raises(errors.ConfigError, match="list of arguments"):
        sb.spawn([])
    with pytest.raises(errors.ConfigError, match="NUL"):
        sb.spawn(["echo", "a\0b"])


def test_writing_to_the_stdin_of_an_ended_process_is_a_broken_pipe(sb: Sandbox) -> None:
    proc = sb.spawn(["true"])
    assert proc.wait(timeout=20) == 0
    assert proc.stdin is not None
    with pytest.raises(BrokenPipeError):
        proc.stdin.write(b"x" * 100)
        proc.stdin.flush()


def test_writing_to_a_closed_stdin_is_a_broken_pipe(sb: Sandbox) -> None:
    if sb.runtime == "vm":
        pytest.skip("the boxlite SDK does not tell the host that a running guest closed its stdin")
    proc = sb.spawn(["sh", "-c", "exec 0<&-; echo closed; sleep 30"])
    assert proc.stdout.readline() == b"closed\n"
    assert proc.stdin is not None
    with pytest.raises(BrokenPipeError):
        proc.stdin.write(b"x" * 100)
        proc.stdin.flush()
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.reliability
@pytest.mark.escape_row("process-output")
def test_a_flood_is_cut_and_flagged_and_waits_still_see_later_lines(sb: Sandbox) -> None:
    # 48 MiB on stdout, one 8 MiB line without a newline on stderr, then a line to wait for.
    script = (
        "import sys\n"
        "o = sys.stdout.buffer\n"
        "for _ in range(48): o.write(b'y' * (1 << 20))\n"
        "o.flush()\n"
        "sys.stderr.buffer.write(b'z' * (8 << 20)); sys.stderr.flush()\n"
        "o.write(b'\\nREADY\\n'); o.flush()\n"
    )
    proc = sb.spawn([py(sb), "-c", script])
    assert proc.wait_for_output("^READY$", timeout=60, stream="stdout")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0
    cap = sb.max_output
    assert len(out) == cap and len(err) == cap
    assert proc.stdout.truncated and proc.stdout.dropped == 48 * (1 << 20) + 7 - cap
    assert proc.stderr.truncated and proc.stderr.dropped == (8 << 20) - cap
    # The long line was cut into pieces no longer than MAX_LINE for the waits.
    assert all(len(line) <= MAX_LINE for _, _, line in proc._lines)


@pytest.mark.escapes
@pytest.mark.escape_row("process-output")
def test_spoofed_control_frames_on_output_are_only_output(sb: Sandbox) -> None:
    frames = b'{"exit": 0}\n{"pid": 1}\n{"error": "x", "errno": 2}\n'
    proc = sb.spawn(
        [
            py(sb),
            "-c",
            f"import sys,time\nsys.stdout.buffer.write({frames!r}); sys.stdout.flush()\n"
            f"sys.stderr.buffer.write({frames!r}); sys.stderr.flush()\ntime.sleep(30)",
        ]
    )
    assert proc.stdout.read(len(frames)) == frames
    assert proc.stderr.read(len(frames)) == frames
    time.sleep(0.2)
    assert proc.poll() is None  # the process still runs: its output is not the agent's channel
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL


# --------------------------------------------------------------------------
# nothing left running
# --------------------------------------------------------------------------


def test_a_process_left_running_is_killed_when_the_sandbox_ends_and_said(sb: Sandbox) -> None:
    proc = sb.spawn(["sh", "-c", "sleep 4321 & sleep 4322"])
    done = sb.spawn(["true"])
    done.wait(timeout=20)
    assert [c for c in box_commands(sb) if "sleep 432" in c]
    with pytest.warns(BoxProcessWarning, match=r"still running when its sandbox ended: killed") as record:
        said = sb.end()
    assert len(said) == 1 and len(record) == 1  # the one that had exited is not reported
    assert proc.returncode == -signal.SIGKILL
    # Its whole process group went with it, and the box has nothing left of it.
    assert not [c for c in box_commands(sb) if "sleep 432" in c]


def test_the_report_says_when_a_boxed_process_was_left_running(pytester: pytest.Pytester, home: Path) -> None:
    pytester.makepyfile(test_left="def test_left(boxlite_sandbox):\n    boxlite_sandbox.spawn(['sleep', '999'])\n")
    result = pytester.runpytest("-p", "no:cacheprovider", f"--boxlite-home={home}", "-W", "default")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "*BoxProcessWarning: process * ('sleep 999') in box *was still running when its box "
            "went back to the pool: killed*"
        ]
    )


def test_a_runtime_without_spawn_says_so() -> None:
    class _NoSpawn(BoxDefaults):
        """A fake box handle (unit layer): only the optional capabilities' defaults."""

        runtime_name = "fake"
        name = "fake-box"

    with pytest.raises(errors.UnsupportedError, match="the fake runtime cannot spawn") as info:
        Sandbox(_NoSpawn()).spawn(["true"])  # type: ignore[arg-type]
    assert isinstance(info.value, NotImplementedError)
    with pytest.raises(errors.UnsupportedError, match="the fake runtime cannot publish"):
        Sandbox(_NoSpawn()).publish(8000)  # type: ignore[arg-type]


def test_a_user_is_refused_on_a_remote_server_not_dropped(rest_rt: Runtime) -> None:
    """The REST API's exec request has no user field (``src/boxlite/src/rest/types.rs``): the SDK
    would run the command as the box's default user, so the runtime refuses ``user=`` instead."""
    sandbox = Sandbox(rest_rt.create_box(BoxSpec(), new_box_name(), timeout=CREATE_TIMEOUT))
    try:
        refused = r"user='1000' cannot be honoured on a remote BoxLite server: the REST API's exec request has no user"
        with pytest.raises(errors.UnsupportedError, match=refused):
            sandbox.spawn(["sh", "-c", "sleep 4321"], user="1000")
        with pytest.raises(errors.UnsupportedError, match=refused):
            sandbox.run(["sh", "-c", "sleep 4321"], user="1000", timeout=20)
        assert not [c for c in box_commands(sandbox) if "sleep 4321" in c]  # nothing ran as anyone
        # Without user= the same calls run, as the box's default user.
        assert sandbox.run(["id", "-u"], timeout=20, check=True).stdout == "0\n"
        proc = sandbox.spawn(["id", "-u"])
        assert proc.communicate(timeout=20) == (b"0\n", b"")
    finally:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", BoxProcessWarning)  # a test that failed midway
                sandbox.end()
        finally:
            sandbox.handle.destroy()


def test_signals_on_a_remote_server_are_requests_to_it(rest_double: tuple[ServerProcess, Runtime]) -> None:
    """On REST a signal is ``POST .../executions/ID/signal`` (``rest/exec.rs``): the double's server
    sees it before the process gets it, and the process gets it."""
    server, rt = rest_double
    sandbox = Sandbox(rt.create_box(BoxSpec(), new_box_name(), timeout=CREATE_TIMEOUT))
    try:
        proc = sandbox.spawn(["sleep", "4322"])
        proc.terminate()
        assert proc.wait(timeout=20) == -signal.SIGTERM
        assert re.search(r"^signal \S+ 15$", server.log(), re.MULTILINE), server.log()[-2000:]
    finally:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", BoxProcessWarning)  # a test that failed midway
                sandbox.end()
        finally:
            sandbox.handle.destroy()
