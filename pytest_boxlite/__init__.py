"""pytest-boxlite: run tests, and the processes they start, inside throw-away boxes.

The public API: the :class:`Sandbox` a box is driven through, the :class:`BoxlitePool` of the
``boxlite_pool`` fixture and the :class:`Lease` it hands out, :class:`BoxSpec`, and the errors
(every one a :class:`BoxliteError`).
"""

from __future__ import annotations

import importlib.metadata

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
from pytest_boxlite.fixtures import BoxlitePool
from pytest_boxlite.pool import Lease, PoolStats
from pytest_boxlite.sandbox import ExecResult, GrepMatch, Sandbox, SearchResult
from pytest_boxlite.spec import BoxSpec

try:
    __version__ = importlib.metadata.version("pytest-boxlite")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

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
    "ConfigError",
    "ExecResult",
    "GrepMatch",
    "GuestToolError",
    "InvalidPathError",
    "Lease",
    "LeaseTimeoutError",
    "PoolStats",
    "RuntimeUnavailableError",
    "Sandbox",
    "SandboxFileError",
    "SearchResult",
    "__version__",
]
