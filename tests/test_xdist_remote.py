"""xdist's remote gateways (issue 16): ``-d --tx socket=HOST:PORT`` workers box on their own hosts.

Two "hosts" run on this machine, each an execnet socket server in a network namespace of its own
(its own address on a private bridge made here, 10.213.N.0/24, N picked free), its own UTS namespace
(its own host name), its own ``$HOME``, boxlite home and checkout of the project.  The controller
runs in this machine's namespace and connects to both; every address used is one of the
namespaces made here.  The server is execnet's own ``execnet.script.socketserver`` serving loop,
one forked process per connection (as ``loop_socketserver.py`` restarts one), so that a killed
worker does not take its host down and a replacement worker can connect at once.

Checks: a boxed suite gives the same outcomes on two remote hosts as with two local workers; each
host's boxes live in its home and its summary line names it; a worker killed mid-run leaves no box
on its host after the run (its replacement there reaps it); a controller killed mid-run leaves no
box on either host (the workers reap when their channel closes) and the hosts' next session runs
clean, also on host b, whose server ignores SIGINT (as one started with ``&`` from a script does);
the controller's own home is never created; a box forked for a boxed test ends with that reaping too.

Needs root, ``ip netns`` and ``unshare``: skipped with the reason otherwise.  Every wait is bounded;
servers, namespaces and links are removed by the fixtures' finalizers, also after a failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
import subruns
from subruns import REAL_DATA_HOME, pids_with, process_gone, sub_env, wait_until

from pytest_boxlite import ledger

pytestmark = [pytest.mark.xdist_remote, pytest.mark.timeout(240)]

#: A test host: execnet's socket server, one fresh forked process per connection.
#: argv: ADDR:PORT HOSTNAME [nosigint]; ``nosigint`` starts it with SIGINT ignored, as ``server &`` in
#: a script does: execnet's interruption of a worker whose controller vanished then does nothing.
HOST_SERVER = """
import os, signal, socket, sys
from execnet.gateway_base import get_execmodel
from execnet.script import socketserver

if sys.argv[3:] == ["nosigint"]:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
socket.sethostname(sys.argv[2])  # this process has a UTS namespace of its own (unshare --uts)
socketserver.execmodel = get_execmodel("thread")
sock = socketserver.bind_and_listen(sys.argv[1], socketserver.execmodel)
print("listening", sock.getsockname(), flush=True)
while True:
    pid = os.fork()
    if pid == 0:
        try:
            socketserver.exec_from_one_connection(sock)
        finally:
            sys.stdout.flush()
            os._exit(0)
    os.waitpid(pid, 0)
"""

PORT = 8888
SUMMARY = re.compile(r"boxes booted (?P<booted>\d+), .*leaked (?P<leaked>\d+)")


def host_line(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"^host {name} \((?P<workers>[\w, ]+); runtime=namespace home=(?P<home>\S+)\): boxes booted (?P<booted>\d+), "
        r"leaked (?P<leaked>\d+), kept (?P<kept>\d+)(?:, removed (?P<removed>\d+) leftover box\(es\) of dead "
        r"sessions there)?$",
        re.M,
    )


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=20)


def _quiet(*argv: str) -> None:
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        subprocess.run(argv, capture_output=True, timeout=20)


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces for the test hosts need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (iproute2 / util-linux)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def _free_subnet() -> int:
    """A third octet N such that nothing on this machine uses 10.213.N.0/24 yet."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=20).stdout
    used += subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, timeout=20).stdout
    for _ in range(50):
        n = 100 + secrets.randbelow(150)
        if f"10.213.{n}." not in used:
            return n
    pytest.skip("no free 10.213.N.0/24 subnet for the test hosts")


