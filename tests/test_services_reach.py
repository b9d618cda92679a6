"""Boxed tests reach services (issue 24, item 3: "Boxed tests reach services too").

A service's host address (``127.0.0.1:<port>``) is made reachable at the same address inside a
boxed test's box, whose network is off (:mod:`pytest_boxlite.reach`).  Everything here is real:
real boxes (booted, forked per test, per module, ``-n 2``), real pytest sub-runs, the real helper
that listens in a box's network and the real relay.  The one stand-in: the sub-runs' conftest
replaces ``services.descriptions_for`` (the service fixtures' host side) with a
description of a host echo server the conftest started, so these tests do not depend on how the
fixtures start their servers; the examples (``examples/test_services.py``) use the real fixture.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from subruns import QUIET, process_gone, sub_env, wait_until

from pytest_boxlite import reach
from pytest_boxlite.errors import ConfigError
from pytest_boxlite.sandbox import Sandbox


class Echo:
    """A host TCP server that echoes, and counts what it saw (connections, at most at once)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.connections = 0
        self.active = 0
        self.peak = 0
        self.received = bytearray()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                self.active += 1
                self.peak = max(self.peak, self.active)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                while data := conn.recv(65536):
                    with self.lock:
                        if len(self.received) < 1 << 20:
                            self.received += data
                    conn.sendall(data)
        except OSError:
            pass
        finally:
            with self.lock:
                self.active -= 1

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def echo() -> Iterator[Echo]:
    server = Echo()
    yield server
    server.close()


def _box_python(sb: Sandbox, code: str, *args: str, timeout: float = 60) -> str:
    sb.write_file("client.py", code)
    r = sb.run([sys.executable, "client.py", *args], timeout=timeout)
    assert r.ok, r.stderr
    return r.stdout


def _offer_into(sb: Sandbox, port: int) -> reach.Offer:
    agent = getattr(sb.handle, "agent_pid", None)
    if agent is None:
        pytest.skip("the box's processes are not this host's (not a namespace box)")
    [offer] = reach.prepare_booted(sb.name, agent, [("127.0.0.1", port)])
    return offer


ROUND_TRIP = r"""
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=20)
s.sendall(b"ping from the box")
print(s.recv(100).decode())
"""


def test_a_box_reaches_a_host_service_at_the_same_address(boxlite_sandbox: Sandbox, echo: Echo) -> None:
    offer = _offer_into(boxlite_sandbox, echo.port)
    assert _box_python(boxlite_sandbox, ROUND_TRIP, str(echo.port)).strip() == "ping from the box"
    assert offer.relayed == 1
    # The box's own network is still off: the host's other ports are not there.
    other = socket.create_server(("127.0.0.1", 0))
    with other:
        out = _box_python(
            boxlite_sandbox,
            "import socket,sys\ntry:\n socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5)\n"
            " print('reached')\nexcept OSError as e:\n print(type(e).__name__)\n",
            str(other.getsockname()[1]),
        )
        assert out.strip() == "ConnectionRefusedError"


def test_several_addresses_are_offered_at_once(boxlite_sandbox: Sandbox) -> None:
    servers = [Echo() for _ in range(3)]
    try:
        agent = getattr(boxlite_sandbox.handle, "agent_pid", None)
        if agent is None:
            pytest.skip("the box's processes are not this host's (not a namespace box)")
        offers = reach.prepare_booted(boxlite_sandbox.name, agent, [("127.0.0.1", e.port) for e in servers])
        assert [o.target[1] for o in offers] == [e.port for e in servers]
        for e in servers:
            assert _box_python(boxlite_sandbox, ROUND_TRIP, str(e.port)).strip() == "ping from the box"
            assert e.connections == 1
    finally:
        for e in servers:
            e.close()


