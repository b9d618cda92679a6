"""``remove_own_dir``: a host-made directory is removed, or the failure is said (never hidden)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_boxlite import _tidy
from pytest_boxlite._tidy import remove_own_dir


def test_removes_a_tree_and_does_not_follow_its_links(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    own = tmp_path / "own"
    (own / "sub").mkdir(parents=True)
    (own / "sub" / "f").write_text("y")
    (own / "link").symlink_to(outside, target_is_directory=True)
    assert remove_own_dir(own, "a test directory")
    assert not own.exists()
    assert (outside / "keep").read_text() == "x"


def test_a_missing_directory_is_gone_already(tmp_path: Path) -> None:
    assert remove_own_dir(tmp_path / "never-made", "a test directory")


def test_a_failure_is_warned_naming_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake (said so): root removes any real tree here, so the failure is injected.
    def refuse(path: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(_tidy, "remove_path", refuse)
    with pytest.warns(RuntimeWarning, match=r"could not remove the relay's directory .*stuck.*Permission denied"):
        assert not remove_own_dir(tmp_path / "stuck", "the relay's directory")


def test_a_directory_left_at_mode_000_is_removed(tmp_path: Path) -> None:
    own = tmp_path / "own"
    (own / "work" / "work").mkdir(parents=True)
    (own / "work" / "work" / "f").write_text("x")
    (own / "work" / "work").chmod(0)
    (own / "work").chmod(0o500)
    assert remove_own_dir(own, "a test directory")
    assert not own.exists()
