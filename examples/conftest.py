"""Examples: tests that would harm a host, run inside boxes.

Every example is marked ``@pytest.mark.boxlite``.  Before the run this
conftest plants sentinels on the host (a directory, a process, the hostname,
/etc/hosts); after the run it checks that each one is untouched and fails
the session loudly if not, so "the host is untouched" is proved, not claimed.

Outside a box these tests would do all of it to this machine.  So this conftest refuses the run,
before any test body, wherever the boxlite plugin is not there to box them (``-p no:boxlite``,
``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``, pytest-boxlite not installed) or a test here is not marked.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# In the user's home (seen by boxes, copy-on-write; /tmp is private to each box), one per user.
SENTINEL_DIR = Path(os.environ.get("BOXLITE_EXAMPLES_SENTINEL", Path.home() / ".pytest-boxlite-examples"))
_STATE = pytest.StashKey[dict[str, object]]()


def _digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "absent"


@pytest.fixture(scope="session")
def host_sentinel() -> dict[str, object]:
    """What the examples try to destroy: the host-side sentinel paths and process id."""
    return {"dir": str(SENTINEL_DIR), "pid": int(os.environ["BOXLITE_EXAMPLES_SENTINEL_PID"])}


_PLUGIN = "pytest_boxlite.plugin"
#: Fixtures whose tests run on the host and box their work instead (see pytest_collection_modifyitems).
_SANDBOX_FIXTURES = frozenset({"boxlite_sandbox", "boxlite_module_sandbox", "boxlite_pool"})
_HARM = (
    "These examples delete files, edit /etc, fill /tmp, kill every `sleep` process and change the "
    "hostname on purpose; outside a box they would do it to this machine"
)
_FIX = "install pytest-boxlite (`python -m pip install -e .`) and run `python -m pytest examples` with the plugin on"


def _why_unboxed(config: pytest.Config) -> str | None:
    """Why boxes would not run these tests in this process, or ``None`` when they would.

    Only pytest's public plugin manager is asked (this file must work without the package
    installed): whether the plugin module is registered, and the role it registers inside a box.
    """
    pm = config.pluginmanager
    loaded = any(getattr(p, "__name__", None) == _PLUGIN for p in pm.get_plugins())
    if os.environ.get("PYTEST_BOXLITE_GUEST") == "1" and loaded:
        # A box's own pytest (the host boxed these tests): the plugin's guest role is there.
        return None if pm.get_plugin("boxlite-guest") is not None else "the boxlite plugin took no guest role"
    if pm.is_blocked("boxlite"):
        return "the boxlite plugin is disabled (-p no:boxlite)"
    if loaded:
        return None
    if importlib.util.find_spec("pytest_boxlite") is None:
        return f"pytest-boxlite is not installed for this Python ({sys.executable})"
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return "PYTEST_DISABLE_PLUGIN_AUTOLOAD is set, so the boxlite plugin was not loaded (or add -p boxlite)"
    return "the boxlite plugin is not loaded"


@pytest.hookimpl(trylast=True)  # after the plugin's own pytest_configure registered its role
def pytest_configure(config: pytest.Config) -> None:
    why = _why_unboxed(config)
    if why is not None:
        raise pytest.UsageError(f"examples/ refused to run: {why}. {_HARM}. To run them, {_FIX}.")
    if hasattr(config, "workerinput") or os.environ.get("PYTEST_BOXLITE_GUEST"):
        return
    SENTINEL_DIR.mkdir(parents=True, exist_ok=True)
    for i in range(3):
        (SENTINEL_DIR / f"precious-{i}.txt").write_text(f"do not delete {i}\n")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    # The boxed tests learn the host pid through the environment the box inherits from the marker.
    os.environ["BOXLITE_EXAMPLES_SENTINEL_PID"] = str(sleeper.pid)
    config.stash[_STATE] = {
        "sleeper": sleeper,
        "hostname": socket.gethostname(),
        "hosts": _digest("/etc/hosts"),
        "files": sorted(p.name for p in SENTINEL_DIR.iterdir()),
    }


def _boxes_its_work(item: pytest.Item) -> bool:
    """Whether ``item`` runs on the host by design, its work done in boxes: a test of the sandbox
    fixtures, or of a service fixture (``pytest_boxlite.service``: the server runs in a box)."""
    if _SANDBOX_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    services = sys.modules.get("pytest_boxlite.services")  # loaded where a test module declares one
    return services is not None and bool(services.services_of(item))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test here must be boxed: an unmarked one would run its body on the host.

    Except a test of the sandbox or service fixtures (a sandbox-fixture test cannot be marked:
    boxes do not nest): it runs on the host by design and does its work in boxes."""
    here = Path(__file__).resolve().parent
    unmarked = [
        item.nodeid
        for item in items
        if item.path.resolve().is_relative_to(here)
        and item.get_closest_marker("boxlite") is None
        and not _boxes_its_work(item)
    ]
    if unmarked:
        raise pytest.UsageError(
            f"examples/ refused to run: {', '.join(unmarked)} not marked @pytest.mark.boxlite. {_HARM}. "
            "Mark every test here (e.g. a module's pytestmark = pytest.mark.boxlite(...))."
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.config.stash.get(_STATE, None)
    if state is None:
        return
    sleeper = state["sleeper"]
    assert isinstance(sleeper, subprocess.Popen)
    problems = []
    if sleeper.poll() is not None:
        problems.append(f"the host process {sleeper.pid} was killed")
    if socket.gethostname() != state["hostname"]:
        problems.append(f"the host name changed to {socket.gethostname()!r}")
    if _digest("/etc/hosts") != state["hosts"]:
        problems.append("/etc/hosts changed on the host")
    files = sorted(p.name for p in SENTINEL_DIR.iterdir()) if SENTINEL_DIR.is_dir() else []
    if files != state["files"]:
        problems.append(f"{SENTINEL_DIR} changed on the host: {files}")
    if Path("/etc/pytest-boxlite-example").exists():
        problems.append("/etc/pytest-boxlite-example appeared on the host")
    sleeper.kill()
    sleeper.wait()
    state["problems"] = problems
    if problems:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None or "problems" not in state:
        return
    problems = state["problems"]
    assert isinstance(problems, list)
    terminalreporter.section("host check", sep="-")
    if problems:
        terminalreporter.write_line("HOST WAS TOUCHED: " + "; ".join(problems), red=True, bold=True)
    else:
        terminalreporter.write_line(
            "host untouched: sentinel files, sentinel process, hostname and /etc/hosts are as before", green=True
        )
