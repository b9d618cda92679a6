"""The warm interpreters in boxes: started over execnet at each box's boot, stopped before it goes.

Each box made for boxed tests gets a warm interpreter: an execnet gateway through the runtime's
stdio bridge, running :mod:`pytest_boxlite.guest.worker`, which configures pytest from the host's
own command line and collects the session once.  Its channel then carries control messages only
(``FORK``, ``WAIT``, ``POLL``, ``KILL``, ``TEARDOWN_SHARED``): every test runs in a fork of it, whose
messages come on a socket (:mod:`.worker_host`).  This module owns the interpreters' lifecycle:
start, stop, kill, and why one died.
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
import weakref
from pathlib import Path
from typing import Any

import execnet
import pytest

from pytest_boxlite import guest
from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.guest import messages as msg
from pytest_boxlite.runtimes.base import BoxHandle
from pytest_boxlite.spec import DEFAULT_ENV_DENY, BoxSpec, minimal_dirs, worker_env

OOM = "the test process in the box was killed by the kernel's OOM killer (the box's memory cap)"


class FrameCap:
    """Refuses an execnet frame longer than :data:`messages.LINE_CAP` before its payload is read,
    and holds back the gateway's receiver while the host has not taken what it already read.

    execnet reads a frame as ``io.read(9)`` (type, channel, length) and then ``io.read(length)``
    with the length the sender wrote: wrapping the gateway's ``io.read`` sees that length first.
    A frame over the cap ends the gateway (its receiver thread stops on the error) and
    :attr:`refused` says why, for the report of the test that was running.

    execnet's receiver thread reads on its own and queues what it read on the channel for
    ``receive``: a box that writes faster than the host takes its messages would have the host
    hold all of it.  Once :meth:`watch` names the channel, the receiver reads on only while fewer
    than :data:`QUEUED_CAP` messages wait there (the box then waits, as a forked box's socket
    makes it), so the host holds at most that many frames of at most ``cap`` bytes each.
    """

    #: Messages read but not yet taken by the host, at most (each at most ``cap`` bytes).
    QUEUED_CAP = 4

    def __init__(self, gateway: Any, cap: int = msg.LINE_CAP) -> None:
        io: Any = getattr(gateway, "_io", None)
        read = getattr(io, "read", None)
        if read is None:  # an execnet whose gateway keeps its io elsewhere: not run unbounded
            raise BoxliteError(f"execnet {execnet.__version__}: the gateway's io has no read() to bound")
        self.cap = cap
        self.refused: str | None = None
        self._read = read
        self._channel: Any = None
        self._queue: Any = None
        self._released = threading.Event()
        io.read = self.read  # the receiver thread looks read() up on the io for every call

    def watch(self, channel: Any) -> None:
        """Hold the receiver back while ``channel`` has :data:`QUEUED_CAP` messages not taken."""
        queue = getattr(channel, "_items", None)  # execnet's queue of what receive() hands out
        if queue is None or not callable(getattr(queue, "qsize", None)):
            raise BoxliteError(f"execnet {execnet.__version__}: the channel's queue cannot be bounded")
        self._channel, self._queue = channel, queue

    def release(self) -> None:
        """The host is done with the gateway: the receiver reads on (to its end) without waiting."""
        self._released.set()

    def read(self, numbytes: int) -> bytes:
        queue, channel = self._queue, self._channel
        while queue is not None and queue.qsize() >= self.QUEUED_CAP:
            if self._released.wait(0.005) or channel.isclosed():
                break
        if numbytes > self.cap:
            self.refused = (
                f"a frame of {numbytes} bytes on the execnet channel, over the cap of {self.cap} bytes "
                "(refused before it was read)"
            )
            raise EOFError(self.refused)
        return bytes(self._read(numbytes))


@dataclasses.dataclass(eq=False)
class WarmInterpreter:
    """A warm interpreter: the box's pytest with its session collected, over an execnet gateway
    whose channel carries control messages only (``guest/messages.py``)."""

    gateway: Any
    channel: Any
    pid: int
    status_file: Path
    frames: FrameCap | None = None


def describe_status(code: int | None, *, forked: bool = False) -> str:
    """'exited with status 3' / 'was killed by SIGSEGV'.

    A forked box's init exits with 128+N when the test process dies by signal N (pid 1 of a pid
    namespace cannot die by its own signal), so for forks such codes name the signal.
    """
    if code is None:
        return "died"
    if forked and 128 < code <= 128 + 64:
        code = 128 - code
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def how_it_died(status_file: Path, wait: float = 2.0) -> str:
    """How a warm interpreter ended, read from the attach bridge's status file (bounded wait)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(status_file, "rb") as fh:  # written by our host-side bridge, not the guest
                return describe_status(int(fh.read(32).strip()))
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return describe_status(None)
            time.sleep(0.02)


