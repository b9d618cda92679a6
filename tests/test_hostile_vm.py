"""The vm runtime's host side acts only on what is its own (issue 40, items 1 and 2), without a VM.

* The stdio bridge's socket serves only its own user: every Unix socket the host accepts from
  checks its peer with ``SO_PEERCRED`` before a byte flows.  A VM box's bridge
  (:class:`pytest_boxlite.runtimes._vmbridge.VmBridge`) listens at ``<vm home>/bridges/NAME.sock``
  and runs, in the box, whatever command a client asks, on the client's own descriptors.  Its
  directory is the caller's own (mode 0700), but a socket another user reaches (a directory made
  by hand, a umask of 000 on a home left searchable) must still give that user nothing: the
  bridge answered anyone who connected.  A ``ping`` is answered before the box is touched.
* ``clean --templates`` and a session's template lock go through the home's descriptors: a
  ``vm-templates`` link (a project shipping ``.bl-home``) made ``clean --templates`` remove the
  ``*.boxlite`` and ``*.tmp`` files of the link's target and leave ``*.lock`` files there, and a
  ``NAME.lock`` link beside a ``NAME.boxlite`` made it truncate the link's target (``open(.., "w")``).
* The REST runtime's local scratch (``<home>/rest/OWNER``, a session with ``--boxlite-url`` and
  ``ls``/``clean --url``) removes the scratch directories of dead runtimes: through a ``rest``
  link it removed every directory of the link's target holding an unlocked ``.lock``.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import pwd
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from subruns import second_user
from test_hostile_home import _attacker_python

import pytest_boxlite
from pytest_boxlite._homefs import Refused, remove_path
from pytest_boxlite.runtimes import rest, vm
from pytest_boxlite.runtimes._vmbridge import VmBridge

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def bridge(tmp_path: Path) -> Iterator[VmBridge]:
    loop = asyncio.new_event_loop()  # never run: a ping needs no SDK call
    made = VmBridge(object(), loop, tmp_path / "vm" / "bridges" / "pbx-x-1.sock", sys.executable)
    try:
        yield made
    finally:
        made.close()
        loop.close()


def _ping(path: Path) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(str(path))
        got = b""
        try:
            conn.sendall(b'{"op": "ping"}\n')
            while chunk := conn.recv(4096):
                got += chunk
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed unread: what it had sent is all there is
        return got


def test_the_bridge_answers_its_own_user_and_keeps_its_directory_private(bridge: VmBridge) -> None:
    assert _ping(bridge.sock_path) == b'{"pong": 0}\n'
    assert bridge.sock_path.parent.stat().st_mode & 0o077 == 0


def test_a_peer_of_another_uid_gets_no_byte(bridge: VmBridge, monkeypatch: pytest.MonkeyPatch) -> None:
    # This process stands for the other user: the bridge sees its peer's uid differ from its own.
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)
    assert _ping(bridge.sock_path) == b"", "the bridge answered a peer that is not its user"


@pytest.fixture
def shared() -> Iterator[Path]:
    base = Path(f"/tmp/pbx-hostile-bridge-{os.getpid()}-{time.monotonic_ns()}")
    base.mkdir(mode=0o755)
    yield base
    remove_path(base)


def test_another_local_user_reaching_the_socket_gets_no_byte(shared: Path) -> None:
    """A real second user (``useradd``) that can reach the socket: refused before a byte flows."""
    attacker: pwd.struct_passwd = second_user()
    loop = asyncio.new_event_loop()
    made = VmBridge(object(), loop, shared / "bridges" / "pbx-x-1.sock", sys.executable)
    try:
        # As a umask of 000 and a directory made by hand would leave them: reachable by anyone.
        made.sock_path.parent.chmod(0o755)
        made.sock_path.chmod(0o777)
        probe = (
            "import socket, sys\n"
            "c = socket.socket(socket.AF_UNIX); c.settimeout(10); c.connect(sys.argv[1])\n"
            "got = b''\n"
            "try:\n"
            '    c.sendall(b\'{"op": "ping"}\\n\')\n'
            "    while (chunk := c.recv(4096)): got += chunk\n"
            "except (BrokenPipeError, ConnectionResetError): pass\n"
            "print(repr(got))\n"
        )
        r = subprocess.run(
            ["runuser", "-u", attacker.pw_name, "--", _attacker_python(), "-I", "-S", "-c", probe, str(made.sock_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr  # it did connect: the socket was reachable
        assert r.stdout.strip() == "b''", f"another user got an answer: {r.stdout}"
        assert _ping(made.sock_path) == b'{"pong": 0}\n'  # and its own user still does
    finally:
        made.close()
        loop.close()


# --- vm-templates: links planted in a home are never followed ---------------------------------


def _clean_templates(home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_BOXLITE_")}
    env["PYTHONPATH"] = str(Path(pytest_boxlite.__file__).resolve().parent.parent)
    return subprocess.run(
        [sys.executable, "-m", "pytest_boxlite", "--home", str(home), "clean", "--templates"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd="/",
    )


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("app.boxlite", "build.tmp", "secret.txt"):
        (victim / name).write_text(f"precious {name}")
    return victim


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "bxh"
    home.mkdir(mode=0o700)
    return home


@pytest.mark.escape_row("hostile-home", runtime="host")
def test_clean_templates_removes_nothing_through_a_vm_templates_link(tmp_path: Path) -> None:
    victim, home = _victim(tmp_path), _home(tmp_path)
    (home / "vm-templates").symlink_to(victim)
    r = _clean_templates(home)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in victim.iterdir()) == ["app.boxlite", "build.tmp", "secret.txt"], r.stdout
    assert all(p.read_text() == f"precious {p.name}" for p in victim.iterdir())
    assert "dropped 0 template(s)" in r.stdout and "refused" in r.stderr, (r.stdout, r.stderr)


@pytest.mark.escape_row("hostile-home", runtime="host")
def test_clean_templates_truncates_nothing_through_a_lock_link(tmp_path: Path) -> None:
    victim, home = _victim(tmp_path), _home(tmp_path)
    store = home / "vm-templates"
    store.mkdir()
    (store / "evil.boxlite").write_text("x")
    (store / "evil.lock").symlink_to(victim / "secret.txt")
    (store / "other.boxlite").symlink_to(victim / "app.boxlite")
    (store / "honest.boxlite").write_text("x")
    (store / "honest.boxlite.123.tmp").write_text("x")
    r = _clean_templates(home)
    assert r.returncode == 0, r.stderr
    assert all(p.read_text() == f"precious {p.name}" for p in victim.iterdir()), r.stdout
    assert "dropped 1 template(s): honest" in r.stdout, (r.stdout, r.stderr)
    # The honest template and the dead build's leftover went; what was refused stayed, said so.
    assert sorted(p.name for p in store.iterdir()) == ["evil.boxlite", "evil.lock", "honest.lock", "other.boxlite"]
    assert "evil.lock" in r.stderr and "other.boxlite" in r.stderr, r.stderr


def test_a_sessions_template_lock_is_never_opened_through_a_link(tmp_path: Path) -> None:
    victim, home = _victim(tmp_path), _home(tmp_path)
    (home / "vm-templates").symlink_to(victim)
    with pytest.raises(Refused, match="vm-templates"):
        vm._template_lock(home / "vm-templates", "k")
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    (store / "k.lock").symlink_to(victim / "secret.txt")
    with pytest.raises(Refused, match=r"k\.lock"):
        vm._template_lock(store, "k")
    assert not (victim / "k.lock").exists()
    assert all(p.read_text() == f"precious {p.name}" for p in victim.iterdir())
    with vm._template_lock(store, "ok") as lock:  # an honest lock: made, ours, mode 0600
        assert os.fstat(lock.fileno()).st_mode & 0o777 == 0o600


# --- the REST runtime's scratch ----------------------------------------------------------------


@pytest.mark.escape_row("hostile-home", runtime="host")
def test_the_rest_scratch_removes_nothing_through_a_rest_link(tmp_path: Path) -> None:
    home = _home(tmp_path)
    siblings = tmp_path / "siblings"
    (siblings / "checkout" / "src").mkdir(parents=True)
    (siblings / "checkout" / ".lock").write_text("")  # a dead scratch's look: an unlocked .lock
    (siblings / "checkout" / "src" / "main.py").write_text("precious")
    (home / "rest").symlink_to(siblings)
    with pytest.raises(Refused, match="rest"):
        rest._hold_scratch(home / "rest" / "cli-1")
    assert (siblings / "checkout" / "src" / "main.py").read_text() == "precious"
    assert sorted(p.name for p in siblings.iterdir()) == ["checkout"]


def test_the_rest_scratch_removes_dead_siblings_of_its_own_only(tmp_path: Path) -> None:
    home = _home(tmp_path)
    victim = _victim(tmp_path)
    scratches = home / "rest"
    (scratches / "dead").mkdir(parents=True)
    (scratches / "dead" / ".lock").write_text("")
    (scratches / "dead" / "out").symlink_to(victim)  # removed as a link, never followed
    (scratches / "lock-link").mkdir()
    (scratches / "lock-link" / ".lock").symlink_to(victim / "secret.txt")
    (scratches / "dir-link").symlink_to(victim)
    live = scratches / "live"
    live.mkdir()
    held = os.open(live / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        fd = rest._hold_scratch(scratches / "mine")
        os.close(fd)
    finally:
        os.close(held)
    assert sorted(p.name for p in scratches.iterdir()) == ["dir-link", "live", "lock-link", "mine"]
    assert all(p.read_text() == f"precious {p.name}" for p in victim.iterdir())


# --- a vm home is made through no link ---------------------------------------------------------


@pytest.mark.escape_row("hostile-home", runtime="host")
@pytest.mark.parametrize("link", ["vm", "images"])
def test_a_vm_home_is_never_made_through_a_link(tmp_path: Path, link: str) -> None:
    victim, home = _victim(tmp_path), _home(tmp_path)
    (home / link).symlink_to(victim)
    with pytest.raises(Refused, match=link):
        vm.prepare_home(home, "pbx-owner")
    assert sorted(p.name for p in victim.iterdir()) == ["app.boxlite", "build.tmp", "secret.txt"]


def test_a_vm_homes_images_link_must_be_the_homes_own(tmp_path: Path) -> None:
    victim, home = _victim(tmp_path), _home(tmp_path)
    made = vm.prepare_home(home, "pbx-owner")
    assert os.readlink(made / "images") == str(home / "images")
    assert vm.prepare_home(home, "pbx-owner") == made  # again: the same link, kept
    (made / "images").unlink()
    (made / "images").symlink_to(victim)
    with pytest.raises(Refused, match="not to the home's own"):
        vm.prepare_home(home, "pbx-owner")
