"""The namespace runtime behaves like a throw-away machine, and its bookkeeping holds.

Every test that writes on the host cleans up after itself, including when
isolation is broken and the box's write reached the host.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import BoxFactory, new_box_name
from subruns import TcpServer, host_cleanup, host_netrc, pids_with

from pytest_boxlite import errors
from pytest_boxlite.runtimes import Runtime, _cgroups
from pytest_boxlite.runtimes.namespace import NamespaceRuntime
from pytest_boxlite.runtimes.namespace.box import NamespaceBox
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec

pytestmark = pytest.mark.timeout(60)

PROJECT = Path(__file__).resolve().parents[1]


def unique(prefix: str = "pbx-iso") -> str:
    """A file name no other test (or run) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def py(sb: Sandbox, code: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    """Run Python code in the box; returns (exit code, stdout, stderr) like subprocess does."""
    r = sb.run([sb.handle.guest_python, "-c", textwrap.dedent(code)], timeout=timeout)
    return subprocess.CompletedProcess([], r.exit_code or 0, r.stdout, r.stderr)


# --------------------------------------------------------------------------
# filesystem
# --------------------------------------------------------------------------


ROOT_HOST = os.geteuid() == 0
NON_ROOT_REASON = (
    "on a non-root host the box's root is the host user, and a box maps no other id: it writes where "
    "that user could (overlayfs cannot copy up a directory owned by an unmapped id, even /var/tmp)"
)


@pytest.mark.parametrize("where", ["/etc", "/usr", "/usr/local/bin", "/var/tmp", "project", "home"])
@pytest.mark.escape_row("host-files")
def test_writes_anywhere_succeed_and_stay_in_the_box(make_namespace_box: BoxFactory, where: str) -> None:
    base = {"project": PROJECT, "home": Path.home()}.get(where, Path(where))
    if not ROOT_HOST and not (where == "home" or (where == "project" and os.stat(PROJECT).st_uid == os.geteuid())):
        pytest.skip(NON_ROOT_REASON)
    target = base / unique()
    assert not target.exists()
    with host_cleanup(target):
        sb = make_namespace_box()
        r = sb.execute_command(f"echo from-box > '{target}' && cat '{target}'", timeout=20)
        assert r.ok, r.stderr
        assert r.stdout == "from-box\n"
        helper_target = target.with_name(target.name + "-helper")
        with host_cleanup(helper_target):
            sb.write_file(str(helper_target), "via helper\n")
            assert sb.read_file(str(helper_target)) == "via helper\n"
            assert not helper_target.exists(), f"{helper_target} leaked to the host"
        assert not target.exists(), f"{target} leaked to the host"


@pytest.mark.escape_row("host-files")
def test_changes_to_existing_host_files_stay_in_the_box(make_namespace_box: BoxFactory) -> None:
    # /var/tmp, not the project: a checkout under /tmp is not visible in a box (its /tmp is private).
    # A non-root host's box can copy up only directories the host user owns: use the home there.
    victim = (Path("/var/tmp") if ROOT_HOST else Path.home()) / f".{unique('pbx-victim')}"
    victim.write_text("original\n")
    with host_cleanup(victim):
        sb = make_namespace_box()
        r = sb.execute_command(f"echo changed >> '{victim}' && cat '{victim}'", timeout=20)
        assert r.stdout == "original\nchanged\n"
        assert victim.read_text() == "original\n"
        sb.remove(str(victim))
        assert not sb.exists(str(victim))
        assert victim.read_text() == "original\n"
        # Nothing of it reaches a second, fresh box either.
        other = make_namespace_box()
        assert other.read_file(str(victim)) == "original\n"


@pytest.mark.escape_row("host-files")
def test_tmp_is_private(make_namespace_box: BoxFactory) -> None:
    host_file = Path("/tmp") / unique("pbx-host")
    box_file = Path("/tmp") / unique("pbx-box")
    host_file.write_text("host\n")
    with host_cleanup(host_file, box_file):
        sb = make_namespace_box()
        assert not sb.exists(str(host_file))
        assert sb.execute_command(f"echo box > {box_file} && cat {box_file}", timeout=20).stdout == "box\n"
        assert not box_file.exists()
        listing = sb.execute_command("ls -A /tmp", timeout=20).stdout.split()
        assert box_file.name in listing
        assert host_file.name not in listing


@pytest.mark.escape_row("other-homes")
def test_boxlite_home_is_hidden_from_guests(make_namespace_box: BoxFactory, namespace_runtime: Runtime) -> None:
    a = make_namespace_box()
    b = make_namespace_box()
    home = str(namespace_runtime.home)  # type: ignore[attr-defined]
    assert (Path(home) / "namespace" / f"{a.name}.ctl" / "agent.sock").exists()  # really there on the host
    # The home is either masked by an empty directory or, under the host's /tmp, not there at all.
    assert not b.exists(home) or b.list_dir(home) == []
    assert not b.exists(f"{home}/namespace/{a.name}.ctl/agent.sock")


@pytest.mark.escape_row("sibling-boxes")
def test_two_boxes_do_not_share_files(make_namespace_box: BoxFactory) -> None:
    a = make_namespace_box()
    b = make_namespace_box()
    etc_name = f"/etc/{unique()}"
    with host_cleanup(Path(etc_name)):
        for path in (f"{a.workdir}/mine.txt", "/tmp/mine.txt", etc_name):
            a.write_file(path, "a\n")
            assert a.exists(path)
            assert not b.exists(path), f"box b sees {path} written by box a"
        b.write_file("/tmp/mine.txt", "b\n")
        assert a.read_file("/tmp/mine.txt") == "a\n"


def test_box_survives_deleting_its_workdir(ns_sandbox: Sandbox) -> None:
    sb = ns_sandbox
    workdir = sb.workdir
    r = sb.execute_command(f"cd / && rm -rf {workdir}", timeout=20)
    assert r.ok, r.stderr
    assert sb.handle.alive()
    assert sb.execute_command("echo alive", cwd="/", timeout=20).stdout == "alive\n"
    # Absolute-path file operations and plain commands must keep working.
    assert sb.read_file("/etc/hostname") is not None
    assert sb.execute_command("echo still alive", timeout=20).stdout == "still alive\n"


# --------------------------------------------------------------------------
# processes, hostname, clock
# --------------------------------------------------------------------------


@pytest.mark.escape_row("host-processes")
def test_box_cannot_see_host_processes(ns_sandbox: Sandbox) -> None:
    sb = ns_sandbox
    out = py(
        sb,
        """
        import os
        pids = [p for p in os.listdir('/proc') if p.isdigit()]
        cmds = []
        for p in pids:
            try:
                cmds.append(open('/proc/%s/cmdline' % p, 'rb').read().replace(b'\\0', b' ').decode())
            except OSError:
                pass
        print(len(pids))
        print('\\n'.join(cmds))
        """,
    ).stdout
    count, *cmds = out.splitlines()
    assert int(count) < 10, cmds
    # This very process (the host's pytest) is not visible, under its pid or any other.
    me = Path(f"/proc/{os.getpid()}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    assert me not in cmds
    seen = py(
        sb,
        f"""
        import sys
        try:
            data = open('/proc/{os.getpid()}/cmdline', 'rb').read()
        except OSError:
            data = b''
        sys.stdout.write(data.replace(b'\\0', b' ').decode(errors='replace'))
        """,
    ).stdout
    assert seen != me


@pytest.mark.escape_row("host-processes")
def test_box_cannot_signal_host_processes(ns_sandbox: Sandbox) -> None:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        r = ns_sandbox.execute_command(f"kill -9 {victim.pid}", timeout=20)
        time.sleep(0.1)
        assert victim.poll() is None, "a box killed a host process"
        assert r.exit_code != 0  # no such process in the box's pid namespace
    finally:
        victim.kill()
        victim.wait(10)


@pytest.mark.escape_row("sysctl-hostname-clock")
def test_hostname_is_private(ns_sandbox: Sandbox) -> None:
    host_before = socket.gethostname()
    sb = ns_sandbox
    assert py(sb, "import socket; print(socket.gethostname())").stdout.strip() == sb.name[:63]
    # Guest root holds Docker's default capabilities, which (like Docker) exclude CAP_SYS_ADMIN:
    # the box's name is set by the runtime and stays.
    r = py(sb, "import socket; socket.sethostname('pbx-renamed'); print(socket.gethostname())")
    assert r.returncode != 0
    assert "PermissionError" in r.stderr
    assert sb.read_file("/proc/sys/kernel/hostname").strip() == sb.name[:63]
    assert socket.gethostname() == host_before


@pytest.mark.escape_row("sysctl-hostname-clock")
def test_clock_cannot_be_set(ns_sandbox: Sandbox) -> None:
    before = time.time()
    r = ns_sandbox.execute_command("date -s '2001-01-01 00:00:00'", timeout=20)
    assert r.exit_code != 0
    assert time.time() >= before
    assert time.time() > 1_600_000_000  # host clock not moved to 2001
    year = ns_sandbox.execute_command("date +%Y", timeout=20).stdout.strip()
    assert int(year) > 2001


@pytest.mark.escape_row("lingering-box")
def test_destroying_a_box_kills_its_processes(namespace_runtime: Runtime) -> None:
    marker = unique("pbx-marker")
    handle = namespace_runtime.create_box(BoxSpec(), new_box_name(), timeout=30)
    sb = Sandbox(handle)
    found: list[int] = []
    try:
        spawn = (
            "import subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[1]],"
            " start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        )
        assert sb.run([handle.guest_python, "-c", spawn, marker], timeout=20).ok
        deadline = time.monotonic() + 5
        while not found and time.monotonic() < deadline:
            found = pids_with(marker)
            time.sleep(0.02)
        assert found, "the detached process did not start"
        handle.destroy()
        deadline = time.monotonic() + 5
        while pids_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pids_with(marker) == [], "a box process outlived destroy()"
    finally:
        handle.destroy()
        for pid in pids_with(marker):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------
# network
# --------------------------------------------------------------------------


CONNECT = """
import socket, sys
try:
    s = socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=3)
except OSError as exc:
    print('failed', type(exc).__name__)
    sys.exit(1)
s.sendall(b'hello-from-box')
s.close()
print('connected')
"""


@pytest.mark.escape_row("loopback-off")
def test_network_is_off_by_default(ns_sandbox: Sandbox, tcp_server: TcpServer) -> None:
    r = ns_sandbox.run([ns_sandbox.handle.guest_python, "-c", CONNECT, str(tcp_server.port)], timeout=20)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert r.stdout.startswith("failed")
    time.sleep(0.2)
    assert tcp_server.received == []
    devices = [line.split(":")[0].strip() for line in ns_sandbox.read_file("/proc/net/dev").splitlines()[2:]]
    assert devices == ["lo"]


@pytest.mark.escape_row("loopback-on")
def test_network_can_be_turned_on(make_namespace_box: BoxFactory, tcp_server: TcpServer) -> None:
    sb = make_namespace_box(BoxSpec(network=True))
    r = sb.run([sb.handle.guest_python, "-c", CONNECT, str(tcp_server.port)], timeout=20)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.stdout == "connected\n"
    assert tcp_server.got(b"hello-from-box")
    assert tcp_server.received == [b"hello-from-box"]


# --------------------------------------------------------------------------
# credentials
# --------------------------------------------------------------------------


@pytest.mark.escape_row("home-secrets")
def test_ssh_directory_is_masked(namespace_runtime: Runtime) -> None:
    ssh = Path.home() / ".ssh"
    created = not ssh.exists()
    ssh.mkdir(mode=0o700, exist_ok=True)
    key = ssh / f"{unique('pbx-testkey')}"
    leaked = ssh / f"{unique('pbx-written-in-box')}"
    handle = None
    try:
        key.write_text("SECRET-KEY-MATERIAL\n")
        handle = namespace_runtime.create_box(BoxSpec(), new_box_name(), timeout=30)
        sb = Sandbox(handle)
        # Another user's home (root's, for a non-root host) is not readable here, so not in a box either.
        for guest_ssh in {str(ssh), "/root/.ssh"} if ROOT_HOST else {str(ssh)}:
            assert sb.list_dir(guest_ssh) == [], f"{guest_ssh} is not masked"
            r = sb.execute_command(f"cat {guest_ssh}/{key.name}", timeout=20)
            assert r.exit_code != 0
            assert "SECRET" not in r.stdout
        assert sb.grep(str(ssh), "SECRET-KEY-MATERIAL", timeout=30).items == []
        sb.write_file(str(leaked), "x")
        assert not leaked.exists()
    finally:
        if handle is not None:
            handle.destroy()
        for p in (key, leaked):
            with contextlib.suppress(OSError):
                p.unlink()
        if created:
            with contextlib.suppress(OSError):
                ssh.rmdir()


@pytest.mark.escape_row("home-secrets")
def test_netrc_is_masked(namespace_runtime: Runtime) -> None:
    with host_netrc("SECRET-NETRC") as netrc:
        _netrc_is_masked(namespace_runtime, netrc)


def _netrc_is_masked(namespace_runtime: Runtime, netrc: Path) -> None:
    handle = None
    try:
        handle = namespace_runtime.create_box(BoxSpec(), new_box_name(), timeout=30)
        sb = Sandbox(handle)
        try:
            content = sb.read_file(str(netrc))
        except PermissionError:
            content = ""  # masked by a device node on a nodev mount: unreadable, which also hides it
        assert "SECRET" not in content
        assert "SECRET" not in sb.execute_command(f"cat {netrc}", timeout=20).stdout
    finally:
        if handle is not None:
            handle.destroy()


# --------------------------------------------------------------------------
# runtime bookkeeping
# --------------------------------------------------------------------------


def test_list_boxes_and_remove_box(namespace_runtime: Runtime) -> None:
    rt = namespace_runtime
    a = rt.create_box(BoxSpec(), new_box_name(), timeout=30)
    b = rt.create_box(BoxSpec(), new_box_name(), timeout=30)
    try:
        records = {r.name: r for r in rt.list_boxes()}
        for h in (a, b):
            rec = records[h.name]
            assert rec.state == "running"
            assert rec.runtime == "namespace"
            assert rec.id == h.id
            assert rec.home == str(rt.home)  # type: ignore[attr-defined]
        a.destroy()
        assert a.name not in {r.name for r in rt.list_boxes()}
        rt.remove_box(b.name)
        assert b.name not in {r.name for r in rt.list_boxes()}
        assert not b.alive(timeout=1)
        assert not (rt.home / "namespace" / b.name).exists()  # type: ignore[attr-defined]
        assert _cgroups.find_dirs(b.name) == []
        with pytest.raises(errors.BoxliteError):
            Sandbox(b).execute_command("true", timeout=5)
        rt.remove_box(b.name)  # twice: not an error
        rt.remove_box("pbx-test-never-existed")
    finally:
        a.destroy()
        b.destroy()
        rt.remove_box(b.name)


def test_duplicate_box_name_is_refused(namespace_runtime: Runtime) -> None:
    name = new_box_name()
    a = namespace_runtime.create_box(BoxSpec(), name, timeout=30)
    try:
        with pytest.raises(errors.BoxStartError, match="already exists"):
            namespace_runtime.create_box(BoxSpec(), name, timeout=30)
        assert a.alive()  # the failed attempt must not have torn down the existing box
    finally:
        a.destroy()


def test_destroy_is_idempotent(namespace_runtime: Runtime) -> None:
    h = namespace_runtime.create_box(BoxSpec(), new_box_name(), timeout=30)
    h.destroy()
    h.destroy()
    assert not h.alive()
    with pytest.raises(errors.BoxDeadError):
        h.exec(["true"], timeout=5)


CHILD = """
import sys, time
from pathlib import Path
from pytest_boxlite.runtimes.namespace import NamespaceRuntime
from pytest_boxlite.spec import BoxSpec

rt = NamespaceRuntime(Path(sys.argv[1]))
box = rt.create_box(BoxSpec(), sys.argv[2], timeout=30)
print(box.name, flush=True)
time.sleep(600)
"""


def _readline(proc: subprocess.Popen[bytes], timeout: float) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return ""
        return proc.stdout.readline().decode().strip()


@pytest.mark.escape_row("agent-watchdog")
def test_box_dies_with_its_sigkilled_host_process(tmp_path: Path) -> None:
    rt = NamespaceRuntime(tmp_path)
    name = new_box_name()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), name], stdout=subprocess.PIPE)
    try:
        assert _readline(child, 30) == name
        [rec] = rt.list_boxes()
        assert (rec.name, rec.state) == (name, "running")
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        deadline = time.monotonic() + 10
        while rt.list_boxes()[0].state != "dead" and time.monotonic() < deadline:
            time.sleep(0.05)
        [rec] = rt.list_boxes()
        assert rec.state == "dead", "the box outlived the process that made it"
        rt.remove_box(name)
        assert rt.list_boxes() == []
        assert not (tmp_path / "namespace" / name).exists()
        assert _cgroups.find_dirs(name) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
        rt.remove_box(name)
        rt.close()


