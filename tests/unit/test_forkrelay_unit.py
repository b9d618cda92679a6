"""The VM fork relay's host end (``runtimes/_forkrelay.py``) against the real guest relay run on
this host, and against a FAKE guest: a local script (no box, no VM) that writes hostile frames.

The fake stands in for a guest that has been taken over: the host end must bound what it reads,
drop what names no connection it knows, refuse connections over the cap, and end cleanly.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from pytest_boxlite.guest.relay import CLOSE, DATA, HEADER, MAX_CONNS, MAX_PAYLOAD, OPEN, READY
from pytest_boxlite.runtimes import _forkrelay as forkrelay
from pytest_boxlite.runtimes._forkrelay import ForkRelay, RelayError

pytestmark = pytest.mark.timeout(60)


def frame(kind: int, cid: int, payload: bytes = b"", length: int | None = None) -> bytes:
    return HEADER.pack(kind, cid, len(payload) if length is None else length) + payload


#: A fake guest relay: writes the frames in argv[1] (hex), then copies its stdin to the file argv[2].
FAKE_GUEST = """
import os, sys, time
out = sys.stdout.buffer
out.write(bytes.fromhex(sys.argv[1])); out.flush()
with open(sys.argv[2], "ab") as log:
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        log.write(chunk); log.flush()
"""


def relay_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("boxlite-forkrelay")]


@pytest.fixture(autouse=True)
def no_threads_left() -> Iterator[None]:
    before = set(relay_threads())
    yield
    deadline = time.monotonic() + 10
    while set(relay_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(relay_threads()) - before, "the relay left threads running"


def fake_relay(tmp_path: Path, frames: bytes, **kwargs: float) -> tuple[ForkRelay, Path]:
    log = tmp_path / "from-host.bin"
    log.write_bytes(b"")

    def attach(argv: Sequence[str]) -> list[str]:
        return [sys.executable, "-c", FAKE_GUEST, frames.hex(), str(log)]

    return ForkRelay(attach, "python3", **kwargs), log  # type: ignore[arg-type]


def frames_in(data: bytes) -> list[tuple[int, int, bytes]]:
    out = []
    while len(data) >= HEADER.size:
        kind, cid, length = HEADER.unpack_from(data)
        out.append((kind, cid, data[HEADER.size : HEADER.size + length]))
        data = data[HEADER.size + length :]
    return out


def wait_for(predicate: Callable[[], object], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def test_the_real_guest_relay_carries_connections_both_ways_and_ends(tmp_path: Path) -> None:
    guest_dir = tmp_path / "guest"

    def local(argv: Sequence[str]) -> list[str]:
        # The guest relay's own argv, run on this host instead of in a VM (no bridge in between).
        return [sys.executable, *argv[1:]]

    relay = ForkRelay(local, "python3", guest_dir=str(guest_dir))
    conns: list[tuple[socket.socket, socket.socket]] = []
    try:
        assert relay.guest_path == f"{guest_dir}/fork.sock"
        assert (guest_dir.stat().st_mode & 0o777) == 0o700
        for n in range(3):  # several connections at once, each its own stream
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(relay.guest_path)
            relay.listener.settimeout(10)
            host, _ = relay.listener.accept()
            host.settimeout(10)
            c.settimeout(10)
            payload = bytes(range(256)) * (400 + n)  # binary, larger than one frame
            c.sendall(payload)
            got = b""
            while len(got) < len(payload):
                got += host.recv(1 << 16)
            assert got == payload
            host.sendall(b"reply %d\n" % n)
            assert c.recv(100) == b"reply %d\n" % n
            conns.append((c, host))
        c, host = conns[0]
        c.close()  # the guest side ends: the host side sees the end
        assert host.recv(10) == b""
        c, host = conns[1]
        host.close()  # the host side ends: the guest side sees the end
        assert c.recv(10) == b""
        proc = relay._proc
        assert proc is not None and proc.poll() is None
    finally:
        relay.close()
        for pair in conns:
            for sock in pair:
                sock.close()
    assert proc.poll() is not None, "the guest relay outlived close()"
    assert not guest_dir.exists(), "the guest relay left its directory"


def test_a_frame_over_the_cap_ends_the_relay(tmp_path: Path) -> None:
    relay, _ = fake_relay(tmp_path, frame(READY, 0) + frame(OPEN, 1) + frame(DATA, 1, length=MAX_PAYLOAD + 1))
    try:
        host, _ = relay.listener.accept()
        host.settimeout(10)
        assert host.recv(10) == b"", "the connection of a relay that broke the protocol must end"
        host.close()
        assert wait_for(lambda: relay.error is not None)
        assert "bad frame" in str(relay.error)
        proc = relay._proc
        assert proc is not None and wait_for(lambda: proc.poll() is not None), "a hostile guest relay must be ended"
    finally:
        relay.close()


def test_an_unknown_kind_ends_the_relay(tmp_path: Path) -> None:
    relay, _ = fake_relay(tmp_path, frame(READY, 0) + frame(ord("X"), 1, b"??"))
    try:
        assert wait_for(lambda: relay.error is not None)
        assert not relay.alive
    finally:
        relay.close()


def test_frames_for_unknown_ids_are_dropped(tmp_path: Path) -> None:
    frames = frame(READY, 0) + frame(DATA, 7, b"nobody") + frame(CLOSE, 8) + frame(OPEN, 1) + frame(DATA, 9, b"lost")
    frames += frame(DATA, 1, b"mine")
    relay, _ = fake_relay(tmp_path, frames)
    try:
        host, _ = relay.listener.accept()
        host.settimeout(10)
        assert host.recv(100) == b"mine"
        assert relay.error is None and relay.alive
        host.close()
    finally:
        relay.close()


def test_connections_over_the_cap_and_reused_ids_are_refused(tmp_path: Path) -> None:
    extra = 5
    frames = frame(READY, 0) + b"".join(frame(OPEN, i) for i in range(1, MAX_CONNS + extra + 1)) + frame(OPEN, 1)
    relay, log = fake_relay(tmp_path, frames)
    try:
        accepted = []
        relay.listener.settimeout(10)
        for _ in range(MAX_CONNS):
            accepted.append(relay.listener.accept()[0])
        relay.listener.settimeout(0.5)
        with pytest.raises(TimeoutError):
            relay.listener.accept()

        def closes() -> list[int]:
            return [cid for kind, cid, _ in frames_in(log.read_bytes()) if kind == CLOSE]

        assert wait_for(lambda: len(closes()) == extra + 1), closes()
        assert sorted(closes()) == [1, *range(MAX_CONNS + 1, MAX_CONNS + extra + 1)]
        for conn in accepted:
            conn.close()
    finally:
        relay.close()


def test_a_guest_relay_that_never_says_ready_fails_in_bounded_time(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RelayError, match="did not start"):
        fake_relay(tmp_path, b"", start_timeout=1.0)
    assert time.monotonic() - start < 10


def test_closing_the_listener_ends_the_relay(tmp_path: Path) -> None:
    relay, _ = fake_relay(tmp_path, frame(READY, 0))
    proc = relay._proc
    relay.listener.close()  # what the runner does when it is done with the fork parent
    assert proc is not None and proc.poll() is not None
    assert not os.path.exists(relay._host_dir)


def test_header_layout_is_what_the_guest_writes() -> None:
    # One layout on both ends: 1-byte kind, 4-byte id, 4-byte length, big-endian.
    assert HEADER.size == 9 and struct.pack(">BII", DATA, 1, 2) == frame(DATA, 1, length=2)


#: A fake guest relay that says it listens, opens one connection, then never reads its stdin.
DEAF_GUEST = """
import sys, time
sys.stdout.buffer.write(bytes.fromhex(sys.argv[1])); sys.stdout.buffer.flush()
time.sleep(60)
"""


def test_a_guest_that_reads_nothing_is_ended_in_bounded_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forkrelay, "SEND_TIMEOUT", 1.0)
    frames = frame(READY, 0) + frame(OPEN, 1)
    relay = ForkRelay(lambda argv: [sys.executable, "-c", DEAF_GUEST, frames.hex()], "python3")
    try:
        host, _ = relay.listener.accept()
        host.settimeout(10)
        with contextlib.suppress(OSError):  # the relay may hang up on us while we still send
            host.sendall(b"x" * (4 << 20))  # far more than a pipe holds
        assert wait_for(lambda: relay.error is not None), "a relay stuck on a deaf guest"
        assert "read nothing" in str(relay.error)
        host.close()
    finally:
        start = time.monotonic()
        relay.close()
        assert time.monotonic() - start < 10


#: Another process (this user's; root's or another user's would be refused alike) that connects
#: straight to the relay's host socket, says a forked box's first words and waits for an answer.
STRANGER = """
import socket, sys
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
c.connect(sys.argv[1])
c.sendall(b"forged first message")
print("connected", flush=True)
c.settimeout(20)
try:
    print(repr(c.recv(100)))
