"""The ``vm`` runtime: BoxLite micro-VMs through the boxlite SDK.

The SDK is async and every call must be made inside a running loop, so one
private event-loop thread per runtime runs them; callers block on
``run_coroutine_threadsafe(...).result(timeout)``.  A call that times out is
cancelled and its box is treated as dead.  The runtime is always opened on
an explicit home (``Boxlite(Options(home_dir=...))``): ``Boxlite.default()``
would install its own SIGINT/SIGTERM handler and lose pytest's exit code.

What the SDK does that the code below works around (``reviews/vm-sdk-review.md``;
each is reproduced by the SDK double in ``tests/sdk_double`` and tested
through it): the guest holds a command's stdin open until the host closes it
(#18), one ``send_input`` is one gRPC message capped at 4 MiB (#17), ``kill``
and ``signal`` reach the command's leader only (#20), ``cwd=None`` means ``/``
(#12), ``wait()`` gives ``-1`` both for SIGHUP and for a lost channel (#19).

One difference from namespace boxes is deliberate and documented rather than
hidden: the project and ``sys.path`` directories are BoxLite volumes
(virtio-fs) mounted **read-only** at their host paths, not copy-on-write
(BoxLite volumes have no overlay option, review #30), so a guest write under
the rootdir fails with EROFS.  A copy-on-write view would need an overlay
mounted inside the guest, which needs privileges the container may not have;
that is unverified, so it is not attempted.

Boxed tests fork per test inside a VM booted once per worker (``--boxlite-fresh=fork``, the
default): the warm interpreter in the guest forks each test's box (new mount, pid, uts, ipc and
network namespaces, a pristine overlay of / and of every writable mount, the test process one
user namespace further down; ``guest/fresh.py``), and the forked box's connection reaches the
host through a relay command over the SDK's exec stdio (:meth:`VmBox.fork_listener`).  Tests of
one worker then share the VM's kernel; ``--boxlite-fresh=boot`` gives each test a VM (and a
kernel) of its own.  Where the guest kernel refuses the namespaces, the warm interpreter says so
at start and every test gets a booted VM.  Unverified on a real VM: user namespaces in libkrun's
kernel (probed), overlayfs with a tmpfs upper layer (``userxattr``) over the guest's root file
system and virtio-fs volumes, pivot_root in BoxLite's container, and the relay's latency over
real exec streams.

Local images (``oci:``, ``oci-archive:``, ``docker-archive:``) reach the SDK as
``BoxOptions.rootfs_path``, a one-image OCI layout made from the machine's image store
(:mod:`._vmimage`); the SDK's refusals of a bad layout are the real wheel's (checked here without
KVM), the boot from one is unverified.

Still to confirm on a host that boots VMs (none here can): whether the OCI
runtime creates a missing working directory (#13: sidestepped, the box gets
``mkdir -p /workspace`` from ``/`` once it is up), whether an oversized
``send_input`` raises on the host or only fails the guest's stream (either
way chunks stay under the cap), and the guest memory growth per retained
exec (#32).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from pytest_boxlite import guest
from pytest_boxlite._homefs import HomeDir, Refused
from pytest_boxlite._shown import shown
from pytest_boxlite.errors import (
    BoxDeadError,
    BoxliteError,
    BoxStartError,
    BoxTimeoutError,
    ConfigError,
    RuntimeUnavailableError,
    file_error,
)
from pytest_boxlite.runtimes import _vmimage, _vmspawn
from pytest_boxlite.runtimes._forkrelay import ForkRelay
from pytest_boxlite.runtimes._vmbridge import VmBridge
from pytest_boxlite.runtimes.base import (
    DEFAULT_MAX_OUTPUT,
    BoxDefaults,
    BoxRecord,
    Capabilities,
    HelperSink,
    Leftover,
    Owners,
    RawResult,
    RuntimeDefaults,
    helper_argv,
)
from pytest_boxlite.runtimes.probe import probe
from pytest_boxlite.spec import BoxSpec

T = TypeVar("T")
ATTACH = guest.path("attach")
WORKDIR = "/workspace"
#: Bound on bookkeeping calls (create, list, remove) that never boot anything.
BOOKKEEPING_TIMEOUT = 30.0
#: Largest piece handed to one ``send_input`` (one gRPC message; tonic refuses more than 4 MiB).
INPUT_CHUNK = 1024 * 1024
#: Every command carries this variable (a fresh value each), so its whole process tree can be found
#: and killed from inside the box: the SDK's kill reaches the leader only.
EXEC_TAG = "PYTEST_BOXLITE_EXEC"
#: Lines the SDK itself writes into a command's stderr when the channel to the guest fails.
_SDK_STREAM_ERRORS = ("Attach failed:", "Attach stream error:")
#: ``BoxSpec.template`` of a vm box cloned from a provisioned template (see VmRuntime.ensure_template).
TEMPLATE_PREFIX = "vm-template:"
#: Run in the box (``python -I -S -c``) to SIGKILL every process carrying one tag in its environment.
KILL_TAGGED = """
import os, sys
needle = ("%s=" % sys.argv[1]).encode() + sys.argv[2].encode() + b"\\0"
me = os.getpid()
for _ in range(3):
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            with open("/proc/%s/environ" % pid, "rb") as fh:
                env = fh.read() + b"\\0"
        except OSError:
            continue
        if b"\\0" + needle in b"\\0" + env:
            try:
                os.kill(int(pid), 9)
            except OSError:
                pass
