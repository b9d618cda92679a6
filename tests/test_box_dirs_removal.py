"""A box's directories are removed whatever modes the box left, or the failure is raised.

It was ``rmtree(ignore_errors=True)``: a directory it could not remove (an ordinary user's
overlayfs work directory at mode 000, a file a dying process wrote meanwhile) stayed behind as a
leaked box in the ledger, and nothing said why (the CI's ordinary-user job once failed on one).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_boxlite.runtimes.namespace import leftovers, provision
from pytest_boxlite.runtimes.namespace.layout import ctl_dir, keep_marker


def _box(tmp_path: Path) -> Path:
    box_dir = tmp_path / "namespace" / "pbx-x-1"
    work = box_dir / "upper" / "work" / "work"
    work.mkdir(parents=True)
    (work / "#copyup").write_text("half a copy-up")
    # What overlayfs leaves (d---------), and a directory a guest made read-only.
    os.chmod(work, 0)
    ro = box_dir / "upper" / "data" / "ro"
    ro.mkdir(parents=True)
    (ro / "f").write_text("x")
    os.chmod(ro, 0o500)
    ctl_dir(box_dir).mkdir()
    keep_marker(box_dir).write_text("")
    return box_dir


def test_a_box_left_with_mode_000_and_read_only_directories_is_removed(tmp_path: Path) -> None:
    box_dir = _box(tmp_path)
    leftovers.remove_box_dirs(box_dir)
    assert not box_dir.exists() and not ctl_dir(box_dir).exists() and not keep_marker(box_dir).exists()


def test_a_box_that_cannot_be_removed_is_an_error_that_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fake for the fault (a directory the host cannot remove is not something to make on demand
    # as root): the first tries fail as a late writer would make them, the last one too.
    box_dir = _box(tmp_path)
    tries: list[Path] = []

    def failing(path: Path) -> None:
        tries.append(path)
        raise OSError(39, "Directory not empty", str(path))

    monkeypatch.setattr(leftovers, "remove_tree", failing)
    monkeypatch.setattr(leftovers, "_REMOVE_RETRIES", (0.0, 0.0))
    with pytest.raises(OSError, match=r"could not remove the directories of box pbx-x-1 .*Directory not empty"):
        leftovers.remove_box_dirs(box_dir)
    assert len(tries) == 3


def test_a_late_failure_that_clears_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    box_dir = _box(tmp_path)
    real = provision.remove_tree
    failures = [OSError(39, "Directory not empty")]

    def once_failing(path: Path) -> None:
        if failures:
            raise failures.pop()
        real(path)

    monkeypatch.setattr(leftovers, "remove_tree", once_failing)
    monkeypatch.setattr(leftovers, "_REMOVE_RETRIES", (0.0,))
    leftovers.remove_box_dirs(box_dir)
    assert not box_dir.exists()
