"""pytest-xdist integration (the controller's hooks are on :class:`pytest_boxlite.roles.ControllerPlugin`).

* The controller hands its session id to every worker (``workerinput``), so
  all box names of one run carry it; each worker is its own owner
  (``<session>-<workerid>``) with its own pool and BoxLite home.
* Workers send their pool counters back (``workeroutput``, :data:`WORKEROUTPUT_KEY`) for the summary.
* ``--boxlite-scope=worker`` starts each worker inside a box of its own (:func:`box_worker_specs`).
* Remote workers (any gateway but a plain local ``popen``: ``socket=``, ``ssh=``, ``popen//via=``)
  box on their own host, under that host's home: the controller marks them
  (:data:`REMOTE_KEY` in ``workerinput``), and such a worker does on its host what the controller
  does for local workers: reconciles dead owners' leftovers at its start, reaps its crashed
  siblings' boxes at its end, and reaps its own boxes when the controller vanishes
  (:func:`watch_controller`).  The controller only reports what they send (:class:`HostReport`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_boxlite._shown import shown
from pytest_boxlite._tidy import remove_own_dir
from pytest_boxlite.session import BoxliteSession
from pytest_boxlite.settings import Settings

WORKEROUTPUT_KEY = "boxlite"
#: ``workerinput`` key: the controller's spec string of a remote worker's gateway.
REMOTE_KEY = "boxlite_remote"

#: Bounds on what a remote worker may put in the controller's summary (it is another machine).
_MAX_TEXT = 200
_MAX_NAMES = 200


#: How this interpreter runs ``boxproc`` as a command of its own.
BOXPROC = ("-m", "pytest_boxlite.boxproc")


def boxproc_argv(
    settings: Settings, *, session_id: str, home: Path, runtime: str, mounts: tuple[str, ...], cwd: str
) -> list[str]:
    """The host command that runs a worker (or a whole session) inside a fresh box."""
    return [
        sys.executable,
        *BOXPROC,
        *boxproc_options(settings, session_id=session_id, home=home, runtime=runtime, mounts=mounts, cwd=cwd),
    ]


def boxproc_options(
    settings: Settings, *, session_id: str, home: Path, runtime: str, mounts: tuple[str, ...], cwd: str
) -> list[str]:
    """``boxproc``'s options for a box of ``settings`` (see :func:`boxproc_argv`)."""
    s = settings
    argv = [
        "--home", str(home),
        "--session", session_id,
        "--runtime", runtime,
        "--image", s.image,
        "--cwd", cwd,
        "--boot-timeout", str(s.boot_timeout),
    ]  # fmt: skip
    if s.cpus:
        argv += ["--cpus", str(s.cpus)]
    if s.memory:
        argv += ["--memory", str(s.memory)]
    if s.network:
        argv.append("--network")
    for m in mounts:
        argv += ["--mount", m]
    # An empty pattern still says "deny nothing" (rather than "use the default").
    for pattern in s.env_deny or ("",):
        argv += ["--env-deny", pattern]
    return argv


# -- gateway specs -------------------------------------------------------------------------------


def tx_specs(config: pytest.Config) -> list[str]:
    """The controller's ``--tx`` specs with xdist's ``N*spec`` multipliers expanded (``-n N`` is N ``popen``)."""
    out: list[str] = []
    for raw in getattr(config.option, "tx", None) or []:
        count, star, rest = str(raw).partition("*")
        if star and count.isdigit():
            out += [rest] * int(count)
        else:
            out.append(str(raw))
    return out


def is_remote(spec: str) -> bool:
    """Whether a worker of this gateway spec runs somewhere else than this machine.

    Only a plain ``popen`` (no ``via=``) is local; ``socket=``, ``ssh=``, ``vagrant_ssh=`` and a
    ``popen`` through another gateway run on another host, or at least under another home.
    """
    import execnet  # here: a run with no -n/--tx never needs it

    try:
        xs = execnet.XSpec(spec)
    except Exception:  # noqa: BLE001 - xdist reports a malformed spec itself; here it is "not ours"
        return True
    return not (xs.popen and not xs.via)


