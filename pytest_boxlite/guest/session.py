"""The session in a box: the box's pytest, run the way pytest-xdist runs a worker.

:mod:`pytest_boxlite.guest.worker` starts it with the host's own command line (so every option, of
pytest, of other plugins and of the project's conftest files, means what it means on the host).
:class:`GuestPlugin` collects the session ONCE, indexes every collected item by node id, and then
runs the items the host asks for, by id, with the right ``nextitem``, so fixture scopes behave as
in a local run.  With ``--boxlite-scope=test`` it sets up the fixtures wider than a function's once,
here, for every forked box to inherit, and tears them down when pytest would (``_prepare``,
``_teardown_shared``).  The boxes themselves are forked by :mod:`pytest_boxlite.guest.forks`.
The messages are listed in :mod:`pytest_boxlite.guest.messages`.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, BinaryIO

import pytest

from pytest_boxlite.guest.changes import Watch
from pytest_boxlite.guest.lastwords import LastWords
from pytest_boxlite.guest.layers import KEEP_LAYERS, LAYERS
from pytest_boxlite.guest.linux import LIBC
from pytest_boxlite.guest.messages import (
    CACHE,
    CHANGES,
    COVERAGE,
    DONE,
    ERROR,
    EXIT,
    FIELD_CAP,
    FILES,
    OUTPUT,
    READY,
    REPORT,
    SHARED_TORN_DOWN,
    TEARDOWN_SHARED,
    WARNING,
    WRITE_BACK,
    WRITE_BACK_BYTES,
    WRITE_BACK_FILES,
    cap,
)

if TYPE_CHECKING:
    import codecs
    import threading
    import warnings
    from collections.abc import Callable, Generator, Iterable

    #: A handler of one kind of the host's messages on the channel (the fork server's: FORK, WAIT, ...).
    Handler = Callable[[dict[str, Any]], None]
    #: What ``_prepare`` set up for an item (see ``_prepared_key``).
    PreparedKey = tuple[tuple[str, ...], tuple[tuple[str, str], ...]]

#: Host-only options, reset in the box: the host distributes, debugs and loops; the box only runs.
_HOST_ONLY_OPTIONS: dict[str, object] = {
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


def _xdist_identity(workerid: str, testrunuid: str) -> object:
    """Fixtures that tell a boxed test which xdist worker its host is, as ``worker_id`` does locally.

    pytest-xdist's own ``worker_id``/``testrun_uid`` read ``config.workerinput``, which the box's
    pytest has not (it is no xdist worker: it must not act as one towards other plugins).  This
    plugin is registered after xdist's, so its fixtures are the ones found.
    """
    import pytest

    class XdistIdentity:
        @pytest.fixture(scope="session")
        def worker_id(self) -> str:
            return workerid

        @pytest.fixture(scope="session")
        def testrun_uid(self) -> str:
            return testrunuid

    return XdistIdentity()


_SHADOW = "boxlite-shared-fixtures"


def _noop() -> None:
    """The stand-in item's test function (never called)."""


def _shared_names(item: pytest.Item) -> list[str] | None:
    """The fixtures of ``item`` that its forked box inherits set up: every one of its closure whose
    scope is wider than the function's, in the closure's order (pytest sorts it widest scope first).

    ``None`` for an item whose setup is more than filling its fixtures (a non-Python test item: its
    ``setup()`` is test code, which must run in the test's own box).  Relies on what pytest 8.0 to 9
    have and no public API offers before a fixture runs: ``Function._fixtureinfo.name2fixturedefs``
    (each name of the closure -> its definitions, the last one the one used), ``FixtureDef.scope``,
    and ``Function.setup()`` filling exactly ``item.fixturenames`` (a public attribute).
    """
    import pytest

    if not isinstance(item, pytest.Function):
        return None
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", None)
    names = getattr(item, "fixturenames", None)
    if not isinstance(defs, dict) or not isinstance(names, list):
        return None
    return [n for n in names if defs.get(n) and getattr(defs[n][-1], "scope", "function") != "function"]


