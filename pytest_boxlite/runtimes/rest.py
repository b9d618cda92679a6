"""The ``vm`` runtime on a remote BoxLite server, through the SDK's REST client (``--boxlite-url``).

How it works, and why: ``docs/explanation/internals/remote-server.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import re
import shutil
import sys
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pytest_boxlite._homefs import HomeDir, remove_tree_at
from pytest_boxlite._shown import shown
from pytest_boxlite.errors import (
    BoxDeadError,
    BoxliteError,
    BoxStartError,
    BoxTimeoutError,
    ConfigError,
    RuntimeUnavailableError,
    UnsupportedError,
)
from pytest_boxlite.runtimes import _vmimage
from pytest_boxlite.runtimes._vmspawn import VmProcess
from pytest_boxlite.runtimes.base import BoxRecord, RawResult
from pytest_boxlite.runtimes.vm import EventLoopThread, VmBox, VmRuntime, _import_boxlite, resource_options
from pytest_boxlite.spec import BoxSpec

T = TypeVar("T")

#: Where the API key is read from when no credential file is named (the SDK's own variable).
API_KEY_ENV = "BOXLITE_API_KEY"
#: Seconds a box may sit unused before the server stops it (the lease); renewed every third of it.
#: ``PYTEST_BOXLITE_REST_LEASE`` overrides it (the tests use a few seconds).
DEFAULT_LEASE = 120
LEASE_ENV = "PYTEST_BOXLITE_REST_LEASE"
#: Bound on one attempt of one bookkeeping call, and how many attempts a call gets.
CALL_TIMEOUT = 30.0
ATTEMPTS = 4
#: Largest credential file read (an API key is a few dozen bytes).
MAX_CREDENTIAL_BYTES = 64 * 1024
#: Where a box records which upload fingerprints it holds: /tmp, which every box can write
#: (a box's /var/tmp may belong to an id its user cannot write as, as on a non-root double).
UPLOAD_MARKS = "/tmp/pytest-boxlite-uploads"
_BOX_NAME = re.compile(r"^pbx-(?P<owner>[a-z0-9]+(?:-[A-Za-z0-9_]+)?)-\d+$")


class Secret:
    """A credential: its ``repr``/``str`` never show it; :meth:`reveal` is the only way out."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret(***)"

    __str__ = __repr__

    def __reduce__(self) -> Any:  # never pickled into a report or sent to an xdist worker
        raise TypeError("a credential is not picklable")


@dataclasses.dataclass(frozen=True)
class RemoteTarget:
    """Which BoxLite server a session uses and how: the URL as shown, and its key (never shown)."""

    url: str
    #: The URL without query or fragment, for the report header.
    display: str
    #: Where the key came from ("environment variable BOXLITE_API_KEY", "file X" or "none"): no secret.
    credential_source: str
    lease: int
    max_boxes: int
    credential: Secret | None = dataclasses.field(default=None, repr=False, compare=False)
    #: The credential file, if the key came from one (it must never be uploaded into a box).
    credential_path: str | None = None

    @property
    def reason(self) -> str:
        return (
            f"remote BoxLite server {self.display}: up to {self.max_boxes} boxes per pytest process, "
            f"each leased {self.lease}s and renewed while this session lives; "
            + ("no API key" if self.credential is None else f"key from {self.credential_source}")
        )


