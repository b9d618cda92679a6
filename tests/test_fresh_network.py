"""A boxed test's network is as a fresh box's (issue 42): no socket, listener or TIME_WAIT entry
another test left.

The guard for any change that makes network namespaces ahead of their boxes, pools them or shares
one: the first test binds a fixed loopback port, connects to it and closes the accepted end first
(so the port is left in TIME_WAIT, checked), and leaves a listener and an abstract Unix socket
open; the next test, in its own box, must see no TCP or Unix socket at all and bind that port
without SO_REUSEADDR.  The same two tests run unboxed (one network namespace) must fail: the
control shows the check can fail.  Real sub-runs, root and an ordinary user, either pid 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from subruns import SubRun, sub_env

from pytest_boxlite import guest

PORT = 47321

TESTS = f"""
import socket

PORT = {PORT}


def _tcp_entries():
    rows = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as fh:
                rows += [line.split() for line in fh.readlines()[1:] if line.strip()]
        except FileNotFoundError:
            pass
    return rows


def _abstract_unix():
    with open("/proc/net/unix") as fh:
        return [line for line in fh.readlines()[1:] if "@boxlite-net-probe" in line]


def test_a_leaves_time_wait():
    srv = socket.socket()
    srv.bind(("127.0.0.1", PORT))
    srv.listen()
    cli = socket.create_connection(("127.0.0.1", PORT))
    conn, _ = srv.accept()
    conn.close()  # the accepted end closes first: 127.0.0.1:PORT is left in TIME_WAIT
    cli.close()
    srv.close()
    # And a listener and an abstract Unix socket, left open for the box's end to close.
    global KEEP
    KEEP = [socket.socket(), socket.socket(socket.AF_UNIX)]
    KEEP[0].bind(("127.0.0.1", PORT + 1))
    KEEP[0].listen()
    KEEP[1].bind("\\0boxlite-net-probe")
    states = {{row[3] for row in _tcp_entries() if row[1].endswith(":%04X" % PORT)}}
    assert "06" in states, states  # TIME_WAIT is there, in this test's network namespace
    assert _abstract_unix()


def test_b_sees_a_fresh_network():
    assert _tcp_entries() == [], _tcp_entries()
    assert _abstract_unix() == []
    s = socket.socket()  # no SO_REUSEADDR: a TIME_WAIT entry on the port would refuse it
    s.bind(("127.0.0.1", PORT))
    s.close()
    s = socket.socket()
    s.bind(("127.0.0.1", PORT + 1))
    s.close()
"""


@pytest.mark.parametrize("pid1", ["native", "python"])
def test_next_boxed_test_sees_no_socket_or_time_wait_of_the_last(
    pid1: str, tmp_path: Path, home: Path, subruns: list[SubRun]
) -> None:
    if pid1 == "native" and isinstance(guest.native_init(), str):
        pytest.skip(f"no native pid 1 here: {guest.native_init()}")
    (tmp_path / "test_net.py").write_text(TESTS)
    env = sub_env(**{guest.NATIVE_INIT_ENV: "1" if pid1 == "native" else "0"})
    run = SubRun(tmp_path, home, pid1, "--boxlite", "-p", "no:randomly", "test_net.py", env=env)
    subruns.append(run)
    rc = run.wait(180)
    assert rc == 0, run.output
    assert "2 passed" in run.output, run.output


def test_control_one_network_namespace_fails(tmp_path: Path, home: Path, subruns: list[SubRun]) -> None:
    """Unboxed, both tests share one network namespace: the second sees the first's TIME_WAIT
    and cannot bind its port, which is what a shared or reused namespace would let through."""
    (tmp_path / "test_net.py").write_text(TESTS)
    run = SubRun(tmp_path, home, "plain", "-p", "no:randomly", "test_net.py", env=sub_env())
    subruns.append(run)
    rc = run.wait(120)
    assert rc == 1, run.output
    # (test_a may fail too: the host's port may still be in TIME_WAIT from an earlier control run.)
    assert "FAILED test_net.py::test_b_sees_a_fresh_network" in run.output, run.output