"""


class EventLoopThread:
    """One asyncio loop on a daemon thread; the only place SDK awaitables are made."""

    def __init__(self, name: str = "boxlite-sdk") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, factory: Callable[[], Awaitable[T]], timeout: float, what: str) -> T:
        """Run ``factory()`` in the loop and wait at most ``timeout`` seconds for it."""

        async def runner() -> T:
            return await factory()

        fut = asyncio.run_coroutine_threadsafe(runner(), self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise BoxTimeoutError(f"boxlite: {what} did not finish within {timeout:.0f}s") from None

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


def _import_boxlite() -> Any:
    try:
        import boxlite
    except ImportError as exc:  # pragma: no cover - boxlite is a hard dependency
        raise RuntimeUnavailableError(f"the boxlite SDK cannot be imported: {exc}") from exc
    return boxlite


async def send_input(stdin: Any, data: bytes) -> None:
    """Send ``data`` in pieces: one ``send_input`` is one gRPC message, and the guest refuses > 4 MiB."""
    view = memoryview(data)
    for off in range(0, len(view), INPUT_CHUNK):
        await stdin.send_input(bytes(view[off : off + INPUT_CHUNK]))


class VmBox(BoxDefaults):
    """A started micro-VM.  See :class:`pytest_boxlite.runtimes.base.BoxHandle`."""

    runtime_name = "vm"
    # The guest's exec stdout reaches us as lossily decoded text.
    binary_stdout = False
    workdir = WORKDIR
    guest_python = "python3"
    #: A VM's root and volumes are no overlays: a forked box renews every writable directory.
    fork_renews_all = True

    def __init__(self, runtime: VmRuntime, box: Any, name: str) -> None:
        self._rt = runtime
        self._box = box
        self.name = name
        self.id = str(box.id)
        self._dead = False
        self._bridge: VmBridge | None = None
        self._bridge_lock = threading.Lock()
        self._relays: list[ForkRelay] = []

    def fork_listener(self) -> tuple[socket.socket, str]:
        """A host socket that boxes forked in this VM reach through a relay in the guest.

        The guest cannot reach a host socket, so a relay command (:mod:`pytest_boxlite.guest.relay`)
        started through this box's stdio bridge listens on a new private guest directory and
        carries each connection over its stdio (:class:`~pytest_boxlite.runtimes._forkrelay.ForkRelay`).
        Closing the returned socket ends the relay; so does :meth:`destroy`.
        """
        if self._dead:
            raise BoxDeadError(f"box {self.name} is dead")
        relay = ForkRelay(lambda argv: self.attach_argv(argv, cwd="/"), self.guest_python)
        with self._bridge_lock:
            self._relays = [r for r in self._relays if r.alive]
            self._relays.append(relay)
        return relay.listener, relay.guest_path

    def attach_argv(self, argv: Sequence[str], *, cwd: str | None = None, status_file: str | None = None) -> list[str]:
        """A host command whose stdio are those of ``argv`` in this VM (through this process's bridge)."""
        with self._bridge_lock:
            if self._bridge is None:
                sock = self._rt.home / "bridges" / f"{self.name}.sock"
                self._bridge = VmBridge(self._box, self._rt.loop.loop, sock, self.guest_python)
        extra = ["--cwd", cwd] if cwd else []
        if status_file:
            extra += ["--status", status_file]
        return [sys.executable, "-I", "-S", str(ATTACH), str(self._bridge.sock_path), *extra, "--", *argv]

    def exec(
        self,
        argv: Sequence[str],
        *,
        input: bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float,
        max_output: int = DEFAULT_MAX_OUTPUT,
        sink: HelperSink | None = None,
    ) -> RawResult:
        if self._dead:
            raise BoxDeadError(f"box {self.name} is dead")
        if not argv:
            raise ConfigError("exec needs a non-empty argv")
        start = time.monotonic()
        tag = secrets.token_hex(8)
        env_items = [*dict(env or {}).items(), (EXEC_TAG, tag)]

        async def run() -> RawResult:
            # cwd=None would run in "/" (the guest's default), not in the box's working directory.
            execution = await self._box.exec(argv[0], list(argv[1:]), env_items, False, user, None, cwd or WORKDIR)
            # The guest holds stdin open until the host closes it: always close it, or a command
            # that reads stdin waits for the timeout (namespace boxes give /dev/null).
            stdin = execution.stdin()
            if input:
                await send_input(stdin, input)
            await stdin.close()
            bufs = [bytearray(), bytearray()]
            dropped = [0, 0]
            refused: list[BaseException] = []  # what the sink raised: the command is killed, then it is raised

            async def collect(i: int, stream: Any) -> None:
                async for chunk in stream:
                    data = chunk.encode("utf-8", "surrogateescape") if isinstance(chunk, str) else bytes(chunk)
                    if i == 0 and sink is not None:
                        if not refused:
                            try:
                                sink(data)
                            except Exception as exc:  # noqa: BLE001 - raised below, once the command is gone
                                refused.append(exc)
                                await self._kill_tagged(tag)
                        continue
                    room = max_output - len(bufs[i])
                    if room > 0:
                        bufs[i] += data[:room]
                    dropped[i] += max(0, len(data) - max(room, 0))

            readers = asyncio.gather(collect(0, execution.stdout()), collect(1, execution.stderr()))
            timed_out = False
            exit_code: int | None = None
            error: str | None = None
            try:
                result = await asyncio.wait_for(execution.wait(), timeout)
                exit_code = int(result.exit_code)
                error = getattr(result, "error_message", None)
            except asyncio.TimeoutError:
                timed_out = True
                # The SDK's kill reaches the leader only: end the command's whole tree from inside.
                await self._kill_tagged(tag)
                # Cancelling the wait leaves the guest process running: kill it explicitly too.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(execution.kill(), 5)
                with contextlib.suppress(Exception):
                    exit_code = int((await asyncio.wait_for(execution.wait(), 5)).exit_code)
            try:
                await asyncio.wait_for(readers, 2)
            except asyncio.TimeoutError:
                readers.cancel()
                # Children that outlived their leader hold the pipes: they must not leak into the next use.
                await self._kill_tagged(tag)
            if exit_code == -1 and not error:
                err_text = bytes(bufs[1]).decode("utf-8", "replace")
                if any(marker in err_text for marker in _SDK_STREAM_ERRORS) or not await self._answers():
                    # -1 is also what wait() gives for a lost channel: not a SIGHUP.
                    exit_code = None
                    error = f"the channel to box {self.name} was lost (boxlite reported exit -1 with no status)"
            if refused:
                raise refused[0]
            return RawResult(
                exit_code=exit_code,
                stdout=bytes(bufs[0]),
                stderr=bytes(bufs[1]),
                timed_out=timed_out,
                duration=time.monotonic() - start,
                stdout_dropped=dropped[0],
                stderr_dropped=dropped[1],
                error=error,
            )

        try:
            return self._rt.loop.call(run, timeout + 30, f"exec {argv[0]!r} in {self.name}")
        except BoxTimeoutError:
            self._dead = True
            raise
        except BoxliteError:
            raise
        except Exception as exc:
            raise self._rt.wrap_exec_error(exc, self, argv[0]) from exc

    def spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None, cwd: str | None, user: str | None
    ) -> _vmspawn.VmProcess:
        """Start ``argv`` through the SDK's exec under a pid shim (see :mod:`~pytest_boxlite.runtimes._vmspawn`)."""
        if self._dead:
            raise BoxDeadError(f"box {self.name} is dead")
        tag = secrets.token_hex(8)
        env_items = [*dict(env or {}).items(), (EXEC_TAG, tag)]
        shim = ["-I", "-S", "-c", _vmspawn.SHIM, *argv]
        proc = _vmspawn.VmProcess(self.name, self._rt.loop.loop, lambda: self._kill_tagged(tag))

        def start() -> Any:  # the SDK's awaitable
            return self._box.exec(self.guest_python, shim, env_items, False, user, None, cwd or WORKDIR)

        asyncio.run_coroutine_threadsafe(proc.run(start, self._answers), self._rt.loop.loop)
        _vmspawn.wait_header(proc, self.name, lambda exc: self._rt.wrap_exec_error(exc, self, argv[0]))
        return proc

    def connect_port(self, port: int, *, timeout: float) -> socket.socket:
        """A connection to ``port`` on the VM's own loopback, made by a guest command whose stdio
        carries it through this box's stdio bridge (one attach helper per connection)."""
        if self._dead:
            raise BoxDeadError(f"box {self.name} is dead")
        argv = self.attach_argv([self.guest_python, "-I", "-S", "-c", _vmspawn.CONNECT, str(int(port))], cwd="/")
        return _vmspawn.connect_port(argv, self.name, int(port), timeout)

    def run_helper(self, payload: bytes, *, timeout: float, max_output: int, sink: HelperSink) -> RawResult:
        """Run the file helper as a guest command (:func:`helper_argv`), its stdout streamed to ``sink``."""
        return self.exec(
            helper_argv(self.guest_python), input=payload, timeout=timeout, max_output=max_output, sink=sink
        )

    async def _kill_tagged(self, tag: str) -> None:
        """SIGKILL every process in the box whose environment carries ``tag``; bounded, best effort."""
        with contextlib.suppress(Exception):
            ex = await asyncio.wait_for(
                self._box.exec(
                    self.guest_python, ["-I", "-S", "-c", KILL_TAGGED, EXEC_TAG, tag], None, False, None, None, "/"
                ),
                5,
            )
            await ex.stdin().close()
            await asyncio.wait_for(ex.wait(), 5)

    async def _answers(self) -> bool:
        try:
            ex = await asyncio.wait_for(self._box.exec("true", [], None, False, None, None, "/"), 5)
            await ex.stdin().close()
            return int((await asyncio.wait_for(ex.wait(), 5)).exit_code) == 0
        except Exception:  # noqa: BLE001 - any failure means the box does not answer
            return False

    def alive(self, timeout: float = 2.0) -> bool:
        if self._dead:
            return False
        try:
            return self.exec(["true"], timeout=timeout).exit_code == 0
        except (BoxDeadError, BoxTimeoutError):
            return False
        except Exception:  # noqa: BLE001 - any SDK failure means the box cannot be used
            return False

    def log_tail(self, max_bytes: int = 4000, *, since: int = 0) -> str:
        """The tails of the box's console log and of its shim's stderr (where boot failures land).

        ``since`` is ignored: these logs are several files, and :meth:`log_size` is always 0.
        """
        box_dir = self._rt.home / "boxes" / self.id
        logs = [*sorted(box_dir.glob("**/*.log"))[-2:], box_dir / "shim.stderr"]
        tail = b""
        for log in logs:
            with contextlib.suppress(OSError), open(log, "rb") as fh:
                fh.seek(0, 2)
                fh.seek(max(0, fh.tell() - max_bytes // len(logs)))
                tail += f"--- {log.name} ---\n".encode() + fh.read()
        return tail.decode("utf-8", "replace")

    def keep(self) -> None:
        """Mark this owner's vm home as kept, so ``clean`` leaves its boxes until ``--kept``."""
        (self._rt.home / "keep").write_text("kept for debugging\n")

    def run_attached(self, argv: Sequence[str], *, cwd: str | None, env: Mapping[str, str]) -> int:
        """Run ``argv`` with this process's stdio: the VM's bridge lives in this process, and the
        attach helper reaches it like a namespace box's agent (the helper sets ``env`` in the guest)."""
        full = self.attach_argv(argv, cwd=cwd)
        cut = full.index("--")
        return subprocess.call([*full[:cut], "--env", json.dumps(dict(env)), *full[cut:]])

    def destroy(self) -> None:
        if self._dead and self._box is None:
            return
        with self._bridge_lock:
            relays, self._relays = self._relays, []
        for relay in relays:
            relay.close()
        with self._bridge_lock:
            if self._bridge is not None:
                self._bridge.close()
                self._bridge = None
        self._dead = True
        self._box = None
        self._rt.remove_box(self.name)


def prepare_home(base: Path, owner: str) -> Path:
    """Make ``<base>/vm/<owner>``, sharing ``<base>/images`` so layers are pulled once per host.

    BoxLite keeps its image index per home; the content-addressed blobs under
    ``images`` are what cost the download, and those are shared.
    """
    # Through the home's descriptor (see _homefs): an ``images`` or ``vm`` link in the home (one a
    # project ships), or an entry of another owner, is refused: BoxLite would write through it.
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    with HomeDir.at(base, "images", create=True):
        pass
    with HomeDir.at(base, f"vm/{owner}", create=True):
        pass
    shared = base / "images"
    home = base / "vm" / owner
    link = home / "images"
    if not link.is_symlink():
        link.symlink_to(shared, target_is_directory=True)
    elif os.readlink(link) != str(shared):
        raise Refused(str(link), f"a link to {os.readlink(link)!r}, not to the home's own {shared}")
    return home


class VmRuntime(RuntimeDefaults):
    """BoxLite runtime on one home directory (one per process: BoxLite locks the home)."""

    name = "vm"
    isolation = "BoxLite micro-VM (KVM / Hypervisor.framework): own kernel, own filesystem, hardware isolation"

    def __init__(self, home: Path, *, sdk: Any | None = None, images: Path | None = None) -> None:
        """Open BoxLite on ``home``.  ``sdk`` replaces the ``boxlite`` module (the tests' SDK double);
        ``images`` is the image store local images go through (default: :func:`image_store`)."""
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.sdk = sdk if sdk is not None else _import_boxlite()
        self._boxlite = self.sdk
        self.loop = EventLoopThread()
        bl = self.sdk

        async def open_runtime() -> Any:
            return bl.Boxlite(bl.Options(home_dir=str(self.home)))

        try:
            self._rt = self.loop.call(open_runtime, BOOKKEEPING_TIMEOUT, f"opening home {self.home}")
        except BaseException as exc:  # PanicException derives from BaseException
            self.loop.close()
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise RuntimeUnavailableError(f"boxlite cannot open home {self.home}: {exc}") from None
        self._closed = False
        #: The image store local images (``oci:``...) go through; ``None``: :func:`image_store`.
        self.images = Path(images) if images is not None else None
        #: Those images as layouts the SDK's ``rootfs_path`` takes, by reference.
        self._layouts: dict[str, _vmimage.LocalLayout] = {}
        self._image_mutex = threading.Lock()
        #: Provisioned templates of this home: key -> the (stopped) SDK box that pool boxes are cloned from.
        self._templates: dict[str, Any] = {}
        self._template_mutex = threading.Lock()

    def wrap_exec_error(self, exc: Exception, box: VmBox, program: str) -> BoxliteError:
        """The plugin's error for an SDK failure of ``exec`` (a missing program or cwd is a file error)."""
        if isinstance(exc, (self.sdk.NotFoundError, self.sdk.StoppedError)):
            box._dead = True
            return BoxDeadError(f"box {box.name} is gone: {exc}")
        text = str(exc)
        # Unverified on a real guest: the spawn error's text is the only place the cause is given.
        for needle, code in (("No such file or directory", errno.ENOENT), ("Not a directory", errno.ENOTDIR)):
            if needle in text:
                return file_error(code, f"box {box.name}: cannot run {program!r}: {text}", program)
        if "Permission denied" in text:
            return file_error(errno.EACCES, f"box {box.name}: cannot run {program!r}: {text}", program)
        return BoxDeadError(f"box {box.name}: exec of {program!r} failed: {exc}")

    def local_image(self, ref: str) -> _vmimage.LocalLayout:
        """The OCI layout that ``BoxOptions.rootfs_path`` gets for the local image ``ref`` (through the
        machine's image store, once per machine; see :mod:`._vmimage`).  A missing, corrupt or
        ambiguous image is a :class:`ConfigError` naming it, before any box exists."""
        with self._image_mutex:
            layout = self._layouts.get(ref)
            if layout is None:
                store = self.images if self.images is not None else image_store(self.home)
                layout = self._layouts[ref] = _vmimage.local_layout(ref, store)
        return layout

    def image_options(self, image: str) -> dict[str, Any]:
        """``BoxOptions`` fields for ``image``: a registry reference goes to the SDK's puller
        (``image``; ``docker://`` is the transport's name, not part of the reference), a local one
        to ``rootfs_path``, which the SDK takes over ``image`` (an OCI layout directory, read at start)."""
        if _vmimage.is_local(image):
            return {"image": None, "rootfs_path": self.local_image(image).path}
        return {"image": image.removeprefix("docker://")}

    def box_options(self, spec: BoxSpec) -> Any:
        bl = self.sdk
        kwargs: dict[str, Any] = {
            **self.image_options(spec.image),
            "env": list(spec.env),
            # No working_dir: whether the OCI runtime creates a missing one is unverified (#13); the
            # box makes /workspace itself once it is up, and every exec names its cwd.
            # 0 = keep the record after a stop, so a dead session's boxes can be found and removed.
            "auto_delete": 0,
        }
        if spec.mounts:
            # Same paths as on the host, read-only: nothing the guest writes may reach the host.
            # (Unlike namespace boxes these are not copy-on-write: writes there fail with EROFS.)
            kwargs["volumes"] = [(m, m, True) for m in spec.mounts]
        kwargs.update(resource_options(bl, spec))
        return bl.BoxOptions(**kwargs)

    def register_box(self, spec: BoxSpec, name: str) -> Any:
        """Create the box record without booting it (works without KVM)."""
        try:
            # Outside the loop: a local image may be read into the store first (a bad one is a
            # usage error, raised as it is).
            options = self.box_options(spec)

            async def create() -> Any:
                return await self._rt.create(options, name=name)

            return self.loop.call(create, BOOKKEEPING_TIMEOUT, f"create {name}")
        except (BoxTimeoutError, ConfigError):  # a bad image is a usage error, not a failed start
            raise
        except Exception as exc:  # OverflowError for cpus > 255 too: a bad spec, not a crash
            raise BoxStartError(f"boxlite could not create box {name} ({spec.describe()}): {exc}") from exc

    def provision(
        self, spec: BoxSpec, setup: str, *, key: str, home: Path, cwd: Path, timeout: float, name: str
    ) -> BoxSpec:
        """A template shared by every home of ``home`` (in ``<home>/vm-templates``): see :meth:`ensure_template`."""
        return self.ensure_template(spec, setup, key=key, store=Path(home) / "vm-templates", cwd=cwd, timeout=timeout)

    def ensure_template(
        self, spec: BoxSpec, setup: str, *, key: str, store: Path, cwd: Path, timeout: float
    ) -> BoxSpec:
        """``--boxlite-setup`` on vm: run ``setup`` once, then clone every box from the result.

        The first session on the machine builds the template (a box that ran the setup, then
        stopped) and exports it to ``store/<key>.boxlite``; every home, this session's, an xdist
        worker's, a later session's, imports that archive once and clones its pool boxes from it
        with ``Box.clone_box`` (a copy of the disk; the clone boots cold: BoxLite has no memory fork).
        ``key`` must identify the spec and the setup (``templates.template_key``); the volumes are
        part of a box's record, so their paths are added here.  Returns the spec that uses it.
        """
        key = f"{key}-{hashlib.sha256(repr(spec.mounts).encode()).hexdigest()[:8]}"
        with self._template_mutex:
            if key not in self._templates:
                self._templates[key] = self._load_template(spec, setup, key, store, cwd, timeout)
        return dataclasses.replace(spec, template=TEMPLATE_PREFIX + key)

    def _load_template(self, spec: BoxSpec, setup: str, key: str, store: Path, cwd: Path, timeout: float) -> Any:
        store.mkdir(mode=0o700, parents=True, exist_ok=True)
        archive = store / f"{key}.boxlite"
        name = f"tpl-{key}"  # no owner in the name: never one session's box, removed at close
        deadline = time.monotonic() + timeout
        try:
            held = _template_lock(store, key)
        except Refused as exc:
            raise BoxStartError(f"vm template {key}: {exc}") from None
        with held as lock:
            # Another session or worker may be building this very template: wait for it, bounded.
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise BoxStartError(
                            f"template {key} is being built elsewhere for over {timeout:.0f}s"
                        ) from None
                    time.sleep(0.1)
            if not archive.exists():
                self._build_template(spec, setup, name, archive, cwd, timeout)

            async def load() -> Any:
                return await self._rt.import_box(str(archive), name=name)

            try:
                return self.loop.call(load, BOOKKEEPING_TIMEOUT, f"import template {key}")
            except BoxliteError:
                raise
            except Exception as exc:
                raise BoxStartError(f"boxlite could not import template {archive}: {exc}") from exc

    def _build_template(self, spec: BoxSpec, setup: str, name: str, archive: Path, cwd: Path, timeout: float) -> None:
        started = time.monotonic()
        handle = self.create_box(dataclasses.replace(spec, warm=False, template=None), name, timeout=timeout)
        try:
            left = max(1.0, timeout - (time.monotonic() - started))
            raw = handle.exec(["/bin/sh", "-c", setup], cwd=str(cwd), timeout=left)
            if raw.exit_code != 0 or raw.timed_out:
                out = (raw.stdout + raw.stderr).decode("utf-8", "replace")[-3000:]
                what = "timed out" if raw.timed_out else f"exited with status {raw.exit_code}"
                raise BoxStartError(f"--boxlite-setup {setup!r} {what} in the template box:\n{out}")
            box = handle._box
            tmp = archive.with_name(f"{archive.name}.{os.getpid()}.tmp")
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()  # a leftover, or a link planted for the SDK's export to write through

            async def export() -> None:
                await box.stop()
                await box.export(dest=str(tmp))

            try:
                self.loop.call(export, max(BOOKKEEPING_TIMEOUT, left), f"export template {name}")
                os.replace(tmp, archive)  # atomic: a reader sees a whole archive or none
            except BoxliteError:
                raise
            except Exception as exc:
                raise BoxStartError(f"boxlite could not export the template box {name}: {exc}") from exc
            finally:
                with contextlib.suppress(OSError):
                    tmp.unlink()
        finally:
            handle.destroy()

    def create_box(self, spec: BoxSpec, name: str, *, timeout: float) -> VmBox:
        if spec.template is not None and spec.template.startswith(TEMPLATE_PREFIX):
            box = self._clone_template(spec.template[len(TEMPLATE_PREFIX) :], name)
        else:
            box = self.register_box(spec, name)
        deadline = time.monotonic() + timeout

        async def start() -> None:
            await box.start()
            # The first exec is the readiness check too; it runs from "/" so it needs no workdir.
            ex = await box.exec("mkdir", ["-p", WORKDIR], None, False, None, None, "/")
            await ex.stdin().close()
            result = await ex.wait()
            if int(result.exit_code) != 0:
                raise BoxStartError(f"mkdir -p {WORKDIR} exited with {result.exit_code}")

        try:
            self.loop.call(start, max(1.0, deadline - time.monotonic()), f"start {name}")
        except Exception as exc:
            handle = VmBox(self, box, name)
            tail = handle.log_tail()
            with contextlib.suppress(Exception):
                self.remove_box(name)
            if isinstance(exc, BoxTimeoutError):
                raise BoxStartError(f"box {name} did not boot within {timeout:.0f}s\n{tail}".rstrip()) from exc
            raise BoxStartError(f"box {name} ({spec.describe()}) failed to boot: {exc}\n{tail}".rstrip()) from exc
        return VmBox(self, box, name)

    def _clone_template(self, key: str, name: str) -> Any:
        with self._template_mutex:
            tpl = self._templates.get(key)
        if tpl is None:
            raise ConfigError(f"no vm template {key!r} in this runtime: call ensure_template first")

        async def clone() -> Any:
            return await tpl.clone_box(name=name)

        try:
            return self.loop.call(clone, BOOKKEEPING_TIMEOUT, f"clone template {key} as {name}")
        except BoxTimeoutError:
            raise
        except Exception as exc:
            raise BoxStartError(f"boxlite could not clone template {key} as {name}: {exc}") from exc

    # -- the seam RestRuntime overrides: how a bookkeeping call is made, and where the boxes are --
    def _bookkeeping(self, factory: Callable[[], Awaitable[T]], what: str) -> T:
        """One bookkeeping call on the SDK's loop, bounded."""
        return self.loop.call(factory, BOOKKEEPING_TIMEOUT, what)

    @property
    def _boxes_at(self) -> str:
        """Where this runtime's boxes are, for their records."""
        return str(self.home)

    @property
    def _where(self) -> str:
        """Where this runtime's boxes are, for error messages."""
        return f"in {self.home}"

    def list_boxes(self) -> list[BoxRecord]:
        async def listing() -> Any:
            return await self._rt.list_info()

        infos = self._bookkeeping(listing, "list boxes")
        return [
            BoxRecord(
                name=str(i.name or i.id),
                id=str(i.id),
                runtime=self.name,
                state=str(i.state.status),
                home=self._boxes_at,
            )
            for i in infos
        ]

    def remove_box(self, name: str) -> None:
        not_found = self.sdk.NotFoundError

        async def remove() -> None:
            with contextlib.suppress(not_found):  # already gone (or reaped by a server's timers) is not an error
                await self._rt.remove(name, force=True)

        try:
            self._bookkeeping(remove, f"remove {name}")
        except BoxliteError:
            raise
        except Exception as exc:  # a raw SDK error must not escape to callers that catch BoxliteError
            raise BoxDeadError(f"boxlite could not remove box {name} {self._where}: {exc}") from exc

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True

        templates = [str(t.name) for t in self._templates.values()]
        self._templates.clear()

        async def shutdown() -> int:
            for name in templates:  # the archives stay in the shared store; this home's copies go
                with contextlib.suppress(Exception):
                    await self._rt.remove(name, force=True)
            with contextlib.suppress(Exception):
                await self._rt.shutdown()
            return len(await self._rt.list_info())

        remaining: int | None = None
        with contextlib.suppress(Exception):
            remaining = self.loop.call(shutdown, BOOKKEEPING_TIMEOUT, "shutdown")
        # Dropping the runtime (and every Box handle) releases BoxLite's home lock.
        self._rt = None
        self.loop.close()
        if remaining == 0:
            # The home is this owner's alone and holds no box any more: leave nothing for the
            # ledger to count as a leftover (the shared image store is only linked from here).
            shutil.rmtree(self.home, ignore_errors=True)


def image_store(home: Path) -> Path:
    """The machine's image store for the vm home ``home`` (``<base>/vm/<owner>``, see :func:`prepare_home`):
    :func:`pytest_boxlite.images.store_dir` of ``<base>``, shared with the namespace runtime."""
    from pytest_boxlite.images import store_dir

    return store_dir(Path(home).parent.parent)


def vm_homes(home: Path) -> Path:
    """Where the per-owner vm homes of ``home`` live (see :func:`prepare_home`)."""
    return Path(home) / "vm"


class VmKind:
    """The vm runtime's host-side operations (a :class:`~pytest_boxlite.runtimes.base.RuntimeKind`)."""

    name = "vm"
    #: Boxed tests fork per test inside a booted VM (the guest's namespaces, fresh layers; the
    #: forks reach the host through a relay over the SDK's exec stdio: VmBox.fork_listener).
    capabilities = Capabilities(fork=True)

    def host_facts(self) -> list[tuple[str, str]]:
        """KVM, the boxlite wheel, and whether micro-VMs can boot here (the host probe, milliseconds)."""
        p = probe()
        return [
            ("kvm", f"{'usable' if p.vm_ok else 'not usable'}: {p.kvm}"),
            ("boxlite", p.boxlite_version or "not installed"),
            ("vm runtime", f"{'available' if p.vm_ok else 'unavailable'}: {p.reason}"),
        ]

    def leftovers(self, home: Path, owners: Owners, *, each_box: bool = True) -> list[Leftover]:
        """The vm homes of ``home``: a live owner's as one entry (BoxLite locks it), a dead owner's
        as one entry per box record with ``each_box`` (opening the home), else one per home."""
        found: list[Leftover] = []
        base = vm_homes(home)
        try:
            # Through the home's descriptor: a ``vm`` link, and entries that are links or another
            # user's, are refused (never opened by BoxLite, never removed).
            with HomeDir.at(home, "vm") as vm:
                entries = vm.entries()
        except FileNotFoundError:
            entries = []
        for entry in entries:
            if entry.refused is not None:
                warnings.warn(
                    f"pytest-boxlite: refused {shown(base / entry.name, line=True)}: {entry.refused}; not a vm "
                    "home of yours: it is not followed or removed (remove it by hand if you know what it is)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            if not entry.is_dir:
                continue
            vm_home = base / entry.name
            owner = vm_home.name
            alive = owners.alive(owner)
            kept = (vm_home / "keep").exists()
            if alive or not each_box:
                found.append(Leftover(f"(vm home of {owner})", self.name, owner, alive, alive, kept, str(vm_home)))
                continue
            for rec in _records(vm_home):
                found.append(Leftover(rec, self.name, owner, False, False, kept, str(vm_home)))
        return found

    def remove_leftover(self, home: Path, leftover: Leftover) -> str | None:
        """Remove every box record of a dead owner's vm home, then the home (the shared image store
        stays); ``None`` when BoxLite still holds the home (its process is alive after all)."""
        assert leftover.owner is not None
        vm_home = vm_homes(home) / leftover.owner
        try:
            rt = VmRuntime(vm_home)
            try:
                names = [r.name for r in rt.list_boxes()]
                for n in names:
                    rt.remove_box(n)
            finally:
                rt.close()
        except BoxliteError:
            return None  # BoxLite still holds the home, or refuses its records: left for a later clean
        if "/" not in leftover.owner and leftover.owner not in ("", ".", ".."):
            with contextlib.suppress(OSError), HomeDir.at(home, "vm") as vm:
                vm.remove(leftover.owner)  # by descriptors: nothing below it is followed
        return f"{leftover.owner} (vm home, {len(names)} boxes)"

    def drop_templates(self, home: Path) -> list[str]:
        """Remove the template archives of ``<home>/vm-templates`` (boxes already imported from one
        keep their copy); one that a session is building or importing right now is left alone."""
        # Through the home's descriptor (see _homefs): a ``vm-templates`` link, and links or other
        # users' entries in it, are refused and warned about, never followed, written or removed.
        try:
            store = HomeDir.at(home, "vm-templates")
        except FileNotFoundError:
            return []
        except Refused as exc:
            _refused_template(exc.path, exc.why)
            return []
        dropped = []
        with store:
            entries = store.entries()
            for entry in entries:
                if entry.refused is not None:
                    _refused_template(store.path / entry.name, entry.refused)
                elif entry.is_file and entry.name.endswith(".boxlite"):
                    key = entry.name.removesuffix(".boxlite")
                    try:
                        with _template_lock(store.path, key, store) as lock:
                            # The lock a build or an import holds (see VmRuntime._load_template).
                            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                            store.unlink(entry.name, missing_ok=False)
                    except (BlockingIOError, FileNotFoundError):
                        continue  # in use, or gone meanwhile
                    except Refused as exc:
                        _refused_template(exc.path, exc.why)
                        continue
                    dropped.append(key)
            for entry in entries:  # half-written exports of builds that died
                if entry.refused is None and entry.is_file and entry.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        store.unlink(entry.name)
        return dropped

    def attach_existing(self, home: Path, name: str, argv: Sequence[str]) -> int | None:
        """``None``: a VM's bridge lives in the process that owns it, so no other process can attach."""
        return None


def _template_lock(store: Path, key: str, opened: HomeDir | None = None) -> BinaryIO:
    """The lock file ``<store>/<key>.lock`` that a template's build, import or removal holds,
    opened (made) through the store's descriptor: a store that is a link or not ours, or a lock
    that is a link (planted to be truncated by ``open(..., "w")``), is :class:`Refused`."""
    top = opened if opened is not None else HomeDir.open_expected(store, "the templates' directory")
    try:
        fd = top.open_file(f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    finally:
        if opened is None:
            top.close()
    return os.fdopen(fd, "r+b")


def _refused_template(path: str | Path, why: str) -> None:
    warnings.warn(
        f"pytest-boxlite: refused {shown(path, line=True)}: {why}; not a vm template of yours: it is not "
        "followed or removed (remove it by hand if you know what it is)",
        RuntimeWarning,
        stacklevel=3,
    )


def _records(vm_home: Path) -> list[str]:
    """The box records of a dead owner's vm home (none if BoxLite cannot open it)."""
    try:
        rt = VmRuntime(vm_home)
    except BoxliteError:
        return []
    try:
        return [r.name for r in rt.list_boxes()]
    finally:
        rt.close()


KIND = VmKind()


def resource_options(bl: Any, spec: BoxSpec) -> dict[str, Any]:
    """The ``BoxOptions`` fields for ``spec``'s cpus, memory and network (local and remote boxes alike)."""
    out: dict[str, Any] = {}
    if spec.cpus:
        out["cpus"] = spec.cpus
    if spec.memory_mib:
        out["memory_mib"] = spec.memory_mib
    if not spec.network:
        out["network"] = bl.NetworkSpec(outbound=bl.OutboundNetworkSpec(mode="disabled"))
    return out
