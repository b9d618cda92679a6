"""An ordinary user's project whose files have a group the box cannot map (issue 23: "for every
user, wherever the project lies").

``git archive | tar -x`` as root, then ``chown -R user``: the files are the user's, their group
stays root's.  The user's box maps only the user's own uid and gid, so overlayfs could not copy
such a file (or a directory holding what is removed) up: ``rm -rf`` of the project in a box failed
with ``EOVERFLOW`` (Errno 75).  :mod:`pytest_boxlite.runtimes.namespace.regroup` lays a re-owned
copy of those entries under the box's writable layer; these check that a boxed test can change
everything there as the host user could, that nothing reaches the host, and what the copy holds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_nonroot import Workdir, _skip_reason

from pytest_boxlite.runtimes.namespace import regroup
from pytest_boxlite.runtimes.namespace.regroup import scan

pytestmark = pytest.mark.timeout(240)

BOXED = """
import os
import shutil
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.boxlite
def test_change_everything():
    data = HERE / "pkg" / "data.txt"
    assert os.stat(data).st_gid == os.getgid()  # the user's own group (not the overflow group)
    data.write_text("changed in the box")  # a copy-up of the file
    os.chmod(HERE / "pkg", 0o700)  # and of its directory
    os.rename(HERE / "pkg" / "mod.py", HERE / "pkg" / "renamed.py")
    assert os.readlink(HERE / "pkg" / "link") == "data.txt"
    (HERE / "pkg" / "link").unlink()
    shutil.rmtree(HERE / "pkg")
    (HERE / "notes.txt").unlink()
    assert sorted(p.name for p in HERE.iterdir() if p.name != "__pycache__") == ["test_boxed.py"]


def test_a_sandbox_changes_the_project_too(boxlite_sandbox):
    r = boxlite_sandbox.execute_command("rm -rf {project}/pkg && echo gone", timeout=60)
    assert r.ok and r.stdout.strip() == "gone", r
