"""What each boxed test left behind (``--boxlite-side-effects``) and used (``--boxlite-usage``), issue 43.

One project of real sub-runs with real namespace boxes (the user running this file: root, or an
ordinary user), in test and module scope: tests that each leave one kind of state and tests that
touch only ``tmp_path`` or use ``monkeypatch``.  ``report`` names exactly the dirty tests and what
each left; ``fail`` fails exactly them; the host is untouched; ``off`` says nothing.  Then the
hostile parts: a flood of files (a cut list and a note), a name with terminal escapes (escaped), a
link (shown, not followed), and the host's checks of the message itself (a unit layer: a box's
forged message is what a real box cannot be made to send on purpose).
"""

from __future__ import annotations

import os
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import subruns
from subruns import wait_until

from pytest_boxlite import ledger, side_effects
from pytest_boxlite.guest import changes as _changes

#: The guest module carries no annotations (it runs on the box's interpreter as it is).
changes: Any = _changes

pytestmark = pytest.mark.timeout(300)


class SubRun(subruns.SubRun):
    base_args = ("--boxlite-runtime=namespace",)
    wait_timeout = 200.0


#: A per-run mark (the test's node id would do, but the host's home must never hold these names).
TAG = f"bxse{os.getpid()}"

SUITE = f"""
import os
import pathlib
import subprocess

import pytest

pytestmark = pytest.mark.boxlite
TAG = {TAG!r}


def test_home_file():
    pathlib.Path(os.path.expanduser("~/." + TAG + "-rc")).write_text("x=1")


def test_project_file():
    pathlib.Path("generated.txt").write_text("hello")


def test_clean_tmp_path(tmp_path, tmp_path_factory):
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path_factory.mktemp("more") / "ok.txt").write_text("fine")


def test_tmp_file():
    pathlib.Path("/tmp/" + TAG + ".log").write_text("log")


def test_deletes_project_file():
    os.remove("data.txt")


def test_clean_monkeypatch(monkeypatch, tmp_path):
    monkeypatch.setenv("POLLUTED", "2")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "sep", os.sep)


def test_detached_process():
    subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL)


def test_environ():
    os.environ["POLLUTED"] = "1"


def test_clean_reads_only():
    assert pathlib.Path("data.txt").exists() or True
    assert os.listdir(os.path.expanduser("~")) is not None


def test_usage_300mb():
    block = bytearray(300 << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
"""

#: What ``report`` must say of each dirty test (a line each), and the clean tests.
DIRTY = {
    "test_home_file": "created file {home}/.{tag}-rc (3 bytes)",
    "test_project_file": "created file {project}/generated.txt (5 bytes)",
    "test_tmp_file": "created file /tmp/{tag}.log (3 bytes)",
    "test_deletes_project_file": "deleted {project}/data.txt",
    "test_detached_process": "process left running (pid ",
    "test_environ": "environment variable POLLUTED set",
}
CLEAN = ("test_clean_tmp_path", "test_clean_monkeypatch", "test_clean_reads_only", "test_usage_300mb")


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "test_suite.py").write_text(textwrap.dedent(SUITE))
    (project / "data.txt").write_text("data")
    return project


def _run(project: Path, home: Path, subruns_: list[subruns.SubRun], tag: str, *args: str) -> tuple[int, str]:
    run = SubRun(project, home, tag, "-p", "no:randomly", *args)
    subruns_.append(run)
    rc = run.wait()
    assert ledger.scan(home) == [], f"boxes left behind\n{run.output[-3000:]}"
    return rc, run.output


def _host_untouched(project: Path) -> None:
    assert (project / "data.txt").read_text() == "data"
    assert not (project / "generated.txt").exists()
    assert not Path(os.path.expanduser(f"~/.{TAG}-rc")).exists()
    assert not Path(f"/tmp/{TAG}.log").exists()
    assert "POLLUTED" not in os.environ


def _section(output: str) -> dict[str, list[str]]:
    """The ``boxlite side effects`` section: test name -> its lines."""
    assert "= boxlite side effects =" in output, output[-3000:]
    body = output.split("= boxlite side effects =", 1)[1]
    out: dict[str, list[str]] = {}
    current = None
    for line in body.splitlines()[1:]:
        if line.startswith("boxlite: ") or line.startswith("="):
            break
        if line.startswith("    "):
            assert current is not None
            out[current].append(line.strip())
        else:
            current = line.split("::")[-1]
            out[current] = []
    return out