@pytest.mark.escape_row("host-files")
def test_template_layers_come_back_in_every_box_and_never_reach_the_host(namespace_runtime: Runtime) -> None:
    """``--boxlite-setup``'s template: built in a box (root in the box), stacked under later boxes."""
    from pytest_boxlite.templates import ensure_template

    rt = namespace_runtime
    assert isinstance(rt, NamespaceRuntime)
    marker = Path.home() / f".{unique('pbx-template')}"
    setup = f"echo provisioned > {marker} && id -u > {marker}.uid"
    with host_cleanup(marker, Path(f"{marker}.uid")):
        spec = ensure_template(rt, BoxSpec(), setup, home=rt.home, cwd=Path("/"), timeout=60, name=new_box_name())
        assert spec.template is not None
        assert not marker.exists(), "the template's write reached the host"
        for _ in range(2):
            box = rt.create_box(spec, new_box_name(), timeout=30)
            try:
                sb = Sandbox(box)
                assert sb.read_file(str(marker)) == "provisioned\n"
                assert sb.read_file(f"{marker}.uid") == "0\n"
                sb.write_file(str(marker), "changed\n")
            finally:
                box.destroy()
        assert not marker.exists()


@pytest.mark.parametrize(
    ("sysctl", "value", "named"),
    [
        ("user.max_user_namespaces", "0", "sysctl -w user.max_user_namespaces="),
        ("kernel.unprivileged_userns_clone", "0", "sysctl -w kernel.unprivileged_userns_clone=1"),
        ("kernel.apparmor_restrict_unprivileged_userns", "1", "AppArmor profile granting `userns,`"),
    ],
)
def test_a_host_forbidding_user_namespaces_is_named_with_its_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sysctl: str, value: str, named: str
) -> None:
    """Fault injection: ``/bin/false`` stands in for a bwrap the policy stops, and the sysctl is read
    from a fake (changing the real one would change the whole machine)."""
    from pytest_boxlite.runtimes.namespace import privileges, runtime

    # Patched where they are read: userns_problem reads the sysctl, the runtime calls userns_problem.
    monkeypatch.setattr(privileges, "_read_sysctl", lambda name: value if name == sysctl else None)
    monkeypatch.setattr(os, "getuid", lambda: 1001)
    problem = privileges.userns_problem.__wrapped__("/bin/false")
    assert problem is not None and named in problem
    monkeypatch.setattr(runtime, "userns_problem", lambda bwrap: problem)
    with pytest.raises(errors.RuntimeUnavailableError, match="namespace boxes need user namespaces"):
        NamespaceRuntime(tmp_path / "home")


