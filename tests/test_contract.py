"""The sandbox contract: what every runtime's box offers through :class:`Sandbox`.

Every test here runs once per runtime kind (``namespace``, ``vm``).  Where no
micro-VM can boot (every machine of this project's CI), the vm variants run the
vm runtime's real code (exec, file helpers, stdio bridge) on the boxlite SDK
double of ``tests/sdk_double``: bubblewrap sandboxes behind the SDK's exact
surface and quirks.  On a KVM host they run on real micro-VMs.
"""

from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

import pytest
from conftest import new_box_name

from pytest_boxlite import errors
from pytest_boxlite.runtimes import Runtime
from pytest_boxlite.sandbox import ExecResult, GrepMatch, Sandbox, SearchResult
from pytest_boxlite.spec import BoxSpec

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def shared(runtime: Runtime) -> Iterator[Sandbox]:
    """One box per runtime for tests that only check argument validation (they change nothing)."""
    handle = runtime.create_box(BoxSpec(), new_box_name(), timeout=30)
    try:
        yield Sandbox(handle)
    finally:
        handle.destroy()


def need_binary_stdout(sb: Sandbox) -> None:
    """Skip where the runtime's exec stdout is lossy text (the vm SDK decodes it as UTF-8)."""
    if not sb.handle.binary_stdout:
        pytest.skip(f"{sb.runtime} exec output is lossily decoded text; exact bytes need the file helpers")


def sh(sb: Sandbox, command: str, timeout: float = 20) -> str:
    """Run a shell command that must succeed; return its stdout."""
    return sb.execute_command(command, timeout=timeout, check=True).stdout


def ws(sb: Sandbox, *parts: str) -> str:
    """An absolute guest path under the box's working directory."""
    return posixpath.join(sb.workdir, *parts)


# --------------------------------------------------------------------------
# identity
# --------------------------------------------------------------------------


def test_identity(sandbox: Sandbox, runtime_kind: str) -> None:
    assert sandbox.runtime == runtime_kind.removesuffix("-forked")
    assert (getattr(sandbox.handle, "forked_from", None) is not None) == runtime_kind.endswith("-forked")
    assert sandbox.name.startswith("pbx-test")
    assert sandbox.id
    assert sandbox.workdir.startswith("/")
    assert sandbox.name in repr(sandbox)
    assert sh(sandbox, "pwd").strip() == sandbox.workdir


# --------------------------------------------------------------------------
# execute_command
# --------------------------------------------------------------------------


def test_execute_command_captures_stdout_stderr_and_exit_code(sandbox: Sandbox) -> None:
    r = sandbox.execute_command("echo out; echo err >&2; exit 7", timeout=20)
    assert isinstance(r, ExecResult)
    assert r.command == "echo out; echo err >&2; exit 7"
    assert r.stdout == "out\n"
    assert r.stderr == "err\n"
    assert r.stdout_bytes == b"out\n"
    assert r.exit_code == 7
    assert not r.timed_out
    assert not r.ok
    assert not r.truncated
    assert 0 <= r.duration < 20


def test_execute_command_success_is_ok(sandbox: Sandbox) -> None:
    r = sandbox.execute_command("true", timeout=20)
    assert r.exit_code == 0
    assert r.ok
    assert r.check() is r
    assert r.stdout == r.stderr == ""


def test_execute_command_shell_features(sandbox: Sandbox) -> None:
    script = (
        'x=abc; echo "$x" | tr a-z A-Z; '
        "(cd / && pwd); "
        "false || echo fallback; "
        "true && echo chained; "
        "echo redirected > r.txt; cat < r.txt; "
        "for i in 1 2 3; do printf '%s,' \"$i\"; done; echo; "
        'echo "$(echo nested)"; '
        "cat <<EOF\nheredoc $x\nEOF\n"
    )
    out = sh(sandbox, script)
    assert out == "ABC\n/\nfallback\nchained\nredirected\n1,2,3,\nnested\nheredoc abc\n"


def test_execute_command_signal_death_is_negative(sandbox: Sandbox) -> None:
    r = sandbox.execute_command("kill -9 $$", timeout=20)
    assert r.exit_code == -9
    assert not r.ok


def test_execute_command_rejects_non_string(shared: Sandbox) -> None:
    with pytest.raises(errors.ConfigError):
        shared.execute_command(["echo", "hi"])  # type: ignore[arg-type]


def test_execute_command_check_raises(sandbox: Sandbox) -> None:
    with pytest.raises(errors.CommandError) as info:
        sandbox.execute_command("echo partial; echo oops >&2; exit 4", check=True, timeout=20)
    assert info.value.result.exit_code == 4
    assert "exited with status 4" in str(info.value)
    assert "partial" in str(info.value)
    assert "oops" in str(info.value)


def test_binary_output_is_exact(sandbox: Sandbox) -> None:
    need_binary_stdout(sandbox)
    r = sandbox.execute_command(r"printf '\000\001\377\376A'", timeout=20)
    assert r.stdout_bytes == b"\x00\x01\xff\xfeA"
    assert r.stdout == "\x00\x01\ufffd\ufffdA"


def test_stdin_is_empty_without_input(sandbox: Sandbox) -> None:
    # Without input a command reading stdin must see EOF, not hang.
    t0 = time.monotonic()
    r = sandbox.run(["cat"], timeout=10)
    assert r.ok
    assert r.stdout == ""
    assert time.monotonic() - t0 < 5


def test_concurrent_commands_on_one_box(sandbox: Sandbox) -> None:
    results: dict[int, str] = {}

    def work(i: int) -> None:
        results[i] = sandbox.execute_command(f"sleep 0.2; echo {i}", timeout=20).stdout

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {i: f"{i}\n" for i in range(8)}
    # They ran side by side, not one after another.
    assert time.monotonic() - t0 < 1.5


# --------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------


def test_run_passes_argv_without_a_shell(sandbox: Sandbox) -> None:
    r = sandbox.run(["printf", "%s|", "$HOME", "a b", "*", "'q'", "; rm -rf /"], timeout=20)
    assert r.ok
    assert r.stdout == "$HOME|a b|*|'q'|; rm -rf /|"
    assert r.command == shlex.join(["printf", "%s|", "$HOME", "a b", "*", "'q'", "; rm -rf /"])


def test_run_input_bytes(sandbox: Sandbox) -> None:
    r = sandbox.run(["cat"], input=b"hello bytes\n", timeout=20)
    assert r.stdout_bytes == b"hello bytes\n"