except ConnectionResetError:
    print(repr(b""))
"""


def test_the_host_socket_hands_the_runner_only_the_relays_own_connections(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A process other than the relay that reaches the host socket (root, whatever the socket
    directory's mode; or this user's) is closed unread and logged; the relayed connection behind
    it is the one the runner accepts."""
    import subprocess

    guest_dir = tmp_path / "guest"

    def local(argv: Sequence[str]) -> list[str]:
        return [sys.executable, *argv[1:]]

    relay = ForkRelay(local, "python3", guest_dir=str(guest_dir))
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        stranger = subprocess.Popen(
            [sys.executable, "-c", STRANGER, relay.listener.getsockname()], stdout=subprocess.PIPE, text=True
        )
        # Queued first: the stranger's connection is the one accept() would return.
        assert stranger.stdout is not None
        assert stranger.stdout.readline().strip() == "connected"
        c.connect(relay.guest_path)
        c.sendall(b"from the box")
        relay.listener.settimeout(10)
        host, _ = relay.listener.accept()
        with host:
            host.settimeout(10)
            assert host.recv(100) == b"from the box"
        out, _ = stranger.communicate(timeout=30)
        assert out.strip() == "b''", out
        assert relay.listener.strangers == 1
        assert any("refused a connection from pid" in r.getMessage() for r in caplog.records)
    finally:
        c.close()
        relay.close()
