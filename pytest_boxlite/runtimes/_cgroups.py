"""Best-effort resource limits for namespace boxes through cgroups (v1 or v2).

Limits apply "where the kernel allows": when a controller is missing or not
writable, the box still starts and :attr:`CgroupSet.missing` says which limit
could not be applied, so the runtime can report it instead of pretending.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")
_PREFIX = "pytest-boxlite-"


def _self_cgroups() -> dict[str, str]:
    """Map controller name (or "" for the v2 hierarchy) to this process's cgroup path."""
    out: dict[str, str] = {}
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


@dataclasses.dataclass
class CgroupSet:
    """The cgroup directories of one box, and which limits are in force."""

    dirs: list[Path] = dataclasses.field(default_factory=list)
    applied: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        """How many processes the OOM killer has killed in these cgroups."""
        total = 0
        for d in self.dirs:
            for name in ("memory.oom_control", "memory.events"):
                try:
                    text = (d / name).read_text()
                except OSError:
                    continue
                for line in text.splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and value.strip().isdigit():
                        total += int(value)
        return total

    def remove(self, timeout: float = 2.0) -> None:
        """Kill what is left in the cgroups and remove them.  Bounded by ``timeout``."""
        remove_dirs(self.dirs, timeout)

    def kill(self) -> None:
        """SIGKILL every process in these cgroups now (not waiting for them to go)."""
        kill_dirs(self.dirs)

    def join_fds(self) -> list[int]:
        """Descriptors, opened here, of the files through which a process moves itself into these
        cgroups by writing ``0``: ``tasks`` on cgroup v1 (which moves the writer's thread alone and
        takes no global lock), else ``cgroup.procs``.  The kernel checks the opener's credentials."""
        fds: list[int] = []
        try:
            for d in self.dirs:
                tasks = d / "tasks"
                fds.append(os.open(tasks if tasks.exists() else d / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def usage(self) -> dict[str, int]:
        """What the box's processes used, where these cgroups count it: ``peak_memory`` and
        ``memory_limit`` (bytes: v2 ``memory.peak``/``memory.max``, v1 ``memory.max_usage_in_bytes``/
        ``memory.limit_in_bytes``) and ``max_processes`` (v2 ``pids.peak``); a missing file, a
        controller not here or an unlimited limit leaves its key out."""
        out: dict[str, int] = {}
        files = (
            ("peak_memory", ("memory.peak", "memory.max_usage_in_bytes")),
            ("memory_limit", ("memory.max", "memory.limit_in_bytes")),
            ("max_processes", ("pids.peak",)),
            ("cpu_ns", ("cpuacct.usage",)),
        )
        for key, names in files:
            for d in self.dirs:
                for name in names:
                    try:
                        text = (d / name).read_text()[:64].strip()
                    except OSError:
                        continue
                    if text.isdigit() and int(text) < 1 << 62:  # "max", or v1's unlimited 2**63-4096
                        out[key] = int(text)
        if "cpu_ns" not in out:
            for d in self.dirs:  # cgroup v2: every cgroup counts its CPU time in cpu.stat
                usec = _stat_value(d / "cpu.stat", "usage_usec")
                if usec is not None:
                    out["cpu_ns"] = usec * 1000
                    break
        return out

    def reset_peaks(self) -> list[str]:
        """Start the peaks again from now, where the kernel lets them (cgroup v1's
        ``memory.max_usage_in_bytes``); returns the keys of :meth:`usage` whose peak still counts
        from the cgroups' start (v2's ``memory.peak`` and ``pids.peak`` take no reset that a later
        reader sees)."""
        kept = {"peak_memory", "max_processes"}
        for d in self.dirs:
            try:
                (d / "memory.max_usage_in_bytes").write_text("0")
                kept.discard("peak_memory")
            except OSError:
                continue
        return sorted(kept)

    def pids_max_reached(self) -> bool:
        """Whether the pids controller refused a fork in these cgroups (``pids.events``: ``max``)."""
        for d in self.dirs:
            try:
                text = (d / "pids.events").read_text()
            except OSError:
                continue
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "max" and value.strip().isdigit() and int(value) > 0:
                    return True
        return False


def _stat_value(path: Path, key: str) -> int | None:
    """``key``'s value in a flat keyed cgroup file (``cpu.stat``), or None."""
    try:
        text = path.read_text()[:4096]
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def kill_dirs(dirs: list[Path]) -> None:
    """SIGKILL every process in ``dirs`` once.  cgroup v2 has ``cgroup.kill`` for that; on v1 each
    listed pid is taken as a pidfd first and signalled only if the cgroup still lists it then, so a
    pid that ended and was reused in between is never signalled."""
    for d in dirs:
        try:
            (d / "cgroup.kill").write_text("1")
            continue
        except OSError:
            pass
        try:
            pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            continue
        held: dict[int, int] = {}
        try:
            for pid in pids:
                with contextlib.suppress(OSError):
                    held[pid] = os.pidfd_open(pid)
            try:
                still = {int(p) for p in (d / "cgroup.procs").read_text().split()}
            except (OSError, ValueError):
                still = set()
            for pid, fd in held.items():
                if pid in still:
                    with contextlib.suppress(OSError):
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            for fd in held.values():
                os.close(fd)
        if pids:
            return  # every hierarchy of a box holds the same processes: one is enough


def try_remove_dirs(dirs: list[Path]) -> list[Path]:
    """Remove the empty ones of ``dirs`` without waiting; the ones still in use are returned."""
    left = []
    for d in dirs:
        try:
            d.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            left.append(d)
    return left


def remove_dirs(dirs: list[Path], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    for d in dirs:
        while d.exists():
            try:
                for pid in (d / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(int(pid), 9)
                d.rmdir()
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)


def _v1_dir(controller: str, own: dict[str, str], name: str) -> Path | None:
    base = _ROOT / controller
    if not (base / "cgroup.procs").exists():
        return None
    parent = base / own.get(controller, "/").lstrip("/")
    return parent / (_PREFIX + name)


def create(name: str, *, memory_mib: int | None, cpus: int | None, pids: int | None) -> CgroupSet:
    """Create the cgroups of box ``name`` with the given limits, as far as possible."""
    cg = CgroupSet()
    own = _self_cgroups()
    wanted = {"memory": memory_mib, "cpu": cpus, "pids": pids}
    v1 = (_ROOT / "memory" / "cgroup.procs").exists() or (_ROOT / "pids" / "cgroup.procs").exists()
    for controller, value in wanted.items():
        if value is None:
            continue
        try:
            if v1:
                d = _v1_dir(controller, own, name)
                if d is None:
                    raise OSError(f"no cgroup v1 {controller} controller")
                d.mkdir(exist_ok=True)
                cg.dirs.append(d)
                if controller == "memory":
                    (d / "memory.limit_in_bytes").write_text(str(value * 1024 * 1024))
                    with contextlib.suppress(OSError):  # no swap accounting: the plain limit still holds
                        (d / "memory.memsw.limit_in_bytes").write_text(str(value * 1024 * 1024))
                elif controller == "cpu":
                    (d / "cpu.cfs_period_us").write_text("100000")
                    (d / "cpu.cfs_quota_us").write_text(str(value * 100000))
                else:
                    (d / "pids.max").write_text(str(value))
            else:
                parent = _ROOT / own.get("", "/").lstrip("/")
                if controller not in (parent / "cgroup.subtree_control").read_text().split():
                    raise OSError(f"cgroup v2 controller {controller} is not delegated to {parent}")
                d = parent / (_PREFIX + name)
                d.mkdir(exist_ok=True)
                if d not in cg.dirs:
                    cg.dirs.append(d)
                if controller == "memory":
                    (d / "memory.max").write_text(str(value * 1024 * 1024))
                    with contextlib.suppress(OSError):  # no swap controller: the memory limit still holds
                        (d / "memory.swap.max").write_text("0")
                elif controller == "cpu":
                    (d / "cpu.max").write_text(f"{value * 100000} 100000")
                else:
                    (d / "pids.max").write_text(str(value))
            cg.applied.append(controller)
        except OSError as exc:
            cg.missing.append(f"{controller} ({exc.strerror or exc})")
    if v1 and cg.dirs:
        # CPU time is counted by cgroup v1's cpuacct controller (v2 counts it in every cgroup):
        # a box with cgroups gets one more, with no limit, for --boxlite-usage (about 40 us here).
        account = _v1_dir("cpuacct", own, name)
        cpu = next((d for d in cg.dirs if (d / "cpuacct.usage").exists()), None)  # cpu,cpuacct mounted together
        if account is not None and cpu is None:
            with contextlib.suppress(OSError):  # not ours to make: the usage says rusage instead
                account.mkdir(exist_ok=True)
                cg.dirs.append(account)
    return cg


def find_dirs(name: str) -> list[Path]:
    """The cgroup directories a box named ``name`` may have left, for cleanup by another process,
    with those of the boxes forked from it (``<name>.<n>``, see :func:`cell_name`)."""
    own = _self_cgroups()
    found: list[Path] = []
    candidates = [_v1_dir(controller, own, name) for controller in ("memory", "cpu", "pids", "cpuacct")]
    candidates.append(_ROOT / own.get("", "/").lstrip("/") / (_PREFIX + name))
    for d in candidates:
        if d is None:
            continue
        if d.exists():
            found.append(d)
        with contextlib.suppress(OSError):
            found += [e for e in d.parent.iterdir() if e.name.startswith(d.name + ".") and e.is_dir()]
    return found


def cell_name(box: str, n: int) -> str:
    """The cgroup name of the ``n``-th box forked from box ``box`` (found by :func:`find_dirs`)."""
    return f"{box}.{n}"
