"""Another local user cannot use a session's published ports or services (issue 40, class 3).

``127.0.0.1`` is open to every local user: a published port's relay (``Sandbox.publish``, and so
every service fixture's address) serves only the processes of the session's own user, and closes
any other connection before a byte flows, with a bounded warning (:mod:`pytest_boxlite.publish`).

The attacker is real: a second local account (``boxlite-attacker``, made here with ``useradd``
when missing) whose process, started with ``runuser``, finds the port (as it would in
``/proc/net/tcp``), connects, sends a request and reads.  It must read nothing.  These need root
(to make and become that user); as an ordinary user they skip, saying so.  The last test turns
it round: a session of the ordinary user ``boxuser`` refuses root's connection too (the rule is
the session's uid, whoever else connects).
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CREATE_TIMEOUT, _Runtimes, new_box_name
from subruns import ATTACKER, QUIET, SubRun, read_line, second_user, sub_env, wait_until
from test_hostile_boxes import _as_user

from pytest_boxlite import publish
from pytest_boxlite.process import BoxProcessWarning
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec

pytestmark = [pytest.mark.escapes, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parent.parent
SECRET = "relay-secret-5c2e"

#: An echo server in the box that greets each connection with a secret line, then echoes.
GREETER = """
import socket, sys, threading
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[1])))
srv.listen(64)
def serve(c):
    with c:
        c.sendall(sys.argv[2].encode() + b"\\n")
        while True:
            data = c.recv(65536)
            if not data:
                return
            c.sendall(data)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

#: The attacker: opens ``n`` connections to the port at once (held together), sends an HTTP
#: request on each and reads until the relay closes it; prints what each connection read, and
#: whether the peer reset it (the relay closing with the request unread).
STEAL = r"""
import json, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
conns = [socket.create_connection(("127.0.0.1", port), timeout=15) for _ in range(n)]
deadline = time.monotonic() + 10  # the whole read: a relay that serves would never close
out = []
for c in conns:
    got, how = b"", "closed"
    try:
        c.sendall(b"GET / HTTP/1.0\r\n\r\n")
        while True:
            c.settimeout(max(0.1, deadline - time.monotonic()))
            more = c.recv(65536)
            if not more:
                break
            got += more
    except (ConnectionResetError, BrokenPipeError):
        how = "reset"
    except TimeoutError:
        how = "timed out"
    out.append([got.decode("latin-1"), how])
print(json.dumps(out))
"""


def _python_for(user: str) -> str | None:
    """An interpreter ``user`` can run (root's own may live in a home only root can enter)."""
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.path.exists(cand):
            continue
        probe = subprocess.run(["runuser", "-u", user, "--", cand, "-I", "-c", "pass"], capture_output=True, timeout=60)
        if probe.returncode == 0:
            return cand
    return None


@pytest.fixture(scope="module")
def attacker() -> str:
    """The interpreter of a second local user, made here when missing (skips where that cannot be)."""
    second_user()
    python = _python_for(ATTACKER)
    if python is None:
        pytest.skip(f"no Python interpreter that {ATTACKER} may run")
    return python


