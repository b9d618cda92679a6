"""Coverage of boxed tests is exact: the boxed total equals the unboxed one (issue 23, item 1).

A project laid out as users lay theirs out (``src/`` package, tests in ``tests/`` with a conftest,
``pyproject.toml``), 24 boxed tests in three modules, each touching lines and branches of its own,
measured with pytest-cov and ``--cov-branch``.  Every forked box of a warm box sends the coverage it
ran under that warm box's name: before the fix each test's data replaced the one before, and only
what the last test of a warm box ran survived (63% unboxed, 17% boxed here).

Runs in the plugin tier (``-m plugins``, the venv with the ``matrix`` extra); skips where pytest-cov
is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from subruns import REAL_DATA_HOME

from pytest_boxlite import ledger

pytestmark = [pytest.mark.plugins, pytest.mark.timeout(400)]

TESTS = 24
PER_MODULE = 8

PYPROJECT = """
[project]
name = "covpkg"
version = "0"

[tool.pytest.ini_options]
testpaths = ["tests"]
pythonpath = ["src"]
"""

CONFTEST = """
import pytest


@pytest.fixture
def base():
    return 100
"""


def package_source() -> str:
    """One function per test, each with a branch the test takes one way, and one no test calls."""
    funcs = [
        f"def f{i}(x):\n    if x > {i}:\n        y = x - {i}\n        return y\n    return -{i}\n" for i in range(TESTS)
    ]
    funcs.append("def never(x):\n    a = x\n    b = a + 1\n    return b\n")
    return "\n\n".join(funcs)


def module_source(m: int) -> str:
    tests = ["import covpkg\n"]
    for i in range(m * PER_MODULE, (m + 1) * PER_MODULE):
        arg = "base" if i % 2 else "0"  # half the branches go one way, half the other
        tests.append(f"def test_{i}(base):\n    assert covpkg.f{i}({arg}) is not None\n")
    return "\n\n".join(tests)


#: pytest-cov's term report: ``name stmts miss branch brpart cover`` per file, and the TOTAL.
ROW = re.compile(r"^(\S+\.py|TOTAL)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)%", re.M)


def run(project: Path, home: Path, *args: str) -> tuple[dict[str, tuple[str, ...]], str]:
    """The coverage rows of one sub-run (and its output); all its tests must pass."""
    cmd = [
        sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "-q",
        "--cov=covpkg", "--cov-branch", "--cov-report=term", *args,
    ]  # fmt: skip
    if any(a.startswith("--boxlite") for a in args):
        cmd.append(f"--boxlite-home={home}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_CORE_"))}
    env["XDG_DATA_HOME"] = REAL_DATA_HOME
    proc = subprocess.run(
        cmd, cwd=project, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert ledger.scan(home) == [], f"boxes left behind\n{proc.stdout[-3000:]}"
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"{TESTS} passed" in proc.stdout, proc.stdout[-4000:]
    rows = {m.group(1): m.groups()[1:] for m in ROW.finditer(proc.stdout)}
    assert "TOTAL" in rows, proc.stdout[-4000:]
    return rows, proc.stdout


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("pytest_cov", reason="pytest-cov is not installed: pip install -e '.[matrix]'")
    root = tmp_path_factory.mktemp("covproj")
    (root / "src" / "covpkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / "src" / "covpkg" / "__init__.py").write_text(package_source())
    (root / "tests" / "conftest.py").write_text(CONFTEST)
    for m in range(TESTS // PER_MODULE):
        (root / "tests" / f"test_m{m}.py").write_text(module_source(m))
    return root


@pytest.fixture(scope="module")
def unboxed(project: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, ...]]:
    rows, _ = run(project, tmp_path_factory.mktemp("bxh"))
    # The suite leaves lines and branches unrun: a total of 100% (or 0) would hide lost lines.
    assert 30 < int(rows["TOTAL"][-1]) < 100, rows
    return rows


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(("--boxlite",), id="test-scope"),
        pytest.param(("--boxlite", "--boxlite-scope=module"), id="module-scope"),
    ],
)
def test_boxed_coverage_equals_unboxed(
    project: Path, unboxed: dict[str, tuple[str, ...]], tmp_path: Path, mode: tuple[str, ...]
) -> None:
    boxed, output = run(project, tmp_path / "bxh", *mode)
    assert boxed == unboxed, f"unboxed {unboxed}\nboxed {boxed}\n{output[-3000:]}"
