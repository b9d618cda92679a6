"""pytest-boxlite's hooks: where a feature joins a boxed test's path without editing the core.

Registered with ``pluginmanager.add_hookspecs`` in the plugin's ``pytest_addhooks``, as
pytest-xdist registers its ``newhooks``.  Implement them in any pytest plugin (a conftest, a
``-p`` module, an entry point) with their ``pytest_boxlite_`` names.  A feature whose module is
imported only where a project uses it (services: only where a conftest declares one) registers
its plugin object with :func:`join`: the plugin registers it with every pytest run of the
process as that run's plugins are registered, so no core module asks ``sys.modules`` whether
the feature was imported.

The hooks, in the order a boxed test meets them (see ``docs/reference/hooks.md``):

* host: :func:`pytest_boxlite_box_fields` (what travels with an item to its box),
  :func:`pytest_boxlite_reach` (what must be reachable in the box before the item runs),
  :func:`pytest_boxlite_box_done` (a forked box is done);
* box: :func:`pytest_boxlite_box_received` (the fields that travelled, before the item's
  fixtures are set up);
* :func:`pytest_boxlite_make_runtime` (``firstresult``): declared as the extension point for a
  runtime of a third party; the session does not call it yet (see its docstring).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pytest_boxlite.runtimes.base import Runtime

__all__ = ["BoxAccess", "enrol", "join", "joined"]


@dataclasses.dataclass(frozen=True)
class BoxAccess:
    """The box an item is about to run in, as :func:`pytest_boxlite_reach` is handed it."""

    #: The box's name (a forked box's is its warm box's name and a number).
    name: str
    #: The pid, on this host, of the first process of the box the item's interpreter was forked
    #: in (its warm box's agent); ``None`` where the runtime's boxes are not processes of this
    #: host (a VM, a remote server).
    agent: int | None
    #: A forked box's stream to the host (its test process is this socket's peer), connected
    #: and waiting for its first ``RUN``; ``None``: the item runs in the warm interpreter's own
    #: box (a booted or leased box, or the wider fixtures set up there before a fork).
    stream: socket.socket | None = None


# -- host side -----------------------------------------------------------------------------------


@pytest.hookspec()
def pytest_boxlite_box_fields(
    config: pytest.Config, item: pytest.Item | None, nodeid: str, wide_only: bool
) -> dict[str, Any] | None:
    """Fields to add to the message that starts an item in its box.

    Called for a ``RUN`` (``item`` given, ``wide_only`` false) and for a ``FORK`` (``item`` may be
    ``None`` for a box made ahead: ``nodeid`` names the test; ``wide_only`` true: only what the
    warm interpreter sets up before it forks, the fixtures wider than a function).  Return a
    JSON-able dict whose keys no other implementation uses, or ``None``; every result is merged
    into the message, whose own keys (``nodeid``, ``seq``, ...) win over a plugin's.  The box gets
    them in :func:`pytest_boxlite_box_received`.
    """


@pytest.hookspec()
def pytest_boxlite_reach(
    config: pytest.Config, box: BoxAccess, item: pytest.Item | None, nodeid: str, wide_only: bool
) -> str | None:
    """Make what the item needs reachable in ``box`` before it runs (services' addresses).

    Called before each ``RUN`` (``item`` given) and, where the warm interpreter sets wider
    fixtures up for its forks, before a ``FORK`` (``wide_only`` true, ``box.stream`` ``None``:
    the warm interpreter's own box).  Return ``None`` when done (or when a box that ended is
    found: its ``RUN`` reports that), else a sentence saying why it cannot be: the test then
    fails with it, without running.  Bound every wait.
    """


@pytest.hookspec()
def pytest_boxlite_box_done(config: pytest.Config, name: str) -> None:
    """The forked box ``name`` is done (its processes are being killed): release what
    :func:`pytest_boxlite_reach` prepared for it."""


@pytest.hookspec(firstresult=True)
def pytest_boxlite_make_runtime(config: pytest.Config, kind: str, home: Path, owner: str) -> Runtime | None:
    """Open the runtime of ``kind`` on ``home`` for ``owner`` (``firstresult``).

    Declared as the extension point for a runtime of a third party (one that implements
    :class:`pytest_boxlite.runtimes.base.Runtime`).  Not called yet: the session opens its
    runtime with ``runtimes.open_choice``, whose ``auto`` fallback and remote reconciling a hook
    result would have to keep; wiring it is a change of ``session.py``'s opener.
    """


# -- box side ------------------------------------------------------------------------------------


@pytest.hookspec()
def pytest_boxlite_box_received(config: pytest.Config, fields: dict[str, Any]) -> None:
    """In the box's pytest: the fields of a ``RUN`` or ``FORK`` (what
    :func:`pytest_boxlite_box_fields` added on the host, and the core's), before the item's
    fixtures are set up (for a ``FORK``: before the wider fixtures are).  The values came over
    the box's channel: check their types before use."""


# -- joining a run ---------------------------------------------------------------------------------

_joining: list[object] = []
_lock = threading.Lock()


def join(plugin: object) -> None:
    """Register ``plugin`` (an object with hook implementations) with every pytest run of this
    process: the runs already configured as their next plugin registers, later ones at once.
    Idempotent.  For a feature imported on demand (services join when a conftest declares one)."""
    with _lock:
        if all(p is not plugin for p in _joining):
            _joining.append(plugin)


def joined() -> list[object]:
    """The plugins :func:`join` was given, in order."""
    with _lock:
        return list(_joining)


def enrol(manager: pytest.PytestPluginManager) -> None:
    """Register with ``manager`` what joined and is not registered there yet (the plugin calls it
    as each plugin registers, and as each item is collected: a test module may declare a service)."""
    if not _joining:  # every plugin registration and collected item passes here: the common case is cheap
        return
    for plugin in joined():
        if not manager.is_registered(plugin):
            manager.register(plugin, getattr(plugin, "NAME", None))
