"""A real server in a box: Redis, from Debian's ``redis-server`` package, talked to with its real
client library (``redis`` from PyPI), from a test on the host and from a boxed one.

The server runs in a box with the box's network off.  The host test reaches it through a
published port (``Sandbox.publish``: a host-owned relay into the box's own loopback); the boxed
test starts its own server in its own box, as it would locally.  Neither can touch a Redis of
this machine: each box has its own ports.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_boxlite import Sandbox

redis = pytest.importorskip("redis", reason="the Redis client is in the test extra: python -m pip install -e '.[test]'")

SERVER = shutil.which("redis-server")
needs_server = pytest.mark.skipif(
    SERVER is None,
    reason="redis-server is not installed: apt-get install redis-server (Debian/Ubuntu; .ci/run installs it)",
)
#: No persistence, no protected-mode warnings, logs on stdout: a throw-away server.
ARGV = ["--port", "6379", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", "/tmp"]


@needs_server
def test_redis_in_a_box_from_the_host(boxlite_sandbox: Sandbox) -> None:
    # Runs on the host (a test using boxlite_sandbox always does); only the server is boxed.
    sb = boxlite_sandbox
    if sb.runtime != "namespace" and not sb.execute_command("command -v redis-server").ok:
        pytest.skip("the box's image has no redis-server (vm: use an image with it)")
    with sb.spawn(["redis-server", *ARGV]) as server:
        sb.wait_for_port(6379, timeout=30, process=server)
        host, port = sb.publish(6379)
        client = redis.Redis(host=host, port=port, socket_timeout=30)
        assert client.ping()
        client.set("greeting", "hello from the host")
        assert client.get("greeting") == b"hello from the host"
        assert client.incr("visits") == 1
        # The server in the box is the one answering: it says where its data would go.
        assert client.config_get("dir") == {"dir": "/tmp"}
        client.close()
        server.terminate()
        server.wait(timeout=30)


@needs_server
@pytest.mark.boxlite(user="root")
def test_redis_in_a_boxed_test() -> None:
    # The whole test runs in a box: its server listens on the box's own loopback, so a Redis on
    # this machine's port 6379 (if any) is neither reached nor disturbed.
    assert SERVER is not None
    with subprocess.Popen([SERVER, *ARGV], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as server:
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", 6379), timeout=1).close()
                    break
                except OSError:
                    assert server.poll() is None, "redis-server exited before it listened"
                    assert time.monotonic() < deadline, "redis-server did not listen within 30 s"
                    time.sleep(0.01)
            client = redis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
            client.rpush("queue", "a", "b", "c")
            assert client.lrange("queue", 0, -1) == [b"a", b"b", b"c"]
            client.close()
        finally:
            server.terminate()
