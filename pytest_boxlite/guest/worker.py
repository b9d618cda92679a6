"""Guest side of boxed test execution: the box's pytest, run the way pytest-xdist runs a worker.

Sent to a box's interpreter with execnet ``remote_exec`` (after the sources of
:mod:`pytest_boxlite.guest.messages` and :mod:`pytest_boxlite.guest.fresh`) and started when the box
boots.  It runs ``pytest.main`` with the host's own command line (so every option, of pytest, of
other plugins and of the project's conftest files, means what it means on the host), collects the
session ONCE, indexes every collected item by node id, and then runs the items the host asks for,
by id, with the right ``nextitem``, so fixture scopes behave as in a local run.  In fork mode each
forked box inherits that one collection.  The messages are listed in
:mod:`pytest_boxlite.guest.messages`.  Imports nothing of the package: standard library and pytest.
"""

import os
import signal
import sys

# Names from guest/messages.py, which the host sends ahead of this file in the same remote_exec.
# noqa comments below mark them: they are not defined in this file on its own.

#: Signals the init of a forked box passes on to the test process (the rest it ignores, as init does).
_FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")

#: Host-only options, reset in the box: the host distributes, debugs and loops; the box only runs.
_HOST_ONLY_OPTIONS = {
    "numprocesses": None,
    "maxprocesses": None,
    "dist": "no",
    "tx": [],
    "looponfail": False,
    "usepdb": False,
    "trace": False,
    # The host selected the items already; re-selecting in the box could drop some of them.
    "lf": False,
    "failedfirst": False,
    "newfirst": False,
    "stepwise": False,
    "stepwise_skip": False,
}


def _xdist_identity(workerid, testrunuid):
    """Fixtures that tell a boxed test which xdist worker its host is, as ``worker_id`` does locally.

    pytest-xdist's own ``worker_id``/``testrun_uid`` read ``config.workerinput``, which the box's
    pytest has not (it is no xdist worker: it must not act as one towards other plugins).  This
    plugin is registered after xdist's, so its fixtures are the ones found.
    """
    import pytest

    class XdistIdentity:
        @pytest.fixture(scope="session")
        def worker_id(self):
            return workerid

        @pytest.fixture(scope="session")
        def testrun_uid(self):
            return testrunuid

    return XdistIdentity()


def _init(child):
    """Be the init of a forked box: forward signals to ``child``, reap orphans, exit as it exits.

    The test process is then never pid 1 of its pid namespace, so signals without a handler kill
    it and ``getppid()`` is not 0, as locally.  A child killed by signal N makes this process exit
    with 128+N (pid 1 cannot die by a signal it sends itself); the host reads it back that way.
    """

    def forward(signum, frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for name in _FORWARDED:
        signal.signal(getattr(signal, name), forward)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(70)
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)


def _cut_channel(channel):
    """In a forked box: point the warm interpreter's execnet pipes at /dev/null.

    The fork inherits them; the test it runs must not be able to speak (or listen) on the warm
    interpreter's channel.  dup2 rather than close, so no later file can take those numbers.
    """
    io = getattr(channel.gateway, "_io", None)
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in ("infile", "outfile"):
            f = getattr(io, name, None)
            if f is not None:
                os.dup2(null, f.fileno())
    finally:
        os.close(null)


def _forget_cached_host_facts():
    """State the warm interpreter computed before the fork that is not true in the new box."""
    import platform

    # platform.uname() is cached: the new box has its own hostname.
    if hasattr(platform, "_uname_cache"):
        platform._uname_cache = None


def _warning_fields(warning_message, nodeid):
    category = warning_message.category
    return {
        "message": cap(str(warning_message.message), "of this warning"),  # noqa: F821 - messages.py
        "category": getattr(category, "__qualname__", "UserWarning"),
        "module": getattr(category, "__module__", "builtins"),
        "filename": str(warning_message.filename),
        "lineno": int(warning_message.lineno or 0),
        # The source line, read here in the box: the host prints it and never reads the file itself.
        "line": _warning_line(warning_message),
        "nodeid": nodeid,
    }


def _warning_line(warning_message):
    """The warning's source line as the box sees it ("" if it has none), bounded."""
    if warning_message.line is not None:
        return str(warning_message.line)[:1000]
    import linecache
    import stat

    try:  # linecache reads a whole file: only a regular one of a source file's size
        st = os.stat(warning_message.filename)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 16 << 20:
            return ""
        return linecache.getline(warning_message.filename, int(warning_message.lineno or 0))[:1000]
    except Exception:  # noqa: BLE001 - a warning's text must not fail the test
        return ""


