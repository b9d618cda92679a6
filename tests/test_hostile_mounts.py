"""Attacks on the mount plan: a host daemon's Unix socket below another mount, a file's device.

Network off (the default) must mean no host socket is reachable from a box, whatever is mounted
where: a directory holding other mounts (docker's and kubelet's under /var, snaps) used to be bound
read-only, and a read-only bind still lets a box ``connect()`` to every socket in it.  The attack
mounts a tmpfs below /var/tmp in a private mount namespace of the sub-run (nobody else's boxes see
it), runs a listener there on the host, and has a boxed test and a sandbox command try it.

A file in a box reports its directory's device (``st_dev``) and ``os.path.ismount()`` is False for
it, as on the host: Send2Trash's ``find_mount_point()`` and ``shutil.move``, ``find -xdev`` rely on it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from subruns import QUIET, host_cleanup, sub_env

pytestmark = pytest.mark.timeout(240)

PROJECT = Path(__file__).resolve().parents[1]

#: What runs on the host inside the sub-run's private mount namespace (root: its own mount
#: namespace; an ordinary user: a user namespace of its own, where it may mount, its id mapped to
#: itself): a tmpfs below /var/tmp, a listener on a socket in it, one connect from the host (the
#: control: the listener works), then the pytest sub-run, its capabilities dropped first.
DRIVER = r"""
import ctypes, os, socket, subprocess, sys, threading
where, log, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
libc = ctypes.CDLL(None, use_errno=True)
if libc.mount(b"pbx-attack", where.encode(), b"tmpfs", 0, b"mode=0777") != 0:
    sys.exit("mount: " + os.strerror(ctypes.get_errno()))
# One socket in the mount below /var/tmp, one beside it, directly in /var/tmp (removed at the end).
paths = [where + "/daemon.sock", where + ".sock"]


def serve(srv):
    while True:
        conn, _ = srv.accept()
        conn.settimeout(5)
        try:
            data = conn.recv(100)
        except OSError:
            data = b"?"
        with open(log, "ab") as fh:
            fh.write(b"connected: " + data + b"\n")
        conn.close()


for path in paths:
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(16)
    threading.Thread(target=serve, args=(srv,), daemon=True).start()
    c = socket.socket(socket.AF_UNIX)
    c.connect(path)
    c.sendall(b"host-control")
    c.close()
import atexit
atexit.register(os.unlink, paths[1])
# Drop what the user namespace gave (bubblewrap refuses to run with capabilities it did not get
# from a setuid bit): children of a non-root id then start with none.
libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
if argv[0] != "runtime":
    sys.exit(subprocess.run(argv, timeout=200).returncode)
# What doctor says of this machine now (its namespace line names the read-only trees).
doctor = subprocess.run([sys.executable, "-m", "pytest_boxlite", "doctor"], capture_output=True, text=True, timeout=120)
print("\n".join(line for line in doctor.stdout.splitlines() if line.startswith(("namespace:", "devices:"))))
# The runtime itself: a booted box, then a box forked from its spec's zygote (a sandbox's).
from pathlib import Path
from pytest_boxlite.runtimes.namespace import NamespaceRuntime
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec
for mode in ("booted", "forked"):
    rt = NamespaceRuntime(Path(argv[1]) / mode)
    rt.allow_forked_boxes(mode == "forked")
    try:
        h = rt.create_box(BoxSpec(), "pbx-attack-" + mode, timeout=60)
        try:
            r = Sandbox(h).run([sys.executable, "-c", argv[2], ",".join(paths), mode], timeout=30)
            for line in r.stdout.splitlines() or ["nothing " + r.stderr.strip()[-500:]]:
                print(mode, line)
        finally:
            h.destroy()
    finally:
        rt.close()
"""

#: Run in a box: connect to each daemon socket (argv 1, comma-separated), send argv 2; says
#: ``refused ERRNO`` or ``CONNECTED`` for each, one line each.
PROBE = """
import socket, sys
for path in sys.argv[1].split(","):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(path)
    except OSError as e:
        print("refused", e.errno)
    else:
        s.sendall(sys.argv[2].encode())
        print("CONNECTED")
