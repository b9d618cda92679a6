"""examples/ refuses to run where boxes would not run it (issue 22, "Examples that are safe
without the plugin").

The examples delete files, edit /etc, fill /tmp, kill every ``sleep`` process and change the
hostname on purpose.  Each sub-run here is one way a user can run them without the plugin boxing
them; each must stop with a usage error naming the cause before any test body runs.

Every refusal sub-run also loads a *shield* plugin (``-p``) that takes over each test's whole run
protocol and only records that a test reached it: no example body can run on this host even
if the refusal is broken (then the test fails on the record instead).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from subruns import QUIET, sub_env

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

SHIELD = """
import os
from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    # Reached only if examples/conftest.py let the run go on: record it, and run nothing.
    with open(os.environ["SHIELD_RECORD"], "a") as fh:
        fh.write(item.nodeid + "\\n")
    return True
"""


@pytest.fixture
def shield(tmp_path: Path) -> tuple[Path, Path]:
    """``(directory holding the shield plugin, the file it records reached tests in)``."""
    plugins = tmp_path / "shield"
    plugins.mkdir()
    (plugins / "boxlite_examples_shield.py").write_text(SHIELD)
    return plugins, tmp_path / "reached.txt"


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )


def _assert_refused(proc: subprocess.CompletedProcess[str], record: Path, why: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert "examples/ refused to run: " + why in out, out
    assert "delete files, edit /etc, fill /tmp, kill every `sleep` process and change the hostname" in out
    assert not record.exists(), f"a test reached its run protocol: {record.read_text()}"


def _shielded_env(plugins: Path, record: Path, home: Path, **extra: str) -> dict[str, str]:
    env = sub_env(SHIELD_RECORD=str(record), PYTHONPATH=str(plugins), **extra)
    # The examples' host sentinels go here, not into the user's home.
    env["BOXLITE_EXAMPLES_SENTINEL"] = str(home / "sentinel")
    return env


@pytest.mark.parametrize(
    ("how", "args", "extra_env", "why"),
    [
        ("-p no:boxlite", ["-p", "no:boxlite"], {}, "the boxlite plugin is disabled (-p no:boxlite)"),
        (
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1",
            [],
            {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD is set, so the boxlite plugin was not loaded",
        ),
        (
            "-n 2 -p no:boxlite",
            ["-n", "2", "-p", "no:boxlite"],
            {},
            "the boxlite plugin is disabled (-p no:boxlite)",
        ),
    ],
)
@pytest.mark.escape_row("examples-unboxed", runtime="host")
def test_examples_refuse_without_the_plugin(
    shield: tuple[Path, Path], tmp_path: Path, how: str, args: list[str], extra_env: dict[str, str], why: str
) -> None:
    plugins, record = shield
    argv = [sys.executable, "-m", "pytest", *QUIET, "-p", "boxlite_examples_shield", *args, str(EXAMPLES)]
    if "-n" in args and importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed")
    proc = _run(argv, ROOT, _shielded_env(plugins, record, tmp_path, **extra_env))
    _assert_refused(proc, record, why)


@pytest.mark.escape_row("examples-unboxed", runtime="host")
def test_examples_refuse_where_the_plugin_is_not_installed(shield: tuple[Path, Path], tmp_path: Path) -> None:
    """A Python that has pytest but not pytest-boxlite: ``python -S`` (no site-packages, so no
    installed distribution and no entry point) with only pytest and its dependencies on the path."""
    plugins, record = shield
    libs = tmp_path / "libs"
    libs.mkdir()
    for name in ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py"):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        # A package is its directory; a single-module one (pytest's py.py shim) is its file.
        source = origin.parent if origin.name == "__init__.py" else origin
        (libs / source.name).symlink_to(source)
    env = _shielded_env(plugins, record, tmp_path)
    env["PYTHONPATH"] = f"{plugins}{os.pathsep}{libs}"
    cwd = tmp_path / "elsewhere"  # python -m puts the working directory on sys.path: not the project
    cwd.mkdir()
    check = "import pytest, importlib.util as u; print(u.find_spec('pytest_boxlite'))"
    probe = _run([sys.executable, "-S", "-c", check], cwd, env)
    assert probe.returncode == 0 and probe.stdout.strip() == "None", probe.stdout + probe.stderr
    argv = [sys.executable, "-S", "-m", "pytest", "-p", "no:cacheprovider", "-p", "boxlite_examples_shield"]
    proc = _run([*argv, str(EXAMPLES)], cwd, env)
    _assert_refused(proc, record, "pytest-boxlite is not installed for this Python")


@pytest.mark.escape_row("examples-unboxed", runtime="host")
def test_an_unmarked_example_is_refused_before_anything_runs(shield: tuple[Path, Path], tmp_path: Path) -> None:
    """With the plugin on, a test in examples/ without the boxlite marker would run on the host."""
    plugins, record = shield
    copy = tmp_path / "examples"
    copy.mkdir()
    shutil.copy(EXAMPLES / "conftest.py", copy / "conftest.py")
    body_ran = tmp_path / "body-ran"
    (copy / "test_unmarked.py").write_text(
        f"from pathlib import Path\n\n\ndef test_forgot_the_marker():\n    Path({str(body_ran)!r}).write_text('ran')\n"
    )
    argv = [sys.executable, "-m", "pytest", *QUIET, "-p", "boxlite_examples_shield", f"--boxlite-home={tmp_path / 'h'}"]
    proc = _run([*argv, str(copy)], tmp_path, _shielded_env(plugins, record, tmp_path))
    _assert_refused(proc, record, "examples/test_unmarked.py::test_forgot_the_marker not marked @pytest.mark.boxlite")
    assert not body_ran.exists()


def test_examples_still_pass_in_boxes(tmp_path: Path) -> None:
    """The guard lets the real thing through: ``python -m pytest examples`` passes, host untouched."""
    if not os.access(EXAMPLES, os.W_OK):
        # An ordinary user's boxes show files this user cannot write read-only (README, "Runtimes"),
        # so the example that removes the project fails in a checkout owned by someone else.
        pytest.skip(f"{EXAMPLES} is not writable by uid {os.getuid()}: run from a checkout this user owns")
    env = sub_env()  # the sentinels in the user's home, as the README's command has them (boxes see it)
    argv = [sys.executable, "-m", "pytest", *QUIET, "-p", "no:randomly", f"--boxlite-home={tmp_path / 'h'}"]
    proc = _run([*argv, str(EXAMPLES)], ROOT, env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "refused" not in out
    assert "host untouched" in out
