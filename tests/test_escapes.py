"""The escape suite: what a hostile guest tries, as root in the box, must fail and leave the host unchanged.

Each attack of issue 12 (and more) runs from inside a direct box (``Sandbox`` commands, root in the
box) and from inside a boxed test (``@pytest.mark.boxlite``, a forked per-test box, running as the
host user: root when this suite runs as root).  The attacks are one standard-library script,
:data:`ATTACKS`, that reports per attack whether it got through; every test asserts that none did
and then checks the host.  Run alone with ``-m escapes``; the README's escape matrix lists these.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BoxFactory, new_box_name
from subruns import QUIET, process_gone, sub_env, wait_until

from pytest_boxlite import errors, ledger
from pytest_boxlite.runtimes import Runtime
from pytest_boxlite.runtimes.namespace import NamespaceBox, ctl_dir
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec

pytestmark = [pytest.mark.escapes, pytest.mark.timeout(120)]

#: The attacks, run in the guest.  Standard library only; prints one JSON list of
#: ``{"attack", "escaped", "detail"}``.  ``PBX_MASKED_HOME`` and ``PBX_MASKED_CONTENT`` come from the
#: environment (names ``--boxlite-env-deny``'s defaults let through to a boxed test).
ATTACKS = r"""
import ctypes, errno, json, os, socket, struct, sys

libc = ctypes.CDLL(None, use_errno=True)
HOME = os.environ["PBX_MASKED_HOME"]
SECRET = os.environ["PBX_MASKED_CONTENT"]
TOKEN = os.environ.get("PBX_HOST_ONLY_VALUE", "")
# A root boxed test is root of user, mount, uts and network namespaces of its own (nested below
# the runtime's): mounting over things, renaming its host or holding capabilities there is its
# right, and only what reaches the runtime's mounts or the host counts.
OWN_NAMESPACES = os.environ.get("BOX_KIND") == "boxed" and os.geteuid() == 0
HOST_USERNS = int(os.environ.get("HOST_USERNS", "0"))
MNT_DETACH, MS_REMOUNT, MS_BIND, MS_RDONLY = 2, 32, 4096, 1
results = []


def record(name, escaped, detail=""):
    results.append({"attack": name, "escaped": bool(escaped), "detail": str(detail)[:300]})


def umount(path):
    rc = libc.umount2(path.encode(), MNT_DETACH)
    return rc == 0, os.strerror(ctypes.get_errno()) if rc else "unmounted"


def remount_rw(path):
    rc = libc.mount(None, path.encode(), None, MS_REMOUNT | MS_BIND, None)
    return rc == 0, os.strerror(ctypes.get_errno()) if rc else "remounted rw"


def read(path):
    try:
        with open(path, "rb") as fh:
            return fh.read(1 << 20).decode("utf-8", "replace")
    except OSError as exc:
        return "<%s>" % exc.strerror


# 1. masks: the credentials must not be readable, and nothing can be unmounted to reveal them.
for name, path in (("read masked ~/.ssh key", HOME + "/.ssh/id_fake"), ("read masked ~/.npmrc", HOME + "/.npmrc")):
    record(name, SECRET in read(path), read(path)[:80])
for target in (HOME + "/.ssh", HOME + "/.npmrc", HOME, os.path.dirname(HOME), "/sys", "/etc", "/usr",
               "/run/pytest-boxlite", "/proc/sys", "/"):
    ok, why = umount(target)
    record("umount " + target, ok, why)
    if ok:
        record("secret readable after umount " + target, SECRET in read(HOME + "/.ssh/id_fake"))

# 2. remounting the runtime's read-only mounts writable.
for target in ("/sys", "/run/pytest-boxlite", "/sys/fs/cgroup", "/proc/sys"):
    ok, why = remount_rw(target)
    record("remount rw " + target, ok, why)

# 3. new mounts over anything (masks included).
if not OWN_NAMESPACES:
    rc = libc.mount(b"tmpfs", b"/mnt", b"tmpfs", 0, None)
    record("mount a tmpfs", rc == 0, os.strerror(ctypes.get_errno()) if rc else "mounted")
record("runs in the host's user namespace", os.stat("/proc/self/ns/user").st_ino == HOST_USERNS)


