"""``@pytest.mark.boxlite`` and ``--boxlite``: the same test files, run locally and in boxes, compared.

Every check here is a real pytest sub-run (``pytester``) whose boxed tests run
in real namespace boxes, each sub-run with a private ``--boxlite-home``.  After
every sub-run no box may be left behind.  Boxes cost about half a second each,
so the checks are packed into few sub-runs.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import socket
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from subruns import BOX_SPY_CONFTEST, TcpServer, host_cleanup, process_gone, wait_until

from pytest_boxlite import ledger

pytestmark = pytest.mark.timeout(120)

BOX_PROPERTY = "boxlite_box"


# --------------------------------------------------------------------------
# helpers


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A private BoxLite home for the sub-runs of one test; no box may be left in it afterwards."""
    h = tmp_path / "bxh"
    yield h
    assert ledger.scan(h) == []


def no_leftovers(home: Path) -> None:
    assert ledger.scan(home) == [], f"boxes left behind in {home}"


class _Collector:
    """Records every test report a sub-run logs (also when the run ends in an internal error)."""

    def __init__(self) -> None:
        self.reports: list[pytest.TestReport] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.reports.append(report)


def run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, dict[tuple[str, str], pytest.TestReport]]:
    """An in-process sub-run: its result, and its test reports keyed by (nodeid, when)."""
    collector = _Collector()
    result = pytester.runpytest_inprocess(*args, plugins=[collector])
    out: dict[tuple[str, str], pytest.TestReport] = {}
    for rep in collector.reports:
        key = (rep.nodeid, rep.when)
        assert key not in out, f"{key} was reported twice"
        out[key] = rep
    return result, out


def no_addresses(text: str) -> str:
    """Object reprs (``<function f at 0x7f...>``) differ between any two processes."""
    return re.sub(r" at 0x[0-9a-f]+>", " at 0x?>", text)


def props(rep: Any) -> dict[str, Any]:
    return dict(rep.user_properties)


