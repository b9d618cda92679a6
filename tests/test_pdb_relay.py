"""A boxed test's debugger on the host's terminal (issue 23, item 6): real pytest sub-runs on a
pseudo-terminal (the standard library's ``pty``), real namespace boxes forked per test or booted
(``--boxlite-fresh=boot``: the test runs in a warm interpreter, its debugger's frames and answers
travel on the execnet channel), and the debugger driven by typing at its prompt, as a user would.

- ``breakpoint()`` / ``pdb.set_trace()`` in test and module scope: the prompt, a local's value,
  ``c`` and the test passes; ``q`` ends the session as locally; end-of-file on stdin (no terminal)
  fails the test with ``bdb.BdbQuit`` as locally;
- ``--pdb``: the post-mortem opens at the failing frame, with its locals;
- the time at the prompt is not the test's: ``--boxlite-timeout 5`` and 7 s at the prompt pass;
- a box whose test floods debugger frames (it plays the hostile guest through the relay's real
  ``send``) fails, the host's output stays bounded and carries no raw ESC byte;
- ``-n 2``: what xdist gives unboxed (``BdbQuit``; ``--pdb`` is a usage error).

The cases marked ``booted`` run the same in boxes booted per test.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import subruns
from subruns import run_in_pty, sub_env

from pytest_boxlite import ledger

pytestmark = pytest.mark.timeout(300)


def argv(home: Path, *args: str, boxed: bool = True) -> list[str]:
    if not boxed:  # the same run without this plugin, to compare with
        return [sys.executable, "-m", "pytest", *subruns.QUIET, "-p", "no:boxlite", "-p", "no:randomly", *args]
    return subruns.pytest_argv(home, "--boxlite-runtime=namespace", "-p", "no:randomly", *args)


def text(out: bytes) -> str:
    return out.decode(errors="replace").replace("\r\n", "\n")


def write(directory: Path, name: str, source: str) -> None:
    (directory / name).write_text(textwrap.dedent(source))


def no_leftovers(home: Path, output: str) -> None:
    assert ledger.scan(home) == [], f"boxes left behind in {home}\n{output[-3000:]}"


PROMPT = b"(Pdb) "

#: How the boxes are made: forked per test (the default) or booted (``--boxlite-fresh=boot``,
#: which ``--boxlite-keep`` implies), where the debugger goes over the warm interpreter's channel.
BOXES = {"forked": (), "booted": ("--boxlite-fresh=boot",)}
both_boxes = pytest.mark.parametrize("boxes", sorted(BOXES))

BREAKS = """
import pytest


@pytest.mark.boxlite
def test_breaks():
    some_local = 41 + 1
    breakpoint()
    assert some_local == 42


@pytest.mark.boxlite
def test_set_trace():
    import pdb

    other_local = "hello"
    pdb.set_trace()
    assert other_local == "hello"
"""


@pytest.mark.parametrize(("scope", "boxes"), [("test", "forked"), ("module", "forked"), ("test", "booted")])
def test_breakpoint_gives_a_debugger_here(tmp_path: Path, home: Path, scope: str, boxes: str) -> None:
    """breakpoint() and pdb.set_trace() in boxed tests: the prompt on this terminal, ``p`` prints
    the box's value, ``c`` continues and the tests pass; no refusal, no leftover boxes."""
    write(tmp_path, "test_breaks.py", BREAKS)
    answers = [
        (PROMPT, b"p some_local\n", 0.0),
        (PROMPT, b"c\n", 0.0),
        (PROMPT, b"p other_local * 2\n", 0.0),
        (PROMPT, b"c\n", 0.0),
    ]
    rc, raw = run_in_pty(argv(home, f"--boxlite-scope={scope}", *BOXES[boxes], "test_breaks.py"), tmp_path, answers)
    out = text(raw)
    assert rc == 0, out
    assert re.search(r"\b2 passed\b", out), out
    assert out.count("PDB set_trace (IO-capturing turned off)") == 2, out
    assert "(Pdb) p some_local\n42\n" in out, out
    assert "(Pdb) p other_local * 2\n'hellohello'\n" in out, out
    assert "PDB continue (IO-capturing resumed)" in out, out
    assert "[boxlite]" not in out, out
    no_leftovers(home, out)


FAILS = """
import pytest


@pytest.mark.boxlite
def test_fails():
    failing_local = [1, 2, 3]
    assert sum(failing_local) == 7
"""