# 4. a user namespace of our own: the runtime's mounts are locked beneath it.
def in_new_userns():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        out = []
        try:
            uid, gid = os.geteuid(), os.getegid()
            if libc.unshare(0x10000000 | 0x00020000) != 0:
                out.append(("unshare", False, os.strerror(ctypes.get_errno())))
            else:
                for f, d in (("uid_map", "0 %d 1" % uid), ("setgroups", "deny"), ("gid_map", "0 %d 1" % gid)):
                    with open("/proc/self/" + f, "w") as fh:
                        fh.write(d)
                for target in ("/sys", "/etc", HOME, os.path.dirname(HOME), "/run/pytest-boxlite", "/proc/sys"):
                    ok, why = umount(target)
                    out.append(("userns: umount " + target, ok, why))
                for target in ("/sys", "/run/pytest-boxlite", "/proc/sys"):
                    ok, why = remount_rw(target)
                    out.append(("userns: remount rw " + target, ok, why))
                out.append(("userns: read masked key", SECRET in read(HOME + "/.ssh/id_fake"), ""))
        except BaseException as exc:
            out.append(("userns attack crashed", False, repr(exc)))
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.waitpid(pid, 0)
    for name, escaped, detail in json.loads(data or b"[]"):
        record(name, escaped, detail)


in_new_userns()

# 5. the control directory: nothing the host reads back is there, and nothing can be written.
ctl = "/run/pytest-boxlite"
if os.path.isdir(ctl):
    listing = os.listdir(ctl)
    record("control dir shows host files", any(n in listing for n in ("box.log", "info.json", "agent.sock")), listing)
    for name in ("box.log", "info.json", "planted"):
        try:
            os.symlink(HOME + "/.ssh/id_fake", ctl + "/" + name)
            record("plant a link in the control dir: " + name, True, "created")
        except OSError as exc:
            record("plant a link in the control dir: " + name, False, exc.strerror)
    try:
        with open(ctl + "/big", "wb") as fh:
            fh.write(b"x" * (1 << 20))
        record("write into the control dir", True, "wrote 1 MiB")
    except OSError as exc:
        record("write into the control dir", False, exc.strerror)

# 6. cgroups: leave the box's memory/pids limits.
for path in ("/sys/fs/cgroup/cgroup.procs", "/sys/fs/cgroup/pids/cgroup.procs", "/sys/fs/cgroup/memory/cgroup.procs"):
    if os.path.exists(path):
        try:
            with open(path, "w") as fh:
                fh.write(str(os.getpid()))
            record("move out of the box's cgroup via " + path, True, "written")
        except OSError as exc:
            record("move out of the box's cgroup via " + path, False, exc.strerror)
try:
    with open("/proc/sys/kernel/hostname", "w") as fh:
        fh.write("pbx-pwned")
    record("write a sysctl", True, "written")
except OSError as exc:
    record("write a sysctl", False, exc.strerror)
if not OWN_NAMESPACES:
    try:
        socket.sethostname("pbx-pwned")
        record("sethostname", True, "renamed")
    except OSError as exc:
        record("sethostname", False, exc.strerror)

# 7. the watchdog and the agent: no descriptor of theirs may be opened, no ptrace.  bubblewrap's
# own pid 1 (in a direct box) is the guest's to trace: it holds no capability, only /dev/null, the
# box log (the guest's own stderr) and its own pipes, so it is checked for exactly that.
me = os.getpid()
# A boxed test has a pid namespace of its own: the agent and the warm interpreter are not in it, and
# its low pids are the test's own processes (as an ordinary user, pid 2 is the test that started
# this script).  Attaching to those stops the test itself, which proves nothing: skip the script's
# ancestors there (a root boxed test has no pid 2 at all; in a direct box pid 2 stays a target).
own = set()
if os.environ.get("BOX_KIND") == "boxed":
    p = os.getppid()
    while p > 0 and p not in own:
        own.add(p)
        fields = read("/proc/%d/stat" % p).rsplit(")", 1)[-1].split()
        p = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 0
