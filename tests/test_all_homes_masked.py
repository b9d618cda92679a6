"""Every boxlite home on the machine is hidden from boxes, not only the session's own (issue 22,
attack 5: a boxed test read a kept box's ``box.log`` in another home).

The other homes lie under ``/var/tmp`` (boxes see it copy-on-write; the host's ``/tmp`` is
private to each box, so a home there is out of reach anyway).  Each test removes what it made,
kept boxes included.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BoxFactory, new_box_name
from subruns import QUIET, record_fork_plans, sub_env

from pytest_boxlite import ledger
from pytest_boxlite.runtimes import _homes
from pytest_boxlite.runtimes.namespace import mounts
from pytest_boxlite.sandbox import Sandbox

pytestmark = [pytest.mark.escapes, pytest.mark.timeout(240)]

USER = "boxuser"

KEEP = """
def test_fails(boxlite_sandbox):
    boxlite_sandbox.write_file("/workspace/evidence", "kept state")
    assert False, "failing on purpose"
"""

#: The attacker: a boxed test that looks for every other home it was told of.
PEEK = """
import os
import pytest

OTHER = {other!r}
LOGS = {logs!r}
DEFAULTS = {defaults!r}


@pytest.mark.boxlite(user="root")
def test_peek():
    seen = {{}}
    for d in [OTHER, *DEFAULTS]:
        if os.path.isdir(d):
            found = []
            for root, dirs, files in os.walk(d):
                found += [os.path.join(root, n) for n in dirs + files]
            seen[d] = found
    for log in LOGS:
        try:
            with open(log, "rb") as fh:
                seen[log] = fh.read(200)
        except OSError:
            pass
    assert all(not v for v in seen.values()), seen
"""


def _cleanup(*homes: Path) -> None:
    for h in homes:
        if h.exists():
            ledger.reconcile(h, include_kept=True)


@pytest.fixture
def var_tmp() -> Iterator[Path]:
    """A directory under /var/tmp (seen by boxes), removed afterwards with any box kept in it."""
    root = Path("/var/tmp") / f"pbx-homes-{uuid.uuid4().hex[:10]}"
    root.mkdir(mode=0o755)
    try:
        yield root
    finally:
        for h in root.rglob("sessions"):
            _cleanup(h.parent)
        shutil.rmtree(root, ignore_errors=True)


def _pytest(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", *QUIET, "-p", "no:randomly", *args],
        cwd=cwd,
        env=env or sub_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=200,
    )


def _keep_a_box(project: Path, home: Path) -> list[Path]:
    """A session in ``home`` whose failed test's box is kept: its logs are what a guest must not read."""
    project.mkdir(parents=True)
    (project / "test_keep.py").write_text(KEEP)
    kept = _pytest(project, f"--boxlite-home={home}", "--boxlite-keep", "test_keep.py")
    assert kept.returncode == 1 and re.search(r"kept box pbx-\S+", kept.stdout), kept.stdout + kept.stderr
    logs = sorted(home.glob("namespace/*.ctl/*.log"))
    assert logs, f"no box log in {home}: {sorted(str(p) for p in home.rglob('*'))}"
    return logs


def _default_homes_of_others() -> list[str]:
    """Other users' default homes that exist here (e.g. the ordinary user's from earlier runs)."""
    me = os.getuid()
    found = []
    for pw in pwd.getpwall():
        d = os.path.join(pw.pw_dir, ".cache", "pytest-boxlite")
        if pw.pw_uid != me and os.path.isdir(d) and not os.path.islink(d):
            found.append(d)
    return found


