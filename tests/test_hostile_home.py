"""A boxlite home is a trust boundary (issue 40, class 1): attacks on what the host keeps there.

The attackers: a second local user (``boxlite-attacker``, made here with ``useradd`` where
missing; those tests need root and skip otherwise) who can write a shared home, and a project
that ships a home of its own (``pytest.ini`` naming ``.bl-home`` with a link planted in it: no
second user needed, so those run as root and as an ordinary user).  Each attack is real: a real
``sleep`` of ours that a planted record names, real links to real directories that must survive,
a real listener of another uid behind ``agent.sock``, real sub-runs of ``pytest`` and of
``python -m pytest_boxlite``.  On the code before this change each of them killed, deleted,
handed over or printed what it must not (the issue lists them).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from subruns import ATTACKER, QUIET, process_gone, second_user, sub_env, wait_until

import pytest_boxlite
from pytest_boxlite import _homefs, ledger

pytestmark = pytest.mark.timeout(300)

#: The tree of the package under test: sub-processes import this one, not an installed copy.
PACKAGE_ROOT = str(Path(pytest_boxlite.__file__).resolve().parent.parent)
CLI_TIMEOUT = 120


def _env(**extra: str) -> dict[str, str]:
    env = sub_env(**extra)
    env["PYTHONPATH"] = PACKAGE_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cli(home: Path, *args: str, stdin: int | None = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest_boxlite", "--home", str(home), *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        env=_env(),
        stdin=stdin,
        cwd="/",
    )


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A host process of ours that a planted record names (it must survive)."""
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    yield proc
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait(10)


def _start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _plant_box(namespace: Path, name: str, pid: int) -> None:
    """A dead session's box, as a record the host wrote would look: pid and start time of ``pid``."""
    (namespace / name).mkdir(parents=True)
    ctl = namespace / f"{name}.ctl"
    ctl.mkdir()
    info = {"name": name, "pid": pid, "start_time": _start_time(pid), "init_pid": pid}
    info["init_start_time"] = info["start_time"]
    (ctl / "info.json").write_text(json.dumps(info))


def _alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None and not process_gone(proc.pid)


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture(scope="module")
def attacker() -> pwd.struct_passwd:
    """A second local account (made here where missing; skips unless root)."""
    return second_user()


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[Path]:
    """A directory every user can reach (tmp_path is root's own, mode 0700)."""
    base = Path(f"/tmp/pbx-hostile-home-{os.getpid()}-{time.monotonic_ns()}")
    base.mkdir(mode=0o755)
    yield base
    _homefs.remove_path(base)


def _chown_tree(path: Path, pw: pwd.struct_passwd) -> None:
    for p in [path, *path.rglob("*")]:
        os.chown(p, pw.pw_uid, pw.pw_gid, follow_symlinks=False)


# --- a home another user can write -------------------------------------------------------------


@pytest.mark.escape_row("hostile-home", runtime="host", users="root")
def test_a_home_another_user_can_write_is_refused_and_nothing_in_it_acted_on(
    shared: Path, attacker: pwd.struct_passwd, victim: subprocess.Popen[bytes]
) -> None:
    """A shared CI home (mode 1777): the attacker planted a box naming our process, ``namespace`` and
    ``sessions`` links to our directories.  Every command refuses the home, naming the fix."""
    outside = shared / "ours"
    (outside / "keep-me").mkdir(parents=True)
    (outside / "keep-me" / "data").write_text("x")
    (outside / "a.lock").write_text("")
    home = shared / "home"
    home.mkdir()
    home.chmod(0o1777)
    _plant_box(home / "elsewhere", "pbx-dead-1", victim.pid)
    (home / "namespace").symlink_to(home / "elsewhere")
    (home / "sessions").symlink_to(outside)
    _chown_tree(home / "elsewhere", attacker)
    os.chown(home / "namespace", attacker.pw_uid, attacker.pw_gid, follow_symlinks=False)
    os.chown(home / "sessions", attacker.pw_uid, attacker.pw_gid, follow_symlinks=False)
    before = _tree(outside)
    for args in (["clean"], ["clean", "--kept"], ["ls"], ["shell", "pbx-dead-1", "true"]):
        r = _cli(home, *args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert f"boxlite home {home} (from --home) is not safe to use: it is writable by others" in r.stderr, r.stderr
        assert f"chmod go-w {home}" in r.stderr, r.stderr
    assert _alive(victim), "a planted record made the host kill a process of ours"
    assert _tree(outside) == before
    assert (home / "elsewhere" / "pbx-dead-1").is_dir()


@pytest.mark.escape_row("hostile-home", runtime="host", users="root")
def test_a_home_of_another_user_is_refused_by_a_session(
    shared: Path, tmp_path: Path, attacker: pwd.struct_passwd
) -> None:
    home = shared / "theirs"
    home.mkdir(mode=0o755)
    os.chown(home, attacker.pw_uid, attacker.pw_gid)
    (tmp_path / "test_one.py").write_text("import pytest\n\n@pytest.mark.boxlite\ndef test_one():\n    pass\n")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={home}", "test_one.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        env=_env(),
    )
    out = r.stdout + r.stderr
    assert r.returncode == 4, out  # a usage error: nothing ran
    assert f"boxlite home {home} (from command line --boxlite-home) is not safe to use" in out, out
    assert f"it belongs to {ATTACKER}" in out, out
    assert not (home / "namespace").exists() and not (home / "sessions").exists()