"""

ATTACK = """
import errno, os, socket, subprocess, sys

import pytest

SOCK = os.environ["PBX_ATTACK_SOCK"]
PROBE = os.environ["PBX_ATTACK_PROBE"]
NO_DAEMON = {errno.ECONNREFUSED, errno.ENOENT}


@pytest.mark.boxlite
def test_boxed_test_cannot_reach_the_daemon():
    out = subprocess.run([sys.executable, "-c", PROBE, SOCK, "boxed-test"], capture_output=True, text=True, timeout=30)
    print(out.stdout, out.stderr)
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all(line.split()[0] == "refused" for line in lines), out.stdout
    assert all(int(line.split()[1]) in NO_DAEMON for line in lines), out.stdout


def test_sandbox_cannot_reach_the_daemon(boxlite_sandbox):
    r = boxlite_sandbox.execute_command(
        "%s -c %s %s sandbox" % (sys.executable, __import__("shlex").quote(PROBE), SOCK)
    )
    print(r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(line.split()[0] == "refused" for line in lines), r.stdout + r.stderr
    assert all(int(line.split()[1]) in NO_DAEMON for line in lines), r.stdout
"""


def _unshare(root: bool) -> list[str]:
    if root:
        return ["unshare", "--mount", "--propagation", "private", "--"]
    return ["unshare", "--user", "--map-current-user", "--mount", "--propagation", "private", "--keep-caps", "--"]


def _attack(tmp_path: Path, *argv: str) -> tuple[str, str]:
    """Run the driver (a tmpfs below /var/tmp with a listening daemon in it, then ``argv``) in a
    private mount namespace: ``(what the daemon saw, the output)``."""
    root = os.geteuid() == 0
    where = Path("/var/tmp") / f"pbx-attack-{uuid.uuid4().hex[:10]}"
    where.mkdir(mode=0o755)
    log = tmp_path / "daemon.log"
    (tmp_path / "driver.py").write_text(DRIVER)
    env = sub_env(PBX_ATTACK_SOCK=f"{where}/daemon.sock,{where}.sock", PBX_ATTACK_PROBE=PROBE, PYTHONPATH=str(PROJECT))
    try:
        probe = subprocess.run([*_unshare(root), "true"], capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            pytest.skip(
                "cannot make a mount namespace here to mount below /var/tmp "
                f"({probe.stderr.strip()[:200]}): an ordinary user needs unprivileged user namespaces"
            )
        out = subprocess.run(
            [*_unshare(root), sys.executable, str(tmp_path / "driver.py"), str(where), str(log), *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=220,
        )
    finally:
        where.rmdir()  # the tmpfs went with the driver's mount namespace
    return (log.read_text() if log.exists() else ""), out.stdout + out.stderr


@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="an ordinary user can mount below /var/tmp only in a user namespace of its own, where root's "
    "directories (/tmp, /home) show as owned by nobody and a session refuses every boxlite home below "
    "them; the runtime-level attack below checks the rule for that user",
)
@pytest.mark.escape_row("unix-sockets-off")
def test_a_boxed_test_and_a_sandbox_cannot_reach_a_host_socket_below_another_mount(tmp_path: Path) -> None:
    (tmp_path / "test_attack.py").write_text(textwrap.dedent(ATTACK))
    argv = [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={tmp_path / 'bxh'}", "--boxlite", "-v", "-s"]
    seen, text = _attack(tmp_path, *argv)
    # The control connect proves the listener was there; nothing else may have reached it.
    assert seen == "connected: host-control\n" * 2, f"the daemon was reached from a box:\n{seen}\n{text[-3000:]}"
    assert "2 passed" in text, text[-3000:]


@pytest.mark.escape_row("unix-sockets-off")
def test_booted_and_forked_boxes_cannot_reach_a_host_socket_below_another_mount(tmp_path: Path) -> None:
    """The same attack on the runtime itself, for an ordinary user too (whose own user namespace holds
    the mount: locked beneath every box, as a machine's docker or snap mounts are)."""
    seen, text = _attack(tmp_path, "runtime", str(tmp_path / "bxh"), PROBE)
    assert seen == "connected: host-control\n" * 2, f"the daemon was reached from a box:\n{seen}\n{text[-3000:]}"
    # doctor names the directory a box sees read-only, and says its sockets are out of reach.
    namespace = next((line for line in text.splitlines() if line.startswith("namespace:")), "")
    trees = namespace.partition("read-only (other mounts below them): ")[2].split(": ")[0].split(", ")
    assert "/var" in trees, text[-3000:]
    assert "no host socket or FIFO in them reachable" in namespace, namespace
    lines = [line for line in text.splitlines() if line.startswith(("booted ", "forked "))]
    assert [line.split()[:2] for line in lines] == [["booted", "refused"]] * 2 + [["forked", "refused"]] * 2, text[
        -3000:
    ]
    assert all(int(line.split()[2]) in (errno.ECONNREFUSED, errno.ENOENT) for line in lines), text[-3000:]


# --------------------------------------------------------------------------------------------------
# a file's device, as on the host
# --------------------------------------------------------------------------------------------------

DEVICES = """
import os, sys

import pytest

PLACES = [os.environ["PBX_PROJECT_DIR"], os.path.expanduser("~")]


@pytest.mark.boxlite
@pytest.mark.parametrize("where", PLACES)
def test_a_host_file_is_on_its_directory_s_device(where):
    # A host file (this test's own module, a file of the home), and one the box writes there.
    files = [f for f in (os.path.join(where, n) for n in sorted(os.listdir(where))) if os.path.isfile(f)][:3]
    new = os.path.join(where, "pbx-dev-new")
    with open(new, "w") as fh:
        fh.write("x")
    for f in [*files, new]:
        assert os.stat(f).st_dev == os.stat(where).st_dev, f
        assert not os.path.ismount(f), f


def test_a_sandbox_file_is_on_its_directory_s_device(boxlite_sandbox):
    r = boxlite_sandbox.execute_command('touch "$HOME/f" && stat -c %d "$HOME" "$HOME/f" /etc /etc/passwd')
    assert r.exit_code == 0, r.stderr
    dev = r.stdout.split()
    assert dev[0] == dev[1] and dev[2] == dev[3], r.stdout
"""


def test_a_file_reports_its_directory_s_device_in_a_boxed_test_and_a_sandbox(tmp_path: Path) -> None:
    # The project under /tmp (a directory a box shows copy-on-write below its private /tmp), the
    # home a top-level overlay: a host file in each, and one the box writes there.
    project = tmp_path / "proj"
    project.mkdir()
    (project / "test_devices.py").write_text(textwrap.dedent(DEVICES))
    (project / "data.txt").write_text("a host file\n")
    with host_cleanup(Path.home() / "pbx-dev-new"):
        out = subprocess.run(
            [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={tmp_path / 'bxh'}", "--boxlite", "-v"],
            cwd=project,
            env=sub_env(PBX_PROJECT_DIR=str(project), PYTHONPATH=str(PROJECT)),
            capture_output=True,
            text=True,
            timeout=200,
        )
        assert not (Path.home() / "pbx-dev-new").exists(), "a box's write reached the host"
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "3 passed" in text, text[-3000:]
    assert not (project / "pbx-dev-new").exists(), "a box's write reached the host"


def test_a_tree_snapshot_holds_no_socket_fifo_or_credential_and_copies_past_its_overlay_budget(
    tmp_path: Path,
) -> None:
    """The unit under the attacks above, on a real directory: ``points`` (the mount table) is given
    rather than mounted, so that an ordinary user checks the bounds too."""
    import socket

    from pytest_boxlite.runtimes.namespace import mounts

    top = tmp_path / "top"
    (top / "held" / "mnt").mkdir(parents=True)
    for name in ("a", "b", "c"):
        (top / name / "deep").mkdir(parents=True)
        (top / name / "deep" / "f").write_text(name)
    (top / "plain.txt").write_text("plain")
    (top / ".netrc").write_text("machine x password secret")
    (top / "link").symlink_to("plain.txt")
    os.mkfifo(top / "fifo")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(top / "held" / "daemon.sock"))
    try:
        tree = mounts._Tree(frozenset({str(top / ".netrc")}), frozenset())
        budget = [2]  # two overlays: a and b; c is copied whole
        mounts._tree(str(top), str(top), [str(top / "held" / "mnt")], tree, budget)
    finally:
        listener.close()
    items = {rel: (kind, data) for kind, rel, _, _, _, data in tree.items}
    # The budget went to a and b; c, and the mount point past it, are copied.
    assert tree.overlays == [("overlay", str(top / "a")), ("overlay", str(top / "b"))]
    assert items["c/deep/f"] == ("file", b"c") and "a/deep" not in items  # copied vs overlaid
    assert items["plain.txt"] == ("file", b"plain") and items["link"] == ("link", b"plain.txt")
    assert items[".netrc"] == ("file", b"")  # the mask's mount point, empty
    assert "fifo" not in items and "held/daemon.sock" not in items
    assert items["held/mnt"][0] == "dir" and tree.left_out == []
    snapshot = Path(mounts._tree_snapshot(tree.items))
    assert (snapshot / "c" / "deep" / "f").read_text() == "c"
    assert not (snapshot / "fifo").exists() and not (snapshot / "held" / "daemon.sock").exists()


# --------------------------------------------------------------------------------------------------
# a host directory shown in an image's box
# --------------------------------------------------------------------------------------------------

IMAGE_ATTACK = """
import os, subprocess, sys

import pytest


@pytest.mark.boxlite(image={image!r})
def test_in_the_image_the_project_s_daemon_is_out_of_reach():
    out = subprocess.run([sys.executable, "-c", {probe!r}, {sock!r}, "image-box"], capture_output=True, text=True)
    assert out.stdout.split()[:1] == ["refused"], out.stdout + out.stderr
    assert os.path.exists(__file__)  # the project is there all the same
"""


@pytest.mark.escape_row("unix-sockets-off")
@pytest.mark.parametrize("fresh", ["fork", "boot"])
def test_an_image_box_cannot_reach_a_host_socket_in_the_project(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, fresh: str
) -> None:
    """The project inside a directory the image has too (the home: /root, /home) used to be bound
    read-only into the image's box, its sockets with it."""
    import socket
    import threading

    from images.build import ImagesUnavailable, shared_cache, test_images

    try:
        image = test_images(shared_cache(tmp_path_factory))["glibc"]
    except ImagesUnavailable as exc:
        pytest.skip(str(exc))
    project = Path.home() / f"pbx-proj-{uuid.uuid4().hex[:8]}"
    project.mkdir()
    sock = project / "daemon.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock))
    listener.listen(8)
    reached: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    reached.append(conn.recv(100))

    threading.Thread(target=serve, daemon=True).start()
    try:
        (project / "test_image_attack.py").write_text(
            textwrap.dedent(IMAGE_ATTACK.format(image=image, probe=PROBE, sock=str(sock)))
        )
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                *QUIET,
                f"--boxlite-home={tmp_path / 'bxh'}",
                f"--boxlite-fresh={fresh}",
                "-v",
            ],
            cwd=project,
            env=sub_env(PYTHONPATH=str(PROJECT)),
            capture_output=True,
            text=True,
            timeout=200,
        )
    finally:
        listener.close()
        shutil.rmtree(project, ignore_errors=True)
    text = out.stdout + out.stderr
    assert reached == [], f"the project's daemon was reached from an image's box: {reached}\n{text[-3000:]}"
    assert out.returncode == 0 and "1 passed" in text, text[-3000:]
