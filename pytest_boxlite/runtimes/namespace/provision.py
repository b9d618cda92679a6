"""Provisioned templates of the namespace runtime (``--boxlite-setup``).

The setup runs once in a box whose writes are kept in a template directory (see
:func:`templates_dir`); later boxes stack those layers over the host's (still copy-on-write), so
``pip install -e .`` costs nothing per box.  Templates are kept across sessions until the host's
/tmp is cleared or ``python -m pytest_boxlite clean --templates`` drops them.  A build is
serialized by a file lock, so concurrent sessions and xdist workers build a template once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import stat
import sys
import time
from pathlib import Path
from typing import Protocol

from pytest_boxlite.errors import BoxliteError, BoxStartError
from pytest_boxlite.runtimes.base import BoxHandle
from pytest_boxlite.runtimes.namespace.layout import private_tmp
from pytest_boxlite.spec import BoxSpec


class TemplateBuilder(Protocol):
    """What building a template needs of the runtime: a box whose writes are kept (``persist``)."""

    def create_box(self, spec: BoxSpec, name: str, *, timeout: float, persist: Path | None = None) -> BoxHandle:
        """Create and start a box; with ``persist``, its writes are kept in that directory."""
        ...


def templates_dir(home: Path) -> Path:
    """Where templates of ``home`` live: under the host's ``/tmp``, never under a box's overlays.

    A template's layers are stacked over the host's directories; overlayfs refuses a lower layer
    that lies inside another one, and ``/tmp`` is the one host directory boxes never overlay (they
    get a private one).  So templates survive across sessions, until the host's /tmp is cleared.
    """
    tag = hashlib.sha256(str(Path(home).resolve()).encode()).hexdigest()[:10]
    # private_tmp() checks that the directory is this user's own, never another user's or a link.
    return private_tmp() / tag / "templates"


def remove_tree(path: Path) -> None:
    """Remove a template's tree, whatever modes its directories have; raises ``OSError`` if it cannot.

    A box's writes keep their modes in the upper layers, and overlayfs leaves its work
    directories at mode 000 (``d---------``): a plain ``rmtree`` by an ordinary user cannot list
    them.  Every directory is made the owner's own first, through directory descriptors and
    never through a link (a link the guest planted is removed, not followed).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    # Each chmod may fail (a directory of another user's: rmtree then says what it could not remove).
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    for _, dirnames, _, dirfd in os.fwalk(path, follow_symlinks=False):
        for name in dirnames:
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.lstat(name, dir_fd=dirfd).st_mode):
                    os.chmod(name, 0o700, dir_fd=dirfd)
    shutil.rmtree(path)


def ensure_template(
    runtime: TemplateBuilder, spec: BoxSpec, setup: str, *, key: str, home: Path, cwd: Path, timeout: float, name: str
) -> BoxSpec:
    """Build the template ``key`` of ``spec`` + ``setup`` unless a finished one exists; return the spec using it."""
    root = templates_dir(home) / key
    done = root / "ready.json"
    if done.exists():
        return dataclasses.replace(spec, template=str(root))
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be building this very template
        if not done.exists():
            _build(runtime, spec, setup, root, name, cwd, timeout)
    return dataclasses.replace(spec, template=str(root))


def _build(
    runtime: TemplateBuilder, spec: BoxSpec, setup: str, root: Path, name: str, cwd: Path, timeout: float
) -> None:
    """Run ``setup`` in a box (named ``name``: one of the session's) whose writes land in ``root``."""
    remove_tree(root)  # what a build that did not finish left
    started = time.monotonic()
    box = runtime.create_box(dataclasses.replace(spec, warm=False, template=None), name, timeout=timeout, persist=root)
    try:
        raw = box.exec(["/bin/sh", "-c", setup], cwd=str(cwd), timeout=timeout)
    finally:
        box.destroy()
    if raw.exit_code != 0 or raw.timed_out:
        out = (raw.stdout + raw.stderr).decode("utf-8", "replace")[-3000:]
        with contextlib.suppress(OSError):  # the build's own error is the one to raise
            remove_tree(root)
        what = "timed out" if raw.timed_out else f"exited with status {raw.exit_code}"
        raise BoxStartError(f"--boxlite-setup {setup!r} {what} in the template box:\n{out}")
    # Overlay work directories are scratch space; only the upper layers are the template.
    remove_tree(root / "work")
    info = {
        "setup": setup,
        "spec": spec.describe(),
        "cwd": str(cwd),
        "python": sys.prefix,
        "built": time.time(),
        "seconds": time.monotonic() - started,
    }
    (root / "ready.json").write_text(json.dumps(info))


@dataclasses.dataclass(frozen=True)
class TemplateInfo:
    """One template of a home, as ``ls`` shows it and ``clean --templates`` removes it."""

    key: str
    ready: bool
    setup: str = ""
    cwd: str = ""
    python: str = ""
    built: float = 0.0

    def describe(self) -> str:
        """``ls``'s line: the key, whether it is complete, the command and where it ran."""
        if not self.ready:
            return f"template {self.key} namespace incomplete (a build that did not finish)"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.built)) if self.built else "?"
        return f"template {self.key} namespace built {when} setup={self.setup!r} cwd={self.cwd} python={self.python}"


#: Bound on a template's record (the host writes it; a few hundred bytes).
_MAX_RECORD = 64 * 1024


def list_templates(home: Path) -> list[TemplateInfo]:
    """Every template directory of ``home`` (complete or not): what ``clean --templates`` removes."""
    base = templates_dir(home)
    found: list[TemplateInfo] = []
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return found
    for d in entries:
        if d.is_symlink() or not d.is_dir():
            continue
        try:
            with open(d / "ready.json", "rb") as fh:
                info = json.loads(fh.read(_MAX_RECORD))
        except (OSError, ValueError):
            found.append(TemplateInfo(d.name, ready=False))
            continue
        info = info if isinstance(info, dict) else {}
        found.append(
            TemplateInfo(
                d.name,
                ready=True,
                setup=str(info.get("setup", "")),
                cwd=str(info.get("cwd", "")),
                python=str(info.get("python", "")),
                built=float(info["built"]) if isinstance(info.get("built"), (int, float)) else 0.0,
            )
        )
    return found


def drop_templates(home: Path) -> list[str]:
    """Remove every template of ``home`` that :func:`list_templates` lists (``clean --templates``).

    Returns their keys; raises :class:`BoxliteError` naming each one that could not be removed
    (after removing the rest).
    """
    base = templates_dir(home)
    dropped: list[str] = []
    failed: list[str] = []
    for t in list_templates(home):
        try:
            remove_tree(base / t.key)
            dropped.append(t.key)
        except OSError as exc:
            failed.append(f"{base / t.key} ({exc.strerror or exc})")
    for lock in base.glob("*.lock") if base.is_dir() else ():
        with contextlib.suppress(OSError):
            lock.unlink()
    if failed:
        done = f"; dropped {', '.join(dropped)}" if dropped else ""
        raise BoxliteError(f"could not remove template(s) {', '.join(failed)}{done}")
    return dropped
