"""The C library and the kernel's numbers the guest's box-making code uses (Linux only).

Standard library only.  Imported by :mod:`pytest_boxlite.guest.ids`,
:mod:`pytest_boxlite.guest.layers`, :mod:`pytest_boxlite.guest.boxinit` and
:mod:`pytest_boxlite.guest.fresh`, in the warm interpreter and in a zygote's agent.
"""

from __future__ import annotations

import ctypes

CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE = 16384, 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
CLONE_NEWCGROUP = 0x02000000
SIGCHLD = 17

#: The C library, opened once in the warm interpreter (ctypes is imported at load time for the same
#: reason): every forked box would otherwise pay the import and the dlopen (several ms) itself.
LIBC = ctypes.CDLL(None, use_errno=True)
#: The same library through a PyDLL: its calls keep the GIL held (see :class:`BareInit`).
PYLIBC = ctypes.PyDLL(None, use_errno=True)
