"""``Sandbox.publish`` and ``wait_for_port``: a box's TCP port reachable from the host with the
box's network off (issue 24, item 2).

Real namespace boxes, booted and forked, and vm boxes on the SDK double.  The relay is host-owned: it
listens on the host's 127.0.0.1 and reaches only the published port on the box's own loopback.
"""

from __future__ import annotations

import socket
import threading
import time
import warnings
from collections.abc import Iterator

import pytest
from conftest import CREATE_TIMEOUT, _Runtimes, new_box_name
from rest_double_runtime import rest_runtime
from subruns import TcpServer, read_line

from pytest_boxlite import errors, publish
from pytest_boxlite.process import BoxProcess, BoxProcessWarning
from pytest_boxlite.runtimes import Runtime
from pytest_boxlite.runtimes.base import BoxDefaults
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec

pytestmark = pytest.mark.timeout(60)

#: An echo server in the box: greets each connection with its token, then echoes.
ECHO = """
import socket, sys, threading
token = sys.argv[2].encode()
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[1])))
srv.listen(64)
print("listening", flush=True)
def serve(c):
    with c:
        c.sendall(token + b"\\n")
        while True:
            data = c.recv(1 << 16)
            if not data:
                return
            c.sendall(data)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


#: Namespace boxes booted and forked from a zygote, the vm runtime's real code on the SDK double
#: (``tests/sdk_double``) where no VM boots, and the vm runtime over REST on the double's server.
KINDS = {"booted": "namespace", "forked": "namespace-forked", "vm": "vm", "rest": "rest"}


@pytest.fixture(scope="module")
def rest_rt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runtime]:
    """The REST runtime on the SDK double's server, for this module's ``rest`` boxes."""
    with rest_runtime(tmp_path_factory) as (_server, rt):
        yield rt


@pytest.fixture(params=list(KINDS))
def rt(request: pytest.FixtureRequest, runtimes: _Runtimes) -> Runtime:
    kind = KINDS[request.param]
    return request.getfixturevalue("rest_rt") if kind == "rest" else runtimes.get(kind)


def _box(rt: Runtime) -> Sandbox:
    return Sandbox(rt.create_box(BoxSpec(), new_box_name(), timeout=CREATE_TIMEOUT))


def _end(sandbox: Sandbox) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BoxProcessWarning)  # servers are left running on purpose
        sandbox.end()
    sandbox.handle.destroy()


@pytest.fixture
def sb(rt: Runtime) -> Iterator[Sandbox]:
    """A box with its network off (the default spec); ended, then destroyed."""
    sandbox = _box(rt)
    try:
        yield sandbox
    finally:
        _end(sandbox)


def echo_server(sb: Sandbox, port: int = 8000, token: str = "hello") -> BoxProcess:
    proc = sb.spawn([sb.handle.guest_python, "-c", ECHO, str(port), token])
    sb.wait_for_port(port, timeout=30, process=proc)
    return proc


def greet(address: tuple[str, int]) -> socket.socket:
    conn = socket.create_connection(address, timeout=20)
    return conn


def test_publish_reaches_the_box_port_with_the_network_off(sb: Sandbox) -> None:
    assert not BoxSpec().network  # the fixture's box has no network
    echo_server(sb)
    host, port = sb.publish(8000)
    assert host == "127.0.0.1" and 1024 <= port <= 65535
    with greet((host, port)) as conn:
        assert read_line(conn) == b"hello\n"
        conn.sendall(b"ping\n")
        assert read_line(conn) == b"ping\n"


def test_binary_data_both_ways_and_half_close(sb: Sandbox) -> None:
    echo_server(sb)
    address = sb.publish(8000)
    payload = bytes(range(256)) * (8 << 12)  # 8 MiB
    with greet(address) as conn:
        assert read_line(conn) == b"hello\n"
        got = bytearray()

        def reader() -> None:
            while True:
                data = conn.recv(1 << 16)
                if not data:
                    return
                got.extend(data)

        t = threading.Thread(target=reader)
        t.start()
        conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)  # the box sees the end, closes, and the host sees its end
        t.join(30)
        assert not t.is_alive()
        assert bytes(got) == payload


def test_two_boxes_have_their_own_port_8000(rt: Runtime) -> None:
    one, two = _box(rt), _box(rt)
    try:
        echo_server(one, token="one")
        echo_server(two, token="two")  # no "Address already in use": each box has its own ports
        for sandbox, token in ((one, b"one\n"), (two, b"two\n")):
            with greet(sandbox.publish(8000)) as conn:
                assert read_line(conn) == token
    finally:
        _end(one)
        _end(two)


def test_wait_for_port_waits_for_a_late_listener(sb: Sandbox) -> None:
    address = sb.publish(8000)  # published before anything listens
    # Nothing listens yet: the relay accepts and hangs up, and goes on.
    with greet(address) as conn:
        assert conn.recv(100) == b""
    proc = sb.spawn(["sh", "-c", f"sleep 0.5; exec {sb.handle.guest_python} -c '{ECHO}' 8000 late"])
    sb.wait_for_port(8000, timeout=30, process=proc)
    with greet(address) as conn:
        assert read_line(conn) == b"late\n"


def test_wait_for_port_timeout_and_a_server_that_exits_first(sb: Sandbox) -> None:
    with pytest.raises(errors.OutputTimeoutError, match="nothing listened on port 8001"):
        sb.wait_for_port(8001, timeout=0.3)
    proc = sb.spawn(["sh", "-c", "echo 'bind: permission denied' >&2; exit 1"])
    with pytest.raises(errors.ProcessExitedError, match="exited with status 1 before port 8001 listened") as info:
        sb.wait_for_port(8001, timeout=30, process=proc)
    assert "stderr: bind: permission denied" in str(info.value)


def test_bad_ports_are_refused_clearly(sb: Sandbox) -> None:
    for bad in (0, 65536, -1, True, "8000", 80.0):
        with pytest.raises(errors.ConfigError, match="a port is a number from 1 to 65535"):
            sb.publish(bad)  # type: ignore[arg-type]
        with pytest.raises(errors.ConfigError, match="a port is a number from 1 to 65535"):
            sb.wait_for_port(bad, timeout=1)  # type: ignore[arg-type]
    host, port = sb.publish(8000)
    with pytest.raises(errors.ConfigError, match=f"port 8000 of box .* is already published at {host}:{port}"):
        sb.publish(8000)


def test_the_relay_ends_with_the_sandbox(rt: Runtime) -> None:
    sandbox = _box(rt)
    try:
        echo_server(sandbox)
        address = sandbox.publish(8000)
        conn = greet(address)
        assert read_line(conn) == b"hello\n"
        with pytest.warns(BoxProcessWarning):
            sandbox.end()
        assert conn.recv(100) == b""  # the open connection is cut
        conn.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=5).close()
        assert not [t for t in threading.enumerate() if t.name.startswith(f"boxlite-relay-{sandbox.name}")]
    finally:
        _end(sandbox)


@pytest.mark.reliability
@pytest.mark.escape_row("process-output")
def test_the_relay_holds_a_bounded_number_of_connections(sb: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publish, "MAX_CONNECTIONS", 3)
    echo_server(sb)
    address = sb.publish(8000)
    held = [greet(address) for _ in range(3)]
    try:
        for conn in held:
            assert read_line(conn) == b"hello\n"
        with greet(address) as extra:
            assert extra.recv(100) == b""  # accepted and closed at once
        held.pop().close()
        for _ in range(200):  # its relay threads end once both ends are closed
            with greet(address) as again:
                if read_line(again) == b"hello\n":
                    break
            time.sleep(0.05)
        else:
            pytest.fail("a slot freed by a closed connection was not reused")
    finally:
        for conn in held:
            conn.close()


@pytest.mark.escapes
@pytest.mark.escape_row("loopback-off")
def test_the_box_cannot_reach_the_relay_or_the_host(sb: Sandbox, tcp_server: TcpServer) -> None:
    echo_server(sb)
    _host, port = sb.publish(8000)
    probe = (
        "import socket, sys\n"
        "for p in map(int, sys.argv[1:]):\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', p), timeout=3).close(); print(p, 'open')\n"
        "    except OSError as e:\n"
        "        print(p, type(e).__name__)\n"
    )
    host_port = tcp_server.port
    r = sb.run([sb.handle.guest_python, "-c", probe, str(port), str(host_port)], timeout=30, check=True)
    # The box's 127.0.0.1 is its own: neither the relay's host port nor a host server is there.
    lines = r.stdout.split("\n")[:2]
    assert [line.split()[0] for line in lines] == [str(port), str(host_port)]
    assert not [line for line in lines if line.endswith(" open")], lines


@pytest.mark.escapes
@pytest.mark.escape_row("process-output")
def test_the_agent_connects_only_to_a_valid_port_of_the_box(sb: Sandbox) -> None:
    if sb.runtime == "vm":
        pytest.skip("the namespace agent's connect request (a vm box connects with a guest command)")
    for bad in (0, 70000):
        with pytest.raises(OSError, match="connect needs a port from 1 to 65535"):
            sb.handle.connect_port(bad, timeout=5)
    with pytest.raises(ConnectionRefusedError, match="nothing listens on port 8002"):
        sb.handle.connect_port(8002, timeout=5)


class _SlowBox(BoxDefaults):
    """A fake box handle (unit layer): its first ``slow`` connection attempts time out, as a vm
    box's guest connect command can on a loaded host, or a remote server's exec over a network."""

    runtime_name = "fake"
    name = "slow-box"

    def __init__(self, slow: int) -> None:
        self.slow = slow
        self.calls = 0

    def connect_port(self, port: int, *, timeout: float) -> socket.socket:
        self.calls += 1
        if self.calls <= self.slow:
            raise errors.BoxTimeoutError(f"box slow-box: no connection to port {port} within {timeout:g} s")
        ours, theirs = socket.socketpair()
        theirs.close()
        return ours


def test_wait_for_port_retries_an_attempt_that_timed_out() -> None:
    slow = _SlowBox(slow=2)
    Sandbox(slow).wait_for_port(8000, timeout=30)  # type: ignore[arg-type]
    assert slow.calls == 3
    # A box that never answers is the wait's own timeout, not one attempt's error.
    with pytest.raises(errors.OutputTimeoutError, match="nothing listened on port 8000 of box slow-box within 1 s"):
        Sandbox(_SlowBox(slow=10**6)).wait_for_port(8000, timeout=1)  # type: ignore[arg-type]
