"""Runtimes: the micro-VM (``vm``) and the namespace sandbox (``namespace``), and how one is chosen."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pytest_boxlite.errors import ConfigError, RuntimeUnavailableError
from pytest_boxlite.runtimes.base import BoxHandle, BoxRecord, RawResult, Runtime
from pytest_boxlite.runtimes.probe import Probe, probe
from pytest_boxlite.spec import BoxSpec

__all__ = [
    "RUNTIME_CHOICES",
    "BoxHandle",
    "BoxRecord",
    "Choice",
    "Probe",
    "RawResult",
    "Runtime",
    "choose",
    "open_choice",
    "open_runtime",
    "probe",
]

RUNTIME_CHOICES = ("auto", "vm", "namespace")


@dataclasses.dataclass(frozen=True)
class Choice:
    """Which runtime a session uses, and the one-line reason shown in the report header."""

    kind: str
    reason: str
    #: The runtime to use instead when ``kind`` cannot open after all (``auto`` only).
    fallback: str | None = None


def choose(requested: str) -> Choice:
    """Resolve ``auto``/``vm``/``namespace`` against the host probe (milliseconds, cached)."""
    if requested not in RUNTIME_CHOICES:
        raise ConfigError(f"unknown runtime {requested!r}; choose one of {', '.join(RUNTIME_CHOICES)}")
    p = probe()
    if requested == "namespace":
        return Choice("namespace", "requested")
    if requested == "vm":
        if not p.vm_ok:
            raise RuntimeUnavailableError(f"runtime=vm was requested but micro-VMs cannot boot here: {p.reason}")
        return Choice("vm", p.reason)
    if p.vm_ok:
        return Choice("vm", p.reason, fallback="namespace")
    return Choice("namespace", p.reason)


def kind_notes(kind: str) -> tuple[str | None, str | None]:
    """What the report says of runtime ``kind``: ``(isolation caveat, why images are unused)``.

    Kept here so that code outside ``runtimes/`` never branches on a runtime's name.
    """
    if kind == "namespace":
        return (
            "namespace isolation shares the host kernel, weaker than a VM",
            "namespace boxes show the host's filesystem",
        )
    return None, None


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
    from pytest_boxlite.runtimes import namespace

    lines = [f"boxlite: seccomp: {namespace.seccomp_status()}"]
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
