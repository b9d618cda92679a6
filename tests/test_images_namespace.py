"""Namespace boxes on an image's root filesystem (issue 25, items 1 and 3).

Real boxes, booted and forked (the ``namespace_mode`` fixture), on small images built here from
Debian's ``busybox-static`` (a static busybox, so no C library the host's Python could use) and,
for boxed tests, on an image carrying the host interpreter's own glibc.  Skipped only where
busybox-static is not installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import CREATE_TIMEOUT, new_box_name
from subruns import host_netrc

from pytest_boxlite import errors
from pytest_boxlite.runtimes import Runtime, image_problem
from pytest_boxlite.runtimes.namespace.image import _exe_libs, _host_interpreter, _interpreter_problem
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec, ImageRoot

pytestmark = pytest.mark.timeout(90)

BUSYBOX = shutil.which("busybox") or "/usr/bin/busybox"
OS_RELEASE = 'NAME="Boxlite Test Busybox"\nID=boxlite-busybox\n'
needs_busybox = pytest.mark.skipif(
    not os.path.isfile(BUSYBOX) or b"static" not in subprocess.run(["file", "-L", BUSYBOX], capture_output=True).stdout,
    reason="needs Debian's busybox-static (apt-get install busybox-static)",
)


def busybox_tree(root: Path, os_release: str = OS_RELEASE) -> Path:
    """A minimal root filesystem: a static busybox with its applets as links, an os-release."""
    for d in ("bin", "etc", "root", "home", "usr/bin", "var/tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in ("sh", "cat", "ls", "env", "id", "echo", "touch", "rm", "mkdir", "pwd", "test", "wc", "stat"):
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "os-release").write_text(os_release)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    return root


def image_root(rootfs: Path, ref: str, **config: object) -> ImageRoot:
    digest = "sha256:" + hashlib.sha256(str(rootfs).encode()).hexdigest()
    return ImageRoot(reference=ref, digest=digest, rootfs=str(rootfs), **config)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def busybox(tmp_path_factory: pytest.TempPathFactory) -> ImageRoot:
    """The busybox image's root, with a config (Env, WorkingDir)."""
    tree = busybox_tree(tmp_path_factory.mktemp("busybox-rootfs"))
    (tree / "srv" / "app").mkdir(parents=True)
    return image_root(
        tree, "oci:/images/busybox:test", env=(("IMAGE_VAR", "from-image"), ("SHARED", "image")), workdir="/srv/app"
    )


def boot(rt: Runtime, spec: BoxSpec) -> Sandbox:
    return Sandbox(rt.create_box(spec, new_box_name(), timeout=CREATE_TIMEOUT))


@needs_busybox
def test_a_box_of_an_image_shows_the_image_not_the_host(namespace_runtime: Runtime, busybox: ImageRoot) -> None:
    spec = BoxSpec(image=busybox.reference, root=busybox, mounts=(str(Path(__file__).parent),))
    sb = boot(namespace_runtime, spec)
    try:
        assert sb.execute_command("cat /etc/os-release", timeout=20).stdout == OS_RELEASE
        r = sb.execute_command("busybox echo works; ls /usr/bin | wc -l; test -e /etc/debian_version; echo $?")
        assert r.stdout.split() == ["works", "0", "1"], r
        # The host's interpreter, its libraries and the host's /etc are nowhere at their paths.
        for host_path in (os.path.realpath(sys.executable), "/etc/debian_version", "/lib64/ld-linux-x86-64.so.2"):
            assert sb.execute_command(f"test -e {host_path}; echo $?").stdout.strip() == "1", host_path
        # What the runtime mounts on purpose is there: the directory the spec mounts.
        assert sb.execute_command(f"test -f {__file__}; echo $?").stdout.strip() == "0"
        # The file operations work although the image has no Python (forks of the agent).
        sb.write_bytes("/root/note.txt", b"hello\x00bytes")
        assert sb.read_bytes("/root/note.txt") == b"hello\x00bytes"
        assert sb.execute_command("cat /root/note.txt").stdout == "hello\x00bytes"
    finally:
        sb.handle.destroy()


@needs_busybox
def test_the_image_config_env_and_workdir(namespace_runtime: Runtime, busybox: ImageRoot) -> None:
    spec = BoxSpec(image=busybox.reference, root=busybox, env=(("SHARED", "spec"),))
    sb = boot(namespace_runtime, spec)
    try:
        r = sb.execute_command("echo $IMAGE_VAR $SHARED; pwd", timeout=20)
        assert r.stdout.split() == ["from-image", "spec", "/srv/app"], r
    finally:
        sb.handle.destroy()