@pytest.mark.escape_row("hostile-home", runtime="host", users="root")
def test_entries_of_another_user_in_our_home_are_refused_never_removed(
    tmp_path: Path, attacker: pwd.struct_passwd
) -> None:
    """What another user left in a home of ours (made before the home was ours alone) is reported,
    neither removed nor entered."""
    home = tmp_path / "bxh"
    theirs = home / "namespace" / "pbx-dead-1"
    (theirs / "inner").mkdir(parents=True)
    (home / "sessions").mkdir()
    (home / "sessions" / "dead.lock").write_text("")
    _chown_tree(theirs, attacker)
    os.chown(home / "sessions" / "dead.lock", attacker.pw_uid, attacker.pw_gid)
    r = _cli(home, "clean")
    assert r.returncode == 0, r.stderr
    assert "removed 0 box(es)" in r.stdout
    assert f"refused {theirs}: it belongs to {ATTACKER}" in r.stderr, r.stderr
    assert (theirs / "inner").is_dir() and (home / "sessions" / "dead.lock").exists()


@pytest.mark.escape_row("hostile-home", runtime="host", users="root")
def _attacker_python() -> str:
    """An interpreter the attacker may run (skips where there is none)."""
    for c in (sys.executable, "/usr/bin/python3"):
        ok = (
            os.path.exists(c)
            and (
                subprocess.run(
                    ["runuser", "-u", ATTACKER, "--", c, "-I", "-c", "pass"], capture_output=True, timeout=60
                )
            ).returncode
            == 0
        )
        if ok:
            return c
    pytest.skip(f"no Python interpreter that {ATTACKER} may run")


#: The attacker's listener: records what the first connection hands it (bytes, descriptors).
_SPY = (
    "import socket,sys,os\n"
    "s=socket.socket(socket.AF_UNIX);s.bind(sys.argv[1]);s.listen(1);s.settimeout(60)\n"
    "open(sys.argv[2]+'/ready','w').close()\n"
    "try:\n"
    "    c,_=s.accept()\n"
    "except TimeoutError:\n"
    "    sys.exit(0)\n"
    "c.settimeout(10)\n"
    "try:\n"
    "    msg,fds,_,_=socket.recv_fds(c,65536,8)\n"
    "except (TimeoutError,OSError):\n"
    "    msg,fds=b'',[]\n"
    "open(sys.argv[2]+'/stolen','w').write(repr((msg,len(fds))))\n"
)