def _expected(project: Path) -> dict[str, str]:
    home = os.path.expanduser("~")
    return {k: v.format(home=home, project=project, tag=TAG) for k, v in DIRTY.items()}


def test_report_names_exactly_the_dirty_tests_and_what_each_left(
    tmp_path: Path, home: Path, subruns: list[subruns.SubRun]
) -> None:
    project = _project(tmp_path)
    junit = tmp_path / "junit.xml"
    rc, out = _run(
        project, home, subruns, "report", "--boxlite-side-effects=report", "--boxlite-usage=2", f"--junitxml={junit}"
    )
    assert rc == 0, out[-3000:]
    section = _section(out)
    expected = _expected(project)
    assert sorted(section) == sorted(expected), out[-3000:]
    for name, line in expected.items():
        assert len(section[name]) == 1 and section[name][0].startswith(line), (name, section[name])
    assert section["test_detached_process"][0].endswith(": sleep 300")
    assert f"boxlite: {len(DIRTY)} of {len(DIRTY) + len(CLEAN)} boxed tests left side effects" in out
    # The usage table names the test that allocated 300 MB first.
    table = out.split("boxlite usage: top 2 boxed tests by peak memory", 1)[1].splitlines()
    first = next(line for line in table if "::" in line)
    assert first.endswith("test_suite.py::test_usage_300mb") and float(first.split()[0]) > 300, table[:6]
    # junitxml: every checked test has the property ("none" when clean), and the usage ones.
    props = {
        str(tc.get("name")): {str(p.get("name")): str(p.get("value")) for p in tc.iter("property")}
        for tc in ET.parse(junit).iter("testcase")
    }
    for name in CLEAN:
        assert props[name][side_effects.PROPERTY] == side_effects.CLEAN
    for name, line in expected.items():
        assert props[name][side_effects.PROPERTY].startswith(line)
    assert float(props["test_usage_300mb"][side_effects.MEMORY_PROPERTY]) > 300
    assert all(side_effects.CPU_PROPERTY in p for p in props.values())
    # Root's boxes have cgroups of their own here: CPU time and processes from them, and the
    # header says so; an ordinary user's have none: the test process's rusage, and no count.
    source = "cgroup" if os.geteuid() == 0 else "rusage"
    assert {p[side_effects.CPU_SOURCE_PROPERTY] for p in props.values()} == {source}, props
    assert {p[side_effects.SOURCE_PROPERTY] for p in props.values()} == {source}, props
    header = out.split("boxlite usage: top 2", 1)[1].split(" peak MiB", 1)[0]
    if source == "cgroup":
        assert "(CPU time from each box's own cgroup (every process of the box))" in header, header
        assert int(props["test_detached_process"][side_effects.PROCESSES_PROPERTY]) >= 2, props
    else:
        assert "(CPU time from the test process's rusage" in header, header
        assert "(processes: not counted: no box had a pids cgroup" in header, header
        assert all(side_effects.PROCESSES_PROPERTY not in p for p in props.values())
    _host_untouched(project)


def test_fail_fails_exactly_the_dirty_tests_in_module_scope(
    tmp_path: Path, home: Path, subruns: list[subruns.SubRun]
) -> None:
    """One box for the module: each test is blamed for what changed between its start and its end
    (the file, process and variable an earlier test left are not the next one's)."""
    project = _project(tmp_path)
    rc, out = _run(project, home, subruns, "fail", "--boxlite-side-effects=fail", "--boxlite-scope=module", "-rA")
    assert rc == 1, out[-3000:]
    errors = {line.split("::")[-1].split(" ")[0] for line in out.splitlines() if line.startswith("ERROR test_suite")}
    assert errors == set(DIRTY), out[-4000:]
    passed = {line.split("::")[-1].split(" ")[0] for line in out.splitlines() if line.startswith("PASSED test_suite")}
    assert passed == set(DIRTY) | set(CLEAN), out[-4000:]
    for name, line in _expected(project).items():
        block = out.split(f"ERROR at teardown of {name} ", 1)[1]
        assert "this test left side effects (--boxlite-side-effects=fail)" in block[:500]
        assert line in block[:1000], (name, block[:1000])
    _host_untouched(project)


