"""What the real boxlite wheel's REST client sends for an exec, its signals and a tunnel.

The REST runtime's ``spawn``/``run`` rest on these facts (``pytest_boxlite/runtimes/rest.py``, and
the SDK double's REST model, ``tests/sdk_double/rest.py`` point 6): the exec request carries no
user (so ``user=`` is refused rather than silently dropped), and ``signal``/``kill`` are requests
of their own.  Here the installed wheel's client (not the double) talks to a recording HTTP
stand-in on loopback, so a wheel that starts sending a user fails this test, saying the refusal
can be lifted.  The stand-in answers just enough for the client to go on; nothing runs.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import socketserver
import threading
from collections.abc import Iterator
from typing import Any

import boxlite  # the real wheel (a dependency of the plugin), not the SDK double
import pytest

pytestmark = pytest.mark.timeout(60)

BOX = {
    "box_id": "b1",
    "name": "wire",
    "status": "running",
    "created_at": "2026-01-01T00:00:00Z",
    "updated_at": "2026-01-01T00:00:00Z",
    "pid": None,
    "image": "alpine",
    "cpus": 1,
    "memory_mib": 512,
}


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Records each request (method, path, body) and answers as a BoxLite server would, minimally."""

    seen: list[tuple[str, str, str]]

    def _body(self) -> str:
        size = min(int(self.headers.get("Content-Length") or 0), 1 << 20)
        return self.rfile.read(size).decode("utf-8", "replace") if size else ""

    def _reply(self, code: int, obj: Any = None) -> None:
        data = b"" if obj is None else json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.seen.append(("GET", self.path, ""))
        if "/executions/" in self.path:  # the attach (no WebSocket here) and its status probe
            self._reply(200, {"execution_id": "e1", "status": "completed", "exit_code": 0})
        else:
            self._reply(200, {"capabilities": {}} if self.path.endswith("/config") else BOX)

    def do_POST(self) -> None:
        self.seen.append(("POST", self.path, self._body()))
        if self.path.endswith("/exec"):
            self._reply(200, {"execution_id": "e1"})
        elif self.path.endswith("/signal"):
            self._reply(204)
        elif "/network/tunnel" in self.path:
            self._reply(200, {"uri": "http://127.0.0.1:9/tunnel"})
        else:
            self._reply(200, BOX)

    def do_DELETE(self) -> None:
        self.seen.append(("DELETE", self.path, ""))
        self._reply(204)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the test reads `seen`
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[tuple[str, str, str]]]]:
    seen: list[tuple[str, str, str]] = []
    handler = type("Handler", (_Recorder,), {"seen": seen})
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(10)


def test_the_real_rest_client_sends_no_user_and_signals_by_request(
    recorder: tuple[str, list[tuple[str, str, str]]],
) -> None:
    url, seen = recorder

    async def drive() -> None:
        rt = boxlite.Boxlite.rest(boxlite.BoxliteRestOptions(url=url, credential=boxlite.ApiKeyCredential("k")))
        box = await asyncio.wait_for(rt.create(boxlite.BoxOptions(image="alpine"), name="wire"), 20)
        ex = await asyncio.wait_for(box.exec("id", ["-u"], [("A", "1")], False, "1000:1000", None, "/tmp"), 20)
        await asyncio.wait_for(ex.signal(15), 20)
        await asyncio.wait_for(ex.kill(), 20)

    asyncio.run(drive())
    execs = [json.loads(body) for method, path, body in seen if method == "POST" and path == "/v1/boxes/b1/exec"]
    assert len(execs) == 1, seen
    # The argv, env and working directory cross; the user asked for does not (no field for it).
    assert execs[0]["command"] == "id" and execs[0]["args"] == ["-u"]
    assert execs[0]["env"] == {"A": "1"} and execs[0]["working_dir"] == "/tmp"
    assert not {k for k in execs[0] if "user" in k or "uid" in k}, (
        f"the wheel's REST exec now sends a user ({execs[0]}): RemoteVmBox's refusal of user= can be lifted"
    )
    assert ("POST", "/v1/boxes/b1/executions/e1/signal", '{"signal":15}') in seen
    assert ("DELETE", "/v1/boxes/b1/executions/e1", "") in seen
