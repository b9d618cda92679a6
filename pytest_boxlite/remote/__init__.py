"""Boxed tests on the host side: warm interpreters in boxes and the protocol that runs items there.

Each step of a boxed item's run has one owner, and the executor calls each once, in order:

- :mod:`.executor`: which box runs an item (per test forked, per test leased, per module); it
  drives lease -> start the run -> drain -> end the box -> report -> log (:class:`BoxedExecutor`).
- :mod:`.worker_host`: starting warm interpreters over execnet, starting a run in one or in a fork
  of one, and ending it: killing, reaping and how its process ended (:class:`RemoteRunner`).
- :mod:`.transport`: the two message streams (execnet channel, forked box's socket) and the one
  loop that reads either, defensively and within its bounds (``drain``).
- :mod:`.reports`: the reports the host makes itself from what the drain and the end found
  (``finish``).

The guest end is :mod:`pytest_boxlite.guest.worker`; the vocabulary is :mod:`pytest_boxlite.guest.messages`.
"""

from __future__ import annotations

from pytest_boxlite.remote.executor import BoxedExecutor
from pytest_boxlite.remote.worker_host import RemoteRunner, guest_args, worker_mounts

__all__ = ["BoxedExecutor", "RemoteRunner", "guest_args", "worker_mounts"]
