"""Per-process run state: settings, runtime, owner lock, warm pool.  Lives in ``config.stash``.

The runtime and pool start lazily in a background thread as soon as the
first item that needs a box is collected, so collection never waits on a
boot and runs that use no box pay nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pytest_boxlite import ledger
from pytest_boxlite._homefs import check_home
from pytest_boxlite._switch import SwitchInterval
from pytest_boxlite.errors import BoxliteError, BoxStartError, ConfigError
from pytest_boxlite.pool import BoxLifecycle, BoxPool, DefaultLifecycle, make_namer
from pytest_boxlite.runtimes import BoxHandle, Choice, Runtime, choose, open_choice, remote_target
from pytest_boxlite.settings import Settings
from pytest_boxlite.spec import BoxSpec, ImageRoot, check_image

#: How long resolving one image may take (a first unpack of a large archive; a registry pull).
IMAGE_TIMEOUT = 600.0


@dataclasses.dataclass
class SessionReport:
    """What the terminal summary shows; plain data so xdist workers can send it to the controller."""

    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    leaked: list[str] = dataclasses.field(default_factory=list)
    reconciled: list[str] = dataclasses.field(default_factory=list)
    kept: list[str] = dataclasses.field(default_factory=list)
    #: Why sandbox boxes were booted although forking was allowed (the host refused a fork).
    fork_fallback: str | None = None
    #: Stats sent by xdist workers, merged into the controller's summary.
    worker_stats: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class _Provisioning:
    """The pool's lifecycle: the session's own provisioning (``--boxlite-setup``) around the owner's steps."""

    def __init__(self, session: BoxliteSession, inner: BoxLifecycle) -> None:
        self.session = session
        self.inner = inner

    def prepare(self, spec: BoxSpec) -> BoxSpec:
        spec = self.inner.prepare(spec)
        return self.session._provisioned(spec) if self.session.settings.setup else spec

    def after_boot(self, handle: BoxHandle, spec: BoxSpec) -> None:
        self.session._setup_box(handle, spec)
        self.inner.after_boot(handle, spec)

    def before_destroy(self, handle: BoxHandle) -> None:
        self.inner.before_destroy(handle)

    def relieve(self, spec: BoxSpec) -> bool:
        return self.inner.relieve(spec)


def home_source(settings: Settings) -> str:
    """Where the home's value came from, for messages (``ini boxlite_home``, ``env ...``, ``default``)."""
    source = settings.sources.get("home", "default")
    return "the default, ~/.cache/pytest-boxlite" if source == "default" else source


