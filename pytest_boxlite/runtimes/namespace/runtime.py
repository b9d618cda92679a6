"""The namespace runtime: creating boxes (one bubblewrap sandbox each) under ``<home>/namespace``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytest_boxlite import guest
from pytest_boxlite._homefs import HomeDir
from pytest_boxlite._shown import shown as _shown
from pytest_boxlite.errors import BoxStartError, BoxTimeoutError, RuntimeUnavailableError
from pytest_boxlite.runtimes import _cgroups
from pytest_boxlite.runtimes.base import BoxRecord, RuntimeDefaults
from pytest_boxlite.runtimes.namespace import image as _image
from pytest_boxlite.runtimes.namespace.box import NamespaceBox
from pytest_boxlite.runtimes.namespace.bwrap import find_bwrap
from pytest_boxlite.runtimes.namespace.layout import (
    _MAX_INFO,
    GUEST_CTL,
    WORKDIR,
    _bind,
    _write_private,
    ctl_dir,
)
from pytest_boxlite.runtimes.namespace.leftovers import (
    _proc_start_time,
    box_dirs,
    remove_box_dirs,
    remove_box_state,
    running,
)
from pytest_boxlite.runtimes.namespace.mounts import (
    _layer_args,
    _mask_plan,
    _mirror_args,
    _mirrored,
    _own_dirs,
    _secrets,
    mount_plan,
)
from pytest_boxlite.runtimes.namespace.privileges import (
    DEFAULT_MEMORY_MIB,
    Limits,
    _host_root,
    _write_id_maps,
    box_identity,
    limits_for,
    plan_limits,
    seccomp_program_fd,
    userns_problem,
)
from pytest_boxlite.runtimes.namespace.provision import ensure_template
from pytest_boxlite.runtimes.namespace.zygote import ForkPlan, ForkRefused, Zygotes, fork_from
from pytest_boxlite.spec import BoxSpec, minimal_dirs

AGENT = guest.path("agent")
#: How a box is started in its directories and cgroups (a boot or a fork): spec, name, box
#: directory, cgroups, timeout, identity, limits, base environment.
_Starter = Callable[
    [BoxSpec, str, Path, _cgroups.CgroupSet, float, tuple[int, int], Limits, dict[str, str]], NamespaceBox
]
HELPER = guest.path("files")


_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


#: How many times a boot is tried again when a path it hides went away under it (see _MaskGone).
_MASK_RETRIES = 3
#: bubblewrap's words when it cannot make a mount point: the path is the one it was making.
_BWRAP_NO_MOUNT_POINT = re.compile(r"bwrap: Can't (?:mkdir|create file at) (/[^\n]*?): ")


class _MaskGone(BoxStartError):
    """bubblewrap could not lay a mask over a host path that was removed after the box's plan was
    made (another session's home ended; a credential file was deleted): nothing is left to hide
    there, so the boot is tried again with a plan made now."""


def _mask_targets(argv: list[str]) -> set[str]:
    """The paths ``argv`` hides under an empty mount: ``--tmpfs P`` and ``--ro-bind /dev/null P``."""
    out: set[str] = set()
    for i, arg in enumerate(argv[:-1]):
        if arg == "--tmpfs":
            out.add(argv[i + 1])
        elif arg == "--ro-bind" and argv[i + 1] == "/dev/null" and i + 2 < len(argv):
            out.add(argv[i + 2])
    return out


def _vanished_mask(log_tail: str, targets: set[str]) -> str | None:
    """The mask target bubblewrap failed on because it no longer exists on the host, if that is
    what ended the boot (a path checked here, never one the box names: the log is bubblewrap's)."""
    for m in _BWRAP_NO_MOUNT_POINT.finditer(log_tail):
        path = m.group(1)
        if path in targets and not os.path.lexists(path):
            return path
    return None


def _guest_path_env() -> str:
    bindir = os.path.dirname(sys.executable)
    return f"{bindir}:{_SYSTEM_PATH}"


def _image_mounts(spec: BoxSpec) -> tuple[tuple[str, ...], list[str]]:
    """What a box of an image shows of the host at its own paths: ``(directories, files)``: the
    spec's mounts (the project; a test worker's ``sys.path``), and a test worker's interpreter."""
    dirs, files = _image.interpreter_mounts() if spec.warm else ([], [])
    return minimal_dirs([*spec.mounts, *dirs]), files


class NamespaceRuntime(RuntimeDefaults):
    """Creates namespace boxes whose state lives under ``<home>/namespace``."""

    name = "namespace"
    isolation = (
        "Linux namespaces via bubblewrap: copy-on-write view of the host filesystem, private /tmp, "
        "own user/pid/ipc/uts/network namespaces, guest root holds only Docker's default capabilities "
        "of the box's own user namespace, no_new_privs, seccomp; the kernel is shared with the host "
        "(weaker than a VM)"
    )

    def __init__(self, home: Path) -> None:
        bwrap, why = find_bwrap()
        if bwrap is None:
            raise RuntimeUnavailableError(why)
        problem = userns_problem(bwrap)
        if problem is not None:
            raise RuntimeUnavailableError(f"namespace boxes need user namespaces: {problem}")
        self.bwrap = bwrap
        self.home = Path(home)
        self.state_dir = self.home / "namespace"
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        # The boxes' directory: a real directory of ours, made through the home's descriptor (a
        # link planted as ``namespace`` is refused, never followed: boxes are made nowhere else).
        HomeDir.at(self.home, "namespace", create=True).close()
        self._closed = False
        self._zygotes = Zygotes(self._boot_zygote)

    def limits_for(self, spec: BoxSpec) -> Limits:
        """Which of ``spec``'s caps would hold on this host (a probe cgroup is made and removed)."""
        return limits_for(spec)

    def limits_header(self, spec: BoxSpec) -> str | None:
        """The report-header line for ``spec`` when a requested cap cannot hold here, else ``None``."""
        return self.limits_for(spec).header_line()

    def _bwrap_argv(
        self, spec: BoxSpec, name: str, box_dir: Path, persist: Path | None, info_fd: int, block_fd: int | None
    ) -> list[str]:
        masks, mask_mounts = self._masks(spec)
        if spec.root is not None:
            dirs, files = _image_mounts(spec)
            shown, _ = _image.host_mount_args(spec.root, dirs, files, masks, spec.template, persist)
            image_wd = _image.image_workdir(spec.root, spec.template)
            layers = _image.image_args(spec.root, spec.template, persist, dirs, files, image_wd)
            workdir = image_wd or WORKDIR
            below = [*shown, *_image.kit_args()]
        else:
            mirror_from = minimal_dirs([*spec.mounts, *_own_dirs()])
            layers = _layer_args(self.bwrap, spec.template, persist, masks)
            below = _mirror_args(mirror_from, masks, spec.template, persist)
            workdir = WORKDIR
        argv = [
            self.bwrap,
            "--unshare-user", "--uid", "0", "--gid", "0",
            "--info-fd", str(info_fd),
            # Every capability of the box's own user namespace, for the agent's set-up only: it drops
            # to Docker's default set before it runs anything (see guest/agent.py).
            "--cap-add", "ALL",
            # The agent is the pid namespace's first process: unkillable from inside, and its end
            # (the host's watchdog pipe closing) ends every process of the box.
            "--unshare-pid", "--as-pid-1", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--new-session",
            "--hostname", name[:63],
            *layers,
            "--proc", "/proc", "--dev", "/dev", "--ro-bind", "/sys", "/sys",
            "--tmpfs", "/tmp", "--tmpfs", "/run",
            "--dir", WORKDIR,
            *below,
            *mask_mounts,
            "--ro-bind", str(box_dir), GUEST_CTL,
            "--dir", workdir,
            "--chdir", workdir,
        ]  # fmt: skip
        if block_fd is not None:
            # A root host writes the box's id maps itself (the whole range, one to one) before it runs.
            argv[argv.index("--info-fd") : argv.index("--info-fd")] = ["--userns-block-fd", str(block_fd)]
        if not spec.network:
            argv.append("--unshare-net")
        return argv

    def _mask_tops(self, spec: BoxSpec) -> tuple[list[str], list[str] | None]:
        """``(tops, shown)``: the box's copy-on-write directories (a secret below one is hidden by a
        layer) and, for a box of an image, the host paths it shows (only masks below them count)."""
        if spec.root is not None:
            dirs, files = _image_mounts(spec)
            _, overlays = _image.host_mount_args(spec.root, dirs, files, {}, None, None)
            return list(overlays), [*dirs, *files]
        mirror_from = minimal_dirs([*spec.mounts, *_own_dirs()])
        return [e[-1] for e in mount_plan(self.bwrap)[0] if e[0] == "overlay"] + _mirrored(mirror_from), None

    def _masks(self, spec: BoxSpec) -> tuple[dict[str, str], list[str]]:
        """The mask layers and mounts hiding credentials (those on the host now) in a box of ``spec``.

        A box of an image sees only the host directories it mounts: the masks of those alone."""
        tops, shown = self._mask_tops(spec)
        layers, mounts = _mask_plan(self.home, tops)
        if shown is None:
            return layers, mounts
        kept: list[str] = []
        i = 0
        while i < len(mounts):
            width = 2 if mounts[i] == "--tmpfs" else 3
            target = mounts[i + width - 1]
            if any(target == d or target.startswith(d.rstrip("/") + "/") for d in shown):
                kept += mounts[i : i + width]
            i += width
        return layers, kept

    def _fork_plan(self, spec: BoxSpec) -> ForkPlan:
        """What a zygote of ``spec`` must have been booted with for a box forked from it to be what a
        box booted now would be: the same layout, hiding at least the credentials and homes the host
        has *now* (a ~/.netrc made after the zygote booted must be hidden all the same: then a new
        zygote is booted; one removed since leaves the zygote hiding a path that is gone)."""
        tops, shown = self._mask_tops(spec)
        dirs, files = _secrets(self.home, tops)
        return ForkPlan(
            layout=(tuple(tops), tuple(shown or ())),
            hidden=frozenset([*(f"d:{d}" for d in dirs), *(f"f:{f}" for f in files)]),
        )

    def _base_env(self, spec: BoxSpec, name: str) -> dict[str, str]:
        # No HOME: the agent gives each command its user's writable home (guest/agent.py home_for).
        env = {
            "PATH": _guest_path_env() if spec.root is None else _SYSTEM_PATH,
            "LANG": "C.UTF-8",
            "HOSTNAME": name[:63],
            "TERM": "dumb",
            "BOXLITE_BOX": name,
            "BOXLITE_RUNTIME": "namespace",
        }
        if spec.root is not None:
            # The image config's Env, under the spec's own.
            env.update(dict(spec.root.env))
        env.update(dict(spec.env))
        return env

    def allow_forked_boxes(self, allowed: bool) -> None:
        """Whether :meth:`create_box` forks new boxes from a zygote of their spec (see
        :mod:`.zygote`) instead of booting each.  Off until the session turns it on: a forked box
        dies with its zygote, so a session that keeps boxes (``--boxlite-keep``) boots them."""
        self._zygotes.allowed = allowed

    def stop_forking(self) -> None:
        """Destroy the zygotes (and with them any box still forked from one)."""
        self._zygotes.stop()

    def create_box(self, spec: BoxSpec, name: str, *, timeout: float, persist: Path | None = None) -> NamespaceBox:
        """Create and start a box.  With ``persist``, its writes are kept there (template building).

        Where forking is allowed (:meth:`allow_forked_boxes`), a sandbox box (not a test worker's,
        not a template build) is forked from its spec's zygote, booted on first use; a host
        that refuses the fork gets booted boxes, and :attr:`fork_fallback` says why.
        """
        if self._closed:
            raise BoxStartError("the namespace runtime is closed")
        _check_name(name)
        if persist is None and not spec.warm:
            zygote = self._zygotes.get(spec, name, timeout, self._fork_plan)
            if zygote is not None:
                try:
                    return self._make(spec, name, lambda *a: fork_from(zygote, *a), timeout)
                except ForkRefused as exc:
                    self._zygotes.refuse(spec, str(exc))
        return self._make(spec, name, lambda *a: self._start(*a, persist=persist), timeout)

    @property
    def fork_fallback(self) -> str | None:
        """Why boxes are booted where they would be forked (the host refused a fork), or ``None``."""
        return self._zygotes.fallback

    def _boot_zygote(self, spec: BoxSpec, name: str, timeout: float) -> NamespaceBox:
        _check_name(name)
        return self._make(spec, name, lambda *a: self._start(*a, persist=None, zygote=True), timeout)

    def _make(
        self,
        spec: BoxSpec,
        name: str,
        start: _Starter,
        timeout: float,
    ) -> NamespaceBox:
        """The box's directories and cgroups, then ``start`` (a boot or a fork) in them.

        A boot that failed only because a path it hides was removed meanwhile (another session
        ending on this machine removes its home, which every box hides) is tried again, with a
        plan made then, a few times within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        for attempt in range(1, _MASK_RETRIES + 1):
            try:
                return self._make_once(spec, name, start, max(0.0, deadline - time.monotonic()))
            except _MaskGone as exc:
                if attempt == _MASK_RETRIES or time.monotonic() >= deadline:
                    raise BoxStartError(f"{exc} (tried {attempt} times)") from exc
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _make_once(self, spec: BoxSpec, name: str, start: _Starter, timeout: float) -> NamespaceBox:
        box_dir = self.state_dir / name
        # Before the box's directory: a user= nobody is makes no box (none to count as leaked).
        identity = box_identity(spec)
        try:
            with HomeDir.at(self.home, "namespace") as state:
                os.mkdir(name, 0o755, dir_fd=state.fd)
                os.mkdir(ctl_dir(box_dir).name, 0o700, dir_fd=state.fd)
        except FileExistsError:
            raise BoxStartError(f"a box named {name!r} already exists in {self.state_dir}") from None
        if spec.root is not None and spec.user is None and not spec.warm and spec.root.user and _host_root():
            # The image config's User, where the box maps every id (a root host): elsewhere only
            # the host user is mapped, and commands run as root in the box as without an image.
            identity = _image.image_identity(spec.root) or identity
        cg = _cgroups.create(
            name,
            memory_mib=spec.memory_mib or DEFAULT_MEMORY_MIB,
            cpus=spec.cpus,
            pids=spec.pids_limit,
        )
        limits = plan_limits(cg, memory_mib=spec.memory_mib, cpus=spec.cpus, pids=spec.pids_limit)
        try:
            box = start(spec, name, box_dir, cg, timeout, identity, limits, self._base_env(spec, name))
        except BaseException:
            cg.remove()
            # The start's own error is the one to raise; what could not be removed is a leftover
            # that the ledger lists and the next reconcile removes.
            with contextlib.suppress(OSError):
                remove_box_dirs(box_dir)
            raise
        workdir = _image.image_workdir(spec.root, spec.template) if spec.root is not None else None
        if workdir is not None:
            box.workdir = workdir  # the image config's WorkingDir: commands' default cwd
        # Each box forked per test from this one's warm interpreter gets these caps in cgroups of
        # its own (see NamespaceBox.fork_cell), not a share of this box's.
        box.cell_limits = (spec.memory_mib or DEFAULT_MEMORY_MIB, spec.cpus, spec.pids_limit)
        return box

    def _start(
        self,
        spec: BoxSpec,
        name: str,
        box_dir: Path,
        cg: _cgroups.CgroupSet,
        timeout: float,
        identity: tuple[int, int],
        limits: Limits,
        env: dict[str, str],
        *,
        persist: Path | None,
        zygote: bool = False,
    ) -> NamespaceBox:
        deadline = time.monotonic() + timeout
        ctl = ctl_dir(box_dir)
        root = _host_root()
        token = secrets.token_hex(16)
        # The agent's socket is made here, in the private directory, and handed over as a descriptor.
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Not bwrap's --die-with-parent: that fires when the *thread* that forked
        # bwrap ends.  A pipe only this process writes to dies with the process.
        watch_r, watch_w = os.pipe()
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe() if root else (None, None)
        seccomp_fd = seccomp_program_fd()
        child_only = [fd for fd in (watch_r, info_w, block_r, seccomp_fd) if fd is not None]
        try:
            _bind(listener, ctl / "agent.sock")
            listener.listen(64)
            kit = spec.root is not None
            cfg = {
                "listen_fd": listener.fileno(),
                "watchdog_fd": watch_r,
                "env": env,
                "helper": _image.kit_path(HELPER) if kit else str(HELPER),
                "user": list(identity),
                "nproc": limits.nproc,
                "zygote": zygote,
                # A secret of this box's: a process is proven the box's by holding it in its
                # command line (the agent's, bubblewrap's) before the host ever signals a pid
                # read back from info.json (see leftovers._proven).
                "token": token,
            }
            if kit:
                # The host's interpreter on the host's loader and libraries (see .image).
                agent = [*_image.kit_argv(), "-I", "-S", _image.kit_path(AGENT), json.dumps(cfg)]
            else:
                agent = [self.guest_python_for(spec), "-I", "-S", str(AGENT), json.dumps(cfg)]
            bwrap = self._bwrap_argv(spec, name, box_dir, persist, info_w, block_r)
            if seccomp_fd is not None:
                bwrap += ["--seccomp", str(seccomp_fd)]
            # The shell joins the box's cgroups first so bwrap and everything under it is limited.
            join = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 97; shift; n=$((n-1)); done; exec "$@"'
            procs = cg.procs_files()
            log = os.open(ctl / "box.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", join, "sh", str(len(procs)), *procs, *bwrap, "--", *agent],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    # Nothing of this process's environment reaches the box (no host secrets in
                    # /proc/1/environ): the agent gives commands the box's own base environment.
                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                    start_new_session=True,
                    pass_fds=(listener.fileno(), *child_only),
                )
            finally:
                os.close(log)
        except BaseException:
            for fd in (watch_w, info_r, block_w):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            listener.close()
            for fd in child_only:
                os.close(fd)
        assert proc.stdout is not None
        info: dict[str, Any] = {
            "name": name,
            "pid": proc.pid,
            "start_time": _proc_start_time(proc.pid),
            "spec": spec.describe(),
            "identity": list(identity),
            "created": time.time(),
            "token": token,
            # The agent's socket was listened on by this process: what SO_PEERCRED names (shell).
            "listener_pid": os.getpid(),
        }
        box = NamespaceBox(name, box_dir, proc, cg, watch_w, identity=identity, limits=limits, info=info)
        try:
            init_pid = _read_child_pid(info_r, deadline)
            if init_pid is not None:
                info["init_pid"] = init_pid
                info["init_start_time"] = _proc_start_time(init_pid)
                box._info = dict(info)
            if block_w is not None:
                if init_pid is None:
                    raise BoxStartError(f"namespace box {name}: bubblewrap did not report its sandbox")
                _write_id_maps(init_pid)
                os.write(block_w, b"1")
            _write_private(ctl / "info.json", json.dumps(info).encode())
            ready = self._wait_ready(proc, max(0.0, deadline - time.monotonic()))
        except BaseException:
            box.destroy()
            raise
        finally:
            os.close(info_r)
            if block_w is not None:
                os.close(block_w)
        proc.stdout.close()
        if not ready:
            try:
                # Ended already (its output closed) or still running after the deadline.
                ended: int | None = proc.wait(0.5)
            except subprocess.TimeoutExpired:
                ended = None
            tail = box.log_tail()
            box.destroy()
            gone = _vanished_mask(tail, _mask_targets(bwrap)) if ended is not None else None
            if gone is not None:
                raise _MaskGone(f"namespace box {name}: {gone}, a path it hides, was removed while it started")
            how = f"bubblewrap exited with status {ended}" if ended is not None else f"within {timeout:.0f}s"
            raise BoxStartError(f"namespace box {name} did not start ({how}): {tail.strip() or 'no output'}")
        return box

    @staticmethod
    def _wait_ready(proc: subprocess.Popen[bytes], timeout: float) -> bool:
        assert proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout):
                return False
            return proc.stdout.readline(256).startswith(b"ready")
        finally:
            sel.close()

    @staticmethod
    def guest_python_for(spec: BoxSpec) -> str:
        # The namespace guest sees the host's filesystem, so the host interpreter is there.
        return sys.executable

    def list_boxes(self) -> list[BoxRecord]:
        return [
            BoxRecord(
                name=box_dir.name,
                id=box_dir.name,
                runtime=self.name,
                state="running" if running(box_dir) else "dead",
                home=str(self.home),
            )
            for box_dir in box_dirs(self.state_dir)
        ]

    def remove_box(self, name: str) -> None:
        if "/" in name or name in ("", ".", ".."):
            raise BoxStartError(f"not a box name: {_shown(name, line=True)}")
        remove_box_state(self.state_dir / name)

    def provision(
        self, spec: BoxSpec, setup: str, *, key: str, home: Path, cwd: Path, timeout: float, name: str
    ) -> BoxSpec:
        """Run ``setup`` once in a box whose writes become a template; boxes of the returned spec
        start from it (see :mod:`.provision`)."""
        return ensure_template(self, spec, setup, key=key, home=home, cwd=cwd, timeout=timeout, name=name)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._zygotes.stop()


def _check_name(name: str) -> None:
    if not name or "/" in name or name.startswith(".") or name.endswith((".ctl", ".keep")):
        raise BoxStartError(f"invalid box name {name!r}")


def _read_child_pid(fd: int, deadline: float) -> int | None:
    """bubblewrap's ``--info-fd`` report: the host pid of the sandbox's first process."""
    buf = b""
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    try:
        while len(buf) < _MAX_INFO:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise BoxTimeoutError("bubblewrap did not report its sandbox in time")
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
            try:
                pid = json.loads(buf).get("child-pid")
            except ValueError:
                continue
            return pid if isinstance(pid, int) and pid > 0 else None
    finally:
        sel.close()
    return None
