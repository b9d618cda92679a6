"""The ``namespace`` runtime: throw-away machines made of Linux namespaces.

A box is one long-lived bubblewrap sandbox whose first process is a small
agent (:mod:`pytest_boxlite.guest.agent`).  Unless an image is asked for (then its root
filesystem takes the host's place: :mod:`.image`), the host filesystem is
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

The package, by concern:

- :mod:`.bwrap`: finding a bubblewrap new enough for overlays;
- :mod:`.mounts`: the mount plan (host directories copy-on-write) and the credential masks;
- :mod:`.image`: boxes on an image's root filesystem (``BoxSpec.root``), the agent on the host's
  loader there, and whether an image can run boxed tests' interpreter;
- :mod:`.privileges`: user namespaces, identity, resource limits, the seccomp filter;
- :mod:`.layout`: a box's directories on the host and bounded reads of its private files;
- :mod:`.leftovers`: a box's liveness and cleanup from the host's own record;
- :mod:`.box`: a running box (:class:`NamespaceBox`), its agent client and :func:`attach`;
- :mod:`.fork`: the host end of the per-test fork (the socket forked boxes report on);
- :mod:`.provision`: templates built by ``--boxlite-setup``;
- :mod:`.runtime`: :class:`NamespaceRuntime`, which creates boxes;
- :mod:`.kind`: the runtime seen from a home without opening it (doctor's facts, leftovers,
  templates, attaching to a running box), for :func:`pytest_boxlite.runtimes.kind`.

The names other modules use are re-exported here.  A test that replaces a function must patch the
module that reads it (e.g. ``privileges._read_sysctl``, ``runtime.userns_problem``), not this one.
"""

from __future__ import annotations

from pytest_boxlite.runtimes.namespace.box import ATTACH, NamespaceBox, attach
from pytest_boxlite.runtimes.namespace.bwrap import find_bwrap
from pytest_boxlite.runtimes.namespace.layout import (
    GUEST_CTL,
    WORKDIR,
    _read_info,
    ctl_dir,
    keep_marker,
    private_tmp,
    read_private,
)
from pytest_boxlite.runtimes.namespace.leftovers import _alive, kill_box_processes, remove_box_dirs
from pytest_boxlite.runtimes.namespace.mounts import mount_plan
from pytest_boxlite.runtimes.namespace.privileges import (
    DEFAULT_MEMORY_MIB,
    DOCKER_CAPS,
    SECCOMP_DENIED,
    SECCOMP_DENIED_IOCTLS,
    Limits,
    box_identity,
    limits_for,
    parse_user,
    plan_limits,
    preflight,
    seccomp_program_fd,
    seccomp_status,
    userns_problem,
)
from pytest_boxlite.runtimes.namespace.runtime import AGENT, HELPER, NamespaceRuntime

__all__ = [
    "AGENT",
    "ATTACH",
    "DEFAULT_MEMORY_MIB",
    "DOCKER_CAPS",
    "GUEST_CTL",
    "HELPER",
    "SECCOMP_DENIED",
    "SECCOMP_DENIED_IOCTLS",
    "WORKDIR",
    "Limits",
    "NamespaceBox",
    "NamespaceRuntime",
    "_alive",
    "_read_info",
    "attach",
    "box_identity",
    "ctl_dir",
    "find_bwrap",
    "keep_marker",
    "kill_box_processes",
    "limits_for",
    "mount_plan",
    "parse_user",
    "plan_limits",
    "preflight",
    "private_tmp",
    "read_private",
    "remove_box_dirs",
    "seccomp_program_fd",
    "seccomp_status",
    "userns_problem",
]