def _prepared_key(item: pytest.Item, names: list[str]) -> PreparedKey:
    """What ``GuestPlugin._prepare`` sets up for ``item`` (beside its collectors): its fixtures
    wider than a function's (``names``, :func:`_shared_names`) and the parameter each of them has
    for it (a module fixture parametrized, directly or indirectly, is set up again for another)."""
    callspec = getattr(item, "callspec", None)
    indices = getattr(callspec, "indices", None) or {}
    return tuple(names), tuple(sorted((n, repr(indices[n])) for n in names if n in indices))


def _warning_filter(arg: object, escape: bool) -> tuple[Any, str, type[Warning], str, int] | None:
    """A ``-W``/``filterwarnings`` line as ``warnings.filterwarnings`` arguments (pytest's own
    parser is private): ``None`` if it does not parse (pytest reports that itself)."""
    import builtins
    import importlib
    import re

    parts = [p.strip() for p in str(arg).split(":")]
    if len(parts) > 5:
        return None
    action, message, category, module, lineno = parts + [""] * (5 - len(parts))
    actions = [a for a in ("default", "error", "ignore", "always", "module", "once") if a.startswith(action)]
    if not actions:
        return None
    try:
        if not category:
            cls = Warning
        elif "." in category:
            mod, _, name = category.rpartition(".")
            cls = getattr(importlib.import_module(mod), name)
        else:
            cls = getattr(builtins, category)
        if not (isinstance(cls, type) and issubclass(cls, Warning)):
            return None
        number = int(lineno) if lineno else 0
    except (ImportError, AttributeError, ValueError):
        return None
    if escape:
        message = re.escape(message) if message else message
        module = re.escape(module) + r"\Z" if module else module
    return actions[0], message, cls, module, number


def _apply_warning_filters(item: pytest.Item) -> None:
    """The warning filters pytest applies around ``item``'s run (its ``catch_warnings_for_item``):
    so a warning a shared fixture raises as the warm interpreter prepares ``item`` is shown,
    ignored or made an error as it would be in ``item``'s own setup."""
    import warnings

    config = item.config
    if not sys.warnoptions:
        warnings.filterwarnings("always", category=DeprecationWarning)
        warnings.filterwarnings("always", category=PendingDeprecationWarning)
    lines = [(a, False) for a in config.getini("filterwarnings")]
    lines += [(a, True) for a in getattr(config.known_args_namespace, "pythonwarnings", None) or []]
    lines += [(a, False) for mark in item.iter_markers(name="filterwarnings") for a in mark.args]
    for arg, escape in lines:
        parsed = _warning_filter(arg, escape)
        if parsed is not None:
            warnings.filterwarnings(*parsed)


def _warning_fields(warning_message: warnings.WarningMessage, nodeid: str) -> dict[str, Any]:
    category = warning_message.category
    return {
        "message": cap(str(warning_message.message), "of this warning"),
        "category": getattr(category, "__qualname__", "UserWarning"),
        "module": getattr(category, "__module__", "builtins"),
        "filename": str(warning_message.filename),
        "lineno": int(warning_message.lineno or 0),
        # The source line, read here in the box: the host prints it and never reads the file itself.
        "line": _warning_line(warning_message),
        "nodeid": nodeid,
    }


def _threads_note(names: list[str], nodeid: str) -> dict[str, Any]:
    """The warning a box reports when fixtures of its test were set up in it, not once for all
    boxes: they started threads, which a forked box would not have (``GuestPlugin._prepare``)."""
    shown_names = ", ".join(names)
    return {
        "message": "pytest-boxlite: fixture%s %s started threads when set up once for every box; "
        "a box is a fork, which keeps no thread, so each test's box sets %s up itself"
        % ("s" if len(names) > 1 else "", shown_names, "them" if len(names) > 1 else "it"),
        "category": "PytestWarning",
        "module": "pytest",
        "filename": "",
        "lineno": 0,
        "line": "",
        "nodeid": nodeid,
    }


