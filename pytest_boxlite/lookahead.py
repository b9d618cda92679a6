"""Look-ahead for boxed tests: what to prepare for the next tests while one runs.

Pure bookkeeping, no box and no pytest object: the executor (:mod:`pytest_boxlite.remote.executor`)
describes each test as a :class:`Step` and asks :class:`LookAhead` for an :class:`Ahead`:

- whether the next test runs in this test's box (module scope: same module, same spec);
- which next tests get their boxes forked now, from the same warm interpreter, while this one runs;
- whether the next test's RUN may be sent to the module's box as soon as this test ends, before
  the host has logged this test's reports (see :func:`early_runs_allowed`).

:class:`RunOrder` finds the tests after the next one in the session's run order, where this
process knows it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from pytest_boxlite.spec import BoxSpec

#: Plugins whose ``pytest_runtest_protocol`` runs each test once, as it is: pytest's own, this
#: plugin's and pytest-timeout's.  Another one (pytest-rerunfailures runs a test again) may decide
#: from a test's reports whether or where the next test runs.
PROTOCOL_PLUGINS = frozenset(
    ("runner", "boxlite-host", "faulthandler", "unittest", "timeout", "assertion", "warnings", "logging-plugin")
)


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """One test as the look-ahead sees it.

    ``spec`` is its box's; ``parent`` its collector, compared by identity (tests under one
    collector share its fixtures); ``wide`` the parameter index of each of its parametrized
    fixtures wider than a function's.  A test that runs on the host has no step (``None``).
    """

    nodeid: str
    spec: BoxSpec
    parent: object = None
    fixtures: frozenset[str] = frozenset()
    wide: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def module(self) -> str:
        """The node id of the test's file (what a module's box is kept for)."""
        return module_of(self.nodeid)


@dataclasses.dataclass(frozen=True)
class Ahead:
    """What to do ahead of the next tests while one runs."""

    #: The next test runs in this test's box (module scope): the box stays after this test.
    same_box: bool = False
    #: The node ids of the next tests whose boxes are forked now.
    fork: tuple[str, ...] = ()
    #: The next test's RUN is sent to this box as soon as this test ends (module scope).
    early_run: bool = False


def module_of(nodeid: str) -> str:
    """The node id of a test's file."""
    return nodeid.split("::", 1)[0]


def same_box(step: Step, nxt: Step | None, *, scope: str) -> bool:
    """Whether ``nxt`` runs in ``step``'s box: module scope keeps one box per module and spec."""
    return scope == "module" and nxt is not None and nxt.spec == step.spec and nxt.module == step.module


def early_runs_allowed(
    *, maxfail: int, stepwise: bool, debugger: bool, keep: bool, protocol_plugins: Iterable[str]
) -> bool:
    """Whether a module box's next test may get its RUN before the host has logged the reports of
    the test before it: only where nothing done with those reports can decide that the next test
    does not run, or runs elsewhere.  Not with ``-x``/``--maxfail``, ``--stepwise``, a debugger,
    ``--boxlite-keep`` (a kept box must hold what its failed test left), or a plugin of its own
    around each test's run (``protocol_plugins``: the names of ``pytest_runtest_protocol``'s
    implementations, each of which must be in :data:`PROTOCOL_PLUGINS`)."""
    return not (maxfail or stepwise or debugger or keep) and set(protocol_plugins) <= PROTOCOL_PLUGINS


@dataclasses.dataclass
class _Group:
    """The tests forked under one spec since its tests last changed collector."""

    parent: object
    names: set[str]
    params: dict[str, Any]