def without_box(user_properties: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return [p for p in user_properties if p[0] != BOX_PROPERTY]


def box_of(reports: dict[tuple[str, str], Any], nodeid: str) -> str:
    """The box a test ran in, from the property the plugin adds to the teardown report."""
    name = props(reports[(nodeid, "teardown")]).get(BOX_PROPERTY)
    assert isinstance(name, str), f"{nodeid}: no {BOX_PROPERTY}: {reports[(nodeid, 'teardown')].user_properties}"
    assert name.startswith(ledger.PREFIX), name
    return name


def junit_cases(path: Path) -> dict[tuple[str, str], ET.Element]:
    root = ET.parse(path).getroot()
    return {(tc.get("classname", ""), tc.get("name", "")): tc for tc in root.iter("testcase")}


def junit_view(tc: ET.Element) -> tuple[dict[str, str], list[tuple[str, dict[str, str], str]], list[tuple[str, str]]]:
    """A testcase without its timing: attributes, children (tag, attributes, text) and properties."""
    attrs = {k: v for k, v in tc.attrib.items() if k != "time"}
    children = [(c.tag, dict(c.attrib), no_addresses((c.text or "").strip())) for c in tc if c.tag != "properties"]
    properties = [(p.get("name", ""), p.get("value", "")) for p in tc.iter("property")]
    return attrs, children, properties


# --------------------------------------------------------------------------
# 3. reports with full fidelity: the same file, locally and in boxes

FIDELITY_CONFTEST = """
    import pytest

    @pytest.fixture
    def greeting():
        print("fixture setup says hi")
        yield "hello"
        print("fixture teardown says bye")
"""

FIDELITY_TESTS = """
    import logging
    import sys

    import pytest

    log = logging.getLogger("fidelity")


    def test_pass_with_output(greeting, record_property):
        print("to stdout", greeting)
        sys.stderr.write("to stderr\\n")
        log.warning("a warning %d", 42)
        record_property("answer", 42)
        record_property("word", greeting)


    def test_fail_list_diff():
        print("printed before failing")
        assert [1, 2, 3] == [1, 2, 4]


    def test_fail_dict_diff(record_property):
        record_property("before", "failure")
        log.error("logged before failing")
        assert {"a": 1, "b": 2} == {"a": 1, "b": 3}


    def test_skip_imperative():
        pytest.skip("not today")


    @pytest.mark.skip(reason="marked skip")
    def test_skip_marked():
        raise AssertionError("never runs")


    @pytest.mark.xfail(reason="known bug")
    def test_xfail():
        assert 1 == 2


    @pytest.mark.xfail(reason="maybe fixed")
    def test_xpass():
        pass


    @pytest.mark.xfail(strict=True, reason="must fail")
    def test_xpass_strict():
        pass


    @pytest.mark.parametrize("n, expected", [(1, 2), (2, 5)])
    def test_param(n, expected):
        assert n * 2 == expected


    @pytest.fixture
    def broken_setup():
        raise RuntimeError("setup boom")


    def test_setup_error(broken_setup):
        pass


    @pytest.fixture
    def broken_teardown():
        yield
        print("tearing down")
        raise RuntimeError("teardown boom")


    def test_teardown_error(broken_teardown):
        print("body ran")
"""


def test_boxed_reports_match_local_reports(pytester: pytest.Pytester, home: Path) -> None:
    """Outcome, failure text, sections, properties, skip/xfail, keywords and the terminal match a local run."""
    pytester.makeconftest(FIDELITY_CONFTEST)
    pytester.makepyfile(test_fidelity=FIDELITY_TESTS)

    local, loc = run(pytester, "-p", "no:boxlite", "-rA")
    boxed, box = run(pytester, "--boxlite", f"--boxlite-home={home}", "-rA")
    no_leftovers(home)

    assert len({nodeid for nodeid, _ in loc}) == 12
    assert sorted(box) == sorted(loc)

    mismatches = []
    boxes = set()
    for key, lrep in loc.items():
        brep = box[key]
        fields = {
            "outcome": (brep.outcome, lrep.outcome),
            "longrepr type": (type(brep.longrepr).__name__, type(lrep.longrepr).__name__),
            "longreprtext": (no_addresses(brep.longreprtext), no_addresses(lrep.longreprtext)),
            "sections": (brep.sections, lrep.sections),
            "user_properties": (without_box(brep.user_properties), list(lrep.user_properties)),
            "wasxfail": (getattr(brep, "wasxfail", None), getattr(lrep, "wasxfail", None)),
            "keywords": (dict(brep.keywords), dict(lrep.keywords)),
            "location": (brep.location, lrep.location),
            "duration > 0": (brep.duration > 0, True),
        }
        mismatches += [(key, name, b, lo) for name, (b, lo) in fields.items() if b != lo]
        assert BOX_PROPERTY not in props(lrep), key
        if key[1] == "teardown":
            boxes.add(box_of(box, key[0]))
    assert not mismatches, "boxed and local reports differ:\n" + "\n".join(
        f"{nodeid} [{when}] {name}: boxed {b!r:.150} != local {lo!r:.150}" for (nodeid, when), name, b, lo in mismatches
    )
    # --boxlite boxed every test, each in a fresh box (default scope).
    assert len(boxes) == 12

    # Spot checks that the compared text is the rich one (assertion rewriting, sections).
    diff = box[("test_fidelity.py::test_fail_list_diff", "call")]
    assert "At index 2 diff: 3 != 4" in diff.longreprtext
    assert ("Captured stdout call", "printed before failing\n") in diff.sections
    dict_diff = box[("test_fidelity.py::test_fail_dict_diff", "call")]
    assert "Differing items:" in dict_diff.longreprtext
    assert "{'b': 2} != {'b': 3}" in dict_diff.longreprtext
    assert any(n == "Captured log call" and "logged before failing" in c for n, c in dict_diff.sections)
    passing = box[("test_fidelity.py::test_pass_with_output", "call")]
    assert [n for n, _ in passing.sections] == [
        "Captured stdout setup",
        "Captured stdout call",
        "Captured stderr call",
        "Captured log call",
    ]
    assert ("answer", 42) in passing.user_properties
    assert ("word", "hello") in passing.user_properties
    assert box[("test_fidelity.py::test_xfail", "call")].wasxfail == "known bug"
    assert box[("test_fidelity.py::test_xpass", "call")].wasxfail == "maybe fixed"
    assert "[XPASS(strict)] must fail" in box[("test_fidelity.py::test_xpass_strict", "call")].longreprtext
    assert "not today" in box[("test_fidelity.py::test_skip_imperative", "call")].longreprtext
    assert "setup boom" in box[("test_fidelity.py::test_setup_error", "setup")].longreprtext
    teardown_error = box[("test_fidelity.py::test_teardown_error", "teardown")]
    assert teardown_error.failed and "teardown boom" in teardown_error.longreprtext

    # The terminal says the same: no internal error, same counts, same -rA summary lines.
    assert "INTERNALERROR" not in boxed.stdout.str() + boxed.stderr.str()
    assert boxed.ret == local.ret == pytest.ExitCode.TESTS_FAILED
    expected_outcomes = {"passed": 3, "failed": 4, "skipped": 2, "xfailed": 1, "xpassed": 1, "errors": 2}
    assert local.parseoutcomes() == expected_outcomes
    assert boxed.parseoutcomes() == expected_outcomes

    def summary(lines: list[str]) -> list[str]:
        return [ln for ln in lines if re.match(r"(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (\[\d+\] )?test_", ln)]

    assert len(summary(local.outlines)) == 13
    assert summary(boxed.outlines) == summary(local.outlines)


JUNIT_TESTS = """
    import pytest


    def test_property(record_property):
        record_property("answer", 42)


    def test_fail():
        assert [1, 2, 3] == [1, 2, 4]


    @pytest.mark.skip(reason="marked skip")
    def test_skip():
        pass


    @pytest.mark.xfail(reason="known bug")
    def test_xfail():
        assert 0
"""


def test_junitxml_matches_local_and_names_the_box(pytester: pytest.Pytester, home: Path) -> None:
    """--junitxml: the same testcases with the same results, plus a boxlite_box property naming the box."""
    pytester.makepyfile(test_junit=JUNIT_TESTS)
    # xunit1: record_property warns under the default xunit2 family.
    junit = ("-o", "junit_family=xunit1")
    local, _ = run(pytester, "-p", "no:boxlite", *junit, "--junitxml=local.xml")
    boxed, reports = run(pytester, "--boxlite", f"--boxlite-home={home}", *junit, "--junitxml=boxed.xml")
    no_leftovers(home)
    assert "INTERNALERROR" not in boxed.stdout.str() + boxed.stderr.str()
    assert boxed.parseoutcomes() == local.parseoutcomes() == {"passed": 1, "failed": 1, "skipped": 1, "xfailed": 1}

    local_cases = junit_cases(pytester.path / "local.xml")
    boxed_cases = junit_cases(pytester.path / "boxed.xml")
    assert len(local_cases) == 4
    assert sorted(boxed_cases) == sorted(local_cases)
    for key, ltc in local_cases.items():
        l_attrs, l_children, l_props = junit_view(ltc)
        b_attrs, b_children, b_props = junit_view(boxed_cases[key])
        assert b_attrs == l_attrs, key
        assert b_children == l_children, key
        assert [p for p in b_props if p[0] != BOX_PROPERTY] == l_props, key
        box_props = [v for n, v in b_props if n == BOX_PROPERTY]
        assert box_props == [box_of(reports, f"test_junit.py::{key[1]}")], (key, b_props)
    assert ("answer", "42") in junit_view(boxed_cases[("test_junit", "test_property")])[2]
    assert [c[0] for c in junit_view(boxed_cases[("test_junit", "test_fail")])[1]] == ["failure"]
    assert "At index 2 diff" in junit_view(boxed_cases[("test_junit", "test_fail")])[1][0][2]


# --------------------------------------------------------------------------
# 1. marker placement, and --boxlite


def test_marker_on_function_class_and_module(pytester: pytest.Pytester, home: Path) -> None:
    """Marked tests (function, class, ``pytestmark``) run in their own box; unmarked ones on the host."""
    pytester.makepyfile(
        test_mod="""
        import socket
        import pytest

        pytestmark = pytest.mark.boxlite

        def _where(record_property):
            record_property("host", socket.gethostname())

        def test_module_a(record_property):
            _where(record_property)

        def test_module_b(record_property):
            _where(record_property)
        """,
        test_cls="""
        import socket
        import pytest

        def _where(record_property):
            record_property("host", socket.gethostname())

        @pytest.mark.boxlite
        class TestBoxed:
            def test_one(self, record_property):
                _where(record_property)

            def test_two(self, record_property):
                _where(record_property)

        @pytest.mark.boxlite
        def test_function(record_property):
            _where(record_property)

        def test_plain(record_property):
            _where(record_property)

        class TestPlain:
            def test_method(self, record_property):
                _where(record_property)
        """,
    )
    result, reports = run(pytester, f"--boxlite-home={home}")
    no_leftovers(home)
    assert result.parseoutcomes() == {"passed": 7}

    host = socket.gethostname()
    assert not host.startswith(ledger.PREFIX)
    boxed = [
        "test_cls.py::TestBoxed::test_one",
        "test_cls.py::TestBoxed::test_two",
        "test_cls.py::test_function",
        "test_mod.py::test_module_a",
        "test_mod.py::test_module_b",
    ]
    local = ["test_cls.py::test_plain", "test_cls.py::TestPlain::test_method"]
    seen = set()
    for nodeid in boxed:
        guest_host = props(reports[(nodeid, "call")])["host"]
        assert guest_host.startswith(ledger.PREFIX), nodeid
        assert guest_host == box_of(reports, nodeid)[:63], nodeid
        seen.add(guest_host)
    assert len(seen) == len(boxed), "each test gets a fresh box"
    for nodeid in local:
        assert props(reports[(nodeid, "call")])["host"] == host, nodeid
        assert BOX_PROPERTY not in props(reports[(nodeid, "teardown")]), nodeid


# --------------------------------------------------------------------------
# 2. what runs where


ISOLATION_CONFTEST = """
    import os
    import socket

    import pytest

    @pytest.fixture
    def where():
        return socket.gethostname(), os.getpid()
"""

ISOLATION_TESTS = """
    import logging
    import os
    import socket

    import pytest

    HERE = os.path.dirname(os.path.abspath(__file__))


    def test_host_files_visible_writes_stay(where, record_property):
        host = socket.gethostname()
        record_property("host", host)
        assert host.startswith("pbx-")
        assert where == (host, os.getpid())  # the conftest fixture ran in this very process
        assert os.path.isfile(__file__)  # the project is at the same path in the guest
        with open(os.path.join(HERE, "sentinel.txt")) as f:
            assert f.read() == "host"
        with open(os.path.join(HERE, "sentinel.txt"), "w") as f:
            f.write("guest")
        with open(os.path.join(HERE, "{guest_file}"), "w") as f:
            f.write("guest")
        with open("/etc/{etc_file}", "w") as f:
            f.write("guest")
        with open(os.path.join(HERE, "sentinel.txt")) as f:
            assert f.read() == "guest"


    @pytest.mark.parametrize("n", [1, 2])
    def test_fixtures_in_box(n, where, tmp_path, monkeypatch, capsys, caplog, record_property):
        host = socket.gethostname()
        record_property("host", host)
        record_property("n", n)
        assert host.startswith("pbx-")
        assert where == (host, os.getpid())
        marker = tmp_path / "made-in-box.txt"
        marker.write_text(host)
        record_property("tmp_file", str(marker))
        monkeypatch.setenv("PBX_MARKER_N", str(n))
        assert os.environ["PBX_MARKER_N"] == str(n)
        monkeypatch.chdir(tmp_path)
        assert os.getcwd() == str(tmp_path)
        print("captured", n)
        assert capsys.readouterr().out == f"captured {n}\\n"
        logging.getLogger("iso").warning("warned %d", n)
        assert [r.getMessage() for r in caplog.records] == [f"warned {n}"]
"""


def test_what_runs_in_the_box(pytester: pytest.Pytester, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--boxlite: body, conftest fixtures, tmp_path, monkeypatch, capsys, caplog, params run in a box.

    The guest sees the project at the same path; nothing it writes (own directory, /etc) reaches the host.
    """
    # pytester points this at a host directory under /tmp, which a box does not see (its /tmp is
    # private); test_tmp_path_when_host_temproot_is_under_tmp covers that case on its own.
    monkeypatch.delenv("PYTEST_DEBUG_TEMPROOT", raising=False)
    tag = uuid.uuid4().hex[:10]
    guest_file = f"guest-wrote-{tag}.txt"
    etc_file = f"pbx-marker-{tag}"
    pytester.makeconftest(ISOLATION_CONFTEST)
    pytester.makepyfile(test_iso=ISOLATION_TESTS.replace("{guest_file}", guest_file).replace("{etc_file}", etc_file))
    (pytester.path / "sentinel.txt").write_text("host")

    with host_cleanup(pytester.path / guest_file, Path("/etc") / etc_file):
        result, reports = run(pytester, "--boxlite", f"--boxlite-home={home}")
        no_leftovers(home)
        assert result.parseoutcomes() == {"passed": 3}, result.stdout.str()

        # Nothing the guest wrote reached the host.
        assert (pytester.path / "sentinel.txt").read_text() == "host"
        assert not (pytester.path / guest_file).exists()
        assert not (Path("/etc") / etc_file).exists()
    assert "PBX_MARKER_N" not in os.environ

    hosts = set()
    for n in (1, 2):
        call = props(reports[(f"test_iso.py::test_fixtures_in_box[{n}]", "call")])
        assert call["n"] == n
        hosts.add(call["host"])
        # tmp_path was made in the box's private /tmp: it is not on the host.
        assert not Path(call["tmp_file"]).exists()
    hosts.add(props(reports[("test_iso.py::test_host_files_visible_writes_stay", "call")])["host"])
    assert len(hosts) == 3 and all(h.startswith(ledger.PREFIX) for h in hosts)


def test_tmp_path_when_host_temproot_is_under_tmp(
    pytester: pytest.Pytester, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tmp_path works in a box when the host's PYTEST_DEBUG_TEMPROOT names a directory under /tmp.

    pytester sets it for every sub-run (so does any plugin's own test suite); the worker inherits
    the host environment, but the box's /tmp is private, so the directory named is not there.
    """
    temproot = Path("/tmp") / f"pbx-temproot-{uuid.uuid4().hex[:10]}"
    temproot.mkdir()
    try:
        monkeypatch.setenv("PYTEST_DEBUG_TEMPROOT", str(temproot))
        pytester.makepyfile(
            test_tmp="""
            import pytest

            @pytest.mark.boxlite
            def test_tmp(tmp_path):
                (tmp_path / "f").write_text("x")
            """
        )
        result, _ = run(pytester, f"--boxlite-home={home}")
        no_leftovers(home)
    finally:
        shutil.rmtree(temproot, ignore_errors=True)
    assert result.parseoutcomes() == {"passed": 1}, result.stdout.str()


def test_an_option_value_that_is_a_path_names_the_tests_as_on_the_host(pytester: pytest.Pytester) -> None:
    """``--boxlite-home DIR`` (the value apart): pytest finds the rootdir before it knows any
    plugin's (or conftest's) options, so on the host DIR counts as a path of the command line and
    the rootdir is the common ancestor of it and the project, while in the box DIR does not exist.
    The box is given the host's rootdir: its tests have the host's node ids (else the box could
    not find the test the host asked for, and it errored)."""
    pytester.makepyfile(
        test_named="""
        import pytest

        @pytest.mark.boxlite
        def test_here():
            pass
        """
    )
    # Directly in /tmp: the rootdir is then /tmp itself, which the box does not see whole (its
    # /tmp is its own, with the project's directory in it).
    home = Path("/tmp") / f"pbx-home-{uuid.uuid4().hex[:10]}"
    home.mkdir()
    try:
        # A run of its own, as from a shell (in-process, the options are known early); no cache:
        # the rootdir is /tmp, where .pytest_cache may be another user's.
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--boxlite-home", str(home), ".")
        no_leftovers(home)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert result.parseoutcomes() == {"passed": 1}, result.stdout.str()
    # The host's rootdir is the common ancestor (the situation this test is about).
    result.stdout.fnmatch_lines([f"rootdir: {os.path.commonpath([pytester.path, home])}"])


# --------------------------------------------------------------------------
# 3. -x, -k and --lf


def test_exitfirst_keyword_and_last_failed(pytester: pytest.Pytester, home: Path) -> None:
    """-x stops after the first boxed failure, -k selects, --lf reruns only the boxed failure."""
    pytester.makepyfile(
        test_sel="""
        import socket

        def test_a():
            assert socket.gethostname().startswith("pbx-")

        def test_b():
            assert socket.gethostname() == "no such host"

        def test_c():
            pass

        def test_deselect_me():
            pass
        """
    )
    first, first_reports = run(pytester, "--boxlite", f"--boxlite-home={home}", "-x", "-k", "not deselect_me")
    no_leftovers(home)
    assert first.parseoutcomes() == {"passed": 1, "failed": 1, "deselected": 1}
    assert first.ret == pytest.ExitCode.TESTS_FAILED
    ran = {nodeid for nodeid, _ in first_reports}
    assert ran == {"test_sel.py::test_a", "test_sel.py::test_b"}
    first.stdout.fnmatch_lines(["*stopping after 1 failures*"])
    failure = first_reports[("test_sel.py::test_b", "call")]
    assert "assert 'pbx-" in failure.longreprtext and "== 'no such host'" in failure.longreprtext

    again, reports = run(pytester, "--boxlite", f"--boxlite-home={home}", "--lf")
    no_leftovers(home)
    assert again.parseoutcomes() == {"failed": 1}  # --lf does not even collect the others
    assert {nodeid for nodeid, _ in reports} == {"test_sel.py::test_b"}
    box_of(reports, "test_sel.py::test_b")
    again.stdout.fnmatch_lines(["*run-last-failure: rerun previous 1 failure*"])


def test_boxes_keep_no_deselected_item_and_still_run_what_only_they_deselect(
    pytester: pytest.Pytester, home: Path
) -> None:
    """Every box is a fork of its warm interpreter, which lets go of the items its collection
    deselected (click's 31,000 were half its memory: each fork copied their page tables twice);
    a test the host selects that the box's own collection deselects is collected alone and runs."""
    pytester.makeconftest(
        """
        import os

        def pytest_collection_modifyitems(config, items):
            if os.environ.get("BOXLITE_BOX"):  # in the box only: the host selects it
                dropped = [item for item in items if item.name == "test_only_the_host_selects"]
                if dropped:
                    config.hook.pytest_deselected(items=dropped)
                    items[:] = [item for item in items if item not in dropped]
        """
    )
    pytester.makepyfile(
        test_sel="""
        import gc

        import pytest

        @pytest.mark.parametrize("n", range(300))
        def test_deselect_me(n):
            pass

        def test_items_in_the_box(record_property):
            items = [o for o in gc.get_objects() if isinstance(o, pytest.Item)]
            record_property("items", sorted({item.name for item in items}))

        def test_only_the_host_selects():
            pass
        """
    )
    result, reports = run(pytester, "--boxlite", f"--boxlite-home={home}", "-k", "not deselect_me")
    no_leftovers(home)
    assert result.parseoutcomes() == {"passed": 2, "deselected": 300}
    names = props(reports[("test_sel.py::test_items_in_the_box", "call")])["items"]
    assert "test_items_in_the_box" in names
    assert not [name for name in names if name.startswith("test_deselect_me")]
    box_of(reports, "test_sel.py::test_only_the_host_selects")


# --------------------------------------------------------------------------
# 1. --boxlite-scope


SCOPE_TESTS = """
    import os
    import socket

    def test_1_writes(record_property):
        record_property("host", socket.gethostname())
        record_property("saw", os.path.exists("/workspace/x"))
        with open("/workspace/x", "w") as f:
            f.write("from test 1")
        # A new top-level directory, on the box's own root directory.
        try:
            os.mkdir("/pbx-scope-top")
            record_property("made_top", True)
        except OSError:
            record_property("made_top", False)

    def test_2_reads(record_property):
        record_property("host", socket.gethostname())
        record_property("saw", os.path.exists("/workspace/x"))
        record_property("saw_top", os.path.exists("/pbx-scope-top"))
"""


def test_scope_module_shares_a_box_in_order(pytester: pytest.Pytester, home: Path) -> None:
    """--boxlite-scope=module: the tests of one module share a box in order; another module gets its own."""
    pytester.makepyfile(test_scope_a=SCOPE_TESTS, test_scope_b=SCOPE_TESTS)
    assert not Path("/workspace/x").exists()
    result, reports = run(pytester, "--boxlite", "--boxlite-scope=module", f"--boxlite-home={home}")
    no_leftovers(home)
    assert result.parseoutcomes() == {"passed": 4}
    for module in ("test_scope_a.py", "test_scope_b.py"):
        first = props(reports[(f"{module}::test_1_writes", "call")])
        second = props(reports[(f"{module}::test_2_reads", "call")])
        assert first["saw"] is False, module
        assert second["saw"] is True, module
        assert second["saw_top"] is first["made_top"], module
        assert first["host"] == second["host"], module
        assert box_of(reports, f"{module}::test_1_writes") == box_of(reports, f"{module}::test_2_reads")
    assert box_of(reports, "test_scope_a.py::test_1_writes") != box_of(reports, "test_scope_b.py::test_1_writes")
    assert not Path("/workspace/x").exists()
    assert not Path("/pbx-scope-top").exists()


STOP_TESTS = """
    import socket

    import pytest

    pytestmark = pytest.mark.boxlite(network=True)


    @pytest.mark.parametrize("word", [b"w1", b"w2", b"w3", b"w4"])
    def test_says(word):
        with socket.create_connection(("127.0.0.1", PORT), timeout=5) as conn:
            conn.sendall(word)
        assert word != b"w2"
"""


@pytest.mark.parametrize("stop", [[], ["-x"], ["--maxfail=1"], ["--sw"]], ids=["none", "x", "maxfail", "stepwise"])
def test_scope_module_runs_the_tests_pytest_runs_and_no_more(
    pytester: pytest.Pytester, home: Path, tcp_server: TcpServer, stop: list[str]
) -> None:
    """A module's box is sent its next test as soon as the one before it ends (the host logs the
    reports meanwhile), but never where those reports can stop the session: after the failure
    under -x, --maxfail or --stepwise no test runs in the box.  The tests say they ran to a
    server on the host (their boxes share its network); the order is pytest's."""
    pytester.makepyfile(test_stop=STOP_TESTS.replace("PORT", str(tcp_server.port)))
    args = ("--boxlite", "--boxlite-scope=module", f"--boxlite-home={home}", "-p", "no:randomly", *stop)
    result, _ = run(pytester, *args)
    no_leftovers(home)
    ran = [b"w1", b"w2"] if stop else [b"w1", b"w2", b"w3", b"w4"]
    assert result.parseoutcomes() == ({"failed": 1, "passed": 1} if stop else {"failed": 1, "passed": 3})
    assert tcp_server.got(ran[-1])
    time.sleep(1.0)  # a test run after the stop would have said so by now
    assert tcp_server.received == ran


def test_scope_test_is_the_default_fresh_box_per_test(pytester: pytest.Pytester, home: Path) -> None:
    """Default scope: test 2 does not see what test 1 wrote to /workspace; each has its own box."""
    pytester.makepyfile(test_scope_a=SCOPE_TESTS)
    result, reports = run(pytester, "--boxlite", f"--boxlite-home={home}")
    no_leftovers(home)
    assert result.parseoutcomes() == {"passed": 2}
    first = props(reports[("test_scope_a.py::test_1_writes", "call")])
    second = props(reports[("test_scope_a.py::test_2_reads", "call")])
    assert first["saw"] is False
    assert second["saw"] is False
    assert first["made_top"] is True  # its box's root directory is writable (root or not): it must not last
    assert second["saw_top"] is False
    assert first["host"] != second["host"]
    assert box_of(reports, "test_scope_a.py::test_1_writes") != box_of(reports, "test_scope_a.py::test_2_reads")


AHEAD_TESTS = """
    import time

    def test_1_slow(record_property):
        record_property("start", time.time())
        time.sleep(0.5)
        record_property("end", time.time())

    def test_2(record_property):
        record_property("start", time.time())

    def test_3(record_property):
        record_property("start", time.time())
"""


def test_box_forked_ahead_starts_its_test_only_after_the_one_before(pytester: pytest.Pytester, home: Path) -> None:
    """The next test's box is forked while a test runs, but its test starts after that test ends."""
    pytester.makepyfile(test_ahead=AHEAD_TESTS)
    result, reports = run(pytester, "--boxlite", f"--boxlite-home={home}")
    no_leftovers(home)
    assert result.parseoutcomes() == {"passed": 3}
    first = props(reports[("test_ahead.py::test_1_slow", "call")])
    second = props(reports[("test_ahead.py::test_2", "call")])
    third = props(reports[("test_ahead.py::test_3", "call")])
    assert first["end"] - first["start"] >= 0.5
    assert second["start"] >= first["end"], (first, second)
    assert third["start"] >= second["start"]
    boxes = {box_of(reports, f"test_ahead.py::{name}") for name in ("test_1_slow", "test_2", "test_3")}
    assert len(boxes) == 3


OUT_OF_ORDER_CONFTEST = """
    import os
    import socket
    import time

    _connect = socket.socket.connect


    def connect(self, address):
        # In a box forked from the warm interpreter, before its own /tmp: number the boxes in the
        # order they were made (the warm box's /tmp is still shared), and hold the second one back
        # so that the third, made ahead after it, connects to the host first.
        if str(address).endswith("fork.sock"):
            n = 1
            while True:
                try:
                    os.close(os.open("/tmp/pbx-ticket-%d" % n, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    break
                except FileExistsError:
                    n += 1
            if n == 2:
                time.sleep(0.4)
        return _connect(self, address)


    if os.environ.get("PYTEST_BOXLITE_GUEST") == "1":  # in the boxes only, not in this host process
        socket.socket.connect = connect
"""


def test_boxes_forked_ahead_may_connect_in_any_order(pytester: pytest.Pytester, home: Path) -> None:
    """Two boxes are made ahead while a test runs; the later one connecting first takes nothing
    from the earlier one (its connection is kept for its own test, not dropped as stale)."""
    pytester.makeconftest(OUT_OF_ORDER_CONFTEST)
    pytester.makepyfile(test_ahead=AHEAD_TESTS.replace("time.sleep(0.5)", "time.sleep(1.5)"))
    result, reports = run(pytester, "--boxlite", "-p", "no:randomly", f"--boxlite-home={home}")
    no_leftovers(home)
    assert result.parseoutcomes() == {"passed": 3}, result.stdout.str()[-3000:]
    boxes = {box_of(reports, f"test_ahead.py::{name}") for name in ("test_1_slow", "test_2", "test_3")}
    assert len(boxes) == 3


MASK_MOUNT_CONFTEST = """
    import os

    from pytest_boxlite.runtimes.namespace import mounts

    _build, _complete = mounts._build_mask_layer, mounts._complete


    def _no_layers(root, entries):
        # Injected fault: no mask layer can be made (as where the layers' directory has no user
        # xattrs), so credentials are masked by mounts laid over the copy-on-write directories.
        _build(root, entries)
        return {top for top, _, _ in entries}


    def pytest_configure(config):
        if os.environ.get("PYTEST_BOXLITE_GUEST") != "1":
            mounts._mask_plan_cached.cache_clear()
            mounts._build_mask_layer = _no_layers
            mounts._complete = lambda root: False  # a build the host cached already is not used


    def pytest_unconfigure(config):
        if os.environ.get("PYTEST_BOXLITE_GUEST") != "1":
            mounts._build_mask_layer, mounts._complete = _build, _complete
            mounts._mask_plan_cached.cache_clear()
"""


def test_a_credential_masked_by_a_mount_boots_a_box_per_test(pytester: pytest.Pytester, home: Path) -> None:
    """A credential masked by a mount (no mask layer could be made) lies over part of a
    copy-on-write directory, which no per-test fork can renew (its mount is locked beneath the
    fork, and overlayfs refuses such a lower directory): the session says so once and boots a box
    per test, and every test runs, instead of each failing with 'mount ...: Invalid argument'.
    The fault (no layer) is injected; the refusal it leads to is the real kernel's."""
    secret = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".vault-token"  # the real home (pytester sets HOME)
    if secret.exists():
        pytest.skip(f"{secret} exists on this host; not touching it")
    secret.write_text("pbx-secret\n")
    try:
        pytester.makeconftest(MASK_MOUNT_CONFTEST)
        pytester.makepyfile(
            test_masked="""
            import os
            import pwd
            from pathlib import Path

            def test_1():
                home = Path(pwd.getpwuid(os.getuid()).pw_dir)
                try:
                    content = home.joinpath(".vault-token").read_text()
                except OSError:
                    content = ""  # masked by a device node on a nodev mount: unreadable
                assert "pbx-secret" not in content

            def test_2():
                pass
            """
        )
        result, reports = run(pytester, "--boxlite", f"--boxlite-home={home}")
        # The failure was this session's own: the next one (layers can be made again) forks.
        pytester.makeconftest("")
        again, _ = run(pytester, "--boxlite", f"--boxlite-home={home}")
    finally:
        secret.unlink()
    no_leftovers(home)
    assert result.parseoutcomes() == {"passed": 2}, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["*boxes cannot be forked per test here (* is mounted over part of *"])
    assert box_of(reports, "test_masked.py::test_1") != box_of(reports, "test_masked.py::test_2")
    assert again.parseoutcomes() == {"passed": 2}, again.stdout.str()[-3000:]
    assert "cannot be forked" not in again.stdout.str()
    again.stdout.fnmatch_lines(["*boxes booted 1, forked 2*"])


def test_box_forked_ahead_and_never_used_is_ended(pytester: pytest.Pytester, home: Path) -> None:
    """-x stops the session after a failure: the box forked ahead for the next test is ended with it."""
    pytester.makepyfile(
        test_stop="""
        def test_1_fails():
            assert False

        def test_2_never_runs():
            pass
        """
    )
    result, reports = run(pytester, "--boxlite", "-x", f"--boxlite-home={home}")
    no_leftovers(home)
    assert result.parseoutcomes() == {"failed": 1}
    assert ("test_stop.py::test_2_never_runs", "call") not in reports

    def left() -> list[Path]:
        return [p for p in Path("/proc").iterdir() if p.name.isdigit() and _runs_in(p, home)]

    # A box's processes die with its pid 1, which the kernel finishes a moment after pytest has
    # exited (seen under load); one still there after that is a leak.
    wait_until(lambda: not left(), timeout=10)
    assert left() == [], f"processes of the run's boxes outlived it: {left()}"


def _runs_in(proc: Path, home: Path) -> bool:
    """Whether process ``proc`` (a /proc entry, not a zombie) was started for a box under ``home``."""
    try:
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False  # it ended while we looked
    return str(home) in cmdline and not process_gone(int(proc.name))


# --------------------------------------------------------------------------
# 1. strict marker validation


@pytest.mark.parametrize(
    ("marker", "names"),
    [
        pytest.param("imgae='x'", ["imgae"], id="unknown-keyword"),
        pytest.param("cpus=0", ["cpus", "0"], id="cpus-zero"),
        pytest.param("'positional'", ["positional"], id="positional"),
        pytest.param("env={'A': 1}", ["env"], id="env-non-str-value"),
    ],
)
def test_bad_marker_arguments_are_usage_errors(
    pytester: pytest.Pytester, home: Path, marker: str, names: list[str]
) -> None:
    """A bad marker argument is a usage error (exit 4) naming the test and the argument."""
    pytester.makepyfile(
        test_bad=f"""
        import pytest

        @pytest.mark.boxlite
        def test_good():
            pass

        @pytest.mark.boxlite({marker})
        def test_bad():
            pass
        """
    )
    result, _ = run(pytester, f"--boxlite-home={home}")
    no_leftovers(home)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    error_lines = [ln for ln in err.splitlines() if "test_bad.py::test_bad" in ln]
    assert error_lines, err
    for name in names:
        assert any(name in ln for ln in error_lines), (name, err)
    assert "test_good" not in err


def test_a_box_that_boots_after_the_session_ended_gets_no_runner(
    pytester: pytest.Pytester, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A usage error can end the session while the default box boots (it starts at the first
    marked item); the shutdown waits for that boot.  The box must then get no warm-interpreter
    runner, which nothing would shut down (CI saw its status directory left to a finalizer: a
    ResourceWarning in a later test).  Injected here: a collection that ends (with the usage
    error) only once the boot has begun, and a boot that ends only once the shutdown has begun."""
    from pytest_boxlite.runtimes.namespace import runtime
    from pytest_boxlite.session import BoxliteSession

    create, shutdown = runtime.NamespaceRuntime.create_box, BoxliteSession.shutdown
    entered, shutting, booted = threading.Event(), threading.Event(), threading.Event()

    def slow(self: Any, *args: Any, **kwargs: Any) -> Any:
        entered.set()
        shutting.wait(30)  # the boot ends only after the session has begun to shut down
        try:
            return create(self, *args, **kwargs)
        finally:
            booted.set()

    def shutdown_marked(self: BoxliteSession) -> None:
        shutting.set()
        shutdown(self)

    monkeypatch.setattr(runtime.NamespaceRuntime, "create_box", slow)
    monkeypatch.setattr(BoxliteSession, "shutdown", shutdown_marked)
    pytester.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.boxlite
        def test_good():
            pass
        """
    )
    hosts: list[Any] = []

    class Inject:
        @pytest.hookimpl(trylast=True)
        def pytest_configure(self, config: pytest.Config) -> None:
            hosts.append(config.pluginmanager.get_plugin("boxlite-host"))

        @pytest.hookimpl(tryfirst=True)
        def pytest_collection_modifyitems(self) -> None:
            # A bad marker is refused before its module's boxes are asked for (MarkerCheck): the
            # usage error that ends this session while the box boots is injected instead.
            assert entered.wait(30), "the default box's boot never began"
            raise pytest.UsageError("injected: the session ends while the default box boots")

    result = pytester.runpytest_inprocess(f"--boxlite-home={home}", plugins=[Inject()])
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert booted.is_set(), "the session ended without waiting for the boot"
    assert hosts and hosts[0] is not None and hosts[0]._remote is None, "a runner was made after the session ended"
    no_leftovers(home)
    assert "passed" not in result.stdout.str()


# --------------------------------------------------------------------------
# 5. when the box itself fails

DUMP_CONFTEST = """
    import json

    def pytest_runtest_logreport(report):
        # On the host this file is the real one; a box only ever writes to its own copy.
        with open({path!r}, "a") as f:
            f.write(json.dumps({{
                "nodeid": report.nodeid,
                "when": report.when,
                "outcome": report.outcome,
                "longreprtext": report.longreprtext,
                "sections": report.sections,
                "duration": report.duration,
                "user_properties": [list(p) for p in report.user_properties],
            }}) + "\\n")
"""

CRASH_TESTS = """
    import ctypes
    import os
    import time

    import pytest


    def test_exit():
        os._exit(3)


    def test_after_exit():
        pass


    def test_segfault():
        ctypes.string_at(0)


    @pytest.mark.boxlite(timeout=1)
    def test_marker_timeout():
        time.sleep(30)


    @pytest.mark.boxlite(memory=128)
    def test_oom():
        hog = []
        for _ in range(32):  # 1 GiB at most, touched page by page
            hog.append(b"x" * (32 << 20))


    @pytest.mark.timeout(1)
    def test_pytest_timeout():
        time.sleep(30)


    def test_last():
        pass
"""


def test_box_failures_become_failed_reports(pytester: pytest.Pytester, home: Path) -> None:
    """os._exit, SIGSEGV, marker timeout, OOM and pytest-timeout fail the test, never the session."""
    from pytest_boxlite.runtimes import _cgroups

    probe = _cgroups.create(f"probe-{os.getpid()}", memory_mib=128, cpus=None, pids=None)
    probe.remove()
    if probe.missing:
        pytest.skip(f"the memory cap cannot hold for this user ({'; '.join(probe.missing)}): no OOM to report")
    dump = pytester.path / "reports.jsonl"
    pytester.makeconftest(DUMP_CONFTEST.format(path=str(dump)))
    pytester.makepyfile(test_crash=CRASH_TESTS)
    result = pytester.runpytest_subprocess("--boxlite", f"--boxlite-home={home}", timeout=110)
    no_leftovers(home)
    assert result.parseoutcomes() == {"passed": 2, "failed": 5}, result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED

    reports: dict[tuple[str, str], dict[str, Any]] = {}
    for line in dump.read_text().splitlines():
        rep = json.loads(line)
        key = (rep["nodeid"], rep["when"])
        assert key not in reports, f"{key} reported twice"
        reports[key] = rep

    def failure(name: str) -> dict[str, Any]:
        nodeid = f"test_crash.py::{name}"
        failed = [r for (n, _), r in reports.items() if n == nodeid and r["outcome"] == "failed"]
        assert len(failed) == 1, (name, failed)
        # Every phase is reported, and the test ends with a teardown report.
        assert (nodeid, "teardown") in reports, name
        return failed[0]

    exited = failure("test_exit")
    assert "exited with status 3" in exited["longreprtext"]

    segv = failure("test_segfault")
    assert "SIGSEGV" in segv["longreprtext"]
    assert any(name.startswith("boxlite log") for name, _ in segv["sections"]), segv["sections"]

    timed_out = failure("test_marker_timeout")
    assert "timed out" in timed_out["longreprtext"]
    assert timed_out["duration"] < 20  # the test sleeps for 30 s

    oom = failure("test_oom")
    assert "OOM" in oom["longreprtext"]

    pt = failure("test_pytest_timeout")
    assert "Timeout" in pt["longreprtext"]
    assert pt["duration"] < 20

    for name in ("test_after_exit", "test_last"):
        assert reports[(f"test_crash.py::{name}", "call")]["outcome"] == "passed", name
    # The session went on to the end, in order.
    nodeids = list(dict.fromkeys(nodeid for nodeid, _ in reports))
    assert nodeids == [
        f"test_crash.py::{n}"
        for n in (
            "test_exit",
            "test_after_exit",
            "test_segfault",
            "test_marker_timeout",
            "test_oom",
            "test_pytest_timeout",
            "test_last",
        )
    ]
    # The terminal shows the box log section of the crashed test.
    result.stdout.fnmatch_lines(["*boxlite log of pbx-*"])


# --------------------------------------------------------------------------
# marker mistakes before any box (issue 44, item 5)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", [(), ("--boxlite",), ("-n", "2")], ids=["marked", "boxlite", "n2"])
@pytest.mark.parametrize(
    ("marker", "said"),
    [
        pytest.param("imgae='x'", "unknown argument(s) imgae", id="typo"),
        pytest.param("user='nosuchuser'", "user='nosuchuser': no such user or group", id="nosuchuser"),
    ],
)
def test_marker_mistakes_are_usage_errors_before_any_box(
    tmp_path: Path, home: Path, mode: tuple[str, ...], marker: str, said: str
) -> None:
    """A marker mistake (an unknown argument, a ``user=`` nobody is) stops the run as a usage error
    naming the test, in every mode (under ``-n 2`` too, not an INTERNALERROR), before any box of
    the module is made (under ``--boxlite`` the default box boots at the session's start, before
    anything is collected); nothing is reported leaked, since no box was made for it."""
    import subprocess

    from subruns import pytest_argv, sub_env

    (tmp_path / "conftest.py").write_text(BOX_SPY_CONFTEST)
    (tmp_path / "test_bad.py").write_text(
        "import pytest\n\n\n@pytest.mark.boxlite\ndef test_good():\n    pass\n\n\n"
        f"@pytest.mark.boxlite({marker})\ndef test_bad():\n    pass\n"
    )
    spy = tmp_path / "boxes-made"
    proc = subprocess.run(
        pytest_argv(home, "--boxlite-runtime=namespace", *mode, "test_bad.py"),
        cwd=tmp_path,
        env=sub_env(BOX_SPY=str(spy)),
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert re.search(rf"test_bad\.py::test_bad: @pytest\.mark\.boxlite: {re.escape(said)}", out), out
    assert "INTERNALERROR" not in out and "LEAKED" not in out and "leaked 1" not in out, out
    if "--boxlite" not in mode:
        assert not spy.exists(), f"boxes were made before the usage error: {spy.read_text()}"
    no_leftovers(home)