def spec_text(spec: object) -> str:
    """A gateway spec as the user wrote it: without the ``execmodel=`` that xdist adds to each."""
    return "//".join(p for p in str(spec).split("//") if not p.startswith("execmodel="))


def remote_specs(config: pytest.Config) -> list[str]:
    """The remote gateway specs of this run (empty for ``-n N`` and plain ``popen`` specs)."""
    return [s for s in tx_specs(config) if is_remote(s)]


class WorkerBoxServers:
    """One box server per local ``--boxlite-scope=worker`` worker (``boxproc --serve-fd``).

    Started when the controller configures, so every worker's box boots at once and ahead of
    xdist's gateway set-up, which starts the workers one after the other and waits for each.
    Each server owns its boxes (an owner lock of its own, as ``boxproc`` always did); the
    controller ends them at its shutdown, and a server also ends when the controller dies.

    A server is a fork of the controller where that is safe (Linux, and the controller has one
    thread at the time): it then starts booting its box at once, instead of after an interpreter's
    start and ``boxproc``'s imports (about 0.15 s of the first worker's wait, and of two cores'
    CPU while the controller starts up).  Elsewhere it is ``python -m pytest_boxlite.boxproc``.
    """

    #: How long a server may take to destroy its box and end after SIGTERM.
    STOP_TIMEOUT = 15.0

    def __init__(self, options: list[str], count: int, serve: Callable[[list[str]], int]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pbx-workers-"))  # 0700: only this user connects
        self._serve = serve
        self.procs: list[subprocess.Popen[bytes] | ForkedServer] = []
        self.sockets: list[Path] = []
        self.logs: list[Path] = []
        try:
            for i in range(count):
                self._start(options, i)
        except BaseException:
            self.stop()
            raise

    def _start(self, options: list[str], i: int) -> None:
        path, log = self.dir / f"{i}.sock", self.dir / f"{i}.log"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with listener, open(log, "wb") as err:
            listener.bind(str(path))
            listener.listen(4)
            fd = listener.fileno()
            args = [*options, "--serve-fd", str(fd), "--serve-dir", str(self.dir), "--parent", str(os.getpid())]
            if _may_fork():
                self.procs.append(ForkedServer.start(self._serve, args, err.fileno()))
            else:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, *BOXPROC, *args],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        pass_fds=[fd],
                    )
                )
        self.sockets.append(path)
        self.logs.append(log)

    def python(self, i: int, python: str) -> str:
        """The gateway's ``python=`` for worker slot ``i``: the attach client, then the worker's interpreter."""
        from pytest_boxlite import guest

        client = [sys.executable, "-I", "-S", str(guest.path("attach")), "--via", str(self.sockets[i])]
        return shlex.join([*client, "--log", str(self.logs[i]), "--", python])

    def stop(self) -> None:
        """End every server (each destroys its box first), bounded; then remove their sockets."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(self.STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()  # its box's watchdog and the controller's reap_workers get the rest
                proc.wait(5.0)
        remove_own_dir(self.dir, "the box servers' directory")


def _may_fork() -> bool:
    """Whether this process may fork a box server: Linux (the runtimes' home), and one thread.

    Counted by the kernel (``/proc/self/task``), so threads of native code count too: a fork of a
    process with other threads may inherit a lock one of them held, forever.
    """
    if sys.platform != "linux":
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


class ForkedServer:
    """A box server forked from this process, with the part of ``subprocess.Popen`` that
    :meth:`WorkerBoxServers.stop` uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    @classmethod
    def start(cls, serve: Callable[[list[str]], int], args: list[str], log_fd: int) -> ForkedServer:
        """Fork; the child runs ``serve(args)`` (``boxproc``'s main; its stderr: ``log_fd``) and never
        returns."""
        pid = os.fork()
        if pid:
            return cls(pid)
        code = 70
        try:
            # This process's objects stay the controller's: never collected (nor finalized) here.
            gc.freeze()
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            os.dup2(log_fd, 2)
            os.close(null)
            # pytest's capture may hold sys.stdout/sys.stderr: write to this process's own.
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - lives as long as the process
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            code = serve(args)
        except SystemExit as exc:  # a signal's exit through boxproc's cleanup, or a usage error
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - the log, with this traceback, is what the worker's client quotes
            traceback.print_exc()
        finally:
            # Never back into the controller's pytest, nor its atexit handlers (coverage's, ...).
            os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"box server {self.pid}", timeout)
            time.sleep(0.01)
        return code

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def box_worker_specs(box: BoxliteSession, config: pytest.Config, serve: Callable[[list[str]], int]) -> WorkerBoxServers:
    """Rewrite xdist's local ``popen`` gateways so each worker starts inside its own box.

    Returns the box servers (one per worker, booting now) that the gateways attach to; the
    caller stops them at the end of the session.  ``serve`` is ``boxproc``'s main function, which
    a forked server runs (``boxproc`` is an entry point, above this module).  A remote gateway
    cannot be wrapped from here (the box command names this machine's interpreter, home and
    directories; a ``socket=`` gateway takes no interpreter at all): that is a usage error naming
    the spec and the ways out.
    """
    specs = tx_specs(config)
    remote = [s for s in specs if is_remote(s)]
    if remote:
        raise pytest.UsageError(
            f"--boxlite-scope=worker boxes local popen workers only; the remote gateway(s) "
            f"{', '.join(repr(s) for s in remote)} run their worker on another host, which this machine "
            "cannot put in a box. Use --boxlite (or @pytest.mark.boxlite) with --boxlite-scope=test or "
            "module instead: each remote worker then boxes its tests on its own host; or use -n N "
            "(local popen workers) with --boxlite-scope=worker."
        )
    options = boxproc_options(
        box.settings,
        session_id=box.session_id,
        home=box.home,
        runtime=box.choice.kind,
        mounts=box.worker_mounts,
        cwd=str(config.invocation_params.dir),
    )
    from execnet import XSpec

    servers = WorkerBoxServers(options, len(specs), serve)
    out = []
    for i, s in enumerate(specs):
        xs = XSpec(s)
        # A popen with its own interpreter runs that interpreter inside the box.
        python = servers.python(i, xs.python or sys.executable)
        out.append(f"{s}//python={python}" if not xs.python else s.replace(f"python={xs.python}", f"python={python}"))
    config.option.tx = out
    return servers