def test_a_working_bwrap_reports_no_user_namespace_problem(namespace_runtime: Runtime) -> None:
    from pytest_boxlite.runtimes.namespace import userns_problem

    assert userns_problem(namespace_runtime.bwrap) is None  # type: ignore[attr-defined]


# --------------------------------------------------------------------------
# sandbox boxes forked from a zygote (namespace_runtime runs every test above both ways)
# --------------------------------------------------------------------------


@pytest.fixture
def forked_runtime(runtimes: Any) -> NamespaceRuntime:
    """The namespace runtime with forking on, as a session has it."""
    rt = runtimes.get("namespace-forked")
    assert isinstance(rt, NamespaceRuntime)
    return rt


def _forked(rt: NamespaceRuntime, spec: BoxSpec | None = None) -> NamespaceBox:
    h = rt.create_box(spec or BoxSpec(), new_box_name(), timeout=30)
    assert h.forked_from is not None, f"box {h.name} was booted, not forked (fallback: {rt.fork_fallback})"
    return h


def _steady_plan(rt: NamespaceRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep ``rt``'s zygotes for the test: each spec's plan is the one it had at its first box.

    A zygote is replaced when a box booted now would hide a path it does not, as it would once
    another session of this user on the machine starts with a home of its own (every box hides
    every boxlite home; CI runs two such jobs side by side).  Tests about two boxes of one zygote
    fix the plan so that nothing outside them can give the second box a new zygote."""
    real = rt._fork_plan
    seen: dict[BoxSpec, Any] = {}

    def steady(spec: BoxSpec) -> Any:
        if spec not in seen:
            seen[spec] = real(spec)
        return seen[spec]

    monkeypatch.setattr(rt, "_fork_plan", steady)


def _zygote(rt: NamespaceRuntime, h: NamespaceBox) -> NamespaceBox:
    # A retired one too: another session's home that appeared since replaces the spec's zygote.
    [zygote] = [z for z in (*rt._zygotes._boxes.values(), *rt._zygotes._retired) if z.name == h.forked_from]
    return zygote


@pytest.mark.escape_row("sibling-boxes")
def test_the_next_forked_box_of_a_spec_is_pristine(
    forked_runtime: NamespaceRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What one sandbox writes (in /tmp, /workspace, /dev, $HOME, /etc, a new directory) the next one of the
    same spec, forked from the same zygote, never sees; and the zygote's own files are untouched."""
    _steady_plan(forked_runtime, monkeypatch)
    tag = unique("pbx-pristine")
    first = _forked(forked_runtime)
    try:
        # A non-root host's box writes only where that user could (NON_ROOT_REASON): not /etc.
        dirs = "/tmp /workspace /dev " + ("$HOME /etc /usr/local/bin" if ROOT_HOST else str(Path.home()))
        write = f"for d in {dirs}; do echo {tag} > $d/{tag} || exit 1; done; mkdir /{tag}"
        # A box's /tmp shows the host directories it needs at their paths (a project under /tmp):
        # what a fresh box's /tmp holds is what the first held before it wrote anything.
        fresh_tmp = Sandbox(first).execute_command("ls -A /tmp").stdout.split()
        made = Sandbox(first).execute_command(write)
        assert made.ok, made.stderr
        assert Sandbox(first).execute_command(f"cat /tmp/{tag}").stdout.strip() == tag
        second = _forked(forked_runtime)
        try:
            assert second.forked_from == first.forked_from
            look = f"for d in {dirs} /; do test -e $d/{tag} && echo seen $d; done; true"
            assert Sandbox(second).execute_command(look).stdout == ""
            assert Sandbox(second).execute_command("ls -A /tmp").stdout.split() == fresh_tmp
            assert Sandbox(second).execute_command("ls -A /workspace").stdout.split() == []
            # Its own /dev: what the first wrote is not there, the devices are.
            assert Sandbox(second).execute_command("head -c 4 /dev/zero | wc -c; test -d /dev/pts").stdout == "4\n"
        finally:
            second.destroy()
    finally:
        first.destroy()
    for d in ("/tmp", "/etc", "/usr/local/bin", str(Path.home())):
        assert not (Path(d) / tag).exists(), f"a forked box's write reached the host's {d}"


NAMESPACES = ("user", "mnt", "pid", "net", "uts", "ipc", "cgroup")


def _box_namespaces(h: NamespaceBox) -> dict[str, str]:
    out = Sandbox(h).execute_command(" ".join(f"readlink /proc/self/ns/{n};" for n in NAMESPACES)).stdout.split()
    return dict(zip(NAMESPACES, out, strict=True))


@pytest.mark.skipif(os.geteuid() != 0, reason="reads the zygote's namespaces from the host, which takes root")
@pytest.mark.escape_row("sibling-boxes", users="root")
def test_forked_boxes_have_namespaces_of_their_own(forked_runtime: NamespaceRuntime) -> None:
    """Each forked box is in user, mount, pid, network, uts, ipc and cgroup namespaces of its own:
    not its zygote's, not its sibling's (the network too: the spec has none)."""
    a, b = _forked(forked_runtime), _forked(forked_runtime)
    try:
        zygote = _zygote(forked_runtime, a)
        assert zygote.agent_pid is not None
        of_zygote = {n: os.readlink(f"/proc/{zygote.agent_pid}/ns/{n}") for n in NAMESPACES}
        of_a, of_b = _box_namespaces(a), _box_namespaces(b)
        for n in NAMESPACES:
            assert len({of_zygote[n], of_a[n], of_b[n]}) == 3, (n, of_zygote[n], of_a[n], of_b[n])
        # The box's pid 1 is its agent, and it sees no other process than its own.
        ps = Sandbox(a).execute_command("ls /proc | grep -E '^[0-9]+$'").stdout.split()
        assert "1" in ps and len(ps) <= 4, ps  # the agent, and sh, ls and grep
        assert Sandbox(a).execute_command("hostname").stdout.strip() == a.name
    finally:
        a.destroy()
        b.destroy()


def _cgroup_of(pid: int, controller: str) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (controllers == "" and controller == ""):
            return path
    raise AssertionError(f"pid {pid} has no {controller!r} cgroup")


@pytest.mark.escape_row("lingering-box")
def test_a_forked_box_has_the_cgroup_limits_of_a_booted_one(namespace_runtime: Runtime) -> None:
    """Its own memory and pids cgroups with the spec's limits, which hold: a memory hog is OOM-killed
    (counted by oom_kills, the box lives on), a fork bomb hits the pids cap."""
    spec = BoxSpec(memory_mib=96, pids_limit=40)
    h = namespace_runtime.create_box(spec, new_box_name(), timeout=30)
    try:
        assert isinstance(h, NamespaceBox)
        cg = h._cgroups
        if "memory" not in cg.applied or "pids" not in cg.applied:
            pytest.skip(f"this host cannot apply the limits: {cg.missing}")
        assert h.agent_pid is not None
        for d in cg.dirs:
            tasks = d / "cgroup.procs"
            assert h.agent_pid in {int(p) for p in tasks.read_text().split()}, f"the box's pid 1 is not in {d}"
        hog = "python3 -c 'b = bytearray(400 << 20); b[::4096] = b\"x\" * (400 << 8)' ; echo rc=$?"
        r = Sandbox(h).execute_command(hog, timeout=60)
        assert "rc=137" in r.stdout, r
        assert h.oom_kills() >= 1
        bomb = "for i in $(seq 60); do sleep 5 & done 2>&1 | head -1; wait; echo done"
        r = Sandbox(h).execute_command(bomb, timeout=60)
        # dash says "Cannot fork", bash "Resource temporarily unavailable": EAGAIN from the pids cap.
        assert "Cannot fork" in r.stdout + r.stderr or "Resource temporarily unavailable" in r.stdout + r.stderr, r
        assert Sandbox(h).execute_command("echo alive").stdout.strip() == "alive"
    finally:
        h.destroy()


@pytest.mark.escape_row("lingering-box")
def test_destroying_a_forked_box_kills_everything_in_it_and_nothing_else(forked_runtime: NamespaceRuntime) -> None:
    """Detached and double-forked processes go with the box; its sibling and the zygote live on;
    destroy is idempotent and removes the box's cgroups and directories."""
    marker = unique("pbx-forked-destroy")
    a, b = _forked(forked_runtime), _forked(forked_runtime)
    try:
        detach = f"(setsid sh -c 'sleep 600; echo {marker}' &) ; (setsid sleep 601 &) ; true"
        assert Sandbox(a).execute_command(detach).ok
        assert wait_for(lambda: pids_with(marker), 5), "the detached process did not start"
        name, dirs = a.name, list(a._cgroups.dirs)
        a.destroy()
        a.destroy()
        assert wait_for(lambda: not pids_with(marker), 5), "a box process outlived destroy()"
        assert not a.alive()
        assert all(not d.exists() for d in dirs)
        assert _cgroups.find_dirs(name) == []
        assert not (forked_runtime.state_dir / name).exists()
        assert Sandbox(b).execute_command("echo sibling").stdout.strip() == "sibling"
        assert _zygote(forked_runtime, b).running()
    finally:
        a.destroy()
        b.destroy()


def wait_for(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


@pytest.mark.escape_row("box-log")
def test_a_forked_box_logs_to_its_own_log(forked_runtime: NamespaceRuntime) -> None:
    """log_tail is the box's own: what its commands write there, not its zygote's or a sibling's."""
    a, b = _forked(forked_runtime), _forked(forked_runtime)
    try:
        tag = unique("pbx-log")
        argv = a.attach_argv(["sh", "-c", f"echo {tag} >&2"])
        assert subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=30).returncode == 0
        assert tag in a.log_tail()
        assert tag not in b.log_tail()
        assert tag not in _zygote(forked_runtime, a).log_tail()
        assert a.log_size() > 0
    finally:
        a.destroy()
        b.destroy()


def test_the_zygote_runs_no_command_and_forks_only_boxes(forked_runtime: NamespaceRuntime) -> None:
    """Asked to run a command or the file helper, the zygote refuses; its only children are the
    agents of the boxes forked from it."""
    boxes = [_forked(forked_runtime) for _ in range(2)]
    try:
        zygote = _zygote(forked_runtime, boxes[0])
        for op in ("exec", "helper"):
            with pytest.raises(errors.BoxliteError, match="runs no command"):
                zygote.exec(["touch", "/tmp/zygote-was-here"], timeout=10, op=op)
        assert zygote.alive()
        children = set()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    status = Path(f"/proc/{entry}/status").read_text()
                    if f"\nPPid:\t{zygote.agent_pid}\n" in status:
                        children.add(int(entry))
        assert children <= {b.agent_pid for b in boxes}, children
        assert {b.agent_pid for b in boxes} <= children
    finally:
        for b in boxes:
            b.destroy()


def test_a_forked_box_cannot_be_kept(forked_runtime: NamespaceRuntime) -> None:
    """It ends with its zygote (and so with this process): keeping it is refused, clearly (sessions
    with --boxlite-keep boot their boxes instead)."""
    h = _forked(forked_runtime)
    try:
        with pytest.raises(errors.BoxliteError, match="must be booted"):
            h.keep()
    finally:
        h.destroy()


def test_a_refused_fork_falls_back_to_booting_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the host refuses what a fork needs, boxes of the spec are booted, and the runtime says why."""
    from pytest_boxlite.runtimes.namespace import runtime as runtime_module
    from pytest_boxlite.runtimes.namespace.zygote import ForkRefused

    def refuse(*args: object) -> NamespaceBox:
        raise ForkRefused("clone: [Errno 1] Operation not permitted (simulated)")

    monkeypatch.setattr(runtime_module, "fork_from", refuse)
    rt = NamespaceRuntime(tmp_path)
    try:
        rt.allow_forked_boxes(True)
        h = rt.create_box(BoxSpec(), "pbx-fallback-1", timeout=30)
        try:
            assert h.forked_from is None
            assert Sandbox(h).execute_command("echo booted").stdout.strip() == "booted"
            assert rt.fork_fallback is not None and "Operation not permitted" in rt.fork_fallback
            # The refusal holds for the spec: no zygote is booted again for it.
            h2 = rt.create_box(BoxSpec(), "pbx-fallback-2", timeout=30)
            h2.destroy()
            assert h2.forked_from is None
            assert [r.name for r in rt.list_boxes()] == ["pbx-fallback-1"]
        finally:
            h.destroy()
    finally:
        rt.close()
    assert rt.list_boxes() == []


def test_a_zygote_that_resets_the_conversation_is_a_refused_fork(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A zygote that goes away mid-fork (its end reset with our request unread) is a refused fork:
    the box is booted and the reason recorded, never a raw ConnectionResetError in a test.  The
    fault is injected: the zygote's socket is swapped for one that accepts and closes unread (a
    real zygote cannot be made to die at that instant on demand)."""
    rt = NamespaceRuntime(tmp_path / "home")
    fake = tmp_path / "reset.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(fake))
    server.listen(4)

    def reset_all() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            time.sleep(0.05)  # let the request arrive: closing over unread data resets the peer
            conn.close()

    threading.Thread(target=reset_all, daemon=True).start()
    _steady_plan(rt, monkeypatch)  # else a new zygote (another session's new home) forks it
    try:
        rt.allow_forked_boxes(True)
        first = rt.create_box(BoxSpec(), "pbx-reset-1", timeout=30)
        assert first.forked_from is not None, rt.fork_fallback
        zygote = _zygote(rt, first)
        monkeypatch.setattr(zygote, "sock_path", fake)
        h = rt.create_box(BoxSpec(), "pbx-reset-2", timeout=30)
        try:
            assert h.forked_from is None
            assert Sandbox(h).execute_command("echo booted").stdout.strip() == "booted"
            assert rt.fork_fallback is not None and "ended while" in rt.fork_fallback, rt.fork_fallback
        finally:
            h.destroy()
            first.destroy()
    finally:
        server.close()
        rt.close()
    assert rt.list_boxes() == []


ZYGOTE_CHILD = """
import sys, time
from pathlib import Path
from pytest_boxlite.runtimes.namespace import NamespaceRuntime
from pytest_boxlite.spec import BoxSpec

rt = NamespaceRuntime(Path(sys.argv[1]))
rt.allow_forked_boxes(True)
box = rt.create_box(BoxSpec(), sys.argv[2], timeout=30)
print(box.forked_from, box.agent_pid, flush=True)
time.sleep(600)
"""


@pytest.mark.escape_row("agent-watchdog")
def test_forked_boxes_and_their_zygote_die_with_a_sigkilled_host_and_are_reaped(tmp_path: Path) -> None:
    """kill -9 of the process that forked a box: the box and its zygote end (the watchdog, the
    nested pid namespace), and removing what is left leaves no cgroup, directory or process."""
    rt = NamespaceRuntime(tmp_path)
    name = new_box_name()
    child = subprocess.Popen([sys.executable, "-c", ZYGOTE_CHILD, str(tmp_path), name], stdout=subprocess.PIPE)
    try:
        line = _readline(child, 30).split()
        assert len(line) == 2, line
        zygote_name, agent = line[0], int(line[1])
        assert {r.name: r.state for r in rt.list_boxes()} == {name: "running", zygote_name: "running"}
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert wait_for(lambda: all(r.state == "dead" for r in rt.list_boxes()), 10), rt.list_boxes()
        assert wait_for(lambda: not os.path.exists(f"/proc/{agent}"), 10)
        for rec in rt.list_boxes():
            rt.remove_box(rec.name)
        assert rt.list_boxes() == []
        assert _cgroups.find_dirs(name) == [] and _cgroups.find_dirs(zygote_name) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
        for rec in rt.list_boxes():
            rt.remove_box(rec.name)
        rt.close()


def test_a_box_can_make_a_sandbox_of_its_own(namespace_runtime: Runtime) -> None:
    """A command can make its own user and pid namespaces with a new /proc (unshare --mount-proc), in a
    forked box as in a booted one: the agent keeps a spare, hidden, fully visible procfs for that."""
    h = namespace_runtime.create_box(BoxSpec(), new_box_name(), timeout=30)
    try:
        r = Sandbox(h).execute_command("unshare --user --map-root-user --pid --fork --mount-proc sh -c 'echo $$'")
        assert r.ok and r.stdout.strip() == "1", r
        assert "no spare /proc" not in h.log_tail()
    finally:
        h.destroy()
