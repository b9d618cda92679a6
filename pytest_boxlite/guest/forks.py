"""The fork server in a warm box: ``FORK`` -> a fresh box, forked from this warm interpreter.

Each box inherits the session's collection (and, with ``--boxlite-scope=test``, the fixtures wider
than a function's, set up by :class:`~pytest_boxlite.guest.session.GuestPlugin`), takes new
namespaces and layers (:mod:`pytest_boxlite.guest.fresh`), connects to the host's socket and runs
each ``RUN`` the host sends on it, until the stream ends.  The host asks how a box ended with
``WAIT``, ``POLL`` and ``KILL`` (see :mod:`pytest_boxlite.guest.messages`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from pytest_boxlite.guest.boxinit import IN_TEST, BareInit
from pytest_boxlite.guest.fresh import (
    clone_box,
    die_with_parent,
    drop_cells,
    enter_test_namespaces,
    held_cell_fds,
    seal_init,
    take_cell,
)
from pytest_boxlite.guest.ids import IdMapper
from pytest_boxlite.guest.layers import KEEP_LAYERS, fresh_box
from pytest_boxlite.guest.messages import ERROR, FORK, FORKED, KILL, POLL, RUN, STATUS, TOKEN, WAIT, tag
from pytest_boxlite.guest.session import _prepare_debugger, _take_fields

if TYPE_CHECKING:
    from pytest_boxlite.guest.session import GuestPlugin

#: Signals the init of a forked box passes on to the test process (the rest it ignores, as init does).
_FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")


def _init(child: int) -> None:
    """Be the init of a forked box: forward signals to ``child``, reap orphans, exit as it exits.

    The test process is then never pid 1 of its pid namespace, so signals without a handler kill
    it and ``getppid()`` is not 0, as locally.  A child killed by signal N makes this process exit
    with 128+N (pid 1 cannot die by a signal it sends itself); the host reads it back that way.
    """

    def forward(signum: int, frame: object) -> None:
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


def _cut_channel(channel: Any) -> None:
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


def _forget_cached_host_facts() -> None:
    """State the warm interpreter computed before the fork that is not true in the new box."""
    import platform

    # platform.uname() is cached: the new box has its own hostname.
    if hasattr(platform, "_uname_cache"):
        platform._uname_cache = None


def _run_then_exit(what: str, steps: Callable[[], None]) -> NoReturn:
    """In a fork: ``steps``, then exit (70, said on stderr, if they raised): a fork must never
    return into the warm interpreter's loop."""
    code = 0
    try:
        steps()
    except BaseException as exc:
        try:
            sys.stderr.write("pytest-boxlite: %s failed: %r\n" % (what, exc))
        finally:
            code = 70
    finally:
        os._exit(code)