@contextlib.contextmanager
def _spy_on(sock: Path, got: Path) -> Iterator[None]:
    """The attacker listening at ``sock``; afterwards, it must have got no byte and no descriptor."""
    got.mkdir()
    got.chmod(0o777)
    spy = subprocess.Popen(["runuser", "-u", ATTACKER, "--", _attacker_python(), "-I", "-c", _SPY, str(sock), str(got)])
    try:
        assert wait_until(lambda: (got / "ready").exists(), 30), "the attacker's listener did not start"
        yield
        spy.wait(30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            spy.kill()
        spy.wait(10)
    stolen = (got / "stolen").read_text() if (got / "stolen").exists() else "(b'', 0)"
    assert stolen == "(b'', 0)", f"the other user's listener got {stolen}"


def _planted_ctl(shared: Path) -> tuple[Path, Path]:
    """A home whose box control directory another user can write: (home, that directory)."""
    home = shared / "bxh"
    ctl = home / "namespace" / "pbx-x-1.ctl"
    (home / "namespace" / "pbx-x-1").mkdir(parents=True)
    ctl.mkdir()
    for d in (home, home / "namespace"):
        d.chmod(0o711)
    ctl.chmod(0o777)
    return home, ctl


def test_shell_hands_nothing_to_a_listener_of_another_user(shared: Path, attacker: pwd.struct_passwd) -> None:
    """``shell NAME`` connects to ``NAME.ctl/agent.sock``: another user's listener there (a control
    directory left writable) gets no byte and no descriptor, and the refusal says whose it is."""
    home, ctl = _planted_ctl(shared)
    with _spy_on(ctl / "agent.sock", shared / "got"):
        r = _cli(home, "shell", "pbx-x-1", "--", "true", stdin=None)
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert f"its agent socket is held by uid {attacker.pw_uid}" in r.stderr, r.stderr
        assert "nothing was sent to it" in r.stderr


@pytest.mark.parametrize("via", [False, True], ids=["agent", "box-server"])
def test_attach_hands_nothing_to_a_listener_of_another_user(
    shared: Path, attacker: pwd.struct_passwd, via: bool
) -> None:
    """``guest/attach.py`` (what an xdist worker in a box, and a box server's client, run on the
    host) hands the socket its stdin, stdout and stderr: never to another user's listener."""
    _, ctl = _planted_ctl(shared)
    script = Path(pytest_boxlite.__file__).parent / "guest" / "attach.py"
    sock = ctl / "agent.sock"
    with _spy_on(sock, shared / "got"):
        args = ["--via", str(sock), "--", "true"] if via else [str(sock), "--", "true"]
        r = subprocess.run([sys.executable, "-I", "-S", str(script), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode in (3, 126), (r.returncode, r.stderr)
        assert f"its listener is uid {attacker.pw_uid}" in r.stderr and "nothing was sent to it" in r.stderr, r.stderr


# --- a home of ours that a project shipped (or that holds records it did not write) -------------


@pytest.mark.escape_row("hostile-home", runtime="host")
def test_a_record_naming_a_process_of_ours_does_not_get_it_killed(
    tmp_path: Path, victim: subprocess.Popen[bytes]
) -> None:
    """``info.json`` holds a pid and its start time, both public in /proc: a record planted in a
    home (shipped by a project, or left by anyone able to write it once) is a claim, not a proof."""
    home = tmp_path / "bxh"
    _plant_box(home / "namespace", "pbx-dead-1", victim.pid)
    r = _cli(home, "ls")
    assert r.returncode == 0, r.stderr
    assert "pbx-dead-1" in r.stdout and "stopped" in r.stdout, r.stdout  # not proven running
    r = _cli(home, "clean")
    assert r.returncode == 0, r.stderr
    assert _alive(victim), "clean killed the process a planted record named"
    assert "removed 1 box(es): pbx-dead-1" in r.stdout  # the planted directory itself is ours: gone
    assert not (home / "namespace" / "pbx-dead-1").exists()


@pytest.mark.escape_row("hostile-home", runtime="namespace")
@pytest.mark.parametrize("argument", ["--this-is-a-long-innocent-argument-0123456789", "0123456789abcdef" * 2])
def test_a_record_whose_token_is_an_argument_of_our_process_does_not_get_it_killed(
    tmp_path: Path, argument: str
) -> None:
    """The token that proves a pid a box's is the host's own secret, in the form the host writes
    it (the agent's JSON config): a planted record that copies a long argument of any process of
    ours as its ``token`` (command lines are public in /proc) used to get that process killed."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", argument], start_new_session=True)
    try:
        home = tmp_path / "bxh"
        _plant_box(home / "namespace", "pbx-dead-1", proc.pid)
        info_path = home / "namespace" / "pbx-dead-1.ctl" / "info.json"
        info = json.loads(info_path.read_text())
        info["token"] = argument
        info_path.write_text(json.dumps(info))
        r = _cli(home, "clean")
        assert r.returncode == 0, r.stderr
        assert _alive(proc), "clean killed the process whose argument a planted record named as its token"
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(10)


@pytest.mark.escape_row("hostile-home", runtime="namespace")
def test_a_session_start_does_not_kill_what_a_planted_record_names(
    tmp_path: Path, victim: subprocess.Popen[bytes]
) -> None:
    home = tmp_path / "bxh"
    _plant_box(home / "namespace", "pbx-dead-1", victim.pid)
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_one.py").write_text("import pytest\n\n@pytest.mark.boxlite\ndef test_one():\n    pass\n")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={home}", "test_one.py"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert _alive(victim), "a session's start-up reconcile killed the process a planted record named"


INI_PROJECT_TEST = "import pytest\n\n@pytest.mark.boxlite\ndef test_one():\n    pass\n"


@pytest.mark.escape_row("hostile-home", runtime="host")
@pytest.mark.parametrize("link", ["namespace", "sessions"])
def test_a_project_shipping_a_home_with_a_link_deletes_nothing(tmp_path: Path, link: str) -> None:
    """``pytest.ini`` says ``boxlite_home = .bl-home`` and the checkout ships ``.bl-home/namespace
    -> ../../siblings``: a plain ``pytest`` used to delete the sibling checkouts at its start."""
    siblings = tmp_path / "siblings"
    (siblings / "other-checkout" / "src").mkdir(parents=True)
    (siblings / "other-checkout" / "src" / "main.py").write_text("print('mine')\n")
    (siblings / "x.lock").write_text("")
    project = tmp_path / "work" / "project"
    (project / ".bl-home").mkdir(parents=True)
    (project / ".bl-home" / link).symlink_to(Path("../../../siblings"))
    (project / "pytest.ini").write_text("[pytest]\nboxlite_home = .bl-home\n")
    (project / "test_one.py").write_text(INI_PROJECT_TEST)
    before = _tree(siblings)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", *QUIET, "test_one.py"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
    )
    out = r.stdout + r.stderr
    assert _tree(siblings) == before, out
    assert r.returncode == 4, out  # a usage error, before any test
    assert f"refused {project / '.bl-home' / link}" in out, out
    assert "ini boxlite_home" in out, out
    # The command line refuses it the same way, and removes nothing either.
    r = _cli(project / ".bl-home", "clean")
    assert r.returncode == 1 and f"refused {project / '.bl-home' / link}" in r.stderr, r.stderr
    assert _tree(siblings) == before


@pytest.mark.escape_row("hostile-home", runtime="host")
def test_a_link_inside_a_leftover_box_is_removed_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "f").write_text("keep")
    home = tmp_path / "bxh"
    box = home / "namespace" / "pbx-dead-1"
    (box / "upper" / "work").mkdir(parents=True)
    (box / "upper" / "to-outside").symlink_to(outside)
    (box / "upper" / "work" / "up").symlink_to(Path("../../../../../outside/sub"))
    os.chmod(box / "upper" / "work", 0)
    (home / "namespace" / "pbx-dead-2").symlink_to(outside)  # a link as a box: refused, left
    r = _cli(home, "clean")
    assert r.returncode == 0, r.stderr
    assert not box.exists()
    assert (outside / "sub" / "f").read_text() == "keep"
    assert (home / "namespace" / "pbx-dead-2").is_symlink()
    assert f"refused {home / 'namespace' / 'pbx-dead-2'}: a link" in r.stderr, r.stderr


@pytest.mark.escape_row("hostile-home", runtime="host")
def test_ls_shows_planted_names_escaped(tmp_path: Path) -> None:
    home = tmp_path / "bxh"
    osc52 = "\x1b]52;c;ZWNobyBwd25lZA==\x07"
    title = "\x1b]0;owned\x07"
    (home / "namespace" / f"pbx-{osc52}-1").mkdir(parents=True)
    (home / "namespace" / f"pbx-dead-1{title}\u202e").mkdir()
    r = _cli(home, "ls")
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout and "\u202e" not in r.stdout, repr(r.stdout)
    assert "pbx-\\x1b]52;c;ZWNobyBwd25lZA==\\x07-1" in r.stdout, r.stdout
    assert "pbx-dead-1\\x1b]0;owned\\x07\\u202e" in r.stdout, r.stdout
    r = _cli(home, "clean")
    assert "\x1b" not in r.stdout + r.stderr, repr(r.stdout + r.stderr)


# --- the home module itself --------------------------------------------------------------------


def test_check_home_holds_ssh_strict_modes(tmp_path: Path) -> None:
    home = tmp_path / "h"
    assert _homefs.check_home(home, source="test", create=True) == home
    assert home.stat().st_mode & 0o777 == 0o700
    home.chmod(0o775)
    with pytest.raises(_homefs.UnsafeHome, match=rf"{home} \(from test\) .*writable by others .*chmod go-w {home}"):
        _homefs.check_home(home, source="test")
    home.chmod(0o755)
    above = tmp_path / "open"
    above.mkdir()
    above.chmod(0o777)
    (above / "h").mkdir()
    with pytest.raises(_homefs.UnsafeHome, match=rf"the directory {above} above it is writable by others"):
        _homefs.check_home(above / "h", source="test")
    above.chmod(0o1777)  # sticky, as /tmp: others cannot rename our entries
    assert _homefs.check_home(above / "h", source="test") == above / "h"


def test_paths_below_a_home_never_follow_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "info.json").write_text("{}")
    home = tmp_path / "h"
    (home / "a").mkdir(parents=True)
    (home / "a" / "link").symlink_to(outside)
    (home / "a" / "file-link").symlink_to(outside / "info.json")
    with _homefs.HomeDir.open(home) as d:
        with pytest.raises(_homefs.Refused, match="a link where a directory is expected"):
            d.sub("a/link")
        with pytest.raises(_homefs.Refused):
            d.read("a/link/info.json", 100)
        with pytest.raises(_homefs.Refused, match="a link where a file is expected"):
            d.read("a/file-link", 100)
        with pytest.raises(_homefs.Refused):
            d.sub("../outside")
        assert [(e.name, e.refused) for e in d.sub("a").entries()] == [("file-link", "a link"), ("link", "a link")]
        d.remove("a")
    assert (outside / "info.json").read_text() == "{}"


def test_the_fallback_walk_refuses_links_as_openat2_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A kernel without openat2 is simulated (this one has it): the O_NOFOLLOW walk must hold alone.
    monkeypatch.setattr(_homefs, "has_openat2", lambda: False)
    outside = tmp_path / "outside"
    outside.mkdir()
    home = tmp_path / "h"
    (home / "a" / "b").mkdir(parents=True)
    (home / "a" / "link").symlink_to(outside)
    with _homefs.HomeDir.open(home) as d:
        with pytest.raises(_homefs.Refused):
            d.sub("a/link")
        with pytest.raises(_homefs.Refused):
            d.write("a/link/x", b"1")
        d.write("a/b/x", b"1")
        assert d.read("a/b/x", 10) == b"1"
    assert not (outside / "x").exists()
    assert "no openat2" in " ".join(_homefs.limits())


def test_the_ledger_refuses_a_sessions_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.lock").write_text("mine")
    home = tmp_path / "bxh"
    home.mkdir()
    (home / "sessions").symlink_to(victim)
    with pytest.raises(_homefs.Refused, match="sessions"):
        ledger.reconcile(home)
    assert (victim / "precious.lock").read_text() == "mine"
    assert ledger.owner_alive(home, "precious")  # a lock behind a link: its owner is left alone


def test_a_signal_goes_only_to_a_proven_box_process(tmp_path: Path, victim: subprocess.Popen[bytes]) -> None:
    from pytest_boxlite.runtimes.namespace import leftovers

    info = {"pid": victim.pid, "start_time": _start_time(victim.pid), "token": "f" * 32}
    leftovers.kill_box_processes(info, tmp_path / "pbx-x-1")
    assert _alive(victim)
    # The same process started holding the token in its command line, as the host writes it in
    # a box's agent's (its JSON config), is a box's: it is signalled.
    token = "a" * 32
    config = json.dumps({"token": token})
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", config])
    try:
        # Its command line is empty for a moment after exec (the kernel sets it up after Popen returns).
        assert wait_until(lambda: config.encode() in Path(f"/proc/{proc.pid}/cmdline").read_bytes(), 10)
        leftovers.kill_box_processes({"pid": proc.pid, "start_time": _start_time(proc.pid), "token": token})
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(10)


@pytest.mark.escape_row("hostile-home", runtime="host")
def test_clean_unlinks_no_service_record_through_a_link(tmp_path: Path) -> None:
    """``clean`` prunes the service records of dead boxes: through ``services -> elsewhere`` it
    used to unlink any ``pbx-…-N.json`` there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "pbx-dead-1.json").write_text('{"service": "mine"}')
    home = tmp_path / "bxh"
    home.mkdir()
    (home / "services").symlink_to(elsewhere)
    r = _cli(home, "clean")
    assert r.returncode == 0, r.stderr
    assert (elsewhere / "pbx-dead-1.json").read_text() == '{"service": "mine"}'


@pytest.mark.escape_row("hostile-home", runtime="host")
def test_clean_opens_and_removes_no_vm_home_through_a_link(tmp_path: Path) -> None:
    """``vm -> elsewhere``: each sub-directory there looked like a dead owner's vm home, opened by
    BoxLite and then removed."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "deadowner").mkdir(parents=True)
    (elsewhere / "deadowner" / "thesis.tex").write_text("mine")
    home = tmp_path / "bxh"
    home.mkdir()
    (home / "vm").symlink_to(elsewhere)
    before = _tree(elsewhere)
    r = _cli(home, "clean")
    assert _tree(elsewhere) == before, r.stdout + r.stderr
    assert r.returncode == 1 and f"refused {home / 'vm'}" in r.stderr, r.stderr


DEEP = """
import os, resource, sys
from pytest_boxlite._homefs import remove_path
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
for i in range(1500):
    os.mkdir("d", dir_fd=fd)
    if i % 100 == 0:
        os.symlink(sys.argv[2], "out", dir_fd=fd)
    nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    fd = nxt
os.close(fd)
remove_path(sys.argv[1])
"""


def test_a_tree_deeper_than_the_descriptor_limit_is_removed(tmp_path: Path) -> None:
    """A guest can leave a tree thousands of levels deep in its box: removing it holds a bounded
    number of descriptors (128 allowed here, 1,500 levels), follows none of its links."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    deep = tmp_path / "deep"
    deep.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", DEEP, str(deep), str(outside)], capture_output=True, text=True, timeout=120, env=_env()
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert not deep.exists() and (outside / "keep").read_text() == "x"


@pytest.mark.escape_row("hostile-home", runtime="host")
def test_ls_images_shows_references_escaped(tmp_path: Path) -> None:
    """An image reference is whatever a project or a user named: printed raw, an OSC 52 in it set
    the terminal's clipboard."""
    from images.build import layer_tar, oci_layout

    from pytest_boxlite.images import ensure_image, store_dir

    layout = oci_layout(tmp_path / "img", [layer_tar([("etc/", "dir", None, 0o755)])])
    home = tmp_path / "bxh"
    ensure_image(f"oci:{layout}", store=store_dir(home), timeout=60)
    # The store refuses such a reference when it is asked for one; a record planted in the home
    # (or written by an older version) is what ``ls`` reads.
    (meta,) = (store_dir(home) / "meta").glob("*.json")
    record = json.loads(meta.read_text())
    record["references"] = ["img\x1b]52;c;ZWNobyBwd25lZA==\x07\u202e"]
    meta.write_text(json.dumps(record))
    r = _cli(home, "ls", "--images")
    assert r.returncode == 0, r.stderr
    assert "1 image(s)" in r.stdout, r.stdout
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout and "\u202e" not in r.stdout, repr(r.stdout)
    assert "img\\x1b]52;c;ZWNobyBwd25lZA==\\x07\\u202e" in r.stdout, r.stdout
