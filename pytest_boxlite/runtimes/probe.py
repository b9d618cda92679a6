"""Can a micro-VM boot here?  Answered from the host's state in milliseconds.

No trial boot: on hosts where ``/dev/kvm`` is a nested PVM hypervisor a boot
only fails after ~17 s, so the answer comes from what the kernel exposes.

Linux: ``/dev/kvm`` must exist, not be the PVM module without hardware KVM
(BoxLite's own check passes under PVM, then every boot dies; checked before
access, as no user could boot there), be read-writable, answer API version
12, and, as BoxLite checks at every runtime open, run a one-instruction guest
to ``KVM_EXIT_HLT`` (a few milliseconds, x86-64; other architectures open a
throwaway BoxLite runtime in a subprocess).  The answer "no KVM" never gets
that far, so it stays well under 50 ms.
macOS: Apple silicon and ``sysctl kern.hv_support`` = 1 (hosted macOS runners
and macOS VMs have no Hypervisor.framework).
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import mmap
import os
import platform
import struct
import subprocess
import sys
import threading
from functools import lru_cache
from pathlib import Path

_KVM_GET_API_VERSION = 0xAE00
_KVM_CREATE_VM = 0xAE01
_KVM_GET_VCPU_MMAP_SIZE = 0xAE04
_KVM_CREATE_VCPU = 0xAE41
_KVM_SET_USER_MEMORY_REGION = 0x4020AE46
_KVM_RUN = 0xAE80
_KVM_SET_REGS = 0x4090AE82
_KVM_GET_SREGS = 0x8138AE83
_KVM_SET_SREGS = 0x4138AE84
_KVM_EXIT_HLT = 5
#: Bound on the usability check (the HLT guest exits at once where KVM works).
SMOKE_TIMEOUT = 5.0
_SUPPORTED_SERIES = (0, 10)


@dataclasses.dataclass(frozen=True)
class Probe:
    """The host's answer: whether the vm runtime can work, and why (not)."""

    vm_ok: bool
    reason: str
    kvm: str
    boxlite_version: str | None


def boxlite_version() -> str | None:
    """The installed boxlite SDK version, or ``None`` when it is not importable."""
    # importlib.metadata costs ~30 ms to import cold; the dist-info name is enough.
    spec = importlib.util.find_spec("boxlite")
    if spec is None or not spec.submodule_search_locations:
        return None
    site = Path(next(iter(spec.submodule_search_locations))).parent
    for info in site.glob("boxlite-*.dist-info"):
        return info.name[len("boxlite-") : -len(".dist-info")]
    return None


def _kvm_state() -> tuple[bool, str]:
    dev = Path("/dev/kvm")
    if not dev.exists():
        return False, "/dev/kvm does not exist (no KVM: enable virtualization or load kvm_intel/kvm_amd)"
    # PVM first: no user can boot a VM there, so "join the kvm group" would send one after nothing.
    modules = Path("/sys/module")
    has_pvm = (modules / "kvm_pvm").exists()
    has_hw = (modules / "kvm_intel").exists() or (modules / "kvm_amd").exists()
    if has_pvm and not has_hw:
        return False, "KVM is a nested PVM hypervisor; micro-VMs cannot boot here"
    if not os.access(dev, os.R_OK | os.W_OK):
        return False, f"/dev/kvm is not read-writable by uid {os.getuid()} (add the user to the 'kvm' group)"
    try:
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return False, f"/dev/kvm cannot be opened: {exc.strerror}"
    try:
        api = fcntl.ioctl(fd, _KVM_GET_API_VERSION)
    except OSError as exc:
        return False, f"/dev/kvm does not answer KVM_GET_API_VERSION: {exc.strerror}"
    finally:
        os.close(fd)
    if api != 12:
        return False, f"/dev/kvm reports KVM API version {api}, expected 12"
    ok, why = kvm_smoke_test()
    if not ok:
        return False, f"/dev/kvm opens but cannot run a guest: {why}"
    return True, "/dev/kvm is usable (hardware KVM, a test guest ran)"


