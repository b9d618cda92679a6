"""runtimes/_homes.py's registry reader: every home a user's registry names is read back, up to
its bound (a home past the bound is not hidden from boxes).  A real registry directory of real
entry files; no box."""

from __future__ import annotations

import os
from pathlib import Path

from pytest_boxlite.runtimes import _homes


def test_a_registry_of_hundreds_of_live_homes_is_read_whole(tmp_path: Path) -> None:
    registry = tmp_path / "homes.d"
    registry.mkdir()
    homes = []
    for i in range(600):
        home = tmp_path / f"home-{i}"
        home.mkdir()
        homes.append(str(home))
        (registry / _homes._entry_name(str(home))).write_text(str(home) + "\n")
    _homes._READ.pop(str(registry), None)
    found = _homes._entries(str(registry), os.getuid())
    assert sorted(found) == sorted(homes), f"{len(found)} of {len(homes)} homes read back"
