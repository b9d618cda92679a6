"""What a pytest process imports at start-up stays what it uses.  The plugin module every pytest
process loads must not import the pool, the runtimes or remote execution: a box's own pytest (and
a run that only collects) never uses them, and their import was about 0.1 s of every box's
start-up (see the issue-15 benchmark's module row).  A session's start imports only the runtime
kinds its home has state of.

Each test starts a fresh interpreter (what it checks is what a new process imports), and the
runner cases run real boxes: so they live here, not in ``tests/unit`` (a layer of in-process tests
that must stay fast on a loaded machine: issue 41)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pytest_boxlite.spec import GUEST_ENV, GUEST_ROLE, ROLE_ENV

HEAVY = (
    "pytest_boxlite.roles",
    "pytest_boxlite.pool",
    "pytest_boxlite.session",
    "pytest_boxlite.runtimes.namespace",
    "pytest_boxlite.runtimes.vm",
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
    """In a box (the guest variables set), a whole pytest run loads the plugin but none of the roles
    (execnet aside: pytest-xdist's own plugin imports it, in a box as on the host)."""
    monkeypatch.setenv(GUEST_ENV, "1")
    monkeypatch.setenv(ROLE_ENV, GUEST_ROLE)
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


def test_reconcile_opens_only_the_runtime_kinds_a_home_has(tmp_path: Path) -> None:
    """A session's start reconciles its home before its first box: a kind whose directory is
    missing or empty (as a clean session leaves it) is not imported (the vm kind: its module and
    asyncio); one with anything in its directory is, and is reconciled."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from pytest_boxlite import ledger\n"
        "home = Path(sys.argv[1])\n"
        "kinds = {'namespace': 'pytest_boxlite.runtimes.namespace.kind', 'vm': 'pytest_boxlite.runtimes.vm'}\n"
        "ledger.reconcile(home)\n"
        "print(sorted(k for k, m in kinds.items() if m in sys.modules))\n"
        "(home / 'vm' / 'stray').write_text('')\n"
        "ledger.reconcile(home)\n"
        "print(sorted(k for k, m in kinds.items() if m in sys.modules))\n"
    )
    (tmp_path / "namespace").mkdir()
    (tmp_path / "vm").mkdir()
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.splitlines() == ["[]", "['vm']"], out.stdout + out.stderr


RUNNER_CASES = [
    # With the plugin installed and nothing boxed, a run makes no warm-interpreter runner and works
    # out no worker mounts: remote execution is imported at the first box, not at configure.
    pytest.param("def test_ok(): pass\n", False, id="nothing-boxed"),
    # A boxlite_sandbox box runs no warm interpreter: using one makes no runner either.
    pytest.param(
        "def test_ok(boxlite_sandbox):\n    assert boxlite_sandbox.execute_command('true').exit_code == 0\n",
        False,
        id="sandbox",
    ),
    # The other side: a marked test gets its runner when its box is wanted.
    pytest.param("import pytest\n\n@pytest.mark.boxlite\ndef test_ok(): pass\n", True, id="marked"),
]


@pytest.mark.parametrize(("test_source", "runner_made"), RUNNER_CASES)
def test_the_runner_and_remote_execution_come_with_the_first_boxed_test(
    pytester: pytest.Pytester, test_source: str, runner_made: bool
) -> None:
    """Remote execution (the warm-interpreter runner, execnet, the guest sources) is made and
    imported only where a test runs in a box of its own."""
    pytester.makeconftest(
        """
        import sys

        def pytest_unconfigure(config):
            host = config.pluginmanager.get_plugin("boxlite-host")
            print("HOST", host is not None)
            print("RUNNER", host is not None and host._remote is not None)
            print("REMOTE", sorted(m for m in sys.modules if m.startswith("pytest_boxlite.remote")))
        """
    )
    pytester.makepyfile(test_source)
    result = pytester.runpytest_subprocess("-s", "--boxlite-home", str(pytester.path / "home"))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["HOST True", f"RUNNER {runner_made}"])
    if not runner_made:
        result.stdout.fnmatch_lines(["REMOTE []"])
