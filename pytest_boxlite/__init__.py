"""pytest-boxlite: run tests, and the processes they start, inside throw-away boxes.

The public API: the :class:`Sandbox` a box is driven through, the :class:`BoxlitePool` of the
``boxlite_pool`` fixture and the :class:`Lease` it hands out, :class:`BoxSpec`, and the errors
(every one a :class:`BoxliteError`), and service fixtures: :func:`service` with its readiness
checks (:class:`PortReady`, :class:`OutputReady`, :class:`HttpReady`, :class:`CommandReady`) and
the :class:`Service` a test gets.

PYTEST_DONT_REWRITE: a box's pytest finds this package imported already (the box's bootstrap
imports the guest code from it first), and pytest warns of every such package it would have
rewritten: a warning that ``filterwarnings = error`` makes fatal to every boxed test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_boxlite.errors import (
    BoxDeadError,
    BoxFileExistsError,
    BoxFileNotFoundError,
    BoxIsADirectoryError,
    BoxliteError,
    BoxNotADirectoryError,
    BoxPermissionError,
    BoxStartError,
    BoxTimeoutError,
    CommandError,
    ConfigError,
    GuestToolError,
    InvalidPathError,
    LeaseTimeoutError,
    RuntimeUnavailableError,
    SandboxFileError,
)
from pytest_boxlite.spec import BoxSpec

if TYPE_CHECKING:
    from pytest_boxlite.fixtures import BoxlitePool
    from pytest_boxlite.pool import Lease, PoolStats
    from pytest_boxlite.sandbox import ExecResult, GrepMatch, Sandbox, SearchResult
    from pytest_boxlite.services import (
        CommandReady,
        HttpReady,
        OutputReady,
        PortReady,
        Ready,
        Service,
        ServiceStartError,
        service,
    )

    __version__: str

#: Names imported on first use: importing the package must not import pytest (the fixtures do),
#: so that ``python -m pytest_boxlite.boxproc``, which starts every --boxlite-scope=worker xdist
#: worker, starts in a fraction of the time.
_LAZY = {
    "BoxlitePool": "pytest_boxlite.fixtures",
    "Lease": "pytest_boxlite.pool",
    "PoolStats": "pytest_boxlite.pool",
    "ExecResult": "pytest_boxlite.sandbox",
    "GrepMatch": "pytest_boxlite.sandbox",
    "Sandbox": "pytest_boxlite.sandbox",
    "SearchResult": "pytest_boxlite.sandbox",
    "service": "pytest_boxlite.services",
    "Service": "pytest_boxlite.services",
    "ServiceStartError": "pytest_boxlite.services",
    "Ready": "pytest_boxlite.services",
    "PortReady": "pytest_boxlite.services",
    "OutputReady": "pytest_boxlite.services",
    "HttpReady": "pytest_boxlite.services",
    "CommandReady": "pytest_boxlite.services",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        import importlib.metadata

        try:
            version = importlib.metadata.version("pytest-boxlite")
        except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
            version = "0+unknown"
        globals()["__version__"] = version
        return version
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BoxDeadError",
    "BoxFileExistsError",
    "BoxFileNotFoundError",
    "BoxIsADirectoryError",
    "BoxNotADirectoryError",
    "BoxPermissionError",
    "BoxSpec",
    "BoxStartError",
    "BoxTimeoutError",
    "BoxliteError",
    "BoxlitePool",
    "CommandError",
    "CommandReady",
    "ConfigError",
    "ExecResult",
    "GrepMatch",
    "GuestToolError",
    "HttpReady",
    "InvalidPathError",
    "Lease",
    "LeaseTimeoutError",
    "OutputReady",
    "PoolStats",
    "PortReady",
    "Ready",
    "RuntimeUnavailableError",
    "Sandbox",
    "SandboxFileError",
    "SearchResult",
    "Service",
    "ServiceStartError",
    "__version__",
    "service",
]
