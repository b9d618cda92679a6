"""Runtimes: the micro-VM (``vm``) and the namespace sandbox (``namespace``), and how one is chosen."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pytest_boxlite.errors import ConfigError, RuntimeUnavailableError
from pytest_boxlite.runtimes.base import BoxHandle, BoxRecord, RawResult, Runtime
from pytest_boxlite.runtimes.probe import Probe, probe

__all__ = [
    "RUNTIME_CHOICES",
    "BoxHandle",
    "BoxRecord",
    "Choice",
    "Probe",
    "RawResult",
    "Runtime",
    "choose",
    "open_runtime",
    "probe",
]

RUNTIME_CHOICES = ("auto", "vm", "namespace")


@dataclasses.dataclass(frozen=True)
class Choice:
    """Which runtime a session uses, and the one-line reason shown in the report header."""

    kind: str
    reason: str


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
        return Choice("vm", p.reason)
    return Choice("namespace", p.reason)


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
