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

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.fixtures import (  # noqa: F401 - fixtures are found as attributes of this plugin
    SESSION_KEY,
    boxlite_module_sandbox,
    boxlite_pool,
    boxlite_sandbox,
)
from pytest_boxlite.marker_registration import MARKER_HELP
from pytest_boxlite.settings import add_options, resolve
from pytest_boxlite.spec import in_guest

if TYPE_CHECKING:
    from pytest_boxlite.roles import _SessionRole

# Only what every pytest process with this plugin needs is imported here: options, fixtures,
# markers.  The roles (pool, runtimes, remote execution) are imported in pytest_configure where
# one is registered, so a box's own pytest does not pay for them at start-up (about 0.1 s).

#: The registered role object of this process (``HostPlugin`` or ``ControllerPlugin``).
ROLE_KEY = pytest.StashKey["_SessionRole"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def _boots_nothing(config: pytest.Config) -> bool:
    """Runs that only list or collect (--collect-only, --fixtures, --markers, --help, ...)."""
    opt = config.option
    names = ("collectonly", "showfixtures", "show_fixtures_per_test", "markers", "help", "version")
    return any(getattr(opt, n, False) for n in names)


def _is_controller(config: pytest.Config) -> bool:
    """True for the xdist controller (it runs no pool); False for workers and plain runs."""
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "dist", "no") != "no")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """``--boxlite-scope=worker`` without ``-n``: run the whole session again inside one box."""
    if in_guest() or hasattr(config, "workerinput") or getattr(config.option, "numprocesses", None):
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
    if in_guest():
        config.pluginmanager.register(GuestRole(), "boxlite-guest")
        return
    if _boots_nothing(config):
        return
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
                settings, session_id=session_id, worker_id=None, worker_mounts=lambda: worker_mounts_for(config)
            )
            role = ControllerPlugin(config, session)
        else:
            worker_id = workerinput.get("workerid") if workerinput else None
            role = HostPlugin(config, settings, session_id, worker_id)
    except BoxliteError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[SESSION_KEY] = role.session
    config.stash[ROLE_KEY] = role
    config.pluginmanager.register(role, role.NAME)


class GuestRole:
    """Inside a box's pytest (boxed tests, ``--boxlite-scope=worker``): the host does the boxing."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        # A --basetemp the host chose (or xdist's per-worker one) lies under the host's /tmp, which
        # the box does not share: make its parent, so tmp_path works as it does on the host.
        basetemp = item.config.option.basetemp
        if basetemp:
            Path(basetemp).resolve().parent.mkdir(parents=True, exist_ok=True)
