"""Capability dropping and libc error checks, shared by the guest code that calls libc.

Standard library only.  Imported by the agent (:mod:`pytest_boxlite.guest.agent`) and by the
per-test fork (:mod:`pytest_boxlite.guest.fresh`); ``ctypes`` is imported only when a function
runs (the warm test interpreter does not load it for nothing).
"""

from __future__ import annotations

import os

# Types for mypy only: the agent imports this file as it starts, and typing would cost it milliseconds.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_EINVAL = 22


def check_libc(ret: int, what: str) -> None:
    """Raise ``OSError`` (with libc's errno) when a libc call returned non-zero."""
    if ret != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def limit_caps(libc: Any, keep: Iterable[int]) -> None:
    """Keep only the capabilities ``keep`` (numbers): bounding, effective and permitted sets; no ambient."""
    import ctypes

    try:
        with open("/proc/sys/kernel/cap_last_cap") as fh:
            last = int(fh.read())
    except (OSError, ValueError):
        last = 40
    for cap in range(last + 1):
        # EINVAL: a capability this kernel does not know; anything else is a real failure.
        if cap not in keep and libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != _EINVAL:
            check_libc(-1, "dropping capability %d from the bounding set" % cap)
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    mask = 0
    for cap in keep:
        mask |= 1 << cap
    lo, hi = mask & 0xFFFFFFFF, mask >> 32
    data = (Data * 2)(Data(lo, lo, 0), Data(hi, hi, 0))
    check_libc(libc.capset(ctypes.byref(Header(_LINUX_CAPABILITY_VERSION_3, 0)), data), "capset")
