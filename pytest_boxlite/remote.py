"""Run one test item inside a box and rebuild its reports on the host.

Each box made for boxed tests gets a warm interpreter at boot: an execnet
gateway through the runtime's stdio bridge, running
:mod:`pytest_boxlite._worker` with pytest already configured.  A test then
costs one request on that channel.  Reports travel through pytest's public
``pytest_report_to_serializable`` / ``pytest_report_from_serializable``
hooks and are logged on the host with ``pytest_runtest_logreport``, so
terminal output, ``-x``, ``--lf``, junitxml and other plugins see them as
local reports.  When the box dies or times out, the missing phases become
failed reports that say what happened, with the box's log attached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import execnet
import pytest

from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.pool import Lease
from pytest_boxlite.runtimes.base import BoxHandle
from pytest_boxlite.spec import GUEST_ENV, BoxSpec, worker_env

if TYPE_CHECKING:
    from pytest_boxlite.markers import BoxPlan
    from pytest_boxlite.session import BoxliteSession

WORKER_SOURCE = Path(__file__).with_name("_worker.py")
#: Flags whose values are forwarded to the guest's pytest so reports render the same.
_FORWARD_VALUE_FLAGS = ("-p", "-o", "--override-ini", "-W", "--pythonwarnings", "--import-mode", "--assert")
_FORWARD_JOINED = ("--override-ini=", "--pythonwarnings=", "--import-mode=", "--assert=")
_FORWARD_BARE_FLAGS = ("--strict-markers", "--strict-config", "--full-trace", "--showlocals", "-l")


@dataclasses.dataclass
class _Worker:
    gateway: Any
    channel: Any
    pid: int
    status_file: Path


def guest_args(config: pytest.Config) -> list[str]:
    """The guest's ``pytest.main`` arguments: the host's rootdir, ini file and rendering options."""
    args = ["--rootdir", str(config.rootpath), "-p", "no:cacheprovider"]
    if config.inipath is not None:
        args += ["-c", str(config.inipath)]
    inv = list(config.invocation_params.args)
    i = 0
    while i < len(inv):
        a = inv[i]
        if a in _FORWARD_VALUE_FLAGS and i + 1 < len(inv):
            args += [a, inv[i + 1]]
            i += 2
            continue
        short_joined = a.startswith(("-p", "-W", "-o")) and len(a) > 2 and not a.startswith("--")
        if short_joined or a.startswith(_FORWARD_JOINED) or a in _FORWARD_BARE_FLAGS:
            args.append(a)
        i += 1
    opt = config.option
    args += [f"--tb={opt.tbstyle}", f"--capture={opt.capture}"]
    verbose = int(getattr(opt, "verbose", 0))
    args += ["-" + "v" * verbose] if verbose > 0 else (["-" + "q" * -verbose] if verbose < 0 else [])
    return args


def _node_arg(config: pytest.Config, nodeid: str) -> str:
    """A command-line argument that selects ``nodeid`` whatever the guest's working directory."""
    path, sep, rest = nodeid.partition("::")
    return str(config.rootpath / path) + sep + rest


