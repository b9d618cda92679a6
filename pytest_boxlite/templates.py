"""Provisioned templates: ``--boxlite-setup`` runs once per box spec, and boxes start from its result.

The key hashes everything the setup's result can depend on: the spec (image included), the
command, the directory it runs in and the interpreter and virtual environment running the session
(``pip install -e .`` of one project must not start another's boxes), the plugin's version (how
templates are laid), and the contents of every file the command names and of the project's
manifests (``pyproject.toml``, ``requirements.txt``...), so a changed input builds a new template.  Each
runtime provisions its own way (``Runtime.provision``): the namespace runtime keeps the writes of
a box that ran the setup as layers later boxes stack over the host's; the vm runtime exports a
set-up box and clones every box from it; a runtime that makes no template (a remote server)
leaves the setup to each box, which runs it once when it boots, before it enters the pool.
Templates are kept across sessions; ``python -m pytest_boxlite clean --templates`` drops them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import os
import shlex
import sys
from pathlib import Path
from typing import Protocol, runtime_checkable

from pytest_boxlite.runtimes import Runtime, kinds
from pytest_boxlite.spec import BoxSpec

#: Files of the setup's directory that say what an install there brings in: hashed whether or not
#: the command names them (``pip install -e .`` names none).
_MANIFESTS = (
    "pyproject.toml", "setup.py", "setup.cfg", "requirements.txt", "requirements-dev.txt", "constraints.txt",
    "poetry.lock", "uv.lock", "pdm.lock", "Pipfile.lock", "package.json", "package-lock.json", "Makefile",
)  # fmt: skip


def _plugin_version() -> str:
    try:
        return importlib.metadata.version("pytest-boxlite")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def template_key(spec: BoxSpec, setup: str, cwd: Path) -> str:
    """Hash of what the template depends on: the spec, the command, where it runs (the setup's
    directory, the session's interpreter and virtual environment), the plugin version, and the
    contents of the files it names and of the directory's manifests."""
    h = hashlib.sha256()
    identity = dataclasses.replace(spec, warm=False, mounts=(), template=None)
    h.update(repr(identity).encode())
    h.update(b"\0" + setup.encode())
    where = (os.path.realpath(cwd), os.path.realpath(sys.prefix), os.path.realpath(sys.executable))
    h.update(b"\0" + repr((where, _plugin_version())).encode())
    try:
        words = shlex.split(setup)
    except ValueError:
        words = setup.split()
    for word in sorted(set(words) | set(_MANIFESTS)):
        path = (cwd / word) if not os.path.isabs(word) else Path(word)
        with contextlib.suppress(OSError):  # a file that cannot be read is hashed as absent
            if path.is_file():
                h.update(b"\0" + word.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:16]


def ensure_template(
    runtime: Runtime, spec: BoxSpec, setup: str, *, home: Path, cwd: Path, timeout: float, name: str
) -> BoxSpec:
    """The spec whose boxes start with ``setup`` done, from ``runtime`` (see ``Runtime.provision``)."""
    key = template_key(spec, setup, cwd)
    return runtime.provision(spec, setup, key=key, home=home, cwd=cwd, timeout=timeout, name=name)


def drop_templates(home: Path) -> list[str]:
    """Remove every cached template of ``home``, of every runtime (``clean --templates``): each one
    :func:`list_templates` lists.  Returns their keys."""
    return [key for k in kinds() for key in k.drop_templates(home)]


@runtime_checkable
class _ListsTemplates(Protocol):
    def list_templates(self, home: Path) -> list[str]: ...


def list_templates(home: Path) -> list[str]:
    """One line per cached template of ``home``, of every runtime kind that can list its own (``ls``)."""
    return [line for k in kinds() if isinstance(k, _ListsTemplates) for line in k.list_templates(home)]