def test_worker_scope_names_what_each_test_changed_in_the_shared_box(
    tmp_path: Path, home: Path, subruns: list[subruns.SubRun]
) -> None:
    """--boxlite-scope=worker: one box runs the whole session, and each test is blamed for what
    changed in it between the test's start and its end (the project, the home, /tmp compared
    whole, its processes and environment): exactly the dirty tests, each with what it left, and
    a note saying where files were looked for.  The host is untouched."""
    project = _project(tmp_path)
    rc, out = _run(
        project, home, subruns, "worker", "--boxlite-side-effects=report", "--boxlite-scope=worker", "--boxlite-usage=1"
    )
    assert rc == 0, out[-3000:]
    section = {name: [x for x in lines if not x.startswith("note: ")] for name, lines in _section(out).items()}
    expected = _expected(project)
    expected["test_deletes_project_file"] = f"deleted file {project}/data.txt"  # its kind is known here
    assert sorted(section) == sorted(expected), out[-3000:]
    for name, line in expected.items():
        assert len(section[name]) == 1 and section[name][0].startswith(line), (name, section[name])
    assert f"boxlite: {len(DIRTY)} of {len(DIRTY) + len(CLEAN)} boxed tests left side effects" in out
    assert _changes.PLACES_NOTE in out
    table = out.split("boxlite usage: top 1 boxed tests by peak memory", 1)[1].splitlines()
    first = next(line for line in table if "::" in line)
    assert first.endswith("test_suite.py::test_usage_300mb") and float(first.split()[0]) > 300, table[:6]
    _host_untouched(project)


HOST_WRITES = """
import time


def test_waits_while_the_host_writes():
    time.sleep(4)
"""


def test_worker_scope_does_not_blame_a_test_for_what_the_host_writes(
    tmp_path: Path, home: Path, subruns: list[subruns.SubRun]
) -> None:
    """A worker's box shows the host's project and home live.  While its test runs, the host
    creates a file in the project and a directory with a file in the home, and the run's own
    output grows in a file of the project (subruns' log): the box's overlay shows the new ones on
    its lower layer, not its own, and the log is the run's output: none is the test's.  (Before,
    each was listed.)  What the host changes in a file that was there is not told apart: the
    how-to says so."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "test_host.py").write_text(HOST_WRITES)
    run = SubRun(
        project, home, "hostw", "-p", "no:randomly", "-v", "--boxlite-scope=worker", "--boxlite-side-effects=report"
    )
    subruns.append(run)
    home_dir = Path(os.path.expanduser(f"~/.{TAG}-host"))
    try:
        assert wait_until(lambda: "test_waits_while_the_host_writes" in run.output, timeout=120)
        (project / "from-host.txt").write_text("h")
        home_dir.mkdir()
        (home_dir / "f").write_text("h")
        rc = run.wait()
    finally:
        import shutil

        shutil.rmtree(home_dir, ignore_errors=True)
    out = run.output
    assert rc == 0, out[-3000:]
    assert "boxlite: no side effects in 1 boxed test" in out, out[-3000:]


def test_off_by_default_says_nothing(tmp_path: Path, home: Path, subruns: list[subruns.SubRun]) -> None:
    project = _project(tmp_path)
    junit = tmp_path / "junit.xml"
    rc, out = _run(project, home, subruns, "off", f"--junitxml={junit}")
    assert rc == 0, out[-3000:]
    assert "side effects" not in out and "boxlite usage" not in out
    assert side_effects.PROPERTY not in junit.read_text()
    _host_untouched(project)


ORDER = """
import os

import pytest

pytestmark = pytest.mark.boxlite


def test_a_leaves_a_variable():
    os.environ["LEFT_BY_A"] = "1"


def test_b_needs_it_unset():
    assert "LEFT_BY_A" not in os.environ
"""

HINT = "--boxlite-side-effects=report lists what each test left for the next"


@pytest.mark.parametrize("scope", ["module", "worker"])
def test_off_points_at_the_option_when_a_shared_box_saw_a_failure(
    tmp_path: Path, home: Path, subruns: list[subruns.SubRun], scope: str
) -> None:
    """The default says one line, where a run could use it: a test failed in a box that several
    tests share (what the one before left fails it).  Not where the option is set (off included),
    and not in a box per test, where that test passes."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "test_order.py").write_text(ORDER)
    rc, out = _run(project, home, subruns, "hint", f"--boxlite-scope={scope}")
    assert rc == 1, out[-3000:]
    line = f"boxlite: 1 test failed in boxes shared by several tests (--boxlite-scope={scope}): {HINT}"
    assert line in out, out[-3000:]
    assert out.count(HINT) == 1
    rc, out = _run(project, home, subruns, "hint-off", f"--boxlite-scope={scope}", "--boxlite-side-effects=off")
    assert rc == 1 and HINT not in out, out[-3000:]
    if scope == "module":
        rc, out = _run(project, home, subruns, "hint-test")
        assert rc == 0 and HINT not in out, out[-3000:]