def _warning_line(warning_message: warnings.WarningMessage) -> str:
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

    def __init__(self, send: Callable[..., None]) -> None:
        import codecs
        import threading

        self.send = send
        self.saved: list[int] = []
        self.threads: list[threading.Thread] = []
        for fd, name in ((1, "stdout"), (2, "stderr")):
            self.saved.append(os.dup(fd))
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            t = threading.Thread(target=self._pump, args=(r, name, decoder), daemon=True)
            t.start()
            self.threads.append(t)

    def _pump(self, r: int, name: str, decoder: codecs.IncrementalDecoder) -> None:
        try:
            while True:
                chunk = os.read(r, 65536)
                text = decoder.decode(chunk, final=not chunk)
                if text:
                    self.send(OUTPUT, stream=name, text=text)
                if not chunk:
                    return
        finally:
            os.close(r)

    def close(self) -> None:
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


def _coverage_fields(sent: dict[str, set[Any]]) -> dict[str, Any] | None:
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
    files: dict[str, list[Any]] = {}
    for name in data.measured_files():
        found = set(data.arcs(name) or ()) if arcs else set(data.lines(name) or ())
        new = found - sent.get(name, set())
        if new:
            sent.setdefault(name, set()).update(new)
            files[name] = [list(a) for a in new] if arcs else sorted(new)
    return {"arcs": arcs, "files": files} if files else None


def _new_files(since: float) -> dict[str, str]:
    """Files written under WRITE_BACK since ``since`` (bounded), as relative path -> base64."""
    import base64
    import stat

    out: dict[str, str] = {}
    total = 0
    cwd = os.getcwd()
    for rel in WRITE_BACK:
        for dirpath, _dirs, files in os.walk(os.path.join(cwd, rel)):  # never follows links
            for name in files:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode) or st.st_mtime < since:
                    continue
                if len(out) >= WRITE_BACK_FILES or total + st.st_size > WRITE_BACK_BYTES:
                    return out
                with open(path, "rb") as fh:
                    data = fh.read(st.st_size + 1)
                total += len(data)
                out[os.path.relpath(path, cwd)] = base64.b64encode(data).decode("ascii")
    return out


