"""The boxes forked from warm interpreters, and the one way to run an item: in a fork.

Every boxed test runs in a fork of its box's warm interpreter (:mod:`.warm`), of one of two kinds:
fresh (new namespaces and layers, the default; forked ahead of its turn) or in place (a plain
fork in the warm interpreter's own box: ``--boxlite-fresh=boot``, ``--boxlite-keep``, a kernel
that refuses fresh forks).  Either connects to the host's socket and runs each ``RUN`` sent there.

This module owns the boxes' side of an item's run, and only that: :meth:`ForkedBoxes.fork` and
:meth:`~ForkedBoxes.run_in` start the run (the box made or found, RUN sent) and hand the executor
a :class:`BoxRun`; the executor has :func:`pytest_boxlite.remote.transport.drain` read the test's
messages, then :meth:`ForkedBoxes.end` ends the box (killed or reaped, its exit and its log read:
an :class:`Ended`), and :func:`pytest_boxlite.remote.reports.finish` makes the reports.  Nothing
here reads a test's messages (but a forked box's TOKEN, as it connects) or makes a report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import socket
import threading
import time
from collections.abc import Container, Sequence
from typing import Any

import execnet
import pytest

from pytest_boxlite import side_effects
from pytest_boxlite._shown import shown
from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.guest import messages as msg
from pytest_boxlite.hooks import BoxAccess
from pytest_boxlite.pool import Lease
from pytest_boxlite.remote.transport import ForkStream, Outcome, RefusedMessage, Stream
from pytest_boxlite.remote.warm import OOM, WarmInterpreter, WarmInterpreters, describe_status
from pytest_boxlite.runtimes.base import BoxHandle, ForkCell

#: At most this many pids of one FORKED's list of ended boxes are read (one per box made since
#: the last FORK is what an honest warm interpreter sends).
_ENDED_CAP = 1024
#: How long a forked box may go on after its DONE before it is killed.
FORK_GRACE = 2.0
#: Boxes made ahead per warm interpreter, at most: two keep a box being made at every moment of a
#: run of trivial tests (making one takes longer than such a test), more only hold memory.
AHEAD_MAX = 2


@dataclasses.dataclass
class ForkedBox:
    """A box forked from a warm interpreter, serving one test or a module's tests over its stream."""

    name: str
    handle: BoxHandle  # the fork parent's box
    worker: WarmInterpreter
    child: int
    stream: ForkStream | None  # None until the box has connected and shown its token
    oom_before: int
    alive: bool = True
    nodeid: str = ""  # the test it was forked for (collected in the warm interpreter first)
    token: str = ""
    network: bool = False
    #: Why there is no box after all (the warm interpreter's answer to the FORK); ``child`` is -1
    #: until that answer is read (see ``ForkedBoxes._sync``).
    error: str | None = None
    #: The box's own cgroups and stderr, where the runtime gives it some (``fork_cell``).
    cell: ForkCell | None = None
    #: A fork in its warm interpreter's own box (no namespaces, layers or pid 1 of its own): boot
    #: mode's and ``--boxlite-keep``'s boxes, whose tests' files stay in the box.
    in_place: bool = False


@dataclasses.dataclass
class BoxRun:
    """One item's run in a forked box as the runner started it (:meth:`ForkedBoxes.fork`,
    :meth:`~ForkedBoxes.run_in`): the executor drains ``stream`` (if any) into ``outcome``, then
    has :meth:`ForkedBoxes.end` end it."""

    handle: BoxHandle  # the forked box's warm interpreter's box
    start: float
    timeout: float
    #: The fork is in place (in ``handle``'s own box): its report names that box.
    in_place: bool = False
    #: The messages to drain, and the run's number they carry; None: nothing to read.
    stream: Stream | None = None
    seq: int = 0
    #: What the box said: :func:`transport.drain`'s result once drained; for a run that went no
    #: further, what stands for it (a box that never connected: a timeout; a RUN that could not be
    #: sent: the broken connection).
    outcome: Outcome = dataclasses.field(default_factory=Outcome)
    #: Whether RUN was sent (or its sending failed): :meth:`ForkedBoxes.end` settles the box then.
    started: bool = False
    box: ForkedBox | None = None  # the forked box the test was sent to
    held: bool = False  # that box was forked for an earlier test of its module (module scope)
    #: Why the test could not be run (its setup fails with that), and the duration it reports.
    failure: str | None = None
    duration: float | None = None  # None: the time from ``start`` to the run's end
    cell: ForkCell | None = None  # the forked box's own cell, whose log the reports quote


