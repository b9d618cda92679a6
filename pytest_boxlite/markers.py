"""Strict parsing of ``@pytest.mark.boxlite(...)`` into a :class:`BoxPlan`."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Generator, Mapping
from typing import TYPE_CHECKING, Any

import pytest

from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.marker_registration import ON_HOST_KEY

if TYPE_CHECKING:
    # Types only: a worker box's pytest checks its tests' markers without the session's imports.
    from pytest_boxlite.session import BoxliteSession
    from pytest_boxlite.spec import BoxSpec

ALLOWED = ("image", "cpus", "memory", "env", "network", "timeout", "user", "side_effects")
#: A collection report's attribute: an xdist worker refused a test's marker (a usage error), which
#: its controller turns into the usage error's exit status (``session_in_box.WorkerRefusals``).
USAGE_ATTR = "boxlite_usage_error"
#: This plugin's fixtures that lease boxes from the host's pool: a test that needs one (directly
#: or through other fixtures) cannot run in a box, since a box starts no boxes of its own.
BOX_FIXTURES = frozenset({"boxlite_sandbox", "boxlite_module_sandbox", "boxlite_pool"})


@dataclasses.dataclass(frozen=True)
class BoxPlan:
    """How one item runs in a box: the box spec and the bound on the whole test."""

    spec: BoxSpec
    timeout: float


def _bad(item: pytest.Item, msg: str) -> pytest.UsageError:
    return pytest.UsageError(f"{item.nodeid}: @pytest.mark.boxlite: {msg}")


def _check(item: pytest.Item, kwargs: Mapping[str, Any]) -> None:
    for key, value in kwargs.items():
        if key == "image" and not (isinstance(value, str) and value.strip()):
            raise _bad(item, f"image must be a non-empty string, got {value!r}")
        if key == "cpus" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise _bad(item, f"cpus must be a positive integer, got {value!r}")
        if key == "memory" and (isinstance(value, bool) or not isinstance(value, int) or value < 64):
            raise _bad(item, f"memory must be an integer number of MiB >= 64, got {value!r}")
        if key == "network" and not isinstance(value, bool):
            raise _bad(item, f"network must be True or False, got {value!r}")
        if key == "env" and not (
            isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
        ):
            raise _bad(item, f"env must be a dict of str to str, got {value!r}")
        if key == "user" and not (isinstance(value, str) and value.strip()):
            raise _bad(item, f"user must be a name or 'uid[:gid]' string, got {value!r}")
        if key == "side_effects" and value not in ("off", "report", "fail"):
            raise _bad(item, f"side_effects must be 'off', 'report' or 'fail', got {value!r}")
        if key == "timeout" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise _bad(item, f"timeout must be a positive number of seconds, got {value!r}")


def marker_kwargs(item: pytest.Item) -> dict[str, Any]:
    """The arguments of ``item``'s closest ``boxlite`` marker, checked (``{}`` without one).

    Bad arguments raise ``UsageError`` naming the test and the argument.
    """
    marker = item.get_closest_marker("boxlite")
    if marker is None:
        return {}
    if marker.args:
        raise _bad(item, f"takes keyword arguments only ({', '.join(ALLOWED)}), got positional {marker.args!r}")
    kwargs = dict(marker.kwargs)
    unknown = sorted(set(kwargs) - set(ALLOWED))
    if unknown:
        raise _bad(item, f"unknown argument(s) {', '.join(unknown)}; allowed: {', '.join(ALLOWED)}")
    _check(item, kwargs)
    return kwargs


def box_fixtures(item: pytest.Item) -> list[str]:
    """This plugin's pool fixtures in ``item``'s fixture closure (what it asks for, and what those ask for)."""
    return sorted(BOX_FIXTURES.intersection(getattr(item, "fixturenames", ())))


def plan_for(item: pytest.Item, session: BoxliteSession) -> BoxPlan | None:
    """The item's plan, or ``None`` when it runs locally.  Bad marker arguments raise ``UsageError``.

    Under ``--boxlite``, a test that needs a sandbox fixture runs on the host (its sandboxes come
    from the host's pool; boxes do not nest), and ``ON_HOST_KEY`` in its stash says why; with an
    explicit ``@pytest.mark.boxlite`` it is a usage error.
    """
    marker = item.get_closest_marker("boxlite")
    if marker is None and not session.settings.all:
        return None
    kwargs = marker_kwargs(item)
    needs_pool = box_fixtures(item)
    if needs_pool:
        if marker is None:
            item.stash[ON_HOST_KEY] = ", ".join(needs_pool)
            return None
        raise _bad(
            item,
            f"it uses {', '.join(needs_pool)} (directly or through its fixtures), "
            f"{'which lease' if len(needs_pool) > 1 else 'which leases'} boxes from the host's pool, and a "
            "test in a box cannot start boxes (boxes do not nest). Remove the marker: the test then runs "
            "on the host, where its sandboxes are boxes (under --boxlite too).",
        )
    timeout = float(kwargs.pop("timeout", session.settings.timeout))
    kwargs.pop("side_effects", None)  # read per test by side_effects.py: not part of the box's spec
    env = kwargs.pop("env", None)
    if session.image_error is not None and "image" not in kwargs:
        # The session's own image (option, ini or environment) is at fault, not this marker.
        raise pytest.UsageError(session_image_error(session))
    try:
        spec = session.spec_for(
            **kwargs, env=tuple(env.items()) if env else None, warm=True, mounts=session.worker_mounts
        )
    except BoxliteError as exc:
        raise _bad(item, str(exc)) from None
    if spec.user is not None:
        _check_user(item, spec.user, session.choice.kind)
    if not item.stash.get(_WARNED_KEY, False):
        unheld = session.unheld_caps(spec)
        if unheld:
            # The header names the default's caps only: say so for the test that asks for more.
            asked = ", ".join(f"{k}={kwargs[k]!r}" for k in ("memory", "cpus") if k in kwargs)
            gist = "is not enforced here"
            warn_at(item, f"{item.nodeid}: @pytest.mark.boxlite({asked}) {gist}: {unheld}", gist)
        item.stash[_WARNED_KEY] = True  # only once given: a warning made an error is raised again
    return BoxPlan(spec, timeout)


#: The item's plan warnings were given (plan_for runs at collection and again after it).
_WARNED_KEY = pytest.StashKey[bool]()


def warn_at(item: pytest.Item, message: str, gist: str) -> None:
    """A warning at ``item``'s line, given at collection.  Where the warning filters make it an error
    (``filterwarnings = error``), that error would be an INTERNALERROR in a collection hook: it is a
    usage error instead, as pytest's own configuration-time warnings stop the run there."""
    lineno = item.location[1]
    try:
        warnings.warn_explicit(
            pytest.PytestWarning(message),
            category=pytest.PytestWarning,
            filename=str(item.path),
            lineno=(lineno or 0) + 1,
        )
    except Warning as exc:
        raise pytest.UsageError(
            f"{exc} (a PytestWarning that the warning filters make an error; to let it pass, add "
            f"'default:.*{gist}:pytest.PytestWarning' to filterwarnings)"
        ) from None


def session_image_error(session: BoxliteSession) -> str:
    """The usage error of a session whose own image (``--boxlite-image``, its ini key or its
    variable) cannot be used: it names the option and where the value came from."""
    from pytest_boxlite.settings import source_text

    source = source_text(session.settings.sources.get("image", "default"))
    return (
        f"--boxlite-image (from {source}): {session.image_error}. Give an image this machine has (a "
        "registry reference, oci:DIR[:TAG], oci-archive:FILE or docker-archive:FILE), or leave the option out"
    )


def _check_user(item: pytest.Item, user: str | int, kind: str) -> None:
    from pytest_boxlite.runtimes import user_problem

    problem = user_problem(kind, user)
    if problem is not None:
        raise _bad(item, problem)


#: Some test's marker asks for side effects (``side_effects="report"`` or ``"fail"``): its box
#: must keep its layers.  Set by :class:`MarkerCheck`, which reads every marker anyway; read by
#: :mod:`pytest_boxlite.side_effects` (with :data:`SIDE_EFFECTS_ALL_OFF`, its cached "none asked").
SIDE_EFFECTS_MARKED = pytest.StashKey[bool]()
SIDE_EFFECTS_ALL_OFF = pytest.StashKey[bool]()


class MarkerCheck:
    """The host's check of the ``boxlite`` markers of each module's tests as the module is
    collected, before any of its tests asks for a box: a mistake (an unknown or ill-typed argument,
    a ``user=`` nobody is) stops the run there, not after a box was made.

    In an xdist worker a usage error raised at collection breaks the controller (an INTERNALERROR
    naming no test): each mistake goes to it as a collection error (:data:`USAGE_ATTR`), the worker
    runs nothing, and the controller ends the run as a usage error.
    """

    NAME = "boxlite-marker-check"

    def __init__(self, config: pytest.Config, kind: Callable[[], str]) -> None:
        self.config = config
        #: The runtime kind of the session (made at the first ``user=``: it needs a box anyway).
        self.kind = kind
        self.refused: dict[str, tuple[pytest.Item, str]] = {}
        self._checked: set[str] = set()

    def _check(self, item: pytest.Item) -> None:
        if item.nodeid in self._checked or item.get_closest_marker("boxlite") is None:
            return
        self._checked.add(item.nodeid)
        try:
            kwargs = marker_kwargs(item)
            if kwargs.get("side_effects") in ("report", "fail"):
                self.config.stash[SIDE_EFFECTS_MARKED] = True
                self.config.stash[SIDE_EFFECTS_ALL_OFF] = False
            if kwargs.get("user") is not None:
                _check_user(item, kwargs["user"], self.kind())
        except pytest.UsageError as exc:
            if not hasattr(self.config, "workerinput"):
                raise
            self.refused[item.nodeid] = (item, str(exc))

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(
        self, collector: pytest.Collector
    ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        # A module's (or class's) collection, before any of its items is "collected" (and wanted).
        report = yield
        if report.passed:
            for node in report.result:
                if isinstance(node, pytest.Item):
                    self._check(node)
            if self.refused:
                # An xdist worker that refused a test runs nothing: its items are not even collected
                # (a collected marked test would ask for a box).
                report.result = [n for n in report.result if not isinstance(n, pytest.Item)]
        return report

    @pytest.hookimpl(tryfirst=True)
    def pytest_itemcollected(self, item: pytest.Item) -> None:
        self._check(item)  # an item some plugin collects otherwise

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not self.refused:
            return
        for item, why in self.refused.values():
            report = pytest.CollectReport(item.nodeid, "failed", why, [])
            setattr(report, USAGE_ATTR, True)
            config.hook.pytest_collectreport(report=report)
        config.hook.pytest_deselected(items=list(items))
        items[:] = []
