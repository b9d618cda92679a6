"""Code that runs inside a box (or as a bare helper beside one), and the one loader for it.

Every module here is standard-library only (plus pytest for the box's session) and imports nothing
of the package but its guest modules.  A warm box sees the plugin's directory: the host ships only
:mod:`bootstrap` (execnet ``remote_exec``), which imports the rest as modules.  A namespace box's
agent runs by path (``python -I -S``) and imports its siblings the same way (see its
``_guest_package``).  Scripts that run where the package may not be (a VM's file helper and fork
relay: ``python -I -S -c`` source) import nothing of it.  The host reaches these files through
:func:`path` and :func:`source`.

- ``bootstrap``: what execnet ships to a warm box: the host's ``sys.path``, then ``worker``.
- ``worker``: the warm pytest interpreter in a box (execnet channel to :mod:`pytest_boxlite.remote`).
- ``session``: the box's pytest session (collection once, the host's runs, shared fixtures).
- ``forks``: the fork server (a fresh box per ``FORK``, its runs on the host's socket).
- ``messages``: the vocabulary both ends of that channel use (the host imports it too).
- ``fresh``: the per-test fork into new namespaces (clone, cells, the test's namespaces).
- ``ids``, ``layers``, ``boxinit``: a fresh box's id maps, pristine layers, and pid 1.
- ``linux``: the C library and the kernel's numbers those use.
- ``caps``: capability dropping and libc error checks, shared by ``agent`` and ``fresh``.
- ``files``: the file-operation helper behind :class:`~pytest_boxlite.sandbox.Sandbox`.
- ``agent``: the in-box agent of a namespace box (pid 2 under bwrap).
- ``attach``: the host-side stdio bridge into a box (namespace agent or VM bridge).
- ``relay``: the guest end of a VM's fork relay (forked boxes' connections over one command's stdio).
- ``lastwords``: a boxed test's captured output, sent to the host when its timeout passes.
- ``changes``: what a boxed test left behind in its box (files, processes, environment), and its usage.
- ``terminal``: a command on a pty of the box's own (``shell`` from a terminal: job control, Ctrl-C).

And, where the package was built with a C compiler (``setup.py``), the native pid 1 of a test's box
(sources in ``_init/``): ``_boxclone*.so`` and ``_boxinit`` (see :func:`native_init`).
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

_HERE = Path(__file__).parent
NAMES = (
    "bootstrap",
    "messages",
    "worker",
    "session",
    "forks",
    "caps",
    "linux",
    "ids",
    "layers",
    "boxinit",
    "fresh",
    "files",
    "agent",
    "attach",
    "relay",
    "terminal",
    "lastwords",
    "changes",
)


def path(name: str) -> Path:
    """The file of guest module ``name`` (one of :data:`NAMES`)."""
    if name not in NAMES:
        raise ValueError(f"unknown guest module {name!r}; expected one of {NAMES}")
    return _HERE / f"{name}.py"


@functools.cache
def source(name: str) -> str:
    """The source text of guest module ``name``, read once per process."""
    return path(name).read_text()


#: The native pid 1's off switch (guest/boxinit.py reads it in the box): ``PYTEST_BOXLITE_NATIVE_INIT=0``.
NATIVE_INIT_ENV = "PYTEST_BOXLITE_NATIVE_INIT"


def native_init() -> tuple[Path, Path] | str:
    """The native pid 1's files built with the package, ``(_boxclone*.so, _boxinit)``; or why a
    test's box runs the Python pid 1 (the rule guest/boxinit.py's ``native_init`` applies in the box)."""
    if os.environ.get(NATIVE_INIT_ENV, "1").strip() == "0":
        return f"switched off ({NATIVE_INIT_ENV}=0)"
    if platform.machine() not in ("x86_64", "aarch64") or platform.system() != "Linux":
        return f"no native pid 1 for {platform.system()} {platform.machine()}"
    shared = sorted(_HERE.glob("_boxclone*.so"))
    init = _HERE / "_boxinit"
    if not shared or not init.is_file():
        return "not built (no C compiler when the package was installed)"
    if not os.access(init, os.X_OK) or os.statvfs(init).f_flag & os.ST_NOEXEC:
        return f"{init} is not executable here (its mode, or a noexec mount)"
    return shared[0], init


def pid1_line() -> str:
    """Which pid 1 a test's forked box runs, for ``doctor`` and the report header."""
    found = native_init()
    if isinstance(found, str):
        return f"python (BareInit, a copy of the warm interpreter): {found}"
    return "native (boxinit: the box's only copy of the warm interpreter is its test process)"