class _LiveOutput:
    """With ``-s``: fds 1 and 2 of the test (and so of its subprocesses) go to the host as it prints.

    Each stream is a pipe drained by a thread that sends ``OUTPUT`` messages; :meth:`close` puts the
    original descriptors back and waits (bounded) for what is still in the pipes.
    """

    def __init__(self, send):
        import codecs
        import threading

        self.send = send
        self.saved = []
        self.threads = []
        for fd, name in ((1, "stdout"), (2, "stderr")):
            self.saved.append(os.dup(fd))
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            t = threading.Thread(target=self._pump, args=(r, name, decoder), daemon=True)
            t.start()
            self.threads.append(t)

    def _pump(self, r, name, decoder):
        try:
            while True:
                chunk = os.read(r, 65536)
                text = decoder.decode(chunk, final=not chunk)
                if text:
                    self.send(OUTPUT, stream=name, text=text)  # noqa: F821 - messages.py
                if not chunk:
                    return
        finally:
            os.close(r)

    def close(self):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd, saved in zip((1, 2), self.saved):  # noqa: B905 - strict= is Python 3.10+, guests may be older
            os.dup2(saved, fd)
            os.close(saved)
        for t in self.threads:
            t.join(2.0)  # a subprocess that still holds the pipe must not hold up the next test


def _coverage_fields(sent):
    """The coverage data this process gathered since the last call, if coverage runs here
    (pytest-cov ``--cov``); ``sent`` remembers what was sent (file -> set of lines or arcs).

    Plain lines or arcs, never coverage's own serialized form: that is an SQL script, which the
    host must not run on a box's word.
    """
    coverage = sys.modules.get("coverage")
    cov = coverage.Coverage.current() if coverage is not None else None
    if cov is None:
        return None
    data = cov.get_data()
    arcs = data.has_arcs()
    files = {}
    for name in data.measured_files():
        found = set(data.arcs(name) or ()) if arcs else set(data.lines(name) or ())
        new = found - sent.get(name, set())
        if new:
            sent.setdefault(name, set()).update(new)
            files[name] = [list(a) for a in new] if arcs else sorted(new)
    return {"arcs": arcs, "files": files} if files else None


def _new_files(since):
    """Files written under WRITE_BACK since ``since`` (bounded), as relative path -> base64."""
    import base64
    import stat

    out, total = {}, 0
    cwd = os.getcwd()
    for rel in WRITE_BACK:  # noqa: F821 - messages.py
        for dirpath, _dirs, files in os.walk(os.path.join(cwd, rel)):  # never follows links
            for name in files:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode) or st.st_mtime < since:
                    continue
                if len(out) >= WRITE_BACK_FILES or total + st.st_size > WRITE_BACK_BYTES:  # noqa: F821
                    return out
                with open(path, "rb") as fh:
                    data = fh.read(st.st_size + 1)
                total += len(data)
                out[os.path.relpath(path, cwd)] = base64.b64encode(data).decode("ascii")
    return out


