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


def _tag(obj):
    """JSON has no tuples, and pytest's reports need theirs back: mark them (see remote._untag)."""
    if isinstance(obj, tuple):
        return {"__tuple__": [_tag(x) for x in obj]}
    if isinstance(obj, list):
        return [_tag(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _tag(v) for k, v in obj.items()}
    return obj


def serve(channel):
    cfg = channel.receive()
    os.chdir(cfg["cwd"])
    # The guest sees the host's project and packages at the same paths.
    sys.path[:] = cfg["sys_path"]
    os.environ.update(cfg["env"])
    import json
    import socket

    import pytest

    class GuestPlugin:
        def __init__(self):
            self.items = {}
            self.config = None
            self.send = lambda kind, data: channel.send((kind, data))
            self.children = {}

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
                kind, args = msg[0], msg[1:]
                if kind == "run":
                    self.run(session, *args)
                    self.send("done", None)
                elif kind == "fork":
                    self.fork(session, *args)
                elif kind == "wait":
                    channel.send(("status", self.wait(*args)))
                elif kind == "poll":
                    channel.send(("status", self.wait(args[0], timeout=0)))
                elif kind == "kill":
                    try:
                        os.kill(args[0], 9)
                    except ProcessLookupError:
                        pass
                    channel.send(("status", self.wait(args[0])))

        def pytest_runtest_logreport(self, report):
            # A test that prints 100 MB must not make the host hold 100 MB per report.
            report.sections = [(title, _cap(content)) for title, content in report.sections]
            data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
            self.send("report", data)

        def _collect(self, session, pairs):
            missing = [arg for nodeid, arg in pairs if nodeid and nodeid not in self.items]
            if missing:
                for item in session.perform_collect(missing):
                    self.items[item.nodeid] = item

        def run(self, session, nodeid, arg, next_nodeid, next_arg):
            try:
                self._collect(session, [(nodeid, arg), (next_nodeid, next_arg)])
            except Exception as exc:  # reported to the host as a failed setup
                self.send("error", "collecting %s in the box failed: %s: %s" % (nodeid, type(exc).__name__, exc))
                return
            item = self.items.get(nodeid)
            if item is None:
                self.send("error", "the box could not collect %s (collected: %s)" % (nodeid, sorted(self.items)[:5]))
                return
            nextitem = self.items.get(next_nodeid) if next_nodeid else None
            item.ihook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            self.items.pop(nodeid, None)

        def fork(self, session, nodeid, arg, token, sock_path, hostname, network):
            for old, status in list(self.children.items()):  # reap boxes that have ended
                if status is None:
                    self.wait(old, timeout=0)
                else:
                    del self.children[old]  # reaped and reported
            # Collect (import the module) here, once: every box forked later inherits it.
            try:
                self._collect(session, [(nodeid, arg)])
            except Exception as exc:
                channel.send(("error", "collecting %s in the box failed: %s: %s" % (nodeid, type(exc).__name__, exc)))
                return
            try:
                pid = os.fork()
            except OSError as exc:
                channel.send(("error", "fork failed: %s" % exc))
                return
            if pid:
                self.children[pid] = None
                channel.send(("forked", pid))
                return
            code = 0
            try:
                # Connect first: the fresh box gets a new /run, which hides the socket's directory.
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.connect(sock_path)
                _fresh_box(hostname, network)  # noqa: F821 - from guest/fresh.py, sent in the same remote_exec
                out = conn.makefile("wb")

                def send(kind, data):
                    out.write((json.dumps([kind, _tag(data)]) + "\n").encode())
                    out.flush()

                send("token", token)
                self.send = send
                self.run(session, nodeid, arg, None, None)
                send("done", None)
                out.close()
                conn.close()
            except BaseException as exc:
                try:
                    sys.stderr.write("pytest-boxlite: forked box failed: %r\n" % (exc,))
                finally:
                    code = 70
            finally:
                os._exit(code)

        def wait(self, pid, timeout=5.0):
            import time

            deadline = time.monotonic() + timeout
            while True:
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    return self.children.get(pid)  # reaped already: its status was kept
                if done:
                    code = os.waitstatus_to_exitcode(status)
                    self.children[pid] = code
                    return code
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.005)

    pytest.main(cfg["args"], plugins=[GuestPlugin()])


if __name__ == "__channelexec__":
    serve(channel)  # type: ignore[name-defined]  # noqa: F821 - provided by execnet
