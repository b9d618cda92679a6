"""A real server in a box: Redis, from Debian's ``redis-server`` package, talked to with its real
client library (``redis`` from PyPI), from a test on the host and from a boxed one.

The server runs in a box with the box's network off.  The service fixture ``redis`` starts it
once for the session and gives its address: a port on the host's ``127.0.0.1`` that the host
relays into the server's box.  A boxed test reaches it at that same address, from a box whose
own network is off too.  A lower-level test does the same by hand with ``Sandbox.spawn`` and
``Sandbox.publish``.  Nothing here can touch a Redis of this machine: each box has its own ports.
"""

from __future__ import annotations

import shutil
import time
from typing import TYPE_CHECKING

import pytest

from pytest_boxlite import PortReady, service

if TYPE_CHECKING:
    from pytest_boxlite import Sandbox, Service

redis_client = pytest.importorskip(
    "redis", reason="the Redis client is in the test extra: python -m pip install -e '.[test]'"
)

SERVER = shutil.which("redis-server")
needs_server = pytest.mark.skipif(
    SERVER is None,
    reason="redis-server is not installed: apt-get install redis-server (Debian/Ubuntu; .ci/run installs it)",
)
#: A throw-away server: no persistence, on the box's loopback only.
ARGV = ["redis-server", "--port", "6379", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", "/tmp"]

# One Redis per session, in a box of its own, ready once it accepts connections on its port 6379.
redis = service("redis", ARGV, ports=[6379], ready=PortReady(6379), scope="session")


def _client(address: tuple[str, int]) -> redis_client.Redis:
    host, port = address
    return redis_client.Redis(host=host, port=port, socket_timeout=30)


@needs_server
def test_redis_from_the_host(redis: Service) -> None:
    # Runs on the host; only the server is boxed.
    client = _client(redis.address(6379))
    assert client.ping()
    client.set("greeting", "hello from the host")
    assert client.get("greeting") == b"hello from the host"
    client.rpush("visitors", "host")
    client.close()


@needs_server
@pytest.mark.boxlite
def test_redis_from_a_boxed_test(redis: Service) -> None:
    # This whole test runs in a box of its own, network off: the fixture's address works here too,
    # and it is the same server (the session's one instance).
    client = _client(redis.address(6379))
    assert client.ping()
    client.rpush("visitors", "box")
    assert b"box" in client.lrange("visitors", 0, -1)
    client.close()


@needs_server
def test_redis_by_hand(boxlite_sandbox: Sandbox) -> None:
    # What the fixture does, by hand: spawn the server, wait for its port, publish it.
    sb = boxlite_sandbox
    if sb.runtime != "namespace" and not sb.execute_command("command -v redis-server").ok:
        pytest.skip("the box's image has no redis-server (vm: use an image with it)")
    started = time.monotonic()
    with sb.spawn(ARGV) as server:
        sb.wait_for_port(6379, timeout=30, process=server)
        host, port = sb.publish(6379)
        client = _client((host, port))
        assert client.ping()
        print(f"redis-server start to ready: {1000 * (time.monotonic() - started):.0f} ms")
        assert client.incr("counter") == 1  # a server of its own: nothing from the session's
        assert client.config_get("dir") == {"dir": "/tmp"}
        client.close()
        server.terminate()
        server.wait(timeout=30)
