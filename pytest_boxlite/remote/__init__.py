"""Boxed tests on the host side: warm interpreters in boxes and the protocol that runs items there.

Each step of a boxed item's run has one owner, and the executor calls each once, in order:

- :mod:`.executor`: which box runs an item (per test forked, per test leased, per module); it
  drives lease -> start the run -> drain -> end the box -> report -> log (:class:`BoxedExecutor`).
- :mod:`.warm`: the warm interpreters in boxes, started over execnet at boot, whose channel carries
  control messages only (:class:`WarmInterpreters`).
- :mod:`.worker_host`: starting a run in a fork of one (fresh or in place), and ending it:
  killing, reaping and how its process ended (:class:`ForkedBoxes`).
- :mod:`.transport`: the forked box's message stream (its socket) and the loop that reads it,
  defensively and within its bounds (``drain``).
- :mod:`.reports`: the reports the host makes itself from what the drain and the end found
  (``finish``).

The guest end is :mod:`pytest_boxlite.guest.worker`; the vocabulary is :mod:`pytest_boxlite.guest.messages`.
"""

from __future__ import annotations

from pytest_boxlite.remote.executor import BoxedExecutor
from pytest_boxlite.remote.warm import WarmInterpreters, guest_args, worker_mounts
from pytest_boxlite.remote.worker_host import ForkedBoxes

__all__ = ["BoxedExecutor", "ForkedBoxes", "WarmInterpreters", "guest_args", "worker_mounts"]