@both_boxes
def test_pdb_post_mortem_at_the_failing_frame(tmp_path: Path, home: Path, boxes: str) -> None:
    """--pdb: a boxed failure opens pytest's post-mortem at the failing frame (its locals), after
    the traceback, as locally; ``c`` ends it and the test is reported failed; no "no debugger" line."""
    write(tmp_path, "test_fails.py", FAILS)
    answers = [(PROMPT, b"p failing_local\n", 0.0), (PROMPT, b"c\n", 0.0)]
    rc, raw = run_in_pty(argv(home, "--pdb", *BOXES[boxes], "test_fails.py"), tmp_path, answers)
    out = text(raw)
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert re.search(r"\b1 failed\b", out), out
    assert ">>> traceback >>>" in out and ">>> entering PDB >>>" in out, out
    assert "PDB post_mortem (IO-capturing turned off)" in out, out
    assert "-> assert sum(failing_local) == 7" in out, out
    assert "(Pdb) p failing_local\n[1, 2, 3]\n" in out, out
    assert "no debugger here can enter" not in out and "does not enter boxed tests" not in out, out
    no_leftovers(home, out)


@both_boxes
def test_quit_ends_the_session_as_locally(tmp_path: Path, home: Path, boxes: str) -> None:
    """``q`` at a boxed breakpoint: pytest's "Quitting debugger" exit, the session stops (rc 2),
    the second test does not run, as locally."""
    write(tmp_path, "test_breaks.py", BREAKS)
    rc, raw = run_in_pty(argv(home, *BOXES[boxes], "test_breaks.py"), tmp_path, [(PROMPT, b"q\n", 0.0)])
    out = text(raw)
    assert rc == pytest.ExitCode.INTERRUPTED, out
    assert "Quitting debugger" in out, out
    assert "test_set_trace" not in out.split("Quitting debugger", 1)[1].split("boxlite ---", 1)[0], out
    assert out.count("(Pdb) ") == 1, out
    no_leftovers(home, out)


@both_boxes
def test_end_of_stdin_fails_the_test_with_bdbquit(tmp_path: Path, home: Path, boxes: str) -> None:
    """No terminal (stdin at its end): pdb reads end-of-file, each test fails with bdb.BdbQuit and
    the session goes on, as locally (``pytest -p no:boxlite < /dev/null`` does the same)."""
    write(tmp_path, "test_breaks.py", BREAKS)
    for boxed in (True, False):
        args = argv(home, *(BOXES[boxes] if boxed else ()), "test_breaks.py", boxed=boxed)
        proc = subprocess.run(
            args, cwd=tmp_path, env=sub_env(), stdin=subprocess.DEVNULL, capture_output=True, timeout=150
        )
        out = proc.stdout.decode(errors="replace")
        assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
        assert re.search(r"\b2 failed\b", out), out
        assert out.count("bdb.BdbQuit") >= 2, out
    no_leftovers(home, out)


SLOW_PROMPT = """
import pytest


@pytest.mark.boxlite
def test_waits_at_the_prompt():
    waited = True
    breakpoint()
    assert waited
"""


@both_boxes
def test_time_at_the_prompt_is_not_the_tests(tmp_path: Path, home: Path, boxes: str) -> None:
    """--boxlite-timeout 5 (and pytest-timeout's --timeout 5): 7 s at the prompt, then ``c``: passes."""
    write(tmp_path, "test_slow.py", SLOW_PROMPT)
    args = argv(home, "--boxlite-timeout", "5", "--timeout", "5", *BOXES[boxes], "test_slow.py")
    rc, raw = run_in_pty(args, tmp_path, [(PROMPT, b"c\n", 7.0)])
    out = text(raw)
    assert rc == 0, out
    assert re.search(r"\b1 passed\b", out), out
    assert "timed out" not in out and "Timeout" not in out, out
    no_leftovers(home, out)


FLOODS = """
import pytest
from pytest_boxlite.guest import debugger
from pytest_boxlite.guest import messages as msg


@pytest.mark.boxlite
def test_floods_without_a_session():
    relay = debugger.current()
    for _ in range(3):
        relay.send(msg.DEBUG, op="out", text="\\x1b[2J\\x1b]0;owned\\x07")


@pytest.mark.boxlite
def test_floods_in_a_session():
    relay = debugger.current()
    relay.send(msg.DEBUG, op="enter", title="\\x1b[31mtitle")
    chunk = "\\x1b[2J\\x1bc" * 4000
    for _ in range(5000):  # far over the per-test cap of debugger output
        relay.send(msg.DEBUG, op="out", text=chunk)


@pytest.mark.boxlite
def test_asks_while_no_debugger():
    relay = debugger.current()
    relay.send(msg.DEBUG, op="read")


@pytest.mark.boxlite
def test_after():
    pass
"""