def steal(python: str, port: int, n: int = 1) -> list[tuple[str, str]]:
    """What the attacker's ``n`` connections to ``127.0.0.1:port`` read, and how each ended."""
    run = subprocess.run(
        ["runuser", "-u", ATTACKER, "--", python, "-I", "-c", STEAL, str(port), str(n)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd="/",
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return [(got, how) for got, how in json.loads(run.stdout)]


@pytest.fixture
def greeter(runtimes: _Runtimes) -> Iterator[tuple[Sandbox, tuple[str, int]]]:
    """A namespace box (network off) whose port 8000 greets with :data:`SECRET`, published."""
    sb = Sandbox(runtimes.get("namespace").create_box(BoxSpec(), new_box_name(), timeout=CREATE_TIMEOUT))
    try:
        proc = sb.spawn([sb.handle.guest_python, "-c", GREETER, "8000", SECRET])
        sb.wait_for_port(8000, timeout=30, process=proc)
        yield sb, sb.publish(8000)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BoxProcessWarning)  # the server is left running on purpose
            sb.end()
        sb.handle.destroy()


def _own_greeting(address: tuple[str, int]) -> bytes:
    import socket

    with socket.create_connection(address, timeout=20) as conn:
        return read_line(conn)


def _relay_of(sb: Sandbox, port: int) -> publish.Relay:
    return sb._relays[port]  # the relay the sandbox made for the port: its counters


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pytest_boxlite.publish"]


def _lookup(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Use the lookup ``how`` names: ``sock_diag`` (skips where the kernel has none), or ``proc
    tables``, the fallback, forced through a private switch (a kernel without ``tcp_diag`` is
    the one fault no real part here produces)."""
    if how == "sock_diag":
        if not publish._sock_diag_works():
            pytest.skip("this kernel answers no sock_diag lookup (no tcp_diag): the tables are read")
    else:
        monkeypatch.setattr(publish, "_sock_diag", False)


@pytest.mark.escape_row("published-port-users", runtime="host", users="root")
@pytest.mark.parametrize("how", ["sock_diag", "proc tables"])
def test_another_user_reads_nothing_from_a_published_port(
    how: str,
    attacker: str,
    greeter: tuple[Sandbox, tuple[str, int]],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _lookup(how, monkeypatch)
    sb, (host, port) = greeter
    caplog.set_level(logging.WARNING, logger="pytest_boxlite.publish")
    [(got, how)] = steal(attacker, port)
    assert got == "", f"another local user read {got!r} from the published port"
    assert how in ("closed", "reset")
    # The session's own process still reaches it.
    assert _own_greeting((host, port)) == f"{SECRET}\n".encode()
    relay = _relay_of(sb, 8000)
    assert relay.strangers == 1
    uid = pwd.getpwnam(ATTACKER).pw_uid
    [line] = _refusals(caplog)
    assert f"refused a connection from uid {uid} ({ATTACKER})" in line and f"127.0.0.1:{port}" in line


def test_a_flood_of_another_users_connections_is_logged_bounded_and_starves_no_one(
    attacker: str, greeter: tuple[Sandbox, tuple[str, int]], caplog: pytest.LogCaptureFixture
) -> None:
    """300 connections held at once (more than the relay's 2 x 64 slots): none is served, none
    takes a slot from the session's own connections, and the log holds a bounded number of lines."""
    sb, address = greeter
    caplog.set_level(logging.WARNING, logger="pytest_boxlite.publish")
    results = steal(attacker, address[1], n=300)
    assert len(results) == 300
    assert all(got == "" for got, _ in results), [got for got, _ in results if got][:3]
    assert _own_greeting(address) == f"{SECRET}\n".encode()
    assert _relay_of(sb, 8000).strangers == 300
    lines = _refusals(caplog)
    assert len(lines) == publish.LOGGED_REFUSALS + 1, lines
    assert "counted, no longer logged" in lines[-1]


#: A sub-run's project: a real service fixture (http.server in its box), an unboxed test that
#: lets the attacker at the service's address while it runs, and a boxed test that reaches the
#: same instance through its box's relay (the session's boxes are served).
SERVICE_CONFTEST = """
import sys
from pytest_boxlite import service, HttpReady

web = service(
    "web", [sys.executable, "-u", "-m", "http.server", "8000", "--bind", "127.0.0.1"],
    ports=[8000], ready=HttpReady(8000), scope="session",
)
"""

SERVICE_TESTS = """
import json, logging, os, subprocess, urllib.request

import pytest


def test_1_another_user_reads_nothing(web, caplog):
    caplog.set_level(logging.WARNING, logger="pytest_boxlite.publish")
    host, port = web.address(8000)
    run = subprocess.run(
        ["runuser", "-u", "{attacker}", "--", "{python}", "-I", "-c", {steal!r}, str(port), "1"],
        capture_output=True, text=True, timeout=90, cwd="/",
    )
    assert run.returncode == 0, run.stderr
    [[got, how]] = json.loads(run.stdout)
    assert got == "", "the other user read: " + got[:200]
    with urllib.request.urlopen(web.url("http", 8000, "/"), timeout=30) as resp:
        assert resp.status == 200
    assert any("refused a connection from uid" in r.getMessage() for r in caplog.records)


@pytest.mark.boxlite
def test_2_the_sessions_boxed_test_reaches_it(web):
    with urllib.request.urlopen(web.url("http", 8000, "/"), timeout=30) as resp:
        assert resp.status == 200
"""


@pytest.mark.escape_row("published-port-users", runtime="host", users="root")
def test_a_service_of_a_root_session_refuses_another_user_and_serves_its_boxed_test(
    attacker: str, tmp_path: Path
) -> None:
    (tmp_path / "conftest.py").write_text(SERVICE_CONFTEST)
    (tmp_path / "test_attacked.py").write_text(
        SERVICE_TESTS.replace("{attacker}", ATTACKER).replace("{python}", attacker).replace("{steal!r}", repr(STEAL))
    )
    run = SubRun(tmp_path, tmp_path / "home", "svc", "-p", "no:randomly", env=sub_env())
    try:
        code = run.wait(180)
    finally:
        run.kill()
    out = run.output
    assert code == 0 and "2 passed" in out, out[-4000:]


#: The ordinary user's session: publishes a greeting port, tells the outer test where, waits
#: for root's attempt, then checks that its own connection is served and root's was refused.
USER_SESSION = """
import os, socket, sys, time, warnings
from pathlib import Path

GREETER = {greeter!r}


def test_publish_and_wait_for_root(boxlite_sandbox):
    sb = boxlite_sandbox
    proc = sb.spawn([sb.handle.guest_python, "-c", GREETER, "8000", "{secret}"])
    sb.wait_for_port(8000, timeout=30, process=proc)
    host, port = sb.publish(8000)
    Path("address").write_text(str(port))
    deadline = time.monotonic() + 120
    while not Path("tried").exists():
        assert time.monotonic() < deadline, "root never tried"
        time.sleep(0.05)
    with socket.create_connection((host, port), timeout=20) as conn:
        assert conn.makefile("rb").readline() == b"{secret}\\n"
    assert sb._relays[8000].strangers == 1
"""


@pytest.mark.escape_row("published-port-users", runtime="host", users="root")
def test_an_ordinary_users_session_refuses_root() -> None:
    """Chosen: the rule is the session's uid, so root's processes are refused too (root could
    read the session's memory anyway; the relay does not serve it on that account)."""
    import socket

    python, work = _as_user()
    try:
        work.write("test_user.py", USER_SESSION.format(greeter=GREETER, secret=SECRET))
        # This checkout's code, not whatever the user's interpreter has installed.
        argv = work.argv(
            "env",
            f"PYTHONPATH={ROOT}",
            python,
            "-m",
            "pytest",
            *QUIET,
            "--basetemp",
            str(work.root / "bt"),
            "-p",
            "no:randomly",
        )
        log = (work.root / "run.log").open("wb")
        proc = subprocess.Popen(argv, cwd=work.project, stdout=log, stderr=subprocess.STDOUT)
        try:
            address = work.project / "address"
            assert wait_until(lambda: address.exists() and address.read_text().isdigit(), timeout=120), (
                work.root / "run.log"
            ).read_text()[-3000:]
            port = int(address.read_text())
            got = b""
            with socket.create_connection(("127.0.0.1", port), timeout=15) as conn:
                conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
                try:
                    while more := conn.recv(65536):
                        got += more
                except (ConnectionResetError, TimeoutError):
                    pass  # reset: refused with the request unread; timed out: served (see got)
            assert got == b"", f"root read {got!r} from the ordinary user's published port"
            (work.project / "tried").write_text("")
            code = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
            log.close()
        out = (work.root / "run.log").read_text()
        assert code == 0 and "1 passed" in out, out[-4000:]
    finally:
        shutil.rmtree(work.root, ignore_errors=True)


@pytest.mark.parametrize("how", ["sock_diag", "proc tables"])
def test_the_lookup_names_this_processes_own_connection_and_no_closed_one(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """:func:`publish.peer_uid` finds the connecting socket's owner (this process's uid, here
    any user's); once the client has closed, no owner (TIME-WAIT keeps none).  Both lookups."""
    import socket

    _lookup(how, monkeypatch)
    srv = socket.create_server(("127.0.0.1", 0))
    with srv:
        client = socket.create_connection(srv.getsockname())
        served, _ = srv.accept()
        with served:
            assert publish.peer_uid(served) == os.geteuid()
            client.close()
            assert wait_until(lambda: publish.peer_uid(served) is None, timeout=10)
        # A dual-stack client (an AF_INET6 socket, v4-mapped) is found too.
        try:
            six = socket.socket(socket.AF_INET6)
            six.connect(("::ffff:127.0.0.1", srv.getsockname()[1]))
        except OSError:
            pytest.skip("no IPv6 sockets here")
        with six:
            served, _ = srv.accept()
            with served:
                assert publish.peer_uid(served) == os.geteuid()
