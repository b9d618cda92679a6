"""The host interpreter's thread switch interval while the plugin's own threads start and serve boxes.

A box boots on a thread of the host (its mount plan, bubblewrap, the execnet handshake, the warm
interpreter's configuration) while the main thread collects the session, and every one of that
thread's system calls gives the GIL up: to take it back, it waits for the main thread to drop it,
which CPython asks of a running thread only once per switch interval (5 ms by default).  A boot's
hundreds of calls then wait seconds in all (click's suite: its warm box was ready 1.3 s after the
host's collection, 0.5 s with a 0.5 ms interval, and the module-scope run took 13% less wall).

So the host runs with a short interval while its boxes are being made and served, and with the
user's own value while a test runs on the host (an unboxed test, a sandbox test under
``--boxlite``): such a test sees ``sys.getswitchinterval()`` and the thread timing it would see
without the plugin (one that an earlier host-run test set included).  A value that someone else
sets while the short one is in force (a conftest at collection) is kept from then on, and the
session ends with whatever value a run without the plugin would end with.
"""

from __future__ import annotations

import sys
import threading

__all__ = ["SwitchInterval"]

#: The interval while boxes are made (seconds).  Up to 1 ms gave click's module scope the same gain;
#: shorter only adds switches to the main thread when a box thread waits.
FAST = 0.0005


class SwitchInterval:
    """Lowers the interpreter's switch interval to :data:`FAST` (:meth:`lower`) and gives the
    value it found back (:meth:`restore`), unless the interval was changed in between."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: The value found by :meth:`lower`, while lowered.
        self._saved: float | None = None
        #: The value :meth:`lower` set (as the interpreter rounds it), while lowered.
        self._set: float | None = None

    def lowered(self) -> bool:
        """Whether the interval is this object's short one now."""
        with self._lock:
            return self._set is not None and sys.getswitchinterval() == self._set

    def lower(self) -> None:
        """Use the short interval (no change if it is already that short or shorter)."""
        with self._lock:
            if self._set is not None and sys.getswitchinterval() == self._set:
                return
            current = sys.getswitchinterval()
            if current <= FAST:
                self._saved = self._set = None
                return
            self._saved = current
            sys.setswitchinterval(FAST)
            self._set = sys.getswitchinterval()

    def restore(self) -> None:
        """Give back the interval :meth:`lower` found, if nobody changed it since."""
        with self._lock:
            saved, set_, self._saved, self._set = self._saved, self._set, None, None
            if saved is not None and sys.getswitchinterval() == set_:
                sys.setswitchinterval(saved)