class _Forked:
    """The boxes this warm interpreter forked, and how each ended (its pid 1's exit code).

    Each FORKED tells the host which boxes have ended since the last one (no round trip per box).
    The host asks how one ended (WAIT, POLL, KILL) only when its test's stream ended early, and
    by then later FORKs may have reaped it (on a busy machine the test can die before this
    interpreter reads the next FORK): the codes of the last :data:`KEPT` reaped boxes stay known.
    """

    KEPT = 256

    def __init__(self) -> None:
        #: pid -> exit code, None while the box runs (in the order they were forked).
        self.codes: dict[int, int | None] = {}

    def add(self, pid: int) -> None:
        self.codes[pid] = None

    def reap(self) -> list[int]:
        """Reap the boxes that have ended: their pids (the host is told in FORKED)."""
        ended = [pid for pid, code in list(self.codes.items()) if code is None and self.wait(pid, 0) is not None]
        reaped = [pid for pid, code in self.codes.items() if code is not None]
        for pid in reaped[: max(0, len(reaped) - self.KEPT)]:
            del self.codes[pid]
        return ended

    def wait(self, pid: int, timeout: float = 5.0) -> int | None:
        """``pid``'s exit code, waiting up to ``timeout`` seconds; None if it still runs, or is unknown."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return self.codes.get(pid)  # reaped already: its code was kept
            if done:
                code = os.waitstatus_to_exitcode(status)
                self.codes[pid] = code
                return code
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)


class ForkServer:
    """The warm interpreter's fork messages (``FORK``, ``WAIT``, ``POLL``, ``KILL``) for ``plugin``,
    the session whose collection (and prepared fixtures) every forked box inherits."""

    def __init__(self, plugin: GuestPlugin, channel: Any) -> None:
        self.plugin = plugin
        self.channel = channel
        self.forked = _Forked()
        #: The debugger relay's hooks are registered here (``_prepare_debugger``, at the first FORK).
        self.debugger_prepared = False

    def install(self) -> None:
        """Take the fork messages of ``plugin``'s channel."""
        self.plugin.handlers.update(
            {
                FORK: lambda fields: self.fork(**fields),
                WAIT: lambda fields: self.status(fields["pid"], 5.0),
                POLL: lambda fields: self.status(fields["pid"], 0),
                KILL: self.kill,
            }
        )

    def status(self, pid: int, timeout: float) -> None:
        """``WAIT`` (up to 5 s) or ``POLL`` (at once): how box ``pid`` ended, if it has."""
        self.channel.send((STATUS, {"code": self.forked.wait(pid, timeout=timeout)}))

    def kill(self, fields: dict[str, Any]) -> None:
        """``KILL``: end box ``pid`` and say how it ended."""
        try:
            os.kill(fields["pid"], 9)
        except ProcessLookupError:
            pass
        self.channel.send((STATUS, {"code": self.forked.wait(fields["pid"])}))

    def fork(
        self,
        nodeid: str,
        token: str,
        sock: str,
        hostname: str,
        network: bool,
        renew_all: bool = False,
        shared: bool = False,
        cell: Any = None,
        services: Any = None,
        changes: bool = False,
        in_place: bool = False,
        **extra: Any,
    ) -> None:
        """Fork a fresh box for ``nodeid`` (collected here first, so the box inherits it) that
        runs each ``RUN`` the host sends on its stream (one, or a module's), until the stream ends.

        ``renew_all``: the box is a VM, whose writable directories are no overlays (see
        ``fresh_box``).  ``shared``: the fixtures wider than a function's are set up here
        first (see ``_prepare``), so the box inherits them.  ``cell``: where the host hands the
        box its own cgroups and stderr (``take_cell``).  ``services``: the services the item
        uses, for its wider fixtures set up here (``_take_fields``).  ``changes``: the box keeps
        a handle on each of its fresh layers, for ``RUN``'s ``changes`` (guest/changes.py).
        ``in_place``: no fresh box, a plain fork in this box (see :meth:`_fork_in_place`).
        ``extra``: what other plugins' ``pytest_boxlite_box_fields`` added, handed on too."""
        plugin = self.plugin
        _take_fields(plugin.config, {**extra, "services": services})
        # Reap boxes that have ended, and tell the host which (in FORKED): it then needs no
        # round trip per box to learn that a box it is done with has gone.
        ended = self.forked.reap()
        item, error = plugin._item(nodeid)
        if item is None:
            self.channel.send((ERROR, {"text": error}))
            return
        plugin._locate(item)
        stop = plugin._prepare(item) if shared else None
        if not self.debugger_prepared:
            # Here, once per warm interpreter: not in every box (see guest/debugger.py _Hooks).
            _prepare_debugger(item.config)
            self.debugger_prepared = True
        if in_place:
            self._fork_in_place(ended, stop, token, sock)
            return
        # Root's fresh box maps every id into its new user namespace: this process writes the maps.
        # On a VM (renew_all) root forks the box as root of the VM's kernel: no maps to write.
        real_root = bool(renew_all) and os.geteuid() == 0
        mapper = IdMapper() if os.geteuid() == 0 and not real_root else None
        init = None
        try:
            dealt = take_cell(cell) if cell else None
            if not real_root:
                init = self._bare_init(mapper, dealt)
            pid = clone_box(network, mapper, real_root, cell=dealt, init=init)
        except OSError as exc:
            if mapper is not None:
                mapper.close_parent_side()
                mapper.close_child_side()
            if init is not None:
                init.discard()
            self.channel.send((ERROR, {"text": "fork failed: %s" % exc}))
            return
        if pid <= 0:
            # Here: in the fresh box, in its new namespaces, ids mapped: its test process (IN_TEST:
            # pid 1 forked it at once, see BareInit) or its pid 1 (0: it forks the test process).
            self._in_box(pid, init, stop, token, sock, hostname, network, renew_all, changes)
        if init is not None:
            init.discard()
        self.forked.add(pid)
        # The maps first: the box waits for them, while the host can wait for FORKED (with
        # boxes made ahead it is not waiting on this box's test yet).
        if mapper is not None:
            mapper.serve(pid)
        plugin.prepare_warnings = []  # the box's to report
        self.channel.send((FORKED, {"pid": pid, "ended": ended}))
        if shared:
            plugin._renew_capture(item.config)

    def _in_box(
        self,
        pid: int,
        init: BareInit | None,
        stop: Any,
        token: str,
        sock: str,
        hostname: str,
        network: bool,
        renew_all: bool,
        changes: bool,
    ) -> None:
        """The fresh box's side of :meth:`fork` (``pid`` is what ``clone_box`` returned there): become
        the box, then run the host's ``RUN``\\ s on the socket ``sock``.  Never returns."""

        def become_the_box() -> None:
            # Connect first: the fresh box gets a new /run, which hides the socket's directory.
            conn = self._connect(sock)
            # A root directory of its own too, but for a VM's box: it moves into an overlay of /.
            KEEP_LAYERS[0] = bool(changes)
            fresh_box(hostname, network, renew_all, own_root=not renew_all)
            if pid == IN_TEST:
                assert init is not None  # IN_TEST comes only from a box whose pid 1 is a BareInit
                nested = init.nested
            else:
                if init is not None:
                    init.discard()  # made by fork(3) (see clone_box): this pid 1 forks its test itself
                nested = IdMapper() if os.geteuid() == 0 else None
                test = os.fork()
                if test:
                    conn.close()  # the host sees the stream end when the test process ends
                    seal_init()
                    if nested is not None:
                        nested.serve(test)
                    _init(test)
            enter_test_namespaces(network, nested)
            _forget_cached_host_facts()
            self._serve_runs(conn, token, stop)

        _run_then_exit("forked box", become_the_box)

    def _fork_in_place(self, ended: list[int], stop: Any, token: str, sock: str) -> None:
        """An in-place fork: a plain ``fork(2)`` of this interpreter that stays in this box (no
        namespaces, layers or pid 1 of its own), then runs the host's ``RUN``\\ s on ``sock`` as a
        fresh box does.  What its test writes stays in this box (``--boxlite-keep`` keeps it), and
        one fork serves a module's tests (boot mode's module scope keeps their state)."""
        import warnings

        try:
            with warnings.catch_warnings():
                # Python 3.12 warns of fork() beside execnet's reader thread: it waits in read(2)
                # without the GIL, and fork(3) takes libc's locks first (see fresh.clone_box).
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError as exc:
            self.channel.send((ERROR, {"text": "fork failed: %s" % exc}))
            return
        if pid == 0:

            def serve() -> None:
                die_with_parent()
                drop_cells()  # a test must never take another box's cgroups or log
                self._serve_runs(self._connect(sock), token, stop)

            _run_then_exit("in-place fork", serve)
        self.forked.add(pid)
        self.plugin.prepare_warnings = []  # the fork's to report
        self.channel.send((FORKED, {"pid": pid, "ended": ended}))

    def _connect(self, sock: str) -> socket.socket:
        """In a fork: connect to the host's socket ``sock``, then cut the warm interpreter's channel."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(sock)
        _cut_channel(self.channel)
        return conn

    def _serve_runs(self, conn: socket.socket, token: str, stop: Any) -> None:
        """In a forked box (fresh or in place): say ``TOKEN``, then run each ``RUN`` the host
        sends on ``conn`` (``stop``: where its teardown stops, see ``GuestPlugin._prepare``)."""
        plugin = self.plugin
        plugin.stop = stop
        out = conn.makefile("wb")

        def send(name: str, **fields: Any) -> None:
            out.write((json.dumps([name, tag(fields)]) + "\n").encode())
            out.flush()

        send(TOKEN, token=token)
        plugin.send = plugin._locked(send)
        # Every test, the first included, starts on the host's RUN: a box may be made
        # ahead, while the test before it still runs, and must not start before its turn.
        commands = conn.makefile("rb")
        plugin.commands = commands  # the test's debugger reads the host's answers here too
        while True:
            line = commands.readline(1 << 20)
            if not line:
                break  # the host is done with this box
            name, fields = json.loads(line)
            if name != RUN:
                break
            plugin.run_fields(fields)
        out.close()
        conn.close()

    def _bare_init(self, mapper: IdMapper | None, dealt: Any) -> BareInit:
        """The init a test's box runs as its pid 1 once it has forked its test process (see
        guest/boxinit.py's BareInit): it closes what of the warm interpreter's it must not
        hold, and serves a root test's nested id maps (the same one-to-one maps as its own)."""
        close = [*(mapper.fds() if mapper is not None else ()), *held_cell_fds(dealt)]
        nested = maps = None
        if mapper is not None:
            nested = IdMapper(proc=False)
            maps = mapper.id_maps()
        return BareInit([getattr(signal, name) for name in _FORWARDED], close, nested, maps)