class BoxliteSession:
    """Everything one pytest process knows about its boxes.

    ``lifecycle`` is the owner's part of each box's life (e.g. a warm test interpreter in
    ``warm`` boxes); ``worker_mounts`` are the host directories a test worker must see at the
    same paths as the host; ``opener`` opens the runtime (kind, home, owner) instead of
    :func:`~pytest_boxlite.runtimes.open_choice`: the unit tests give a fake one.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        session_id: str,
        worker_id: str | None,
        lifecycle: BoxLifecycle | None = None,
        worker_mounts: tuple[str, ...] | Callable[[], tuple[str, ...]] = (),
        project: str | os.PathLike[str] | None = None,
        opener: Callable[[str, Path, str], Runtime] | None = None,
    ) -> None:
        self.settings = settings
        self.session_id = session_id
        self.worker_id = worker_id
        self.owner = session_id if worker_id is None else f"{session_id}-{worker_id}"
        self.home = Path(settings.home).expanduser()
        remote = remote_target(settings.url, credential_file=settings.credential_file, max_boxes=settings.max_boxes)
        self.choice: Choice = choose(settings.runtime, remote)
        #: The project (pytest's rootdir; the working directory if not given): every sandbox sees
        #: it at its own path, copy-on-write (read-only on vm), wherever it lies, /tmp included.
        self.project = os.path.abspath(project if project is not None else os.getcwd())
        #: Images resolved to their root filesystems (or why they cannot be), per reference.
        self._images: dict[str, ImageRoot | ConfigError] = {}
        self._images_lock = threading.Lock()
        #: The specs :meth:`spec_for` made, by its arguments.
        self._specs: dict[tuple[Any, ...], BoxSpec] = {}
        self.report = SessionReport()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._runtime: Runtime | None = None
        self._pool: BoxPool | None = None
        self._owner_lock: ledger.OwnerLock | None = None
        self._starter: threading.Thread | None = None
        self._closed = False
        #: The host's switch interval, short while boxes start and serve (see _switch.py).
        self.switch = SwitchInterval()
        self._opener = opener
        self._lifecycle = _Provisioning(self, DefaultLifecycle() if lifecycle is None else lifecycle)
        self._wanted: set[BoxSpec] = set()
        self._namer = make_namer(self.owner)
        self._templated: dict[BoxSpec, BoxSpec] = {}
        self._template_lock = threading.Lock()
        #: Where the setup command runs and relative paths in it resolve: the invocation directory.
        self.cwd = Path.cwd()
        self._worker_mounts = worker_mounts
        #: Why boxed tests cannot be forked after all (the guest kernel said so), or ``None``.
        self.fork_refused: str | None = None
        #: What ``unheld_caps`` found per (memory, cpus) request.
        self._caps: dict[tuple[int | None, int | None], str] = {}
        self._caps_lock = threading.Lock()
        #: Why the session's own image (``--boxlite-image``, ini, environment) cannot be used, or
        #: ``None``: then every box of the session fails with it (the header says so at once).
        self.image_error: str | None = None
        try:
            self.default_spec = self.spec_for()
        except ConfigError as exc:
            if settings.all or not self.image_explicit():
                raise  # every test is boxed: a usage error now, before anything runs
            # A run that boxes nothing (settings shown, a plain unit test) is not stopped for it;
            # every box asked for gets this error, none is ever made on the host's files instead.
            self.image_error = str(exc)
            self.default_spec = self.spec_for(resolve=False)
            self._start_error = exc
            self._ready.set()
        if settings.all and self.default_spec.root is not None:
            # Every test is boxed in the image: an image that cannot run the interpreter is a
            # usage error now, before any box boots, not one error per test.
            self.spec_for(warm=True, mounts=())

    @property
    def fork_boxes(self) -> bool:
        """Boxed tests get boxes forked from a warm interpreter (runtimes that can fork): one per
        test, or one per module with ``--boxlite-scope=module``.

        Kept boxes (``--boxlite-keep``) must outlive the run, which a fork cannot, and
        ``--boxlite-fresh=boot`` asks for a box booted per test (on vm: a VM, so a kernel, per
        test): then tests get booted boxes of their own instead.  So does a session whose warm
        interpreter found that its kernel refuses the fork's namespaces (:meth:`refuse_fork`).
        """
        s = self.settings
        return (
            self.choice.capabilities.fork
            and s.scope in ("test", "module")
            and not s.keep
            and s.fresh == "fork"
            and self.fork_refused is None
        )

    def refuse_fork(self, why: str) -> None:
        """The boxes' kernel refuses the per-test fork's namespaces: boot a box per test from now on."""
        self.fork_refused = why

    @property
    def worker_mounts(self) -> tuple[str, ...]:
        """What a test worker must see at the same paths as the host (worked out at first use:
        a run that boxes no test never needs it)."""
        mounts = self._worker_mounts
        if callable(mounts):
            # Two threads asking at once both work it out, alike: no lock needed.
            mounts = self._worker_mounts = mounts()
        return mounts

    @property
    def default_worker_spec(self) -> BoxSpec:
        """The spec of boxes that run marked tests without arguments."""
        return self.spec_for(warm=True, mounts=self.worker_mounts)

    # -- specs --------------------------------------------------------------
    def spec_for(self, *, resolve: bool = True, **overrides: Any) -> BoxSpec:
        """The session's default spec with ``overrides`` (image, cpus, memory, env, network, user) applied.

        Where the runtime boxes on the host's files unless an image is named (namespace) and one
        is (:meth:`image_explicit`), the image is resolved (:meth:`image_root`) unless ``resolve``
        is false; a :class:`ConfigError` names the image and the cause where it cannot be.

        Specs are kept by their arguments (and the runtime's kind, which ``auto`` may change):
        every collected test asks, most with the same arguments, and making one checks every field."""
        try:
            key = (resolve, self.choice.kind, tuple(sorted(overrides.items())))
            known = self._specs.get(key)
        except TypeError:  # an unhashable argument: made anew (the spec's checks name what is wrong)
            key, known = None, None
        if known is not None:
            return known
        spec = self._make_spec(resolve, overrides)
        if key is not None:
            self._specs[key] = spec
        return spec

    def _make_spec(self, resolve: bool, overrides: dict[str, Any]) -> BoxSpec:
        s = self.settings
        base: dict[str, Any] = {
            "image": s.image,
            "cpus": s.cpus,
            "memory_mib": s.memory,
            "network": s.network,
            "env": (),
        }
        known = {"image", "cpus", "memory", "memory_mib", "env", "network", "warm", "mounts", "user"}
        unknown = set(overrides) - known
        if unknown:
            raise ConfigError(f"unknown box setting(s): {', '.join(sorted(unknown))}")
        if "memory" in overrides:
            overrides["memory_mib"] = overrides.pop("memory")
        base.update({k: v for k, v in overrides.items() if v is not None})
        if not base.get("warm") and "mounts" not in base:
            base["mounts"] = (self.project,)
        if resolve and self.image_explicit(overrides.get("image")):
            from pytest_boxlite.runtimes import image_problem, images_on_request

            if images_on_request(self.choice.kind):
                base["root"] = self.image_root(base["image"])
                spec = BoxSpec(**base)
                problem = image_problem(self.choice.kind, spec)
                if problem is not None:
                    raise ConfigError(problem)
                return spec
            from pytest_boxlite.images.reference import is_image_reference_local

            if is_image_reference_local(base["image"]) and not self.settings.url:
                # vm: a local image is checked (and stored) before any box; the runtime lays it out
                # for the SDK from the same store (a remote server refuses it: it cannot read it).
                self.image_root(base["image"])
        return BoxSpec(**base)

    def image_explicit(self, override: str | None = None) -> bool:
        """Whether boxes get an image that was asked for (an ``image=`` of a call or marker, or
        ``--boxlite-image``/ini/environment), not the default one.  A runtime that boxes on the
        host's files unless asked (namespace) shows the image only then."""
        return override is not None or self.settings.sources.get("image", "default") != "default"

    def image_root(self, image: str) -> ImageRoot:
        """``image`` resolved through the image store of this session's home (pulled or unpacked
        once, shared by every session and worker); a :class:`ConfigError` naming the image and the
        cause where it cannot be (unknown, missing or corrupt archive, another architecture)."""
        check_image(image)
        with self._images_lock:
            known = self._images.get(image)
            if known is None:
                known = self._images[image] = self._resolve(image)
        if isinstance(known, ConfigError):
            raise ConfigError(str(known))
        return known

    def _resolve(self, image: str) -> ImageRoot | ConfigError:
        try:
            from pytest_boxlite.images import ImageError, ensure_image, store_dir
        except ImportError as exc:  # pragma: no cover - the package ships it
            return ConfigError(f"image {image!r}: the image store is not available ({exc})")
        try:
            found = ensure_image(image, store=store_dir(self.home), timeout=IMAGE_TIMEOUT)
        except (ImageError, BoxliteError, OSError) as exc:
            why = str(exc)
            named = f"image {image!r}: "
            return ConfigError(f"image {image!r} cannot be used: {why[len(named) :] if why.startswith(named) else why}")
        cfg = found.config
        return ImageRoot(
            reference=image,
            digest=found.digest,
            rootfs=str(found.rootfs),
            env=tuple((str(k), str(v)) for k, v in (cfg.env or ())),
            workdir=cfg.workdir or None,
            user=cfg.user or None,
        )

    def unused_image(self, image: str, what: str) -> str | None:
        """The warning for ``what`` (``"<test>: @pytest.mark.boxlite"``, ``"boxlite_pool.sandbox"``)
        asking for ``image`` where this session's runtime uses no image, else ``None``.  The one
        text both the marker and the pool fixture warn with."""
        from pytest_boxlite.runtimes import images_on_request, kind_notes

        _, unused = kind_notes(self.choice.kind)
        if not unused or image == self.settings.image or images_on_request(self.choice.kind):
            return None
        return (
            f"{what}(image={image!r}) has no effect on the {self.choice.kind} runtime ({unused}); "
            "it runs on this host's files. Use --boxlite-runtime=vm for a real image."
        )

    def unheld_caps(self, spec: BoxSpec) -> str | None:
        """Why the memory or cpus ``spec`` asks for beyond the session's default cannot hold here
        (for a per-test warning: the report header speaks of the default only), else ``None``."""
        from pytest_boxlite.runtimes import header_notes

        default = self.default_spec
        wanted = []
        if spec.memory_mib != default.memory_mib and spec.memory_mib is not None:
            wanted.append(("memory", f"memory {spec.memory_mib} MiB"))
        if spec.cpus != default.cpus and spec.cpus is not None:
            wanted.append(("cpus", f"cpu {spec.cpus}"))
        if not wanted:
            return None
        key = (spec.memory_mib, spec.cpus)
        with self._caps_lock:
            if key not in self._caps:
                # A probe per distinct request (the namespace runtime makes and removes a cgroup).
                asked = dataclasses.replace(default, memory_mib=spec.memory_mib, cpus=spec.cpus)
                lines = header_notes(self.choice.kind, asked)
                prefix = "boxlite: limits not enforced: "
                line = next((x[len(prefix) :] for x in lines if x.startswith(prefix)), "")
                self._caps[key] = line.split("; in force:")[0]
            missing = self._caps[key]
        unheld = [entry for entry in missing.split("; ") if any(entry.startswith(w) for _, w in wanted)]
        return "; ".join(unheld) or None

    # -- lifecycle ------------------------------------------------------------
    def prepare_home(self) -> None:
        """Create the home and take this process's owner lock; fails clearly if the home is unusable."""
        # The home is a trust boundary: ours, writable by no one else, or nothing in it is used
        # (UnsafeHome names the path, the fix and where the value came from).
        try:
            check_home(self.home, source=home_source(self.settings), create=True)
            probe = self.home / f".write-test-{self.owner}"
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                # Some real bytes: an empty file fits on a full disk, a box's state does not.
                with open(fd, "wb") as fh:
                    fh.write(b"\0" * (256 << 10))
                    fh.flush()
                    os.fsync(fh.fileno())
            finally:
                probe.unlink(missing_ok=True)
            # A restarted xdist worker reuses its predecessor's owner id: clear what that one left.
            ledger.reconcile(self.home, owners={self.owner})
            lock = ledger.OwnerLock(self.home, self.owner)
            lock.acquire()
        except OSError as exc:
            raise ConfigError(
                f"--boxlite-home {self.home} is not usable ({exc.strerror or exc}; the value is from "
                f"{home_source(self.settings)}); point --boxlite-home (or PYTEST_BOXLITE_HOME) at a writable "
                "directory with free space"
            ) from None
        self._owner_lock = lock

    def defer_error(self, exc: BaseException) -> None:
        """Remember why boxes cannot be had; raised to the first test that asks for one."""
        self._start_error = exc
        self._ready.set()  # nothing will start: start_async sees the session is "ready"

    def reconcile(self) -> list[str]:
        """Remove leftovers of dead sessions (never a live session's boxes)."""
        removed = ledger.reconcile(self.home)
        self.report.reconciled += removed
        return removed

    def want(self, spec: BoxSpec) -> None:
        """Say that tests will lease boxes of ``spec``: start the runtime and keep such boxes warm."""
        with self._lock:
            if spec in self._wanted:
                return
            self._wanted.add(spec)
            pool = self._pool
        if pool is not None:
            pool.prewarm(spec, self._warm_count(spec))
        else:
            self.start_async()

    def _warm_count(self, spec: BoxSpec) -> int:
        # Forked boxes need one warm interpreter per spec, not a box per test.
        return 1 if spec.warm and self.fork_boxes else self.settings.max_boxes

    def start_async(self) -> None:
        """Open the runtime and start prewarming in the background (once)."""
        with self._lock:
            if self._starter is not None or self._closed or self._ready.is_set():
                return
            # From here on the host's threads make and serve boxes beside the main thread.
            self.switch.lower()
            self._starter = threading.Thread(target=self._start, name="boxlite-start", daemon=True)
            self._starter.start()

    @contextlib.contextmanager
    def host_code(self) -> Iterator[None]:
        """Around a test that runs on the host: the user's own switch interval while it runs (the
        plugin's short one is only for its threads, see _switch.py), the short one again after."""
        lowered = self.switch.lowered()
        if lowered:
            self.switch.restore()
        try:
            yield
        finally:
            if lowered and not self._closed:
                self.switch.lower()

    def _start(self) -> None:
        try:
            if self._opener is not None:
                runtime = self._opener(self.choice.kind, self.home, self.owner)
            else:
                # Under auto, a VM runtime that will not open falls back to namespace, saying why.
                runtime, self.choice = open_choice(self.choice, self.home, self.owner)
                # A remote server's runtime removes, on opening, what dead sessions left there.
                self.report.reconciled += list(runtime.reaped)
            s = self.settings
            # Sandbox boxes forked from a zygote end with this process: kept ones must be booted,
            # and --boxlite-fresh=boot asks for every box booted.
            runtime.allow_forked_boxes(not s.keep and s.fresh == "fork")
            pool = BoxPool(
                runtime,
                namer=self._namer,
                max_boxes=s.max_boxes,
                boot_timeout=s.boot_timeout,
                lease_timeout=s.lease_timeout,
                idle_timeout=s.idle_timeout,
                command_timeout=s.timeout,
                lifecycle=self._lifecycle,
            )
            with self._lock:
                self._runtime, self._pool = runtime, pool
                closed = self._closed
                wanted = list(self._wanted)
            if not closed:
                for spec in wanted:
                    pool.prewarm(spec, self._warm_count(spec))
        except BaseException as exc:  # noqa: BLE001 - raised to every test that asks for a box
            self._start_error = exc
        finally:
            self._ready.set()

    def _provisioned(self, spec: BoxSpec) -> BoxSpec:
        """With ``--boxlite-setup``: the spec that starts from the provisioned template (built once)."""
        from pytest_boxlite.templates import ensure_template

        assert self.settings.setup is not None and self._runtime is not None and self._pool is not None
        with self._template_lock:
            if spec not in self._templated:
                self._templated[spec] = ensure_template(
                    self._runtime,
                    spec,
                    self.settings.setup,
                    home=self.home,
                    cwd=self.cwd,
                    timeout=max(self.settings.boot_timeout, self.settings.timeout),
                    name=self._namer(),
                )
            return self._templated[spec]

    def _setup_box(self, handle: BoxHandle, spec: BoxSpec) -> None:
        setup = self.settings.setup
        if setup and spec.template is None:
            # The runtime made no template to start from (a remote server): each box runs the
            # setup once, in the background, before it is leased.
            raw = handle.exec(["/bin/sh", "-c", setup], cwd=str(self.cwd), timeout=self.settings.timeout)
            if raw.exit_code != 0 or raw.timed_out:
                err = (raw.stdout + raw.stderr).decode("utf-8", "replace")[-3000:]
                raise BoxStartError(f"--boxlite-setup {setup!r} failed in box {handle.name}:\n{err}")

    def pool(self, timeout: float | None = None) -> BoxPool:
        """The warm pool, starting it if needed; raises the start error if the runtime could not open."""
        self.start_async()
        if not self._ready.wait(self.settings.boot_timeout if timeout is None else timeout):
            raise BoxliteError("the boxlite runtime did not open in time")
        if self._start_error is not None:
            raise self._start_error
        assert self._pool is not None
        return self._pool

    @property
    def started(self) -> bool:
        return self._pool is not None

    def reap_workers(self) -> None:
        """xdist controller, after its workers ended: remove whatever they (or their boxes' hosts) left."""
        removed = ledger.reconcile(self.home, owner_prefix=f"{self.session_id}-")
        self.report.leaked += removed

    def shutdown(self) -> None:
        """Destroy every box of this process, count leaks, release the owner lock.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            starter = self._starter
        if starter is not None:
            starter.join(self.settings.boot_timeout)
        pool, runtime = self._pool, self._runtime
        try:
            if pool is not None:
                pool.shutdown()
                self.report.stats = pool.stats.asdict()
                self.report.kept = list(pool.stats.kept)
            if runtime is not None:
                # The runtime's own template boxes (zygotes) go first: they are no leak.
                runtime.stop_forking()
                self.report.fork_fallback = runtime.fork_fallback
                # Anything of ours still listed after the pool shut down is a leak: report it, then reap it.
                mine = [
                    r.name
                    for r in runtime.list_boxes()
                    if ledger.owner_of(r.name) == self.owner and r.name not in self.report.kept
                ]
                self.report.leaked = mine
                for name in mine:
                    with contextlib.suppress(BoxliteError, OSError):
                        runtime.remove_box(name)
                runtime.close()
        finally:
            self.switch.restore()
            if self._owner_lock is not None:
                self._owner_lock.release()