@dataclasses.dataclass
class Ended:
    """What is left of a run once :meth:`ForkedBoxes.end` has ended its box, for its reports."""

    #: The box that ran the test (the ``boxlite_box`` property of its teardown report).
    name: str
    duration: float
    timeout: float
    #: Why the test could not be run (:attr:`BoxRun.failure`).
    failure: str | None
    #: How the box's test process ended, in words, for a run that ended without DONE.
    how: str
    #: The box log's tail since the test began, where the reports quote it (a run that did not finish).
    log: tuple[str, str] | None
    #: The forked box, still open for the next test of its module (module scope); else None.
    box: ForkedBox | None
    #: Whether the warm interpreter the test ran under is still usable.
    worker_alive: bool
    #: ``pytest.exit``'s reason and return code, if the test called it.
    exit: tuple[str, int] | None
    #: What the box used, from its own cgroups where it has them (``ForkCell.usage``).
    usage: dict[str, int] = dataclasses.field(default_factory=dict)


def _left(start: float, timeout: float) -> float:
    """The seconds left of a test's bound, for the box to send its last words when they pass."""
    return max(0.0, start + timeout - time.monotonic())


def escape_controls(text: str) -> str:
    """``text`` with every character that could act on a terminal escaped (:func:`_shown.shown`)."""
    return shown(text)


def _service_fields(
    config: pytest.Config, *, item: pytest.Item | None = None, nodeid: str = "", wide_only: bool = False
) -> dict[str, Any]:
    """What plugins add to an item's ``RUN`` or ``FORK`` (``pytest_boxlite_box_fields``: the
    services it uses, described)."""
    fields: dict[str, Any] = {}
    nodeid = nodeid or (item.nodeid if item is not None else "")
    for found in config.hook.pytest_boxlite_box_fields(config=config, item=item, nodeid=nodeid, wide_only=wide_only):
        if not isinstance(found, dict) or not all(isinstance(k, str) for k in found):
            raise BoxliteError(f"a pytest_boxlite_box_fields hook returned {found!r:.200}, not a dict with str keys")
        taken = sorted(set(found) & set(fields))
        if taken:
            raise BoxliteError(f"two pytest_boxlite_box_fields hooks returned the field(s) {', '.join(taken)}")
        fields.update(found)
    return fields


def _first_problem(
    config: pytest.Config, box: BoxAccess, item: pytest.Item | None, nodeid: str, *, wide_only: bool
) -> str | None:
    """Why what the item needs cannot be made reachable in ``box`` (``pytest_boxlite_reach``), if so."""
    for why in config.hook.pytest_boxlite_reach(config=config, box=box, item=item, nodeid=nodeid, wide_only=wide_only):
        if why:
            return str(why)
    return None


