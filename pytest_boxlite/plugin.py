"""pytest-boxlite (the pytest11 entry point): options, fixtures, and one plugin object per role.

``pytest_configure`` decides the role once and registers exactly one object, the way pytest-xdist
registers its ``DSession`` only where it distributes:

- :class:`~pytest_boxlite.roles.HostPlugin` (``boxlite-host``): a plain run or an xdist worker;
  owns the session's boxes (pool, warm interpreters, boxed items);
- :class:`~pytest_boxlite.roles.ControllerPlugin` (``boxlite-controller``): the xdist
  controller; runs no pool, hands its session id to the workers, reconciles before they start
  and reaps after they end;
- :class:`GuestRole` (``boxlite-guest``): inside a box's pytest, where the host does the boxing;
- nothing for runs that only list or collect (``--collect-only``, ``--fixtures``, ``--help``, ...).
"""

from __future__ import annotations

import fcntl
import io
import os
import re
import stat
import traceback
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.fixtures import (  # noqa: F401 - fixtures are found as attributes of this plugin
    PROMOTE_KEY,
    SESSION_KEY,
    boxlite_module_sandbox,
    boxlite_pool,
    boxlite_sandbox,
)
from pytest_boxlite.marker_registration import MARKER_HELP, ON_HOST_KEY
from pytest_boxlite.settings import add_options, resolve
from pytest_boxlite.spec import in_guest

if TYPE_CHECKING:
    from pytest_boxlite.roles import HostPlugin, _SessionRole
    from pytest_boxlite.session import BoxliteSession
    from pytest_boxlite.settings import Settings

# Only what every pytest process with this plugin needs is imported here: options, fixtures,
# markers.  The roles (pool, runtimes, remote execution) are imported in pytest_configure where
# one is registered, so a box's own pytest does not pay for them at start-up (about 0.1 s).

#: The registered role object of this process (``HostPlugin`` or ``ControllerPlugin``).
ROLE_KEY = pytest.StashKey["_SessionRole"]()


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """The package's hookspecs (:mod:`pytest_boxlite.hooks`): how a feature joins a boxed test's path."""
    from pytest_boxlite import hooks

    pluginmanager.add_hookspecs(hooks)


def pytest_plugin_registered(plugin: object, manager: pytest.PytestPluginManager) -> None:
    """Features imported on demand (:func:`pytest_boxlite.hooks.join`: services, once a conftest
    imports them) are registered with this run as the conftest that imported them is."""
    from pytest_boxlite.hooks import enrol

    enrol(manager)


def pytest_itemcollected(item: pytest.Item) -> None:
    """... and as a test module that imports one has been collected (its items come next)."""
    from pytest_boxlite.hooks import enrol

    enrol(item.config.pluginmanager)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """A box's own pytest takes its role out of the environment before any conftest or test runs,
    so nothing they start inherits it (``spec.in_guest``)."""
    in_guest(early_config)


def _boots_nothing(config: pytest.Config) -> bool:
    """Runs that only list or collect (--collect-only, --fixtures, --markers, --help, ...)."""
    opt = config.option
    names = ("collectonly", "showfixtures", "show_fixtures_per_test", "markers", "help", "version")
    return any(getattr(opt, n, False) for n in names)