ESCAPE = r"""
import os, socket, sys
port, canary = int(sys.argv[1]), int(sys.argv[2])
# Root of its box, knowing the relay's source: ask it, in every way a proxy could be asked, to
# connect somewhere else, and try to reach the host's other port directly.
asks = [
    b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (canary, canary),
    b"GET http://127.0.0.1:%d/ HTTP/1.1\r\n\r\n" % canary,
    b"\x05\x01\x00\x05\x01\x00\x01\x7f\x00\x00\x01" + canary.to_bytes(2, "big"),  # SOCKS5
    b"\x04\x01" + canary.to_bytes(2, "big") + b"\x7f\x00\x00\x01\x00",  # SOCKS4
    b'{"op": "connect", "port": %d}\n' % canary,
]
for ask in asks:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(ask)
    got = b""
    while len(got) < len(ask):
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    assert got == ask, (ask, got)  # echoed by the service itself: the bytes went there, as bytes
    s.close()
# The listener is the host's: closing ours, rebinding the port, or listening beside it changes
# nothing on the host (this box is its own network).
try:
    socket.create_server(("127.0.0.1", port))
    print("rebound")
except OSError:
    print("in use")
try:
    socket.create_connection(("127.0.0.1", canary), timeout=5)
    print("canary reached")
except OSError:
    print("canary refused")
"""


@pytest.mark.escapes
@pytest.mark.escape_row("service-relay")
def test_the_box_cannot_make_the_relay_connect_anywhere_else(boxlite_sandbox: Sandbox, echo: Echo) -> None:
    canary = socket.create_server(("127.0.0.1", 0))
    canary.settimeout(0.5)
    with canary:
        offer = _offer_into(boxlite_sandbox, echo.port)
        out = _box_python(boxlite_sandbox, ESCAPE, str(echo.port), str(canary.getsockname()[1]))
        assert out.split() == ["in", "use", "canary", "refused"]
        with pytest.raises(TimeoutError):
            canary.accept()  # the host never connected to the other port
    assert offer.target == ("127.0.0.1", echo.port)
    assert echo.connections == 5 and offer.relayed == 5


FLOOD = r"""
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
socks = []
for _ in range(n):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    socks.append(s)
alive = 0
for s in socks:
    s.settimeout(10)
    try:
        s.sendall(b"x")
        alive += s.recv(1) == b"x"
    except OSError:
        pass
print(alive)
for s in socks:
    s.close()
# The relay takes new connections again once those are gone.
time.sleep(0.5)
s = socket.create_connection(("127.0.0.1", port), timeout=10)
s.sendall(b"again")
print(s.recv(10).decode())
"""


@pytest.mark.reliability
@pytest.mark.escape_row("service-relay")
def test_a_flood_of_connections_from_the_box_is_bounded(boxlite_sandbox: Sandbox, echo: Echo) -> None:
    offer = _offer_into(boxlite_sandbox, echo.port)
    n = reach.MAX_CONNECTIONS * 4
    alive, again = _box_python(boxlite_sandbox, FLOOD, str(echo.port), str(n), timeout=120).split()
    assert int(alive) == reach.MAX_CONNECTIONS
    assert again == "again"
    assert echo.peak <= reach.MAX_CONNECTIONS
    assert offer.refused >= n - reach.MAX_CONNECTIONS


@pytest.mark.escape_row("service-relay")
def test_the_offer_ends_with_its_box(boxlite_pool, echo: Echo) -> None:  # type: ignore[no-untyped-def]
    with boxlite_pool.sandbox() as sb:
        offer = _offer_into(sb, echo.port)
        assert _box_python(sb, ROUND_TRIP, str(echo.port)).strip() == "ping from the box"
    assert wait_until(lambda: offer.closed, timeout=10), "the offer outlived its box"
    assert not any(t.name.startswith(f"boxlite-reach-{sb.name}-") for t in threading.enumerate())


