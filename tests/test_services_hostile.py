"""Hostile guests against the services surfaces (issue 24, red team F3): a process's output
waits keep their timeout and its line history its memory bound whatever the guest writes, an
HTTP readiness check keeps its deadline against a server that trickles bytes, and a service's
setup output is escaped before it reaches the terminal.  Real namespace boxes throughout."""

from __future__ import annotations

import threading
import time
import tracemalloc
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CREATE_TIMEOUT, _Runtimes, new_box_name
from subruns import SubRun

from pytest_boxlite import errors, services
from pytest_boxlite.process import MAX_LINE, BoxProcessWarning
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def sb(runtimes: _Runtimes) -> Iterator[Sandbox]:
    """A namespace box with a 1 MiB output bound; its processes are ended before it goes."""
    handle = runtimes.get("namespace").create_box(BoxSpec(), new_box_name(), timeout=CREATE_TIMEOUT)
    sandbox = Sandbox(handle, max_output=1 << 20)
    try:
        yield sandbox
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BoxProcessWarning)
            sandbox.end()
        handle.destroy()


def _long_lines(count: int, fill: bytes, then: bytes = b"") -> str:
    """Guest code writing ``count`` lines of 64 KiB of ``fill``, then ``then``, then sleeping."""
    return (
        "import sys, time\n"
        f"line = {fill!r} * 65535 + b'\\n'\n"
        f"for _ in range({count}): sys.stdout.buffer.write(line)\n"
        f"sys.stdout.buffer.write({then!r}); sys.stdout.flush()\n"
        "print('written', file=sys.stderr, flush=True)\n"
        "time.sleep(60)\n"
    )


@pytest.mark.reliability
@pytest.mark.escape_row("service-readiness")
def test_a_wait_keeps_its_timeout_against_lines_a_pattern_is_slow_on(sb: Sandbox) -> None:
    # 20 lines of 64 KiB of spaces: r"\s+ready" is quadratic in a line's length (about 2 s a
    # line matched whole, 40 s for all before the fix, with the pump blocked meanwhile).
    proc = sb.spawn([sb.handle.guest_python, "-c", _long_lines(20, b" ")])
    proc.wait_for_output("^written$", timeout=30, stream="stderr")
    t = time.monotonic()
    with pytest.raises(errors.OutputTimeoutError, match="within 2 s"):
        proc.wait_for_output(r"\s+ready", timeout=2, stream="stdout")
    assert time.monotonic() - t < 15
    proc.kill()


@pytest.mark.reliability
@pytest.mark.escape_row("service-readiness")
def test_a_long_line_is_matched_on_its_first_max_line_bytes(sb: Sandbox) -> None:
    head = b"START" + b"x" * (MAX_LINE + 1000) + b"TAIL\nnext\n"
    proc = sb.spawn([sb.handle.guest_python, "-c", _long_lines(0, b"", then=head)])
    assert proc.wait_for_output("^START", timeout=30, stream="stdout").group(0) == "START"
    # The rest of the long line is not a line of its own: the next line is "next".
    assert proc.wait_for_output(".+", timeout=30, stream="stdout").group(0) == "next"
    with pytest.raises(errors.OutputTimeoutError):
        proc.wait_for_output("TAIL", timeout=1, stream="stdout")
    proc.kill()


@pytest.mark.reliability
@pytest.mark.escape_row("service-readiness")
def test_the_line_history_is_bounded_by_bytes_not_only_by_lines(sb: Sandbox) -> None:
    # 2500 lines of 64 KiB nobody reads, max_output 1 MiB: the history kept 2000 of them
    # (125 MiB on the host) before the fix; now at most max_output bytes of lines.
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        proc = sb.spawn([sb.handle.guest_python, "-c", _long_lines(2500, b"y", then=b"LAST\n")])
        proc.wait_for_output("^written$", timeout=60, stream="stderr")
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 32 << 20, f"the host holds {grown >> 20} MiB for one process with max_output 1 MiB"
    # The waits still see the lines in order, up to the last.
    assert proc.wait_for_output("^LAST$", timeout=10, stream="stdout")
    proc.kill()


TRICKLE_SERVER = r"""
import socket, threading, time
s = socket.create_server(("127.0.0.1", 8000))
print("up", flush=True)
def trickle(c):
    try:
        c.recv(4096)
        for b in b"HTTP/1.1 200 OK\r\n" + b"X-A: " + b"a" * 10**6:
            c.send(bytes([b])); time.sleep(0.5)
    except OSError:
        pass
while True:
    c, _ = s.accept(); threading.Thread(target=trickle, args=(c,), daemon=True).start()
"""


@pytest.mark.reliability
@pytest.mark.escape_row("service-readiness")
def test_http_ready_keeps_its_deadline_against_a_server_that_trickles_bytes(sb: Sandbox) -> None:
    # One byte every 0.5 s: http.client's timeout bounds each recv, so the check never ended
    # before the fix (stuck after 90 s with a 3 s deadline).  Run in a thread so a regression
    # fails here rather than hanging the test.
    proc = sb.spawn([sb.handle.guest_python, "-c", TRICKLE_SERVER])
    proc.wait_for_output("^up$", timeout=30)
    target = services._Starting(spec=None, sandbox=sb, process=proc, addresses={8000: sb.publish(8000)})  # type: ignore[arg-type]
    outcome: list[BaseException | None] = []

    def check() -> None:
        try:
            services.HttpReady(8000).wait(target, time.monotonic() + 3)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    t = time.monotonic()
    thread = threading.Thread(target=check, daemon=True)
    thread.start()
    thread.join(20)
    assert outcome, f"HttpReady.wait with a 3 s deadline still ran after {time.monotonic() - t:.0f} s"
    # Not ready (the status line never completed): the check's timeout, as for a silent server.
    assert isinstance(outcome[0], errors.OutputWaitError), outcome[0]
    assert "did not answer 200 in time" in str(outcome[0])
    proc.kill()


SETUP_CONFTEST = r"""
import sys
from pytest_boxlite import service, CommandReady
# A hostile program in the box (its /bin/sh, apt, ...) writes terminal control sequences.
bad_setup = service(
    "bad_setup", [sys.executable, "-c", "pass"],
    setup="printf 'ok\\033]2;PWNED-TITLE\\007\\033[2J\\033[31mRED\\n'; exit 1", timeout=20,
)
bad_check = service(
    "bad_check", ["/bin/sh", "-c", "exec sleep 60"], timeout=3,
    ready=CommandReady("printf 'no\\033]2;PWNED-CHECK\\007\\033[2J\\n' >&2; exit 1"),
)
"""


@pytest.mark.escapes
@pytest.mark.escape_row("service-readiness")
def test_service_setup_and_check_output_reaches_the_terminal_escaped(tmp_path: Path, home: Path) -> None:
    (tmp_path / "conftest.py").write_text(SETUP_CONFTEST)
    (tmp_path / "test_c.py").write_text(
        "def test_setup(bad_setup):\n    pass\n\ndef test_check(bad_check):\n    pass\n"
    )
    run = SubRun(tmp_path, home, "c", "-p", "no:randomly", "-p", "no:cacheprovider")
    run.wait(120)
    out = run.log_path.read_bytes()
    assert b"PWNED-TITLE" in out and b"PWNED-CHECK" in out, out.decode(errors="replace")[-3000:]
    # The control bytes are escaped (shown as \x1b, \x07), never written raw.
    assert b"\x1b" not in out and b"\x07" not in out, out.decode(errors="replace")[-3000:]
    assert b"ok\\x1b]2;PWNED-TITLE\\x07" in out