def remote_target(
    url: str,
    *,
    credential_file: str | None,
    max_boxes: int,
    environ: Mapping[str, str] | None = None,
) -> RemoteTarget:
    """Check ``url`` and read the key; a bad URL or an unreadable key file is a :class:`ConfigError`."""
    env = os.environ if environ is None else environ
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--boxlite-url {url!r} is not an http(s) URL; give e.g. https://boxes.internal:8100")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            "--boxlite-url must not carry credentials (user info in the URL ends up in logs and reports): "
            f"put the API key in {API_KEY_ENV} or in a file named by --boxlite-credential-file"
        )
    try:
        port = parts.port
    except ValueError:
        raise ConfigError("--boxlite-url has a bad port; give e.g. https://boxes.internal:8100") from None
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    display = f"{parts.scheme}://{host}{f':{port}' if port else ''}{parts.path.rstrip('/')}"
    credential: Secret | None = None
    source = "none"
    if credential_file:
        path = Path(credential_file).expanduser()
        try:
            with open(path, "rb") as fh:
                raw = fh.read(MAX_CREDENTIAL_BYTES + 1)
        except OSError as exc:
            raise ConfigError(
                f"--boxlite-credential-file {path}: cannot read it ({exc.strerror or exc}); "
                "name a readable file that holds the server's API key"
            ) from None
        key = raw.decode("utf-8", "replace").strip()
        if not key or len(raw) > MAX_CREDENTIAL_BYTES or any(c.isspace() for c in key):
            raise ConfigError(
                f"--boxlite-credential-file {path} does not hold one API key (empty, several words or over 64 KiB)"
            )
        credential, source = Secret(key), f"file {path}"
    elif env.get(API_KEY_ENV, "").strip():
        credential, source = Secret(env[API_KEY_ENV].strip()), f"environment variable {API_KEY_ENV}"
    lease_raw = env.get(LEASE_ENV, "")
    try:
        lease = int(lease_raw) if lease_raw else DEFAULT_LEASE
    except ValueError:
        lease = -1
    if lease < 2:
        raise ConfigError(f"{LEASE_ENV}={lease_raw!r}: must be a whole number of seconds >= 2")
    return RemoteTarget(
        url=urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")),
        display=display,
        credential_source=source,
        lease=lease,
        max_boxes=max_boxes,
        credential=credential,
        credential_path=str(Path(credential_file).expanduser().resolve()) if credential_file else None,
    )


def owner_of(name: str) -> str | None:
    """The owner encoded in a box name (the ledger's naming rule), or None for boxes that are not ours."""
    m = _BOX_NAME.match(name)
    return m.group("owner") if m else None


def _printable(text: str, limit: int = 80) -> str:
    """``text`` safe for a terminal: control characters escaped, at most ``limit`` characters."""
    return shown(text, line=True, limit=limit)


def fingerprint(paths: Sequence[str]) -> str:
    """A digest of what is under ``paths`` (relative names, sizes, modes, modification times)."""
    h = hashlib.sha256()
    for top in sorted(paths):
        h.update(b"\0top\0" + top.encode("utf-8", "surrogateescape"))
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            for name in sorted(filenames) + [d + "/" for d in dirnames]:
                full = os.path.join(dirpath, name.rstrip("/"))
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                rel = os.path.relpath(full, top).encode("utf-8", "surrogateescape")
                h.update(b"%s\0%d\0%o\0%d\n" % (rel, st.st_size, st.st_mode, st.st_mtime_ns))
    return h.hexdigest()[:24]


def _own_stdlib(path: str) -> bool:
    """Whether ``path`` is this interpreter's standard library: the image brings its own, it is not uploaded."""
    base = os.path.realpath(sys.base_prefix)
    real = os.path.realpath(path)
    return (real == base or real.startswith(base + os.sep)) and "site-packages" not in real.split(os.sep)


def _hold_scratch(scratch: Path) -> int:
    """Make ``scratch`` and lock it for this runtime's life; remove siblings whose runtime died.

    The kernel drops the lock with its process, however it dies, so an unlocked sibling is the
    leftover of a killed session (its bridge sockets): nothing there is still in use.  Every path
    goes through the descriptor of ``scratch``'s parent (``<home>/rest``, see :mod:`._homefs`): a
    link there, or a sibling or lock that is a link or another user's, is refused, never followed
    or removed (a ``rest`` link shipped in a project's home once removed directories elsewhere).
    """
    scratch.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with HomeDir.open_expected(scratch.parent, "a directory") as top:
        top.sub(scratch.name, create=True).close()
        fd = top.open_file(f"{scratch.name}/.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        for sibling in top.entries():
            if sibling.name == scratch.name or sibling.refused is not None or not sibling.is_dir:
                continue
            try:
                other = top.open_file(f"{sibling.name}/.lock", os.O_RDWR)
            except OSError:
                continue  # being made right now, or not ours: leave it
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # alive
            finally:
                os.close(other)
            with contextlib.suppress(OSError):
                remove_tree_at(top.fd, sibling.name)
    return fd


def _refuse_user(box: str, user: str | None) -> None:
    """Refuse a command as another user: a BoxLite server would run it as the default one."""
    if user is not None:
        raise UnsupportedError(
            f"box {box}: user={user!r} cannot be honoured on a remote BoxLite server: the REST API's exec "
            "request has no user field (boxlite 0.10.8, src/boxlite/src/rest/types.rs ExecRequest: command, "
            "args, env, timeout_seconds, working_dir, tty), so the command would run as the box's default "
            "user; run it without user= (or drop privileges in the command itself), or use the local vm "
            "or namespace runtime"
        )


class RemoteVmBox(VmBox):
    """A micro-VM on a remote server: a :class:`VmBox` whose logs stay on the server.

    ``exec`` and ``spawn`` are the vm runtime's (the REST execution streams stdin, stdout and
    stderr and takes signals, as a local one does), except that a ``user`` is refused: the REST
    client drops it.  ``connect_port`` (``Sandbox.publish``) is the vm runtime's relay over an
    exec channel, so it needs nothing of the server's own port forwarding.
    """

    def exec(self, argv: Sequence[str], *, user: str | None = None, **kwargs: Any) -> RawResult:
        _refuse_user(self.name, user)
        return super().exec(argv, **kwargs)

    def spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None, cwd: str | None, user: str | None
    ) -> VmProcess:
        _refuse_user(self.name, user)
        return super().spawn(argv, env=env, cwd=cwd, user=None)

    def keep(self) -> None:
        """Nothing to mark on this host: the box lives on the server, which this host's ``clean`` never touches."""

    def log_tail(self, max_bytes: int = 4000, *, since: int = 0) -> str:
        rt = self._rt
        assert isinstance(rt, RestRuntime)
        return f"(box {self.name} runs on {rt.target.display}; its console log stays on that server)"


