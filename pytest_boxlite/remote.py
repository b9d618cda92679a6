"""Run one test item inside a box and rebuild its reports on the host.

Each box made for boxed tests gets a warm interpreter at boot: an execnet
gateway through the runtime's stdio bridge, running
:mod:`pytest_boxlite.guest.worker` with pytest already configured.  A test then
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
import json
import os
import secrets
import shlex
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import execnet
import pytest

from pytest_boxlite import guest
from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.pool import Lease
from pytest_boxlite.runtimes.base import BoxHandle
from pytest_boxlite.spec import GUEST_ENV, BoxSpec, worker_env

if TYPE_CHECKING:
    from pytest_boxlite.markers import BoxPlan
    from pytest_boxlite.session import BoxliteSession

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
        # The per-test fork's namespace set-up travels with the worker: one remote_exec.
        self._source = guest.source("fresh") + "\n" + guest.source("worker")
        self._args = guest_args(config)
        self._listeners: dict[str, socket.socket] = {}
        self._log_since: dict[str, int] = {}
        #: Boxes forked from warm interpreters, and how long each took beyond the test's own phases.
        self.forks = 0
        self.fork_waits: list[float] = []
        self._status_tmp = tempfile.TemporaryDirectory(prefix="boxlite-status-")
        self.status_dir = Path(self._status_tmp.name)

    def mounts(self) -> tuple[str, ...]:
        """Host directories a test worker needs at the same paths: the project and ``sys.path``."""
        from pytest_boxlite.spec import minimal_dirs

        paths = [str(self.config.rootpath), str(self.config.invocation_params.dir), *sys.path]
        return minimal_dirs(p for p in paths if p)

    # -- pool callbacks -------------------------------------------------------
    def start_worker(self, handle: BoxHandle, spec: BoxSpec) -> None:
        """Pool ``on_boot`` callback: start pytest inside a fresh ``worker`` box and wait until it is ready."""
        if not spec.worker:
            return
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
            listener = self._listeners.pop(handle.name, None)
        if listener is not None:
            listener.close()
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
            "run",
            item.nodeid,
            _node_arg(config, item.nodeid),
            next_nodeid,
            _node_arg(config, next_nodeid) if next_nodeid else None,
        )
        reports: list[Any] = []
        deadline = start + timeout
        error: str | None = None
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
                    error = str(data)  # "done" still follows
            if error is not None:
                return self._synthesized(item, "setup", error, handle, time.monotonic() - start)
        except (TimeoutError, execnet.TimeoutError):
            self._kill(handle)
            why = f"timed out after {timeout:.0f}s; the box was killed (--boxlite-timeout or the marker's timeout)"
            return self._complete(item, reports, why, handle, time.monotonic() - start)
        except (EOFError, OSError, execnet.RemoteError, execnet.HostNotFound) as exc:
            why = self._death_reason(handle, worker, exc)
            return self._complete(item, reports, why, handle, time.monotonic() - start)
        return reports

    def run_item_forked(
        self, item: pytest.Item, lease: Lease, *, timeout: float, network: bool
    ) -> tuple[list[Any], str]:
        """Run ``item`` in a fresh box forked from the leased box's warm interpreter (namespace runtime).

        Returns the reports and the forked box's name.  The fork gets new namespaces and empty
        writable layers, so it is as pristine as a newly booted box, at the cost of a fork.
        """
        config = item.config
        handle = lease.handle
        with self._lock:
            worker = self._workers.get(handle.name)
        self.forks += 1
        name = f"{handle.name}.{self.forks}"
        if worker is None:
            return self._synthesized(item, "setup", f"box {handle.name} has no running test worker", handle, 0.0), name
        listener = self._fork_listener(handle)
        token = secrets.token_hex(8)
        start = time.monotonic()
        deadline = start + timeout
        reports: list[Any] = []
        oom_before = _oom_count(handle)
        # Failure reports quote only what this fork added to the template's log.
        size = getattr(handle, "log_size", None)
        self._log_since[handle.name] = size() if size is not None else 0
        try:
            request = ("fork", item.nodeid, _node_arg(config, item.nodeid), token, FORK_SOCKET, name[:63], network)
            worker.channel.send(request)
            kind, data = worker.channel.receive(min(timeout, 30.0))
            if kind != "forked":
                return self._synthesized(item, "setup", f"could not fork a box: {data}", handle, 0.0), name
            child = int(data)
        except (EOFError, OSError, execnet.RemoteError, execnet.TimeoutError) as exc:
            why = self._death_reason(handle, worker, exc)
            return self._complete(item, reports, why, handle, time.monotonic() - start), name
        error: str | None = None
        done = False
        try:
            stream = self._accept_fork(worker, listener, token, child, deadline)
            if stream is None:
                code = self._fork_status(worker, ("wait", child))
                why = f"the box died before it could run the test: it {_describe_status(code)}"
                return self._synthesized(item, "setup", why, handle, time.monotonic() - start), name
            with stream.conn:
                for kind, data in stream.messages(deadline):
                    if kind == "report":
                        reports.append(config.hook.pytest_report_from_serializable(config=config, data=data))
                    elif kind == "error":
                        error = str(data)
                    elif kind == "done":
                        done = True
                        break
            self.fork_waits.append(time.monotonic() - start - sum(getattr(r, "duration", 0.0) for r in reports))
        except TimeoutError:
            self._fork_status(worker, ("kill", child))
            why = f"timed out after {timeout:.0f}s; the box was killed (--boxlite-timeout or the marker's timeout)"
            return self._complete(item, reports, why, handle, time.monotonic() - start), name
        except OSError:
            pass  # the box hung up: say how it died below
        if error is not None:
            return self._synthesized(item, "setup", error, handle, time.monotonic() - start), name
        if not done:
            code = self._fork_status(worker, ("wait", child))
            if _oom_count(handle) > oom_before:
                why = "the test process in the box was killed by the kernel's OOM killer (the box's memory cap)"
            else:
                why = f"the test process in the box {_describe_status(code)}"
            return self._complete(item, reports, why, handle, time.monotonic() - start), name
        return reports, name

    def _accept_fork(
        self, worker: _Worker, listener: socket.socket, token: str, child: int, deadline: float
    ) -> _JsonStream | None:
        """The forked box's connection, which presents ``token``; ``None`` if the box died first.

        Waits in short slices and asks the warm interpreter between them whether the fork is still
        alive, so a box that dies before connecting is reported at once, not at the timeout.
        """
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            listener.settimeout(min(left, 1.0))
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                if self._fork_status(worker, ("poll", child)) is not None:
                    return None
                continue
            stream = _JsonStream(conn)
            first = next(stream.messages(deadline), None)
            if first == ("token", token):
                return stream
            conn.close()  # a stale connection (from an earlier box that timed out): drop it

    def _fork_status(self, worker: _Worker, request: tuple[str, int]) -> int | None:
        try:
            worker.channel.send(request)
            kind, code = worker.channel.receive(10.0)
        except (EOFError, OSError, execnet.RemoteError, execnet.TimeoutError):
            return None
        return int(code) if kind == "status" and code is not None else None

    def _fork_listener(self, handle: BoxHandle) -> socket.socket:
        with self._lock:
            sock = self._listeners.get(handle.name)
            if sock is None:
                path = Path(getattr(handle, "box_dir")) / "fork.sock"  # noqa: B009 - namespace boxes only
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.bind(_short_path(path))
                sock.listen(4)
                self._listeners[handle.name] = sock
            return sock

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
            out.append(_report(item, "call", "failed", why, self._log(handle), duration))
        if "teardown" not in done:
            out.append(_report(item, "teardown", "passed", None, None, 0.0))
        return out

    def _log(self, handle: BoxHandle) -> tuple[str, str] | None:
        """The box log's tail as a report section (for a forked box: only what it wrote)."""
        since = self._log_since.get(handle.name)
        tail = handle.log_tail() if since is None else handle.log_tail(since=since)  # type: ignore[call-arg]
        return (f"boxlite log of {handle.name}", tail) if tail.strip() else None

    def _synthesized(self, item: pytest.Item, when: str, why: str, handle: BoxHandle, duration: float) -> list[Any]:
        reports = [_report(item, when, "failed", why, self._log(handle), duration)]
        if when != "teardown":
            reports.append(_report(item, "teardown", "passed", None, None, 0.0))
        return reports