# -- the remote worker's side ----------------------------------------------------------------------


def forget_controller_home(config: pytest.Config) -> None:
    """On a remote worker: drop a ``--boxlite-home`` typed on the controller's command line.

    It names a directory on the controller's machine; a remote worker resolves its home as a
    plain run on its own host would (its ``PYTEST_BOXLITE_HOME``, the ini key, or the default
    under its own ``$HOME``).
    """
    if getattr(config.option, "boxlite_home", None) is not None:
        config.option.boxlite_home = None


def watch_controller(config: pytest.Config, on_lost: Callable[[], None]) -> threading.Thread | None:
    """Call ``on_lost`` (in a thread) when the channel to the xdist controller closes.

    In the normal order the worker reaps its boxes at session finish, *before* it reports to the
    controller, which only then closes the channel: ``on_lost`` must then do nothing (it is told
    by its own state).  When the controller vanishes (killed, its machine gone), the worker's
    execnet gateway sees end-of-file, interrupts the main thread with SIGINT after 5 s (nothing, if
    the server was started with SIGINT ignored, as ``cmd &`` in a script does) and calls
    ``os._exit`` 10 s later: the reaping must not wait for either.

    The channel is xdist's worker-side ``WorkerInteractor.channel``, found by duck typing among
    the registered plugins (xdist runs its worker module as a remote-exec'd source, so its classes
    cannot be imported to compare with); ``Channel.waitclose`` is execnet's public API.  For a
    ``socket=`` gateway, TCP keepalive is switched on so that a controller whose machine vanished
    without closing the connection is noticed in about a minute (best effort: the socket is an
    attribute of execnet's ``SocketIO``).  Returns the thread, or ``None`` without a channel.
    """
    channel = None
    for plugin in config.pluginmanager.get_plugins():
        cand = getattr(plugin, "channel", None)
        if callable(getattr(cand, "waitclose", None)) and hasattr(cand, "gateway"):
            channel = cand
            break
    if channel is None:
        return None
    _keepalive(getattr(getattr(channel.gateway, "_io", None), "sock", None))

    def watch() -> None:
        # Any end of the channel (EOF, a remote error) means the same here.
        with contextlib.suppress(Exception):
            channel.waitclose()
        on_lost()

    thread = threading.Thread(target=watch, name="boxlite-controller-watch", daemon=True)
    thread.start()
    return thread