def _is_controller(config: pytest.Config) -> bool:
    """True for the xdist controller (it runs no pool); False for workers and plain runs.

    ``-d`` (``distload``) and ``-n`` become ``--dist=load`` only in xdist's own
    ``pytest_cmdline_main``, which may run after this plugin's (both are tryfirst; their order is
    the plugins' registration order, which the installed distributions decide): read all three.
    """
    opt = config.option
    distributed = getattr(opt, "dist", "no") != "no" or getattr(opt, "distload", False)
    return not hasattr(config, "workerinput") and bool(distributed or getattr(opt, "numprocesses", None))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """``--boxlite-scope=worker`` without ``-n``: run the whole session again inside one box."""
    if in_guest(config) or hasattr(config, "workerinput") or getattr(config.option, "numprocesses", None):
        return None
    if _is_controller(config):
        return None  # -d/--dist with --tx: each worker is boxed by the controller (or refused, if remote)
    if _boots_nothing(config):
        return None
    settings = resolve(config)
    if settings.scope != "worker":
        return None
    from pytest_boxlite.session_in_box import run_session_in_box

    return run_session_in_box(config, settings)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    if in_guest(config):
        settings = resolve(config)
        worker_scope = settings.scope == "worker" and not _boots_nothing(config)
        config.pluginmanager.register(GuestRole(terminal=worker_scope and _session_box(config)), "boxlite-guest")
        if worker_scope:
            from pytest_boxlite.session_in_box import WorkerScopeGuest

            config.pluginmanager.register(WorkerScopeGuest(settings), "boxlite-worker-scope")
            from pytest_boxlite.side_effects import WorkerScopeWatch

            config.pluginmanager.register(WorkerScopeWatch(config, settings), WorkerScopeWatch.NAME)
        return
    if _boots_nothing(config):
        return
    settings = resolve(config)
    if settings.sources["home"] != "default" and settings.url is None:
        # A home named by the command line, the environment or a project's ini file is checked
        # before anything looks into it (a checkout may ship one with links planted in it).
        from pytest_boxlite._homefs import check_home

        try:
            check_home(Path(settings.home).expanduser(), source=settings.sources["home"])
        except BoxliteError as exc:
            raise pytest.UsageError(str(exc)) from None
        except OSError as exc:  # not a directory, not readable by this user...
            raise pytest.UsageError(
                f"--boxlite-home {settings.home} is not usable ({exc.strerror or exc}; the value is from "
                f"{settings.sources['home']}); point --boxlite-home (or PYTEST_BOXLITE_HOME) at a writable "
                "directory of your own"
            ) from None
    configured = any(source != "default" for source in settings.sources.values())
    if not settings.all and not configured and not _is_controller(config):
        # Nothing is boxed unless a test asks for it: the host role waits for the first one.  A run
        # that sets any boxlite option (command line, ini, environment) gets it now, as one with
        # --boxlite does: a bad home, runtime or image stops the run at its start.
        lazy = LazyHost(config)
        config.stash[PROMOTE_KEY] = lazy.promote
        config.pluginmanager.register(lazy, LazyHost.NAME)
    else:
        _register_role(config)
    if not _is_controller(config):
        from pytest_boxlite.markers import MarkerCheck

        def kind() -> str:
            from pytest_boxlite.fixtures import get_session

            return get_session(config).choice.kind

        config.pluginmanager.register(MarkerCheck(config, kind), MarkerCheck.NAME)


def _register_role(config: pytest.Config) -> _SessionRole:
    """Make this process's role (host or controller) and register it."""
    from pytest_boxlite import ledger
    from pytest_boxlite.roles import ControllerPlugin, HostPlugin, worker_mounts_for
    from pytest_boxlite.session import BoxliteSession
    from pytest_boxlite.xdist_support import REMOTE_KEY, forget_controller_home

    workerinput = getattr(config, "workerinput", None)
    if workerinput and workerinput.get(REMOTE_KEY):
        forget_controller_home(config)  # it names a directory on the controller's machine
    settings = resolve(config)
    session_id = (workerinput.get("boxlite_session") if workerinput else None) or ledger.new_session_id()
    role: _SessionRole
    try:
        if _is_controller(config):
            session = BoxliteSession(
                settings,
                session_id=session_id,
                worker_id=None,
                worker_mounts=lambda: worker_mounts_for(config),
                project=config.rootpath,
            )
            role = ControllerPlugin(config, session)
        else:
            worker_id = workerinput.get("workerid") if workerinput else None
            role = HostPlugin(config, settings, session_id, worker_id)
    except BoxliteError as exc:
        raise pytest.UsageError(_named(settings, str(exc))) from None
    config.stash[SESSION_KEY] = role.session
    config.stash[ROLE_KEY] = role
    config.pluginmanager.register(role, role.NAME)
    if role.session.image_error is not None:
        # The run's own image (option, ini or environment) cannot be had: every box would fail
        # with it, so the run stops now, before any box, naming the option and its source.  (The
        # role is registered: its unconfigure releases what the session holds.)
        from pytest_boxlite.markers import session_image_error

        raise pytest.UsageError(session_image_error(role.session))
    if config.option.usepdb and isinstance(role, HostPlugin):
        config.pluginmanager.register(PdbNotice(_boxed_on(role)), "boxlite-pdb")
    if isinstance(role, ControllerPlugin):
        # A worker's marker refusals (any scope) end the run as a usage error.
        from pytest_boxlite.session_in_box import WorkerRefusals

        config.pluginmanager.register(WorkerRefusals(), "boxlite-worker-refusals")
    return role


