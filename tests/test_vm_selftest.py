"""``pytest_boxlite.selftest`` (the KVM host's one-command check), run here against the SDK double."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import sdk_double

from pytest_boxlite.selftest import run_selftest

pytestmark = pytest.mark.timeout(180)


def test_selftest_passes_on_a_working_runtime(tmp_path: Path) -> None:
    out = io.StringIO()
    assert run_selftest(home=tmp_path, sdk=sdk_double, out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "FAIL" not in text and "all steps passed" in text
    assert text.count("ok   ") == 6


def test_selftest_reports_a_broken_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the double's stdin is never closed (the #18 bug), which the self-test must catch."""
    monkeypatch.setattr(sdk_double.ExecStdin, "close", sdk_double.ExecStdin.is_closed)
    out = io.StringIO()
    assert run_selftest(home=tmp_path, sdk=sdk_double, out=out, only=["stdin", "exec"]) == 1
    text = out.getvalue()
    assert "FAIL stdin gets EOF without input" in text and "ok   exec in /workspace" in text
    assert "1 step(s) failed" in text
