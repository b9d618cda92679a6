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
import shutil
import time
from pathlib import Path
from typing import Protocol

from pytest_boxlite.errors import BoxStartError
from pytest_boxlite.runtimes.base import BoxHandle
from pytest_boxlite.runtimes.namespace.mounts import private_tmp
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
    shutil.rmtree(root, ignore_errors=True)
    started = time.monotonic()
    box = runtime.create_box(
        dataclasses.replace(spec, worker=False, template=None), name, timeout=timeout, persist=root
    )
    try:
        raw = box.exec(["/bin/sh", "-c", setup], cwd=str(cwd), timeout=timeout)
    finally:
        box.destroy()
    if raw.exit_code != 0 or raw.timed_out:
        out = (raw.stdout + raw.stderr).decode("utf-8", "replace")[-3000:]
        shutil.rmtree(root, ignore_errors=True)
        what = "timed out" if raw.timed_out else f"exited with status {raw.exit_code}"
        raise BoxStartError(f"--boxlite-setup {setup!r} {what} in the template box:\n{out}")
    # Overlay work directories are scratch space; only the upper layers are the template.
    shutil.rmtree(root / "work", ignore_errors=True)
    info = {"setup": setup, "spec": spec.describe(), "built": time.time(), "seconds": time.monotonic() - started}
    (root / "ready.json").write_text(json.dumps(info))


def drop_templates(home: Path) -> list[str]:
    """Remove every cached template of ``home`` (``clean --templates``).  Returns their keys."""
    base = templates_dir(home)
    if not base.is_dir():
        return []
    dropped = []
    for d in sorted(p for p in base.iterdir() if p.is_dir()):
        with contextlib.suppress(OSError):
            shutil.rmtree(d)
            dropped.append(d.name)
    for lock in base.glob("*.lock"):
        with contextlib.suppress(OSError):
            lock.unlink()
    return dropped
