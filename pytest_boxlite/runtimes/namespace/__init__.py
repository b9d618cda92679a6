"""The ``namespace`` runtime: throw-away machines made of Linux namespaces.

How it works, and why: ``docs/explanation/internals/namespace-runtime.md``.
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