class RestRuntime(VmRuntime):
    """BoxLite micro-VMs on a remote server.  One per process; any number may share a server."""

    name = "vm"

    def __init__(self, target: RemoteTarget, home: Path, owner: str, *, sdk: Any | None = None) -> None:
        """Connect to ``target``; ``home`` is local scratch (bridge sockets), ``sdk`` replaces ``boxlite``."""
        self.target = target
        self.owner = owner
        self.isolation = (
            f"BoxLite micro-VM on the remote server {target.display}: own kernel, hardware isolation; "
            "nothing of this host is mounted (the project is uploaded)"
        )
        self.home = Path(home)
        self._scratch_lock = _hold_scratch(self.home)
        self.sdk = sdk if sdk is not None else _import_boxlite()
        self._boxlite = self.sdk
        self.loop = EventLoopThread("boxlite-rest")
        bl = self.sdk
        self._closed = True
        self._templates: dict[str, Any] = {}
        self._template_mutex = threading.Lock()
        self._held: dict[str, Any] = {}
        self._held_lock = threading.Lock()
        self._fingerprints: dict[tuple[str, ...], str] = {}
        self._stop_renewal = threading.Event()
        self.reaped: list[str] = []

        async def connect() -> Any:
            key = target.credential.reveal() if target.credential is not None else None
            cred = bl.ApiKeyCredential(key) if key else None
            return bl.Boxlite.rest(bl.BoxliteRestOptions(url=target.url, credential=cred))

        try:
            self._rt = self.loop.call(connect, CALL_TIMEOUT, f"connecting to {target.display}")
            infos = self._call(lambda: self._rt.list_info(), f"list boxes on {target.display}")
        except BaseException as exc:  # PanicException derives from BaseException
            self.loop.close()
            self._release_scratch()
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise RuntimeUnavailableError(f"the BoxLite server {target.display} cannot be used: {exc}") from None
        self._closed = False
        self.reaped = self._reap(infos)
        self._renewer = threading.Thread(target=self._renew_loop, name="boxlite-lease", daemon=True)
        self._renewer.start()

    # -- calls ------------------------------------------------------------------------------------
    def _retryable(self, exc: BaseException) -> bool:
        kinds = tuple(
            getattr(self.sdk, n)
            for n in ("NetworkError", "UpstreamUnavailableError", "ResourceExhaustedError")
            if hasattr(self.sdk, n)
        )
        return isinstance(exc, BoxTimeoutError) or (bool(kinds) and isinstance(exc, kinds))

    def _call(self, factory: Callable[[], Awaitable[T]], what: str, *, timeout: float | None = None) -> T:
        """One SDK call, each attempt bounded by ``timeout``, retried on transport errors with backoff."""
        timeout = CALL_TIMEOUT if timeout is None else timeout
        delay = 0.5
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return self.loop.call(factory, timeout, what)
            except BaseException as exc:
                if attempt == ATTEMPTS or not self._retryable(exc):
                    raise
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def wrap_exec_error(self, exc: Exception, box: VmBox, program: str) -> BoxliteError:
        if isinstance(exc, getattr(self.sdk, "NetworkError", ())):
            box._dead = True
            return BoxDeadError(f"box {box.name}: lost the connection to {self.target.display}: {exc}")
        return super().wrap_exec_error(exc, box, program)

    # -- boxes ------------------------------------------------------------------------------------
    def image_options(self, image: str) -> dict[str, Any]:
        """A registry reference only: the server pulls images itself, and a local image
        (``oci:``, ``oci-archive:``, ``docker-archive:``) is a file on this machine that it cannot
        read (``BoxOptions.rootfs_path`` would name a path on the *server*)."""
        if _vmimage.is_local(image):
            raise ConfigError(
                f"image {image!r} is a file on this machine, which the boxlite server at "
                f"{self.target.display} cannot read (it pulls images from registries itself): push the "
                f"image to a registry the server reaches (e.g. skopeo copy {image} docker://REGISTRY/NAME:TAG) "
                "and name that, or run without --boxlite-url (the local vm or namespace runtime takes local images)"
            )
        return {"image": image.removeprefix("docker://")}

    def box_options(self, spec: BoxSpec) -> Any:
        bl = self.sdk
        lease = self.target.lease
        kwargs: dict[str, Any] = {
            **self.image_options(spec.image),
            "env": list(spec.env),
            # The dead-man switch: stopped after a lease without use, deleted a while after that.
            "auto_stop": lease,
            "auto_delete": 2 * lease,
        }
        kwargs.update(resource_options(bl, spec))
        return bl.BoxOptions(**kwargs)

    def register_box(self, spec: BoxSpec, name: str) -> Any:
        """Create the box on the server; a retried create whose first answer was lost finds its box."""
        already = tuple(getattr(self.sdk, n) for n in ("AlreadyExistsError", "InvalidArgumentError"))
        first = [True]
        self.image_options(spec.image)  # a local image is refused before anything reaches the server

        async def create() -> Any:
            try:
                return await self._rt.create(self.box_options(spec), name=name)
            except already as exc:
                found = None if first[0] else await self._rt.get(name)
                if found is None or "already exists" not in str(exc):
                    raise
                return found
            finally:
                first[0] = False

        try:
            return self._call(create, f"create {name} on {self.target.display}")
        except BoxTimeoutError:
            raise
        except Exception as exc:
            raise BoxStartError(f"boxlite could not create box {name} ({spec.describe()}): {exc}") from exc

    def ensure_template(
        self, spec: BoxSpec, setup: str, *, key: str, store: Path, cwd: Path, timeout: float
    ) -> BoxSpec:
        """No template on a remote server (export/import would move the disk through this host): setup per box."""
        return spec

    def create_box(self, spec: BoxSpec, name: str, *, timeout: float) -> RemoteVmBox:
        started = time.monotonic()
        handle = super().create_box(dataclasses.replace(spec, template=None), name, timeout=timeout)
        box = RemoteVmBox(self, handle._box, name)
        with self._held_lock:
            self._held[name] = box._box
        try:
            self._upload(box, spec.mounts, max(1.0, timeout - (time.monotonic() - started)))
        except BaseException:
            box.destroy()
            raise
        return box

    def _upload(self, box: RemoteVmBox, mounts: Sequence[str], timeout: float) -> None:
        """Copy the host directories ``mounts`` into the box at the same paths (no volumes remotely)."""
        dirs = tuple(sorted(m for m in mounts if os.path.isdir(m) and not _own_stdlib(m)))
        if not dirs:
            return
        cred = self.target.credential_path
        for d in dirs:
            if cred is not None and (cred + os.sep).startswith(os.path.realpath(d) + os.sep):
                raise ConfigError(
                    f"--boxlite-credential-file {cred} is inside {d}, which is uploaded into every box: "
                    "keep the server's key outside the project and sys.path directories"
                )
        if dirs not in self._fingerprints:
            self._fingerprints[dirs] = fingerprint(dirs)
        mark = f"{UPLOAD_MARKS}/{self._fingerprints[dirs]}"
        raw = box.exec(["test", "-e", mark], cwd="/", timeout=min(timeout, CALL_TIMEOUT))
        if raw.exit_code == 0:
            return
        sdk_box = box._box
        deadline = time.monotonic() + timeout
        for d in dirs:
            # "SRC/." copies the directory's contents (docker cp's rule), creating the destination.

            async def copy(d: str = d) -> None:
                await sdk_box.copy_in(f"{d}/.", d, self.sdk.CopyOptions(recursive=True, overwrite=True))

            left = deadline - time.monotonic()
            if left <= 0:
                raise BoxStartError(f"uploading {', '.join(dirs)} to box {box.name} took over {timeout:.0f}s")
            try:
                self.loop.call(copy, left, f"upload {d} to {box.name}")
            except BoxliteError:
                raise
            except Exception as exc:
                raise BoxStartError(f"could not upload {d} to box {box.name} on {self.target.display}: {exc}") from exc
        raw = box.exec(["/bin/sh", "-c", 'mkdir -p "$1" && touch "$2"', "sh", UPLOAD_MARKS, mark], timeout=CALL_TIMEOUT)
        if raw.exit_code != 0:
            raise BoxStartError(f"box {box.name}: could not record its upload: {raw.stderr[-500:]!r}")

    def _renew_loop(self) -> None:
        """Use every box this process holds once per third of the lease, so none is stopped as idle."""
        period = max(0.5, self.target.lease / 3)
        while not self._stop_renewal.wait(period):
            with self._held_lock:
                held = list(self._held.items())
            for name, sdk_box in held:

                async def touch(sdk_box: Any = sdk_box) -> None:
                    ex = await sdk_box.exec("true", [], None, False, None, None, "/")
                    await ex.stdin().close()
                    await ex.wait()

                # A failed renewal is not fatal: the box's next use reports what is wrong.
                with contextlib.suppress(Exception):
                    self.loop.call(touch, min(period, CALL_TIMEOUT), f"renew the lease of {name}")

    def _reap(self, infos: Sequence[Any]) -> list[str]:
        """Remove our kind of boxes whose lease lapsed (stopped ``pbx-`` boxes of other owners)."""
        removed = []
        for info in infos:
            name = str(info.name or "")
            owner = owner_of(name)
            if owner is None or owner == self.owner or str(info.state.status) != "stopped":
                continue
            with contextlib.suppress(BoxliteError):
                self.remove_box(name)
                removed.append(f"{name} (on {self.target.display}, lease lapsed)")
        return removed

    def _bookkeeping(self, factory: Callable[[], Awaitable[T]], what: str) -> T:
        """Over the network: retried on transport errors (see :meth:`_call`)."""
        return self._call(factory, f"{what} on {self.target.display}")

    @property
    def _boxes_at(self) -> str:
        return self.target.display

    @property
    def _where(self) -> str:
        return f"on {self.target.display}"

    def remove_box(self, name: str) -> None:
        with self._held_lock:
            self._held.pop(name, None)
        super().remove_box(name)

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._stop_renewal.set()
        self._renewer.join(timeout=CALL_TIMEOUT)
        with self._held_lock:
            self._held.clear()
        # The server owns its lifecycle (the REST runtime's shutdown is a no-op): boxes this process
        # still has were removed by the pool; whatever is left dies by its timers.
        self._rt = None
        self.loop.close()
        self._release_scratch()

    def _release_scratch(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._scratch_lock)