@needs_busybox
def test_each_box_of_an_image_is_pristine(namespace_runtime: Runtime, busybox: ImageRoot) -> None:
    spec = BoxSpec(image=busybox.reference, root=busybox)
    before = sorted(str(p.relative_to(busybox.rootfs)) for p in Path(busybox.rootfs).rglob("*"))
    for _ in range(2):
        sb = boot(namespace_runtime, spec)
        try:
            r = sb.execute_command(
                "ls /etc/mark /bin/mark 2>&1; echo x > /etc/mark; rm /bin/cat; echo y > /bin/mark; "
                "echo z > /etc/os-release; mkdir /newtop; cat /etc/os-release",
                timeout=20,
            )
            assert "No such file" in r.stdout and r.stdout.count("No such file") == 2, r
            assert r.stdout.endswith("z\n"), r
        finally:
            sb.handle.destroy()
    # The image's tree itself is never written.
    assert sorted(str(p.relative_to(busybox.rootfs)) for p in Path(busybox.rootfs).rglob("*")) == before
    assert (Path(busybox.rootfs) / "etc" / "os-release").read_text() == OS_RELEASE


@needs_busybox
@pytest.mark.escapes
@pytest.mark.escape_row("home-secrets")
def test_masks_hold_in_a_box_of_an_image(namespace_runtime: Runtime, busybox: ImageRoot) -> None:
    """A host directory the box shows keeps its credentials hidden, as without an image."""
    home = Path.home()
    with host_netrc("SECRET-NETRC") as netrc:
        spec = BoxSpec(image=busybox.reference, root=busybox, mounts=(str(home),))
        sb = boot(namespace_runtime, spec)
        try:
            r = sb.execute_command(f"cat {netrc}; ls -a {home}", timeout=20)
            assert "SECRET" not in r.stdout, r
            assert ".netrc" in r.stdout  # the file is there, empty: a mask, not a missing home
        finally:
            sb.handle.destroy()


def _vanishing_home(rt: Runtime, monkeypatch: pytest.MonkeyPatch, times: int) -> list[list[str]]:
    """Another session's home, registered under this user's home directory, that ends (is
    removed) right after each of the next ``times`` boots made their plan, before bubblewrap lays
    the plan's mask over it.  The fault is injected at that instant (a real session cannot be made
    to end there on demand); the home, its registration and the removal are real.  Returns the
    argument lists the boots planned."""
    from pytest_boxlite.runtimes._homes import register_home

    planned: list[list[str]] = []
    real = rt._bwrap_argv  # type: ignore[attr-defined]

    def plan_then_end(*args: object, **kwargs: object) -> list[str]:
        other = Path.home() / f".pbx-ending-home-{uuid.uuid4().hex[:8]}"
        if len(planned) < times:
            (other / "namespace").mkdir(parents=True)
            register_home(other)
        argv: list[str] = real(*args, **kwargs)
        planned.append(argv)
        shutil.rmtree(other, ignore_errors=True)
        return argv

    monkeypatch.setattr(rt, "_bwrap_argv", plan_then_end)
    return planned