for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != me]:
    cmd = read("/proc/%s/cmdline" % pid)
    if "bwrap" in cmd:
        st = dict(line.split(":", 1) for line in read("/proc/%s/status" % pid).splitlines() if ":" in line)
        record("bubblewrap's pid %s holds capabilities" % pid, int(st.get("CapEff", "0").strip(), 16), st.get("CapEff"))
        for fd in os.listdir("/proc/%s/fd" % pid) if os.access("/proc/%s/fd" % pid, os.R_OK) else []:
            try:
                link = os.readlink("/proc/%s/fd/%s" % (pid, fd))
            except OSError:
                continue
            allowed = link == "/dev/null" or link.endswith("/box.log") or link.startswith(("pipe:", "anon_inode:"))
            record("bubblewrap's pid %s holds %s" % (pid, link), not allowed)
        continue
    if not (pid == "2" or "agent.py" in cmd) or (int(pid) in own and "agent.py" not in cmd):
        continue
    try:
        fds = os.listdir("/proc/%s/fd" % pid)
    except OSError:
        fds = []
    for fd in fds:
        path = "/proc/%s/fd/%s" % (pid, fd)
        try:
            link = os.readlink(path)
        except OSError:
            link = "?"
        if link == "/dev/null":
            continue
        try:
            wfd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(wfd, b"k")
            finally:
                os.close(wfd)
            record("write into fd %s of pid %s (%s)" % (fd, pid, link), True, "written")
        except OSError as exc:
            record("write into fd %s of pid %s" % (fd, pid), False, exc.strerror)
    PTRACE_ATTACH, PTRACE_DETACH = 16, 17
    if libc.ptrace(PTRACE_ATTACH, int(pid), None, None) == 0:
        libc.ptrace(PTRACE_DETACH, int(pid), None, None)
        record("ptrace pid %s" % pid, True, "attached")
    else:
        record("ptrace pid %s" % pid, False, os.strerror(ctypes.get_errno()))
    if TOKEN:
        record("host secret in /proc/%s/environ" % pid, TOKEN in read("/proc/%s/environ" % pid))

# 8. privileges: no CAP_SYS_ADMIN anywhere in reach, no_new_privs.
status = read("/proc/self/status")
fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
for key in ("CapEff", "CapPrm", "CapBnd", "CapAmb") if not OWN_NAMESPACES else ():
    value = int(fields.get(key, "0").strip(), 16)
    record("CAP_SYS_ADMIN in " + key, value & (1 << 21), hex(value))
    record("CAP_SYS_PTRACE / SYS_MODULE in " + key, value & ((1 << 19) | (1 << 16)), hex(value))
record("no_new_privs off", fields.get("NoNewPrivs", "0").strip() != "1", fields.get("NoNewPrivs"))

# 9. dangerous system calls (seccomp, in the spirit of Docker's default profile).
SECCOMP = os.environ.get("EXPECT_SECCOMP") == "1"
if SECCOMP:
    record("seccomp filter not in force", fields.get("Seccomp", "0").strip() != "2", fields.get("Seccomp"))
    import fcntl
    import termios

    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        fd = None
    if fd is not None:
        try:
            fcntl.ioctl(fd, termios.TIOCSTI, b"x")
            record("ioctl TIOCSTI", True, "injected")
        except OSError as exc:
            record("ioctl TIOCSTI", False, exc.strerror)
        os.close(fd)
    sysno = {"keyctl": 250, "add_key": 248, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
             "kexec_load": 246, "init_module": 175, "finit_module": 313, "open_by_handle_at": 304}
    if os.uname().machine == "x86_64":
        for name, nr in sysno.items():
            ctypes.set_errno(0)
            rc = libc.syscall(nr, 0, 0, 0, 0, 0)
            err = ctypes.get_errno()
            # EPERM from the filter; anything else (EINVAL, EFAULT...) means the kernel saw the call.
            detail = "rc=%d errno=%s" % (rc, errno.errorcode.get(err))
            record("syscall " + name, not (rc == -1 and err == errno.EPERM), detail)