class RemoteRunner:
    """Starts warm interpreters in boxes and runs items in them."""

    def __init__(self, config: pytest.Config, boot_timeout: float) -> None:
        self.config = config
        self.boot_timeout = boot_timeout
        self.group = execnet.Group()
        self._workers: dict[str, _Worker] = {}
        self._lock = threading.Lock()
        self._source = WORKER_SOURCE.read_text()
        self._args = guest_args(config)
        self._status_tmp = tempfile.TemporaryDirectory(prefix="boxlite-status-")
        self.status_dir = Path(self._status_tmp.name)

    def mounts(self) -> tuple[str, ...]:
        """Host directories a test worker needs at the same paths: the project and ``sys.path``."""
        from pytest_boxlite.spec import minimal_dirs

        paths = [str(self.config.rootpath), str(self.config.invocation_params.dir), *sys.path]
        return minimal_dirs(p for p in paths if p)

    # -- pool callbacks -------------------------------------------------------
    def start_worker(self, handle: BoxHandle, spec: BoxSpec) -> None:
        """Pool ``on_boot`` callback: start pytest inside the fresh box and wait until it is ready."""
        cwd = str(self.config.invocation_params.dir)
        status_file = self.status_dir / f"{handle.name}.status"
        argv = handle.attach_argv([handle.guest_python], cwd=cwd, status_file=str(status_file))
        spec_str = "execmodel=main_thread_only//popen//python=" + shlex.join(argv)
        gw = self.group.makegateway(spec_str)
        try:
            channel = gw.remote_exec(self._source)
            channel.send(
                {
                    "args": self._args,
                    "cwd": cwd,
                    "sys_path": list(sys.path),
                    "env": worker_env(spec),
                }
            )
            kind, pid = channel.receive(self.boot_timeout)
            if kind != "ready":
                raise BoxliteError(f"unexpected first message from the worker in {handle.name}: {kind!r}")
        except BaseException as exc:
            with contextlib.suppress(Exception):
                gw.exit()
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            tail = handle.log_tail()
            raise BoxliteError(f"pytest did not start inside box {handle.name}: {exc}\n{tail}".rstrip()) from exc
        with self._lock:
            self._workers[handle.name] = _Worker(gw, channel, int(pid), status_file)

    def stop_worker(self, handle: BoxHandle) -> None:
        """Pool ``on_destroy`` callback: drop the gateway; the box is killed right after."""
        with self._lock:
            w = self._workers.pop(handle.name, None)
        if w is not None:
            with contextlib.suppress(Exception):
                w.gateway.exit()

    def live_workers(self) -> set[str]:
        """Names of boxes whose worker is still usable."""
        with self._lock:
            return set(self._workers)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.group.terminate(timeout=5.0)
        self._status_tmp.cleanup()

    # -- running ------------------------------------------------------------------
    def run_item(self, item: pytest.Item, lease: Lease, *, next_nodeid: str | None, timeout: float) -> list[Any]:
        """Run ``item`` in the leased box; return host-side reports (always a complete set)."""
        config = item.config
        handle = lease.handle
        with self._lock:
            worker = self._workers.get(handle.name)
        if worker is None:
            return self._synthesized(item, "setup", f"box {handle.name} has no running test worker", handle, 0.0)
        start = time.monotonic()
        request = (
            item.nodeid,
            _node_arg(config, item.nodeid),
            next_nodeid,
            _node_arg(config, next_nodeid) if next_nodeid else None,
        )
        reports: list[Any] = []
        deadline = start + timeout
        try:
            worker.channel.send(request)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                kind, data = worker.channel.receive(left)
                if kind == "report":
                    rep = config.hook.pytest_report_from_serializable(config=config, data=data)
                    reports.append(rep)
                elif kind == "done":
                    break
                elif kind == "error":
                    return self._synthesized(item, "setup", str(data), handle, time.monotonic() - start)
        except (TimeoutError, execnet.TimeoutError):
            self._kill(handle)
            why = f"timed out after {timeout:.0f}s; the box was killed (--boxlite-timeout or the marker's timeout)"
            return self._complete(item, reports, why, handle, time.monotonic() - start)
        except (EOFError, OSError, execnet.RemoteError, execnet.HostNotFound) as exc:
            why = self._death_reason(handle, worker, exc)
            return self._complete(item, reports, why, handle, time.monotonic() - start)
        return reports

    def _kill(self, handle: BoxHandle) -> None:
        with self._lock:
            w = self._workers.pop(handle.name, None)
        with contextlib.suppress(Exception):
            handle.destroy()
        if w is not None:
            with contextlib.suppress(Exception):
                w.channel.close()

    def _death_reason(self, handle: BoxHandle, worker: _Worker, exc: BaseException) -> str:
        with self._lock:
            self._workers.pop(handle.name, None)
        oom = getattr(handle, "oom_killed", None)
        if oom is not None and oom():
            return "the test process in the box was killed by the kernel's OOM killer (the box's memory cap)"
        how = _how_it_died(worker.status_file)
        gone = "" if handle.alive(timeout=1.0) else "; the box itself is gone"
        return f"the test process in the box {how}{gone} (channel: {type(exc).__name__}: {exc})"

    def _complete(
        self, item: pytest.Item, reports: list[Any], why: str, handle: BoxHandle, duration: float
    ) -> list[Any]:
        """Add failed reports for the phases the box did not finish."""
        done = {r.when for r in reports}
        if "setup" not in done:
            return reports + self._synthesized(item, "setup", why, handle, duration)
        out = list(reports)
        if "call" not in done and all(r.passed for r in reports):
            out.append(_report(item, "call", "failed", why, handle, duration))
        if "teardown" not in done:
            out.append(_report(item, "teardown", "passed", None, handle, 0.0))
        return out

    def _synthesized(self, item: pytest.Item, when: str, why: str, handle: BoxHandle, duration: float) -> list[Any]:
        reports = [_report(item, when, "failed", why, handle, duration)]
        if when != "teardown":
            reports.append(_report(item, "teardown", "passed", None, handle, 0.0))
        return reports


