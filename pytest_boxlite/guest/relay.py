"""The guest end of a VM's fork relay: forked boxes' connections, carried over one command's stdio.

Standard library only; imports nothing of the package.  The host runs it in a VM through the
box's stdio bridge (``python3 -I -S -c <this source> DIR``) once per fork parent, and the host end
(:mod:`pytest_boxlite.runtimes._forkrelay`) reads it.  A VM guest cannot reach a host socket: the
SDK's exec streams are the only way out, so this process listens on ``DIR/fork.sock`` (``DIR`` a
new directory, mode 0700, that it creates and that must not exist) and multiplexes every
connection a forked box makes there over its own stdin and stdout, in frames:

    kind (1 byte) | connection id (4 bytes, big-endian) | length (4 bytes) | payload

``R`` (guest to host, once, id 0): listening.  ``O`` (guest to host): connection ``id`` opened.
``D``: ``length`` bytes of connection ``id``'s stream.  ``C``: connection ``id`` ended (either
way).  Each end checks what the other sends: a payload over :data:`MAX_PAYLOAD` or an unknown
kind ends the relay (the stream cannot be resynchronised); frames for unknown ids are dropped.
At most :data:`MAX_CONNS` connections are open at once; more are refused (closed at once).
The relay ends when its stdin ends (the host is done, or gone), removing its directory.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import sys

HEADER = struct.Struct(">BII")
READY, OPEN, DATA, CLOSE = ord("R"), ord("O"), ord("D"), ord("C")
KINDS = (READY, OPEN, DATA, CLOSE)
#: Largest payload of one frame, either way.
MAX_PAYLOAD = 64 * 1024
#: Connections open at once: a fork parent has one box running and at most one made ahead.
MAX_CONNS = 32


def frame(kind: int, cid: int, payload: bytes = b"") -> bytes:
    """One frame's bytes."""
    return HEADER.pack(kind, cid, len(payload)) + payload


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def main(argv: list[str]) -> int:
    directory = argv[0]
    os.mkdir(directory, 0o700)  # must be new: nothing else may have been listening there
    path = os.path.join(directory, "fork.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(MAX_CONNS)
    out, inp = sys.stdout.fileno(), sys.stdin.fileno()
    conns: dict[int, socket.socket] = {}  # id -> socket
    ids: dict[int, int] = {}  # socket fileno -> id
    next_id = 1
    buf = b""
    try:
        _write_all(out, frame(READY, 0))
        while True:
            ready, _, _ = select.select([listener, inp, *conns.values()], [], [])
            for r in ready:
                if r is listener:
                    conn, _ = listener.accept()
                    if len(conns) >= MAX_CONNS:
                        conn.close()
                        continue
                    cid, next_id = next_id, next_id + 1
                    conns[cid] = conn
                    ids[conn.fileno()] = cid
                    _write_all(out, frame(OPEN, cid))
                elif r == inp:
                    chunk = os.read(inp, 1 << 16)
                    if not chunk:
                        return 0  # the host is done with this relay
                    buf += chunk
                    while len(buf) >= HEADER.size:
                        kind, cid, length = HEADER.unpack_from(buf)
                        if kind not in (DATA, CLOSE) or length > MAX_PAYLOAD:
                            sys.stderr.write("boxlite fork relay: bad frame from the host (kind %d)\n" % kind)
                            return 2
                        if len(buf) < HEADER.size + length:
                            break
                        payload, buf = buf[HEADER.size : HEADER.size + length], buf[HEADER.size + length :]
                        known = conns.get(cid)
                        if known is None:
                            continue  # already closed here
                        if kind == DATA:
                            try:
                                known.sendall(payload)
                                continue
                            except OSError:
                                _write_all(out, frame(CLOSE, cid))
                        del ids[known.fileno()]
                        del conns[cid]
                        known.close()
                else:
                    assert isinstance(r, socket.socket)  # neither the listener nor stdin: a connection
                    cid = ids[r.fileno()]
                    try:
                        data = r.recv(MAX_PAYLOAD)
                    except OSError:
                        data = b""
                    if data:
                        _write_all(out, frame(DATA, cid, data))
                        continue
                    _write_all(out, frame(CLOSE, cid))
                    del ids[r.fileno()]
                    del conns[cid]
                    r.close()
    finally:
        listener.close()
        for conn in conns.values():
            conn.close()
        try:
            os.unlink(path)
            os.rmdir(directory)
        except OSError:
            pass  # the box's end removes it anyway


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:
        sys.exit(0)  # the host hung up first