@dataclasses.dataclass
class Net:
    """The private bridge (this machine's side) and the two namespaces on it."""

    tag: str
    subnet: int
    namespaces: list[str] = dataclasses.field(default_factory=list)
    links: list[str] = dataclasses.field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"pbxbr{self.tag}"

    def add_namespace(self, letter: str, last_octet: int) -> tuple[str, str]:
        ns, outside, inside = f"pbxh{self.tag}{letter}", f"pbxv{self.tag}{letter}", f"pbxn{self.tag}{letter}"
        _run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        self.links.append(outside)
        _run("ip", "link", "set", outside, "master", self.bridge)
        _run("ip", "link", "set", outside, "up")
        _run("ip", "link", "set", inside, "netns", ns)
        addr = f"10.213.{self.subnet}.{last_octet}"
        _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", inside)
        _run("ip", "-n", ns, "link", "set", inside, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        return ns, addr

    def teardown(self) -> None:
        for ns in self.namespaces:
            _quiet("ip", "netns", "del", ns)  # removes the veth end inside it, and so its peer
        for link in self.links:
            _quiet("ip", "link", "del", link)
        _quiet("ip", "link", "del", self.bridge)


@dataclasses.dataclass
class Host:
    """One test host: a socket server in its namespace, with its own HOME, boxlite home and checkouts."""

    name: str
    ns: str
    addr: str
    root: Path
    sigint: bool = True
    proc: subprocess.Popen[bytes] | None = None

    @property
    def home(self) -> Path:
        return self.root / "bxh"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def start(self) -> None:
        (self.root / "home").mkdir(parents=True, exist_ok=True)
        env = sub_env(
            HOME=str(self.root / "home"),
            PYTEST_BOXLITE_HOME=str(self.home),
            # Where the boxlite wheel unpacked bubblewrap: "installed on this host" like the wheel itself.
            XDG_DATA_HOME=REAL_DATA_HOME,
        )
        env.pop("XDG_CACHE_HOME", None)
        argv = ["ip", "netns", "exec", self.ns, "unshare", "--uts", sys.executable, "-c", HOST_SERVER]
        with open(self.log, "ab") as log:
            proc = self.proc = subprocess.Popen(
                [*argv, f"{self.addr}:{PORT}", self.name, *([] if self.sigint else ["nosigint"])],
                cwd=self.root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        up = wait_until(lambda: "listening" in self.log.read_text() or proc.poll() is not None, 30)
        assert up and proc.poll() is None, f"host {self.name} did not start:\n{self.log.read_text()}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the server and the worker it forked
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        if self.home.exists():
            ledger.reconcile(self.home, include_kept=True)

    def checkout(self, project: Path, tag: str) -> Path:
        """This host's own copy of ``project`` (as a checkout on each host would be)."""
        dest = self.root / "src" / tag
        shutil.copytree(project, dest, ignore=shutil.ignore_patterns("*.log", "*.xml", "__pycache__"))
        return dest

    def tx(self, checkout: Path) -> str:
        return f"socket={self.addr}:{PORT}//chdir={checkout}"

    def boxes(self) -> list[ledger.Leftover]:
        return ledger.scan(self.home)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Host]]:
    """Two hosts on a private bridge, for every test of this file; all removed at the end."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    net = Net(tag=secrets.token_hex(3), subnet=_free_subnet())
    made: list[Host] = []
    try:
        try:
            _run("ip", "link", "add", net.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"10.213.{net.subnet}.1/24", "dev", net.bridge)
            _run("ip", "link", "set", net.bridge, "up")
            specs = [("a", 2), ("b", 3)]
            nss = [net.add_namespace(letter, octet) for letter, octet in specs]
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot make network namespaces here: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
        base = tmp_path_factory.mktemp("xr")
        for (letter, _), (ns, addr) in zip(specs, nss, strict=True):
            # Host b ignores SIGINT: its workers must not need execnet's SIGINT to clean up.
            host = Host(name=f"pbxhost{letter}", ns=ns, addr=addr, root=base / letter, sigint=letter == "a")
            made.append(host)
            host.start()
        yield made
    finally:
        for host in made:
            host.stop()
        net.teardown()


class SubRun(subruns.SubRun):
    """A sub-run of this file: on the namespace runtime, with time for two remote workers to start."""

    base_args = ("--boxlite-runtime=namespace",)
    wait_timeout = 180.0


@pytest.fixture
def runs(home: Path) -> Iterator[list[SubRun]]:
    """Sub-runs of a test, killed at teardown if a failure left them running."""
    started: list[SubRun] = []
    yield started
    for s in started:
        s.kill()


def write(directory: Path, name: str, source: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(textwrap.dedent(source))


def outcomes(path: Path) -> dict[str, tuple[str, dict[str, str]]]:
    """Test name -> (outcome, recorded properties) from a junit file."""
    out = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        tags = {c.tag for c in tc}
        outcome = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        props = {p.get("name", ""): p.get("value", "") for p in tc.iter("property")}
        out[tc.get("name", "")] = (outcome, props)
    return out


def remote_args(hosts: list[Host], project: Path, tag: str) -> list[str]:
    args = ["-d"]
    for h in hosts:
        args += ["--tx", h.tx(h.checkout(project, tag))]
    return args


def untouched(controller_home: Path, output: str) -> None:
    assert not controller_home.exists(), (
        f"the controller's home was touched: {list(controller_home.rglob('*'))}\n" + (output[-3000:])
    )


# --------------------------------------------------------------------------
# 1. the same outcomes as two local workers; each host's boxes in its own home

SUITE = """
import os, socket
from pathlib import Path
import pytest