@needs_busybox
def test_a_home_removed_while_a_box_starts_does_not_fail_the_box(
    namespace_runtime: Runtime, busybox: ImageRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A box hides every boxlite home on the machine; one that another session removes after the
    box's plan was made is nothing left to hide, and the boot is tried again with a plan made then.
    CI: two sessions of one user side by side failed image boxes showing the user's home
    ("bwrap: Can't mkdir <home>: Read-only file system")."""
    planned = _vanishing_home(namespace_runtime, monkeypatch, times=1)
    spec = BoxSpec(image=busybox.reference, root=busybox, mounts=(str(Path.home()),), env=(("PBX_VANISH", "1"),))
    sb = boot(namespace_runtime, spec)
    try:
        assert sb.execute_command("echo up", timeout=20).stdout == "up\n"
    finally:
        sb.handle.destroy()
    # The first plan hid the home that then ended: a mount over it, which bubblewrap could not lay.
    # (Another session of this user ending at that moment may cost one more try: CI runs two.)
    assert 2 <= len(planned) <= 3, planned
    assert any(a.startswith(str(Path.home() / ".pbx-ending-home-")) for a in planned[0])
    assert not any(".pbx-ending-home-" in a for a in planned[-1])


@needs_busybox
def test_homes_that_keep_ending_under_a_booting_box_are_a_clear_error_and_no_leak(
    namespace_runtime: Runtime, busybox: ImageRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retries are bounded: a boot whose hidden paths vanish every time fails with the path
    and the count, and leaves no box, directory or cgroup behind."""
    before = {r.name for r in namespace_runtime.list_boxes()}
    planned = _vanishing_home(namespace_runtime, monkeypatch, times=10)
    spec = BoxSpec(image=busybox.reference, root=busybox, mounts=(str(Path.home()),), env=(("PBX_VANISH", "2"),))
    with pytest.raises(errors.BoxStartError, match=r"a path it hides, was removed while it started \(tried 3 times\)"):
        boot(namespace_runtime, spec)
    assert len(planned) == 3
    assert {r.name for r in namespace_runtime.list_boxes()} == before


@needs_busybox
def test_an_image_without_the_loader_cannot_box_tests(busybox: ImageRoot) -> None:
    spec = BoxSpec(image=busybox.reference, root=busybox, warm=True)
    why = image_problem("namespace", spec)
    assert why is not None
    assert busybox.reference in why and os.path.realpath(sys.executable) in why
    assert "no dynamic loader /lib" in why and "glibc >=" in why
    # A sandbox of the same image is fine: its agent runs on the host's loader.
    assert image_problem("namespace", BoxSpec(image=busybox.reference, root=busybox)) is None
    assert image_problem("vm", spec) is None


@needs_busybox
@pytest.mark.escapes
@pytest.mark.escape_row("hostile-image")
def test_links_of_a_hostile_image_are_never_followed_by_the_runtime(namespace_runtime: Runtime, tmp_path: Path) -> None:
    """An image's links where the runtime makes directories or mount points (/workspace, the
    WorkingDir, a host directory's path) would be followed by bubblewrap while it sets the box
    up, where ``/oldroot`` is the host: none is taken, and a mount below one is refused."""
    tree = busybox_tree(tmp_path / "hostile")
    tag = uuid.uuid4().hex[:10]
    escapes = [Path(f"/tmp/pbx-escape-{tag}-{n}") for n in range(3)]
    (tree / "workspace").symlink_to(f"/oldroot{escapes[0]}")
    (tree / "srv").symlink_to(f"/oldroot{escapes[1]}")
    shutil.rmtree(tree / "var")
    (tree / "var").symlink_to(f"/oldroot{escapes[2]}")
    root = image_root(tree, "oci:/images/hostile:test", workdir="/srv/app")
    sb = boot(namespace_runtime, BoxSpec(image=root.reference, root=root))
    try:
        assert sb.execute_command("pwd; echo x > f").stdout == "/workspace\n"
    finally:
        sb.handle.destroy()
    shown = Path("/var/tmp") / f"pbx-host-{tag}"
    shown.mkdir()
    try:
        with pytest.raises(errors.BoxStartError, match="/var is a link in the image"):
            boot(namespace_runtime, BoxSpec(image=root.reference, root=root, mounts=(str(shown),)))
    finally:
        shown.rmdir()
    assert [e for e in escapes if os.path.lexists(e)] == []


@needs_busybox
def test_the_image_config_user_where_the_box_maps_every_id(namespace_runtime: Runtime, tmp_path: Path) -> None:
    """``User`` from the image's own /etc/passwd on a root host (every id mapped); elsewhere only
    the host user is mapped, and commands run as root in the box as without an image."""
    tree = busybox_tree(tmp_path / "user")
    root = image_root(tree, "oci:/images/user:test", user="nobody")
    sb = boot(namespace_runtime, BoxSpec(image=root.reference, root=root))
    try:
        expected = "65534:65534" if os.geteuid() == 0 else "0:0"
        assert sb.execute_command("echo $(id -u):$(id -g)", timeout=20).stdout.strip() == expected
        # An explicit user of the call still wins.
        assert sb.execute_command("id -u", user="root", timeout=20).stdout.strip() == "0"
    finally:
        sb.handle.destroy()


def test_boxed_tests_interpreter_is_shown_at_every_hop_of_its_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A venv's python -> python3 -> /usr/bin/python3 -> python3.11 (Debian's venvs): each link
    outside the venv (which the box shows whole) is bound, not only the file it ends at.
    A unit layer: the interpreter's paths are faked, nothing is run."""
    from pytest_boxlite.runtimes.namespace.image import interpreter_mounts

    venv, system = tmp_path / "venv", tmp_path / "sys" / "bin"
    (venv / "bin").mkdir(parents=True)
    system.mkdir(parents=True)
    (system / "python3.11").write_text("")
    (system / "python3").symlink_to("python3.11")
    (venv / "bin" / "python3").symlink_to(system / "python3")
    (venv / "bin" / "python").symlink_to("python3")
    monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "exec_prefix", str(venv))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    dirs, files = interpreter_mounts()
    assert dirs == [str(venv), str(venv)]
    assert files == [str(system / "python3"), str(system / "python3.11")]