HOSTILE = r"""
import os
import pathlib

import pytest

pytestmark = pytest.mark.boxlite(side_effects="report")


def test_flood():
    d = pathlib.Path(os.path.expanduser("~/flood"))
    d.mkdir()
    for i in range({n}):
        (d / str(i)).touch()
    for i in range(3):
        sub = pathlib.Path("spread%d" % i)
        sub.mkdir()
        for j in range({n} // 2):
            (sub / str(j)).touch()


def test_escape_in_a_name():
    pathlib.Path("/tmp/evil\x1b]0;owned\x07\u202e.txt").write_text("x")


def test_link_not_followed():
    os.symlink("/etc", "etc-link")
    os.makedirs("loop")
    os.symlink("../loop", "loop/self")


@pytest.mark.boxlite(side_effects="off")
def test_marker_off():
    pathlib.Path("ignored-by-marker").write_text("x")


def test_ignored_by_pattern():
    os.makedirs("build/out")
    pathlib.Path("build/out/a.o").write_text("x")
    pathlib.Path(os.path.expanduser("~/.cache-ignored")).write_text("x")
"""


def test_hostile_names_floods_and_links(tmp_path: Path, home: Path, subruns: list[subruns.SubRun]) -> None:
    """The marker turns it on for its tests; the flood is walked within the bound and said to be
    cut; escapes are escaped; links are shown, not followed (a loop is no trouble); the ignore
    patterns (ini) leave out what they name, relative to the project and as ~/... in the home."""
    project = tmp_path / "proj"
    project.mkdir()
    n = changes.WALK_ENTRIES
    (project / "test_hostile.py").write_text(textwrap.dedent(HOSTILE.replace("{n}", str(n))))
    # The ini key is a line list: a pattern per line, or several on one line, comma-separated.
    ini = "[pytest]\nboxlite_side_effects_ignore =\n    build\n    ~/.cache-ignored, /nowhere/*\n"
    (project / "pytest.ini").write_text(ini)
    rc, out = _run(project, home, subruns, "hostile")
    assert rc == 0, out[-3000:]
    section = _section(out)
    assert sorted(section) == ["test_escape_in_a_name", "test_flood", "test_link_not_followed"], out[-3000:]
    flood = section["test_flood"]
    assert any(line.startswith(f"created dir {os.path.expanduser('~')}/flood (") for line in flood), flood
    assert any("the walk of the box's files stopped after" in line for line in flood), flood
    assert len(flood) <= side_effects.FILES_CAP + side_effects.NOTES_CAP
    assert section["test_escape_in_a_name"] == ["created file /tmp/evil\\x1b]0;owned\\x07\\u202e.txt (1 byte)"]
    assert "\x1b]0;owned" not in out and "\u202e" not in out
    assert sorted(section["test_link_not_followed"]) == [
        f"created dir {project}/loop (1 file, 0 bytes)",
        f"created link {project}/etc-link -> /etc",
    ], out[-3000:]


# --- the host's checks of a CHANGES message (unit layer: forged fields a box could send) -----


def _good() -> dict[str, object]:
    return {
        "files": [["created", "file", "/x", 1, 0, None]],
        "processes": [[4, "sleep 1"]],
        "env": [["A", "set"]],
        "cwd": ["/a", "/b"],
        "umask": [0o22, 0o77],
        "usage": {"cpu_s": 0.5, "peak_kib": 1024},
        "notes": ["n"],
    }


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("files", "x", "files is not a list"),
        ("files", [["created", "file", "/x", 1, 0, None]] * (side_effects.FILES_CAP + 1), "at most"),
        ("files", [["exploded", "file", "/x", 1, 0, None]], "unknown"),
        ("files", [["created", "file", "/x", -1, 0, None]], "a size is not a count"),
        ("files", [["created", "file", 7, 1, 0, None]], "a path is not a string"),
        ("files", [["created", "file", "/x", True, 0, None]], "a size is not a count"),
        ("processes", [["4", "x"]], "a pid is not a count"),
        ("env", [["A", "exploded"]], "an env entry"),
        ("umask", [0o22, 0o1777], "umask"),
        ("usage", {"cpu_s": float("nan"), "peak_kib": 1}, "cpu_s"),
        ("usage", {"cpu_s": 1.0, "peak_kib": 2**70}, "peak_kib"),
        ("notes", ["n"] * (side_effects.NOTES_CAP + 1), "at most"),
    ],
)
def test_a_forged_message_is_refused_naming_what(field: str, value: object, why: str) -> None:
    fields = _good()
    fields[field] = value
    with pytest.raises(ValueError, match=why):
        side_effects.take(fields)


