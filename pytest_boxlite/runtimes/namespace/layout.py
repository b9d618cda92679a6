"""A box's directories on the host: what the guest sees, the host's private control directory,
the keep mark, and bounded, link-refusing reads and writes of the private files."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat as _stat
from pathlib import Path
from typing import Any

from pytest_boxlite._homefs import HomeDir, read_at_most
from pytest_boxlite.errors import BoxStartError

GUEST_CTL = "/run/pytest-boxlite"
WORKDIR = "/workspace"
#: Bound on what the host reads back from a box's control files.
_MAX_INFO = 64 * 1024


def keep_marker(box_dir: Path) -> Path:
    """Where the host marks a box as kept: next to its directory, never inside it."""
    return box_dir.with_name(box_dir.name + ".keep")


def ctl_dir(box_dir: Path) -> Path:
    """A box's private control directory (agent socket, log, info): the host's alone, never in the box."""
    return box_dir.with_name(box_dir.name + ".ctl")


def read_private(path: Path, limit: int) -> bytes:
    """Read at most ``limit`` bytes of a regular file without following a link to it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        import stat as _stat

        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(22, "not a regular file", str(path))
        return read_at_most(fd, limit)
    finally:
        os.close(fd)


def _read_info(box_dir: Path) -> dict[str, Any]:
    """The host's record of a box (pids and their start times), from its private directory."""
    # Through the state directory's descriptor: a control directory, or a record, that is a link
    # or another user's is refused, never followed.
    try:
        with HomeDir.open(box_dir.parent) as state:
            info = json.loads(state.read(f"{ctl_dir(box_dir).name}/info.json", _MAX_INFO))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _write_private(path: Path, data: bytes) -> None:
    """Create a host-private file atomically (a reader never sees half of it), never through a link."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _bind(sock: socket.socket, path: Path) -> None:
    """Bind a Unix socket at ``path``, reaching long paths through a directory descriptor."""
    target = str(path)
    if len(target.encode()) <= 100:
        sock.bind(target)
        return
    dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sock.bind(f"/proc/self/fd/{dirfd}/{path.name}")
    finally:
        os.close(dirfd)


def private_tmp() -> Path:
    """``/tmp/pytest-boxlite-<uid>``: this user's own directory on the host's /tmp (checked, never a link).

    Layers stacked over the host's directories (templates, masks) live here: overlayfs refuses a
    layer inside another one, and /tmp is the one host directory boxes never overlay.
    """
    base = Path("/tmp") / f"pytest-boxlite-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(base, 0o700)
    st = os.lstat(base)
    if not _stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise BoxStartError(f"{base} is not a directory owned by uid {os.getuid()}; remove it and retry")
    if st.st_mode & 0o077:
        os.chmod(base, 0o700)
    return base
