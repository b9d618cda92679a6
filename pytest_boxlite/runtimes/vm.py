"""The ``vm`` runtime: BoxLite micro-VMs through the boxlite SDK.

The SDK is async and every call must be made inside a running loop, so one
private event-loop thread per runtime runs them; callers block on
``run_coroutine_threadsafe(...).result(timeout)``.  A call that times out is
cancelled and its box is treated as dead.  The runtime is always opened on
an explicit home (``Boxlite(Options(home_dir=...))``): ``Boxlite.default()``
would install its own SIGINT/SIGTERM handler and lose pytest's exit code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pytest_boxlite import guest
from pytest_boxlite.errors import BoxDeadError, BoxStartError, BoxTimeoutError, ConfigError, RuntimeUnavailableError
from pytest_boxlite.runtimes._vmbridge import VmBridge
from pytest_boxlite.runtimes.base import DEFAULT_MAX_OUTPUT, BoxRecord, RawResult
from pytest_boxlite.spec import BoxSpec

T = TypeVar("T")
ATTACH = guest.path("attach")
WORKDIR = "/workspace"
#: Bound on bookkeeping calls (create, list, remove) that never boot anything.
BOOKKEEPING_TIMEOUT = 30.0


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


class VmBox:
    """A started micro-VM.  See :class:`pytest_boxlite.runtimes.base.BoxHandle`."""

    runtime_name = "vm"
    # The guest's exec stdout reaches us as lossily decoded text.
    binary_stdout = False
    workdir = WORKDIR
    guest_python = "python3"

    def __init__(self, runtime: VmRuntime, box: Any, name: str) -> None:
        self._rt = runtime
        self._box = box
        self.name = name
        self.id = str(box.id)
        self._dead = False
        self._bridge: VmBridge | None = None
        self._bridge_lock = threading.Lock()

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
    ) -> RawResult:
        if self._dead:
            raise BoxDeadError(f"box {self.name} is dead")
        if not argv:
            raise ConfigError("exec needs a non-empty argv")
        start = time.monotonic()

        async def run() -> RawResult:
            execution = await self._box.exec(
                argv[0], list(argv[1:]), list((env or {}).items()) or None, False, user, None, cwd or WORKDIR
            )
            if input is not None:
                stdin = execution.stdin()
                await stdin.send_input(input)
                await stdin.close()
            bufs = [bytearray(), bytearray()]
            dropped = [0, 0]

            async def collect(i: int, stream: Any) -> None:
                async for chunk in stream:
                    data = chunk.encode("utf-8", "surrogateescape") if isinstance(chunk, str) else bytes(chunk)
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
                # Cancelling the wait leaves the guest process running: kill it explicitly.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(execution.kill(), 5)
                with contextlib.suppress(Exception):
                    exit_code = int((await asyncio.wait_for(execution.wait(), 5)).exit_code)
            try:
                await asyncio.wait_for(readers, 2)
            except asyncio.TimeoutError:
                readers.cancel()
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
            return self._rt.loop.call(run, timeout + 15, f"exec {argv[0]!r} in {self.name}")
        except BoxTimeoutError:
            self._dead = True
            raise

    def alive(self, timeout: float = 2.0) -> bool:
        if self._dead:
            return False
        try:
            return self.exec(["true"], timeout=timeout).exit_code == 0
        except (BoxDeadError, BoxTimeoutError):
            return False
        except Exception:  # noqa: BLE001 - any SDK failure means the box cannot be used
            return False

    def log_tail(self, max_bytes: int = 4000) -> str:
        logs = sorted((self._rt.home / "boxes" / self.id).glob("**/*.log"))
        tail = b""
        for log in logs[-2:]:
            with contextlib.suppress(OSError), open(log, "rb") as fh:
                fh.seek(0, 2)
                fh.seek(max(0, fh.tell() - max_bytes // 2))
                tail += f"--- {log.name} ---\n".encode() + fh.read()
        return tail.decode("utf-8", "replace")

    def destroy(self) -> None:
        if self._dead and self._box is None:
            return
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
    shared = base / "images"
    shared.mkdir(parents=True, exist_ok=True)
    home = base / "vm" / owner
    home.mkdir(parents=True, exist_ok=True)
    link = home / "images"
    if not link.exists() and not link.is_symlink():
        link.symlink_to(shared, target_is_directory=True)
    return home


class VmRuntime:
    """BoxLite runtime on one home directory (one per process: BoxLite locks the home)."""

    name = "vm"
    isolation = "BoxLite micro-VM (KVM / Hypervisor.framework): own kernel, own filesystem, hardware isolation"

    def __init__(self, home: Path) -> None:
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self._boxlite = _import_boxlite()
        self.loop = EventLoopThread()
        bl = self._boxlite

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

    def box_options(self, spec: BoxSpec) -> Any:
        bl = self._boxlite
        kwargs: dict[str, Any] = {
            "image": spec.image,
            "env": list(spec.env),
            "working_dir": WORKDIR,
            # Keep the record after a stop so a dead session's boxes can be found and removed.
            "auto_delete": False,
        }
        if spec.mounts:
            # Same paths as on the host, read-only: nothing the guest writes may reach the host.
            kwargs["volumes"] = [(m, m, True) for m in spec.mounts]
        if spec.cpus:
            kwargs["cpus"] = spec.cpus
        if spec.memory_mib:
            kwargs["memory_mib"] = spec.memory_mib
        if not spec.network:
            kwargs["network"] = bl.NetworkSpec(outbound=bl.OutboundNetworkSpec(mode="disabled"))
        return bl.BoxOptions(**kwargs)

    def register_box(self, spec: BoxSpec, name: str) -> Any:
        """Create the box record without booting it (works without KVM)."""
        opts = self.box_options(spec)

        async def create() -> Any:
            return await self._rt.create(opts, name=name)

        try:
            return self.loop.call(create, BOOKKEEPING_TIMEOUT, f"create {name}")
        except BoxTimeoutError:
            raise
        except Exception as exc:
            raise BoxStartError(f"boxlite could not create box {name} ({spec.describe()}): {exc}") from exc

    def create_box(self, spec: BoxSpec, name: str, *, timeout: float) -> VmBox:
        box = self.register_box(spec, name)

        async def start() -> None:
            await box.start()

        try:
            self.loop.call(start, timeout, f"start {name}")
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.remove_box(name)
            if isinstance(exc, BoxTimeoutError):
                raise BoxStartError(f"box {name} did not boot within {timeout:.0f}s") from exc
            raise BoxStartError(f"box {name} ({spec.describe()}) failed to boot: {exc}") from exc
        return VmBox(self, box, name)

    def list_boxes(self) -> list[BoxRecord]:
        async def listing() -> Any:
            return await self._rt.list_info()

        infos = self.loop.call(listing, BOOKKEEPING_TIMEOUT, "list boxes")
        return [
            BoxRecord(
                name=str(i.name or i.id),
                id=str(i.id),
                runtime=self.name,
                state=str(i.state.status),
                home=str(self.home),
            )
            for i in infos
        ]

    def remove_box(self, name: str) -> None:
        async def remove() -> None:
            try:
                await self._rt.remove(name, force=True)
            except Exception as exc:  # a box that is already gone is not an error
                if "not found" not in str(exc).lower():
                    raise

        self.loop.call(remove, BOOKKEEPING_TIMEOUT, f"remove {name}")

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True

        async def shutdown() -> None:
            with contextlib.suppress(Exception):
                await self._rt.shutdown()

        with contextlib.suppress(BoxTimeoutError):
            self.loop.call(shutdown, BOOKKEEPING_TIMEOUT, "shutdown")
        # Dropping the runtime (and every Box handle) releases BoxLite's home lock.
        self._rt = None
        self.loop.close()