def test_run_input_binary_bytes(sandbox: Sandbox) -> None:
    need_binary_stdout(sandbox)
    payload = bytes(range(256)) * 4
    r = sandbox.run(["cat"], input=payload, timeout=20)
    assert r.stdout_bytes == payload


def test_run_input_str(sandbox: Sandbox) -> None:
    r = sandbox.run(["cat"], input="héllo wörld ☃\n", timeout=20)
    assert r.stdout == "héllo wörld ☃\n"


def test_run_large_input(sandbox: Sandbox) -> None:
    # Larger than any pipe buffer: stdin must be pumped while output is read.
    r = sandbox.run(["wc", "-c"], input=b"x" * (3 << 20), timeout=30)
    assert r.stdout.strip() == str(3 << 20)


def test_run_large_output(sandbox: Sandbox) -> None:
    r = sandbox.execute_command("head -c 5000000 /dev/zero | tr '\\0' z", timeout=30)
    assert r.ok
    assert r.stdout_bytes == b"z" * 5_000_000
    assert not r.stdout_truncated


def test_run_env(sandbox: Sandbox) -> None:
    r = sandbox.run(["sh", "-c", 'printf "%s" "$FOO"'], env={"FOO": "bar baz $x ü"}, timeout=20)
    assert r.stdout == "bar baz $x ü"
    r = sandbox.execute_command('printf "%s" "$A_1"', env={"A_1": ""}, timeout=20)
    assert r.ok
    assert r.stdout == ""


