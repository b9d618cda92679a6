"""What execnet ships to a warm box (``remote_exec``), as pytest-xdist ships its ``remote.py``.

A few lines, standard library only: take the host's first message, work where the host works with
the host's ``sys.path`` (the box sees the plugin's directory, the project and its packages at the
same paths), then import :mod:`pytest_boxlite.guest.worker` from there and serve.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def main(channel: Any) -> None:
    """Serve the host at the other end of ``channel`` (see :func:`pytest_boxlite.guest.worker.serve`)."""
    cfg = channel.receive()
    prepare(cfg)
    from pytest_boxlite.guest.worker import serve

    serve(channel, cfg)


def prepare(cfg: dict[str, Any]) -> None:
    """Work where the host works, importing what it imports (``cfg``: the host's first message)."""
    os.chdir(cfg["cwd"])
    sys.path[:] = cfg["sys_path"]
    if cfg.get("prefix") not in (None, sys.prefix):
        # Another interpreter than the host's (a VM image's): it never read the host environment's
        # .pth files (editable installs' import hooks), so read them now.
        import site

        for entry in list(cfg["sys_path"]):
            if entry.endswith(("site-packages", "dist-packages")) and os.path.isdir(entry):
                site.addsitedir(entry)


if __name__ == "__channelexec__":
    main(globals()["channel"])  # execnet's name for the host's end, in this module's namespace
