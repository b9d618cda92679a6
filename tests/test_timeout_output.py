"""A boxed test that hits its timeout shows what it printed and logged so far (issue 23), as a
local pytest-timeout report would: real sub-runs with real namespace boxes, the host killing the
box at ``timeout=2`` as before, the box's last words (``LASTWORDS``) in the failure's report."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
import subruns

from pytest_boxlite import ledger
from pytest_boxlite.guest import messages as msg
from pytest_boxlite.remote import transport

pytestmark = pytest.mark.timeout(240)


class SubRun(subruns.SubRun):
    base_args = ("--boxlite-runtime=namespace", "-p", "no:randomly")
    wait_timeout = 150.0


HANGS = """
import logging
import sys
import time

import pytest


@pytest.fixture
def slow_setup():
    print("printed by the fixture")
    time.sleep(60)


@pytest.mark.boxlite(timeout=2)
def test_a_hangs_in_call():
    print("printed before the hang")
    print("to stderr before the hang", file=sys.stderr)
    logging.getLogger("hang").warning("logged before the hang")
    time.sleep(60)


@pytest.mark.boxlite(timeout=2)
def test_b_hangs_in_setup(slow_setup):
    pass


@pytest.mark.boxlite(timeout=2)
def test_c_floods_then_hangs():
    sys.stdout.write("y" * (3 << 20))
    sys.stdout.flush()
    time.sleep(60)


@pytest.mark.boxlite
def test_d_next():
    print("the next test")
"""


def _body(out: str, name: str) -> str:
    head = rf"_{{3,}} (?:ERROR at setup of )?{name} _{{3,}}\n"
    end = r"(?=\n_{3,} (?:ERROR at setup of )?test_|\n-{3,} boxlite -{3,}|\n={3,})"
    m = re.search(head + "(.*?)" + end, out, re.S)
    assert m, out[-6000:]
    return m[1]


@pytest.mark.parametrize("scope", [(), ("--boxlite-scope=module",)], ids=["test", "module"])
def test_a_timed_out_boxed_test_shows_its_output(tmp_path: Path, home: Path, scope: Sequence[str]) -> None:
    (tmp_path / "test_hangs.py").write_text(textwrap.dedent(HANGS))
    run = SubRun(tmp_path, home, "hangs", *scope, "test_hangs.py")
    rc = run.wait()
    out = run.output
    assert rc == pytest.ExitCode.TESTS_FAILED, out[-6000:]
    assert re.search(r"\b2 failed, 1 passed, 1 error\b", out), out[-6000:]

    call = _body(out, "test_a_hangs_in_call")
    assert "[boxlite] timed out after 2s" in call, call
    assert re.search(r"-+ Captured stdout call -+\nprinted before the hang", call), call
    assert re.search(r"-+ Captured stderr call -+\nto stderr before the hang", call), call
    assert re.search(r"-+ Captured log call -+\nWARNING +hang:test_hangs.py:\d+ logged before the hang", call), call

    setup = _body(out, "test_b_hangs_in_setup")
    assert "[boxlite] timed out after 2s" in setup, setup
    assert re.search(r"-+ Captured stdout setup -+\nprinted by the fixture", setup), setup

    # Bounded: the flood's section is cut to the per-section cap, and says so.
    flood = _body(out, "test_c_floods_then_hangs")
    m = re.search(r"\[pytest-boxlite: (\d+) more characters of this section were cut\]", flood)
    assert m and int(m[1]) > 2 << 20, flood[-500:]
    assert len(flood) < 2 * msg.FIELD_CAP
    assert ledger.scan(home) == [], out[-3000:]


def test_last_words_are_text_only_and_capped(pytestconfig: pytest.Config) -> None:
    """The unit layer: what the host keeps of a box's LASTWORDS message, whatever it holds."""
    fields = {
        "when": "../../etc",  # not a phase: the call's
        "out": "ok\ud800",  # a lone surrogate: replaced, so no encoder on the host fails on it
        "err": 12345,  # not text: dropped
        "log": "z" * (msg.FIELD_CAP + 10),
    }
    sections = transport._last_words(pytestconfig, fields)
    assert [t for t, _ in sections] == ["Captured stdout call", "Captured log call"]
    assert sections[0][1] == "ok\ufffd"
    assert len(sections[1][1]) <= msg.FIELD_CAP and "were cut" in sections[1][1]