@needs_busybox
def test_an_image_without_env_cannot_box_tests(tmp_path: Path) -> None:
    """The glibc a test's interpreter needs, but no ``env`` to start it through: said before any box."""
    tree = busybox_tree(tmp_path / "noenv")
    (tree / "bin" / "env").unlink()
    _, loader, _, _ = _host_interpreter()
    for path in [loader, *_exe_libs().values()]:
        target = tree / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(path), target)
    root = image_root(tree, "oci:/images/noenv:test")
    why = image_problem("namespace", BoxSpec(image=root.reference, root=root, warm=True))
    assert why is not None and "no env command" in why and root.reference in why, why
    (tree / "bin" / "env").symlink_to("busybox")
    _interpreter_problem.cache_clear()
    assert image_problem("namespace", BoxSpec(image=root.reference, root=root, warm=True)) is None


@needs_busybox
@pytest.mark.escapes
@pytest.mark.escape_row("host-files")
def test_the_agents_kit_is_read_only_and_holds_no_installed_packages(
    namespace_runtime: Runtime, busybox: ImageRoot
) -> None:
    """The host interpreter the agent runs on (under /.boxlite-host): read-only (a box writing
    there would reach the next box forked from the same warm one), its site-packages empty."""
    import sysconfig

    sb = boot(namespace_runtime, BoxSpec(image=busybox.reference, root=busybox))
    try:
        site = "/.boxlite-host" + os.path.realpath(sysconfig.get_paths()["purelib"])
        r = sb.execute_command(f"touch /.boxlite-host/x {site}/x; ls {site} 2>/dev/null | wc -l", timeout=20)
        # Read-only where the stdlib holds site-packages (a pyenv build); absent where it does not (a venv).
        assert "/.boxlite-host/x: Read-only file system" in r.stderr and r.stdout.strip() == "0", r
        assert "site-packages/x: Read-only file system" in r.stderr or "No such file" in r.stderr, r
    finally:
        sb.handle.destroy()


@needs_busybox
def test_a_host_directory_inside_an_image_directory_is_forked_and_pristine(
    namespace_runtime: Runtime, namespace_mode: str, tmp_path: Path
) -> None:
    """A host directory shown inside one of the image's directories (the project under the
    image's /home): sandbox boxes of it are forked, not booted (issue 44 item 6: a fresh overlay
    over the image's directory, with the host's mount beneath it, failed with EINVAL), and each
    is pristine: the image's sub-directories beside it copy-on-write, the way to it read-only,
    the host directory read-only, the WorkingDir made and writable."""
    tree = busybox_tree(tmp_path / "tree")
    (tree / "var" / "tmp" / "beside").mkdir()
    (tree / "var" / "tmp" / "beside" / "f").write_text("image\n")
    (tree / "var" / "tmp" / "top-file").write_text("top\n")
    (tree / "var" / "lib").mkdir()
    root = image_root(tree, "oci:/images/tree:test", workdir="/var/work/app")
    shown = Path("/var/tmp") / f"pbx-host-{uuid.uuid4().hex[:10]}"
    shown.mkdir()
    try:
        (shown / "hello").write_text("host\n")
        spec = BoxSpec(image=root.reference, root=root, mounts=(str(shown),))
        for n in range(2):
            h = namespace_runtime.create_box(spec, new_box_name(), timeout=CREATE_TIMEOUT)
            try:
                if namespace_mode == "forked":
                    fallback = namespace_runtime.fork_fallback
                    assert h.forked_from is not None, f"booted, not forked: {fallback}"  # type: ignore[attr-defined]
                r = Sandbox(h).execute_command(
                    f"cat {shown}/hello /var/tmp/beside/f /var/tmp/top-file; ls /var/tmp/beside; pwd;"
                    f" echo {n} > /var/tmp/beside/new{n} && echo beside-ok; echo x > here && echo wd-ok;"
                    f" echo x > /var/lib/y && echo lib-ok; echo x > {shown}/w 2>/dev/null || echo host-ro",
                    timeout=20,
                )
                assert r.stdout.split() == [
                    "host", "image", "top", "f", "/var/work/app", "beside-ok", "wd-ok", "lib-ok", "host-ro",
                ], r  # fmt: skip
            finally:
                h.destroy()
        assert sorted(os.listdir(shown)) == ["hello"]
        assert sorted(os.listdir(tree / "var" / "tmp" / "beside")) == ["f"]
    finally:
        shutil.rmtree(shown)
