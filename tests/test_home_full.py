"""A full ``--boxlite-home`` is a usage error naming the path (a real full file system: a tiny tmpfs)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def full_home(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs to fill needs root and mount(8)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mnt)], capture_output=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode(errors='replace').strip()}")
    try:
        with open(mnt / "filler", "wb", buffering=0) as fh, pytest.raises(OSError):
            while True:  # until ENOSPC
                fh.write(b"\0" * 4096)
        yield mnt / "bxh"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_full_home_is_a_usage_error_naming_it(pytester: pytest.Pytester, full_home: Path) -> None:
    pytester.makepyfile("import pytest\n\n@pytest.mark.boxlite\ndef test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--boxlite-home={full_home}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    err = result.stderr.str() + result.stdout.str()
    assert str(full_home) in err and "not usable" in err, err
    assert "INTERNALERROR" not in err and "Traceback" not in err, err
