"""The escape matrix in docs/explanation/escapes.md is what the suite declares (``escape_row``
markers, collected by a real pytest sub-process), and its generator says what it must.

The committed table comes from collection alone, the same on every machine and for every user;
the tests it names prove their rows by running (in CI, as root and as an ordinary user).  Run
``python -m tests.escape_table`` to rewrite the table after changing a marker or a row.
"""

from __future__ import annotations

import difflib

import pytest
from escape_table import DOC, ROWS, TableError, check, collect, committed, render, replace
from escape_table import Proof as P

pytestmark = pytest.mark.timeout(600)


def test_the_committed_table_is_what_the_suite_declares() -> None:
    collected = collect()
    assert len(collected.proofs) > 100, "the suite's escape_row markers were not found"
    table = render(collected.proofs)  # raises if a row has no test or a marker names no row
    old = committed(DOC.read_text())
    diff = "\n".join(difflib.unified_diff(old.splitlines(), table.splitlines(), "committed", "generated", lineterm=""))
    assert old == table, f"{DOC.name} is stale: run python -m tests.escape_table\n{diff}"


def _all_rows(**kwargs: str) -> list[P]:
    return [P(f"tests/test_x.py::test_{r.id.replace('-', '_')}", (r.id,), **kwargs) for r in ROWS]


def test_a_row_without_a_test_or_a_marker_without_a_row_is_refused() -> None:
    proofs = _all_rows(users="both", runtime="namespace")
    check(proofs)
    with pytest.raises(TableError, match=f"row '{ROWS[3].id}' has no test"):
        check(proofs[:3] + proofs[4:])
    with pytest.raises(TableError, match="unknown row 'made-up'"):
        check([*proofs, P("tests/test_x.py::test_y", ("made-up",), "both", "namespace")])
    with pytest.raises(TableError, match="users='nobody'"):
        check([*proofs, P("tests/test_x.py::test_y", (ROWS[0].id,), "nobody", "namespace")])
    check(proofs[:3], complete=False)  # a run of a selection names only its rows


def test_rows_say_what_ran_here_and_claim_no_hold_for_skips_or_known_gaps() -> None:
    proofs = _all_rows(users="both", runtime="namespace")
    first, second, third = (p.nodeid for p in proofs[:3])
    outcomes = {
        first: {"outcome": "skipped", "reason": "micro-VMs cannot boot here"},
        second: {"outcome": "failed", "reason": ""},
        third: {"outcome": "passed", "reason": ""},
    }
    lines = render(proofs, outcomes).splitlines()
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert rows[0].endswith("| **skipped here**, no hold claimed: micro-VMs cannot boot here |"), rows[0]
    assert f"**FAILED**: `{second}`" in rows[1], rows[1]
    assert rows[2].endswith("| holds (1 passed) |"), rows[2]
    assert rows[3].endswith("| **not run here** |"), rows[3]
    # A known gap (xfail) and a root-only test: the row says so and claims nothing it does not prove.
    gap = P("tests/test_x.py::test_gap[a]", (ROWS[0].id,), "both", "namespace", xfail="trusts its workers")
    root_only = P("tests/test_x.py::test_root", (ROWS[0].id,), "root", "host")
    row = render([gap, root_only, *proofs[1:]]).splitlines()[4]
    assert "| host code (no box); root |" in row, row
    assert "`tests/test_x.py::test_gap` (a; **known gap** (xfail): trusts its workers)" in row, row
    assert "`tests/test_x.py::test_root` (as root)" in row, row
    only_gap = render([gap, *proofs[1:]]).splitlines()[4]
    assert "| none; none |" in only_gap, only_gap


def test_the_page_keeps_its_text_around_the_table() -> None:
    page = DOC.read_text()
    block = committed(page)
    assert replace(page, "NEW\n").count("NEW") == 1
    assert replace(page, block) == page
    with pytest.raises(TableError, match="has no generated table"):
        committed(page.replace(block, ""))


def test_a_run_here_records_outcomes_and_a_vm_double_is_no_proof() -> None:
    """A real ``--run`` sub-process over three small tests: a host-code one passes; the vm case of
    a runtime-parametrized test, where no micro-VM boots, runs on the SDK double and is shown skipped."""
    from pytest_boxlite.runtimes import probe

    got = collect(
        "-k",
        "test_what_comes_last_after_the_cap_is_kept or test_vm_bridge_backlog_is_cut_at_its_cap "
        "or (test_the_transfer_cap_holds_on_every_runtime and vm)",
        run=True,
        timeout=300,
    )
    outcomes = {nodeid.split("::", 1)[1]: o for nodeid, o in got.outcomes.items()}
    assert outcomes["test_what_comes_last_after_the_cap_is_kept"]["outcome"] == "passed", outcomes
    assert outcomes["test_vm_bridge_backlog_is_cut_at_its_cap"]["outcome"] == "passed", outcomes
    vm = outcomes["test_the_transfer_cap_holds_on_every_runtime[vm]"]
    if probe().vm_ok:
        assert vm["outcome"] == "passed", vm
    else:
        assert vm["outcome"] == "skipped" and "no micro-VM boots here" in vm["reason"], vm
    table = render(got.proofs, got.outcomes, complete=False)
    assert table.count("| holds (1 passed) |") == 2, table
    assert table.count("| no test selected |") == len(ROWS) - 3, table