def _hlt_guest() -> str | None:
    """Run a one-instruction real-mode guest (``hlt``); None when it exits with KVM_EXIT_HLT, else why not."""
    import ctypes  # only where the cheap checks passed

    libc = ctypes.CDLL(None, use_errno=True)
    libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    kvm = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    fds = [kvm]
    try:
        vm = fcntl.ioctl(kvm, _KVM_CREATE_VM, 0)
        fds.append(vm)
        mem = mmap.mmap(-1, 0x1000)
        mem.write(b"\xf4")  # hlt
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
        region = struct.pack("=IIQQQ", 0, 0, 0x1000, 0x1000, addr)
        buf = ctypes.create_string_buffer(region, len(region))
        if libc.ioctl(vm, _KVM_SET_USER_MEMORY_REGION, buf) < 0:
            return f"KVM_SET_USER_MEMORY_REGION: {os.strerror(ctypes.get_errno())}"
        vcpu = fcntl.ioctl(vm, _KVM_CREATE_VCPU, 0)
        fds.append(vcpu)
        size = fcntl.ioctl(kvm, _KVM_GET_VCPU_MMAP_SIZE, 0)
        run = mmap.mmap(vcpu, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        sregs = bytearray(312)
        fcntl.ioctl(vcpu, _KVM_GET_SREGS, sregs)
        sregs[0:8] = b"\0" * 8  # cs.base
        sregs[12:14] = b"\0" * 2  # cs.selector
        fcntl.ioctl(vcpu, _KVM_SET_SREGS, bytes(sregs))
        regs = bytearray(144)
        regs[128:144] = struct.pack("=QQ", 0x1000, 0x2)  # rip, rflags
        fcntl.ioctl(vcpu, _KVM_SET_REGS, bytes(regs))
        fcntl.ioctl(vcpu, _KVM_RUN, 0)
        reason = struct.unpack_from("=I", run, 8)[0]
        run.close()
        del buf
        return None if reason == _KVM_EXIT_HLT else f"the test guest exited with reason {reason}, not HLT"
    finally:
        for fd in reversed(fds):
            os.close(fd)


def _trial_open() -> str | None:
    """Open a throwaway BoxLite runtime in a subprocess (it runs BoxLite's own KVM smoke test)."""
    import tempfile

    code = "import sys, boxlite\nboxlite.Boxlite(boxlite.Options(home_dir=sys.argv[1]))\n"
    with tempfile.TemporaryDirectory(prefix="boxlite-probe-") as home:
        try:
            r = subprocess.run(
                [sys.executable, "-c", code, home], capture_output=True, text=True, timeout=SMOKE_TIMEOUT * 4
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return f"a trial BoxLite runtime did not open: {exc}"
    if r.returncode != 0:
        return (r.stderr.strip().splitlines() or ["a trial BoxLite runtime failed"])[-1][:300]
    return None


def kvm_smoke_test() -> tuple[bool, str]:
    """Whether KVM really runs a guest here (BoxLite's check), bounded by :data:`SMOKE_TIMEOUT`."""
    if platform.machine() not in ("x86_64", "AMD64"):
        why = _trial_open()
        return why is None, why or "ok"
    out: list[str | None] = []

    def run() -> None:
        try:
            out.append(_hlt_guest())
        except OSError as exc:
            out.append(f"{exc.strerror or exc}")

    t = threading.Thread(target=run, name="boxlite-kvm-smoke", daemon=True)
    t.start()
    t.join(SMOKE_TIMEOUT)
    if t.is_alive():
        return False, f"the test guest did not exit within {SMOKE_TIMEOUT:.0f}s"
    why = out[0] if out else "the smoke test crashed"
    return why is None, why or "ok"


def _hv_support() -> tuple[bool, str]:
    """macOS: Apple silicon and Hypervisor.framework available (``sysctl kern.hv_support``)."""
    if platform.machine() != "arm64":
        return False, "BoxLite needs Apple silicon on macOS"
    try:
        r = subprocess.run(["sysctl", "-n", "kern.hv_support"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"cannot ask sysctl for kern.hv_support: {exc}"
    if r.stdout.strip() != "1":
        return False, (
            "Hypervisor.framework is not available (kern.hv_support is not 1: a macOS VM or a hosted "
            "runner without nested virtualization)"
        )
    return True, "Hypervisor.framework (Apple silicon)"


@lru_cache(maxsize=1)
def probe() -> Probe:
    """Probe once per process; cached."""
    version = boxlite_version()
    system = platform.system()
    if system == "Linux":
        kvm_ok, kvm = _kvm_state()
    elif system == "Darwin":
        kvm_ok, kvm = _hv_support()
    else:
        kvm_ok, kvm = False, f"BoxLite does not support {system}"
    if version is None:
        return Probe(False, "the boxlite package is not installed (pip install 'boxlite>=0.10,<0.11')", kvm, None)
    series = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if series != _SUPPORTED_SERIES:
        want = ".".join(map(str, _SUPPORTED_SERIES))
        return Probe(False, f"boxlite {version} is installed but pytest-boxlite needs the {want} series", kvm, version)
    if not kvm_ok:
        return Probe(False, kvm, kvm, version)
    return Probe(True, f"{kvm}; boxlite {version}", kvm, version)