def open_remote(target: RemoteTarget, home: Path, owner: str) -> RestRuntime:
    """The runtime for ``target``, with ``<home>/rest/<owner>`` as local scratch space."""
    return RestRuntime(target, Path(home) / "rest" / owner, owner)


def server_boxes(target: RemoteTarget, home: Path, *, sdk: Any | None = None) -> list[tuple[BoxRecord, str | None]]:
    """Every box on the server, with its owner (``python -m pytest_boxlite ls --url``)."""
    rt = RestRuntime(target, Path(home) / "rest" / f"cli-{os.getpid()}", f"cli{os.getpid()}", sdk=sdk)
    try:
        # Names and states come from a shared server (anyone's boxes): printable, bounded text only.
        return [
            (dataclasses.replace(r, name=_printable(r.name), state=_printable(r.state)), owner_of(r.name))
            for r in rt.list_boxes()
        ]
    finally:
        rt.close()


def clean_server(target: RemoteTarget, home: Path, names: Sequence[str] = ()) -> list[str]:
    """Remove ``names``, or every ``pbx-`` box whose lease lapsed (stopped); running ones are a live session's."""
    rt = RestRuntime(target, Path(home) / "rest" / f"cli-{os.getpid()}", f"cli{os.getpid()}")
    try:
        if not names:
            return [r.split(" ", 1)[0] for r in rt.reaped]
        known = {r.name for r in rt.list_boxes()}
        missing = [n for n in names if n not in known]
        if missing:
            raise ConfigError(f"no box named {', '.join(missing)} on {target.display}")
        for n in names:
            rt.remove_box(n)
        return list(names)
    finally:
        rt.close()
