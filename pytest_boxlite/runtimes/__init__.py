"""Runtimes: the micro-VM (``vm``) and the namespace sandbox (``namespace``), and how one is chosen."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_boxlite.errors import ConfigError, RuntimeUnavailableError
from pytest_boxlite.runtimes._homes import register_home
from pytest_boxlite.runtimes.base import (
    BoxDefaults,
    BoxHandle,
    BoxRecord,
    Capabilities,
    Leftover,
    Owners,
    RawResult,
    Runtime,
    RuntimeDefaults,
    RuntimeKind,
)
from pytest_boxlite.runtimes.probe import Probe, probe
from pytest_boxlite.spec import BoxSpec

if TYPE_CHECKING:
    from pytest_boxlite.runtimes.rest import RemoteTarget

__all__ = [
    "LOCAL_KINDS",
    "RUNTIME_CHOICES",
    "BoxDefaults",
    "BoxHandle",
    "BoxRecord",
    "Capabilities",
    "Choice",
    "Leftover",
    "Owners",
    "Probe",
    "RawResult",
    "Runtime",
    "RuntimeDefaults",
    "RuntimeKind",
    "choose",
    "kind",
    "kinds",
    "kinds_with_state",
    "open_choice",
    "open_runtime",
    "probe",
    "register_home",
    "remote_boxes",
    "remote_clean",
    "remote_target",
    "vm_unavailable",
]

RUNTIME_CHOICES = ("auto", "vm", "namespace")
#: The runtimes that run boxes on this host, in the order ``doctor`` shows them.
LOCAL_KINDS = ("vm", "namespace")


def kind(name: str) -> RuntimeKind:
    """The host-side operations of runtime kind ``name`` (nothing is opened or booted)."""
    if name == "namespace":
        from pytest_boxlite.runtimes.namespace.kind import KIND as namespace_kind

        return namespace_kind
    if name == "vm":
        from pytest_boxlite.runtimes.vm import KIND as vm_kind

        return vm_kind
    raise ConfigError(f"unknown runtime {name!r}; choose one of {', '.join(LOCAL_KINDS)}")


def kinds() -> list[RuntimeKind]:
    """Every local runtime kind, whether or not it works on this host."""
    return [kind(name) for name in LOCAL_KINDS]


def kinds_with_state(home: Path) -> list[RuntimeKind]:
    """The local runtime kinds that have anything under ``home``: each keeps its boxes in
    ``home/<kind name>`` (see ``vm_homes`` and the namespace kind's ``state_dir``), which a clean
    session leaves empty.  A kind with nothing there is not even imported: the vm kind's module and
    asyncio cost a session's start about 60 ms, on the path to its first box, and the namespace
    kind's about 10 ms of every run with the plugin installed, boxes or none."""
    return [kind(name) for name in LOCAL_KINDS if _has_entries(Path(home) / name)]


def _has_entries(directory: Path) -> bool:
    try:
        with os.scandir(directory) as entries:
            return next(entries, None) is not None
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True  # unreadable: the kind itself says what is wrong, as it did before


@dataclasses.dataclass(frozen=True)
class Choice:
    """Which runtime a session uses, and the one-line reason shown in the report header."""

    kind: str
    reason: str
    #: The runtime to use instead when ``kind`` cannot open after all (``auto`` only).
    fallback: str | None = None
    #: The remote BoxLite server boxes run on (``--boxlite-url``); ``None``: this host.
    remote: RemoteTarget | None = None

    @property
    def capabilities(self) -> Capabilities:
        """What the chosen runtime can do (known before it opens: the session plans with it)."""
        return kind(self.kind).capabilities


def remote_target(
    url: str | None, *, credential_file: str | None, max_boxes: int, environ: Mapping[str, str] | None = None
) -> RemoteTarget | None:
    """The checked ``--boxlite-url`` target with its key, or ``None`` without a URL."""
    if url is None:
        return None
    from pytest_boxlite.runtimes.rest import remote_target as make

    return make(url, credential_file=credential_file, max_boxes=max_boxes, environ=environ)


def remote_boxes(target: RemoteTarget, home: Path) -> list[tuple[BoxRecord, str | None]]:
    """Every box on the remote server, with the owner its name carries (``None``: not ours)."""
    from pytest_boxlite.runtimes.rest import server_boxes

    return server_boxes(target, home)


def remote_clean(target: RemoteTarget, home: Path, names: list[str]) -> list[str]:
    """Remove ``names`` from the remote server, or (none named) every box of ours whose lease lapsed."""
    from pytest_boxlite.runtimes.rest import clean_server

    return clean_server(target, home, names)


def choose(requested: str, remote: RemoteTarget | None = None) -> Choice:
    """Resolve ``auto``/``vm``/``namespace`` against the host probe (milliseconds, cached).

    With a ``remote`` server, boxes are micro-VMs there whatever this host can boot.
    """
    if requested not in RUNTIME_CHOICES:
        raise ConfigError(f"unknown runtime {requested!r}; choose one of {', '.join(RUNTIME_CHOICES)}")
    if remote is not None:
        if requested == "namespace":
            raise ConfigError(
                "--boxlite-url runs the boxes as micro-VMs on a remote BoxLite server: it cannot be combined "
                "with --boxlite-runtime=namespace (drop one of them)"
            )
        return Choice("vm", remote.reason, remote=remote)
    p = probe()
    if requested == "namespace":
        return Choice("namespace", "requested")
    if requested == "vm":
        if not p.vm_ok:
            raise RuntimeUnavailableError(vm_unavailable(p.reason))
        return Choice("vm", p.reason)
    if p.vm_ok:
        return Choice("vm", p.reason, fallback="namespace")
    return Choice("namespace", p.reason)


def vm_unavailable(reason: str, asked: str = "runtime=vm was requested") -> str:
    """Why a micro-VM (``asked`` for) cannot run here, and the ways forward."""
    why = reason if "cannot boot" in reason else f"this host cannot boot a micro-VM: {reason}"
    return (
        f"{asked}, but {why}. Ways forward: run on a "
        "host with working KVM (bare metal, or nested virtualization that boots guests: `python -m "
        "pytest_boxlite doctor` says what this one lacks); or --boxlite-url to run the boxes on a remote "
        "BoxLite server; or --boxlite-runtime=auto (the default) or namespace for Linux namespace boxes "
        "here, which share the host's kernel"
    )


def kind_notes(kind: str) -> tuple[str | None, str | None]:
    """What the report says of runtime ``kind``: ``(isolation caveat, why images are unused)``.

    Kept here so that code outside ``runtimes/`` never branches on a runtime's name.  No runtime
    leaves an image it is asked for unused now (namespace boxes are on the image's root
    filesystem when one is named: :func:`images_on_request`); the second part stays ``None``.
    """
    if kind == "namespace":
        return "namespace isolation shares the host kernel, weaker than a VM", None
    return None, None


def images_on_request(kind: str) -> bool:
    """Whether runtime ``kind`` boxes on the host's files unless an image is named explicitly
    (namespace), and then on the image's root filesystem from the local image store (the session
    resolves it: ``BoxSpec.root``).  The vm runtime always boots ``spec.image`` itself."""
    return kind == "namespace"


def image_problem(kind: str, spec: BoxSpec) -> str | None:
    """Why a box of ``spec`` (its ``root`` resolved) cannot work on runtime ``kind`` (boxed tests:
    the image cannot run the host's interpreter), with the fix; else ``None``."""
    if kind != "namespace" or spec.root is None or not spec.warm:
        return None
    import os
    import sys

    from pytest_boxlite.runtimes.namespace.image import interpreter_mounts, interpreter_problem

    dirs, _ = interpreter_mounts()
    why = interpreter_problem(spec.root, [*spec.mounts, *dirs])
    if why is None:
        return None
    libc = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else None
    need = "an image with the host's C library"
    if libc:
        need = f"an image with {libc.replace('glibc ', 'glibc >= ')} (the host's)"
    return (
        f"image {spec.root.reference} cannot run {os.path.realpath(sys.executable)} (the interpreter of boxed tests, "
        f"which runs on the image's own C library): {why}; use {need}, or run the test on the host and "
        "give it a boxlite_pool.sandbox(image=...) for the commands that need the image"
    )


def user_problem(kind: str, user: str | int) -> str | None:
    """Why ``user=`` (a marker's or a sandbox's) names nobody a box of runtime ``kind`` can run as,
    with the fix; else ``None``.  Asked before any box is made (a vm's guest resolves names itself)."""
    if kind != "namespace":
        return None
    from pytest_boxlite.runtimes.namespace.privileges import parse_user

    try:
        parse_user(user, (0, 0))
    except ConfigError as exc:
        return f"{exc}: give a user or group listed there, or numeric ids ('uid[:gid]')"
    return None


def preflight(kind: str) -> str | None:
    """Why boxes of runtime ``kind`` cannot work on this host (with the fix), or ``None``.

    For a usage error before any test runs, instead of a failure per test.
    """
    if kind == "namespace":
        from pytest_boxlite.runtimes import namespace

        return namespace.preflight()
    return None


def header_notes(kind: str, spec: BoxSpec) -> list[str]:
    """Report-header lines about what runtime ``kind`` enforces here: the seccomp filter, and a
    line only when one of ``spec``'s caps cannot hold."""
    if kind != "namespace":
        return []
    from pytest_boxlite import guest
    from pytest_boxlite.runtimes import namespace

    lines = [f"boxlite: seccomp: {namespace.seccomp_status()}", f"boxlite: pid 1: {guest.pid1_line()}"]
    limits = namespace.limits_for(spec).header_line()
    if limits:
        lines.append(limits)
    return lines


def open_choice(choice: Choice, home: Path, owner: str) -> tuple[Runtime, Choice]:
    """Open the chosen runtime; under ``auto``, fall back to namespace when the VM runtime cannot open.

    The probe answers in milliseconds from the host's state; opening BoxLite can still fail (its
    own KVM check, a broken install).  Returns the runtime and the choice that holds, whose reason
    says why the fallback happened.
    """
    if choice.remote is not None:
        from pytest_boxlite.runtimes.rest import open_remote

        return open_remote(choice.remote, home, owner), choice
    try:
        return open_runtime(choice.kind, home, owner), choice
    except RuntimeUnavailableError as exc:
        if choice.fallback is None:
            raise
        reason = f"the {choice.kind} runtime could not open ({exc}); using {choice.fallback}"
        return open_runtime(choice.fallback, home, owner), Choice(choice.fallback, reason)


def open_runtime(kind: str, home: Path, owner: str) -> Runtime:
    """Open runtime ``kind`` on ``home`` for the process identified by ``owner``.

    BoxLite allows one runtime per home directory per process, so the vm
    runtime gets a home of its own per owner (``<home>/vm/<owner>``), with the
    image store shared through a symlink.
    """
    if kind == "namespace":
        from pytest_boxlite.runtimes.namespace import NamespaceRuntime

        return NamespaceRuntime(home)
    if kind == "vm":
        from pytest_boxlite.runtimes.vm import VmRuntime, prepare_home

        return VmRuntime(prepare_home(home, owner))
    raise ConfigError(f"unknown runtime {kind!r}; choose vm or namespace")
