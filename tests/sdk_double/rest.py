"""The SDK double's REST runtime: ``Boxlite.rest(BoxliteRestOptions(...))`` and a ``boxlite serve``.  TESTS ONLY.

The server is a real separate process (``python -m sdk_double.serve --home H``) holding the
local double's runtime on its own home: its boxes are its children, so they outlive any client, as
boxes on a ``boxlite serve`` host outlive the pytest session that made them.  Clients speak to it
over TCP on a loopback port, one JSON request per connection (standing in for the HTTP API).  What
it reproduces of the real REST runtime (0.10.8 wheel, ``src/boxlite/src/rest/`` in BoxLite's source):

1. the client refuses host volumes (``UnsupportedError``, the real message), host ports, and a
   lifecycle policy whose ``auto_delete`` is not above ``auto_stop`` (``ConfigError``), before any
   request goes out;
2. server-side timers: ``auto_stop`` seconds without use stop a box (a ``configured`` one is
   stopped too), ``auto_delete`` seconds after it stopped the server deletes it; ``auto_resume``
   (default true) restarts a stopped box on exec.  "Use" is any call naming the box (an exec,
   a start, a get); which calls the real server counts is unverified;
3. the bearer key: a server started with ``--api-key-file`` answers other keys with 401, which the
   client maps, as the real one does, to ``ConfigError("auth: ...")``;
4. transport errors: an unreachable server, or a connection the server drops, is a
   ``NetworkError("network error: ...")``; ``get``/``get_info`` of a missing box give ``None``;
   ``shutdown`` is a no-op (the client does not own the server);
5. ``Box.copy_in(host_path, container_dest, copy_options)``: a tar of the host path (or of its
   contents, for ``SRC/.``), symlinks not followed, written into the box by the box's own
   interpreter;
6. ``Box.exec``'s request carries what the real one does and no more: the real client's
   ``ExecRequest`` (``src/boxlite/src/rest/types.rs``) has ``command``, ``args``, ``env`` (a
   map), ``timeout_seconds``, ``working_dir`` and ``tty``, and no user, so the client drops the
   ``user`` argument without a word (what the 0.10.8 wheel sends: ``tests/test_rest_exec_wire.py``): a
   command runs as the box's default user whatever ``user`` says.  The execution then streams
   stdin, stdout and stderr (one WebSocket, ``/boxes/{id}/executions/{eid}/attach``, stdout and
   stderr decoded lossily as UTF-8 per frame) and takes ``signal`` and ``kill`` as requests
   (``POST .../signal``, ``DELETE .../executions/{eid}``; ``rest/litebox.rs``, ``rest/exec.rs``):
   :class:`RestExecution` makes them (the server logs ``signal BOX N``), then delivers them.

Faults are injected through ``<home>/faults.json``, read on every request (see :func:`set_faults`):
``{"drop": N, "every": M, "lose": L, "delay": SECONDS, "ops": [...]}`` drops the next N connections
of those ops, then every M-th, without an answer (a reset the client reports as a network error),
carries out the next L but resets the connection instead of answering (the answer is lost), and
delays every answer.

Data plane: an exec's stdio, and its signals once the server answered their request, go straight
to the box's agent socket in the server's home (the same machine), not through the server; the
real SDK carries stdio over a WebSocket (point 6).  So exec semantics are the local double's
(which the real REST client's match: streamed stdin, lossily decoded output, signals to the
leader), the exec request aside (point 6), and throughput says nothing about a real network.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import sys
import tarfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from boxlite.errors import (
    AlreadyExistsError,
    BoxliteError,
    ConfigError,
    ExecutionError,
    InternalError,
    InvalidArgumentError,
    InvalidStateError,
    NetworkError,
    NotFoundError,
    StoppedError,
    UnsupportedError,
)

import sdk_double as local

#: Error classes by the wire's ``code`` (the real client dispatches on it: ``rest/error.rs``).
_CODES: dict[str, type[BoxliteError]] = {
    "invalid_argument": InvalidArgumentError,
    "unsupported": UnsupportedError,
    "not_found": NotFoundError,
    "already_exists": AlreadyExistsError,
    "invalid_state": InvalidStateError,
    "stopped": StoppedError,
    "execution_failed": ExecutionError,
    "network_unavailable": NetworkError,
    "config_error": ConfigError,
    "internal": InternalError,
}
_PREFIX = {NotFoundError: "not found: ", ConfigError: "configuration error: ", NetworkError: "network error: "}
#: The script that unpacks a copy_in tar (stdin) at its destination, inside the box.
_UNTAR = """
import os, sys, tarfile
dest = sys.argv[1]
os.makedirs(dest, exist_ok=True)
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
    # extraction filters exist from Python 3.11.4 on (the box may run an older 3.11)
    tar.extractall(dest, **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
"""


def _thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Blocking ``fn`` on a thread of its own, as a future of the running loop."""
    return local._in_thread(lambda: fn(*args, **kwargs))


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """An awaitable made at call time (as a pyo3 future is) running blocking ``fn`` on a thread of its own."""

    async def go() -> Any:
        return await local._in_thread(lambda: fn(*args, **kwargs))

    return local._awaitable(go())


def _error(code: str, message: str) -> BoxliteError:
    cls = _CODES.get(code, InternalError)
    return cls(_PREFIX.get(cls, "") + message)


def set_faults(
    home: Path, *, drop: int = 0, every: int = 0, lose: int = 0, delay: float = 0.0, ops: list[str] | None = None
) -> None:
    """Make the server at ``home`` drop the next ``drop`` requests (of ``ops``), and every ``every``-th
    one after that; carry out the next ``lose`` ones but drop their answers; answer after ``delay`` s."""
    tmp = home / "faults.json.tmp"
    tmp.write_text(json.dumps({"drop": drop, "every": every, "lose": lose, "delay": delay, "ops": ops}))
    os.replace(tmp, home / "faults.json")


# -- client ----------------------------------------------------------------------------------------
class AccessToken:
    """``boxlite.AccessToken``."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.expires_at = None

    def __repr__(self) -> str:
        return "AccessToken(token='***', expires_at=None)"


class ApiKeyCredential:
    """``boxlite.ApiKeyCredential``: its repr hides the key, as the real one's does."""

    def __init__(self, key):  # type: ignore[no-untyped-def]
        self._key = str(key)

    @staticmethod
    def from_env():  # type: ignore[no-untyped-def]
        key = os.environ.get("BOXLITE_API_KEY")
        return ApiKeyCredential(key) if key else None

    def get_token(self, /):  # type: ignore[no-untyped-def]
        return AccessToken(self._key)

    def __repr__(self) -> str:
        return "ApiKeyCredential(***)"


class BoxliteRestOptions:
    """``boxlite.BoxliteRestOptions``."""

    def __init__(self, url, credential=None, path_prefix=None):  # type: ignore[no-untyped-def]
        self.url = url
        self.credential = credential
        self.path_prefix = path_prefix

    @staticmethod
    def from_env():  # type: ignore[no-untyped-def]
        url = os.environ.get("BOXLITE_REST_URL")
        if not url:
            raise ConfigError("configuration error: BOXLITE_REST_URL not set")
        return BoxliteRestOptions(url, ApiKeyCredential.from_env(), os.environ.get("BOXLITE_REST_PATH_PREFIX"))

    def __repr__(self) -> str:
        cred = "None" if self.credential is None else repr(self.credential)
        return f'BoxliteRestOptions(url="{self.url}", credential={cred}, path_prefix={self.path_prefix!r})'


class CopyOptions:
    """``boxlite.CopyOptions``."""

    def __init__(self, recursive=True, overwrite=True, follow_symlinks=False):  # type: ignore[no-untyped-def]
        self.recursive = recursive
        self.overwrite = overwrite
        self.follow_symlinks = follow_symlinks


class _Client:
    """One request per connection to the server at ``url``, bounded by ``timeout`` per attempt."""

    def __init__(self, options: Any) -> None:
        parts = urllib.parse.urlsplit(str(options.url))
        if not parts.hostname or parts.port is None:
            raise ConfigError(f"configuration error: invalid URL {options.url!r}")
        self.url = str(options.url).rstrip("/")
        self.addr = (parts.hostname, parts.port)
        cred = options.credential
        self._token = cred.get_token().token if cred is not None else None

    def request(self, op: str, path: str, **args: Any) -> Any:
        where = f"{self.url}/v1{path}"
        try:
            conn = socket.create_connection(self.addr, timeout=600)
        except OSError as exc:
            raise NetworkError(
                f"network error: connect failed reaching {where}: error sending request for url ({where})"
            ) from exc
        with conn:
            conn.sendall((json.dumps({"op": op, "auth": self._token, **args}) + "\n").encode())
            buf = b""
            while not buf.endswith(b"\n"):
                try:
                    chunk = conn.recv(1 << 16)
                except OSError:
                    chunk = b""
                if not chunk:
                    raise NetworkError(
                        f"network error: request to {where} failed: connection closed before message completed"
                    )
                buf += chunk
        reply = json.loads(buf)
        if "error" in reply:
            err = reply["error"]
            if reply.get("status") == 401:
                raise ConfigError(f"configuration error: auth: unauthorized (HTTP 401): {err['message']}")
            raise _error(err["code"], err["message"])
        return reply["ok"]


class _Remote:
    """What an Execution needs of a box: where its logs are (the server's box directory)."""

    def __init__(self, box_dir: str) -> None:
        self.dir = Path(box_dir)


class RestExecution(local.Execution):
    """``boxlite.Execution`` of a REST box: ``signal`` is ``POST /boxes/{id}/executions/{eid}/signal``
    and ``kill`` is ``DELETE /boxes/{id}/executions/{eid}`` (``rest/exec.rs``, and what the wheel
    sends: ``tests/test_rest_exec_wire.py``).  Each is a request to the server (the key, the faults,
    a use of the box) before the signal goes over the data plane; a failed request delivers nothing.
    An execution that has ended sends no request (what a real server answers then is unverified)."""

    def __init__(self, client: _Client, box_id: str, *args: Any) -> None:
        super().__init__(*args)
        self._client = client
        self._box_id = box_id

    def _request(self, op: str, path: str, deliver: Any, **args: Any) -> Any:
        async def send() -> None:
            if self._done.done():
                return
            await _thread(self._client.request, op, path, box=self._box_id, **args)
            await deliver()

        return local._awaitable(send())

    def signal(self, /, signal):  # type: ignore[no-untyped-def]
        path = f"/boxes/{self._box_id}/executions/{self.id()}/signal"
        return self._request("signal", path, lambda: super(RestExecution, self).signal(signal), signal=int(signal))

    def kill(self, /):  # type: ignore[no-untyped-def]
        path = f"/boxes/{self._box_id}/executions/{self.id()}"
        return self._request("kill", path, lambda: super(RestExecution, self).kill())


class RestBox:
    """``boxlite.Box`` of a REST runtime: a handle by id; every operation is a request."""

    def __init__(self, client: _Client, info: dict[str, Any]) -> None:
        self._client = client
        self._info = info

    @property
    def id(self) -> str:
        return str(self._info["id"])

    @property
    def name(self) -> str | None:
        name: str | None = self._info["name"]
        return name

    def start(self, /):  # type: ignore[no-untyped-def]
        return _call(self._client.request, "start", f"/boxes/{self.id}/start", box=self.id)

    def stop(self, /):  # type: ignore[no-untyped-def]
        return _call(self._client.request, "stop", f"/boxes/{self.id}/stop", box=self.id)

    def info(self, /):  # type: ignore[no-untyped-def]
        async def info() -> local.BoxInfo:
            return _info(await _thread(self._client.request, "get", f"/boxes/{self.id}", box=self.id))

        return local._awaitable(info())

    def exec(self, /, command, args=None, env=None, tty=False, user=None, timeout_secs=None, cwd=None):  # type: ignore[no-untyped-def]
        if env is not None:
            env = local.BoxOptions._env(env)

        async def run() -> RestExecution:
            where = await _thread(self._client.request, "exec", f"/boxes/{self.id}/exec", box=self.id)
            merged = dict(where["env"])
            merged.update(env or [])
            argv = [str(command), *(str(a) for a in (args or []))]
            loop = asyncio.get_running_loop()
            # user=None: the REST ExecRequest has no user field (point 6 above), whatever was asked.
            sock, fds, rest = await local._in_thread(
                local.spawn, Path(where["agent"]), self.id, argv, merged, cwd, None
            )
            remote = _Remote(where["dir"])
            return RestExecution(self._client, self.id, remote, sock, fds, rest, loop, os.urandom(8).hex())

        return local._awaitable(run())

    def copy_in(self, /, host_path, container_dest, copy_options=None):  # type: ignore[no-untyped-def]
        """Tar ``host_path`` (its contents for ``SRC/.``) and unpack it at ``container_dest`` in the box."""

        async def copy() -> None:
            src = str(host_path)
            contents = src.endswith("/.")
            root = Path(src[:-2] if contents else src)
            if not root.exists():
                raise NotFoundError(f"not found: {root}")
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                if contents and root.is_dir():
                    for child in sorted(root.iterdir()):
                        tar.add(child, child.name)  # symlinks stay symlinks (follow_symlinks=False)
                else:
                    tar.add(root, root.name)
            argv = ["-I", "-S", "-c", _UNTAR, str(container_dest)]
            ex = await self.exec("python3", argv, None, False, None, None, "/")
            stdin = ex.stdin()
            data = buf.getvalue()
            for off in range(0, len(data), 1 << 20):
                await stdin.send_input(data[off : off + (1 << 20)])
            await stdin.close()
            err = []
            async for chunk in ex.stderr():
                err.append(chunk)
            result = await ex.wait()
            if result.exit_code != 0:
                raise ExecutionError(f"copy_in to {container_dest} failed: {''.join(err)[-500:]}")

        return local._awaitable(copy())

    def copy_out(self, /, container_src, host_dest, copy_options=None):  # type: ignore[no-untyped-def]
        async def nothing() -> None:
            raise UnsupportedError("sdk double: copy_out is not modelled (pytest-boxlite does not use it)")

        return local._awaitable(nothing())


def _info(rec: dict[str, Any]) -> local.BoxInfo:
    info = local.BoxInfo(rec)
    info.auto_stop = rec.get("auto_stop")  # type: ignore[attr-defined]
    info.auto_delete = rec.get("auto_delete")
    return info


class RestBoxlite:
    """``Boxlite.rest(options)``: the REST runtime (same methods as a local one)."""

    def __init__(self, options: Any) -> None:
        self._client = _Client(options)

    def create(self, /, options, name=None):  # type: ignore[no-untyped-def]
        async def create() -> RestBox:
            if options.volumes:
                raise UnsupportedError(
                    "unsupported: host bind mounts are only supported by the local runtime; "
                    "mount a managed volume by id or name instead"
                )
            if options.ports:
                raise UnsupportedError(
                    "unsupported: Host port publication (-p/ports) is local-only for remote runtimes."
                )
            stop, delete = options.auto_stop or 0, options.auto_delete or 0
            if delete > 0 and delete <= stop:
                raise ConfigError("configuration error: auto_delete must be greater than auto_stop")
            net = options.network
            mode = "enabled" if net is None else (getattr(net.outbound, "mode", None) or net.mode or "enabled")
            body = {
                "image": options.image,
                "env": options.env,
                "cpus": options.cpus,
                "memory_mib": options.memory_mib,
                "network": mode,
                "auto_stop": stop,
                "auto_delete": delete,
                "auto_resume": True if options.auto_resume is None else bool(options.auto_resume),
            }
            rec = await _thread(self._client.request, "create", "/boxes", options=body, name=name)
            return RestBox(self._client, rec)

        return local._awaitable(create())

    def get(self, /, id_or_name):  # type: ignore[no-untyped-def]
        async def get() -> RestBox | None:
            try:
                rec = await _thread(self._client.request, "get", f"/boxes/{id_or_name}", box=id_or_name)
            except NotFoundError:
                return None
            return RestBox(self._client, rec)

        return local._awaitable(get())

    def get_info(self, /, id_or_name):  # type: ignore[no-untyped-def]
        async def get_info() -> local.BoxInfo | None:
            try:
                rec = await _thread(self._client.request, "get", f"/boxes/{id_or_name}", box=id_or_name)
                return _info(rec)
            except NotFoundError:
                return None

        return local._awaitable(get_info())

    def list_info(self, /, _state=None):  # type: ignore[no-untyped-def]
        async def listing() -> list[local.BoxInfo]:
            return [_info(r) for r in await _thread(self._client.request, "list", "/boxes")]

        return local._awaitable(listing())

    def remove(self, /, id_or_name, force=False):  # type: ignore[no-untyped-def]
        path = f"/boxes/{id_or_name}" + ("?force=true" if force else "")
        return _call(self._client.request, "remove", path, box=id_or_name, force=force)

    def shutdown(self, /, timeout=None):  # type: ignore[no-untyped-def]
        async def nothing() -> tuple[()]:
            return ()  # the REST client does not own the server (pyo3 gives the unit value)

        return local._awaitable(nothing())

    def close(self, /):  # type: ignore[no-untyped-def]
        return None


def rest(options):  # type: ignore[no-untyped-def]
    """``Boxlite.rest``: synchronous, as the real one is; nothing is contacted until the first call."""
    return RestBoxlite(options)


# -- server ----------------------------------------------------------------------------------------
class Server:
    """``boxlite serve`` stand-in: the local double on ``home/server``, timers, faults, a bearer key."""

    def __init__(self, home: Path, key: str | None) -> None:
        self.home = home
        self.key = key
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.rt = self._run(self._open)
        self.mutex = threading.RLock()
        self.timers: dict[str, dict[str, Any]] = {}
        self.matched = 0
        self.log = open(home / "server.log", "a", buffering=1)  # noqa: SIM115 - the server's whole life

    async def _open(self) -> local.Boxlite:
        return local.Boxlite(local.Options(home_dir=str(self.home / "server")))

    def _run(self, factory: Any) -> Any:
        """Await ``factory()`` (an SDK call: it needs the running loop) on the server's loop."""

        async def go() -> Any:
            return await factory()

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(300)

    def _state(self, id_or_name: str) -> local._BoxState:
        state: local._BoxState = self.rt._rt.find(id_or_name)
        return state

    def _rec(self, state: local._BoxState) -> dict[str, Any]:
        t = self.timers.get(state.rec["id"], {})
        return dict(state.rec, auto_stop=t.get("auto_stop", 0), auto_delete=t.get("auto_delete", 0))

    def _touch(self, state: local._BoxState) -> None:
        t = self.timers.get(state.rec["id"])
        if t is not None:
            t["active"] = time.monotonic()

    def handle(self, req: dict[str, Any]) -> Any:
        op = req["op"]
        if op == "list":
            with self.rt._rt.mutex:
                return [self._rec(s) for s in self.rt._rt.boxes.values()]
        if op == "create":
            o = req["options"]
            net = local.NetworkSpec(outbound=local.OutboundNetworkSpec(mode=o["network"]))
            opts = local.BoxOptions(
                image=o["image"],
                env=[tuple(kv) for kv in o["env"]],
                cpus=o["cpus"],
                memory_mib=o["memory_mib"],
                network=net,
                auto_delete=0,  # the server's own timers below decide
            )
            box = self._run(lambda: self.rt.create(opts, name=req["name"]))
            state = box._state
            self.log.write(f"created {req['name']}\n")
            self.timers[state.rec["id"]] = {
                "auto_stop": o["auto_stop"],
                "auto_delete": o["auto_delete"],
                "auto_resume": o["auto_resume"],
                "active": time.monotonic(),
                "stopped_at": None,
            }
            return self._rec(state)
        state = self._state(req["box"])
        if op == "remove":
            self._run(lambda: self.rt.remove(req["box"], force=req["force"]))
            self.timers.pop(state.rec["id"], None)
            return None
        self._touch(state)
        t = self.timers.get(state.rec["id"], {})
        if op == "get":
            return self._rec(state)
        if op in ("signal", "kill"):
            self.log.write(f"{op} {req['box']} {req.get('signal', 9)}\n")
            return None  # delivered by the client over the data plane once this answer came
        if op == "stop":
            state.stop_blocking()
            t["stopped_at"] = time.monotonic()
            return None
        if op in ("start", "exec"):
            if state.rec["status"] == "stopped" and op == "exec" and not t.get("auto_resume", True):
                raise InvalidStateError(f"box {state.rec['id']} is stopped")
            state.start_blocking()
            t["stopped_at"] = None
            if op == "start":
                return None
            assert state.opts is not None
            env = dict(local._image_env())
            env.update(state.opts.env)
            return {"agent": str(state.dir / "ctl" / "agent.sock"), "dir": str(state.dir), "env": env}
        raise InvalidArgumentError(f"unknown operation {op!r}")

    def timers_loop(self) -> None:
        """auto_stop: idle running (or never started) boxes stop; auto_delete: stopped ones go."""
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            with self.mutex:
                for bid, t in list(self.timers.items()):
                    state = self.rt._rt.boxes.get(bid)
                    if state is None:
                        self.timers.pop(bid, None)
                        continue
                    status = state.rec["status"]
                    if status in ("running", "configured") and t["auto_stop"] and now - t["active"] > t["auto_stop"]:
                        self.log.write(f"auto-stopped {state.rec['name']}\n")
                        state.stop_blocking()
                        self.rt._rt.update(state.rec, status="stopped")
                        t["stopped_at"] = now
                    elif status == "stopped" and t["auto_delete"]:
                        t["stopped_at"] = t["stopped_at"] or now
                        if now - t["stopped_at"] > t["auto_delete"]:
                            self.log.write(f"auto-deleted {state.rec['name']}\n")
                            self.rt._rt.forget(state)
                            self.timers.pop(bid, None)

    def _lose(self, op: str) -> bool:
        """Whether the answer to this (carried out) request is to be lost."""
        path = self.home / "faults.json"
        try:
            f = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        ops = f.get("ops")
        lose = int(f.get("lose") or 0)
        if lose <= 0 or (ops is not None and op not in ops):
            return False
        f["lose"] = lose - 1
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(f))
        os.replace(tmp, path)
        return True

    def _faults(self, op: str) -> tuple[bool, float]:
        path = self.home / "faults.json"
        try:
            f = json.loads(path.read_text())
        except (OSError, ValueError):
            return False, 0.0
        ops = f.get("ops")
        if ops is not None and op not in ops:
            return False, float(f.get("delay") or 0)
        drop = int(f.get("drop") or 0)
        every = int(f.get("every") or 0)
        if drop <= 0 and every > 0:
            self.matched += 1
            return self.matched % every == 0, float(f.get("delay") or 0)
        if drop > 0:
            f["drop"] = drop - 1
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(f))
            os.replace(tmp, path)
        return drop > 0, float(f.get("delay") or 0)

    def serve_one(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = conn.recv(1 << 16)
                if not chunk:
                    return
                buf += chunk
            req = json.loads(buf)
            with self.mutex:
                drop, delay = self._faults(req.get("op", ""))
            if drop:
                self.log.write(f"dropped {req.get('op')}\n")
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                return
            if delay:
                time.sleep(delay)
            if self.key is not None and req.get("auth") != self.key:
                reply: dict[str, Any] = {"status": 401, "error": {"code": "unauthenticated", "message": "bad key"}}
            else:
                try:
                    with self.mutex:
                        reply = {"ok": self.handle(req)}
                        lost = self._lose(req.get("op", ""))
                    if lost:
                        self.log.write(f"lost the answer to {req.get('op')}\n")
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                        return
                except BoxliteError as exc:
                    reply = {"error": {"code": exc.code, "message": str(exc).split(": ", 1)[-1]}}
                except Exception as exc:  # noqa: BLE001 - a server answers 500, it does not die
                    reply = {"error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}}
            with contextlib.suppress(OSError):
                conn.sendall((json.dumps(reply) + "\n").encode())


def serve(home: Path, port: int, key_file: Path | None) -> None:
    """Run the server until killed; prints ``listening http://127.0.0.1:PORT`` once it accepts."""
    home.mkdir(parents=True, exist_ok=True)
    key = key_file.read_text().strip() if key_file is not None else None
    server = Server(home, key)
    threading.Thread(target=server.timers_loop, daemon=True).start()
    lsock = socket.create_server(("127.0.0.1", port))
    print(f"listening http://127.0.0.1:{lsock.getsockname()[1]}", flush=True)
    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=server.serve_one, args=(conn,), daemon=True).start()


class ServerProcess:
    """A running :func:`serve` in a process (and session) of its own; :meth:`stop` ends it and its boxes."""

    def __init__(self, home: Path, *, key: str | None = None, env: dict[str, str] | None = None) -> None:
        import subprocess

        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "sdk_double.serve", "--home", str(home)]
        if key is not None:
            key_file = home / "api-key"
            key_file.write_text(key)
            argv += ["--api-key-file", str(key_file)]
        tests = str(Path(__file__).resolve().parent.parent)
        run_env = dict(os.environ if env is None else env)
        run_env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, run_env.get("PYTHONPATH", "")) if p)
        with open(home / "server.stderr", "ab") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=run_env, start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("listening "):
            self.stop()
            raise RuntimeError(f"the double's server did not start: {(home / 'server.stderr').read_text()[-2000:]}")
        self.url = line.split()[1]

    def boxes(self) -> list[dict[str, Any]]:
        """The server's records, read from its home (no request: works whatever faults are set)."""
        try:
            data: dict[str, dict[str, Any]] = json.loads((self.home / "server" / "db" / "boxes.json").read_text())
        except (OSError, ValueError):
            return []
        return list(data.values())

    def log(self) -> str:
        try:
            return (self.home / "server.log").read_text()
        except OSError:
            return ""

    def stop(self) -> None:
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except Exception:  # noqa: BLE001 - then by force
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