def where(record_property):
    record_property("pbx_host", socket.gethostname())


@pytest.mark.boxlite
@pytest.mark.parametrize("i", range(3))
def test_boxed(i):
    assert os.environ.get("PYTEST_BOXLITE_GUEST") == "1"
    assert socket.gethostname().startswith("pbx-")


@pytest.mark.parametrize("i", range(4))
def test_sandbox(i, boxlite_sandbox, record_property):
    where(record_property)
    record_property("pbx_box", boxlite_sandbox.name)
    home = os.environ.get("PYTEST_BOXLITE_HOME")
    # The box lives in this host's home (unset on the controller's machine: the local run).
    record_property("pbx_box_in_home", str(bool(home) and (Path(home) / "namespace" / boxlite_sandbox.name).is_dir()))
    r = boxlite_sandbox.run(["sh", "-c", "echo $((6 * 7))"])
    assert r.ok and r.stdout.strip() == "42", r


@pytest.mark.boxlite
def test_boxed_fails():
    assert 1 + 1 == 3


def test_plain_skips():
    pytest.skip("meant to skip")


@pytest.mark.xfail(reason="meant to fail", strict=True)
def test_plain_xfails():
    assert False
"""


def test_two_socket_hosts_give_the_local_outcomes_and_box_in_their_own_homes(
    tmp_path: Path, home: Path, hosts: list[Host], runs: list[SubRun]
) -> None:
    proj = tmp_path / "proj"
    write(proj, "test_suite.py", SUITE)

    local = SubRun(proj, tmp_path / "local-bxh", "local", "-n", "2", f"--junitxml={tmp_path / 'local.xml'}")
    runs.append(local)
    assert local.wait() == pytest.ExitCode.TESTS_FAILED, local.output

    remote = SubRun(proj, home, "remote", *remote_args(hosts, proj, "same"), f"--junitxml={tmp_path / 'remote.xml'}")
    runs.append(remote)
    rc = remote.wait()
    out = remote.output
    assert rc == pytest.ExitCode.TESTS_FAILED, out

    here, there = outcomes(tmp_path / "local.xml"), outcomes(tmp_path / "remote.xml")
    assert len(here) == 10, here
    assert {n: o for n, (o, _) in there.items()} == {n: o for n, (o, _) in here.items()}, (here, there, out)
    assert re.search(r"\b1 failed, 7 passed, 1 skipped, 1 xfailed\b", out), out

    # Sandbox tests ran on the socket hosts, each in a box of its own home; none ran on the
    # controller's machine.  (Which host gets them is xdist's load scheduling: under load one host's
    # worker can take them all, so only "on these hosts" is checked.)
    ran_on = {p["pbx_host"] for o, p in there.values() if "pbx_host" in p}
    assert ran_on and ran_on <= {"pbxhosta", "pbxhostb"}, there
    assert all(p["pbx_box_in_home"] == "True" for _, p in there.values() if "pbx_box" in p), there

    # One line per host, with the host's own name and home; the total adds them up.
    booted = 0
    for h in hosts:
        m = host_line(h.name).search(out)
        assert m, out
        assert m["home"] == str(h.home) and m["leaked"] == "0" and m["kept"] == "0", m.group(0)
        assert int(m["booted"]) >= 1, m.group(0)
        booted += int(m["booted"])
        assert h.boxes() == [], f"boxes left on {h.name}: {h.boxes()}"
    total = SUMMARY.search(out)
    assert total and int(total["booted"]) == booted and total["leaked"] == "0", out
    assert "nothing runs in this machine's home" in out, out
    untouched(home, out)


# --------------------------------------------------------------------------
# 2. a worker killed mid-run: its replacement on that host reaps what it left

KILLED_WORKER = """
import os, socket, time
from pathlib import Path
import pytest