"""


def _tree_digest(root: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every entry below ``root``: mode, owner, group and content (a link's target), links unfollowed."""
    out: dict[str, tuple[int, int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                body = "-> " + os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                body = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                body = ""
            out[str(p.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid, body)
    return out


@pytest.fixture
def work() -> Iterator[Workdir]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    w = Workdir()
    yield w
    shutil.rmtree(w.root, ignore_errors=True)


def test_a_project_of_a_foreign_group_can_be_changed_in_its_boxes(work: Workdir) -> None:
    work.write("test_boxed.py", BOXED.format(project=work.project))
    work.write("notes.txt", "notes\n")
    pkg = work.project / "pkg"
    pkg.mkdir()
    (pkg / "data.txt").write_text("host data\n")
    (pkg / "mod.py").write_text("X = 1\n")
    os.symlink("data.txt", pkg / "link")
    # The user's files, root's group: what `tar -x` as root and `chown -R user` leave.
    for p in [work.project, *work.project.rglob("*")]:
        os.lchown(p, work.uid, 0)
    before = _tree_digest(work.project)

    r = work.pytest("--boxlite-runtime=namespace", "-p", "no:randomly", "-rA", "test_boxed.py")

    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert "2 passed" in r.stdout
    assert "Errno 75" not in r.stdout
    # Nothing of what the boxes did reached the host's files.
    assert _tree_digest(work.project) == before
    assert (pkg / "data.txt").read_text() == "host data\n"
    # The copy the boxes stacked is the user's, with the user's group and the host's content, and
    # the boxes' writes did not land there either.
    layers = [
        p for p in Path(f"/tmp/pytest-boxlite-{work.uid}/regroup").glob("*/*/tree") if (p / "pkg" / "mod.py").exists()
    ]
    mine = [p for p in layers if (p / "test_boxed.py").read_text() == (work.project / "test_boxed.py").read_text()]
    assert mine, layers
    copy = mine[-1]
    assert (copy / "pkg" / "data.txt").read_text() == "host data\n"
    assert os.readlink(copy / "pkg" / "link") == "data.txt"
    for p in [copy / "pkg", copy / "pkg" / "data.txt", copy / "pkg" / "link"]:
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (work.uid, work.gid)
    assert stat.S_IMODE((copy / "pkg").stat().st_mode) == stat.S_IMODE(before["pkg"][0])
    assert (copy / "pkg" / "data.txt").stat().st_mtime_ns == (pkg / "data.txt").stat().st_mtime_ns


def test_scan_takes_only_the_users_own_entries_and_follows_no_link(tmp_path: Path) -> None:
    """The unit layer: which entries get a copy (called with an owner and group of the test's
    choosing, so it runs as any user)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give files other owners")
    uid, gid = 4242, 4243
    top = tmp_path / "top"
    tree = top / "mid" / "proj"
    (tree / "sub").mkdir(parents=True)
    (tree / "theirs").mkdir()
    (tree / "sub" / "a.txt").write_text("a")
    (tree / "own.txt").write_text("b")
    (tree / "theirs" / "hidden.txt").write_text("c")
    os.symlink("/etc/shadow", tree / "sub" / "shadow")
    os.symlink(str(tree / "theirs"), tree / "into-theirs")
    sub = tree / "sub"
    for p in [top, top / "mid", tree, sub, sub / "a.txt", sub / "shadow", tree / "into-theirs"]:
        os.lchown(p, uid, 0)  # the user's, with a group the box cannot map
    os.chown(tree / "own.txt", uid, gid)  # the user's own group: nothing to do
    os.chown(tree / "theirs", 0, 0)  # another owner's directory: not entered
    os.chown(tree / "theirs" / "hidden.txt", uid, 0)

    found = scan(str(top), str(tree), uid, gid)

    names = ["mid", "mid/proj", "mid/proj/into-theirs", "mid/proj/sub", "mid/proj/sub/a.txt", "mid/proj/sub/shadow"]
    assert sorted(found) == names
    assert found["mid/proj/sub/shadow"].kind == "link" and found["mid/proj/sub/shadow"].target == "/etc/shadow"
    assert found["mid/proj/sub/a.txt"].kind == "file" and found["mid/proj/sub/a.txt"].size == 1
    # A tree below a directory of another owner is left alone: a copy would show that directory
    # as the box's root's.
    os.chown(top / "mid", 0, 0)
    assert scan(str(top), str(tree), uid, gid) == {}
    os.chown(top / "mid", uid, gid)
    # And nothing at all where no entry needs it.
    for p in [tree, tree / "sub", tree / "sub" / "a.txt"]:
        os.chown(p, uid, gid)
    for p in [tree / "sub" / "shadow", tree / "into-theirs"]:
        os.lchown(p, uid, gid)
    assert scan(str(top), str(tree), uid, gid) == {}


EDITED = """
import os
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent / "pkg"


@pytest.mark.boxlite
def test_1_reads():
    assert (PKG / "data.txt").read_text() == "v1\\n"


def test_2_host_edits_in_place():
    (PKG / "data.txt").write_text("v2, longer\\n")  # the same inode: its group stays root's
    assert os.stat(PKG / "data.txt").st_gid == 0


@pytest.mark.boxlite
def test_3_a_box_forked_after_the_edit_reads_it():
    data = PKG / "data.txt"
    assert data.read_text() == "v2, longer\\n"
    assert os.stat(data).st_gid == os.getgid()  # still re-owned: the box can change it
    data.write_text("box")


def test_4_host_replaces_and_removes():
    new = PKG / "data.new"
    new.write_text("v3\\n")  # an editor's save: a new file (the user's group), renamed over the old
    os.replace(new, PKG / "data.txt")
    (PKG / "gone.txt").unlink()


@pytest.mark.boxlite
def test_5_sees_the_replacement_and_the_removal():
    assert (PKG / "data.txt").read_text() == "v3\\n"
    assert not (PKG / "gone.txt").exists()
    assert (PKG / "other.txt").read_text() == "other\\n"


def test_6_a_live_sandbox_sees_an_edit(boxlite_sandbox):
    other = PKG / "other.txt"
    r = boxlite_sandbox.execute_command(f"cat {other}", timeout=60)
    assert r.ok and r.stdout == "other\\n", r
    other.write_text("changed while the box lives\\n")
    r = boxlite_sandbox.execute_command(f"cat {other}", timeout=60)
    assert r.ok and r.stdout == "changed while the box lives\\n", r
"""

AGAIN = """
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent / "pkg"


@pytest.mark.boxlite
def test_a_new_session_reads_the_edit():
    assert (PKG / "other.txt").read_text() == {expected!r}
"""


def test_host_edits_of_re_owned_files_show_in_boxes(work: Workdir) -> None:
    """A boxed test forked from a warm box after the host changed a re-owned file reads what the
    host has (as for files that need no copy), a live sandbox too, and so does a later session."""
    work.write("test_edited.py", EDITED)
    pkg = work.project / "pkg"
    pkg.mkdir()
    for name, text in [("data.txt", "v1\n"), ("gone.txt", "gone\n"), ("other.txt", "other\n")]:
        (pkg / name).write_text(text)
    for p in [work.project, *work.project.rglob("*")]:
        os.lchown(p, work.uid, 0)

    r = work.pytest("--boxlite-runtime=namespace", "-p", "no:randomly", "-rA", "test_edited.py")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert "6 passed" in r.stdout
    assert (pkg / "data.txt").read_text() == "v3\n"  # the box's write stayed in the box

    other = pkg / "other.txt"
    for text in ["edited between sessions\n", "same size and same time\n"]:
        before = other.stat()
        other.write_text(text)  # in place: its group stays root's
        if len(text) == before.st_size:
            # Only the change time tells this edit (as `cp -p` or an rsync of a same-sized file):
            # the second session's layer must not be taken for this one's.
            os.utime(other, ns=(before.st_atime_ns, before.st_mtime_ns))
        work.write("test_again.py", AGAIN.format(expected=text))
        r = work.pytest("--boxlite-runtime=namespace", "-p", "no:randomly", "-rA", "test_again.py")
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
        assert "1 passed" in r.stdout


@pytest.fixture
def live_layer(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A tree of root's files with a group of their own, and this process's re-owned layer of it
    (as root the layer is made all the same, with root's own group: regroup_args alone skips root).
    The layer is forgotten after the test (regroup._LIVE is private: this process must not keep it)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give files another group")
    top = tmp_path / "top"
    (top / "proj" / "sub").mkdir(parents=True)
    for rel, text in [("proj/a.txt", "a1"), ("proj/sub/b.txt", "b1"), ("proj/sub/c.txt", "c1")]:
        (top / rel).write_text(text)
    for p in [top / "proj", *(top / "proj").rglob("*")]:
        os.lchown(p, 0, 4243)
    layer = regroup.regroup_layer(str(top), [str(top / "proj")])
    assert layer is not None
    try:
        yield top, Path(layer)
    finally:
        regroup._LIVE.pop(layer, None)


def test_a_live_layer_follows_the_host(live_layer: tuple[Path, Path]) -> None:
    top, layer = live_layer
    copy = layer / "proj" / "sub" / "b.txt"
    ino = copy.stat().st_ino
    assert copy.read_text() == "b1"

    (top / "proj" / "sub" / "b.txt").write_text("b2, longer")  # in place
    os.chmod(top / "proj" / "sub", 0o750)
    (top / "proj" / "a.txt").unlink()
    (top / "proj" / "sub" / "new.txt").write_text("n")
    os.chown(top / "proj" / "sub" / "new.txt", 0, 4243)
    (top / "beside").mkdir()  # in the top, outside the trees the layer is for: never copied
    os.chown(top / "beside", 0, 4243)
    regroup.settle()

    assert copy.read_text() == "b2, longer"
    assert copy.stat().st_ino == ino  # the same inode: a box that has it cached reads the new content
    assert (copy.stat().st_uid, copy.stat().st_gid) == (0, 0)
    assert stat.S_IMODE((layer / "proj" / "sub").stat().st_mode) == 0o750
    assert not (layer / "proj" / "a.txt").exists()
    assert (layer / "proj" / "sub" / "new.txt").read_text() == "n"
    assert not (layer / "beside").exists()
    # Changed in place: no later box start takes it by its key; one that scans now gets this one
    # (what it holds is what the host has), with nothing to copy.
    assert not (layer.parent / "ready").exists()
    assert regroup.regroup_layer(str(top), [str(top / "proj")]) == str(layer)

    # An editor's save: a new file of the user's own group.  The copy stays (a live box's overlay
    # has its inode cached), brought up to date in place.
    c = layer / "proj" / "sub" / "c.txt"
    ino = c.stat().st_ino
    new = top / "proj" / "sub" / "c.new"
    new.write_text("c2")
    os.replace(new, top / "proj" / "sub" / "c.txt")
    regroup.settle()
    assert c.read_text() == "c2" and c.stat().st_ino == ino


def test_a_layer_without_watches_is_compared_at_each_settle(live_layer: tuple[Path, Path]) -> None:
    """Where inotify is used up, settle() compares each copied entry's look (the fallback)."""
    top, layer = live_layer
    with regroup._BUILD:  # private, as the fixture's: as _watch leaves a layer when inotify_add_watch fails
        regroup._LIVE[str(layer)].polled = True
        for wd, (watched, _) in list(regroup._WDS.items()):
            if watched == str(top):
                del regroup._WDS[wd]  # its events now say nothing
    host = top / "proj" / "sub" / "b.txt"
    host.write_text("b3")
    st = host.stat()
    os.utime(host, ns=(st.st_atime_ns, st.st_mtime_ns))  # the times as before: the change time moved
    regroup.settle()
    assert (layer / "proj" / "sub" / "b.txt").read_text() == "b3"


def test_a_box_start_after_an_edit_that_keeps_size_and_time_gets_the_new_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer a box start stacks is keyed by its entries' looks, the change time included: an
    edit that restores the modification time (``cp -p``, rsync) of a same-sized file is not missed
    by a later process (one that did not watch the edit)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give files another group")
    monkeypatch.setattr(regroup, "_RACY_NS", -(10**18))  # private: no copy counts as made within a tick
    top = tmp_path / "top"
    (top / "proj").mkdir(parents=True)
    host = top / "proj" / "b.txt"
    host.write_text("b1")
    for p in [top / "proj", host]:
        os.lchown(p, 0, 4243)
    first = regroup.regroup_layer(str(top), [str(top / "proj")])
    assert first is not None
    regroup._LIVE.pop(first)  # private: a later process, which has no live layer of its own
    assert (Path(first).parent / "ready").exists()  # unchanged: a later box start may take it by its key
    before = host.stat()
    host.write_text("bX")
    os.utime(host, ns=(before.st_atime_ns, before.st_mtime_ns))
    again = regroup.regroup_layer(str(top), [str(top / "proj")])
    assert again is not None
    try:
        assert again != first
        assert (Path(again) / "proj" / "b.txt").read_text() == "bX"
    finally:
        regroup._LIVE.pop(again, None)
