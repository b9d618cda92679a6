"""The vm runtime over the SDK's REST client (``--boxlite-url``), against the real wheel and the double.

Three layers:

* **Conformance**: the double's REST surface (``Boxlite.rest``, ``BoxliteRestOptions``,
  ``ApiKeyCredential``, ``CopyOptions``, ``Box.copy_in``) has the installed wheel's signatures,
  and the client-side refusals (host volumes, timer order, an unreachable server) are the same
  on both, error classes and messages included.
* **The real wheel's REST client on the wire**: a scripted HTTP server (this file; it only answers
  the three bookkeeping requests) receives what :class:`RestRuntime` makes the real client send,
  so the lease timers, the absence of volumes and the bearer key are checked on the real client.
* **Through the double's server** (a real process holding real sandboxes): uploads, retries on
  dropped connections, bounded slow calls, a bad key, and the dead-man switch: boxes of a runtime
  that stopped renewing are stopped, then deleted, by the server's timers; a new runtime reaps
  stopped leftovers.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boxlite as real
import pytest
import sdk_double as double
from sdk_double.rest import RestBox, RestBoxlite, ServerProcess, set_faults
from subruns import wait_until

from pytest_boxlite.errors import BoxStartError, BoxTimeoutError, ConfigError, RuntimeUnavailableError
from pytest_boxlite.runtimes import choose
from pytest_boxlite.runtimes import rest as rest_mod
from pytest_boxlite.runtimes.rest import RestRuntime, Secret, remote_target
from pytest_boxlite.spec import BoxSpec

pytestmark = pytest.mark.timeout(120)
KEY = "blk_test_3b1f9e0c7d"


def _sig(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "<no signature>"


# -- conformance -----------------------------------------------------------------------------------
REST_SURFACE = [
    (real.BoxliteRestOptions, double.BoxliteRestOptions, "__init__"),
    (real.BoxliteRestOptions, double.BoxliteRestOptions, "from_env"),
    (real.ApiKeyCredential, double.ApiKeyCredential, "__init__"),
    (real.ApiKeyCredential, double.ApiKeyCredential, "from_env"),
    (real.ApiKeyCredential, double.ApiKeyCredential, "get_token"),
    (real.CopyOptions, double.CopyOptions, "__init__"),
    (real.Boxlite, double.Boxlite, "rest"),
    (real.Box, RestBox, "copy_in"),
    (real.Box, RestBox, "copy_out"),
    (real.Box, RestBox, "exec"),
    (real.Box, RestBox, "start"),
    (real.Box, RestBox, "stop"),
    (real.Box, RestBox, "info"),
    *[
        (real.Boxlite, RestBoxlite, m)
        for m in ("create", "get", "get_info", "list_info", "remove", "shutdown", "close")
    ],
]


@pytest.mark.parametrize(("real_cls", "dbl_cls", "member"), REST_SURFACE, ids=lambda x: getattr(x, "__name__", x))
def test_rest_double_matches_the_installed_wheel(real_cls: Any, dbl_cls: Any, member: str) -> None:
    want = _sig(real_cls if member == "__init__" else getattr(real_cls, member))
    got = _sig(dbl_cls if member == "__init__" else getattr(dbl_cls, member))
    assert got == want, f"{real_cls.__name__}.{member}{want} but the double has {got}: update the double"


@pytest.mark.parametrize("sdk", [real, double], ids=["wheel", "double"])
def test_credentials_never_show_in_reprs(sdk: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    opts = sdk.BoxliteRestOptions(url="http://127.0.0.1:9", credential=sdk.ApiKeyCredential(KEY))
    assert KEY not in repr(opts) and KEY not in str(opts) and "***" in repr(opts)
    monkeypatch.setenv("BOXLITE_REST_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("BOXLITE_API_KEY", KEY)
    assert KEY not in repr(sdk.BoxliteRestOptions.from_env())
    monkeypatch.delenv("BOXLITE_API_KEY")
    assert sdk.ApiKeyCredential.from_env() is None
    monkeypatch.delenv("BOXLITE_REST_URL")
    with pytest.raises(sdk.ConfigError, match="BOXLITE_REST_URL not set"):
        sdk.BoxliteRestOptions.from_env()


def _run(coro_factory: Any) -> Any:
    async def go() -> Any:
        return await coro_factory()

    return asyncio.run(go())


@pytest.mark.parametrize("sdk", [real, double], ids=["wheel", "double"])
def test_client_side_refusals_are_the_wheels(sdk: Any, tmp_path: Path) -> None:
    """Nothing listens on port 9: what the client refuses before sending anything shows first."""
    rt = sdk.Boxlite.rest(sdk.BoxliteRestOptions(url="http://127.0.0.1:9"))
    vol = sdk.BoxOptions(image="python:3.11-slim", volumes=[(str(tmp_path), "/x", True)])
    with pytest.raises(sdk.UnsupportedError, match="host bind mounts are only supported by the local runtime"):
        _run(lambda: rt.create(vol, name="pbx-x-1"))
    order = sdk.BoxOptions(image="python:3.11-slim", auto_stop=60, auto_delete=60)
    with pytest.raises(sdk.ConfigError, match="auto_delete must be greater than auto_stop"):
        _run(lambda: rt.create(order, name="pbx-x-1"))
    with pytest.raises(sdk.NetworkError, match=r"^network error: connect failed reaching http://127.0.0.1:9/v1/boxes"):
        _run(rt.list_info)
    assert _run(lambda: rt.shutdown()) == ()  # the client does not own the server


# -- the real client on the wire -------------------------------------------------------------------
class _Scripted(BaseHTTPRequestHandler):
    """Answers list/create/delete as a BoxLite server would (bodies from BoxLite's own client tests)."""

    seen: list[tuple[str, str, str | None, bytes]] = []

    def _reply(self, status: int, body: dict[str, Any] | None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _box(self, name: str) -> dict[str, Any]:
        return {
            "box_id": "01HJK4TNRPQSXYZ8WM6NCVT9R5",
            "name": name,
            "status": "configured",
            "created_at": "2026-01-01T00:00:00Z",
            "updated_at": "2026-01-01T00:00:00Z",
            "pid": None,
            "image": "python:3.11-slim",
            "cpus": 1,
            "memory_mib": 512,
            "labels": {},
        }

    def _handle(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n) if n else b""
        self.seen.append((self.command, self.path, self.headers.get("authorization"), body))
        if self.command == "GET" and self.path == "/v1/boxes":
            self._reply(200, {"boxes": [self._box("pbx-dead01-1") | {"status": "stopped"}]})
        elif self.command == "POST" and self.path == "/v1/boxes":
            self._reply(201, self._box(json.loads(body)["name"]))
        elif self.command == "DELETE":
            self._reply(204, None)
        else:
            self._reply(404, {"error": {"message": "nope", "type": "NotFoundError", "code": "not_found"}})

    do_GET = do_POST = do_DELETE = _handle

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[str]:
    _Scripted.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_real_client_sends_leases_no_volumes_and_the_bearer_key(scripted: str, tmp_path: Path) -> None:
    target = remote_target(scripted, credential_file=None, max_boxes=2, environ={"BOXLITE_API_KEY": KEY})
    rt = RestRuntime(target, tmp_path / "scratch", "abc123")  # the real boxlite wheel
    try:
        spec = BoxSpec(image="python:3.11-slim", mounts=(str(tmp_path),), network=False)
        box = rt.register_box(spec, "pbx-abc123-1")
        assert box.name == "pbx-abc123-1"
    finally:
        rt.close()
    methods = [(m, p) for m, p, _, _ in _Scripted.seen]
    # Opening lists the server and reaps the stopped box of a dead owner; then the create.
    assert methods[:3] == [("GET", "/v1/boxes"), ("DELETE", "/v1/boxes/pbx-dead01-1?force=true"), ("POST", "/v1/boxes")]
    assert rt.reaped == ["pbx-dead01-1 (on " + target.display + ", lease lapsed)"]
    assert {a for _, _, a, _ in _Scripted.seen} == {f"Bearer {KEY}"}
    create = json.loads(_Scripted.seen[2][3])
    assert create["auto_stop"] == rest_mod.DEFAULT_LEASE and create["auto_delete"] == 2 * rest_mod.DEFAULT_LEASE
    assert "volumes" not in create and create["network"] == {"mode": "disabled"}
    assert not (tmp_path / "scratch").exists()


# -- settings --------------------------------------------------------------------------------------
def test_remote_target_checks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must not carry credentials"):
        remote_target(f"https://me:{KEY}@boxes:8100", credential_file=None, max_boxes=1, environ={})
    with pytest.raises(ConfigError, match="not an http"):
        remote_target("boxes:8100", credential_file=None, max_boxes=1, environ={})
    with pytest.raises(ConfigError, match="cannot read it"):
        remote_target("https://boxes:8100", credential_file=str(tmp_path / "none"), max_boxes=1, environ={})
    (tmp_path / "two").write_text("a b\n")
    with pytest.raises(ConfigError, match="does not hold one API key"):
        remote_target("https://boxes:8100", credential_file=str(tmp_path / "two"), max_boxes=1, environ={})
    (tmp_path / "key").write_text(KEY + "\n")
    t = remote_target("https://boxes:8100/api/?x=1", credential_file=str(tmp_path / "key"), max_boxes=3, environ={})
    assert t.credential is not None and t.credential.reveal() == KEY
    assert t.display == "https://boxes:8100/api" and f"file {tmp_path / 'key'}" == t.credential_source
    for text in (repr(t), str(t), t.reason, repr(t.credential), choose("auto", t).reason, repr(choose("vm", t))):
        assert KEY not in text
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(Secret(KEY))
    with pytest.raises(ConfigError, match="cannot be combined"):
        choose("namespace", t)
    assert choose("auto", t).kind == "vm"  # whatever this host can boot
    env_t = remote_target("http://h:1", credential_file=None, max_boxes=1, environ={"BOXLITE_API_KEY": KEY})
    assert env_t.credential_source == "environment variable BOXLITE_API_KEY"


# -- through the double's server -------------------------------------------------------------------
@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path / "server-host", key=KEY)
    try:
        yield srv
    finally:
        srv.stop()


def _runtime(srv: ServerProcess, tmp_path: Path, owner: str, *, lease: int = 120, key: str = KEY) -> RestRuntime:
    env = {"BOXLITE_API_KEY": key, rest_mod.LEASE_ENV: str(lease)}
    target = remote_target(srv.url, credential_file=None, max_boxes=2, environ=env)
    return RestRuntime(target, tmp_path / f"scratch-{owner}", owner, sdk=double)


def test_upload_replaces_volumes_and_writes_stay_in_the_box(server: ServerProcess, tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "pkg").mkdir(parents=True)
    (project / "pkg" / "mod.py").write_text("VALUE = 42\n")
    os.symlink("/etc/passwd", project / "link")  # uploaded as a link, never followed on the host
    rt = _runtime(server, tmp_path, "up1")
    try:
        box = rt.create_box(BoxSpec(mounts=(str(project),)), "pbx-up1-1", timeout=60)
        raw = box.exec(["python3", "-c", "import mod; print(mod.VALUE)"], cwd=str(project / "pkg"), timeout=20)
        assert (raw.exit_code, raw.stdout) == (0, b"42\n"), raw.stderr
        raw = box.exec(["sh", "-c", 'readlink "$0"/link && echo new > "$0"/pkg/mod.py', str(project)], timeout=20)
        assert raw.exit_code == 0 and raw.stdout == b"/etc/passwd\n"
        assert (project / "pkg" / "mod.py").read_text() == "VALUE = 42\n"  # the host copy is untouched
        # One upload per box: the fingerprint is recorded in it, a second upload is skipped.
        marks = box.exec(["ls", rest_mod.UPLOAD_MARKS], timeout=10).stdout.split()
        assert len(marks) == 1
        rt._upload(box, (str(project),), 30)
        assert box.exec(["cat", str(project / "pkg" / "mod.py")], timeout=10).stdout == b"new\n"
        box.destroy()
        assert server.boxes() == []
    finally:
        rt.close()


def test_dropped_connections_are_retried_and_slow_calls_bounded(
    server: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = _runtime(server, tmp_path, "net1")
    try:
        set_faults(server.home, drop=2, ops=["list", "create"])
        box = rt.create_box(BoxSpec(), "pbx-net1-1", timeout=60)
        assert [r.name for r in rt.list_boxes()] == ["pbx-net1-1"]
        assert server.log().count("dropped") == 2
        set_faults(server.home, drop=3, ops=["remove"])
        box.destroy()
        assert server.boxes() == []
        # A create the server carried out but whose answer was lost: the retry finds the box by name
        # (the server says "already exists"), it is not created twice nor reported as a failure.
        set_faults(server.home, lose=1, ops=["create"])
        box = rt.create_box(BoxSpec(), "pbx-net1-2", timeout=60)
        assert "lost the answer to create" in server.log()
        assert [b["name"] for b in server.boxes()] == ["pbx-net1-2"]
        assert box.exec(["true"], timeout=10).exit_code == 0
        box.destroy()
        # A name that really exists already is an error, not silently someone else's box.
        set_faults(server.home)
        other = rt.create_box(BoxSpec(), "pbx-net1-3", timeout=60)
        with pytest.raises(BoxStartError, match="already exists"):
            rt.create_box(BoxSpec(), "pbx-net1-3", timeout=60)
        other.destroy()
        # More drops than attempts: the error says what failed (a network error), after bounded tries.
        set_faults(server.home, drop=10, ops=["list"])
        with pytest.raises(double.NetworkError):
            rt.list_boxes()
        # An answer slower than the per-call bound: a timeout per attempt, a bounded total.
        monkeypatch.setattr(rest_mod, "CALL_TIMEOUT", 0.5)
        monkeypatch.setattr(rest_mod, "ATTEMPTS", 2)
        set_faults(server.home, delay=3.0, ops=["list"])
        started = time.monotonic()
        with pytest.raises(BoxTimeoutError, match="did not finish within"):
            rt.list_boxes()
        assert time.monotonic() - started < 3.0
    finally:
        set_faults(server.home)
        rt.close()


def test_a_wrong_key_is_a_clear_error_without_the_key(server: ServerProcess, tmp_path: Path) -> None:
    wrong = "blk_wrong_5d0a1c"
    with pytest.raises(RuntimeUnavailableError, match=r"auth: unauthorized \(HTTP 401\)") as info:
        _runtime(server, tmp_path, "auth1", key=wrong)
    assert wrong not in str(info.value) and KEY not in str(info.value)


def test_timers_remove_a_dead_runtimes_boxes_and_the_next_one_reaps(server: ServerProcess, tmp_path: Path) -> None:
    dead = _runtime(server, tmp_path, "dead01", lease=2)
    live = _runtime(server, tmp_path, "live01", lease=2)

    def status(name: str) -> str | None:
        return next((b["status"] for b in server.boxes() if b["name"] == name), None)

    def die(rt: RestRuntime) -> None:
        # The owner dies: nothing renews its leases any more (what a SIGKILL leaves behind).
        rt._stop_renewal.set()
        rt._renewer.join(10)

    try:
        dead.create_box(BoxSpec(), "pbx-dead01-1", timeout=60)
        kept = live.create_box(BoxSpec(), "pbx-live01-1", timeout=60)
        die(dead)
        # Nobody reaps: the server's own timers stop the box, then delete it.
        assert wait_until(lambda: status("pbx-dead01-1") == "stopped", timeout=20), server.boxes()
        assert wait_until(lambda: status("pbx-dead01-1") is None, timeout=30), server.boxes()
        assert "auto-stopped pbx-dead01-1" in server.log() and "auto-deleted pbx-dead01-1" in server.log()
        # The live session's box outlived all of that: its lease is renewed.
        assert status("pbx-live01-1") == "running"
        assert kept.exec(["true"], timeout=10).exit_code == 0
    finally:
        dead.close()
    # A session that opens while a dead owner's box is stopped (not yet deleted) reaps it.
    dead2 = _runtime(server, tmp_path, "dead02", lease=2)
    try:
        dead2.create_box(BoxSpec(), "pbx-dead02-1", timeout=60)
        die(dead2)
        assert wait_until(lambda: status("pbx-dead02-1") == "stopped", timeout=20), server.boxes()
        reaper = _runtime(server, tmp_path, "next01", lease=2)
        reaper.close()
        assert [r.split()[0] for r in reaper.reaped] == ["pbx-dead02-1"]  # never the live session's box
        assert status("pbx-dead02-1") is None and "auto-deleted pbx-dead02-1" not in server.log()
        assert status("pbx-live01-1") == "running"
    finally:
        dead2.close()
        live.close()


def test_a_credential_file_is_never_uploaded(server: ServerProcess, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / ".boxlite-key").write_text(KEY)
    target = remote_target(server.url, credential_file=str(project / ".boxlite-key"), max_boxes=1, environ={})
    rt = RestRuntime(target, tmp_path / "scratch", "cred1", sdk=double)
    try:
        with pytest.raises(ConfigError, match="keep the server's key outside the project"):
            rt.create_box(BoxSpec(mounts=(str(project),)), "pbx-cred1-1", timeout=60)
        assert server.boxes() == []  # the box it had booted is gone again
    finally:
        rt.close()


def test_ls_shows_other_peoples_box_names_safely(server: ServerProcess, tmp_path: Path) -> None:
    """Box names on a shared server are anyone's: ``ls`` never prints control characters from them."""
    rt = _runtime(server, tmp_path, "ls1")
    try:
        hostile = "evil\x1b]0;pwned\x07\x1b[2J" + "x" * 200
        box = rt.create_box(BoxSpec(), hostile, timeout=60)
        rows = rest_mod.server_boxes(rt.target, tmp_path, sdk=double)
        (row, owner) = next((r, o) for r, o in rows if r.name.startswith("evil"))
        assert owner is None and row.name.isprintable() and len(row.name) <= 80 and "\x1b" not in row.name
        box.destroy()
    finally:
        rt.close()
