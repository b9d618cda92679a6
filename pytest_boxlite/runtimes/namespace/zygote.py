"""Sandbox boxes forked from a warm template box (a *zygote*) instead of booted.

A zygote is a namespace box booted like any other (bubblewrap, the spec's layers, cgroups, a
watchdog pipe) whose agent runs no command: asked to ``spawn``, it clones a child into new
user, mount, pid, uts, ipc and (unless the spec shares the host's) network namespaces with
pristine writable layers, with the code that gives each boxed test its pristine box
(:mod:`pytest_boxlite.guest.fresh`; the agent's side is in :mod:`pytest_boxlite.guest.agent`).
The child becomes the new box's pid 1 agent and serves on the socket the host sent along.

What the host does for a forked box is what it does for a booted one: the box's own directories,
its own cgroups with the spec's limits (the host moves the child there before it goes on), its
own watchdog pipe (the host's end closing ends the box), its own log, and a record of its pid
(with its start time) in its private directory, so ``clean`` and the next session's reconcile
find and kill it as they would a booted box.  Killing the box's pid 1 ends every process in it.

A forked box cannot outlive its zygote: the zygote is its parent (the child dies with it,
``PR_SET_PDEATHSIG``) and its pid namespace is nested in the zygote's, which the kernel empties
when the zygote ends; the zygote ends with the host (its watchdog).  So a session that keeps
boxes (``--boxlite-keep``) boots them instead (see ``NamespaceRuntime.allow_forked_boxes``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_boxlite.errors import BoxDeadError, BoxStartError, BoxTimeoutError
from pytest_boxlite.runtimes import _cgroups
from pytest_boxlite.runtimes.namespace.box import NamespaceBox, _connect, _Lines
from pytest_boxlite.runtimes.namespace.clone_log import CappedBoxLog
from pytest_boxlite.runtimes.namespace.layout import _bind, _write_private, ctl_dir
from pytest_boxlite.runtimes.namespace.leftovers import _proc_start_time
from pytest_boxlite.runtimes.namespace.privileges import Limits
from pytest_boxlite.spec import BoxSpec

#: A box name whose last part is its sequence number (``pbx-<owner>-<n>``): the zygotes of its
#: owner are named ``pbx-<owner>-0<k>``, with a leading zero no pool name has, so the ledger traces
#: them to the same owner (and reaps them with its boxes) while no box name can collide with one.
_SEQ_NAME = re.compile(r"^(?P<head>.+-)\d+$")
_UCRED = struct.Struct("iii")


@dataclass(frozen=True)
class ForkPlan:
    """What a box of a spec booted now would be made of beyond its spec: its layout (the
    directories it shows and overlays) and the host paths it hides (credentials, boxlite homes)."""

    layout: Hashable
    hidden: frozenset[str]

    def serves(self, now: ForkPlan) -> bool:
        """Whether a zygote booted under this plan may fork a box that should be made under
        ``now``: the same layout, hiding every path ``now`` hides.  A path hidden then and gone
        now (another session's home, removed) still shows as an empty mask in the box, as it
        would in a box booted a moment earlier; a new one takes a new zygote."""
        return self.layout == now.layout and now.hidden <= self.hidden


class ForkRefused(BoxStartError):
    """The host refused what a fork needs (a clone, a mount): boxes of the spec are booted instead."""


def zygote_name(box_name: str, k: int) -> str | None:
    """The name of the ``k``-th zygote of the owner of ``box_name``, or ``None`` if that name does
    not end in a sequence number (then the box is booted: nothing would trace a zygote to its owner)."""
    m = _SEQ_NAME.match(box_name)
    return f"{m.group('head')}0{k}" if m else None


def is_zygote_name(name: str) -> bool:
    """Whether ``name`` is a zygote's (see :func:`zygote_name`), not a box's that a pool leases."""
    m = _SEQ_NAME.match(name)
    return m is not None and name[m.end("head")] == "0"


class Zygotes:
    """One zygote per spec, booted on first use by ``boot(spec, name, timeout)``."""

    def __init__(self, boot: Callable[[BoxSpec, str, float], NamespaceBox]) -> None:
        self._boot = boot
        self._lock = threading.Lock()
        self._boxes: dict[BoxSpec, NamespaceBox] = {}
        self._refused: dict[BoxSpec, str] = {}
        self._plans: dict[str, ForkPlan] = {}
        self._retired: list[NamespaceBox] = []
        self._seq = itertools.count(1)
        self._stopped = False
        #: Whether boxes may be forked at all (the session turns it on).
        self.allowed = False
        #: Why boxes of some spec are booted although forking is allowed (the last refusal).
        self.fallback: str | None = None

    def get(self, spec: BoxSpec, name: str, timeout: float, plan: Callable[[BoxSpec], ForkPlan]) -> NamespaceBox | None:
        """The live zygote of ``spec`` (booted now if there is none), or ``None``: boot the box.

        ``plan(spec)`` says what a box booted now would be made of beyond its spec (the masks
        over the host's credentials): a zygote whose plan does not serve it is replaced.
        """
        if not self.allowed:
            return None
        now = plan(spec)
        with self._lock:
            if self._stopped or spec in self._refused:
                return None
            zygote = self._boxes.get(spec)
            then = self._plans.get(zygote.name) if zygote is not None else None
            if zygote is not None and zygote.running() and then is not None and then.serves(now):
                return zygote
            if zygote is not None:
                # Dead (killed from outside: its boxes went with it), or booted under another plan:
                # boxes forked from it before stay as they are, as booted ones would.
                self._retire(zygote)
                del self._boxes[spec]
            zname = zygote_name(name, next(self._seq))
            if zname is None:
                return None
            zygote = self._boot(spec, zname, timeout)
            self._boxes[spec] = zygote
            self._plans[zygote.name] = now
            return zygote

    def _retire(self, zygote: NamespaceBox) -> None:
        """A zygote no new box comes from: destroyed once no box forked from it is left (they
        end with it), or at :meth:`stop`."""
        self._plans.pop(zygote.name, None)
        if zygote.running():
            self._retired.append(zygote)
        else:
            zygote.destroy()

    def refuse(self, spec: BoxSpec, why: str) -> None:
        """The host refused a fork for ``spec``: boot its boxes from now on, and say why."""
        with self._lock:
            self._refused[spec] = why
            self.fallback = why
            zygote = self._boxes.pop(spec, None)
        if zygote is not None:
            zygote.destroy()

    def stop(self) -> None:
        """Destroy every zygote; later boxes are booted.  Idempotent."""
        with self._lock:
            self._stopped = True
            boxes = [*self._boxes.values(), *self._retired]
            self._boxes.clear()
            self._retired.clear()
        for zygote in boxes:
            zygote.destroy()


class ForkedProcess:
    """A forked box's pid 1 as the host sees it: a Popen look-alike (pid, poll, kill, wait) for a
    process that is not the host's child (the zygote is its parent and reaps it).

    Held through a pidfd where the kernel has them, so a signal can never reach a reused pid;
    else through the pid and its start time.  No exit status: the zygote collects it.
    """

    #: What :meth:`poll` returns once the process has ended (its status is the zygote's to collect).
    ENDED = -signal.SIGKILL

    def __init__(self, pid: int, start_time: str | None) -> None:
        self.pid = pid
        self._start_time = start_time
        self.returncode: int | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None  # no pidfds here (Linux < 5.3): the start time tells a reused pid
        if _proc_start_time(pid) != start_time:
            self._ended()  # it ended before the pidfd was taken: the pidfd may name another process

    def _ended(self) -> None:
        self.returncode = self.ENDED
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _wait(self, timeout: float) -> bool:
        if self.returncode is not None:
            return True
        if self._pidfd is not None:
            ready, _, _ = select.select([self._pidfd], [], [], timeout)
            if ready:
                self._ended()
            return bool(ready)
        deadline = time.monotonic() + timeout
        while _proc_start_time(self.pid) == self._start_time:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        self._ended()
        return True

    def poll(self) -> int | None:
        self._wait(0)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is not None:
            return
        if self._pidfd is not None:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        elif _proc_start_time(self.pid) == self._start_time:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if not self._wait(3600.0 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(f"forked box pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


def _first_line_with_pid(conn: socket.socket, deadline: float, ctl: Path) -> tuple[dict[str, Any], int | None]:
    """The first message on ``conn`` and the host pid of its sender (``SO_PASSCRED`` is set)."""
    buf = b""
    pid: int | None = None
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BoxTimeoutError("the zygote did not fork the box in time")
        conn.settimeout(left)
        try:
            data, ancdata, _flags, _addr = conn.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
        except TimeoutError:
            continue
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(cdata) >= _UCRED.size:
                pid = _UCRED.unpack(cdata[: _UCRED.size])[0]
        if not data:
            raise ForkRefused(f"the zygote hung up without forking the box: {_log_tail(ctl)}")
        buf += data
        if len(buf) > 65536:
            raise BoxDeadError("the zygote sent an oversized message")
    line = buf.split(b"\n", 1)[0]
    try:
        msg = json.loads(line.decode())
    except ValueError:
        raise BoxDeadError("the zygote sent a malformed message") from None
    if not isinstance(msg, dict):
        raise BoxDeadError("the zygote sent a malformed message")
    return msg, pid


def fork_from(
    zygote: NamespaceBox,
    spec: BoxSpec,
    name: str,
    box_dir: Path,
    cg: _cgroups.CgroupSet,
    timeout: float,
    identity: tuple[int, int],
    limits: Limits,
    env: dict[str, str],
) -> NamespaceBox:
    """Have ``zygote`` fork the box ``name`` (its directories and cgroups made already)."""
    deadline = time.monotonic() + timeout
    ctl = ctl_dir(box_dir)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    watch_r, watch_w = os.pipe()
    log: CappedBoxLog | None = None
    conn: socket.socket | None = None
    try:
        log = CappedBoxLog(ctl / "box.log")  # a pipe, drained capped: no host file's descriptor in the box
        _bind(listener, ctl / "agent.sock")
        listener.listen(64)
        try:
            conn = _connect(zygote.sock_path, max(0.1, deadline - time.monotonic()))
        except OSError as exc:
            raise BoxDeadError(f"zygote {zygote.name} does not answer: {exc}") from exc
        # Before the request: the child's first word must carry its pid (the kernel's, translated
        # into the host's pid namespace), and it may speak as soon as the zygote has read this.
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        req = {
            "op": "spawn",
            "hostname": name[:63],
            "network": spec.network,
            "env": env,
            "user": list(identity),
            "nproc": limits.nproc,
        }
        joins = _join_fds(cg)
        try:
            fds = [listener.fileno(), watch_r, log.write_end, *joins]
            socket.send_fds(conn, [(json.dumps(req) + "\n").encode()], fds)
        except OSError as exc:  # the zygote went away between accept and request
            raise ForkRefused(f"zygote {zygote.name} ended while asked to fork: {exc}") from exc
        finally:
            for fd in joins:
                os.close(fd)
    except BaseException:
        os.close(watch_w)
        if conn is not None:
            conn.close()
        raise
    finally:
        listener.close()
        os.close(watch_r)
        if log is not None:
            log.handed_over()
    proc: ForkedProcess | None = None
    try:
        with conn:
            first, pid = _first_line_with_pid(conn, deadline, ctl)
            if "error" in first:
                raise ForkRefused(f"zygote {zygote.name} could not fork a box: {first['error']}")
            if "forked" not in first or pid is None or pid <= 0 or pid == zygote.agent_pid:
                raise BoxDeadError(f"zygote {zygote.name}: unexpected answer {first!r}")
            proc = ForkedProcess(pid, _proc_start_time(pid))
            if proc.poll() is not None:
                raise ForkRefused(f"the box forked by {zygote.name} ended at once: {_log_tail(ctl)}")
            info: dict[str, Any] = {
                "name": name,
                "pid": pid,
                "start_time": proc._start_time,
                "init_pid": pid,
                "init_start_time": proc._start_time,
                "spec": spec.describe(),
                "identity": list(identity),
                "created": time.time(),
                "forked_from": zygote.name,
            }
            _write_private(ctl / "info.json", json.dumps(info).encode())
            conn.sendall(b"go\n")
            lines = _Lines(conn)
            try:
                ready = lines.read(deadline)
            except BoxDeadError:
                raise ForkRefused(f"the box forked by {zygote.name} did not start: {_log_tail(ctl)}") from None
            if "ready" not in ready:
                raise BoxDeadError(f"forked box {name}: unexpected answer {ready!r}")
        return NamespaceBox(
            name, box_dir, proc, cg, watch_w, identity=identity, limits=limits, info=info, forked_from=zygote.name
        )
    except OSError as exc:
        # The zygote (or the box it forked) went away mid-conversation: a refused fork, so the
        # box is booted instead, and the reason recorded, not a raw socket error in a test.
        _kill_quietly(proc)
        os.close(watch_w)
        raise ForkRefused(f"zygote {zygote.name} ended while forking a box: {exc}") from exc
    except BaseException:
        _kill_quietly(proc)
        os.close(watch_w)  # the box's agent ends on its own when this closes
        raise


def _kill_quietly(proc: ForkedProcess | None) -> None:
    """End a forked box whose start failed (bounded wait)."""
    if proc is not None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _join_fds(cg: _cgroups.CgroupSet) -> list[int]:
    """Descriptors, opened here, of the files through which the forked box's first process moves
    itself into ``cg``'s cgroups: ``tasks`` on cgroup v1 (writing ``0`` there moves the writer's
    thread alone, which needs no global lock), else ``cgroup.procs``."""
    fds: list[int] = []
    try:
        for d in cg.dirs:
            tasks = d / "tasks"
            fds.append(os.open(tasks if tasks.exists() else d / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        raise BoxStartError(f"cannot open the box's cgroup {exc.filename}: {exc.strerror}") from exc
    return fds


def _log_tail(ctl: Path) -> str:
    try:
        with open(ctl / "box.log", "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 2000))
            return fh.read().decode("utf-8", "replace").strip() or "no output"
    except OSError as exc:
        return f"(no log: {exc})"
