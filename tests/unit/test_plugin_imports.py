"""The plugin module every pytest process loads stays light: a box's own pytest (and a run that
only collects) must not import the pool, the runtimes or remote execution it never uses.  Their
import cost was about 0.1 s of every box's start-up (see the issue-15 benchmark's module row)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pytest_boxlite.spec import GUEST_ENV

HEAVY = (
    "pytest_boxlite.roles",
    "pytest_boxlite.pool",
    "pytest_boxlite.session",
    "pytest_boxlite.runtimes",
    "pytest_boxlite.remote",
    "pytest_boxlite.xdist_support",
    "execnet",
)


def test_the_plugin_module_imports_no_role() -> None:
    code = f"import sys, pytest, pytest_boxlite.plugin\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_box_s_pytest_registers_the_guest_role_without_the_roles(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a box (the guest variable set), a whole pytest run loads the plugin but none of the roles
    (execnet aside: pytest-xdist's own plugin imports it, in a box as on the host)."""
    monkeypatch.setenv(GUEST_ENV, "1")
    pytester.makeconftest(
        f"""
        import sys

        def pytest_unconfigure(config):
            assert config.pluginmanager.has_plugin("boxlite-guest")
            print("HEAVY", sorted(m for m in {HEAVY[:-1]!r} if m in sys.modules))
        """
    )
    pytester.makepyfile("def test_ok(): pass")
    result = pytester.runpytest_subprocess("-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["HEAVY []"])