FORK_SOCKET = "/run/pytest-boxlite/fork.sock"


def _short_path(path: Path) -> str:
    """``sun_path`` holds ~108 bytes: bind long paths through a directory descriptor."""
    target = str(path)
    if len(target.encode()) <= 100:
        return target
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    # The descriptor must stay open while the path is used; it is kept for the process's life.
    return f"/proc/self/fd/{fd}/{path.name}"


class _JsonStream:
    """Newline-delimited JSON from a forked box; the buffer outlives any one reader."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buf = b""

    def messages(self, deadline: float) -> Iterator[tuple[str, Any]]:
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                kind, data = json.loads(line, object_hook=_untag)
                yield kind, data
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.conn.settimeout(left)
            chunk = self.conn.recv(1 << 16)
            if not chunk:
                return
            self.buf += chunk


def _untag(obj: dict[str, Any]) -> Any:
    """The inverse of the guest's ``_tag``: tuples come back as tuples."""
    if len(obj) == 1 and "__tuple__" in obj:
        return tuple(obj["__tuple__"])
    return obj


def _oom_count(handle: BoxHandle) -> int:
    counter = getattr(handle, "oom_kills", None)
    return int(counter()) if counter is not None else 0


def _describe_status(code: int | None) -> str:
    if code is None:
        return "died"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _how_it_died(status_file: Path, wait: float = 2.0) -> str:
    """'exited with status 3' / 'was killed by SIGSEGV', read from the attach bridge's status file."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return _describe_status(int(status_file.read_text().strip()))
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return _describe_status(None)
            time.sleep(0.02)


def _report(
    item: pytest.Item, when: str, outcome: str, why: str | None, log: tuple[str, str] | None, duration: float
) -> pytest.TestReport:
    sections = [log] if why is not None and log is not None else []
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
        self._held_failed = False
        #: Warm interpreters that fresh boxes are forked from, one per spec (fork mode).
        self._templates: dict[BoxSpec, Lease] = {}

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
        box_name = ""
        try:
            lease = self._template(plan) if self.session.fork_boxes else self._lease(module, plan)
        except BoxliteError as exc:
            reports = [
                _report(item, "setup", "failed", f"could not get a box: {exc}", None, 0.0),
                _report(item, "teardown", "passed", None, None, 0.0),
            ]
        else:
            box_name = lease.handle.name
        if lease is not None and self.session.fork_boxes:
            reports, box_name = self.runner.run_item_forked(
                item, lease, timeout=plan.timeout, network=plan.spec.network
            )
            if lease.handle.name not in self.runner.live_workers():
                self._templates.pop(plan.spec, None)
                lease.release()
        elif lease is not None:
            reports = self.runner.run_item(
                item, lease, next_nodeid=nextitem.nodeid if shared and nextitem else None, timeout=plan.timeout
            )
            self._held_failed |= any(r.failed for r in reports)
            dead = lease.handle.name not in self.runner.live_workers()
            if not shared or dead:
                # With --boxlite-keep, a box in which any test failed outlives the run (a dead one cannot).
                self._drop(keep=self._held_failed and self.session.settings.keep and not dead)
        for rep in reports:
            if rep.when == "teardown" and box_name:
                rep.user_properties.append((self.KEEP_PROPERTY, box_name))
            ihook.pytest_runtest_logreport(report=rep)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _lease(self, module: str, plan: BoxPlan) -> Lease:
        if self._held is not None:
            held_module, held_spec, lease = self._held
            if held_module == module and held_spec == plan.spec:
                return lease
            self._drop(keep=self._held_failed and self.session.settings.keep)
        lease = self.session.pool().lease(plan.spec)
        self._held = (module, plan.spec, lease)
        return lease

    def _template(self, plan: BoxPlan) -> Lease:
        """The warm interpreter to fork ``plan``'s box from, leased once per spec."""
        lease = self._templates.get(plan.spec)
        if lease is not None:
            return lease
        if len(self._templates) >= self.session.settings.replicas:
            # Make room under the cap: the oldest template goes.
            oldest = next(iter(self._templates))
            self._templates.pop(oldest).release()
        pool = self.session.pool()
        # The template is held for the session: no spare box of this spec is needed (a warm or
        # booting one is still taken by the lease below).
        pool.prewarm(plan.spec, 0)
        lease = pool.lease(plan.spec)
        self._templates[plan.spec] = lease
        return lease

    def release_template(self, wanted: BoxSpec) -> bool:
        """Pool pressure callback: give back the oldest fork template not of ``wanted``'s spec."""
        for spec in list(self._templates):
            if spec != wanted:
                self._templates.pop(spec).release()
                return True
        return False

    def _drop(self, *, keep: bool) -> None:
        if self._held is not None:
            _, _, lease = self._held
            self._held = None
            self._held_failed = False
            lease.release(keep=keep)

    def close(self) -> None:
        self._drop(keep=self._held_failed and self.session.settings.keep)
        for lease in self._templates.values():
            lease.release()
        self._templates.clear()
