"""Removing directories the host made for its own use (sockets, logs, staging), saying so when it cannot.

These hold nothing a later run needs, so a failure to remove one does not fail the run; but it is
never hidden either: a directory left behind is named, with the reason, as a ``RuntimeWarning``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from pytest_boxlite._homefs import remove_path


def remove_own_dir(path: str | Path, what: str) -> bool:
    """Remove ``path`` (a directory this process made); warn naming ``what`` if it cannot.

    Returns whether the directory is gone.  It is removed by directory descriptors
    (:func:`pytest_boxlite._homefs.remove_path`): links inside are removed, never followed, the
    walk never leaves the tree, and directories a box left at mode 000 are made removable first.
    """
    try:
        remove_path(path)
    except FileNotFoundError:
        return True
    except OSError as exc:
        warnings.warn(
            f"pytest-boxlite: could not remove {what} {path}: {exc}; nothing depends on it, remove it by hand",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True
