"""regroup's live sync never follows a link the host swapped in (issue 40, class 6).

An ordinary user's project whose files have a group the box cannot map gets a re-owned copy of
them, kept current while boxes live (:mod:`pytest_boxlite.runtimes.namespace.regroup`).  Here a
copied directory of the project is swapped, in one ``renameat2(RENAME_EXCHANGE)`` (as checkouts
and build tools swap trees), with a link to another directory of the user's home.  The sync
used to keep the old directory's children, copy the link into the layer and then reach those
children *through* it: a file of that other directory (one the user cannot read, one of another
owner) was unlinked, every run.  Now every step is relative to a directory descriptor reached
without following a link, and a dropped directory's children go with it: the other directory is
untouched.

Real sub-runs: the ordinary user ``boxuser`` (driven by root through ``runuser``; as an ordinary
user, with a supplementary group to give the files, the same run as that user), a boxed test
before the swap, the swap on the host, a boxed test forked after it.  And the unit layer: this
process's own live layer, as root.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from subruns import QUIET, sub_env
from test_hostile_boxes import _as_user

from pytest_boxlite.runtimes.namespace import regroup

pytestmark = [pytest.mark.escapes, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parent.parent
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> None:
    """``renameat2(a, b, RENAME_EXCHANGE)``: the two names swap their entries in one step."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


#: The sub-run's tests: a boxed test stacks the layer (``sub`` copied with its files), the host
#: swaps ``sub`` for the link ``swap`` (to the other directory), a boxed test is forked after it
#: (the host settles its layers before every fork: the sync runs).
SWAPPED = """
import ctypes, os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.boxlite
def test_1_reads_the_copy():
    assert (HERE / "sub" / "x.txt").read_text() == "x1"
    assert os.stat(HERE / "sub" / "y.txt").st_gid == os.getgid()  # re-owned: the copy


def test_2_the_host_swaps_the_directory_for_a_link():
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.renameat2(-100, bytes(HERE / "sub"), -100, bytes(HERE / "swap"), 2) == 0, ctypes.get_errno()
    assert (HERE / "sub").is_symlink()


@pytest.mark.boxlite
def test_3_a_box_forked_after_the_swap_runs():
    # Forked after the host settled its layers (the sync ran). What a live overlay shows of a
    # lower layer changed under it is overlayfs's business (its dentries may be cached): not checked.
    assert HERE.is_dir()
"""


def _plant(project: Path, other: Path, uid: int, foreign_gid: int) -> dict[str, tuple[int, int, int, int, int, str]]:
    """The project (``sub`` with two files, all of ``foreign_gid``; ``swap``, a link to ``other``)
    and, in ``other``, two files of the same names the sync must never touch: one of root's, one
    of the user's own that the user cannot read.  Returns what ``other`` holds."""
    sub = project / "sub"
    sub.mkdir()
    for name in ("x.txt", "y.txt"):
        (sub / name).write_text("x1")
    os.symlink(str(other), project / "swap")
    other.mkdir()
    (other / "x.txt").write_text("another owner's file\n")
    (other / "y.txt").write_text("the user's unreadable file\n")
    for p in [project, *project.rglob("*")]:
        if p.name != "swap":
            os.lchown(p, uid, foreign_gid)
    os.lchown(project / "swap", uid, -1)
    if os.geteuid() == 0:
        os.chown(other, uid, -1)
        os.chown(other / "y.txt", uid, -1)  # x.txt stays root's
    os.chmod(other / "y.txt", 0)
    return _contents(other)


def _contents(d: Path) -> dict[str, tuple[int, int, int, int, int, str]]:
    """Each entry of ``d``: owner, mode, inode, size, modification time and content (``?`` where
    this user cannot read it)."""
    out: dict[str, tuple[int, int, int, int, int, str]] = {}
    for p in sorted(d.iterdir()):
        st = p.lstat()
        body = p.read_text() if os.access(p, os.R_OK) else "?"
        out[p.name] = (st.st_uid, stat.S_IMODE(st.st_mode), st.st_ino, st.st_size, st.st_mtime_ns, body)
    return out