@both_boxes
def test_a_flooding_box_keeps_the_host_bounded(tmp_path: Path, home: Path, boxes: str) -> None:
    """The test code plays the hostile guest with the relay's real ``send`` (a fault injected on
    purpose): frames outside a session and a read without one fail their test without the host
    reading stdin; a flood inside one stops at the per-test cap; the terminal gets no raw ESC."""
    write(tmp_path, "test_floods.py", FLOODS)
    rc, raw = run_in_pty(argv(home, *BOXES[boxes], "test_floods.py"), tmp_path, timeout=200)
    out = text(raw)
    assert rc == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    assert re.search(r"\b3 failed, 1 passed\b", out), out[-3000:]
    assert b"\x1b" not in raw, [m.start() for m in re.finditer(b"\x1b", raw)][:5]
    assert "frame outside a debugger session" in out, out[-3000:]
    assert "bytes of debugger output for one test" in out, out[-3000:]
    # What the host printed of the flood: within the cap (16 MiB of text, escaped 4 bytes per ESC).
    assert len(raw) < 80 << 20, len(raw)
    no_leftovers(home, out[-3000:])


def test_under_xdist_as_unboxed(tmp_path: Path, home: Path) -> None:
    """-n 2: breakpoint() in a boxed test (forked or booted) fails with bdb.BdbQuit as in an
    unboxed xdist worker; --pdb is xdist's usage error, boxed or not."""
    write(tmp_path, "test_breaks.py", BREAKS)
    for boxed, boxes in ((True, "forked"), (True, "booted"), (False, "forked")):
        rc, raw = run_in_pty(argv(home, "-n", "2", *BOXES[boxes], "test_breaks.py", boxed=boxed), tmp_path)
        out = text(raw)
        assert rc == pytest.ExitCode.TESTS_FAILED, out
        assert re.search(r"\b2 failed\b", out), out
        assert out.count("bdb.BdbQuit") >= 2, out
        rc, raw = run_in_pty(argv(home, "-n", "2", "--pdb", *BOXES[boxes], "test_breaks.py", boxed=boxed), tmp_path)
        out = text(raw)
        assert rc == pytest.ExitCode.USAGE_ERROR, out
        assert "--pdb is incompatible with distributing tests; try using -n0 or -nauto." in out, out
    no_leftovers(home, out)


@both_boxes
def test_ctrl_c_at_the_prompt_goes_to_pdb(tmp_path: Path, home: Path, boxes: str) -> None:
    """Ctrl-C at a boxed test's prompt: pdb says ``--KeyboardInterrupt--`` and asks again, as
    locally; the session goes on (``c``: the tests pass)."""
    write(tmp_path, "test_breaks.py", BREAKS)
    answers = [
        (PROMPT, b"\x03", 0.5),
        (b"--KeyboardInterrupt--", b"p some_local\n", 0.5),
        (b"42", b"c\n", 0.0),
        (PROMPT, b"c\n", 0.0),
    ]
    rc, raw = run_in_pty(argv(home, *BOXES[boxes], "test_breaks.py"), tmp_path, answers)
    out = text(raw)
    assert rc == 0, out
    assert re.search(r"\b2 passed\b", out), out
    assert out.count("--KeyboardInterrupt--") == 1, out
    no_leftovers(home, out)


DIES = """
import os
import threading
import time

import pytest


@pytest.mark.boxlite
def test_dies_at_the_prompt():
    threading.Thread(target=lambda: (time.sleep(2), os._exit(3)), daemon=True).start()
    breakpoint()


@pytest.mark.boxlite
def test_after():
    pass
"""


@both_boxes
def test_box_ending_at_the_prompt_ends_cleanly(tmp_path: Path, home: Path, boxes: str) -> None:
    """The box's test process ends while the host waits for the user's line: no hang, the test
    fails saying how it ended, capture is back on and the next test runs."""
    write(tmp_path, "test_dies.py", DIES)
    rc, raw = run_in_pty(argv(home, *BOXES[boxes], "test_dies.py"), tmp_path, timeout=120)
    out = text(raw)
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert re.search(r"\b1 failed, 1 passed\b", out), out
    assert "the test process in the box exited with status 3" in out, out
    no_leftovers(home, out)


PROMPT_AND_PLAIN = """
import pytest


@pytest.mark.boxlite
def test_a_fails():
    failing_local = 1
    assert failing_local == 2


@pytest.mark.boxlite
def test_b_passes():
    pass
"""


def test_time_at_the_prompt_is_not_box_overhead(tmp_path: Path, home: Path) -> None:
    """``--pdb`` and 5 s at the post-mortem's prompt (outside every report's duration): the
    summary's fork "overhead p50" does not count them. Two forked tests, so the old median (the
    mean of both, over 2.5 s) would show it."""
    write(tmp_path, "test_two.py", PROMPT_AND_PLAIN)
    rc, raw = run_in_pty(argv(home, "--pdb", "test_two.py"), tmp_path, [(PROMPT, b"c\n", 5.0)])
    out = text(raw)
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert re.search(r"\b1 failed, 1 passed\b", out), out
    m = re.search(r"forked (\d+) \(overhead p50 ([\d.]+) ms\)", out)
    assert m is not None, out
    assert m.group(1) == "2" and float(m.group(2)) < 2500, out
    no_leftovers(home, out)