def test_hold(boxlite_sandbox):
    boxlite_sandbox.write_file("/workspace/x", "y")
    Path({pidfile!r}).write_text(f"{{socket.gethostname()}} {{os.getpid()}}")
    time.sleep(150)


@pytest.mark.parametrize("i", range(6))
def test_after(i, boxlite_sandbox):
    assert boxlite_sandbox.run(["true"]).ok
"""


def test_worker_killed_mid_run_leaves_no_box_on_its_host(
    tmp_path: Path, home: Path, hosts: list[Host], runs: list[SubRun]
) -> None:
    proj = tmp_path / "proj"
    pidfile = tmp_path / "victim.pid"
    # Remote workers do not see the controller's environment: the path is in the source.
    write(proj, "test_kill.py", KILLED_WORKER.format(pidfile=str(pidfile)))
    run = SubRun(
        proj,
        home,
        "kill-worker",
        *remote_args(hosts, proj, "killw"),
        "--max-worker-restart=1",
    )
    runs.append(run)
    assert wait_until(
        lambda: (pidfile.exists() and len(pidfile.read_text().split()) == 2) or run.proc.poll() is not None, 150
    )
    assert run.proc.poll() is None, run.output
    host_name, pid = pidfile.read_text().split()
    victim_host = next(h for h in hosts if h.name == host_name)
    held = [b.name for b in victim_host.boxes() if b.owner_alive]
    assert held, f"the worker on {host_name} holds no box"
    os.kill(int(pid), signal.SIGKILL)

    rc = run.wait()
    out = run.output
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert re.search(r"\b1 failed, 6 passed\b", out), out
    assert re.search(r"worker '?gw\d'? crashed while running '?test_kill.py::test_hold'?", out), out
    assert process_gone(int(pid))
    # The crashed worker never reported: the controller says so, naming its gateway.
    assert re.search(
        rf"worker gw\d \(socket={re.escape(victim_host.addr)}:{PORT}\S*\) went down without reporting", out
    ), out
    # Its replacement on the same host removed its boxes, at its start or its end.
    m = host_line(host_name).search(out)
    assert m, out
    assert int(m["removed"] or 0) + int(m["leaked"]) >= len(held), (held, m.group(0))
    for h in hosts:
        assert h.boxes() == [], f"boxes left on {h.name}: {h.boxes()}\n{out[-3000:]}"
    untouched(home, out)


# --------------------------------------------------------------------------
# 3. the controller killed mid-run: the workers reap their boxes; the next session is clean

KILLED_CONTROLLER = """
import os, socket, time
from pathlib import Path
import pytest


@pytest.mark.parametrize("i", range(2))
def test_hold(i, boxlite_sandbox):
    boxlite_sandbox.write_file("/workspace/x", "y")
    Path({pids!r}, socket.gethostname()).write_text(str(os.getpid()))
    time.sleep(150)
"""

NEXT = """
import pytest


@pytest.mark.boxlite
@pytest.mark.parametrize("i", range(2))
def test_next(i):
    pass
