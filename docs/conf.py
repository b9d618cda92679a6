"""Sphinx configuration of pytest-boxlite's documentation site.

Build it warning-free: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``
(``pip install -e '.[docs]'`` first).
"""

from __future__ import annotations

import sys
from importlib.metadata import version as _version
from pathlib import Path

# The reference extension lives beside this file.
sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "pytest-boxlite"
author = "The pytest-boxlite contributors"
copyright = "2026, The pytest-boxlite contributors"
release = _version("pytest-boxlite")
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "boxlite_reference",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
# Intersphinx inventories are fetched over the network: none is configured, so a build offline
# is the same build (and -W cannot fail on an unreachable inventory).
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}

html_theme = "furo"
# Code spans (flags, names) never broken mid-word; the reference's flag titles sized to fit.
html_static_path = ["_static"]
html_css_files = ["boxlite.css"]
html_title = f"pytest-boxlite {release}"