def test_host_environment_does_not_leak(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBX_HOST_ONLY_SECRET", "leaked")
    r = sandbox.execute_command('printf "%s" "${PBX_HOST_ONLY_SECRET-unset}"', timeout=20)
    assert r.stdout == "unset"


def test_run_cwd(sandbox: Sandbox) -> None:
    assert sandbox.run(["pwd"], cwd="/etc", timeout=20).stdout == "/etc\n"
    assert sandbox.run(["pwd"], cwd=PurePosixPath("/"), timeout=20).stdout == "/\n"
    sh(sandbox, "mkdir -p sub/dir")
    assert sandbox.run(["pwd"], cwd="sub/dir", timeout=20).stdout == ws(sandbox, "sub/dir") + "\n"
    assert sandbox.run(["pwd"], cwd="sub/dir/../..", timeout=20).stdout == sandbox.workdir + "\n"


def test_run_missing_cwd_fails(sandbox: Sandbox) -> None:
    try:
        r = sandbox.run(["pwd"], cwd="/no/such/dir", timeout=20)
    except errors.BoxliteError:
        return
    assert not r.ok, "a command given a missing cwd must not succeed"


def test_run_missing_program_fails(sandbox: Sandbox) -> None:
    try:
        r = sandbox.run(["pbx-no-such-program"], timeout=20)
    except errors.BoxliteError as exc:
        assert isinstance(exc, FileNotFoundError)
        return
    assert not r.ok


def test_run_check_raises_command_error(sandbox: Sandbox) -> None:
    argv = ["sh", "-c", "echo some-out; echo some-err >&2; exit 3"]
    with pytest.raises(errors.CommandError) as info:
        sandbox.run(argv, check=True, timeout=20)
    exc = info.value
    assert isinstance(exc, errors.BoxliteError)
    assert exc.result.exit_code == 3
    assert exc.result.command == shlex.join(argv)
    assert exc.result.stdout == "some-out\n"
    assert exc.result.stderr == "some-err\n"
    text = str(exc)
    assert shlex.join(argv) in text
    assert "exited with status 3" in text
    assert "some-out" in text
    assert "some-err" in text


def test_run_check_passes_on_success(sandbox: Sandbox) -> None:
    r = sandbox.run(["echo", "fine"], check=True, timeout=20)
    assert r.stdout == "fine\n"


@pytest.mark.parametrize("argv", ["echo hi", b"echo", [], ()])
def test_run_rejects_non_lists(shared: Sandbox, argv: object) -> None:
    with pytest.raises(errors.ConfigError):
        shared.run(argv, timeout=20)  # type: ignore[arg-type]


def test_run_rejects_nul_in_argument(shared: Sandbox) -> None:
    with pytest.raises(errors.ConfigError):
        shared.run(["echo", "a\0b"], timeout=20)


@pytest.mark.parametrize("bad", [0, -1, -0.5, True, "5"])
def test_bad_timeouts_are_config_errors(shared: Sandbox, bad: object) -> None:
    with pytest.raises(errors.ConfigError):
        shared.execute_command("true", timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigError):
        shared.read_file("/etc/hostname", timeout=bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# timeouts
# --------------------------------------------------------------------------


def _dead_in_box(sb: Sandbox, pid: str, wait: float = 3.0) -> bool:
    """Whether ``pid`` (a pid in the box) is gone or a zombie, polling up to ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        state = sb.execute_command(f"cat /proc/{pid}/stat 2>/dev/null", timeout=10).stdout
        if not state or state.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_timeout_kills_and_keeps_partial_output(sandbox: Sandbox) -> None:
    t0 = time.monotonic()
    r = sandbox.execute_command(
        "echo $$ > /tmp/sh.pid; sleep 30 & echo $! > /tmp/sleep.pid; echo before; wait; echo after",
        timeout=0.5,
    )
    elapsed = time.monotonic() - t0
    assert elapsed < 5
    assert r.timed_out
    assert not r.ok
    assert r.exit_code is None or r.exit_code < 0
    assert r.stdout == "before\n"
    assert "after" not in r.stdout
    # Both the shell and the sleep it started are really gone.
    for f in ("/tmp/sh.pid", "/tmp/sleep.pid"):
        pid = sandbox.read_file(f).strip()
        assert pid.isdigit()
        assert _dead_in_box(sandbox, pid), f"process {pid} from {f} survived the timeout"


def test_timeout_on_run(sandbox: Sandbox) -> None:
    t0 = time.monotonic()
    r = sandbox.run(["sleep", "30"], timeout=0.3)
    assert time.monotonic() - t0 < 5
    assert r.timed_out
    assert not r.ok


def test_timeout_with_check_raises(sandbox: Sandbox) -> None:
    with pytest.raises(errors.CommandError, match="timed out"):
        sandbox.execute_command("sleep 30", timeout=0.3, check=True)


def test_default_timeout_applies(sandbox: Sandbox) -> None:
    quick = Sandbox(sandbox.handle, default_timeout=0.4)
    t0 = time.monotonic()
    r = quick.execute_command("sleep 30")
    assert time.monotonic() - t0 < 5
    assert r.timed_out


def test_background_child_holding_output_open_does_not_block(sandbox: Sandbox) -> None:
    # The answer comes when the shell exits, not when the child that holds its output does: far
    # below the child's 120 s (a loaded machine makes a REST round trip take seconds, so the bound
    # is the child's life, not a small number).
    t0 = time.monotonic()
    r = sandbox.execute_command("sleep 120 & echo done", timeout=100)
    assert time.monotonic() - t0 < 60
    assert r.exit_code == 0
    assert not r.timed_out
    assert r.stdout == "done\n"


def test_file_operation_timeout_is_bounded(sandbox: Sandbox) -> None:
    # Reading a FIFO nobody writes to blocks forever: the helper's bound must fire.
    sh(sandbox, "mkfifo fifo")
    t0 = time.monotonic()
    with pytest.raises(errors.BoxTimeoutError) as info:
        sandbox.read_file("fifo", timeout=0.5)
    assert isinstance(info.value, TimeoutError)
    assert time.monotonic() - t0 < 5
    # The box is still usable afterwards.
    assert sh(sandbox, "echo ok") == "ok\n"


# --------------------------------------------------------------------------
# env validation
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env",
    [
        {"BAD-KEY": "x"},
        {"1ABC": "x"},
        {"": "x"},
        {"A=B": "x"},
        {"A B": "x"},
        {"NUL": "a\0b"},
        {"NOTSTR": 1},
        {"ÜMLAUT": "x"},
    ],
)
def test_bad_env_raises_config_error(shared: Sandbox, env: dict[str, object]) -> None:
    with pytest.raises(errors.ConfigError):
        shared.execute_command("true", env=env, timeout=20)  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigError):
        shared.run(["true"], env=env, timeout=20)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# output cap
# --------------------------------------------------------------------------


def test_output_cap_truncates_and_flags(sandbox: Sandbox) -> None:
    small = Sandbox(sandbox.handle, max_output=1000)
    r = small.execute_command("head -c 5000 /dev/zero | tr '\\0' a; head -c 10 /dev/zero | tr '\\0' e >&2", timeout=20)
    assert r.ok
    assert r.stdout_bytes == b"a" * 1000
    assert r.stdout_truncated
    assert r.truncated
    assert r.stderr == "e" * 10
    assert not r.stderr_truncated


def test_output_cap_on_stderr(sandbox: Sandbox) -> None:
    small = Sandbox(sandbox.handle, max_output=100)
    r = small.execute_command("head -c 1000 /dev/zero | tr '\\0' e >&2", timeout=20)
    assert r.stderr == "e" * 100
    assert r.stderr_truncated
    assert not r.stdout_truncated
    assert r.truncated


def test_output_exactly_at_cap_is_not_truncated(sandbox: Sandbox) -> None:
    small = Sandbox(sandbox.handle, max_output=1000)
    at = small.execute_command("head -c 1000 /dev/zero | tr '\\0' a", timeout=20)
    assert len(at.stdout_bytes) == 1000
    assert not at.truncated
    over = small.execute_command("head -c 1001 /dev/zero | tr '\\0' a", timeout=20)
    assert len(over.stdout_bytes) == 1000
    assert over.stdout_truncated


def test_output_cap_exceeding_command_still_completes(sandbox: Sandbox) -> None:
    # A command writing far past the cap must run to completion (its output drained), not block.
    small = Sandbox(sandbox.handle, max_output=10)
    t0 = time.monotonic()
    r = small.execute_command("head -c 20000000 /dev/zero; echo done >&2", timeout=30)
    assert r.ok
    assert r.stderr == "done\n"
    assert r.stdout_truncated
    assert time.monotonic() - t0 < 20


# --------------------------------------------------------------------------
# read_file / write_file
# --------------------------------------------------------------------------


def test_read_file_line_ranges(sandbox: Sandbox) -> None:
    sandbox.write_file("lines.txt", "l1\nl2\nl3\nl4\n")
    assert sandbox.read_file("lines.txt") == "l1\nl2\nl3\nl4\n"
    assert sandbox.read_file("lines.txt", start_line=2, end_line=3) == "l2\nl3\n"
    assert sandbox.read_file("lines.txt", start_line=3) == "l3\nl4\n"
    assert sandbox.read_file("lines.txt", end_line=1) == "l1\n"
    assert sandbox.read_file("lines.txt", start_line=4, end_line=4) == "l4\n"
    assert sandbox.read_file("lines.txt", start_line=2, end_line=100) == "l2\nl3\nl4\n"
    assert sandbox.read_file("lines.txt", start_line=5) == ""
    assert sandbox.read_file("lines.txt", start_line=3, end_line=2) == ""


def test_read_file_last_line_without_newline(sandbox: Sandbox) -> None:
    sandbox.write_file("nonl.txt", "a\nb")
    assert sandbox.read_file("nonl.txt", start_line=2) == "b"
    assert sandbox.read_file("nonl.txt", start_line=1, end_line=1) == "a\n"


@pytest.mark.parametrize(
    "kwargs", [{"start_line": 0}, {"end_line": -1}, {"start_line": True}, {"end_line": "2"}, {"start_line": 1.5}]
)
def test_read_file_bad_line_numbers(shared: Sandbox, kwargs: dict[str, object]) -> None:
    with pytest.raises(errors.ConfigError):
        shared.read_file("/etc/hostname", **kwargs)  # type: ignore[arg-type]


def test_read_file_replaces_invalid_utf8(sandbox: Sandbox) -> None:
    sandbox.write_bytes("bad.txt", b"ok \xff\xfe end")
    assert sandbox.read_file("bad.txt") == "ok \ufffd\ufffd end"


def test_write_file_overwrites_and_appends(sandbox: Sandbox) -> None:
    sandbox.write_file("log.txt", "a\n")
    sandbox.write_file("log.txt", "b\n")
    assert sandbox.read_file("log.txt") == "b\n"
    sandbox.write_file("log.txt", "c\n", append=True)
    sandbox.write_bytes("log.txt", b"d\n", append=True)
    assert sandbox.read_file("log.txt") == "b\nc\nd\n"
    sandbox.write_file("new-by-append.txt", "first\n", append=True)
    assert sandbox.read_file("new-by-append.txt") == "first\n"


def test_write_file_is_visible_to_commands(sandbox: Sandbox) -> None:
    sandbox.write_file("/tmp/seen.txt", "from the helper\n")
    assert sh(sandbox, "cat /tmp/seen.txt") == "from the helper\n"
    sh(sandbox, "echo from the shell > made-by-shell.txt")
    assert sandbox.read_file("made-by-shell.txt") == "from the shell\n"


def test_write_rejects_wrong_content_type(sandbox: Sandbox) -> None:
    with pytest.raises(errors.ConfigError):
        sandbox.write_file("x.txt", b"bytes")  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigError):
        sandbox.write_bytes("x.txt", "text")  # type: ignore[arg-type]
    assert not sandbox.exists("x.txt")


def test_write_preserves_mode(sandbox: Sandbox) -> None:
    sandbox.write_file("script.sh", "#!/bin/sh\necho one\n")
    sh(sandbox, "chmod 750 script.sh")
    sandbox.write_file("script.sh", "#!/bin/sh\necho two\n")
    assert sh(sandbox, "stat -c %a script.sh").strip() == "750"
    assert sh(sandbox, "./script.sh") == "two\n"
    sandbox.write_file("script.sh", "echo three\n", append=True)
    assert sh(sandbox, "stat -c %a script.sh").strip() == "750"


def test_atomic_write_leaves_no_temp_files(sandbox: Sandbox) -> None:
    for i in range(5):
        sandbox.write_file("atomic/f.txt", f"version {i}\n")
        sandbox.write_bytes("atomic/g.bin", bytes([i]) * 1000, append=True)
    with pytest.raises(IsADirectoryError):
        sandbox.write_file("atomic", "cannot replace a directory")
    listing = sh(sandbox, "ls -A atomic").split("\n")
    assert [x for x in listing if x] == ["f.txt", "g.bin"]
    assert sandbox.list_dir("atomic") == [ws(sandbox, "atomic/f.txt"), ws(sandbox, "atomic/g.bin")]
    assert sandbox.read_file("atomic/f.txt") == "version 4\n"
    assert sandbox.read_bytes("atomic/g.bin") == b"".join(bytes([i]) * 1000 for i in range(5))


#: Writes the torn-write test makes, and reads its reader makes at least: counted work, not a time
#: window (a window that a loaded machine fills with two writes, or none that overlap a read).
TORN_WRITES = 12
TORN_READS = 12


def test_concurrent_readers_never_see_a_torn_write(sandbox: Sandbox) -> None:
    """A reader in the box reads the file over and over while the host rewrites it whole: every
    read sees one complete version.  The reader starts before the first write and reads on until
    after the last one (it says so in ``torn.ready``; the host, in ``torn.done``), so the reads
    overlap every write however slow the machine is."""
    size = 1 << 20
    sandbox.write_bytes("torn.bin", b"A" * size)
    reader = (
        "import os, time\n"
        "open('torn.ready', 'w').close()\n"
        "end = time.monotonic() + 90\n"
        "reads = torn = 0\n"
        "while time.monotonic() < end:\n"
        "    done = os.path.exists('torn.done')  # before the read: that read follows the last write\n"
        "    d = open('torn.bin', 'rb').read()\n"
        "    reads += 1\n"
        f"    if len(d) != {size} or len(set(d)) != 1:\n"
        "        torn += 1\n"
        f"    if done and reads >= {TORN_READS}:\n"
        "        break\n"
        "print(reads, torn, done)\n"
    )
    out: list[str] = []
    t = threading.Thread(
        target=lambda: out.append(sandbox.run([sandbox.handle.guest_python, "-c", reader], timeout=120).stdout)
    )
    t.start()
    deadline = time.monotonic() + 60
    while not sandbox.exists("torn.ready") and t.is_alive():
        assert time.monotonic() < deadline, "the reader in the box did not start within 60 s"
        time.sleep(0.02)
    for writes in range(TORN_WRITES):
        sandbox.write_bytes("torn.bin", (b"B" if writes % 2 == 0 else b"A") * size)
    sandbox.write_file("torn.done", "")
    t.join(150)
    assert out, "the reader in the box did not answer"
    reads, torn, done = out[0].split()
    assert done == "True", f"the reader stopped before the host's last write: {out[0]!r}"
    assert int(reads) >= TORN_READS
    assert int(torn) == 0, f"{torn} of {reads} reads saw a partly written file"


def test_write_creates_parent_directories(sandbox: Sandbox) -> None:
    sandbox.write_file("deep/a/b/c/d.txt", "deep\n")
    assert sandbox.read_file(ws(sandbox, "deep/a/b/c/d.txt")) == "deep\n"
    sandbox.write_bytes("/tmp/x/y/z.bin", b"\x00")
    assert sandbox.read_bytes("/tmp/x/y/z.bin") == b"\x00"
    assert sh(sandbox, "test -d deep/a/b/c && echo dir") == "dir\n"


def test_write_under_a_file_fails(sandbox: Sandbox) -> None:
    sandbox.write_file("plain", "x")
    with pytest.raises(errors.SandboxFileError) as info:
        sandbox.write_file("plain/child.txt", "y")
    assert isinstance(info.value, OSError)
    assert sandbox.read_file("plain") == "x"


def test_write_bytes_all_byte_values(sandbox: Sandbox) -> None:
    data = bytes(range(256))
    sandbox.write_bytes("all.bin", data)
    assert sandbox.read_bytes("all.bin") == data
    assert sandbox.download_file("all.bin") == data
    sandbox.update_file("all.bin", data[::-1])
    assert sandbox.read_bytes("all.bin") == data[::-1]
    assert sh(sandbox, "wc -c < all.bin").strip() == "256"
    # Bytes a command wrote are read back exactly too.
    sh(sandbox, r"printf '\000\377\200\n\r' > made.bin")
    assert sandbox.read_bytes("made.bin") == b"\x00\xff\x80\n\r"


def test_empty_file_round_trip(sandbox: Sandbox) -> None:
    sandbox.write_bytes("empty", b"")
    assert sandbox.read_bytes("empty") == b""
    assert sandbox.read_file("empty") == ""
    assert sandbox.exists("empty")


def test_20mb_file_round_trip_write_read(sandbox: Sandbox) -> None:
    data = os.urandom(20 << 20)
    digest = hashlib.sha256(data).hexdigest()
    sandbox.write_bytes("/tmp/big.bin", data)
    assert sh(sandbox, "sha256sum /tmp/big.bin").split()[0] == digest
    back = sandbox.read_bytes("/tmp/big.bin")
    assert len(back) == len(data)
    assert hashlib.sha256(back).hexdigest() == digest


def test_20mb_file_upload_download(sandbox: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    data = os.urandom(20 << 20)
    src.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    sandbox.upload(src, "up/big.bin")
    assert sh(sandbox, "sha256sum up/big.bin").split()[0] == digest
    # A file made in the box travels back the other way.
    sh(sandbox, "head -c 20971520 /dev/urandom > made.bin")
    in_box = sh(sandbox, "sha256sum made.bin").split()[0]
    dest = tmp_path / "out" / "made.bin"
    sandbox.download("made.bin", dest)
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == in_box
    assert dest.stat().st_size == 20 << 20
    assert [p.name for p in dest.parent.iterdir()] == ["made.bin"]  # no temp files left


AWKWARD_NAMES = [
    "with space.txt",
    "quote'single.txt",
    'quote"double.txt',
    "new\nline.txt",
    "co:lon:12:3.txt",
    "ünïcødé-日本語.txt",
    "-leading-dash",
    "back\\slash",
    "tab\tname",
    "star*and?brackets[1]",
    "$(echo injected)",
    "emoji-😀",
    ".hidden",
]


def _tree_snapshot(root: Path) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = Path(p).read_bytes()
    return out


def test_upload_download_tree(sandbox: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    for i, name in enumerate(AWKWARD_NAMES):
        d = src / "nested" / f"level {i % 3}" / name
        d.parent.mkdir(parents=True, exist_ok=True)
        d.write_bytes(f"content of {name!r}\n".encode() + bytes(range(i * 10)))
    (src / "empty dir" / "and below").mkdir(parents=True)
    (src / "top.bin").write_bytes(os.urandom(100_000))
    script = src / "run.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o755)

    sandbox.upload(src, "tree")
    in_box = sandbox.glob("tree", "**", include_dirs=True, max_results=1000).items
    assert sorted(in_box) == sorted(ws(sandbox, "tree", rel.rstrip("/")) for rel in _tree_snapshot(src))
    name = AWKWARD_NAMES[3]
    assert sandbox.read_bytes(f"tree/nested/level 0/{name}") == (src / "nested" / "level 0" / name).read_bytes()
    assert sh(sandbox, "./tree/run.sh") == "ran\n"

    # Changes made in the box come back.
    sandbox.write_file("tree/made in box.txt", "new\n")
    dest = tmp_path / "back"
    sandbox.download("tree", dest)
    expected = _tree_snapshot(src)
    expected["made in box.txt"] = b"new\n"
    assert _tree_snapshot(dest) == expected
    assert os.access(dest / "run.sh", os.X_OK)


def test_upload_into_existing_directory_merges(sandbox: Sandbox, tmp_path: Path) -> None:
    sandbox.write_file("merge/keep.txt", "kept\n")
    src = tmp_path / "m"
    src.mkdir()
    (src / "added.txt").write_text("added\n")
    sandbox.upload(src, "merge")
    assert sandbox.read_file("merge/keep.txt") == "kept\n"
    assert sandbox.read_file("merge/added.txt") == "added\n"


def test_upload_missing_host_path(sandbox: Sandbox, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        sandbox.upload(tmp_path / "nope", "x")


def test_download_missing_guest_path(sandbox: Sandbox, tmp_path: Path) -> None:
    with pytest.raises(errors.BoxFileNotFoundError):
        sandbox.download("nope", tmp_path / "x")
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------
# exists / remove / errors
# --------------------------------------------------------------------------


def test_exists(sandbox: Sandbox) -> None:
    sandbox.write_file("e/file.txt", "x")
    assert sandbox.exists("e/file.txt")
    assert sandbox.exists("e")
    assert sandbox.exists("/etc")
    assert not sandbox.exists("e/missing")
    assert not sandbox.exists("/no/such/path")
    sh(sandbox, "ln -s /nowhere e/dangling")
    assert sandbox.exists("e/dangling")


def test_remove_file_and_tree(sandbox: Sandbox) -> None:
    sandbox.write_file("r/one.txt", "1")
    sandbox.write_file("r/sub/deeper/two.txt", "2")
    sandbox.remove("r/one.txt")
    assert not sandbox.exists("r/one.txt")
    assert sandbox.exists("r/sub/deeper/two.txt")
    sandbox.remove("r")
    assert not sandbox.exists("r")
    assert sh(sandbox, "test -e r || echo gone") == "gone\n"


def test_remove_symlink_keeps_target(sandbox: Sandbox) -> None:
    sandbox.write_file("target/keep.txt", "keep")
    sh(sandbox, "ln -s target link")
    sandbox.remove("link")
    assert not sandbox.exists("link")
    assert sandbox.read_file("target/keep.txt") == "keep"


def test_remove_missing_raises_file_not_found(sandbox: Sandbox) -> None:
    with pytest.raises(errors.BoxFileNotFoundError) as info:
        sandbox.remove("missing.txt")
    exc = info.value
    assert isinstance(exc, FileNotFoundError)
    assert isinstance(exc, errors.BoxliteError)
    assert exc.errno == errno.ENOENT
    assert exc.filename == ws(sandbox, "missing.txt")


def test_read_missing_raises_file_not_found(sandbox: Sandbox) -> None:
    for call in (sandbox.read_file, sandbox.read_bytes, sandbox.download_file):
        with pytest.raises(FileNotFoundError) as info:
            call("missing.txt")
        assert isinstance(info.value, errors.BoxFileNotFoundError)
        assert info.value.filename == ws(sandbox, "missing.txt")


def test_reading_a_directory_raises_is_a_directory(sandbox: Sandbox) -> None:
    with pytest.raises(IsADirectoryError) as info:
        sandbox.read_file("/etc")
    assert isinstance(info.value, errors.BoxIsADirectoryError)
    with pytest.raises(errors.BoxIsADirectoryError):
        sandbox.read_bytes(sandbox.workdir)


def test_errors_are_exceptions_not_strings(sandbox: Sandbox) -> None:
    sandbox.write_file("Error: not an error.txt", "Error: this is content\n")
    assert sandbox.read_file("Error: not an error.txt") == "Error: this is content\n"
    failing: list[Callable[[], object]] = [
        lambda: sandbox.read_file("nope"),
        lambda: sandbox.list_dir("nope"),
        lambda: sandbox.glob("nope", "*"),
        lambda: sandbox.grep("nope", "x"),
        lambda: sandbox.remove("nope"),
        lambda: sandbox.list_dir("Error: not an error.txt"),
        lambda: sandbox.glob("Error: not an error.txt", "*"),
    ]
    for call in failing:
        with pytest.raises(errors.SandboxFileError):
            call()


def test_list_dir_and_glob_of_a_file_raise_not_a_directory(sandbox: Sandbox) -> None:
    sandbox.write_file("f.txt", "x")
    with pytest.raises(NotADirectoryError):
        sandbox.list_dir("f.txt")
    with pytest.raises(errors.BoxNotADirectoryError):
        sandbox.glob("f.txt", "*")


# --------------------------------------------------------------------------
# list_dir
# --------------------------------------------------------------------------


def _make_tree(sb: Sandbox) -> None:
    sh(
        sb,
        "mkdir -p d/sub/deeper/deepest d/emptydir && echo a > d/a.txt && echo b > d/sub/b.txt"
        " && echo c > d/sub/deeper/c.txt && ln -s sub d/link",
    )


def test_list_dir_depth_and_trailing_slash(sandbox: Sandbox) -> None:
    _make_tree(sandbox)
    d = ws(sandbox, "d")
    assert sandbox.list_dir("d", max_depth=1) == [f"{d}/a.txt", f"{d}/emptydir/", f"{d}/link", f"{d}/sub/"]
    assert sandbox.list_dir("d") == [
        f"{d}/a.txt",
        f"{d}/emptydir/",
        f"{d}/link",
        f"{d}/sub/",
        f"{d}/sub/b.txt",
        f"{d}/sub/deeper/",
    ]
    assert sandbox.list_dir("d", max_depth=10) == [
        f"{d}/a.txt",
        f"{d}/emptydir/",
        f"{d}/link",
        f"{d}/sub/",
        f"{d}/sub/b.txt",
        f"{d}/sub/deeper/",
        f"{d}/sub/deeper/c.txt",
        f"{d}/sub/deeper/deepest/",
    ]
    # Absolute, relative and trailing-slash spellings name the same directory.
    assert sandbox.list_dir(d + "/", max_depth=1) == sandbox.list_dir("d", max_depth=1)
    assert sandbox.list_dir("d/emptydir") == []


def test_list_dir_work_is_bounded_by_depth(sandbox: Sandbox) -> None:
    """``max_depth`` bounds the walk, not just the answer: listing ``/`` one level deep is quick.

    (Walking the whole filesystem to keep two dozen entries takes seconds.)
    """
    try:
        entries = sandbox.list_dir("/", max_depth=1, timeout=1.5)
    except errors.BoxTimeoutError:
        pytest.fail("list_dir('/', max_depth=1) took over 1.5 s: it walks the whole tree below max_depth")
    assert "/etc/" in entries
    assert "/tmp/" in entries
    assert all(e.startswith("/") and not e.startswith("//") and e.count("/") <= 2 for e in entries)


@pytest.mark.parametrize("depth", [0, -1, True, 1.5, "2"])
def test_list_dir_bad_depth(shared: Sandbox, depth: object) -> None:
    with pytest.raises(errors.ConfigError):
        shared.list_dir("/", max_depth=depth)  # type: ignore[arg-type]


def test_list_dir_missing(sandbox: Sandbox) -> None:
    with pytest.raises(errors.BoxFileNotFoundError):
        sandbox.list_dir("missing")


# --------------------------------------------------------------------------
# glob
# --------------------------------------------------------------------------


def _make_src(sb: Sandbox) -> str:
    sh(sb, "mkdir -p src/pkg/deep && touch src/a.py src/readme.md src/pkg/b.py src/pkg/deep/c.py src/pkg/deep/d.txt")
    return ws(sb, "src")


def test_glob_patterns(sandbox: Sandbox) -> None:
    s = _make_src(sandbox)
    r = sandbox.glob("src", "**/*.py")
    assert isinstance(r, SearchResult)
    assert sorted(r.items) == [f"{s}/a.py", f"{s}/pkg/b.py", f"{s}/pkg/deep/c.py"]
    assert r.truncated is False
    assert sandbox.glob("src", "*.py").items == [f"{s}/a.py"]
    assert sandbox.glob("src", "pkg/*.py").items == [f"{s}/pkg/b.py"]
    assert sandbox.glob("src", "pkg/**/*.py").items == [f"{s}/pkg/b.py", f"{s}/pkg/deep/c.py"]
    assert sorted(sandbox.glob("src", "**/?.txt").items) == [f"{s}/pkg/deep/d.txt"]
    assert sandbox.glob("src", "*.nothing").items == []
    assert sandbox.glob(s, "[ab].py").items == [f"{s}/a.py"]
    assert sandbox.glob(s, "[!a].py").items == []


def test_glob_include_dirs(sandbox: Sandbox) -> None:
    s = _make_src(sandbox)
    assert sandbox.glob("src", "**/deep").items == []
    assert sandbox.glob("src", "**/deep", include_dirs=True).items == [f"{s}/pkg/deep"]
    everything = sandbox.glob("src", "**", include_dirs=True).items
    assert f"{s}/pkg" in everything
    assert f"{s}/pkg/deep/d.txt" in everything
    assert f"{s}/pkg" not in sandbox.glob("src", "**").items


def test_glob_max_results_and_truncated(sandbox: Sandbox) -> None:
    sh(sandbox, "mkdir many && cd many && for i in 0 1 2 3 4 5 6 7 8 9; do : > f$i.log; done")
    r = sandbox.glob("many", "*.log", max_results=3)
    assert len(r.items) == 3
    assert r.truncated is True
    exact = sandbox.glob("many", "*.log", max_results=10)
    assert len(exact.items) == 10
    assert exact.truncated is False
    with pytest.raises(errors.ConfigError):
        sandbox.glob("many", "*.log", max_results=0)
    with pytest.raises(errors.ConfigError):
        sandbox.glob("many", "")


def test_glob_filters_before_the_limit(sandbox: Sandbox) -> None:
    sh(
        sandbox,
        "mkdir -p hay/sub && cd hay && i=0; while [ $i -lt 300 ]; do : > a$i.txt; i=$((i+1)); done; "
        ": > z1.py; : > z2.py; : > sub/z3.py",
    )
    r = sandbox.glob("hay", "**/*.py", max_results=5)
    assert sorted(r.items) == sorted(ws(sandbox, p) for p in ("hay/z1.py", "hay/z2.py", "hay/sub/z3.py"))
    assert r.truncated is False


# --------------------------------------------------------------------------
# grep
# --------------------------------------------------------------------------


def test_grep_basic(sandbox: Sandbox) -> None:
    sandbox.write_file("g/one.py", "import os\nneedle = 1\n# no\n")
    sandbox.write_file("g/sub/two.txt", "needle in text\nhay\nanother needle\n")
    r = sandbox.grep("g", "needle")
    assert isinstance(r, SearchResult)
    assert sorted(r.items) == sorted(
        [
            GrepMatch(ws(sandbox, "g/one.py"), 2, "needle = 1"),
            GrepMatch(ws(sandbox, "g/sub/two.txt"), 1, "needle in text"),
            GrepMatch(ws(sandbox, "g/sub/two.txt"), 3, "another needle"),
        ]
    )
    assert r.truncated is False
    assert sandbox.grep("g", "nothing-matches-this").items == []
    # A single file can be searched too.
    assert sandbox.grep("g/one.py", "^import").items == [GrepMatch(ws(sandbox, "g/one.py"), 1, "import os")]


def test_grep_regex(sandbox: Sandbox) -> None:
    sandbox.write_file("re.txt", "foo1\nfoo22\nbar\n")
    assert [m.line for m in sandbox.grep("re.txt", r"^foo\d{2}$").items] == ["foo22"]


def test_grep_glob_filter(sandbox: Sandbox) -> None:
    sandbox.write_file("gf/a.py", "needle\n")
    sandbox.write_file("gf/b.txt", "needle\n")
    sandbox.write_file("gf/sub/c.py", "needle\n")
    sandbox.write_file("gf/sub/d.txt", "needle\n")
    by_name = sorted(m.path for m in sandbox.grep("gf", "needle", glob="*.py").items)
    assert by_name == [ws(sandbox, "gf/a.py"), ws(sandbox, "gf/sub/c.py")]
    by_path = [m.path for m in sandbox.grep("gf", "needle", glob="sub/*.txt").items]
    assert by_path == [ws(sandbox, "gf/sub/d.txt")]


def test_grep_literal(sandbox: Sandbox) -> None:
    sandbox.write_file("lit.txt", "call a.b(x)\ncall axb(x)\n")
    r = sandbox.grep("lit.txt", "a.b(", literal=True)
    assert [m.line for m in r.items] == ["call a.b(x)"]
    assert [m.line for m in sandbox.grep("lit.txt", r"a.b\(").items] == ["call a.b(x)", "call axb(x)"]


def test_grep_case_insensitive(sandbox: Sandbox) -> None:
    sandbox.write_file("case.txt", "Needle\nNEEDLE\nneedle\nnope\n")
    assert [m.line_number for m in sandbox.grep("case.txt", "needle").items] == [3]
    assert [m.line_number for m in sandbox.grep("case.txt", "needle", case_sensitive=False).items] == [1, 2, 3]
    assert [m.line_number for m in sandbox.grep("case.txt", "NEEDLE", case_sensitive=False, literal=True).items] == [
        1,
        2,
        3,
    ]


def test_grep_max_results_and_truncated(sandbox: Sandbox) -> None:
    sandbox.write_file("ten.txt", "".join(f"hit {i}\n" for i in range(10)))
    r = sandbox.grep("ten.txt", "hit", max_results=4)
    assert [m.line_number for m in r.items] == [1, 2, 3, 4]
    assert r.truncated is True
    exact = sandbox.grep("ten.txt", "hit", max_results=10)
    assert len(exact.items) == 10
    assert exact.truncated is False
    with pytest.raises(errors.ConfigError):
        sandbox.grep("ten.txt", "hit", max_results=0)


def test_grep_filters_before_the_limit(sandbox: Sandbox) -> None:
    sh(
        sandbox,
        "mkdir -p ghay/sub && cd ghay && i=0; while [ $i -lt 300 ]; do echo hay > a$i.txt; i=$((i+1)); done; "
        "echo needle > z1.txt; echo needle > z2.txt; echo needle > sub/z3.txt",
    )
    r = sandbox.grep("ghay", "needle", max_results=5)
    assert sorted(m.path for m in r.items) == sorted(
        ws(sandbox, p) for p in ("ghay/z1.txt", "ghay/z2.txt", "ghay/sub/z3.txt")
    )
    assert r.truncated is False


def test_grep_skips_binary_files(sandbox: Sandbox) -> None:
    sandbox.write_bytes("bin/blob.bin", b"needle\x00\x01\x02needle\n")
    sandbox.write_file("bin/text.txt", "needle\n")
    assert [m.path for m in sandbox.grep("bin", "needle").items] == [ws(sandbox, "bin/text.txt")]


def test_grep_invalid_regex_is_config_error(sandbox: Sandbox) -> None:
    sandbox.write_file("x.txt", "x\n")
    with pytest.raises(errors.ConfigError, match="regular expression"):
        sandbox.grep("x.txt", "(unclosed")
    with pytest.raises(errors.ConfigError):
        sandbox.grep("x.txt", "")
    # The same text is fine as a literal.
    assert sandbox.grep("x.txt", "(unclosed", literal=True).items == []


def test_grep_line_numbers_agree_with_read_file(sandbox: Sandbox) -> None:
    """A match's line number must name the line read_file (and ``grep -n``) call by that number.

    Form feeds (common as page breaks in source files) and other Unicode line
    boundaries are not line ends for either.
    """
    content = "first\x0cpage break\nneedle here\nx\x1cy\u2028z\nsecond needle\n"
    sandbox.write_file("lines.txt", content)
    matches = sandbox.grep("lines.txt", "needle").items
    assert [m.line for m in matches] == ["needle here", "second needle"]
    for m in matches:
        assert sandbox.read_file("lines.txt", start_line=m.line_number, end_line=m.line_number) == m.line + "\n"
    assert [m.line_number for m in matches] == [2, 4]


# --------------------------------------------------------------------------
# awkward paths
# --------------------------------------------------------------------------


def test_awkward_file_names(sandbox: Sandbox) -> None:
    fulls = {name: ws(sandbox, "awk", name) for name in AWKWARD_NAMES}
    for i, name in enumerate(AWKWARD_NAMES):
        sandbox.write_file(f"awk/{name}", f"needle: {i}\nsecond line\n")
    for i, full in enumerate(fulls.values()):
        assert sandbox.read_file(full) == f"needle: {i}\nsecond line\n", full
    assert set(sandbox.list_dir("awk")) == set(fulls.values())
    assert set(sandbox.glob("awk", "*").items) == set(fulls.values())
    matches = sandbox.grep("awk", "needle", max_results=100).items
    assert sorted(matches) == sorted(GrepMatch(full, 1, f"needle: {i}") for i, full in enumerate(fulls.values()))
    # The files are really named so: a command sees the same names.
    listing = sandbox.run(
        [sandbox.handle.guest_python, "-c", "import os; print(repr(sorted(os.listdir('awk'))))"], timeout=20
    )
    assert listing.stdout.strip() == repr(sorted(AWKWARD_NAMES))
    for name in AWKWARD_NAMES[:4]:
        assert sandbox.exists(f"awk/{name}")
        sandbox.remove(f"awk/{name}")
        assert not sandbox.exists(f"awk/{name}")


def test_awkward_directory_names(sandbox: Sandbox) -> None:
    d = "dir with space/co:lon/ünï\ncode"
    sandbox.write_file(f"{d}/f.txt", "needle\n")
    full = ws(sandbox, d, "f.txt")
    assert sandbox.grep(".", "needle").items == [GrepMatch(full, 1, "needle")]
    assert sandbox.glob(".", "**/f.txt").items == [full]
    assert full in sandbox.list_dir(".", max_depth=4)


def test_longest_file_names(sandbox: Sandbox) -> None:
    """Names up to the filesystem's 255-byte limit work, whatever their characters."""
    for name in ("a" * 255, "日" * 85, "é" * 127):
        assert len(name.encode()) <= 255
        sandbox.write_file(f"long/{name}", "x")
        assert sandbox.read_file(f"long/{name}") == "x"
        sandbox.remove(f"long/{name}")


def test_too_long_file_name_is_a_file_error(sandbox: Sandbox) -> None:
    with pytest.raises(errors.SandboxFileError) as info:
        sandbox.write_file("a" * 256, "x")
    assert info.value.errno == errno.ENAMETOOLONG


# --------------------------------------------------------------------------
# symlinks
# --------------------------------------------------------------------------


def test_symlink_loops_do_not_hang(sandbox: Sandbox) -> None:
    sh(
        sandbox,
        "mkdir -p loop/inner && ln -s . loop/dot && ln -s .. loop/inner/up && ln -s self loop/self"
        " && echo needle > loop/inner/f.txt",
    )
    t0 = time.monotonic()
    g = sandbox.glob("loop", "**", include_dirs=True, timeout=10)
    assert ws(sandbox, "loop/inner/f.txt") in g.items
    assert ws(sandbox, "loop/dot") in g.items
    r = sandbox.grep("loop", "needle", timeout=10)
    assert r.items == [GrepMatch(ws(sandbox, "loop/inner/f.txt"), 1, "needle")]
    entries = sandbox.list_dir("loop", max_depth=10, timeout=10)
    assert ws(sandbox, "loop/dot") in entries  # listed, not followed: no trailing '/'
    assert time.monotonic() - t0 < 10


def test_glob_and_grep_do_not_follow_symlinks_out(sandbox: Sandbox) -> None:
    sh(
        sandbox,
        "mkdir -p scope && echo needle > outside.txt && ln -s .. scope/parent && ln -s ../outside.txt scope/file-link",
    )
    assert sandbox.grep("scope", "needle").items == []
    assert sorted(sandbox.glob("scope", "**").items) == [ws(sandbox, "scope/file-link"), ws(sandbox, "scope/parent")]


# --------------------------------------------------------------------------
# paths
# --------------------------------------------------------------------------


def test_relative_paths_resolve_against_workdir(sandbox: Sandbox) -> None:
    sandbox.write_file("rel.txt", "relative\n")
    assert sandbox.run(["cat", ws(sandbox, "rel.txt")], timeout=20).stdout == "relative\n"
    assert sh(sandbox, "cat rel.txt") == "relative\n"
    assert sandbox.read_file(ws(sandbox, "rel.txt")) == "relative\n"
    assert sandbox.read_file(PurePosixPath("rel.txt")) == "relative\n"
    assert sandbox.read_file("./rel.txt") == "relative\n"


def test_dotdot_normalizes(sandbox: Sandbox) -> None:
    sandbox.write_file("a/../b.txt", "b\n")
    assert sandbox.exists(ws(sandbox, "b.txt"))
    assert not sandbox.exists("a")  # '..' is resolved lexically: 'a' is never created
    assert sandbox.read_file("x/y/../../b.txt") == "b\n"
    hostname = sandbox.read_file("/etc/hostname")
    ups = "../" * (sandbox.workdir.count("/") + 3)
    assert sandbox.read_file(ups + "etc/hostname") == hostname
    assert sandbox.read_file("/../../etc/hostname") == hostname
    assert sandbox.read_file("//etc///hostname") == hostname


NUL_CALLS = {
    "read_file": lambda sb, p: sb.read_file(p),
    "read_bytes": lambda sb, p: sb.read_bytes(p),
    "write_file": lambda sb, p: sb.write_file(p, "x"),
    "write_bytes": lambda sb, p: sb.write_bytes(p, b"x"),
    "exists": lambda sb, p: sb.exists(p),
    "remove": lambda sb, p: sb.remove(p),
    "list_dir": lambda sb, p: sb.list_dir(p),
    "glob": lambda sb, p: sb.glob(p, "*"),
    "grep": lambda sb, p: sb.grep(p, "x"),
    "upload": lambda sb, p: sb.upload(__file__, p),
    "download": lambda sb, p: sb.download(p, "/nonexistent-host-dir/never-written"),
    "run-cwd": lambda sb, p: sb.run(["true"], cwd=p, timeout=20),
    "execute_command-cwd": lambda sb, p: sb.execute_command("true", cwd=p, timeout=20),
}


@pytest.mark.parametrize("call", list(NUL_CALLS.values()), ids=list(NUL_CALLS))
def test_nul_in_path_is_invalid(shared: Sandbox, call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(errors.InvalidPathError):
        call(shared, "dir/fi\0le")
    assert isinstance(errors.InvalidPathError("x"), ValueError)


@pytest.mark.parametrize("bad", ["", b"/etc/hostname", 42, None, ["/etc/hostname"]])
def test_unusable_paths_are_invalid(shared: Sandbox, bad: object) -> None:
    with pytest.raises(errors.InvalidPathError):
        shared.read_file(bad)  # type: ignore[arg-type]


def test_file_ops_still_work_after_a_failure(sandbox: Sandbox) -> None:
    with pytest.raises(errors.BoxFileNotFoundError):
        sandbox.read_file("nope")
    with pytest.raises(errors.ConfigError):
        sandbox.grep(".", "(bad")
    sandbox.write_file("after.txt", "fine")
    assert sandbox.read_file("after.txt") == "fine"
    assert sandbox.handle.alive()
