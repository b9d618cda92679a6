"""Provisioned templates: ``--boxlite-setup`` runs once per box spec, and boxes start from its result.

On the namespace runtime the setup runs in a box whose writes are kept in a
template directory (see :func:`templates_dir`); later boxes stack those layers over the host's
(still copy-on-write), so ``pip install -e .`` costs nothing per box.  The key
hashes the spec, the setup command and the contents of every file the
command names (``pyproject.toml``, ``requirements.txt``...), so a changed
input builds a new template; templates are kept across sessions and
``python -m pytest_boxlite clean --templates`` drops them.  A build is
serialized by a file lock, so concurrent sessions and xdist workers build a
template once.  On the vm runtime each box runs the setup once when it boots,
in the background, before it enters the pool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import time
from pathlib import Path

from pytest_boxlite.errors import BoxStartError
from pytest_boxlite.runtimes.base import Runtime
from pytest_boxlite.spec import BoxSpec


def template_key(spec: BoxSpec, setup: str, cwd: Path) -> str:
    """Hash of what the template depends on: the spec, the command, and the files it names."""
    h = hashlib.sha256()
    identity = dataclasses.replace(spec, worker=False, mounts=(), template=None)
    h.update(repr(identity).encode())
    h.update(b"\0" + setup.encode())
    try:
        words = shlex.split(setup)
    except ValueError:
        words = setup.split()
    for word in sorted(set(words)):
        path = (cwd / word) if not os.path.isabs(word) else Path(word)
        if path.is_file():
            h.update(b"\0" + word.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def templates_dir(home: Path) -> Path:
    """Where templates of ``home`` live: under the host's ``/tmp``, never under a box's overlays.

    A template's layers are stacked over the host's directories; overlayfs refuses a lower layer
    that lies inside another one, and ``/tmp`` is the one host directory boxes never overlay (they
    get a private one).  So templates survive across sessions, until the host's /tmp is cleared.
    """
    from pytest_boxlite.runtimes.namespace import private_tmp

    tag = hashlib.sha256(str(Path(home).resolve()).encode()).hexdigest()[:10]
    # private_tmp() checks that the directory is this user's own, never another user's or a link.
    return private_tmp() / tag / "templates"


def ensure_template(
    runtime: Runtime, spec: BoxSpec, setup: str, *, home: Path, cwd: Path, timeout: float, name: str
) -> BoxSpec:
    """Build the template for ``spec`` + ``setup`` unless a finished one exists; return the spec that uses it."""
    from pytest_boxlite.runtimes.namespace import NamespaceRuntime

    key = template_key(spec, setup, cwd)
    if not isinstance(runtime, NamespaceRuntime):
        # The vm runtime builds its own kind of template (one box set up, exported, cloned per box);
        # a runtime without one (a remote server) returns the spec unchanged: setup per box at boot.
        own = getattr(runtime, "ensure_template", None)
        if own is None:
            return spec
        store = home / "vm-templates"
        result: BoxSpec = own(spec, setup, key=key, store=store, cwd=cwd, timeout=timeout)
        return result
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


def _build(runtime: Runtime, spec: BoxSpec, setup: str, root: Path, name: str, cwd: Path, timeout: float) -> None:
    """Run ``setup`` in a box (named ``name``: one of the session's) whose writes land in ``root``."""
    from pytest_boxlite.runtimes.namespace import NamespaceRuntime

    assert isinstance(runtime, NamespaceRuntime)
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
    """Remove every cached template (``clean --templates``).  Returns their keys."""
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
