"""Can a micro-VM boot here?  Answered from the host's state in milliseconds.

No trial boot: on hosts where ``/dev/kvm`` is a nested PVM hypervisor a boot
only fails after ~17 s, so the answer comes from what the kernel exposes.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import os
import platform
from functools import lru_cache
from pathlib import Path

_KVM_GET_API_VERSION = 0xAE00
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
    if not os.access(dev, os.R_OK | os.W_OK):
        return False, f"/dev/kvm is not read-writable by uid {os.getuid()} (add the user to the 'kvm' group)"
    modules = Path("/sys/module")
    has_pvm = (modules / "kvm_pvm").exists()
    has_hw = (modules / "kvm_intel").exists() or (modules / "kvm_amd").exists()
    if has_pvm and not has_hw:
        return False, "KVM is a nested PVM hypervisor; micro-VMs cannot boot here"
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
    return True, "/dev/kvm is usable (hardware KVM)"


@lru_cache(maxsize=1)
def probe() -> Probe:
    """Probe once per process; cached."""
    version = boxlite_version()
    system = platform.system()
    if system == "Linux":
        kvm_ok, kvm = _kvm_state()
    elif system == "Darwin":
        kvm_ok = platform.machine() == "arm64"
        kvm = "Hypervisor.framework (Apple silicon)" if kvm_ok else "BoxLite needs Apple silicon on macOS"
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