@pytest.mark.escape_row("other-homes")
def test_a_boxed_test_cannot_read_a_kept_box_of_another_home(var_tmp: Path, tmp_path: Path) -> None:
    other = var_tmp / "other-home"
    logs = _keep_a_box(var_tmp / "other-project", other)
    project = tmp_path / "peek"
    project.mkdir()
    defaults = _default_homes_of_others()
    (project / "test_peek.py").write_text(PEEK.format(other=str(other), logs=[str(p) for p in logs], defaults=defaults))
    run = _pytest(project, f"--boxlite-home={tmp_path / 'mine'}", "test_peek.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert all(p.exists() for p in logs), "the host's files are untouched"


@pytest.mark.escape_row("other-homes")
def test_a_home_above_the_project_hides_its_boxes_but_not_the_project(var_tmp: Path, tmp_path: Path) -> None:
    """A home that holds the project (``--boxlite-home`` at the project's root) cannot be hidden
    whole: its state entries are hidden one by one, and the project stays visible."""
    other = var_tmp / "outer"
    logs = _keep_a_box(other / "keeper", other)
    project = other / "inner"
    project.mkdir()
    (project / "data.txt").write_text("project data\n")
    (project / "test_inner.py").write_text(
        textwrap.dedent(
            f"""
            import os
            import pytest

            @pytest.mark.boxlite(user="root")
            def test_sees_the_project_not_the_boxes():
                assert open({str(project / "data.txt")!r}).read() == "project data\\n"
                assert os.path.isdir({str(other / "keeper")!r})
                for entry in ("namespace", "sessions"):
                    path = os.path.join({str(other)!r}, entry)
                    assert not os.path.isdir(path) or os.listdir(path) == [], (path, os.listdir(path))
                for log in {[str(p) for p in logs]!r}:
                    assert not os.path.exists(log), log
            """
        )
    )
    run = _pytest(project, f"--boxlite-home={tmp_path / 'mine'}", "test_inner.py")
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.escape_row("other-homes")
def test_a_home_in_a_project_under_tmp_is_hidden(tmp_path: Path) -> None:
    """A project under the host's /tmp is mirrored in its boxes, and a home inside it with it: run
    from a subdirectory, so the project's root (not the working directory) is what is mirrored."""
    project = tmp_path / "proj"
    sub = project / "sub"
    sub.mkdir(parents=True)
    (project / "pytest.ini").write_text("[pytest]\n")
    other = project / ".other-home"
    try:
        logs = _keep_a_box(tmp_path / "keeper", other)
        (sub / "test_peek.py").write_text(PEEK.format(other=str(other), logs=[str(p) for p in logs], defaults=[]))
        run = _pytest(sub, f"--boxlite-home={tmp_path / 'mine'}", "test_peek.py")
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"rootdir: {project}" in run.stdout, run.stdout
    finally:
        # The kept box outlives its session by design: remove it, as the var_tmp fixture does.
        _cleanup(other)


@pytest.mark.escape_row("other-homes")
def test_a_direct_box_cannot_read_another_home(var_tmp: Path, make_namespace_box: BoxFactory) -> None:
    """A sandbox box made after another session registered its home hides it: booted, and forked
    from a zygote booted before that home existed (its plan changed, so a new zygote is booted)."""
    first = make_namespace_box()  # boots this spec's zygote (forked mode) before the other home exists
    assert first.execute_command("true", timeout=20).exit_code == 0
    other = var_tmp / "direct"
    lock = ledger.OwnerLock(other, "deadbeef")
    lock.acquire()  # as a session does: this registers the home
    secret = other / "namespace" / "pbx-deadbeef-1.ctl" / "box.log"
    secret.parent.mkdir(parents=True)
    secret.write_text("SECRET-LOG-LINE\n")
    try:
        sb = make_namespace_box()
        assert not sb.exists(str(other)) or sb.list_dir(str(other)) == []
        r = sb.execute_command(f"cat {secret}", timeout=20)
        assert r.exit_code != 0 and "SECRET" not in r.stdout
        assert secret.read_text() == "SECRET-LOG-LINE\n"
    finally:
        lock.release()


def test_a_home_that_ends_keeps_the_zygote_and_a_new_one_replaces_it(
    var_tmp: Path, runtimes: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A zygote serves while the homes it hides cover those on the machine now: one that ends
    after it booted leaves it serving (its box shows an empty mask where the home was, as a box
    booted a moment earlier would), and one that appears takes a new zygote that hides it.

    Other sessions of this user may come and go meanwhile (CI runs two jobs side by side): the
    plans every box was made under are recorded, and the zygote may change only where the plan
    then hid a path its zygote's did not."""
    from pytest_boxlite.runtimes.namespace import NamespaceRuntime
    from pytest_boxlite.spec import BoxSpec

    rt = runtimes.get("namespace-forked")
    assert isinstance(rt, NamespaceRuntime)
    plans = record_fork_plans(rt, monkeypatch)
    spec = BoxSpec(env=(("PBX_ZYGOTE_PLAN", uuid.uuid4().hex),))
    boxes = []
    try:
        ending = var_tmp / "ending"
        lock = ledger.OwnerLock(ending, "deadbee1")
        lock.acquire()  # registers the home, as a session does
        boxes.append(rt.create_box(spec, new_box_name(), timeout=30))
        assert any(str(ending) in h for h in plans[-1].hidden), plans[-1]
        lock.release()
        shutil.rmtree(ending)
        boxes.append(rt.create_box(spec, new_box_name(), timeout=30))
        if boxes[1].forked_from != boxes[0].forked_from:
            assert not plans[-1].hidden <= plans[0].hidden, "a home that ended replaced the zygote"
        shown = Sandbox(boxes[1]).execute_command(f"ls -A {ending} 2>/dev/null; true", timeout=20)
        assert shown.stdout == ""
        new = var_tmp / "new"
        lock = ledger.OwnerLock(new, "deadbee2")
        lock.acquire()
        try:
            boxes.append(rt.create_box(spec, new_box_name(), timeout=30))
            assert boxes[2].forked_from not in (boxes[0].forked_from, boxes[1].forked_from)
        finally:
            lock.release()
        assert all(b.forked_from for b in boxes), [b.forked_from for b in boxes]
    finally:
        for b in boxes:
            b.destroy()


@pytest.mark.escape_row("other-homes", runtime="host")
def test_the_session_registers_its_home(tmp_path: Path) -> None:
    home = tmp_path / "registered"
    lock = ledger.OwnerLock(home, "cafe0001")
    lock.acquire()
    lock.release()
    assert str(home.resolve()) in _homes.boxlite_homes()


def _nonroot_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (files owned by another user)"
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"no user named {USER}"
    return None


def _runuser_reason() -> str | None:
    """Why sub-runs cannot run as the ordinary user here (as tests/test_nonroot.py checks it)."""
    reason = _nonroot_reason()
    if reason is None and shutil.which("runuser") is None:
        reason = "runuser (util-linux) is not installed"
    if reason is None:
        probe = subprocess.run(
            ["runuser", "-u", USER, "--", sys.executable, "-c", "import pytest_boxlite"],
            capture_output=True,
            timeout=60,
        )
        if probe.returncode != 0:
            reason = f"{USER} cannot run {sys.executable} with pytest_boxlite: {probe.stderr.decode()[-300:]}"
    return reason


@pytest.mark.escape_row("other-homes", users="root", runtime="host")
def test_another_users_registry_names_only_what_that_user_owns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit layer (the user database is replaced by one user whose home is under tmp_path): a
    registry of another user cannot make this user's boxes hide a directory it does not own."""
    reason = _nonroot_reason()
    if reason:
        pytest.skip(reason)
    pw = pwd.getpwnam(USER)
    user_dir = tmp_path / "u"
    theirs = tmp_path / "their-home"
    not_theirs = tmp_path / "not-theirs"
    for d in (user_dir, theirs, not_theirs):
        d.mkdir()
    registry = user_dir / ".cache" / "pytest-boxlite" / _homes.REGISTRY
    registry.mkdir(parents=True)
    for d in (user_dir, user_dir / ".cache", registry.parent, registry, theirs):
        os.chown(d, pw.pw_uid, pw.pw_gid)
    for name, target in (("a", theirs), ("b", not_theirs), ("c", Path("/usr"))):
        (registry / name).write_text(f"{target}\n")
        os.chown(registry / name, pw.pw_uid, pw.pw_gid)
    forged = registry / "d"  # an entry in their registry that they do not own
    forged.write_text(f"{not_theirs}\n")
    monkeypatch.setattr(_homes, "_users", lambda: [(pw.pw_uid, str(user_dir))])
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(user_dir))  # $HOME counts as this user's own: not here
    monkeypatch.setattr(_homes, "_user_dirs", lambda: [(pw.pw_uid, str(user_dir))])
    found = _homes.boxlite_homes()
    assert str(theirs) in found
    assert str(not_theirs) not in found and "/usr" not in found
    # Their default home pointing at a directory they do not own is no home either.
    (user_dir / ".cache" / "pytest-boxlite").rename(user_dir / ".cache" / "moved")
    (user_dir / ".cache" / "pytest-boxlite").symlink_to("/usr")
    assert "/usr" not in _homes.boxlite_homes()


@pytest.mark.escape_row("other-homes", runtime="host")
def test_a_home_is_hidden_whole_unless_a_box_must_see_below_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit layer (the homes found are replaced): what the mask plan hides for each kind of home."""
    below = "/var/tmp/pbx-unit/elsewhere/home"  # only named, never made
    above = str(Path(os.getcwd()).parent)
    out_of_reach = str(tmp_path / "a-test-runs-home")  # under the host's /tmp, mirrored in no box
    project = str(tmp_path / "project")  # a project under /tmp: the box mirrors it
    in_project = project + "/.boxlite-home"
    found = [below, above, "/", out_of_reach, in_project]
    monkeypatch.setattr(mounts, "boxlite_homes", lambda wanted=None: [h for h in found if wanted is None or wanted(h)])
    plan = mounts._home_masks(tmp_path / "own", ["/usr", project])
    assert in_project in plan
    assert plan[0] == str(tmp_path / "own")
    assert below in plan
    if above == "/tmp" or above.startswith("/tmp/"):
        # Run from a checkout under /tmp: a box shows no entry of the host's /tmp but the directories
        # it mirrors (here only the project), so a home there has nothing to hide.
        assert above not in plan and os.path.join(above, "namespace") not in plan
    else:
        assert above not in plan and os.path.join(above, "namespace") in plan
    assert "/" not in plan and "/namespace" in plan
    assert not any(p.startswith(out_of_reach) for p in plan)


@pytest.mark.escape_row("other-homes", users="user")
def test_an_ordinary_users_box_hides_its_other_homes(tmp_path: Path) -> None:
    """As an ordinary user: a kept box in one of the user's homes is hidden from a boxed test of
    a session in another of the user's homes (the whole file also runs as that user in CI)."""
    reason = _runuser_reason()
    if reason:
        pytest.skip(reason)
    pw = pwd.getpwnam(USER)
    root = Path("/var/tmp") / f"pbx-homes-user-{uuid.uuid4().hex[:10]}"
    root.mkdir(mode=0o755)
    os.chown(root, pw.pw_uid, pw.pw_gid)
    env = {"HOME": str(root / "h"), "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}

    def as_user(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
        argv = ["runuser", "-u", USER, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items())]
        argv += [sys.executable, "-m", "pytest", *QUIET, "-p", "no:randomly", "--basetemp", str(root / "bt"), *args]
        return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=200, stdin=subprocess.DEVNULL)

    try:
        other, keeper, peek = root / "other-home", root / "keeper", root / "peek"
        for d in (keeper, peek):
            d.mkdir()
        (keeper / "test_keep.py").write_text(KEEP)
        kept = as_user(keeper, f"--boxlite-home={other}", "--boxlite-keep", "test_keep.py")
        assert kept.returncode == 1 and "kept box pbx-" in kept.stdout, kept.stdout + kept.stderr
        (peek / "test_peek.py").write_text(PEEK.format(other=str(other), logs=[], defaults=[]))
        for p in (keeper, peek, *keeper.iterdir(), *peek.iterdir()):
            os.chown(p, pw.pw_uid, pw.pw_gid)
        run = as_user(peek, f"--boxlite-home={root / 'mine'}", "test_peek.py")
        assert run.returncode == 0, run.stdout + run.stderr
    finally:
        subprocess.run(
            ["runuser", "-u", USER, "--", sys.executable, "-m", "pytest_boxlite", "--home", str(root / "other-home"),
             "clean", "--kept"],
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)
