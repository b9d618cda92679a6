"""pytest-boxlite: run tests, and the processes they start, inside throw-away boxes."""

from __future__ import annotations

from pytest_boxlite.sandbox import ExecResult, GrepMatch, Sandbox, SearchResult
from pytest_boxlite.spec import BoxSpec

__version__ = "0.1.0"
__all__ = ["BoxSpec", "ExecResult", "GrepMatch", "Sandbox", "SearchResult", "__version__"]