def _named(settings: Settings, message: str) -> str:
    """``message`` with the option and its source in front where it is about the run's own image."""
    source = settings.sources.get("image", "default")
    if source == "default" or not message.startswith(f"image {settings.image!r}"):
        return message
    from pytest_boxlite.settings import source_text

    return f"--boxlite-image (from {source_text(source)}): {message}"


#: The fixtures whose sandboxes are boxes of the host's pool (``roles._BOX_FIXTURES``, the same set).
BOX_FIXTURES = frozenset({"boxlite_sandbox", "boxlite_module_sandbox", "boxlite_pool"})
#: What a home holds while any session, live or dead, has boxes or an owner lock in it: one
#: directory per runtime kind (``runtimes.LOCAL_KINDS``; namespace boxes by box name, vm homes by
#: owner) and the owners' locks.  A clean session leaves them empty.
HOME_STATE_DIRS = ("namespace", "vm", "sessions")
#: A box's name and its owner (``ledger._NAME``, the same pattern).
BOX_NAME = re.compile(r"^pbx-(?P<owner>[a-z0-9]+(?:-[A-Za-z0-9_]+)?)-(?P<seq>\d+)$")


def _owner_alive(home: Path, owner: str) -> bool:
    """Whether ``owner``'s process holds its lock (``ledger.owner_alive``, without its imports)."""
    try:
        # Never through a link (a home's entries are not followed, see _homefs).
        fd = os.open(home / "sessions" / f"{owner}.lock", os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def _has_keep_mark(dir_fd: int, name: str) -> bool:
    """Whether the vm home ``name`` (an owner's, in ``dir_fd``) is marked kept; no link followed."""
    try:
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.stat("keep", dir_fd=sub, follow_symlinks=False).st_mode)
    except OSError:
        return False
    finally:
        os.close(sub)