print("ESCAPE-RESULTS " + json.dumps(results))
"""


def parse(output: str) -> list[dict[str, object]]:
    for line in output.splitlines():
        if line.startswith("ESCAPE-RESULTS "):
            results: list[dict[str, object]] = json.loads(line[len("ESCAPE-RESULTS ") :])
            return results
    raise AssertionError(f"the attack script printed no results:\n{output[-4000:]}")


def escaped(results: list[dict[str, object]]) -> list[dict[str, object]]:
    return [r for r in results if r["escaped"]]


class Secrets:
    """A fake home with credentials, visible to boxes at the same path (under /var/tmp)."""

    def __init__(self, root: Path) -> None:
        self.home = root
        self.secret = f"FAKE-SECRET-{uuid.uuid4().hex}"
        self.token = f"FAKE-TOKEN-{uuid.uuid4().hex}"
        (root / ".ssh").mkdir(parents=True)
        (root / ".ssh" / "id_fake").write_text(self.secret + "\n")
        (root / ".npmrc").write_text(f"//registry.example/:_authToken={self.secret}\n")

    def snapshot(self) -> dict[str, str]:
        return {str(p.relative_to(self.home)): p.read_text() for p in sorted(self.home.rglob("*")) if p.is_file()}

    def env(self) -> dict[str, str]:
        return {
            # Not named like credentials: the default --boxlite-env-deny must let these through.
            "PBX_MASKED_HOME": str(self.home),
            "PBX_MASKED_CONTENT": self.secret,
            "PBX_HOST_ONLY_VALUE": self.token,
            "EXPECT_SECCOMP": "1" if seccomp_expected() else "0",
            "HOST_USERNS": str(os.stat("/proc/self/ns/user").st_ino),
        }


def seccomp_expected() -> bool:
    from pytest_boxlite.runtimes.namespace import seccomp_program_fd

    fd = seccomp_program_fd()
    if fd is None:
        return False
    os.close(fd)
    return True


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch) -> Iterator[Secrets]:
    """A fake ``$HOME`` with a key and an npm token, and a secret in the host's environment."""
    root = Path("/var/tmp") / f"pbx-escape-{uuid.uuid4().hex[:10]}"
    s = Secrets(root)
    monkeypatch.setenv("HOME", str(root))
    monkeypatch.setenv("FAKE_SECRET_TOKEN", s.token)
    try:
        yield s
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_attacks(sb: Sandbox, secrets: Secrets) -> list[dict[str, object]]:
    r = sb.run([sys.executable, "-I", "-c", ATTACKS], env={**secrets.env(), "BOX_KIND": "direct"}, timeout=60)
    return parse(r.stdout + "\n" + r.stderr)


@pytest.mark.escape_row(
    "home-secrets",
    "umount",
    "userns",
    "remount",
    "sysctl-hostname-clock",
    "leave-cgroup",
    "control-dir",
    "agent-watchdog",
    "host-environment",
    "seccomp",
)
def test_direct_box_as_root_cannot_undo_its_box(make_namespace_box: BoxFactory, secrets: Secrets) -> None:
    before = secrets.snapshot()
    sb = make_namespace_box()
    assert sb.execute_command("id -u", timeout=20).stdout.strip() == "0"  # root in the box
    results = run_attacks(sb, secrets)
    assert len(results) > 30
    assert escaped(results) == [], json.dumps(escaped(results), indent=1)
    # The host is unchanged: its credentials, its hostname, and the box's private files.
    assert secrets.snapshot() == before
    handle = sb.handle
    assert isinstance(handle, NamespaceBox)
    assert not handle.log_path.is_symlink()
    assert secrets.secret not in handle.log_tail(1 << 20)
    assert json.loads((handle.ctl_dir / "info.json").read_text())["name"] == handle.name
    assert sorted(p.name for p in handle.box_dir.iterdir()) == []


@pytest.mark.escape_row("host-environment")
def test_commands_see_no_host_environment(make_namespace_box: BoxFactory, secrets: Secrets) -> None:
    sb = make_namespace_box()
    env = sb.execute_command("env; cat /proc/1/environ /proc/self/environ", timeout=20).stdout
    assert secrets.token not in env
    assert "FAKE_SECRET_TOKEN" not in env
    assert "PYTEST_CURRENT_TEST" not in env
    passed = sb.execute_command("echo $ONLY_THIS", env={"ONLY_THIS": "given"}, timeout=20).stdout
    assert passed == "given\n"