class ForkedBoxes:
    """The boxes forked from warm interpreters (:class:`~.warm.WarmInterpreters`), fresh or in
    place, and their bookkeeping: forked ahead, lingering, their cells, the answers owed."""

    def __init__(self, warm: WarmInterpreters) -> None:
        self.warm = warm
        self.config = warm.config
        self._lock = threading.Lock()
        #: Per fork parent: the socket its forks connect to, and that socket's path in the box.
        self._listeners: dict[str, tuple[socket.socket, str]] = {}
        self._log_since: dict[str, int] = {}
        self._seq = 0  # every run's number: its messages carry it (see transport.drain)
        #: Per warm interpreter: the boxes asked for whose FORKED answer is still on its channel,
        #: oldest first (the answers come in order, and every other request reads them first).
        self._pending: dict[WarmInterpreter, list[ForkedBox]] = {}
        #: Forked boxes that said DONE but may not have exited yet: (warm interpreter, pid, kill-after).
        self._lingering: list[tuple[WarmInterpreter, int, float]] = []
        #: Cells of boxes that are done: killed at once, their cgroups removed once empty.
        self._done_cells: list[ForkCell] = []
        #: A box without cgroups is done: it is ended before the next test runs (see ``close``).
        self._end_now = False
        #: Boxes forked ahead for the next tests, in their order, per fork parent (see ``fork``).
        self._ahead: dict[str, list[ForkedBox]] = {}
        #: Boxes forked from warm interpreters, and how long each took beyond the test's own phases.
        self.forks = 0
        self.fork_waits: list[float] = []
        #: Forks inherit the fixtures wider than a function's from their warm interpreter, which
        #: sets them up (``--boxlite-scope=test``; see ``teardown_shared``).
        self.share_fixtures = False

    # -- a warm interpreter's forks ------------------------------------------------------------
    def stop_warm(self, handle: BoxHandle) -> None:
        """Stop ``handle``'s warm interpreter; the box is killed right after (with any box forked
        ahead in it)."""
        self._forget(handle)
        self.warm.stop(handle)

    def shutdown(self) -> None:
        """End every forked box still open and remove the cells of those that are done."""
        for parent in list(self._ahead):
            self._drop_ahead(parent)
        with contextlib.suppress(Exception):
            self._reap_lingering(final=True)
        cells, self._done_cells = self._done_cells, []
        for cell in cells:
            cell.remove()
        with self._lock:
            listeners, self._listeners = list(self._listeners.values()), {}
        for sock, _ in listeners:  # boxes that ended without passing through stop_warm
            sock.close()

    # -- running --------------------------------------------------------------------------
    def fork(
        self,
        item: pytest.Item,
        lease: Lease,
        *,
        network: bool,
        next_nodeid: str | None,
        timeout: float,
        ahead: Sequence[str] = (),
        in_place: bool = False,
    ) -> BoxRun:
        """Start ``item`` in a box forked from the leased box's warm interpreter: a fresh one, or
        with ``in_place`` a plain fork in the leased box itself (no namespaces or layers of its
        own: what its test writes stays in that box; see ``guest/forks.py``).

        The fork gets new namespaces and empty writable layers, so it is as pristine as a newly
        booted box, at the cost of a fork (namespace runtime).  The box is the one made ahead for
        ``item`` (see ``ahead``) if there is one, else it is forked now.  ``ahead``: the node ids of
        the next tests that will need new boxes from this warm interpreter, in order; their boxes
        are forked while ``item`` runs (each a box of its own, which starts its test only on that
        test's ``RUN``).  Two ahead let one box be made while the next one's last steps and this
        test run side by side: making a box takes longer than running a trivial test in one.
        Returns the run (see :class:`BoxRun`); once :meth:`end` has ended it, a box still open
        takes more items (:meth:`run_in`) until :meth:`close`.
        """
        handle = lease.handle
        start = time.monotonic()
        # Failure reports quote only what the box's fork parent logged since this test began: a box
        # made ahead was forked while the test before it ran, whose writes are not this test's.
        self._log_since[handle.name] = handle.log_size()
        box = None if in_place else self._take_ahead(handle.name, item.nodeid, network)
        if box is None:
            made = self._send_fork(handle, item.nodeid, network, in_place=in_place)
            if isinstance(made, str):
                return BoxRun(handle, start, timeout, in_place, failure=made, duration=0.0)
            box = made
        # With shared fixtures the answer comes once they are set up (a slow session fixture's
        # time): the test's own bound, as when its box set them up itself.
        shared = self.share_fixtures and not in_place
        why = self._resolve(box, timeout if shared else min(timeout, 30.0))
        if why is not None:
            return BoxRun(handle, start, timeout, in_place, failure=why, duration=0.0)
        if box.stream is None:
            try:
                box.stream = self._accept_fork(
                    box.worker, self._fork_listener(handle)[0], box.token, box.child, start + timeout, handle.name
                )
            except TimeoutError:
                box.alive = False
                self._retire(box)
                self._fork_status(box.worker, msg.KILL, box.child)
                return BoxRun(handle, start, timeout, in_place, outcome=Outcome(timed_out=True), cell=box.cell)
            if box.stream is None:
                box.alive = False
                self._retire(box)
                died = self._fork_status(box.worker, msg.WAIT, box.child)
                why = f"the box died before it could run the test: it {describe_status(died, forked=not in_place)}"
                duration = time.monotonic() - start
                return BoxRun(handle, start, timeout, in_place, failure=why, duration=duration, cell=box.cell)
        return self.run_in(box, item, next_nodeid=next_nodeid, timeout=timeout, start=start, ahead=ahead)

    def run_in(
        self,
        box: ForkedBox,
        item: pytest.Item,
        *,
        next_nodeid: str | None,
        timeout: float,
        start: float | None = None,
        ahead: Sequence[str] = (),
    ) -> BoxRun:
        """Start an item in a live forked box (the first, or another of its module: module scope):
        what is done of earlier boxes is ended first, then RUN is sent.

        ``ahead``: as for :meth:`fork`, the boxes for those tests are forked once this item has started.
        """
        assert box.stream is not None and box.alive
        held = start is None
        if start is None:  # another test of a module's box: its report quotes what it logged
            start = time.monotonic()
            self._log_since[box.handle.name] = box.handle.log_size()
        self._release_cells()  # nothing of a box that is done runs on beside this test
        if self._end_now:
            self._end_now = False
            self._reap_lingering()  # boxes without cgroups that are done: ended before this test runs
        handle = box.handle
        run = BoxRun(handle, start, timeout, box.in_place, box=box, held=held, cell=box.cell)
        why = self._reach(handle, item, box)
        if why is not None:
            box.alive = False
            self._retire(box)
            self._fork_status(box.worker, msg.KILL, box.child)
            run.failure, run.duration = why, 0.0
            return run
        self._seq += 1
        run.seq = seq = self._seq
        fields = {**_service_fields(self.config, item=item), "nodeid": item.nodeid, "next": next_nodeid, "seq": seq}
        fields.update(side_effects.run_fields(self.config, item))
        fields["timeout"] = _left(start, timeout)  # the box sends its last words when it passes
        line = json.dumps([msg.RUN, fields]) + "\n"
        run.started = True
        if run.cell is not None and side_effects.usage_count(self.config):
            run.cell.begin_test()  # a module's later tests: their usage counts from their own start
        try:
            box.stream.conn.sendall(line.encode())
        except OSError as exc:
            run.outcome = Outcome(hung_up=exc)  # nothing to drain: the box is settled as one that hung up
            return run
        if ahead:
            self._fork_ahead(handle, ahead, box.network)
        run.stream = box.stream
        return run

    def end(self, run: BoxRun, *, last: bool = True) -> Ended:
        """End ``run`` once its messages are read (``run.outcome``): a box that timed out, was
        refused or broke is killed (a forked one reaped, its exit read, its OOM kills counted into
        ``run.outcome``), and what its reports need is gathered: how the box ended and, for a run
        that did not finish, its log.  A forked box that finished stays open for its module's next
        test unless ``last`` (or the test called ``pytest.exit``)."""
        out = run.outcome
        box = run.box
        code: int | None = None
        if run.started and box is not None:
            code = self._settle(box, out, run.start)
        duration = run.duration if run.duration is not None else time.monotonic() - run.start
        if isinstance(out.hung_up, RefusedMessage):
            how = str(out.hung_up)
        else:
            how = f"the test process in the box {describe_status(code, forked=not run.in_place)}"
        finished = run.failure is None and out.error is None and (out.done or out.exit is not None)
        log = None if finished else self._log(run.handle, run.cell)
        if run.in_place:
            name = run.handle.name
            if run.started and not out.done and out.exit is None:
                # A test that did not finish takes its box with it, as it took the warm
                # interpreter it ran in before in-place forks: its module's next test gets a new box.
                self._kill_box(run.handle)
        elif box is not None and (run.held or box.alive):
            name = box.name
        else:
            name = f"{run.handle.name}.{self.forks}"
        still_open = None
        if box is not None and box.alive:
            if last or out.exit is not None:
                self.close(box)
            else:
                still_open = box
        alive = run.handle.name in self.warm.live()
        usage = run.cell.usage() if run.cell is not None and side_effects.usage_count(self.config) else {}
        return Ended(name, duration, run.timeout, run.failure, how, log, still_open, alive, out.exit, usage)

    def _reach(self, handle: BoxHandle, item: pytest.Item, box: ForkedBox | None = None) -> str | None:
        """Make the services ``item`` uses reachable in its box (``box``, forked from ``handle``'s
        warm interpreter, or ``handle``'s own) at their host addresses, before it runs
        (the ``pytest_boxlite_reach`` hook, which services implement); why not, if they cannot be."""
        agent = getattr(handle, "agent_pid", None)
        if box is not None and box.stream is not None and not box.in_place:
            where = BoxAccess(box.name, agent, box.stream.conn)
        else:
            where = BoxAccess(handle.name, agent)
        return _first_problem(self.config, where, item, item.nodeid, wide_only=False)

    def _send_fork(self, handle: BoxHandle, nodeid: str, network: bool, *, in_place: bool = False) -> ForkedBox | str:
        """Ask ``handle``'s warm interpreter for a fresh box for ``nodeid``: the box (its pid known
        once :meth:`_resolve` has read the answer; not yet connected, see :meth:`_accept_fork`), or
        why there is none.  The answer is not waited for here: a box made ahead is asked for while
        a test runs, and the host then reads that test's reports, not the warm interpreter's clone."""
        worker = self.warm.get(handle.name)
        if in_place:
            name = handle.name  # the fork is its box's: reports, services and hooks name that box
        else:
            self.forks += 1
            name = f"{handle.name}.{self.forks}"
        if worker is None:
            return f"box {handle.name} has no running test worker"
        try:
            _, fork_socket = self._fork_listener(handle)  # listening before the box can connect
        except (OSError, BoxliteError) as exc:
            # Every boxed test runs in a fork: a runtime whose boxes take no socket runs none.
            return f"box {handle.name} takes no connection from a fork of its warm interpreter: {exc}"
        token = secrets.token_hex(8)
        request = {"nodeid": nodeid, "token": token, "sock": fork_socket, "hostname": name[:63], "network": network}
        if in_place:
            request["in_place"] = True  # no namespaces, layers or cell: the box's own, as booted
        elif handle.fork_renews_all:
            request["renew_all"] = True  # absent otherwise: namespace boxes are forked as they always were
        if not in_place:
            request.update(side_effects.fork_fields(self.config))  # the box keeps its layers to list changes
        if self.share_fixtures and not in_place:
            request["shared"] = True  # wider fixtures are set up in the warm interpreter (BoxedExecutor)
            # Plugins' fields never replace the request's own (the core's keys win).
            request = {**_service_fields(self.config, nodeid=nodeid, wide_only=True), **request}
            # The warm interpreter sets those fixtures up in its own box: they reach the services there.
            warm = BoxAccess(handle.name, getattr(handle, "agent_pid", None))
            why = _first_problem(self.config, warm, None, nodeid, wide_only=True)
            if why is not None:
                return why
        try:
            # Cgroups and a stderr of the box's own (namespace runtime): a test that leaves
            # processes, memory or output behind leaves them in its own box, not the next one's.
            # An in-place fork's are its box's, as a booted test's were.
            cell = None if in_place else handle.fork_cell(name)
        except (OSError, BoxliteError) as exc:
            return f"could not make the box's cgroups and log: {exc}"
        if cell is not None:
            request["cell"] = cell.request
        try:
            worker.channel.send((msg.FORK, request))
        except (EOFError, OSError, execnet.RemoteError) as exc:
            if cell is not None:
                cell.abandon()
                self._done_cells.append(cell)
            return self.warm.death_reason(handle, worker, exc)
        if cell is not None:
            cell.deal(10.0)  # a cell that could not be handed over: the guest refuses the fork, saying so
        box = ForkedBox(
            name,
            handle,
            worker,
            -1,
            None,
            handle.oom_kills(),
            nodeid=nodeid,
            token=token,
            network=network,
            cell=cell,
            in_place=in_place,
        )
        self._pending.setdefault(worker, []).append(box)
        return box

    def _resolve(self, box: ForkedBox, timeout: float) -> str | None:
        """Wait (up to ``timeout``) for the answer to ``box``'s FORK: ``None`` once its pid is
        known, else why there is no box."""
        if box.child < 0 and box.error is None:
            self._sync(box.worker, timeout)
        return box.error

    def _sync(self, worker: WarmInterpreter, timeout: float) -> None:
        """Read every FORKED answer ``worker`` still owes, in order (each within ``timeout``)."""
        pending = self._pending.get(worker)
        if not pending:
            return  # also ends the recursion through _reap_lingering -> _fork_status
        ended: set[object] = set()
        while pending:
            box = pending.pop(0)
            try:
                kind, fields = worker.channel.receive(timeout)
            except (EOFError, OSError, execnet.RemoteError, execnet.TimeoutError) as exc:
                why = self.warm.death_reason(box.handle, worker, exc)
                for lost in (box, *pending):
                    lost.error = why
                pending.clear()
                break
            if kind != msg.FORKED or not isinstance(fields, dict) or not isinstance(fields.get("pid"), int):
                text = fields.get("text", kind) if isinstance(fields, dict) else kind
                box.error = f"could not fork a box: {str(text)[:2000]}"
                continue
            box.child = fields["pid"]
            reaped = fields.get("ended")
            if isinstance(reaped, list):  # the box's word: only pids count, and only so many
                ended |= {p for p in reaped[:_ENDED_CAP] if type(p) is int}
        self._reap_lingering(worker, ended)

    def _fork_ahead(self, handle: BoxHandle, nodeids: Sequence[str], network: bool) -> None:
        """Have boxes for the tests ``nodeids`` (the next ones, in order) made now, while this test
        runs (see :meth:`fork`): those made already are kept, the missing ones are forked, and any
        made for a test no longer expected next is ended.

        A box that cannot be had now is not an error of this test: its own test reports what went
        wrong (or forks its own).
        """
        made = {(box.nodeid, box.network): box for box in self._ahead.pop(handle.name, [])}
        queue: list[ForkedBox] = []
        for nodeid in nodeids[:AHEAD_MAX]:
            box = made.pop((nodeid, network), None)
            if box is None:
                fresh = self._send_fork(handle, nodeid, network)
                if isinstance(fresh, str):
                    break
                box = fresh
            queue.append(box)
        for unused in made.values():
            self._end_unused(unused)
        if queue:
            self._ahead[handle.name] = queue

    def _take_ahead(self, parent: str, nodeid: str, network: bool) -> ForkedBox | None:
        """The box made ahead for ``nodeid`` from ``parent``, if there is one.  Boxes made for
        tests before it in the queue are ended (those tests were skipped over); with no box for
        ``nodeid`` the queue stays (a test run again, as by a rerun plugin, forks its own)."""
        queue = self._ahead.get(parent, [])
        for i, box in enumerate(queue):
            if (box.nodeid, box.network) == (nodeid, network):
                for skipped in queue[:i]:
                    self._end_unused(skipped)
                self._ahead[parent] = queue[i + 1 :]
                return box
        return None

    def _forget_ahead(self, parent: str) -> None:
        """Forget the boxes made ahead in ``parent`` (they die with it): only the connections of
        those that connected early are closed here."""
        for box in self._ahead.pop(parent, []):
            if box.stream is not None:
                with contextlib.suppress(OSError):
                    box.stream.conn.close()

    def _drop_ahead(self, parent: str) -> None:
        for box in self._ahead.pop(parent, []):
            self._end_unused(box)

    def _end_unused(self, box: ForkedBox) -> None:
        """A box made ahead that no test will use: killed at the next reap (it ran no test)."""
        if box.stream is not None:
            with contextlib.suppress(OSError):
                box.stream.conn.close()
        box.alive = False
        self._retire(box)
        if self._resolve(box, 10.0) is None:  # with an error there is no box to end
            self._lingering.append((box.worker, box.child, time.monotonic()))

    def close(self, box: ForkedBox) -> None:
        """End a forked box: its stream closes, and one that lingers is killed (bounded)."""
        if box.stream is not None:
            with contextlib.suppress(OSError):
                box.stream.conn.close()
        if box.alive:
            box.alive = False
            # A box without cgroups of its own (an ordinary user's) shares its warm box's process
            # limit with the next one: it is ended before the next test runs, not after a grace.
            unconfined = box.cell is not None and not box.cell.cgroups.dirs
            self._end_fork(box.worker, box.child, 0.0 if unconfined else FORK_GRACE)
            self._end_now = self._end_now or unconfined
        self._retire(box)

    def _settle(self, box: ForkedBox, out: Outcome, start: float) -> int | None:
        """A forked box that failed to finish is ended: killed (a timeout, a refused stream) or
        waited for (its exit code returned; an OOM kill said in ``out.hung_up``)."""
        code: int | None = None
        if out.timed_out or out.refused:
            box.alive = False
            self._fork_status(box.worker, msg.KILL, box.child)
        elif not out.done:
            box.alive = False
            code = self._fork_status(box.worker, msg.WAIT, box.child)
            if box.handle.oom_kills() > box.oom_before or (box.cell is not None and box.cell.oom_kills() > 0):
                out.hung_up = RefusedMessage(OOM + side_effects.memory_text(box.cell.usage() if box.cell else {}))
        if out.done and not out.paused and not box.in_place:
            # A test that sat at the debugger's prompt tells nothing of the box's overhead.
            self.fork_waits.append(time.monotonic() - start - sum(r.duration for r in out.reports))
        if not box.alive and box.stream is not None:
            with contextlib.suppress(OSError):
                box.stream.conn.close()
        if not box.alive:
            self._retire(box)
        return code

    def _accept_fork(
        self, worker: WarmInterpreter, listener: socket.socket, token: str, child: int, deadline: float, parent: str
    ) -> ForkStream | None:
        """The forked box's connection, which presents ``token``; ``None`` if the box died first.

        Waits in short slices and asks the warm interpreter between them whether the fork is still
        alive, so a box that dies before connecting is reported at once, not at the timeout.  The
        boxes made ahead from ``parent`` connect to the same socket in any order: a connection
        that presents one of their tokens is kept for that box; any other is dropped.
        """
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            listener.settimeout(min(left, 1.0))
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                if self._fork_status(worker, msg.POLL, child) is not None:
                    return None
                continue
            stream = ForkStream(conn)
            try:
                first = next(stream.messages(min(deadline, time.monotonic() + 10.0)), None)
            except (RefusedMessage, TimeoutError, OSError):
                first = None
            if first == (msg.TOKEN, {"token": token}):
                return stream
            ahead = next((b for b in self._ahead.get(parent, []) if first == (msg.TOKEN, {"token": b.token})), None)
            if ahead is not None and ahead.stream is None:
                ahead.stream = stream  # a box made ahead that connected before this one did
                continue
            conn.close()  # a stale connection (from an earlier box that timed out): drop it

    def _end_fork(self, worker: WarmInterpreter, child: int, grace: float = FORK_GRACE) -> None:
        """A forked box that said DONE must end; it is checked off the test's path (next fork, or
        shutdown), and one that lingers past :data:`FORK_GRACE` (a test that goes on after its
        report) is killed, so nothing outlives its test by more than that."""
        self._lingering.append((worker, child, time.monotonic() + grace))

    def _reap_lingering(
        self, worker: WarmInterpreter | None = None, ended: Container[object] = (), *, final: bool = False
    ) -> None:
        """Forget forked boxes that have ended; kill those past their grace (all, at the end).

        ``ended``: the pids ``worker``'s warm interpreter reaped (its FORKED says so), forgotten
        without asking.  The others are asked about only once past their grace (or at the end),
        so a box that is still exiting costs the next test no round trip.
        """
        keep = []
        now = time.monotonic()
        for w, child, deadline in self._lingering:
            if w is worker and child in ended:
                continue
            if final or now > deadline:
                if self._fork_status(w, msg.POLL, child) is None:
                    self._fork_status(w, msg.KILL, child)
                continue
            keep.append((w, child, deadline))
        self._lingering = keep

    def teardown_shared(self, handle: BoxHandle, keep: list[str], nodeid: str, timeout: float) -> object:
        """Have ``handle``'s warm interpreter tear down the fixtures it set up for its forks on the
        nodes not in ``keep`` (node ids), as at ``nodeid``'s teardown: the box's serialized
        report of that teardown (untrusted), ``None`` if nothing was torn down; raises
        :class:`BoxliteError` if the warm interpreter did not answer."""
        worker = self.warm.get(handle.name)
        if worker is None:
            return None  # no warm interpreter left: what it had set up went with it
        self._sync(worker, 10.0)  # answers owed to earlier FORKs come first on the channel
        try:
            worker.channel.send((msg.TEARDOWN_SHARED, {"keep": keep, "nodeid": nodeid}))
            kind, fields = worker.channel.receive(timeout)
        except (EOFError, OSError, execnet.RemoteError, execnet.TimeoutError, ValueError, TypeError) as exc:
            raise BoxliteError(self.warm.death_reason(handle, worker, exc)) from None
        if kind != msg.SHARED_TORN_DOWN or not isinstance(fields, dict):
            answer = str(kind)[:100]
            raise BoxliteError(f"the warm interpreter of box {handle.name} answered {answer!r} to TEARDOWN_SHARED")
        return fields.get("report")

    def _fork_status(self, worker: WarmInterpreter, name: str, pid: int) -> int | None:
        self._sync(worker, 10.0)  # answers owed to earlier FORKs come first on the channel
        try:
            worker.channel.send((name, {"pid": pid}))
            kind, fields = worker.channel.receive(10.0)
        except (EOFError, OSError, execnet.RemoteError, execnet.TimeoutError, ValueError, TypeError):
            return None
        code = fields.get("code") if kind == msg.STATUS and isinstance(fields, dict) else None
        return code if isinstance(code, int) else None

    def _fork_listener(self, handle: BoxHandle) -> tuple[socket.socket, str]:
        """The socket this box's forks connect to (one per fork parent), and its path in the box."""
        with self._lock:
            known = self._listeners.get(handle.name)
            if known is None:
                known = self._listeners[handle.name] = handle.fork_listener()
            return known

    def _kill_box(self, handle: BoxHandle) -> None:
        """Destroy ``handle``'s box now (its boxes made ahead die with it)."""
        self._forget(handle)
        self.warm.kill(handle)

    def _forget(self, handle: BoxHandle) -> None:
        """Forget what is kept of the boxes forked in ``handle``'s box, which goes now: those made
        ahead, its socket, the answers and the lingering boxes its warm interpreter owes."""
        self._forget_ahead(handle.name)
        with self._lock:
            listener = self._listeners.pop(handle.name, None)
        if listener is not None:
            listener[0].close()
        interp = self.warm.get(handle.name)
        if interp is not None:
            self._pending.pop(interp, None)
            self._lingering = [entry for entry in self._lingering if entry[0] is not interp]

    def _log(self, handle: BoxHandle, cell: ForkCell | None = None) -> tuple[str, str] | None:
        """The box log's tail as a report section: only what was logged since this test began
        (for a forked box: since its test began, not since its fork parent booted), with its
        control characters escaped (the log holds what the box wrote: no escape sequence of a box
        reaches the host's terminal).  A forked box with a cell of its own has a log of its own:
        that one is quoted (once the box's last writer is gone, up to a second)."""
        if cell is not None:
            own = escape_controls(cell.log_tail(wait=1.0))
            return (f"boxlite log of {cell.name}", own) if own.strip() else None
        since = self._log_since.get(handle.name)
        tail = escape_controls(handle.log_tail(since=since or 0))
        return (f"boxlite log of {handle.name}", tail) if tail.strip() else None

    def _retire(self, box: ForkedBox) -> None:
        """A forked box is done: every process in its cgroups is killed now (no grace: nothing of
        it may run on beside the next test), its cgroups removed once empty (:meth:`_release_cells`)."""
        if not box.in_place:  # an in-place fork's box goes on (or goes with its lease)
            self.config.hook.pytest_boxlite_box_done(config=self.config, name=box.name)
        cell = box.cell
        if cell is not None and all(c is not cell for c in self._done_cells):
            cell.kill()
            self._done_cells.append(cell)

    def _release_cells(self) -> None:
        """Remove the cgroups of the boxes that are done, where they are empty already (no wait)."""
        if self._done_cells:
            self._done_cells = [c for c in self._done_cells if not c.release()]