def serve(channel):
    cfg = channel.receive()
    os.chdir(cfg["cwd"])
    # The guest sees the host's project and packages at the same paths.
    sys.path[:] = cfg["sys_path"]
    if cfg.get("prefix") not in (None, sys.prefix):
        # Another interpreter than the host's (a VM image's): it never read the host environment's
        # .pth files (editable installs' import hooks), so read them now.
        import site

        for entry in list(cfg["sys_path"]):
            if entry.endswith(("site-packages", "dist-packages")) and os.path.isdir(entry):
                site.addsitedir(entry)
    os.environ.update(cfg["env"])
    # Asked once, before pytest is imported (a fork is cheapest now): can this kernel make the
    # per-test box's namespaces?  A VM's kernel may lack user namespaces; a namespace box may have
    # a mount over part of a copy-on-write directory, which no fork can renew.  The host then
    # boots a box per test instead of failing every test.
    probe = fork_refused if cfg.get("probe_fork") else fork_blocked_by_mounts  # noqa: F821 - guest/fresh.py
    fork_problem = probe()
    import json
    import socket

    import pytest

    class GuestPlugin:
        def __init__(self):
            self.items = {}
            self.collect_errors = {}
            self.session = None
            self.children = {}
            self.seq = None
            self.send = self._locked(lambda name, **fields: channel.send((name, fields)))
            self.cache_writes = {}
            self.coverage_sent = {}

        def _locked(self, send):
            """``send`` made safe for the live-output threads (one message at a time)."""
            import threading

            lock = threading.Lock()

            def locked(name, **fields):
                # Every message of a run carries the run's number: the host drops what an
                # earlier test left behind (a thread still printing, say) instead of misreading it.
                fields["seq"] = self.seq
                with lock:
                    send(name, **fields)

            return locked

        # -- configuration: the host's invocation, minus what only the host does -------------
        @pytest.hookimpl(tryfirst=True)
        def pytest_configure(self, config):
            for name, value in _HOST_ONLY_OPTIONS.items():
                if hasattr(config.option, name):
                    setattr(config.option, name, value)
            # Values the host resolved at random (pytest-randomly's seed): the box uses the same.
            for name, value in cfg.get("resolved", {}).items():
                if hasattr(config.option, name):
                    setattr(config.option, name, value)
            xdist = cfg.get("xdist")
            if xdist:
                config.pluginmanager.register(
                    _xdist_identity(xdist["workerid"], xdist["testrunuid"]), "boxlite-xdist-id"
                )
            # The box's own terminal report is nobody's to read: the terminal plugin binds it to
            # sys.stdout in its pytest_configure, so hand it a copy of stderr (the box log) until
            # the session starts; with -s fd 1 then carries only what the test prints.
            self.stdout = sys.stdout
            sys.stdout = os.fdopen(os.dup(2), "w", buffering=1)

        @pytest.hookimpl(tryfirst=True)
        def pytest_sessionstart(self, session):
            if getattr(self, "stdout", None) is not None:
                sys.stdout, self.stdout = self.stdout, None

        # -- collection: once, every item indexed before any plugin deselects or reorders ------
        @pytest.hookimpl(wrapper=True, tryfirst=True)
        def pytest_collection_modifyitems(self, session, config, items):
            for item in items:
                self.items.setdefault(item.nodeid, item)
            return (yield)

        def pytest_collectreport(self, report):
            if report.failed:
                self.collect_errors[report.nodeid] = cap(report.longreprtext, "of this error")  # noqa: F821

        # -- the run loop: items by id, as the host asks -------------------------------------
        @pytest.hookimpl(tryfirst=True)
        def pytest_runtestloop(self, session):
            self.session = session
            self._watch_cache(session.config)
            ready = {"pid": os.getpid(), "collected": len(self.items)}
            if fork_problem is not None:
                ready["fork_problem"] = fork_problem
            channel.send((READY, ready))  # noqa: F821
            while True:
                msg = channel.receive()
                if msg is None:
                    return True
                name, fields = msg
                if name == RUN:  # noqa: F821
                    self.seq = fields.get("seq")
                    self.run(fields["nodeid"], fields.get("next"))
                    self.send(DONE)  # noqa: F821
                elif name == FORK:  # noqa: F821
                    self.fork(**fields)
                elif name in (WAIT, POLL):  # noqa: F821
                    code = self.wait(fields["pid"], timeout=0 if name == POLL else 5.0)  # noqa: F821
                    channel.send((STATUS, {"code": code}))  # noqa: F821
                elif name == KILL:  # noqa: F821
                    try:
                        os.kill(fields["pid"], 9)
                    except ProcessLookupError:
                        pass
                    channel.send((STATUS, {"code": self.wait(fields["pid"])}))  # noqa: F821

        def _watch_cache(self, config):
            """Keep what tests store in ``config.cache``: the host stores it in its own cache."""
            cache = getattr(config, "cache", None)
            if cache is None:
                return
            store = cache.set

            def set_and_keep(key, value):
                store(key, value)
                self.cache_writes[key] = value

            cache.set = set_and_keep

        def _send_side_data(self, since):
            """What a test left for the host besides its reports: cache values, coverage, files."""
            files = _new_files(since)
            if files:
                self.send(FILES, files=files)  # noqa: F821
            if self.cache_writes:
                self.send(CACHE, values=self.cache_writes)  # noqa: F821
                self.cache_writes = {}
            coverage = _coverage_fields(self.coverage_sent)
            if coverage is not None:
                self.send(COVERAGE, **coverage)  # noqa: F821

        def pytest_runtest_logreport(self, report):
            # A test that prints (or asserts with) 100 MB must not make the host hold 100 MB.
            report.sections = [(title, cap(content)) for title, content in report.sections]  # noqa: F821
            if report.longrepr is not None and len(report.longreprtext) > FIELD_CAP:  # noqa: F821
                report.longrepr = cap(report.longreprtext, "of this failure")  # noqa: F821
            config = self.session.config
            data = config.hook.pytest_report_to_serializable(config=config, report=report)
            self.send(REPORT, data=data)  # noqa: F821

        def pytest_warning_recorded(self, warning_message, when, nodeid, location):
            if when == "runtest" and self.session is not None:
                self.send(WARNING, **_warning_fields(warning_message, nodeid))  # noqa: F821

        def _item(self, nodeid):
            item = self.items.get(nodeid)
            if item is not None:
                return item, None
            # Not in the box's collection (the host collected differently): collect it alone.
            path, sep, rest = nodeid.partition("::")
            arg = str(self.session.config.rootpath / path) + sep + rest
            try:
                for found in self.session.perform_collect([arg]):
                    self.items.setdefault(found.nodeid, found)
            except Exception as exc:
                errors = [t for n, t in self.collect_errors.items() if nodeid.startswith(n.split("::")[0])]
                why = errors[0] if errors else "%s: %s" % (type(exc).__name__, exc)
                return None, "collecting %s in the box failed: %s" % (nodeid, why)
            item = self.items.get(nodeid)
            if item is None:
                return None, "the box did not collect %s" % nodeid
            return item, None

        def run(self, nodeid, next_nodeid):
            item, error = self._item(nodeid)
            if item is None:
                self.send(ERROR, text=error)  # noqa: F821
                return
            nextitem = self.items.get(next_nodeid) if next_nodeid else None
            import time

            since = time.time() - 1.0  # file systems keep mtimes coarser than the clock
            live = _LiveOutput(self.send) if item.config.option.capture in ("no", "tee-sys") else None
            try:
                item.ihook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            except pytest.exit.Exception as exc:
                self.send(EXIT, reason=str(exc.msg), returncode=exc.returncode)  # noqa: F821
            finally:
                if live is not None:
                    live.close()
            self._send_side_data(since)

        def fork(self, nodeid, token, sock, hostname, network, renew_all=False, cell=None):
            """Fork a fresh box for ``nodeid`` (collected here first, so the box inherits it) that
            runs each ``RUN`` the host sends on its stream (one, or a module's), until the stream ends.

            ``renew_all``: the box is a VM, whose writable directories are no overlays (see
            ``_fresh_box``).  ``cell``: where the host hands the box its own cgroups and stderr
            (``take_cell``)."""
            # Reap boxes that have ended, and tell the host which (in FORKED): it then needs no
            # round trip per box to learn that a box it is done with has gone.
            ended = []
            for old, status in list(self.children.items()):
                if status is None:
                    if self.wait(old, timeout=0) is not None:
                        ended.append(old)
                else:
                    del self.children[old]  # reaped and reported
            item, error = self._item(nodeid)
            if item is None:
                channel.send((ERROR, {"text": error}))  # noqa: F821
                return
            # Root's fresh box maps every id into its new user namespace: this process writes the maps.
            # On a VM (renew_all) root forks the box as root of the VM's kernel: no maps to write.
            real_root = bool(renew_all) and os.geteuid() == 0
            mapper = IdMapper() if os.geteuid() == 0 and not real_root else None  # noqa: F821 - guest/fresh.py
            try:
                dealt = take_cell(cell) if cell else None  # noqa: F821 - guest/fresh.py
                pid = clone_box(network, mapper, real_root, cell=dealt)  # noqa: F821 - guest/fresh.py
            except OSError as exc:
                if mapper is not None:
                    mapper.close_parent_side()
                    mapper.close_child_side()
                channel.send((ERROR, {"text": "fork failed: %s" % exc}))  # noqa: F821
                return
            if pid:
                self.children[pid] = None
                # The maps first: the box waits for them, while the host can wait for FORKED (with
                # boxes made ahead it is not waiting on this box's test yet).
                if mapper is not None:
                    mapper.serve(pid)
                channel.send((FORKED, {"pid": pid, "ended": ended}))  # noqa: F821
                return
            # Here: pid 1 of the fresh box, in its new namespaces, ids mapped.
            code = 0
            try:
                # Connect first: the fresh box gets a new /run, which hides the socket's directory.
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.connect(sock)
                _cut_channel(channel)
                # A root directory of its own too, but for a VM's box: it moves into an overlay of /.
                _fresh_box(hostname, network, renew_all, own_root=not renew_all)  # noqa: F821 - from guest/fresh.py, sent in the same remote_exec
                nested = IdMapper() if os.geteuid() == 0 else None  # noqa: F821 - guest/fresh.py
                test = os.fork()
                if test:
                    conn.close()  # the host sees the stream end when the test process ends
                    seal_init()  # noqa: F821 - guest/fresh.py
                    if nested is not None:
                        nested.serve(test)
                    _init(test)
                enter_test_namespaces(network, nested)  # noqa: F821 - guest/fresh.py
                _forget_cached_host_facts()
                out = conn.makefile("wb")

                def send(name, **fields):
                    out.write((json.dumps([name, tag(fields)]) + "\n").encode())  # noqa: F821
                    out.flush()

                send(TOKEN, token=token)  # noqa: F821
                self.send = send = self._locked(send)
                # Every test, the first included, starts on the host's RUN: a box may be made
                # ahead, while the test before it still runs, and must not start before its turn.
                commands = conn.makefile("rb")
                while True:
                    line = commands.readline(1 << 20)
                    if not line:
                        break  # the host is done with this box
                    name, fields = json.loads(line)
                    if name != RUN:  # noqa: F821
                        break
                    self.seq = fields.get("seq")
                    self.run(fields["nodeid"], fields.get("next"))
                    send(DONE)  # noqa: F821
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
