"""A boxed test's last words: at its timeout, what it printed and logged so far, sent to the host.

The host kills a boxed test's box when the test's timeout passes (``timeout=`` of the marker,
``--boxlite-timeout``); pytest's capture of the test's output dies with it.  So the box watches
the same deadline: when it passes, it reads what pytest captured of the running phase (its
stdout and stderr, at the descriptor level, and its log records) and sends that as one
``LASTWORDS`` message, which the host puts in the timeout's report as pytest-timeout's would be.
The host waits briefly for it and kills the box as before; the message is only ever text, capped.

Shipped into the box as source after ``messages`` (for :data:`LASTWORDS` and ``cap``).
"""

import os
import threading


class LastWords:
    """Watch one test run: at ``timeout`` seconds, send its phase's captured output with ``send``.

    The time the test waits at a debugger's prompt for the host's user (:meth:`pause` to
    :meth:`resume`) does not count, as pytest-timeout does not count it locally.
    """

    def __init__(self, item, send, timeout):
        import time

        self.item = item
        self.send = send
        self.done = threading.Event()
        self.changed = threading.Condition()
        self.paused_at = None
        self.deadline = time.monotonic() + float(timeout or 0)
        self.thread = None
        if timeout is not None and timeout > 0:
            self.thread = threading.Thread(target=self._watch, name="boxlite-lastwords")
            self.thread.daemon = True
            self.thread.start()

    def stop(self):
        self.done.set()
        with self.changed:
            self.changed.notify_all()

    def pause(self):
        """The test waits for the user (at a debugger's prompt): the clock stops."""
        import time

        with self.changed:
            if self.paused_at is None:
                self.paused_at = time.monotonic()

    def resume(self):
        """The user answered: the clock runs on from where it stopped."""
        import time

        with self.changed:
            if self.paused_at is not None:
                self.deadline += time.monotonic() - self.paused_at
                self.paused_at = None
                self.changed.notify_all()

    def _due(self):
        """Wait until the (paused-aware) deadline passes or the run ends; True if it passed."""
        import time

        with self.changed:
            while not self.done.is_set():
                if self.paused_at is not None:
                    self.changed.wait()
                    continue
                left = self.deadline - time.monotonic()
                if left <= 0:
                    return True
                self.changed.wait(left)
            return False

    def _watch(self):
        if not self._due():
            return
        try:
            fields = self._captured()
        except Exception as exc:  # noqa: BLE001 - best effort: the host reports the timeout either way
            fields = {"when": "call", "out": "", "err": "", "log": "", "problem": "%s: %s" % (type(exc).__name__, exc)}
        if not self.done.is_set():
            self.send(LASTWORDS, **fields)  # noqa: F821 - messages.py

    def _captured(self):
        # "nodeid (call)": which phase runs now, as pytest itself says it.
        current = os.environ.get("PYTEST_CURRENT_TEST", "")
        when = current.rsplit("(", 1)[-1].rstrip(")") if current.endswith(")") else "call"
        if when not in ("setup", "call", "teardown"):
            when = "call"
        config = self.item.config
        out = err = log = ""
        capman = config.pluginmanager.getplugin("capturemanager")
        if capman is not None and capman.is_globally_capturing():
            captured = capman.read_global_capture()
            out, err = captured.out, captured.err
        logging_plugin = config.pluginmanager.getplugin("logging-plugin")
        handler = getattr(logging_plugin, "report_handler", None)
        stream = getattr(handler, "stream", None)
        if stream is not None and hasattr(stream, "getvalue"):
            log = stream.getvalue().strip()
        return {
            "when": when,
            "out": cap(out),  # noqa: F821 - messages.py
            "err": cap(err),  # noqa: F821
            "log": cap(log),  # noqa: F821
        }