def test_long_texts_are_cut_and_escaped() -> None:
    fields = _good()
    fields["files"] = [["created", "link", "/a\x1b[2J" + "x" * 5000, 3, 0, "\u202e" * 3000]]
    got = side_effects.take(fields)
    (line,) = [ln for ln in got.lines() if ln.startswith("created link")]
    assert "\x1b" not in line and "\u202e" not in line
    assert len(got.files[0][2]) == side_effects.TEXT_CAP and len(got.files[0][5] or "") == side_effects.TEXT_CAP


# --- the box's walk (unit layer: a real directory tree, no box) ------------------------------


def test_the_walk_never_follows_a_link_and_stops_at_its_bounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Links are entries, never followed (a loop is no trouble); the walk stops at its entry bound
    and at its depth bound (one descriptor per level), saying it was cut."""
    (tmp_path / "d").mkdir()
    for i in range(50):
        (tmp_path / "d" / str(i)).touch()
    (tmp_path / "out").symlink_to("/")
    (tmp_path / "d" / "up").symlink_to("..")

    def walk(top: Path, budget: Any) -> dict[str, tuple[object, ...]]:
        state: dict[str, tuple[object, ...]] = {}
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
        try:
            changes._walk(fd, "/top", None, budget, state, lambda p: False, {}, lambda p: False)
        finally:
            os.close(fd)
        return state

    state = walk(tmp_path, changes._Budget())
    assert state["/top/out"][0] == "link" and state["/top/d/up"][0] == "link"
    assert not any(p.startswith(("/top/out/", "/top/d/up/")) for p in state)
    assert len(state) == 53
    monkeypatch.setattr(changes, "WALK_ENTRIES", 10)
    budget = changes._Budget()
    assert len(walk(tmp_path, budget)) == 10 and budget.cut
    monkeypatch.setattr(changes, "WALK_ENTRIES", 20000)
    deep = tmp_path / "deep"
    here = deep
    for _ in range(changes.WALK_DEPTH + 5):
        here = here / "x"
    here.mkdir(parents=True)
    budget = changes._Budget()
    state = walk(deep, budget)
    assert budget.cut and max(p.count("/") for p in state) == changes.WALK_DEPTH + 2


def test_a_worker_box_place_is_walked_level_by_level_never_following_a_link(tmp_path: Path) -> None:
    """A worker box's places (its home: often 200,000 files) are walked level by level on a
    budget: what lies near the top, where tests write (~/.rc), is seen even when a deep tree
    uses the budget up, which a depth-first walk spends on the tree first; links are entries, a
    link to / is not walked into."""
    deep = tmp_path / "a"
    for _ in range(30):
        deep = deep / "d"
        deep.mkdir(parents=True)
        (deep / "f").touch()
    (tmp_path / "zz-top.rc").touch()
    (tmp_path / "link").symlink_to("/")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        wide: dict[str, Any] = {}
        changes._walk_wide(fd, str(tmp_path), None, changes._Budget(10, 5.0), wide, lambda p: False, {})
        narrow: dict[str, Any] = {}
        changes._walk(fd, str(tmp_path), None, changes._Budget(10, 5.0), narrow, lambda p: False, {}, changes._no)
    finally:
        os.close(fd)
    assert f"{tmp_path}/zz-top.rc" in wide and wide[f"{tmp_path}/link"][0] == "link"
    assert not any(p.startswith(f"{tmp_path}/link/") for p in wide)
    assert {f"{tmp_path}/a", f"{tmp_path}/a/d"} <= set(wide) and len(wide) == 10
    if os.listdir(tmp_path)[0] == "a":  # the order the directory lists: depth first spends it on a/
        assert f"{tmp_path}/zz-top.rc" not in narrow


def test_ignore_patterns_match_a_path_its_directories_and_its_aliases() -> None:
    aliases = [("/proj", ""), ("/home/u", "~/")]
    assert changes._ignored("/proj/build/out/a.o", ("build",), aliases)
    assert changes._ignored("/home/u/.cache/x/y", ("~/.cache",), aliases)
    assert changes._ignored("/srv/a/__pycache__/m.pyc", changes.DEFAULT_IGNORE, aliases)
    assert changes._ignored("/tmp/x.log", ("/tmp/*.log",), aliases)
    assert not changes._ignored("/proj/src/build.py", ("build",), aliases)
    assert not changes._ignored("/elsewhere/build/a", ("build",), aliases)


OOM = """
import pytest


