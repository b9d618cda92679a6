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


# --- a fresh box for one test, forked from this warm interpreter (namespace runtime) -------------
# The child gets new mount, uts, ipc, network and pid namespaces; every overlay the box has gets a
# new, empty upper layer, and /tmp, /workspace and /dev/shm new tmpfs, so the test sees the box as
# it was when this interpreter started, and nothing it does reaches this interpreter or the host.

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWPID = 0x20000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG = 1


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def _mount(libc, src, target, fstype, flags, data):
    enc = lambda v: v.encode() if v is not None else None  # noqa: E731
    _check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), "mount %s" % target)


def _mounts():
    """``(mount point, fstype)`` of every mount this process sees, in mount order."""
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            f = line.split()
            point = f[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
            out.append((point, f[f.index("-") + 1]))
    return out


def _overlay(libc, lower, target, stage, n):
    """A new overlay on ``target`` over ``lower``, with an empty upper layer in ``stage``."""
    upper, work = "%s/u%d" % (stage, n), "%s/w%d" % (stage, n)
    os.mkdir(upper)
    os.mkdir(work)
    opts = "lowerdir=%s,upperdir=%s,workdir=%s,userxattr" % (lower, upper, work)
    _mount(libc, "overlay", target, "overlay", 0, opts)


def _under(path, top):
    return path.startswith(top.rstrip("/") + "/")


def _fresh_box(hostname, network):
    """In the forked child: new namespaces and pristine writable layers.  Returns in the box's pid 1.

    Every overlay gets a new, empty upper layer.  The masks the box had on top of its overlays
    (credential directories, the boxes' state) are laid again on top of the new layers, and
    /tmp, /workspace, /dev/shm and /run are new tmpfs.
    """
    libc = _libc()
    flags = _CLONE_NEWNS | _CLONE_NEWUTS | _CLONE_NEWIPC | _CLONE_NEWPID
    if not network:
        flags |= _CLONE_NEWNET
    _check(libc.unshare(flags), "unshare")
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE, None)
    stage = "/run/.boxlite-fresh"
    os.makedirs(stage, exist_ok=True)
    _mount(libc, "tmpfs", stage, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0700")
    mounts = _mounts()
    overlays = sorted({m for m, fs in mounts if fs == "overlay"}, key=lambda p: (p.count("/"), p))
    hidden = [m for m in overlays if _under(m, "/tmp")]
    private = ("/tmp", "/run", "/proc", "/dev", "/sys")
    masks = [
        (m, fs)
        for m, fs in mounts
        if fs != "overlay" and any(_under(m, o) for o in overlays) and not any(m == p or _under(m, p) for p in private)
    ]
    # Overlays under /tmp and bind masks vanish under what is mounted next: keep a handle on them.
    for i, m in enumerate(hidden):
        os.mkdir("%s/keep%d" % (stage, i))
        _mount(libc, m, "%s/keep%d" % (stage, i), None, _MS_BIND | _MS_REC, None)
    for i, (m, fs) in enumerate(masks):
        if fs != "tmpfs":
            held = "%s/mask%d" % (stage, i)
            if os.path.isdir(m):
                os.mkdir(held)
            else:
                open(held, "w").close()
            _mount(libc, m, held, None, _MS_BIND, None)
    for i, m in enumerate(overlays):
        if m not in hidden:
            _overlay(libc, m, m, stage, i)
    for i, (m, fs) in enumerate(masks):
        if fs == "tmpfs":
            _mount(libc, "tmpfs", m, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755")
        else:
            _mount(libc, "%s/mask%d" % (stage, i), m, None, _MS_BIND, None)
    for d in ("/tmp", "/workspace", "/dev/shm"):
        if os.path.isdir(d):
            _mount(libc, "tmpfs", d, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777" if d != "/workspace" else "mode=0755")
    for i, m in enumerate(hidden):
        os.makedirs(m, exist_ok=True)
        _overlay(libc, "%s/keep%d" % (stage, i), m, stage, len(overlays) + i)
    # Last, a new /run: it hides the staging area and the template's control directory.
    _mount(libc, "tmpfs", "/run", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755")
    pid = os.fork()
    if pid:
        # The intermediate process: wait for the box's pid 1 and exit with its status.
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            import signal

            try:
                signal.signal(-code, signal.SIG_DFL)
            except (OSError, ValueError):
                pass  # SIGKILL and SIGSTOP cannot be handled, so need no reset
            os.kill(os.getpid(), -code)
        os._exit(code)
    import signal
    import socket

    _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    _mount(libc, "proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
    socket.sethostname(hostname)
    try:
        import fcntl
        import struct

        with socket.socket() as s:  # bring loopback up, as a new machine has it
            fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH14s", b"lo", 0x1 | 0x40, b""))
    except OSError:
        pass
    with open("/proc/self/oom_score_adj", "w") as fh:
        fh.write("1000")  # under memory pressure the test dies, not the warm interpreter


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
                _fresh_box(hostname, network)
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