def guest_args(config: pytest.Config) -> list[str]:
    """The box's ``pytest.main`` arguments: the host's own command line, as pytest-xdist hands it on.

    Every option (pytest's, other plugins', the project's conftest options) then means in the box
    what it means on the host; the box resets what only the host does (``guest/worker.py``).

    The host's rootdir goes with them (unless the command line names one): pytest finds it from
    the command line's existing paths before any plugin's options are known, so the value of
    ``--boxlite-home /some/dir`` counts as one of them on the host, where that directory exists,
    and not in the box, where it does not: the two would name the tests differently.
    """
    args = [str(a) for a in config.invocation_params.args]
    if not any(a == "--rootdir" or a.startswith("--rootdir=") for a in args):
        # Before a "--", after which every argument is a path.
        end = args.index("--") if "--" in args else len(args)
        args.insert(end, f"--rootdir={config.rootpath}")
    return args


def worker_mounts(config: pytest.Config) -> tuple[str, ...]:
    """Host directories a test worker needs at the same paths: the project, ``sys.path``, this
    plugin's own directory and the source trees of editable installs (which are on no path)."""
    paths = [str(config.rootpath), str(config.invocation_params.dir), *sys.path]
    paths.append(str(Path(__file__).resolve().parents[2]))
    paths += _editable_roots()
    return minimal_dirs(p for p in paths if p)


def _editable_roots() -> list[str]:
    """Source directories of installed editable distributions (PEP 610 ``direct_url.json``)."""
    import importlib.metadata
    import json
    from urllib.parse import unquote, urlparse

    roots = []
    for dist in importlib.metadata.distributions():
        try:
            info = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        url = info.get("url", "") if isinstance(info, dict) else ""
        if info.get("dir_info", {}).get("editable") and url.startswith("file://"):
            path = unquote(urlparse(url).path)
            if os.path.isdir(path):
                roots.append(path)
    return roots


#: Options whose value the host resolves at random when not given (the box must use the same).
RESOLVED_OPTIONS = ("randomly_seed",)


def resolved_options(config: pytest.Config) -> dict[str, object]:
    """The host's final value of each :data:`RESOLVED_OPTIONS` entry its plugins define."""
    out: dict[str, object] = {}
    for name in RESOLVED_OPTIONS:
        value = getattr(config.option, name, None)
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            out[name] = value
    return out


def xdist_identity(config: pytest.Config) -> dict[str, str] | None:
    """Which xdist worker this host is (for the box's ``worker_id`` fixture), if it is one."""
    workerinput = getattr(config, "workerinput", None)
    if not workerinput:
        return None
    return {"workerid": str(workerinput.get("workerid", "")), "testrunuid": str(workerinput.get("testrunuid", ""))}


def startup_env(env: dict[str, str]) -> list[str]:
    """``NAME=value`` for the variables Python reads at start-up: they must be set before it starts."""
    return [f"{k}={v}" for k, v in sorted(env.items()) if k.startswith("PYTHON")]


