"""Boxed tests on the host side: warm interpreters in boxes and the protocol that runs items there.

- :mod:`.executor`: which box runs an item (per test forked, per test leased, per module) and
  logging its reports (:class:`BoxedExecutor`).
- :mod:`.worker_host`: starting warm interpreters over execnet, running an item in one or in a fork
  of one (:class:`RemoteRunner`).
- :mod:`.transport`: the two message streams (execnet channel, forked box's socket) and the one
  loop that reads either, defensively.
- :mod:`.reports`: reports the host makes itself and how a box's process ended.

The guest end is :mod:`pytest_boxlite.guest.worker`; the vocabulary is :mod:`pytest_boxlite.guest.messages`.
"""

from __future__ import annotations

from pytest_boxlite.remote.executor import BoxedExecutor
from pytest_boxlite.remote.worker_host import RemoteRunner, guest_args, worker_mounts

__all__ = ["BoxedExecutor", "RemoteRunner", "guest_args", "worker_mounts"]