def _how_it_died(status_file: Path, wait: float = 2.0) -> str:
    """'exited with status 3' / 'was killed by SIGSEGV', read from the attach bridge's status file."""
    deadline = time.monotonic() + wait
    while True:
        try:
            code = int(status_file.read_text().strip())
            break
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return "died"
            time.sleep(0.02)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def _report(
    item: pytest.Item, when: str, outcome: str, why: str | None, handle: BoxHandle, duration: float
) -> pytest.TestReport:
    sections = []
    if why is not None:
        tail = handle.log_tail()
        if tail.strip():
            sections.append((f"boxlite log of {handle.name}", tail))
    return pytest.TestReport(
        nodeid=item.nodeid,
        location=item.location,
        keywords={k: 1 for k in item.keywords},
        outcome=outcome,  # type: ignore[arg-type]
        longrepr=f"[boxlite] {why}" if why else None,
        when=when,  # type: ignore[arg-type]
        sections=sections,
        duration=duration,
        user_properties=list(item.user_properties),
    )


def in_guest() -> bool:
    """True inside a box's test worker: the plugin then stays passive."""
    return os.environ.get(GUEST_ENV) == "1"


class BoxedExecutor:
    """The runtest protocol of boxed items: lease (per test or per module), run, log reports."""

    KEEP_PROPERTY = "boxlite_box"

    def __init__(self, runner: RemoteRunner, session: BoxliteSession) -> None:
        self.runner = runner
        self.session = session
        self._held: tuple[str, BoxSpec, Lease] | None = None  # module scope: (module path, spec, lease)

    def run_protocol(
        self, item: pytest.Item, plan: BoxPlan, nextitem: pytest.Item | None, next_plan: BoxPlan | None
    ) -> bool:
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        module = item.nodeid.split("::", 1)[0]
        shared = (
            self.session.settings.scope == "module"
            and nextitem is not None
            and next_plan is not None
            and next_plan.spec == plan.spec
            and nextitem.nodeid.split("::", 1)[0] == module
        )
        reports: list[Any]
        lease: Lease | None = None
        try:
            lease = self._lease(module, plan)
        except BoxliteError as exc:
            reports = [
                _report_no_box(item, "setup", "failed", f"[boxlite] could not get a box: {exc}"),
                _report_no_box(item, "teardown", "passed", None),
            ]
        else:
            reports = self.runner.run_item(
                item, lease, next_nodeid=nextitem.nodeid if shared and nextitem else None, timeout=plan.timeout
            )
            failed = any(r.failed for r in reports)
            dead = lease.handle.name not in self.runner.live_workers()
            if not shared or dead:
                self._drop(keep=failed and self.session.settings.keep and not dead)
            elif failed and self.session.settings.keep:
                pass  # the module goes on in this box; it is kept when the module ends if asked
        for rep in reports:
            if rep.when == "teardown" and lease is not None:
                rep.user_properties.append((self.KEEP_PROPERTY, lease.handle.name))
            ihook.pytest_runtest_logreport(report=rep)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _lease(self, module: str, plan: BoxPlan) -> Lease:
        if self._held is not None:
            held_module, held_spec, lease = self._held
            if held_module == module and held_spec == plan.spec:
                return lease
            self._drop(keep=False)
        lease = self.session.pool().lease(plan.spec)
        self._held = (module, plan.spec, lease)
        return lease

    def _drop(self, *, keep: bool) -> None:
        if self._held is not None:
            _, _, lease = self._held
            self._held = None
            lease.release(keep=keep)

    def close(self) -> None:
        self._drop(keep=False)


def _report_no_box(item: pytest.Item, when: str, outcome: str, why: str | None) -> pytest.TestReport:
    return pytest.TestReport(
        nodeid=item.nodeid,
        location=item.location,
        keywords={k: 1 for k in item.keywords},
        outcome=outcome,  # type: ignore[arg-type]
        longrepr=why,
        when=when,  # type: ignore[arg-type]
        sections=[],
        duration=0.0,
        user_properties=list(item.user_properties),
    )