def test_bad_targets_are_refused(boxlite_sandbox: Sandbox) -> None:
    with pytest.raises(ConfigError, match=r"only services on 127\.0\.0\.1"):
        reach.prepare_booted(boxlite_sandbox.name, os.getpid(), [("10.0.0.1", 80)])
    with pytest.raises(reach.ReachError, match="not processes of this host"):
        reach.prepare_booted("a-vm", None, [("127.0.0.1", 80)])
    # A box whose first process ended (a zombie, not yet reaped): gone, which the runner leaves to
    # the box's own end to report.
    ended = subprocess.Popen(["true"])
    assert wait_until(lambda: Path(f"/proc/{ended.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z")
    with pytest.raises(reach.BoxGone):
        reach.prepare_booted("gone", ended.pid, [("127.0.0.1", 80)])
    ended.wait()
    assert reach.targets_of({"a": {"ports": {"1": ["10.0.0.1", 5]}}, "b": {"ports": {"2": ["127.0.0.1", True]}}}) == []
    assert reach.targets_of({"a": {"ports": {"6379": ["127.0.0.1", 4242]}}, "b": "junk"}) == [("127.0.0.1", 4242)]


# -- boxed tests in real sub-runs --------------------------------------------------------------

CONFTEST = r"""
import os, socket, threading

import pytest

from pytest_boxlite import services


def _echo():
    srv = socket.create_server(("127.0.0.1", 0))
    def serve(c):
        with c:
            while d := c.recv(65536):
                c.sendall(d)
    def run():
        while True:
            c, _ = srv.accept()
            threading.Thread(target=serve, args=(c,), daemon=True).start()
    threading.Thread(target=run, daemon=True).start()
    return srv


def pytest_configure(config):
    config.addinivalue_line("markers", "echo: the test uses the host's echo service")
    if os.environ.get("PYTEST_BOXLITE_GUEST") or "ECHO_PORT" in os.environ:
        return  # in a box (or an xdist worker, which inherits the controller's server)
    config._echo = _echo()
    os.environ["ECHO_PORT"] = str(config._echo.getsockname()[1])
    # A port of the host's that no test is offered: any connection to it is written down.
    canary = socket.create_server(("127.0.0.1", 0))
    def watch():
        while True:
            c, _ = canary.accept()
            with open(os.path.join(str(config.rootpath), "canary-reached"), "a") as fh:
                fh.write("reached\n")
            c.close()
    threading.Thread(target=watch, daemon=True).start()
    config._canary = canary
    os.environ["CANARY_PORT"] = str(canary.getsockname()[1])


def _described(config, item):
    # Stands in for the service fixtures' host side: one service, its host address.
    if item.get_closest_marker("echo") is None:
        return {}
    return {"echo": {"name": "echo", "ports": {"7": ["127.0.0.1", int(os.environ["ECHO_PORT"])]}}}


services.descriptions_for = _described


def pytest_unconfigure(config):
    # Where the host's helper ran, its pid: the outer test checks it ended with this process.
    from pytest_boxlite import reach

    proc = reach._helper._proc
    if proc is not None and not os.environ.get("PYTEST_BOXLITE_GUEST"):
        with open("helper-pids", "a") as fh:
            fh.write("%d\n" % proc.pid)
"""

TESTS = r"""
import os, socket

import pytest

pytestmark = pytest.mark.boxlite


def _talk(tag):
    s = socket.create_connection(("127.0.0.1", int(os.environ["ECHO_PORT"])), timeout=20)
    s.sendall(tag.encode())
    assert s.recv(100) == tag.encode()
    s.close()


@pytest.mark.echo
@pytest.mark.parametrize("i", range(3))
def test_reaches(i):
    _talk(f"test {i} in box {socket.gethostname()}")


def test_without_the_service_does_not_reach_it():
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", int(os.environ["ECHO_PORT"])), timeout=5)


@pytest.mark.echo
def test_reaches_again_after_one_without():
    _talk("again")


@pytest.mark.echo
def test_cannot_make_the_relay_connect_elsewhere():
    # In a box of its own (root there if the run is root), asking the relay in every way a proxy
    # could be asked to reach the host's other port: the bytes only ever reach the service.
    port, canary = int(os.environ["ECHO_PORT"]), int(os.environ["CANARY_PORT"])
    asks = [
        b"CONNECT 127.0.0.1:%d HTTP/1.1\r\n\r\n" % canary,
        b"\x05\x01\x00\x05\x01\x00\x01\x7f\x00\x00\x01" + canary.to_bytes(2, "big"),
        b'{"op": "connect", "port": %d}\n' % canary,
    ]
    for ask in asks:
        s = socket.create_connection(("127.0.0.1", port), timeout=20)
        s.sendall(ask)
        got = b""
        while len(got) < len(ask):
            got += s.recv(65536) or b"!"
        assert got == ask
        s.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", canary), timeout=5)
"""


def _subrun(tmp_path: Path, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_reach_boxed.py").write_text(TESTS)
    cmd = [sys.executable, "-m", "pytest", *QUIET, "-p", "no:randomly", f"--boxlite-home={home}", "-q", *args]
    return subprocess.run(
        cmd, cwd=tmp_path, env=sub_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600
    )


@pytest.mark.escapes
@pytest.mark.parametrize(
    "args",
    [
        pytest.param((), id="test-scope-forked"),
        # One box per module: what one test was offered stays for the box's later tests.
        pytest.param(("--boxlite-scope=module", "-k", "not does_not_reach"), id="module-scope-forked"),
        pytest.param(("--boxlite-fresh=boot",), id="test-scope-booted"),
        pytest.param(("-n", "2"), id="xdist-2"),
    ],
)
@pytest.mark.escape_row("service-relay")
def test_boxed_tests_reach_the_service_at_its_host_address(tmp_path: Path, home: Path, args: tuple[str, ...]) -> None:
    if args[:1] == ("-n",):
        pytest.importorskip("xdist")
    started = time.monotonic()
    res = _subrun(tmp_path, home, *args)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert ("5 passed" if "not does_not_reach" in args else "6 passed") in out, out
    assert not (tmp_path / "canary-reached").exists(), "the host connected to a port no test was offered"
    # The helper that made the listeners ran (in each xdist worker) and ended with its process.
    pids = [int(p) for p in (tmp_path / "helper-pids").read_text().split()]
    assert 1 <= len(pids) <= (2 if "-n" in args else 1), pids  # -n 2: a worker may have run no such test
    assert wait_until(lambda: all(process_gone(p) for p in pids), timeout=10), pids
    assert time.monotonic() - started < 300


# -- with the real service fixture -------------------------------------------------------------

REAL_CONFTEST = r"""
import socket, sys

import pytest

from pytest_boxlite import PortReady, service

ECHO = '''
import socket, threading
srv = socket.create_server(("127.0.0.1", 7000))
def serve(c):
    with c:
        while d := c.recv(65536):
            c.sendall(d)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
'''

echo = service("echo", [sys.executable, "-c", ECHO], ports=[7000], ready=PortReady(7000), scope="session")


@pytest.fixture(scope="session")
def early(echo):
    # Connected once, where the session's fixtures are set up: a boxed test's warm interpreter.
    s = socket.create_connection(echo.address(7000), timeout=20)
    s.sendall(b"early")
    assert s.recv(100) == b"early"
    return s
"""

REAL_TESTS = r"""
import socket

import pytest

pytestmark = pytest.mark.boxlite


def test_through_a_session_fixture(early):
    early.sendall(b"later")
    assert early.recv(100) == b"later"


@pytest.mark.parametrize("i", range(2))
def test_direct(echo, i):
    s = socket.create_connection(echo.address(7000), timeout=20)
    s.sendall(b"direct %d" % i)
    assert s.recv(100) == b"direct %d" % i
"""


@pytest.mark.parametrize("args", [(), ("--boxlite-scope=module",)], ids=["test-scope", "module-scope"])
def test_a_session_fixture_of_a_boxed_test_connects_where_it_is_set_up(
    tmp_path: Path, home: Path, args: tuple[str, ...]
) -> None:
    (tmp_path / "conftest.py").write_text(REAL_CONFTEST)
    (tmp_path / "test_real.py").write_text(REAL_TESTS)
    cmd = [sys.executable, "-m", "pytest", *QUIET, "-p", "no:randomly", f"--boxlite-home={home}", "-q", *args]
    res = subprocess.run(
        cmd, cwd=tmp_path, env=sub_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "3 passed" in out, out


def test_on_vm_a_boxed_test_is_told_why_it_cannot_reach_the_service(tmp_path: Path, home: Path) -> None:
    """A VM's processes are not this host's: no network namespace to listen in (the SDK double)."""
    from test_vm_marker import double_env

    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_reach_boxed.py").write_text(TESTS)
    cmd = [sys.executable, "-m", "pytest", *QUIET, "-p", "no:randomly", f"--boxlite-home={home}", "-q"]
    res = subprocess.run(
        [*cmd, "--boxlite-runtime=vm", "-k", "reaches_again or does_not_reach"],  # one each way
        cwd=tmp_path,
        env=double_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "1 passed" in out and "1 error" in out, out  # an error at its setup
    assert "could not make the test's services reachable in its" in out, out
    assert "are not processes of this host" in out, out
