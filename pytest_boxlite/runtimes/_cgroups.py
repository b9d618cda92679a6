"""Best-effort resource limits for namespace boxes through cgroups (v1 or v2).

Limits apply "where the kernel allows": when a controller is missing or not
writable, the box still starts and :attr:`CgroupSet.missing` says which limit
could not be applied, so the runtime can report it instead of pretending.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
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
    return cg


def find_dirs(name: str) -> list[Path]:
    """The cgroup directories a box named ``name`` may have left, for cleanup by another process."""
    own = _self_cgroups()
    found: list[Path] = []
    for controller in ("memory", "cpu", "pids"):
        d = _v1_dir(controller, own, name)
        if d is not None and d.exists():
            found.append(d)
    v2 = _ROOT / own.get("", "/").lstrip("/") / (_PREFIX + name)
    if v2.exists():
        found.append(v2)
    return found