class LookAhead:
    """Plans, test by test, what to fork ahead and whether the next test may start early.

    ``share_fixtures``: forked boxes inherit their warm interpreter's fixtures wider than a
    function's (test scope), so a box is forked ahead only when setting up its fixtures first
    changes nothing a running test could see (see :meth:`_ahead_ok`).
    """

    def __init__(self, *, scope: str, share_fixtures: bool) -> None:
        self.scope = scope
        self.share_fixtures = share_fixtures
        #: Per spec: the tests forked under it since its tests last changed collector.
        self._groups: dict[BoxSpec, _Group] = {}

    def plan(
        self,
        step: Step,
        nxt: Step | None,
        then: Step | None = None,
        next_module: Step | None = None,
        *,
        early_runs: bool = False,
    ) -> Ahead:
        """What to do while ``step`` runs in a forked box.  ``nxt``: the next test; ``then``: the
        one after it and ``next_module``: the first after ``step``'s module, where the run order
        is known; ``early_runs``: whether :func:`early_runs_allowed` said yes.  Call once per
        forked test, in run order (it keeps what the tests before asked for)."""
        kept = same_box(step, nxt, scope=self.scope)
        names, params = self._group_of(step)
        fork: list[str] = []
        if kept:
            # Module scope: the next module's box is forked while this module runs, not only
            # during its last test (a box takes longer to make than most tests take to run).
            if (
                next_module is not None
                and next_module.spec == step.spec
                and self._ahead_ok(step, next_module, names, params)
            ):
                fork.append(next_module.nodeid)
        elif nxt is not None and nxt.spec == step.spec and self._ahead_ok(step, nxt, names, params):
            fork.append(nxt.nodeid)
            names_then = names | nxt.fixtures
            params_then = {**params, **nxt.wide}
            if (
                self.scope == "test"
                and then is not None
                and then.spec == step.spec
                and self._ahead_ok(nxt, then, names_then, params_then)
            ):
                fork.append(then.nodeid)
        early = kept and early_runs and then is not None and then.spec == step.spec and then.module == step.module
        return Ahead(same_box=kept, fork=tuple(fork), early_run=early)

    def _group_of(self, step: Step) -> tuple[set[str], dict[str, Any]]:
        """The fixture names asked for by the tests forked from ``step``'s warm interpreter since
        its tests last changed collector, ``step``'s included, and the parameter each of their
        wider fixtures has there now (``step``'s, or the last test's that had one)."""
        group = self._groups.get(step.spec)
        if group is None or group.parent is not step.parent:
            group = self._groups[step.spec] = _Group(step.parent, set(), {})
        group.names |= step.fixtures
        group.params.update(step.wide)
        return group.names, group.params

    def _ahead_ok(self, step: Step, nxt: Step, names: set[str], params: Mapping[str, Any]) -> bool:
        """Whether ``nxt``'s box may be forked while ``step`` runs.  With shared fixtures its warm
        interpreter sets up ``nxt``'s wider fixtures first: only when that changes nothing a
        running test could see, as far as the host can tell (the same collector, no fixture that
        no earlier test under it asked for, and each wider fixture with the parameter it has now:
        another one is torn down first, and with it what the running test may use, such as its
        files in the warm interpreter's /tmp, which a box sees through)."""
        if not self.share_fixtures:
            return True
        if nxt.parent is not step.parent or not nxt.fixtures <= names:
            return False
        return all(name in params and params[name] == index for name, index in nxt.wide.items())


class _Node(Protocol):
    @property
    def nodeid(self) -> str: ...


T = TypeVar("T", bound=_Node)


@dataclasses.dataclass(frozen=True)
class _Stretch(Generic[T]):
    """A module's run of consecutive items, as last walked: where it starts and ends, and the
    first item after it."""

    module: str
    start: int
    end: int
    after: T | None


class RunOrder(Generic[T]):
    """Where each item is in the session's run order (``session.items``), for the look-ahead.

    ``known=False``: this process does not know its run order (an xdist worker learns its next
    items from the controller as it goes), and every answer is ``None``.  So is every answer once
    an item turns up that is not in the list (another plugin runs items of its own).
    """

    def __init__(self, *, known: bool = True) -> None:
        self.known = known
        self._index: dict[int, int] = {}
        self._stretch: _Stretch[T] | None = None

    def after(self, items: Sequence[T], item: T | None) -> T | None:
        """The item that runs after ``item``."""
        at = self._at(items, item)
        return items[at + 1] if at is not None and at + 1 < len(items) else None

    def after_module(self, items: Sequence[T], item: T) -> T | None:
        """The first item after ``item``'s module (its stretch of consecutive items), worked out
        once per stretch: the walk to the module's end is paid once."""
        at = self._at(items, item)
        if at is None or at + 1 >= len(items):
            return None
        module = module_of(item.nodeid)
        known = self._stretch
        # The same stretch of the module's items (a plugin may reorder a module's items apart).
        if known is not None and known.module == module and known.start <= at < known.end:
            return known.after
        end = at + 1
        while end < len(items) and module_of(items[end].nodeid) == module:
            end += 1
        found = items[end] if end < len(items) else None
        self._stretch = _Stretch(module, at, end, found)
        return found

    def _at(self, items: Sequence[T], item: T | None) -> int | None:
        if item is None or not self.known:
            return None
        at = self._index.get(id(item))
        if at is None or at >= len(items) or items[at] is not item:
            self._index = {id(it): n for n, it in enumerate(items)}
            at = self._index.get(id(item))
            if at is None:
                # Another plugin runs items that are not the session's: guess no further.
                self.known = False
        return at