class WarmInterpreters:
    """Starts a warm interpreter in each box made for boxed tests, and stops it."""

    def __init__(
        self, config: pytest.Config, boot_timeout: float, env_deny: tuple[str, ...] = DEFAULT_ENV_DENY
    ) -> None:
        self.config = config
        self.boot_timeout = boot_timeout
        #: Host variables boxed tests do not see (--boxlite-env-deny).
        self.env_deny = env_deny
        self.group = execnet.Group()
        self._interpreters: dict[str, WarmInterpreter] = {}
        self._lock = threading.Lock()
        # A few lines that put the host's sys.path in place and import the guest from the plugin's
        # directory, which the box sees: one remote_exec (as pytest-xdist ships its remote.py).
        self._source = guest.source("bootstrap")
        self._args = guest_args(config)
        #: Why a box's warm interpreter cannot fork fresh boxes (its kernel refuses the namespaces).
        self.fork_problems: dict[str, str] = {}
        #: Every live gateway's frame bound, released at shutdown (a receiver held back by a box's
        #: unread messages must still reach the end of its stream); weak: a gone gateway's goes.
        self._frame_caps: weakref.WeakSet[FrameCap] = weakref.WeakSet()
        self._status_tmp = tempfile.TemporaryDirectory(prefix="boxlite-status-")
        self.status_dir = Path(self._status_tmp.name)

    def start(self, handle: BoxHandle, spec: BoxSpec) -> None:
        """Start pytest inside a fresh ``worker`` box and wait until it has collected the session."""
        if not spec.warm:
            return
        cwd = str(self.config.invocation_params.dir)
        status_file = self.status_dir / f"{handle.name}.status"
        env = worker_env(spec, self.env_deny)
        argv = handle.attach_argv(
            ["env", *startup_env(env), handle.guest_python], cwd=cwd, status_file=str(status_file)
        )
        spec_str = "execmodel=main_thread_only//popen//python=" + shlex.join(argv)
        gw = self._make_gateway(spec_str, handle)
        try:
            # Bounded before the box's code runs: it sends nothing until remote_exec starts it.
            frames = FrameCap(gw)
            self._frame_caps.add(frames)
            channel = gw.remote_exec(self._source)
            frames.watch(channel)
            channel.send(
                {
                    "args": self._args,
                    "cwd": cwd,
                    "sys_path": list(sys.path),
                    "env": env,
                    "resolved": resolved_options(self.config),
                    "prefix": sys.prefix,
                    "xdist": xdist_identity(self.config),
                    # A VM's kernel is not the host's: whether it can make a forked box's
                    # namespaces is asked once, at start (the host's own was checked already).
                    "probe_fork": handle.fork_renews_all,
                }
            )
            # Collection of the whole session happens before READY: bounded by the boot timeout.
            name, fields = channel.receive(self.boot_timeout)
            if name != msg.READY or not isinstance(fields, dict) or not isinstance(fields.get("pid"), int):
                raise BoxliteError(f"unexpected first message from the worker in {handle.name}: {name!r}")
        except BaseException as exc:
            with contextlib.suppress(Exception):
                gw.exit()
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            tail = handle.log_tail()
            raise BoxliteError(f"pytest did not start inside box {handle.name}: {exc}\n{tail}".rstrip()) from exc
        problem = fields.get("fork_problem")
        with self._lock:
            self._interpreters[handle.name] = WarmInterpreter(gw, channel, fields["pid"], status_file, frames)
            if problem is not None:
                self.fork_problems[handle.name] = str(problem)[:500]  # the box's word: shown, capped

    def _make_gateway(self, spec_str: str, handle: BoxHandle) -> Any:
        """``makegateway``, bounded by the boot timeout (execnet's own call has no timeout)."""
        made: dict[str, Any] = {}

        def make() -> None:
            try:
                made["gateway"] = self.group.makegateway(spec_str)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                made["error"] = exc

        thread = threading.Thread(target=make, name=f"boxlite-gateway-{handle.name}", daemon=True)
        thread.start()
        thread.join(self.boot_timeout)
        if thread.is_alive():
            # Ending the box ends its bridge, which lets makegateway fail instead of hanging on.
            with contextlib.suppress(Exception):
                handle.destroy()
            thread.join(5.0)
            raise BoxliteError(f"box {handle.name}: no interpreter answered within {self.boot_timeout:.0f}s")
        if "error" in made:
            raise made["error"]
        return made["gateway"]

    def stop(self, handle: BoxHandle) -> None:
        """Drop ``handle``'s gateway; the box is killed right after."""
        with self._lock:
            w = self._interpreters.pop(handle.name, None)
        if w is not None:
            if w.frames is not None:
                w.frames.release()
            with contextlib.suppress(Exception):
                w.gateway.exit()

    def get(self, name: str) -> WarmInterpreter | None:
        """Box ``name``'s warm interpreter, while it is usable."""
        with self._lock:
            return self._interpreters.get(name)

    def live(self) -> set[str]:
        """Names of boxes whose warm interpreter is still usable."""
        with self._lock:
            return set(self._interpreters)

    def shutdown(self) -> None:
        """End every gateway (their boxes are destroyed by the pool)."""
        for frames in list(self._frame_caps):
            frames.release()
        with contextlib.suppress(Exception):
            self.group.terminate(timeout=5.0)
        self._status_tmp.cleanup()

    def kill(self, handle: BoxHandle) -> None:
        """Destroy ``handle``'s box now, and with it its warm interpreter (a test that broke it)."""
        with self._lock:
            w = self._interpreters.pop(handle.name, None)
        with contextlib.suppress(Exception):
            handle.destroy()
        if w is not None:
            if w.frames is not None:
                w.frames.release()
            with contextlib.suppress(Exception):
                w.channel.close()

    def death_reason(self, handle: BoxHandle, worker: WarmInterpreter, exc: BaseException) -> str:
        """Why ``handle``'s warm interpreter stopped answering (``exc``: what its channel raised);
        it is forgotten."""
        with self._lock:
            self._interpreters.pop(handle.name, None)
        if handle.oom_kills() > 0:
            return OOM
        how = how_it_died(worker.status_file)
        gone = "" if handle.alive(timeout=1.0) else "; the box itself is gone"
        return f"the test process in the box {how}{gone} (channel: {type(exc).__name__}: {str(exc)[:500]})"
