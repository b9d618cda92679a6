"""The privilege model: user namespaces, identity, resource limits and the seccomp filter."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import subprocess
from functools import lru_cache
from pathlib import Path

from pytest_boxlite.errors import ConfigError
from pytest_boxlite.runtimes import _cgroups
from pytest_boxlite.runtimes.namespace.bwrap import find_bwrap
from pytest_boxlite.spec import BoxSpec

#: Memory cap when the spec names none: BoxLite's own VM default, for parity.
DEFAULT_MEMORY_MIB = 1024


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

    A box that runs boxed tests (``spec.warm``) runs them as the host user, as a local run
    would (a test expecting ``PermissionError`` on a read-only file still gets it); any other box
    runs commands as root in the box, like a container's exec, so installers can write
    ``/usr/local``.  A ``user`` attribute on the spec (``"uid[:gid]"`` or a name) overrides both.
    """
    default = (os.getuid(), os.getgid()) if spec.warm else (0, 0)
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


def forked_box_sharing(cg: _cgroups.CgroupSet, *, pids: int | None) -> str:
    """What boxes forked per test from one warm box share on this host, for doctor.

    Each gets cgroups of its own where this user may make them (``cg``: a probe's), killed whole
    once its test is done; otherwise only its own stderr, and what its processes use counts where
    its warm box's does (``RLIMIT_NPROC``, the host's memory) until it is ended, before the next test.
    """
    if cg.applied:
        own = ", ".join(cg.applied)
        shared = [c for c in ("memory", "cpu", "pids") if c not in cg.applied]
        rest = f"; shared with the host: {', '.join(shared)}" if shared else ""
        return (
            f"each boxed test's forked box has its own stderr and cgroups ({own}, its warm box's caps){rest}; "
            "a box whose test is done is killed whole before the next test runs"
        )
    nproc = f"RLIMIT_NPROC {pids}" if pids else "the user's process limit"
    return (
        f"each boxed test's forked box has its own stderr but no cgroups (none can be made here): the boxes "
        f"forked from one warm box share its {nproc} and the host's memory and cpu; a box whose test is done "
        "is ended before the next test runs (through its warm interpreter: a round trip per test), while "
        "the boxes made ahead for the next tests count against the same limit, and a fork refused for that "
        "says so"
    )


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
