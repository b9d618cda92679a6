"""Provisioned templates: ``--boxlite-setup`` runs once per box spec, and boxes start from its result.

The key hashes the spec, the setup command and the contents of every file the command names
(``pyproject.toml``, ``requirements.txt``...), so a changed input builds a new template.  Each
runtime provisions its own way (``Runtime.provision``): the namespace runtime keeps the writes of
a box that ran the setup as layers later boxes stack over the host's; the vm runtime exports a
set-up box and clones every box from it; a runtime that makes no template (a remote server)
leaves the setup to each box, which runs it once when it boots, before it enters the pool.
Templates are kept across sessions; ``python -m pytest_boxlite clean --templates`` drops them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
from pathlib import Path

from pytest_boxlite.runtimes import Runtime, kinds
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


def ensure_template(
    runtime: Runtime, spec: BoxSpec, setup: str, *, home: Path, cwd: Path, timeout: float, name: str
) -> BoxSpec:
    """The spec whose boxes start with ``setup`` done, from ``runtime`` (see ``Runtime.provision``)."""
    key = template_key(spec, setup, cwd)
    return runtime.provision(spec, setup, key=key, home=home, cwd=cwd, timeout=timeout, name=name)


def drop_templates(home: Path) -> list[str]:
    """Remove every cached template of ``home``, of every runtime (``clean --templates``).  Returns their keys."""
    return [key for k in kinds() for key in k.drop_templates(home)]