@pytest.mark.boxlite(memory=128)
def test_oom():
    data = bytearray(300 << 20)
    for i in range(0, len(data), 4096):
        data[i] = 1
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a box's memory cap needs cgroups, which an ordinary user has not here")
def test_an_oom_killed_box_names_its_limit_and_peak(tmp_path: Path, home: Path, subruns: list[subruns.SubRun]) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "test_oom.py").write_text(OOM)
    rc, out = _run(project, home, subruns, "oom", "--boxlite-usage=1")
    assert rc == 1, out[-3000:]
    assert "killed by the kernel's OOM killer (the box's memory cap): its peak 128.0 MiB, its limit 128.0 MiB" in out


def test_the_guest_modules_share_no_namespace() -> None:
    """The host once sent several guest modules' sources in one remote_exec, one namespace: a helper
    of one that another defined too replaced the other's (a side-effects helper named like one of
    guest/fresh.py's broke the VM path's fresh boxes, side effects off).  Now it sends the bootstrap
    alone, which imports the guest from the package: each module has a namespace of its own."""
    import ast
    import inspect

    from pytest_boxlite import guest
    from pytest_boxlite.remote import warm

    assert 'self._source = guest.source("bootstrap")' in inspect.getsource(warm.WarmInterpreters.__init__)
    tree = ast.parse(guest.source("bootstrap"))
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert defined == {"main", "prepare"}
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m for m in imported if m and m.startswith("pytest_boxlite")} == {"pytest_boxlite.guest.worker"}


# --- Sandbox.changes(): what a sandbox's commands changed since it started -----------------------

#: The checkout: the box shows it copy-on-write at the same path, writable by whoever runs this.
INSTALL = (
    "mkdir -p {repo}/.bx-{tag}/share/mytool/__pycache__ && printf 1 > {repo}/.bx-{tag}/share/mytool/a"
    " && printf 22 > {repo}/.bx-{tag}/share/mytool/b && ln -s {repo}/.bx-{tag}/share/mytool/a {repo}/.bx-{tag}-link"
    " && echo x >> {repo}/README.md && rm {repo}/docs/index.md && printf w > /workspace/w && printf t > /tmp/t"
)


@pytest.fixture
def host_tree() -> Iterator[Path]:
    """A small project on the host that every box sees at its own path: in the home, since a box's
    /tmp is its own (a checkout under the host's /tmp is not in a plain box), and an ordinary
    user's box cannot copy up a directory of another owner's (/var/tmp: EOVERFLOW)."""
    import shutil
    import tempfile

    tree = Path(tempfile.mkdtemp(prefix=".bx-se-", dir=Path.home()))
    try:
        (tree / "docs").mkdir()
        (tree / "docs" / "index.md").write_text("# index\n")
        (tree / "README.md").write_text("# readme\n")
        yield tree
    finally:
        shutil.rmtree(tree)


def test_sandbox_changes_after_an_install(make_namespace_box: Any, namespace_mode: str, host_tree: Path) -> None:
    """A sandbox forked from the warm box (the default) lists exactly what its commands wrote; a
    booted one says it cannot (UnsupportedError), never an empty list.  The host is untouched."""
    from pytest_boxlite.errors import UnsupportedError
    from pytest_boxlite.sandbox import Change

    repo = host_tree  # the project an install writes into
    readme = (repo / "README.md").read_bytes()
    sb = make_namespace_box()
    sb.run(["sh", "-c", INSTALL.format(repo=repo, tag=TAG)]).check()
    assert (repo / "README.md").read_bytes() == readme and (repo / "docs" / "index.md").exists()
    assert not (repo / f".bx-{TAG}").exists()
    if namespace_mode == "booted":
        with pytest.raises(UnsupportedError, match="keeps no handle on its layers"):
            sb.changes()
        return
    got = sb.changes()
    assert got.notes == []
    target = f"{repo}/.bx-{TAG}/share/mytool/a"
    expected = [
        Change("modified", "file", f"{repo}/README.md", len(readme) + 2, 0, None),
        Change("created", "dir", f"{repo}/.bx-{TAG}", 3, 2, None),
        Change("created", "link", f"{repo}/.bx-{TAG}-link", len(target), 0, target),
        Change("deleted", "entry", f"{repo}/docs/index.md", 0, 0, None),
        Change("created", "file", "/tmp/t", 1, 0, None),
        Change("created", "file", "/workspace/w", 1, 0, None),
    ]
    assert list(got) == sorted(expected, key=lambda c: c.path)
    # Asked again, after more: the list grows, from the same start.
    sb.run(["sh", "-c", f"rm {repo}/.bx-{TAG}/share/mytool/b"]).check()
    again = {c.path: c for c in sb.changes()}
    assert again[f"{repo}/.bx-{TAG}"].files == 1


