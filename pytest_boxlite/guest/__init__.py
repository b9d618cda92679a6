"""Code that runs inside a box (or as a bare helper beside one), and the one loader for it.

Every module here is standard-library only (plus pytest for :mod:`worker`) and imports nothing of
the package: it is shipped into a box as source or run by path under ``python -I -S``.  The host
reaches these files only through :func:`path` and :func:`source`.

- ``worker``: the warm pytest interpreter in a box (execnet channel to :mod:`pytest_boxlite.remote`).
- ``messages``: the vocabulary both ends of that channel use (the host imports it too).
- ``fresh``: the per-test fork's new namespaces and pristine layers (namespace runtime).
- ``caps``: capability dropping and libc error checks, shared by ``agent`` and ``fresh``.
- ``files``: the file-operation helper behind :class:`~pytest_boxlite.sandbox.Sandbox`.
- ``agent``: the in-box agent of a namespace box (pid 2 under bwrap).
- ``attach``: the host-side stdio bridge into a box (namespace agent or VM bridge).
- ``relay``: the guest end of a VM's fork relay (forked boxes' connections over one command's stdio).
- ``lastwords``: a boxed test's captured output, sent to the host when its timeout passes.
- ``changes``: what a boxed test left behind in its box (files, processes, environment), and its usage.
- ``terminal``: a command on a pty of the box's own (``shell`` from a terminal: job control, Ctrl-C).
"""

from __future__ import annotations

import functools
from pathlib import Path

_HERE = Path(__file__).parent
NAMES = ("messages", "worker", "caps", "fresh", "files", "agent", "attach", "relay", "terminal", "lastwords", "changes")


def path(name: str) -> Path:
    """The file of guest module ``name`` (one of :data:`NAMES`)."""
    if name not in NAMES:
        raise ValueError(f"unknown guest module {name!r}; expected one of {NAMES}")
    return _HERE / f"{name}.py"


@functools.cache
def source(name: str) -> str:
    """The source text of guest module ``name``, read once per process."""
    return path(name).read_text()