def _keepalive(sock: object) -> None:
    if not isinstance(sock, socket.socket):
        return
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, opt, value in opts:
        try:
            sock.setsockopt(level, opt, value)
        except OSError:
            return


def worker_output(session: BoxliteSession, *, remote: bool) -> dict[str, Any]:
    """What a worker sends to the controller for the summary (plain data: it crosses execnet)."""
    rep = session.report
    out: dict[str, Any] = {"stats": rep.stats, "leaked": rep.leaked, "kept": rep.kept}
    if remote:
        out.update(
            host=socket.gethostname(),
            home=str(session.home),
            runtime=session.choice.kind,
            reconciled=rep.reconciled,
        )
    return out


# -- the controller's side -------------------------------------------------------------------------


def _text(value: object) -> str:
    # A remote worker's words, shown as every other text from elsewhere is (one escape: _shown).
    return shown(value if isinstance(value, str) else repr(value), line=True, limit=_MAX_TEXT)


def _names(value: object) -> list[str]:
    if not isinstance(value, list):
        return []
    return [_text(v) for v in value[:_MAX_NAMES]]


def _count(stats: object, key: str) -> int:
    v = stats.get(key, 0) if isinstance(stats, dict) else 0
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def clean_stats(stats: object) -> dict[str, Any]:
    """A remote worker's pool counters, keeping only what the summary can add up.

    Numbers (not booleans) and lists of up to ``_MAX_NAMES`` numbers, under short string keys;
    anything else from the other machine is dropped rather than trusted.
    """
    out: dict[str, Any] = {}
    if not isinstance(stats, dict):
        return out
    for key, value in list(stats.items())[:_MAX_NAMES]:
        if not isinstance(key, str) or len(key) > 40:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            out[key] = value
        elif isinstance(value, list):
            out[key] = [v for v in value[:_MAX_NAMES] if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return out


@dataclasses.dataclass
class HostReport:
    """What the remote workers of one host (host name and home, as the workers said) reported."""

    host: str
    home: str
    runtime: str
    workers: list[str] = dataclasses.field(default_factory=list)
    booted: int = 0
    leaked: list[str] = dataclasses.field(default_factory=list)
    kept: list[str] = dataclasses.field(default_factory=list)
    reconciled: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RemoteLedger:
    """The controller's record of its remote workers: per-host reports and workers that never reported."""

    #: worker id -> its gateway spec (only remote workers).
    specs: dict[str, str] = dataclasses.field(default_factory=dict)
    hosts: dict[tuple[str, str], HostReport] = dataclasses.field(default_factory=dict)
    #: ``(worker id, spec)`` of remote workers that went down without a report.
    silent: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    @property
    def eventful(self) -> bool:
        """Whether there is anything to say: a host booted, leaked, kept or removed boxes, or a worker was silent."""
        return bool(self.silent) or any(h.booted or h.leaked or h.kept or h.reconciled for h in self.hosts.values())

    def add(self, worker: str, data: object) -> HostReport | None:
        """Merge one remote worker's ``workeroutput`` entry, checked field by field; ``None`` if unusable."""
        if not isinstance(data, dict):
            return None
        host, home = _text(data.get("host", "?")), _text(data.get("home", "?"))
        report = self.hosts.setdefault((host, home), HostReport(host, home, _text(data.get("runtime", "?"))))
        report.workers.append(_text(worker))
        report.booted += _count(clean_stats(data.get("stats")), "booted")
        report.leaked += _names(data.get("leaked"))
        report.kept += _names(data.get("kept"))
        report.reconciled += _names(data.get("reconciled"))
        return report