"""


def test_controller_killed_mid_run_workers_reap_their_boxes(
    tmp_path: Path, home: Path, hosts: list[Host], runs: list[SubRun]
) -> None:
    proj = tmp_path / "proj"
    pids = tmp_path / "pids"
    pids.mkdir()
    write(proj, "test_hold.py", KILLED_CONTROLLER.format(pids=str(pids)))
    run = SubRun(proj, home, "kill-controller", *remote_args(hosts, proj, "killc"))
    runs.append(run)
    names = {h.name for h in hosts}
    assert wait_until(lambda: {p.name for p in pids.iterdir()} == names or run.proc.poll() is not None, 150)
    assert run.proc.poll() is None, run.output
    assert wait_until(lambda: all(p.read_text() for p in pids.iterdir()), 5)
    workers = {p.name: int(p.read_text()) for p in pids.iterdir()}
    for h in hosts:
        assert any(b.owner_alive for b in h.boxes()), f"no box held on {h.name}"
        # The worker switched TCP keepalive on: a controller whose machine vanishes silently is noticed too.
        ss = subprocess.run(
            ["ip", "netns", "exec", h.ns, "ss", "-tnoH", "state", "established", f"( sport = :{PORT} )"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
        assert "keepalive" in ss, f"no TCP keepalive on the worker's connection on {h.name}: {ss!r}"

    run.proc.kill()  # SIGKILL: the controller gets no chance to say anything
    run.wait(30)
    # The workers see their channel close and reap at once (execnet ends them 15 s later); on host b,
    # which ignores SIGINT, that is the only way: execnet's interruption of its main thread does nothing.
    for h in hosts:
        assert wait_until(lambda: h.boxes() == [], 30), f"boxes left on {h.name}: {h.boxes()}"  # noqa: B023
    for name, pid in workers.items():
        assert wait_until(lambda: process_gone(pid), 40), f"the worker on {name} outlived its controller"  # noqa: B023

    # The next session on both hosts runs and leaves nothing behind.
    write(proj, "test_next.py", NEXT)
    (proj / "test_hold.py").unlink()
    after = SubRun(proj, home, "next", *remote_args(hosts, proj, "next"))
    runs.append(after)
    assert after.wait() == 0, after.output
    assert re.search(r"\b2 passed\b", after.output), after.output
    for h in hosts:
        assert h.boxes() == [], f"boxes left on {h.name}: {h.boxes()}"
    untouched(home, run.output + after.output)


FORKED_HOLD = """
import subprocess, sys, time
import pytest


@pytest.mark.boxlite
def test_hold_boxed():
    # In a box forked for this test (its writes stay there): a process tagged for the host to see.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(150)", {tag!r}])
    time.sleep(150)
"""


def test_controller_killed_during_a_forked_test_leaves_no_process(
    tmp_path: Path, home: Path, hosts: list[Host], runs: list[SubRun]
) -> None:
    proj = tmp_path / "proj"
    tag = f"pbx-xremote-{secrets.token_hex(8)}"
    write(proj, "test_forked.py", FORKED_HOLD.format(tag=tag))
    host = hosts[1]  # its server ignores SIGINT: only the worker's own reaping can act
    run = SubRun(proj, home, "kill-forked", "-d", "--tx", host.tx(host.checkout(proj, "killf")))
    runs.append(run)
    try:
        assert wait_until(lambda: bool(pids_with(tag)) or run.proc.poll() is not None, 150)
        assert run.proc.poll() is None, run.output
        run.proc.kill()
        run.wait(30)
        assert wait_until(lambda: host.boxes() == [], 30), f"boxes left on {host.name}: {host.boxes()}"
        assert wait_until(lambda: not pids_with(tag), 30), "a process of the forked test outlived the worker's reaping"
    finally:
        for pid in pids_with(tag):  # this test's own processes, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    untouched(home, run.output)


# --------------------------------------------------------------------------
# 4. --boxlite-scope=worker cannot box a remote worker: a usage error that says what to do


def test_worker_scope_with_a_remote_spec_is_a_usage_error(tmp_path: Path, home: Path) -> None:
    """No host needed: the controller refuses before it connects anywhere (loopback, were it to try)."""
    proj = tmp_path / "proj"
    write(proj, "test_x.py", "def test_x():\n    pass\n")
    run = SubRun(proj, home, "scope", "--boxlite-scope=worker", "--tx", "2*popen", "--tx", "socket=127.0.0.1:9", "-d")
    rc = run.wait(60)
    out = run.output
    assert rc == pytest.ExitCode.USAGE_ERROR, out
    assert "--boxlite-scope=worker boxes local popen workers only" in out, out
    assert "'socket=127.0.0.1:9'" in out and "--boxlite-scope=test or module" in out, out
