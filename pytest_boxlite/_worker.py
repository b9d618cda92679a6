"""Guest side of boxed test execution.  Imports nothing but pytest and the standard library.

Sent to a box's interpreter with execnet ``remote_exec`` and started when the
box is booted, so a leased box already has pytest imported and configured.
Protocol on the channel:

* host -> guest: ``{"args": [...], "cwd": ..., "sys_path": [...], "env": {...}}``
* guest -> host: ``("ready", pid)`` once ``pytest.main`` reached its run loop
* host -> guest: ``(nodeid, arg, next_nodeid, next_arg)``; ``None`` ends the worker
* guest -> host: ``("report", data)`` per report, streamed as they happen
  (so a crash leaves the phases that finished), then ``("done", None)`` or
  ``("error", text)`` when the item could not be collected.
"""

import os
import sys

SECTION_CAP = 1 << 20


def _cap(text):
    if len(text) <= SECTION_CAP:
        return text
    cut = len(text) - SECTION_CAP
    return text[:SECTION_CAP] + "\n[pytest-boxlite: %d more characters of this section were cut]\n" % cut


def serve(channel):
    cfg = channel.receive()
    os.chdir(cfg["cwd"])
    # The guest sees the host's project and packages at the same paths.
    sys.path[:] = cfg["sys_path"]
    os.environ.update(cfg["env"])
    import pytest

    class GuestPlugin:
        def __init__(self):
            self.items = {}
            self.config = None

        @pytest.hookimpl(tryfirst=True)
        def pytest_collection(self, session):
            return True  # items are collected on demand, one request at a time

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtestloop(self, session):
            self.config = session.config
            channel.send(("ready", os.getpid()))
            while True:
                msg = channel.receive()
                if msg is None:
                    return True
                self.run(session, *msg)

        def pytest_runtest_logreport(self, report):
            # A test that prints 100 MB must not make the host hold 100 MB per report.
            report.sections = [(title, _cap(content)) for title, content in report.sections]
            data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
            channel.send(("report", data))

        def _collect(self, session, pairs):
            missing = [arg for nodeid, arg in pairs if nodeid and nodeid not in self.items]
            if missing:
                for item in session.perform_collect(missing):
                    self.items[item.nodeid] = item

        def run(self, session, nodeid, arg, next_nodeid, next_arg):
            try:
                self._collect(session, [(nodeid, arg), (next_nodeid, next_arg)])
            except Exception as exc:  # reported to the host as a failed setup
                channel.send(("error", "collecting %s in the box failed: %s: %s" % (nodeid, type(exc).__name__, exc)))
                return
            item = self.items.get(nodeid)
            if item is None:
                channel.send(
                    ("error", "the box could not collect %s (collected: %s)" % (nodeid, sorted(self.items)[:5]))
                )
                return
            nextitem = self.items.get(next_nodeid) if next_nodeid else None
            item.ihook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            self.items.pop(nodeid, None)
            channel.send(("done", None))

    pytest.main(cfg["args"], plugins=[GuestPlugin()])


if __name__ == "__channelexec__":
    serve(channel)  # type: ignore[name-defined]  # noqa: F821 - provided by execnet
