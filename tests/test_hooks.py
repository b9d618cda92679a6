"""pytest-boxlite's hookspecs (``pytest_boxlite/hooks.py``) as a third party meets them.

A project's conftest implements ``pytest_boxlite_box_fields`` (what travels with an item to its
box) and ``pytest_boxlite_box_received`` (the box's side); real sub-runs run boxed tests in real
boxes in each mode that starts a test (a box forked per test, one box per module, a booted box per
test), and each test checks, in its box, that its own fields arrived before its fixtures were set
up.  The hook also tries to replace the message's own ``nodeid`` and ``seq``: the core's keys win
(were they replaced, the box would run another test, or the host would wait for a run that never
ends).  A malformed result fails the run naming the hook.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from subruns import SubRun

from pytest_boxlite import ledger

pytestmark = pytest.mark.timeout(240)

CONFTEST = """
import os

import pytest


def pytest_boxlite_box_fields(config, item, nodeid, wide_only):
    if wide_only:  # a FORK whose warm interpreter sets the wider fixtures up first
        return {"probe_wide": nodeid}
    # "nodeid" and "seq" are the message's own: they must not be replaced.
    return {"probe": item.nodeid, "nodeid": "test_elsewhere.py::test_forged", "seq": -1}


def pytest_boxlite_box_received(config, fields):
    if os.environ.get("PYTEST_BOXLITE_GUEST") == "1":
        probe = fields.get("probe")
        if isinstance(probe, str):
            os.environ["PROBE_SEEN"] = probe


@pytest.fixture
def probe_at_setup():
    return os.environ.get("PROBE_SEEN")
"""

TESTS = """
import os

import pytest

pytestmark = pytest.mark.boxlite


def test_one(request, probe_at_setup):
    assert os.environ.get("PYTEST_BOXLITE_GUEST") == "1"
    assert probe_at_setup == request.node.nodeid


def test_two(request, probe_at_setup):
    assert probe_at_setup == request.node.nodeid
"""


def _run(tmp_path: Path, home: Path, tag: str, conftest: str, *args: str) -> tuple[int, str]:
    proj = tmp_path / tag
    proj.mkdir()
    (proj / "conftest.py").write_text(textwrap.dedent(conftest))
    (proj / "test_a.py").write_text(textwrap.dedent(TESTS))
    run = SubRun(proj, home, tag, "-p", "no:randomly", "-p", "no:xdist", *args)
    rc = run.wait(200)
    assert ledger.scan(home) == [], f"boxes left behind in {home}"
    return rc, run.output


@pytest.mark.parametrize(
    "args",
    [
        pytest.param((), id="forked-per-test"),
        pytest.param(("--boxlite-scope=module",), id="one-box-per-module"),
        pytest.param(("--boxlite-fresh=boot",), id="booted-per-test"),
    ],
)
def test_a_plugins_fields_travel_with_each_item_to_its_box(tmp_path: Path, home: Path, args: tuple[str, ...]) -> None:
    rc, output = _run(tmp_path, home, "fields", CONFTEST, *args)
    assert rc == 0 and "2 passed" in output, output


def test_a_malformed_result_is_an_error_naming_the_hook(tmp_path: Path, home: Path) -> None:
    conftest = "def pytest_boxlite_box_fields(config, item, nodeid, wide_only):\n    return ['not', 'a', 'dict']\n"
    rc, output = _run(tmp_path, home, "malformed", conftest)
    assert rc != 0, output
    assert "a pytest_boxlite_box_fields hook returned ['not', 'a', 'dict'], not a dict with str keys" in output, output