# --- the vm path, through the BoxLite SDK double (a real guest computes the same list) -----------

VM_SUITE = f"""
import os
import pathlib

import pytest

pytestmark = pytest.mark.boxlite
TAG = {TAG!r}


def test_home_file():
    pathlib.Path(os.path.expanduser("~/." + TAG + "-rc")).write_text("x=1")


def test_tmp_file():
    pathlib.Path("/tmp/" + TAG + ".log").write_text("log")


def test_environ():
    os.environ["POLLUTED"] = "1"


def test_clean(tmp_path, monkeypatch):
    monkeypatch.setenv("POLLUTED", "2")
    (tmp_path / "ok").write_text("ok")
"""


def test_vm_double_reports_the_same(tmp_path: Path, home: Path) -> None:
    """On the vm runtime a boxed test's box is forked in the VM with an overlay over its root and
    every writable mount (guest/fresh.py's renew_all): the same list, from the same guest code."""
    import subprocess
    import sys

    tests = Path(__file__).resolve().parent
    env = subruns.sub_env(
        PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests), str(tests / "sdk_double" / "site")]),
        BOXLITE_SDK_DOUBLE="1",
    )
    project = tmp_path / "proj"
    project.mkdir()
    (project / "test_vm.py").write_text(textwrap.dedent(VM_SUITE))
    argv = [sys.executable, "-m", "pytest", *subruns.QUIET, f"--boxlite-home={home}", "--boxlite-runtime=vm"]
    r = subprocess.run(
        [*argv, "--boxlite-side-effects=report"], cwd=project, env=env, capture_output=True, text=True, timeout=200
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    section = _section(out)
    box_home = section["test_home_file"][0].split(" ")[2].rsplit("/", 1)[0]  # the box user's home in the VM
    assert section == {
        "test_home_file": [f"created file {box_home}/.{TAG}-rc (3 bytes)"],
        "test_tmp_file": [f"created file /tmp/{TAG}.log (3 bytes)"],
        "test_environ": ["environment variable POLLUTED set"],
    }, out[-3000:]
    assert ledger.scan(home) == []
    assert not Path(os.path.expanduser(f"~/.{TAG}-rc")).exists() and not Path(f"/tmp/{TAG}.log").exists()
    # fail, in one VM box per module, with the usage: exactly the dirty tests fail, each for what
    # it left after the one before it, and the usage comes from rusage (the plugin has no cgroup
    # of a VM's box), which the table says.
    r = subprocess.run(
        [*argv, "--boxlite-side-effects=fail", "--boxlite-scope=module", "--boxlite-usage=4", "-rA"],
        cwd=project, env=env, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    errors = {line.split("::")[-1].split(" ")[0] for line in out.splitlines() if line.startswith("ERROR test_vm")}
    assert errors == set(section), out[-3000:]
    header = out.split("boxlite usage: top 4 boxed tests by peak memory", 1)[1].split(" peak MiB", 1)[0]
    assert "(CPU time from the test process's rusage" in header and "processes: not counted" in header, header
    assert ledger.scan(home) == []
    assert not Path(os.path.expanduser(f"~/.{TAG}-rc")).exists() and not Path(f"/tmp/{TAG}.log").exists()


def test_a_booted_box_says_what_it_cannot_see(tmp_path: Path, home: Path, subruns: list[subruns.SubRun]) -> None:
    """--boxlite-fresh=boot: the box's writable layers lie outside it, so its files are not listed
    and the summary says so; what it can see (the environment, processes) is still listed."""
    project = _project(tmp_path)
    rc, out = _run(
        project, home, subruns, "boot", "--boxlite-side-effects=report", "--boxlite-fresh=boot",
        "-k", "test_home_file or test_environ or test_clean_tmp_path",
    )  # fmt: skip
    assert rc == 0, out[-3000:]
    assert _section(out) == {"test_environ": ["environment variable POLLUTED set", "note: " + BOOTED_NOTE]}
    assert f"boxlite: {BOOTED_NOTE} (2 clean tests)" in out, out[-2000:]
    _host_untouched(project)


BURN = """
import time


def test_burns_cpu():
    end = time.process_time() + 0.6
    while time.process_time() < end:
        pass


def test_idle_after():
    pass
"""


def test_module_scope_usage_counts_from_each_tests_start(
    tmp_path: Path, home: Path, subruns: list[subruns.SubRun]
) -> None:
    """In module scope one box runs both tests: the second test's CPU time counts from its own
    start (the cell's begin_test), not the box's, so the first test's 0.6 s is not the second's."""
    if os.geteuid() != 0:
        pytest.skip("an ordinary user's boxes have no cgroup here: usage is the test process's rusage")
    project = tmp_path / "proj"
    project.mkdir()
    (project / "test_burn.py").write_text(textwrap.dedent(BURN))
    junit = tmp_path / "junit.xml"
    rc, out = _run(
        project, home, subruns, "burn", "--boxlite", "--boxlite-scope=module", "--boxlite-usage=2",
        f"--junitxml={junit}",
    )  # fmt: skip
    assert rc == 0, out[-3000:]
    props = {
        str(tc.get("name")): {str(p.get("name")): str(p.get("value")) for p in tc.iter("property")}
        for tc in ET.parse(junit).iter("testcase")
    }
    assert props["test_burns_cpu"][side_effects.CPU_SOURCE_PROPERTY] == "cgroup", props
    assert float(props["test_burns_cpu"][side_effects.CPU_PROPERTY]) >= 0.5, props
    assert float(props["test_idle_after"][side_effects.CPU_PROPERTY]) < 0.3, props


BOOTED_NOTE = "files: not seen in a booted box (its writable layers lie outside it)"


DEV = f"""
import os

import pytest

pytestmark = pytest.mark.boxlite
TAG = {TAG!r}


def test_writes_dev():
    with open("/dev/" + TAG, "w") as fh:
        fh.write("x")


def test_after():
    pass
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="only root of a box can write its /dev")
def test_a_file_left_in_dev_is_listed(tmp_path: Path, home: Path, subruns: list[subruns.SubRun]) -> None:
    """A forked box's /dev is the warm box's, which no fork renews: what a root test leaves there
    the next test's box sees, so it is listed (for the test that wrote it, not the next one)."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "test_dev.py").write_text(DEV)
    rc, out = _run(project, home, subruns, "dev", "--boxlite-side-effects=report")
    assert rc == 0, out[-3000:]
    assert _section(out) == {"test_writes_dev": [f"created file /dev/{TAG} (1 byte)"]}, out[-3000:]
    assert not Path(f"/dev/{TAG}").exists()


# --- the box's own cgroups: CPU time and peaks per test, module scope included ---------------------

CHILD = """
import sys
for line in sys.stdin:
    mb, spin = map(int, line.split())
    block = bytearray(mb << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    del block  # freed: what the next step uses starts from here
    x = 0
    for i in range(spin):
        x += i
    print("done", flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a box's own cgroups need root here")
def test_a_cell_counts_each_tests_cpu_and_peaks_from_its_start() -> None:
    """A real cell's cgroups (no box: a child process moved into them): the CPU time counts from
    the test's start (:meth:`ForkCell.begin_test`), not the box's; the memory peak starts again
    where the kernel lets it, and a peak that cannot (pids.peak) is left out of a later test's usage
    instead of being reported as its own."""
    import subprocess
    import sys

    from pytest_boxlite.runtimes import _cgroups
    from pytest_boxlite.runtimes._forkcell import ForkCell

    cg = _cgroups.create(f"se-cell-{os.getpid()}", memory_mib=1024, cpus=None, pids=64)
    cell = ForkCell("se-cell", cg, {}, lambda c, t: None)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        for d in cg.dirs:
            (d / "cgroup.procs").write_text(str(child.pid))
        if "cpu_ns" not in cg.usage():
            pytest.skip(f"this host counts no CPU time in a box's cgroups: {cg.dirs}")
        cell.begin_test()  # the module's first test
        child.stdin.write("80 4000000\n")
        assert child.stdout.readline() == "done\n"
        first = cell.usage()
        cell.begin_test()  # its second: a little CPU, no new memory
        child.stdin.write("0 200000\n")
        assert child.stdout.readline() == "done\n"
        second = cell.usage()
    finally:
        child.kill()
        child.communicate(timeout=10)  # closes its pipes
        cell.remove()
        cell.log.close()
    assert first["cpu_ns"] > 4 * second["cpu_ns"] > 0, (first, second)
    assert first["peak_memory"] > 80 << 20, first
    assert second.get("peak_memory", 0) < 40 << 20, second  # started again (v1), or left out (v2)
    if "max_processes" in first:
        assert "max_processes" not in second  # pids.peak never starts again: not the second test's
