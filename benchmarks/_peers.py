"""The alternatives measured beside pytest-boxlite: pytest-forked and pytest-isolate.

pytest-forked fails every test under pytest 9, so both run in a virtual environment with
``pytest>=8,<9`` kept at ``benchmarks/.venv-pytest8`` (created once and reused; their rows are
skipped, with the reason, when pip cannot install it).  pytest-isolate is pip-installed with
``--target`` into ``.venv-pytest8/pytest-isolate-site`` (once; a failed install is remembered
there, ``--retry-isolate`` tries again) and put on ``PYTHONPATH`` only for its own rows: installed
into the venv's site-packages it would take over the ``--forked`` rows (its
``pytest_runtest_protocol`` is ``tryfirst`` and it treats ``--forked`` as ``--isolate``).  A
suite whose test checks that it runs in another process is run first.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

from benchmarks._bench import HERE, QUIET_ARGS, Skipped, clean_env, log, run_bounded, step

VENV = HERE / ".venv-pytest8"
VENV_REQUIREMENTS = ("pytest>=8,<9", "pytest-forked")
ISOLATE_SITE = VENV / "pytest-isolate-site"
ISOLATE_FAILED = VENV / "pytest-isolate-install-failed.txt"
ISOLATE_PACKAGES = ("pytest-isolate", "dill", "filelock", "tblib")  # with --no-deps: pytest comes from the venv
#: pytest-isolate's rows run without pytest-forked loaded.
ISOLATE_ARGS = ("-p", "no:pytest_forked")

_PROBE_FORKED = (
    "import importlib.metadata as m, pytest, pytest_forked, sys; "
    "print('pytest', pytest.__version__, 'pytest-forked', m.version('pytest-forked')); "
    "sys.exit(0 if pytest.version_tuple[0] == 8 else 1)"
)

ISOLATE_PROBE_TEST = """\
import os

PID = os.getpid()


def test_runs_in_another_process():
    assert os.getpid() != PID
"""


@dataclasses.dataclass
class Peers:
    """The pytest 8 interpreter (None: pytest-forked rows skipped), pytest-isolate's extra
    environment (None: its rows skipped), and what was found or why not."""

    python8: Path | None
    isolate_env: dict[str, str] | None
    notes: list[str]


def make_venv(venv: Path, requirements: list[str], probe: str, timeout: float) -> tuple[Path, str]:
    """A virtual environment at ``venv`` in which ``probe`` (python code) succeeds: reused if it
    does already, else (re)made and ``requirements`` pip-installed.  Returns its python and what it
    holds; raises :class:`Skipped` with the reason."""
    py = venv / "bin" / "python"

    def usable() -> str | None:
        if not py.exists():
            return None
        rc, out, _, _ = run_bounded([str(py), "-c", probe], cwd=HERE, env=clean_env(), timeout=60)
        return out.strip() if rc == 0 else None

    found = usable()
    if found is not None:
        return py, f"reused {venv} ({found})"
    if not py.exists():
        log(f"creating {venv}")
        step(f"python -m venv {venv}", [sys.executable, "-m", "venv", str(venv)], HERE, 300)
    # A generated environment: kept out of git without touching the project's .gitignore.
    (venv / ".gitignore").write_text("*\n")
    log(f"installing {' '.join(requirements)} into {venv}")
    step(f"pip install {' '.join(requirements)}", [str(py), "-m", "pip", "install", "-q", *requirements], HERE, timeout)
    found = usable()
    if found is None:
        raise Skipped(f"{venv}: the check after pip install failed: {probe}")
    return py, f"made {venv} ({found})"


def ensure_isolate(py: Path, retry: bool, timeout: float) -> tuple[dict[str, str], str]:
    """The environment that loads pytest-isolate into the pytest 8 venv, and what it is; raises Skipped."""
    env = {"PYTHONPATH": str(ISOLATE_SITE)}
    probe = "import importlib.metadata as m; print('pytest-isolate', m.version('pytest-isolate'))"

    def version() -> str | None:
        rc, out, _, _ = run_bounded([str(py), "-c", probe], cwd=HERE, env=clean_env(**env), timeout=60)
        return out.strip() if rc == 0 else None

    found = version() if ISOLATE_SITE.is_dir() else None
    if found:
        return env, f"{found}, reused {ISOLATE_SITE}"
    if ISOLATE_FAILED.exists() and not retry:
        raise Skipped(f"{ISOLATE_FAILED.read_text().strip()} (remembered; --retry-isolate tries again)")
    log(f"installing {' '.join(ISOLATE_PACKAGES)} into {ISOLATE_SITE}")
    shutil.rmtree(ISOLATE_SITE, ignore_errors=True)
    cmd = [str(py), "-m", "pip", "install", "-q", "--no-deps", "--target", str(ISOLATE_SITE), *ISOLATE_PACKAGES]
    try:
        step("pip install pytest-isolate", cmd, HERE, timeout)
        found = version()
        if not found:
            raise Skipped("pytest-isolate does not import after pip install")
    except Skipped as exc:
        ISOLATE_FAILED.write_text(f"{exc}\n")
        shutil.rmtree(ISOLATE_SITE, ignore_errors=True)
        raise
    ISOLATE_FAILED.unlink(missing_ok=True)
    return env, f"{found}, installed into {ISOLATE_SITE}"


def _check_isolate(py: Path, env: dict[str, str], work: Path) -> None:
    probe_dir = work / "isolate-probe"
    probe_dir.mkdir()
    (probe_dir / "pytest.ini").write_text("[pytest]\n")
    (probe_dir / "test_probe.py").write_text(ISOLATE_PROBE_TEST)
    cmd = [str(py), "-m", "pytest", *QUIET_ARGS, *ISOLATE_ARGS, "--isolate"]
    rc, out, _, timed_out = run_bounded(cmd, cwd=probe_dir, env=clean_env(**env), timeout=120)
    if timed_out or rc != 0:
        tail = " ".join(out.strip().splitlines()[-1:]) if out.strip() else "no output"
        raise Skipped(f"a test run with --isolate failed (exit {rc}): {tail[-200:]}")


def peers(work: Path, *, isolate: bool, retry_isolate: bool, timeout: float) -> Peers:
    """pytest-forked's and pytest-isolate's environments, each skipped with its reason if missing."""
    try:
        py, desc = make_venv(VENV, list(VENV_REQUIREMENTS), _PROBE_FORKED, timeout)
    except Skipped as exc:
        log(f"pytest-forked and pytest-isolate rows skipped: {exc}")
        return Peers(None, None, [f"pytest-forked and pytest-isolate rows skipped: {exc}"])
    notes = [f"pytest 8 environment: {desc}"]
    if not isolate:
        return Peers(py, None, notes)
    try:
        env, iso = ensure_isolate(py, retry_isolate, timeout)
        _check_isolate(py, env, work)
    except Skipped as exc:
        log(f"pytest-isolate rows skipped: {exc}")
        notes.append(f"pytest-isolate rows skipped: {exc}")
        return Peers(py, None, notes)
    notes.append(f"pytest-isolate: {iso}")
    return Peers(py, env, notes)