@pytest.mark.escape_row("download-links")
def test_download_refuses_links_leaving_the_destination(ns_sandbox: Sandbox, tmp_path: Path) -> None:
    sb = ns_sandbox
    outside = tmp_path / "outside"
    outside.mkdir()
    for name, target in (("abs", "/etc/passwd"), ("up", "../../.."), ("sneaky", "sub/../../x")):
        make = f"rm -rf t && mkdir -p t/sub && echo data > t/sub/f && ln -s '{target}' t/{name}"
        sb.execute_command(make, timeout=20)
        dest = tmp_path / f"dest-{name}"
        with pytest.raises(errors.InvalidPathError, match="leaves the destination"):
            sb.download("t", dest)
        assert not dest.exists() or not any(p.is_symlink() for p in dest.rglob("*"))
    assert list(outside.iterdir()) == []
    # Links that stay inside the tree are kept as links.
    sb.execute_command("rm -rf t && mkdir -p t/sub && echo data > t/sub/f && ln -s sub/f t/inside", timeout=20)
    dest = tmp_path / "dest-ok"
    sb.download("t", dest)
    assert (dest / "inside").is_symlink()
    assert os.readlink(dest / "inside") == "sub/f"
    assert (dest / "inside").read_text() == "data\n"


@pytest.mark.escape_row("agent-watchdog")
def test_box_dies_with_its_host_process_whatever_the_guest_does(tmp_path: Path, secrets: Secrets) -> None:
    """A guest that tries to hold the watchdog (writing ``k`` into every descriptor it can open) dies
    with its host process all the same, and cleanup finds it from host-side facts."""
    home = tmp_path / "home"
    script = tmp_path / "hold.py"
    name = new_box_name()
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from pathlib import Path
            from pytest_boxlite.runtimes.namespace import NamespaceRuntime
            from pytest_boxlite.spec import BoxSpec
            rt = NamespaceRuntime(Path({str(home)!r}))
            box = rt.create_box(BoxSpec(), {name!r}, timeout=30)
            attack = (
                "for f in /proc/[0-9]*/fd/*; do (echo k > $f) 2>/dev/null; done; "
                "(setsid sh -c 'sleep 300' &) ; echo attacked"
            )
            r = box.exec(["/bin/sh", "-c", attack], timeout=30)
            print(r.stdout.decode().strip(), flush=True)
            time.sleep(300)
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=sub_env())
    try:
        assert proc.stdout is not None
        # The guest's own stdout is among the descriptors it wrote "k" into: skip those.
        lines = iter(proc.stdout.readline, "")
        assert any(line.strip().endswith("attacked") for line in lines)
        info = json.loads((ctl_dir(home / "namespace" / name) / "info.json").read_text())
        init_pid = info["init_pid"]
        assert not process_gone(init_pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert wait_until(lambda: process_gone(init_pid), timeout=15), "the box outlived its host process"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    ledger.reconcile(home)
    assert ledger.scan(home) == []
    assert not (home / "namespace" / name).exists()


@pytest.mark.escape_row("control-dir")
def test_forged_info_cannot_redirect_cleanup(namespace_runtime: Runtime, tmp_path: Path) -> None:
    """The host's record lives where no guest reaches; a box's own view holds nothing to forge."""
    handle = namespace_runtime.create_box(BoxSpec(), new_box_name(), timeout=30)
    try:
        assert isinstance(handle, NamespaceBox)
        sb = Sandbox(handle)
        r = sb.execute_command('echo \'{"pid": 1, "start_time": "0"}\' > /run/pytest-boxlite/info.json', timeout=20)
        assert r.exit_code != 0
        info = json.loads((handle.ctl_dir / "info.json").read_text())
        assert info["pid"] != 1 and info["init_pid"] > 1
    finally:
        handle.destroy()
    assert not handle.ctl_dir.exists() and not handle.box_dir.exists()


BOXED_ATTACKS = """
import os
import subprocess
import sys

import pytest

ATTACKS = {attacks!r}


@pytest.mark.boxlite
def test_attacks_fail_in_a_boxed_test():
    r = subprocess.run([sys.executable, "-I", "-c", ATTACKS], capture_output=True, text=True, timeout=60)
    assert "ESCAPE-RESULTS " in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    # The host's credential-named variable is held back by the default --boxlite-env-deny.
    assert "FAKE_SECRET_TOKEN" not in os.environ
    results = [x for x in __import__("json").loads(r.stdout.split("ESCAPE-RESULTS ", 1)[1])]
    got_through = [x for x in results if x["escaped"]]
    assert len(results) > 30
    assert got_through == []


@pytest.mark.boxlite
def test_a_writes_the_template_layer():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.umount2(b"/etc", 2) != 0  # the fork's fresh /etc cannot be peeled off
    assert libc.umount2(b"/usr", 2) != 0
    with open("/etc/pbx-escape-marker", "w") as fh:
        fh.write("x")
    if os.geteuid() == 0:  # root of its own namespaces: renaming its machine is its right
        import socket

        socket.sethostname("pbx-boxed-renamed")
        assert socket.gethostname() == "pbx-boxed-renamed"


@pytest.mark.boxlite
def test_b_sees_a_pristine_box():
    assert not os.path.exists("/etc/pbx-escape-marker")
"""


@pytest.mark.escape_row(
    "home-secrets",
    "umount",
    "userns",
    "remount",
    "sysctl-hostname-clock",
    "leave-cgroup",
    "control-dir",
    "agent-watchdog",
    "host-environment",
    "seccomp",
    "sibling-boxes",
)
def test_boxed_test_as_host_user_cannot_undo_its_box(
    pytester: pytest.Pytester, secrets: Secrets, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = pytester.path / "bxh"
    for key, value in {**secrets.env(), "BOX_KIND": "boxed"}.items():
        monkeypatch.setenv(key, value)
    before = secrets.snapshot()
    host_name = socket.gethostname()
    pytester.makepyfile(test_boxed_escapes=BOXED_ATTACKS.format(attacks=ATTACKS))
    env_keys = {**sub_env(), **secrets.env(), "BOX_KIND": "boxed", "HOME": str(secrets.home)}
    for key, value in env_keys.items():
        monkeypatch.setenv(key, value)
    result = pytester.runpytest_subprocess(*QUIET, "--boxlite", f"--boxlite-home={home}", "-v", timeout=180)
    assert result.ret == 0, result.stdout.str()[-6000:]
    result.assert_outcomes(passed=3)
    assert secrets.snapshot() == before
    assert socket.gethostname() == host_name
    assert not Path("/etc/pbx-escape-marker").exists()
    assert ledger.scan(home) == []


def test_boxed_tests_run_as_the_host_user_and_sandboxes_as_root(
    pytester: pytest.Pytester, make_namespace_box: BoxFactory
) -> None:
    sb = make_namespace_box()
    assert sb.execute_command("id -u", timeout=20).stdout.strip() == "0"
    pytester.makepyfile(
        test_identity=f"""
        import os
        import pytest

        @pytest.mark.boxlite
        def test_identity():
            assert (os.getuid(), os.getgid()) == ({os.getuid()}, {os.getgid()})
        """
    )
    home = pytester.path / "bxh"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in sub_env().items():
            mp.setenv(key, value)
        result = pytester.runpytest_subprocess(*QUIET, "--boxlite", f"--boxlite-home={home}", timeout=120)
    assert result.ret == 0, result.stdout.str()[-4000:]
    assert ledger.scan(home) == []


def test_installer_style_work_as_root_in_the_box(make_namespace_box: BoxFactory) -> None:
    """What installers need keeps working: root writes /usr/local, chown, another user via setpriv, port 80."""
    if os.geteuid() != 0:
        pytest.skip("needs a root host: a non-root host maps only its own uid into a box (no chown, no su)")
    sb = make_namespace_box()
    script = textwrap.dedent(
        """
        set -e
        mkdir -p /usr/local/pbx-installer && echo ok > /usr/local/pbx-installer/f
        chown 1001:1001 /usr/local/pbx-installer/f && stat -c %u:%g /usr/local/pbx-installer/f
        setpriv --reuid 1001 --regid 1001 --clear-groups id -u
        python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 80)); print("port 80")'
        """
    )
    r = sb.execute_command(script, timeout=30)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split() == ["1001:1001", "1001", "port", "80"]
    assert not Path("/usr/local/pbx-installer").exists()
    assert sb.run(["id", "-u"], user="1001", timeout=20).stdout.strip() == "1001"


@pytest.mark.escape_row("lingering-box")
def test_no_pid_of_a_box_survives_destroy(make_namespace_box: BoxFactory) -> None:
    sb = make_namespace_box()
    sb.execute_command("(setsid sh -c 'sleep 300' > /dev/null 2>&1 &); true", timeout=20)
    handle = sb.handle
    assert isinstance(handle, NamespaceBox)
    init_pid = json.loads((handle.ctl_dir / "info.json").read_text())["init_pid"]
    handle.destroy()
    assert wait_until(lambda: process_gone(init_pid), timeout=10)
    time.sleep(0.1)