def _release_memory() -> None:
    """Once, before the first box is forked: free what collection left behind (the deselected
    items, see ``_forget_deselected``; they hold reference cycles) and hand the freed memory back
    to the kernel, so that no fork copies its page tables.  Every box inherits the collected heap
    as it would be at any later point of a local run: no semantics change."""
    import gc

    gc.collect()
    trim = getattr(LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _prepare_debugger(config: pytest.Config) -> None:
    """In the warm interpreter, before it forks: import the debugger relay and register its hooks
    once, so that no forked box compiles the module (the box cannot write its bytecode cache) or
    registers a plugin for its one test."""
    try:
        from pytest_boxlite.guest import debugger
    except ImportError:
        return  # _relay_debugger says so in the box
    debugger.prepare(config)


def _relay_debugger(config: pytest.Config, plugin: GuestPlugin, clock: LastWords) -> tuple[Any, Any] | None:
    """Relay the run's debugger to the host's terminal (guest/debugger.py, which the box's pytest
    imports from the package, as it imports this plugin): the host's answers come on the fork's
    socket.  Returns ``(module, answers)`` (``detach`` after the run), or ``None`` where the
    module cannot be imported: then the plugin's GuestRole says at the debugger's line why there is none."""
    try:
        from pytest_boxlite.guest import debugger
    except ImportError as exc:
        sys.stderr.write("pytest-boxlite: no debugger relay in this box: %r\n" % (exc,))
        return None
    answers = debugger.SocketAnswers(plugin.commands)
    debugger.attach(config, plugin.send, answers, clock, plugin.postmortem)
    return debugger, answers


def _take_fields(config: pytest.Config, fields: dict[str, Any]) -> None:
    """The fields of the ``RUN`` or ``FORK`` about to be set up, handed to the box's plugins
    (``pytest_boxlite_box_received``: the services' descriptions, where their fixtures find their
    addresses) before the item's fixtures are.  A box whose pytest runs without the plugin
    declares no such hook."""
    hook = getattr(config.hook, "pytest_boxlite_box_received", None)
    if hook is not None:
        hook(config=config, fields=fields)


class GuestPlugin:
    """The box's pytest plugin: collection once, then the host's control messages (``TEARDOWN_SHARED``) from
    ``channel``; other messages go to :attr:`handlers` (the fork server's, see ``guest/forks.py``).

    ``cfg`` is the host's first message (see :mod:`pytest_boxlite.guest.messages`);
    ``fork_problem`` why this box's kernel cannot fork fresh boxes, if so (sent in ``READY``)."""

    def __init__(self, channel: Any, cfg: dict[str, Any], fork_problem: str | None) -> None:
        self.channel = channel
        self.cfg = cfg
        self.fork_problem = fork_problem
        #: The host's other messages on the channel, by name: FORK, WAIT, POLL, KILL (guest/forks.py).
        self.handlers: dict[str, Handler] = {}
        self.items: dict[str, pytest.Item] = {}
        #: The selected items of each module (its node id's file part) whose ``location`` is
        #: still to be worked out (see ``_locate``).
        self.modules: dict[str, list[pytest.Item]] = {}
        self.collect_errors: dict[str, str] = {}
        self.session: pytest.Session | None = None
        self.seq: int | None = None
        #: The ``changes`` field of the current RUN (side effects or usage asked for: guest/changes.py).
        self.changes: dict[str, Any] | None = None
        self.send = self._locked(lambda name, **fields: self.channel.send((name, fields)))
        self.cache_writes: dict[str, Any] = {}
        self.coverage_sent: dict[str, set[Any]] = {}
        #: The nodes of this warm interpreter's SetupState that carry what it set up for its
        #: forked boxes (session first): fixtures wider than a function's, which pytest sets
        #: up once per session, package, module or class and every box inherits.
        self.shared: list[pytest.Item | pytest.Collector] = []
        #: What the last ``_prepare`` set up on ``shared`` (see ``_prepared_key``): an item
        #: that needs no more is forked as it is, without setting it up and down again here.
        self.prepared: PreparedKey | None = None
        #: In a forked box whose item was prepared so: the node its teardown stops at (the
        #: item's parent: what is above it belongs to the warm interpreter).
        self.stop: pytest.Item | pytest.Collector | None = None
        #: Warnings that preparing the item raised: its box reports them as its own.
        self.prepare_warnings: list[dict[str, Any]] = []
        #: In such a box: fixtures wider than a function's that its test set up itself (asked
        #: for with ``request.getfixturevalue``): torn down at its teardown, as the box ends.
        self.own_wide: list[tuple[Any, Any]] = []
        #: In a forked box: the reading side of its socket (the host's RUNs, and its answers to
        #: the test's debugger, see guest/debugger.py).
        self.commands: BinaryIO | None = None
        #: The host runs with --pdb (taken off here at configure; each run relays it).
        self.postmortem = False
        #: The session's collection was indexed and its deselected items let go of (later
        #: collections, of one item each in ``_item``, keep all they find).
        self.pruned = False
        #: Fixtures wider than a function's whose setup here left threads running, as
        #: ``id(fixturedef) -> (fixture name, thread names)``: a fork keeps only the forking
        #: thread, so each box sets these (and what depends on them) up itself.
        self.threaded: dict[int, tuple[str, list[str]]] = {}
        #: While ``_prepare`` sets up fixtures here: the wider ones set up, with their requests.
        self.preparing: list[tuple[Any, Any]] | None = None

    def _locked(self, send: Callable[..., None]) -> Callable[..., None]:
        """``send`` made safe for the live-output threads (one message at a time)."""
        import threading

        lock = threading.Lock()

        def locked(name: str, **fields: Any) -> None:
            # Every message of a run carries the run's number: the host drops what an
            # earlier test left behind (a thread still printing, say) instead of misreading it.
            fields["seq"] = self.seq
            with lock:
                send(name, **fields)

        return locked

    # -- configuration: the host's invocation, minus what only the host does -------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        self.postmortem = bool(getattr(config.option, "usepdb", False))
        for name, value in _HOST_ONLY_OPTIONS.items():
            if hasattr(config.option, name):
                setattr(config.option, name, value)
        # Values the host resolved at random (pytest-randomly's seed): the box uses the same.
        for name, value in self.cfg.get("resolved", {}).items():
            if hasattr(config.option, name):
                setattr(config.option, name, value)
        xdist = self.cfg.get("xdist")
        if xdist:
            config.pluginmanager.register(_xdist_identity(xdist["workerid"], xdist["testrunuid"]), "boxlite-xdist-id")
        # The box's own terminal report is nobody's to read: the terminal plugin binds it to
        # sys.stdout in its pytest_configure, so hand it a copy of stderr (the box log) until
        # the session starts; with -s fd 1 then carries only what the test prints.
        self.stdout = sys.stdout
        sys.stdout = os.fdopen(os.dup(2), "w", buffering=1)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if getattr(self, "stdout", None) is not None:
            sys.stdout, self.stdout = self.stdout, None

    # -- collection: once, every item indexed before any plugin deselects or reorders ------
    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_collection_modifyitems(
        self, session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
    ) -> Generator[None, object, object]:
        for item in items:
            self.items.setdefault(item.nodeid, item)
        result = yield
        # What is left selected (the host selected the same, or fewer): the items whose
        # locations _locate works out (click's suite deselects 31,000 of its 33,459).
        for item in items:
            self.modules.setdefault(item.nodeid.split("::")[0], []).append(item)
        if not self.pruned:
            self.pruned = True
            self._forget_deselected(config, items)
        return result

    def _forget_deselected(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """After the session's collection: let go of the items this interpreter deselected.

        Every box is a fork of this interpreter, and a fork costs by the memory it copies the
        page tables of (twice per test: the box's pid 1 and its test process) and tears down
        at exit: click's 31,000 deselected items are half of its 124 MB.  The host runs only
        what it selected, the same or fewer; an item it asks for that is not kept is collected
        alone (``_item``), as before.  The terminal reporter (whose report only the box log
        sees) keeps its count of them, not the items.
        """
        selected = {item.nodeid for item in items}
        for nodeid in [n for n in self.items if n not in selected]:
            del self.items[nodeid]
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        stats = getattr(reporter, "stats", None)
        if isinstance(stats, dict) and stats.get("deselected"):
            stats["deselected"] = [None] * len(stats["deselected"])

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors[report.nodeid] = cap(report.longreprtext, "of this error")

    # -- the run loop: items by id, as the host asks -------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        self.session = session
        self._watch_cache(session.config)
        _release_memory()
        ready: dict[str, Any] = {"pid": os.getpid(), "collected": len(self.items)}
        if self.fork_problem is not None:
            ready["fork_problem"] = self.fork_problem
        self.channel.send((READY, ready))
        while True:
            msg = self.channel.receive()
            if msg is None:
                return True
            name, fields = msg
            if name == TEARDOWN_SHARED:
                report = self._teardown_shared(fields.get("keep") or (), fields.get("nodeid"))
                self.channel.send((SHARED_TORN_DOWN, {"report": report}))
            elif name in self.handlers:
                self.handlers[name](fields)

    def _watch_cache(self, config: pytest.Config) -> None:
        """Keep what tests store in ``config.cache``: the host stores it in its own cache."""
        cache = getattr(config, "cache", None)
        if cache is None:
            return
        store = cache.set

        def set_and_keep(key: str, value: object) -> None:
            store(key, value)
            self.cache_writes[key] = value

        cache.set = set_and_keep

    def _send_side_data(self, since: float) -> None:
        """What a test left for the host besides its reports: cache values, coverage, files."""
        files = _new_files(since)
        if files:
            self.send(FILES, files=files)
        if self.cache_writes:
            self.send(CACHE, values=self.cache_writes)
            self.cache_writes = {}
        coverage = _coverage_fields(self.coverage_sent)
        if coverage is not None:
            self.send(COVERAGE, **coverage)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # A test that prints (or asserts with) 100 MB must not make the host hold 100 MB.
        report.sections = [(title, cap(content)) for title, content in report.sections]
        if report.longrepr is not None and len(report.longreprtext) > FIELD_CAP:
            report.longrepr = cap(report.longreprtext, "of this failure")
        config = self.config
        data = config.hook.pytest_report_to_serializable(config=config, report=report)
        self.send(REPORT, data=data)

    def pytest_warning_recorded(
        self, warning_message: warnings.WarningMessage, when: str, nodeid: str, location: object
    ) -> None:
        if when == "runtest" and self.session is not None:
            self.send(WARNING, **_warning_fields(warning_message, nodeid))

    # -- fixtures wider than a function's: set up here, once, for every forked box --------
    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any) -> Generator[None, object, object]:
        wide = getattr(fixturedef, "scope", "function") != "function"
        if self.preparing is None or not wide:
            result = yield
            if self.stop is not None and wide:
                self.own_wide.append((fixturedef, request))
            return result
        import threading

        before = set(threading.enumerate())
        try:
            return (yield)
        finally:
            started = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
            if started:
                self.threaded[id(fixturedef)] = (fixturedef.argname, started)
                self.preparing.append((fixturedef, request))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
        """In a box whose item was prepared: its teardown stops at what the warm interpreter
        set up; the wider fixtures the test set up itself end with it (``FixtureDef.finish``,
        as their scope's node would at its teardown)."""
        try:
            result = yield
        except BaseException:
            self._finish_own_wide()
            raise
        self._finish_own_wide()
        return result

    @staticmethod
    def _renew_capture(config: pytest.Config) -> None:
        """New files for pytest's global capture here, the forked box keeping the old ones:
        this interpreter captures what fixtures print as it prepares the next box (see
        ``_prepare``) while that box's test may run, and one file shared by both would mix
        (and cut) their output.  CaptureManager's ``stop/start_global_capturing`` (pytest 8.0
        to 9) are what pytest itself calls at the start and end of a session."""
        capman = config.pluginmanager.getplugin("capturemanager")
        if capman is None:
            return
        capman.stop_global_capturing()
        capman.start_global_capturing()

    def _finish_own_wide(self) -> None:
        own, self.own_wide = self.own_wide, []
        errors: list[Exception] = []
        for fixturedef, request in reversed(own):
            try:
                fixturedef.finish(request)
            except Exception as exc:  # noqa: BLE001 - every one is finished; the first error is raised
                errors.append(exc)
        if errors:
            raise errors[0]

    def _prepare(self, item: Any) -> pytest.Item | pytest.Collector | None:
        """Before ``item``'s box is forked: set up here what pytest sets up for ``item`` above
        the function (its collectors, and its session, package, module and class fixtures), as
        ``item``'s own setup would, then take ``item`` itself off the stack again.

        The box inherits all of it set up (values, and files made in this box), and its own
        setup then only sets up ``item``'s function-scoped fixtures.  What fails here (a fixture
        error, a skip mark) is left for the box: its setup raises the same (pytest keeps a
        fixture's error as its result for its scope, and a collector's for its subtree).
        Returns the node the box's teardown stops at (what is above it stays here).
        """
        names = _shared_names(item)
        chain = item.listchain()
        if names is not None and self.threaded:
            names = self._without_threaded(item, names)
        if names is None:
            # Not a Python function: its setup runs in its box only; nothing of ours is torn down there.
            kept = [n for n in self.shared if n in chain]
            return kept[-1] if kept else None
        key = _prepared_key(item, names)
        if self.prepared == key and self.shared == chain[:-1]:
            # The item before it (of the same collectors) had the same fixtures set up here,
            # with the same parameters: its setup would set up nothing and run every plugin's
            # setup and teardown hooks here for nothing (each box then copies the pages they wrote).
            self.prepare_warnings = []
            parent: pytest.Collector | None = item.parent
            return parent
        self.prepared = None
        # The host asked for this already (TEARDOWN_SHARED) when the next item left a scope; for an
        # item it did not tell us about (a test run again, say), here is when it is due.
        late = self._teardown_shared([n.nodeid for n in chain], None)
        if late is not None and late.get("outcome") == "failed":
            # No test's report is left to hold it: the box log does (quoted by failure reports).
            sys.stderr.write("pytest-boxlite: a shared fixture's teardown failed before %s\n" % item.nodeid)
        import warnings

        full = item.fixturenames
        if hasattr(item, "_request") and not item._request:
            item._initrequest()  # prepared before (a test run again): as runtestprotocol does
        with warnings.catch_warnings(record=True) as caught:
            _apply_warning_filters(item)
            item.fixturenames = names
            self.preparing = []
            try:
                item.ihook.pytest_runtest_setup(item=item)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException:  # noqa: BLE001,S110 - the box's own setup raises it again and reports it
                pass
            finally:
                item.fixturenames = full
                threaded, self.preparing = self.preparing, None
            # Fixtures that started threads: ended here again (what depends on them ends first,
            # by pytest's own finalizers), for each box to set up with its threads alive.
            for fixturedef, request in reversed(threaded):
                try:
                    fixturedef.finish(request)
                except Exception:  # noqa: BLE001,S110 - its teardown runs again in each box, and reports there
                    pass
            try:
                # A collector, not an item, as the next one: its chain is what stays set up here.
                item.ihook.pytest_runtest_teardown(item=item, nextitem=item.parent)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException:  # noqa: BLE001,S110 - item-level finalizers: none ran here
                pass
            if hasattr(item, "_request"):
                # As pytest's runtestprotocol leaves an item after its teardown (and sets it up
                # again for a rerun): the box's own setup starts from a new request.  pytest
                # 8.0's request counts each fixture's lookups, and one that failed here would
                # otherwise read as a recursive dependency there.
                item._request = False
                item.funcargs = None
        self.prepare_warnings = [_warning_fields(w, item.nodeid) for w in caught]
        own = self._threaded_names(item)
        if own:
            self.prepare_warnings.append(_threads_note(own, item.nodeid))
        self.shared = chain[:-1]
        self.prepared = None if threaded else key
        parent = item.parent
        return parent

    def _threaded_names(self, item: pytest.Item) -> list[str]:
        """The fixtures of ``item`` that started threads here (:attr:`threaded`), sorted."""
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", None) or {}
        return sorted({self.threaded[id(d)][0] for fds in defs.values() for d in fds if id(d) in self.threaded})

    def _without_threaded(self, item: pytest.Item, names: list[str]) -> list[str]:
        """``names`` less the fixtures that must be set up in ``item``'s own box: those that
        started threads here, and every one that depends on one of them (directly or not)."""
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", None) or {}
        tainted: dict[str, bool] = {}

        def needs_box(name: str, seen: frozenset[str]) -> bool:
            if name not in tainted:
                fds = defs.get(name) or ()
                tainted[name] = any(id(d) in self.threaded for d in fds) or any(
                    needs_box(arg, seen | {name})
                    for d in fds
                    for arg in getattr(d, "argnames", ())
                    if arg not in seen and arg != name
                )
            return tainted[name]

        return [n for n in names if not needs_box(n, frozenset())]

    def _teardown_shared(self, keep: Iterable[str], nodeid: str | None) -> dict[str, Any] | None:
        """Tear down what this interpreter set up on the nodes whose ids are not in ``keep``
        (the next item's chain; empty: everything), as pytest does at the teardown of ``nodeid``
        (the last item that needed them).  Returns that teardown's serialized report (its
        output and error), or ``None`` when nothing was set up on such a node.

        pytest tears nodes down only at an item's teardown: a stand-in item under the deepest
        node goes through the setup and teardown hooks (its own fixtures none), with the
        collector that stays as its next item.
        """
        keep = set(keep)
        kept: list[pytest.Item | pytest.Collector] = []
        for node in self.shared:
            if node.nodeid not in keep:
                break
            kept.append(node)
        if len(kept) == len(self.shared):
            return None
        import pytest

        top, self.shared = self.shared[-1], kept
        self.prepared = None
        shadow = pytest.Function.from_parent(top, name=_SHADOW, callobj=_noop)
        shadow.fixturenames = []
        sections: list[tuple[str, str]] = []

        def add_section(when: str, key: str, content: str) -> None:
            if content:
                sections.append(("Captured %s %s" % (key, when), cap(content)))

        shadow.add_report_section = add_section  # type: ignore[method-assign]
        stop = (KeyboardInterrupt, SystemExit)
        pytest.CallInfo.from_call(lambda: shadow.ihook.pytest_runtest_setup(item=shadow), "setup", reraise=stop)
        target = kept[-1] if kept else None
        call = pytest.CallInfo.from_call(
            lambda: shadow.ihook.pytest_runtest_teardown(item=shadow, nextitem=target), "teardown", reraise=stop
        )
        item = self.items.get(nodeid) if nodeid else None
        if item is None:
            if call.excinfo is None and not sections:
                return None
            item = shadow
        report = pytest.TestReport.from_item_and_call(item, call)
        report.sections = [(t, c) for t, c in sections if t.endswith(" teardown")]
        if report.longrepr is not None and len(report.longreprtext) > FIELD_CAP:
            report.longrepr = cap(report.longreprtext, "of this failure")
        config = self.config
        data: dict[str, Any] = config.hook.pytest_report_to_serializable(config=config, report=report)
        return data

    def _locate(self, item: pytest.Item) -> None:
        """Compute ``location`` (pytest caches it on the item) of each item of ``item``'s
        module here, once, before the first of their boxes is forked.

        Each box would compute it again for its own report, and the stat of the test's
        file it takes there is the first look-up of that path in the box's fresh layers
        (about half a millisecond of kernel time each); here it is one warm look-up per item,
        inherited by every box.  An item whose location raises is left to its box, which
        raises where pytest does, as locally.
        """
        # Once: a module's items leave the index as they are located (an item collected
        # later, alone, by _item is in no module's list: it is located by itself).
        for other in self.modules.pop(item.nodeid.split("::")[0], (item,)):
            try:
                other.location  # noqa: B018 - a cached property: computed once, kept on the item
            except Exception:  # noqa: BLE001, S110 - not swallowed: the box computes it again
                pass

    def _item(self, nodeid: str) -> tuple[pytest.Item | None, str | None]:
        item = self.items.get(nodeid)
        if item is not None:
            return item, None
        # Not in the box's collection (the host collected differently): collect it alone.
        path, sep, rest = nodeid.partition("::")
        assert self.session is not None  # the run loop has started: no message comes before
        arg = str(self.config.rootpath / path) + sep + rest
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

    @property
    def config(self) -> pytest.Config:
        """The session's config (the run loop has started: no message comes before)."""
        assert self.session is not None
        return self.session.config

    def run_fields(self, fields: dict[str, Any]) -> None:
        """Run the item of one ``RUN`` (``fields``: its message), then say ``DONE``."""
        self.seq = fields.get("seq")
        self.changes = fields.get("changes")
        _take_fields(self.config, fields)
        self.run(fields["nodeid"], fields.get("next"), fields.get("timeout"))
        self.send(DONE)

    def run(self, nodeid: str, next_nodeid: str | None, timeout: float | None = None) -> None:
        item, error = self._item(nodeid)
        if item is None:
            self.send(ERROR, text=error)
            return
        # Prepared in the warm interpreter, the item's teardown leaves what is above it there.
        nextitem = self.items.get(next_nodeid) if next_nodeid else self.stop
        if self.stop is not None:
            # Nor may -x / --maxfail (the host's to act on) make it tear everything down.
            item.session.config.option.maxfail = 0
            for fields in self.prepare_warnings:
                self.send(WARNING, **fields)
            self.prepare_warnings = []
        import time

        since = time.time() - 1.0  # file systems keep mtimes coarser than the clock
        watch = None
        if self.changes:
            forked = KEEP_LAYERS[0]
            watch = Watch(LAYERS, self.changes, item.config, forked)
        live = _LiveOutput(self.send) if item.config.option.capture in ("no", "tee-sys") else None
        last = LastWords(item, self.send, timeout)
        debugger = _relay_debugger(item.config, self, last)
        try:
            item.ihook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        except pytest.exit.Exception as exc:
            self.send(EXIT, reason=str(exc.msg), returncode=exc.returncode)
        finally:
            last.stop()
            if debugger is not None:
                debugger[0].detach(item.config)
            if live is not None:
                live.close()
        self._send_side_data(since)
        if watch is not None:
            self.send(CHANGES, **watch.finish())
