"""pytest-boxlite: run tests, and the processes they start, inside throw-away boxes."""

from __future__ import annotations

__version__ = "0.1.0"