def _has_state(home: Path) -> bool:
    """Whether ``home`` may hold leftovers of a dead session to reconcile: its state directories
    hold anything but a live owner's lock, boxes and vm home (a concurrent run, or the xdist
    controller of this one, is no reason to reconcile).  A missing or unreadable directory holds
    nothing this process could reconcile either."""
    for kind in HOME_STATE_DIRS:
        try:
            # Never through a link: one planted as a state directory is the session's to refuse.
            fd = os.open(home / kind, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError:
            return True  # a link or unreadable: the host role is made, and refuses it clearly
        try:
            with os.scandir(fd) as entries:
                names = [e.name for e in entries]
            # Kept for debugging (--boxlite-keep): reconciling leaves these, so they are no reason
            # to make the host role at every later run (``clean --kept`` removes them).  A box
            # is kept by a ``.keep`` mark beside it, an owner's home by a ``keep`` file in it.
            kept = {n.removesuffix(".keep") for n in names if n.endswith(".keep")}
            kept.update(n for n in names if "." not in n and _has_keep_mark(fd, n))
        except OSError:
            continue
        finally:
            os.close(fd)
        for name in names:
            if kind == "sessions":
                owner = name.removesuffix(".lock") if name.endswith(".lock") else None
            elif kind == "namespace":
                # A box's directory, or its control directory or keep mark beside it.
                base = name.removesuffix(".ctl").removesuffix(".keep")
                if base in kept:
                    continue
                m = BOX_NAME.match(base)
                owner = m.group("owner") if m else None
            else:
                if name in kept:
                    continue
                owner = name
            if owner is None or not _owner_alive(home, owner):
                return True
    return False


def _needs_box(item: pytest.Item) -> bool:
    """Without ``--boxlite``: the item is marked ``boxlite`` or leases sandboxes (see ``markers.plan_for``)."""
    return item.get_closest_marker("boxlite") is not None or bool(
        BOX_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    )


class LazyHost:
    """The host of a run without ``--boxlite`` (plain or an xdist worker) until a test is boxed.

    Most runs of a project that installs the plugin box nothing.  This stand-in holds off the host
    role (:class:`~pytest_boxlite.roles.HostPlugin`: the pool, the runtimes, the home's
    preparation and owner lock, the runtime's probing for the header) until something needs a
    box: a test marked ``boxlite`` or taking a sandbox fixture (at collection), service fixtures
    (after it), a sandbox fixture asked for with ``request.getfixturevalue`` (see
    :func:`pytest_boxlite.fixtures.get_session`), or a home that holds state of another session at
    the session's start (the role reconciles dead sessions' leftovers then, as always).  Once
    made, the role gets the hook calls it missed; the header lines, if pytest shows a header, come
    after the collection line instead.
    """

    NAME = "boxlite-lazy-host"

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.role: HostPlugin | None = None
        self._session: pytest.Session | None = None
        #: The role was made before the terminal wrote the header (it has its lines there).
        self._in_header = False
        self._late_header_done = False

    def promote(self) -> BoxliteSession:
        """Make and register the host role (once), replaying the session start it missed; its session."""
        return self._host().session

    def _host(self) -> HostPlugin:
        if self.role is None:
            from pytest_boxlite.roles import HostPlugin

            role = _register_role(self.config)
            if not isinstance(role, HostPlugin):  # pytest_configure makes no LazyHost for a controller
                raise TypeError(f"pytest-boxlite: a LazyHost made a {type(role).__name__}, not the host role")
            self.role = role
            if self._session is not None:
                role.pytest_sessionstart(self._session)
        return self.role

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self._session = session
        if _has_state(Path(resolve(self.config).home).expanduser()):
            self.promote()
        # tryfirst: before the terminal's own session start writes the header.
        self._in_header = self.role is not None

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        if self.role is not None:
            return  # the role itself is registered now and sees this call
        if _needs_box(item):
            self._host().pytest_itemcollected(item)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if self.role is not None:
            return
        # Another plugin or a conftest may have marked items after their collection.
        if any(_needs_box(item) for item in items):
            self._host().pytest_collection_modifyitems(config, items)

    def pytest_report_collectionfinish(self, config: pytest.Config) -> list[str]:
        """The role's header lines, for a role made after the header was written."""
        if self.role is None or self._in_header or self._late_header_done:
            return []
        self._late_header_done = True
        if config.get_verbosity() < 0 or config.option.no_header:
            return []  # where pytest writes no header
        return self.role.pytest_report_header(config)


#: A setup report's attribute naming why its test ran on the host under ``--boxlite`` (it survives
#: xdist's report serialization, so the controller's summary counts its workers' tests).
ON_HOST_ATTR = "boxlite_on_host"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    reason = item.stash.get(ON_HOST_KEY, None)
    if reason is not None and report.when == "setup":
        setattr(report, ON_HOST_ATTR, reason)
    return report


def _boxed_anything(config: pytest.Config) -> bool:
    """This run made boxes, or asked for side effects or usage (the worker scope's controller
    makes none itself): only then is there a side-effects or usage summary to write."""
    from pytest_boxlite.fixtures import SESSION_KEY

    if SESSION_KEY in config.stash:
        return True
    return any(
        config.getoption(f"boxlite_{name}", None) or os.environ.get(f"PYTEST_BOXLITE_{name.upper()}")
        for name in ("side_effects", "usage")
    ) or bool(config.getini("boxlite_side_effects"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line for the tests that ``--boxlite`` left on the host because they lease sandboxes;
    the side effects and usage of boxed tests (``--boxlite-side-effects``, ``--boxlite-usage``)."""
    if _boxed_anything(terminalreporter.config):
        from pytest_boxlite import side_effects  # not imported by a run that boxes nothing

        side_effects.summary(terminalreporter)
    on_host: dict[str, str] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            reason = getattr(rep, ON_HOST_ATTR, None)
            if isinstance(reason, str) and getattr(rep, "when", None) == "setup":
                on_host[rep.nodeid] = reason
    if on_host:
        fixtures = sorted({name for reason in on_host.values() for name in reason.split(", ")})
        n = len(on_host)
        terminalreporter.write_line(
            f"boxlite: {n} test{'s' if n != 1 else ''} ran on the host, not in a box: "
            f"{'they use' if n != 1 else 'it uses'} {', '.join(fixtures)}, whose sandboxes are boxes "
            "from the host's pool (a box starts no boxes)"
        )


def _boxed_on(role: _SessionRole) -> Callable[[pytest.Item], bool]:
    """Whether an item runs in a box of ``role``'s session (its plan; a bad marker is no box)."""
    from pytest_boxlite.markers import plan_for

    def boxed(item: pytest.Item) -> bool:
        try:
            return plan_for(item, role.session) is not None
        except pytest.UsageError:
            return False

    return boxed


class PdbNotice:
    """``--pdb`` and boxed tests that failed without a box relaying their debugger (no box could
    be had for them, say): each gets a line saying how to debug that test here, where pytest
    would have entered the debugger.  A test that ran in a box (forked per test or booted) had
    pytest's post-mortem opened by the box itself, relayed to this terminal: no line for those."""

    def __init__(self, boxed: Callable[[pytest.Item], bool]) -> None:
        self._boxed = boxed
        self._item: pytest.Item | None = None
        self._told: set[str] = set()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
        self._item = item
        try:
            return (yield)
        finally:
            self._item = None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        item = self._item
        if not report.failed or item is None or report.nodeid != item.nodeid or report.nodeid in self._told:
            return
        if not self._boxed(item):
            return
        from pytest_boxlite.remote.debug_relay import RELAYED

        if item.stash.get(RELAYED, False):
            return  # its box opened the debugger on this terminal
        self._told.add(report.nodeid)
        reporter = item.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            # ensure_newline knows only of a file's progress line: a progress letter written after the
            # "waiting for a box" line (or under -qq) leaves the cursor mid-line all the same.
            if item.config.get_terminal_writer().width_of_current_line:
                reporter.write("\n")
            reporter.ensure_newline()
            reporter.write_line(
                f"boxlite: --pdb: {report.nodeid} failed before a box could open its debugger here; "
                f"to debug it: pytest -p no:boxlite --pdb {report.nodeid}",
                yellow=True,
            )


def _session_box(config: pytest.Config) -> bool:
    """This pytest is the whole session in one box (``--boxlite-scope=worker`` without xdist), which
    is handed the user's stdin, stdout and stderr themselves (see ``run_session_in_box``): pdb and
    ``--pdb`` work there as locally."""
    return not hasattr(config, "workerinput") and "PYTEST_XDIST_WORKER" not in os.environ


def _caller() -> str:
    """``file:line`` of the code that called the debugger (the first frame outside it and pytest)."""
    skip = ("pdb.py", "bdb.py", *(f"{os.sep}{pkg}{os.sep}" for pkg in ("_pytest", "pluggy", "pytest_boxlite")))
    for frame in reversed(traceback.extract_stack()):
        if not any(part in frame.filename for part in skip):
            return f"{frame.filename}:{frame.lineno}"
    return "?"


class GuestRole:
    """Inside a box's pytest (boxed tests, ``--boxlite-scope=worker``): the host does the boxing."""

    def __init__(self, *, terminal: bool = False) -> None:
        #: pdb can use the user's terminal from this box (see ``_session_box``).
        self.terminal = terminal

    def pytest_enter_pdb(self, config: pytest.Config, pdb: object) -> None:
        """``breakpoint()``, ``pdb.set_trace()`` and ``pytest.set_trace()`` in a box: in a test's run
        (in a box forked per test or booted) the debugger is relayed to the host's terminal
        (``guest/debugger.py``); under xdist it reads end-of-file, as in an unboxed xdist worker
        (``bdb.BdbQuit``); outside a test's run (the box's collection: module-level code) no
        debugger reaches the user's terminal, so it fails at that line saying so."""
        if self.terminal:
            return  # the session's own box, with the user's stdin and stdout: pdb works as locally
        from pytest_boxlite.guest import debugger

        if debugger.current() is not None:
            return  # relayed to the host (or end-of-file under xdist): see BoxDebugger
        if debugger.under_xdist():
            # As pdb in an unboxed xdist worker: its stdin has nothing, the test fails with BdbQuit.
            pdb.stdin = io.StringIO("")  # type: ignore[attr-defined]
            pdb.use_rawinput = False  # type: ignore[attr-defined]
            return
        # pytest suspended capturing to hand the terminal to pdb; nobody resumes it if we refuse.
        capman = config.pluginmanager.getplugin("capturemanager")
        if capman is not None and hasattr(capman, "resume"):
            capman.resume()
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" (")[0]
        where = _caller()
        target = test or where.rpartition(":")[0] or "."
        pytest.fail(
            f"[boxlite] {test or 'collecting in a box'}: a debugger was asked for at {where}, outside any "
            "test's run in a box of pytest-boxlite (a boxed test's own debugger is relayed to your "
            "terminal; the box's collection has none). To debug it, run it unboxed: "
            f"pytest -p no:boxlite {target}",
            pytrace=False,
        )

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        # A --basetemp the host chose (or xdist's per-worker one) lies under the host's /tmp, which
        # the box does not share: make its parent, so tmp_path works as it does on the host.
        basetemp = item.config.option.basetemp
        if basetemp:
            Path(basetemp).resolve().parent.mkdir(parents=True, exist_ok=True)
