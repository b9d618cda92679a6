"""Sandboxes see the project (issue 23, items 8 and 9): real sub-runs, as root and as ``boxuser``.

A project under the host's /tmp (which every box has private) is shown in a sandbox at its own
path, copy-on-write; commands start in ``/workspace`` (kept: a writable scratch directory on
every runtime, where the vm runtime's project volume is read-only); ``$HOME`` is writable for
whoever a command runs as; boxed tests that delete the project pass; pytest invoked from /tmp
itself (``cd /tmp && pytest proj``) boots boxes that do not show the host's whole /tmp.
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from subruns import QUIET

pytestmark = pytest.mark.timeout(300)

USER = "boxuser"
#: The interpreters the ordinary user may run this project with: this one, or its own venv's.
USER_PYTHONS = (sys.executable, "/home/boxuser/venv/bin/python")
#: This checkout, first on the sub-runs' path: they test this tree, whatever the venv installed.
CHECKOUT = str(Path(__file__).resolve().parents[1])

PROJECT_TESTS = """
import os
import shutil
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_project_visible_at_its_path(boxlite_sandbox):
    r = boxlite_sandbox.run(["cat", str(HERE / "marker.txt")])
    assert (r.exit_code, r.stdout) == (0, "host marker\\n"), r


def test_project_is_copy_on_write(boxlite_sandbox):
    r = boxlite_sandbox.execute_command(
        f"echo box >> {HERE}/marker.txt && rm -rf {HERE}/sub && cat {HERE}/marker.txt && ls {HERE}"
    )
    assert r.exit_code == 0 and r.stdout.startswith("host marker\\nbox\\n"), r
    assert "sub" not in r.stdout.split()
    assert (HERE / "marker.txt").read_text() == "host marker\\n"
    assert (HERE / "sub" / "deeper" / "f.txt").read_text() == "kept\\n"


def test_default_cwd_is_the_workspace(boxlite_sandbox):
    assert boxlite_sandbox.workdir == "/workspace"
    r = boxlite_sandbox.execute_command("pwd && touch here.txt")
    assert (r.exit_code, r.stdout) == (0, "/workspace\\n"), r
    assert boxlite_sandbox.exists("here.txt")


@pytest.mark.parametrize("user", [None, "nobody", os.environ["SBP_USER"]])
def test_home_is_writable(boxlite_sandbox, user):
    r = boxlite_sandbox.execute_command(
        'mkdir -p "$HOME/.cache/pip" && echo ok > "$HOME/.cache/pip/f" && cat "$HOME/.cache/pip/f" && echo "$HOME"',
        user=user,
    )
    assert r.exit_code == 0, r
    ok, home = r.stdout.split()
    assert ok == "ok" and home.startswith("/") and home != "/", r


def test_home_given_by_the_call_wins(boxlite_sandbox):
    r = boxlite_sandbox.execute_command('echo "$HOME"', env={"HOME": "/workspace"})
    assert r.stdout == "/workspace\\n", r


@pytest.mark.boxlite
def test_boxed_rm_rf_of_the_project():
    for entry in HERE.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    assert list(HERE.iterdir()) == []


@pytest.mark.boxlite(user="root")
def test_boxed_rm_rf_as_root_in_the_box():
    shutil.rmtree(HERE / "sub")
    assert not (HERE / "sub").exists()
"""

N_TESTS = 9


class Project:
    """A project under the host's /tmp, owned by whoever the sub-run runs as."""

    def __init__(self, base: Path, owner: pwd.struct_passwd | None) -> None:
        self.root = base / f"sbproj-{uuid.uuid4().hex[:10]}"
        self.owner = owner
        (self.root / "sub" / "deeper").mkdir(parents=True)
        (self.root / "marker.txt").write_text("host marker\n")
        (self.root / "sub" / "deeper" / "f.txt").write_text("kept\n")
        (self.root / "test_project.py").write_text(textwrap.dedent(PROJECT_TESTS))
        (self.root / "pytest.ini").write_text("[pytest]\n")  # the rootdir, wherever pytest starts
        if owner is not None:
            for p in [self.root, *self.root.rglob("*")]:
                os.chown(p, owner.pw_uid, owner.pw_gid)

    def pytest(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": CHECKOUT,
        }
        python = sys.executable
        prefix: list[str] = []
        if self.owner is not None:
            env["HOME"] = self.owner.pw_dir
            python = _user_python() or sys.executable
            prefix = ["runuser", "-u", self.owner.pw_name, "--"]
        else:
            env["HOME"] = os.environ.get("HOME", "/root")
        env["SBP_USER"] = USER if _has_user() else "root"
        argv = [*prefix, "env", "-i", *(f"{k}={v}" for k, v in env.items()), python, "-m", "pytest", *QUIET]
        argv += ["-p", "no:randomly", "-q", *args]
        return subprocess.run(argv, cwd=cwd or self.root, capture_output=True, text=True, timeout=240, check=False)

    def host_untouched(self) -> None:
        assert (self.root / "marker.txt").read_text() == "host marker\n"
        assert (self.root / "sub" / "deeper" / "f.txt").read_text() == "kept\n"
        assert (self.root / "test_project.py").exists()


def _has_user() -> bool:
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _user_python() -> str | None:
    """The first of :data:`USER_PYTHONS` that the ordinary user can run this project with."""
    for python in USER_PYTHONS:
        probe = subprocess.run(
            ["runuser", "-u", USER, "--", "env", f"PYTHONPATH={CHECKOUT}", python, "-c", "import pytest_boxlite"],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if probe.returncode == 0:
            return python
    return None


def _nonroot_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to run sub-sessions as another user (runuser)"
    if shutil.which("runuser") is None:
        return "runuser (util-linux) is not installed"
    if not _has_user():
        return f"no user named {USER} (.ci/run creates it)"
    if _user_python() is None:
        return f"{USER} can run none of {', '.join(USER_PYTHONS)} with pytest_boxlite"
    return None


@pytest.fixture(params=["host-user", USER])
def project(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    if request.param == USER:
        reason = _nonroot_reason()
        if reason:
            pytest.skip(reason)
        base = Path("/tmp")
        owner: pwd.struct_passwd | None = pwd.getpwnam(USER)
    else:
        base = tmp_path_factory.mktemp("sbp")  # under /tmp: the host's /tmp is private in boxes
        owner = None
    p = Project(base, owner)
    assert str(p.root).startswith("/tmp/")
    try:
        yield p
    finally:
        shutil.rmtree(p.root, ignore_errors=True)


def _passed(r: subprocess.CompletedProcess[str]) -> None:
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
    assert f"{N_TESTS} passed" in r.stdout, tail


def test_sandboxes_see_a_project_under_tmp(project: Project) -> None:
    _passed(project.pytest())
    project.host_untouched()


def test_pytest_invoked_from_tmp_itself(project: Project) -> None:
    """``cd /tmp && pytest proj``: the invocation directory is /tmp, which no box shows whole
    (a box used to mount the host's /tmp, and failed to start: 'Overlay directories may not overlap')."""
    _passed(project.pytest(str(project.root.relative_to("/tmp")), cwd=Path("/tmp")))
    project.host_untouched()