@pytest.mark.escape_row("project-link-swap", users="user")
def test_a_swap_for_a_link_during_an_ordinary_users_session_removes_nothing_outside() -> None:
    """As ``boxuser``, run by root (which gives the project root's group, as ``tar -x`` as root
    then ``chown -R user`` does)."""
    python, work = _as_user()
    try:
        other = work.home / "other"
        before = _plant(work.project, other, work.uid, 0)
        work.write("test_swapped.py", SWAPPED)
        # This checkout's code, not whatever the user's interpreter has installed.
        r = work.run(
            "env", f"PYTHONPATH={ROOT}", python, "-m", "pytest", *QUIET, "--basetemp", str(work.root / "bt"),
            "--boxlite-runtime=namespace", "-p", "no:randomly", "-rA", "test_swapped.py", timeout=200,
        )  # fmt: skip
        out = r.stdout + r.stderr
        assert sorted(p.name for p in other.iterdir()) == ["x.txt", "y.txt"], (
            f"a file outside the project went:\n{out[-4000:]}"
        )
        assert _contents(other) == before
        assert r.returncode == 0 and "3 passed" in out, out[-6000:]
    finally:
        shutil.rmtree(work.root, ignore_errors=True)


def test_a_swap_for_a_link_as_this_ordinary_user_removes_nothing_outside(tmp_path: Path) -> None:
    """The same run as this ordinary user, where it has a supplementary group to give the files
    (a group its box cannot map: only the user's own is)."""
    if os.geteuid() == 0:
        pytest.skip("as root the box maps every id: regroup does nothing (the test above drives boxuser)")
    groups = [g for g in os.getgroups() if g != os.getegid()]
    if not groups:
        pytest.skip("this user has no group other than its own to give the project's files")
    project, other = tmp_path / "project", tmp_path / "home" / "other"
    project.mkdir()
    (tmp_path / "home").mkdir()
    before = _plant(project, other, os.geteuid(), groups[0])
    (project / "test_swapped.py").write_text(SWAPPED)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={tmp_path / 'bl'}", "--basetemp",
         str(tmp_path / "bt"), "--boxlite-runtime=namespace", "-p", "no:randomly", "-rA", "test_swapped.py"],
        cwd=project, env=sub_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert sorted(p.name for p in other.iterdir()) == ["x.txt", "y.txt"], out[-4000:]
    assert _contents(other) == before
    assert r.returncode == 0 and "3 passed" in out, out[-6000:]


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """``top/proj/sub`` (root's, with a group of its own) and this process's live layer of it (as
    root the layer is made all the same, with root's group: only ``regroup_args`` skips root).
    The layer is forgotten afterwards (``regroup._LIVE`` is private: this process must not keep it)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give files other owners and groups")
    top = tmp_path / "top"
    (top / "proj").mkdir(parents=True)
    _plant(top / "proj", top / "other", 0, 4243)
    os.chown(top / "other" / "x.txt", 4242, 4242)  # another owner's, in a directory of root's
    layer = regroup.regroup_layer(str(top), [str(top / "proj")])
    assert layer is not None
    try:
        yield top, Path(layer)
    finally:
        regroup._LIVE.pop(layer, None)


@pytest.mark.escape_row("project-link-swap", runtime="host", users="root")
def test_the_live_sync_reaches_nothing_through_a_swapped_in_link(live: tuple[Path, Path]) -> None:
    top, layer = live
    other = top / "other"
    before = _contents(other)
    assert (layer / "proj" / "sub" / "x.txt").read_text() == "x1"

    exchange(top / "proj" / "sub", top / "proj" / "swap")
    regroup.settle()

    assert _contents(other) == before
    # The layer has what the host has now: the link where the directory was (its copy and its
    # children gone with it), the directory under its new name.
    assert os.readlink(layer / "proj" / "sub") == str(other)
    assert (layer / "proj" / "swap" / "x.txt").read_text() == "x1"
    live_layer = regroup._LIVE[str(layer)]  # private: what the sync still holds
    assert not live_layer.failed
    assert not [r for r in [*live_layer.held, *live_layer.absent] if r.startswith("proj/sub/")]

    # And back: the link swapped for the directory again.
    exchange(top / "proj" / "sub", top / "proj" / "swap")
    regroup.settle()
    assert _contents(other) == before
    assert (layer / "proj" / "sub" / "x.txt").read_text() == "x1"
    assert not (layer / "proj" / "sub").is_symlink()
