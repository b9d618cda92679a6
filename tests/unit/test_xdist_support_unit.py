"""Unit tests of :mod:`pytest_boxlite.xdist_support`: gateway specs, what remote workers send, the summary.

Configs are real (``pytester.parseconfig``), the controller channel a real execnet channel to a
local interpreter; the terminal reporter is a recorder (a fake: only its two writing methods are
used).  The whole path over real socket hosts is ``tests/test_xdist_remote.py``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, cast

import execnet
import pytest

from pytest_boxlite import reporting
from pytest_boxlite.session import BoxliteSession
from pytest_boxlite.xdist_support import (
    RemoteLedger,
    clean_stats,
    forget_controller_home,
    is_remote,
    remote_specs,
    spec_text,
    tx_specs,
    watch_controller,
)
from unit.test_session_unit import make_settings

pytestmark = pytest.mark.timeout(30)


def test_specs_are_expanded_and_only_plain_popen_is_local(pytester: pytest.Pytester) -> None:
    config = pytester.parseconfig(
        "-d", "--tx", "2*popen", "--tx", "popen//chdir=/x", "--tx", "popen//via=gw0", "--tx", "3*socket=10.0.0.1:8888"
    )
    specs = tx_specs(config)
    assert specs == ["popen", "popen", "popen//chdir=/x", "popen//via=gw0", *["socket=10.0.0.1:8888"] * 3]
    assert [is_remote(s) for s in specs] == [False, False, False, True, True, True, True]
    assert is_remote("ssh=ci@host//python=python3")
    assert remote_specs(config) == ["popen//via=gw0", *["socket=10.0.0.1:8888"] * 3]
    assert spec_text("execmodel=main_thread_only//socket=h:1//chdir=/p") == "socket=h:1//chdir=/p"


def test_remote_worker_drops_the_controllers_home(pytester: pytest.Pytester) -> None:
    config = pytester.parseconfig("--boxlite-home=/on/the/controller")
    forget_controller_home(config)
    assert config.getoption("boxlite_home") is None


def test_what_a_remote_worker_sends_is_bounded_and_checked() -> None:
    ledger = RemoteLedger(specs={"gw0": "socket=a:1", "gw1": "socket=b:1"})
    assert ledger.add("gw0", "not a dict") is None
    assert not ledger.eventful
    hostile = {
        "host": "evil\x1b[2J\nhost" + "x" * 1000,
        "home": ["not", "text"],
        "runtime": "namespace",
        "stats": {"booted": 3, "leased": "many", "lease_waits": [0.1, "x", True], "max_live": True, 7: 1},
        "leaked": [f"pbx-{i}" for i in range(1000)],
        "kept": "pbx-1",
        "reconciled": [None],
    }
    rep = ledger.add("gw0", hostile)
    assert rep is not None
    assert "\x1b" not in rep.host and "\n" not in rep.host and len(rep.host) <= 200
    assert rep.host.startswith("evil\\x1b[2J\\nhost"), rep.host  # shown escaped, as all text from elsewhere
    assert rep.home == "['not', 'text']"
    assert rep.booted == 3 and len(rep.leaked) == 200 and rep.kept == [] and rep.reconciled == ["None"]
    assert clean_stats(hostile["stats"]) == {"booted": 3, "lease_waits": [0.1]}
    # Two workers of one host (same name and home) share its line.
    ledger.add("gw1", {"host": rep.host, "home": rep.home, "stats": {"booted": 2}})
    assert len(ledger.hosts) == 1 and rep.workers == ["gw0", "gw1"] and rep.booted == 5
    assert ledger.eventful


class Recorder:
    """Records what the summary writes (a fake TerminalReporter: ``section`` and ``write_line``)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def section(self, title: str, sep: str = "=", **kw: Any) -> None:
        self.lines.append(f"[{title}]")

    def write_line(self, line: str, **kw: Any) -> None:
        self.lines.append(line)


def test_summary_has_a_line_per_host_and_per_silent_worker(tmp_path: Path) -> None:
    session = BoxliteSession(make_settings(tmp_path), session_id="abc", worker_id=None)
    ledger = RemoteLedger()
    tr = Recorder()
    reporting.summary(cast(pytest.TerminalReporter, tr), session, remote=ledger)
    assert tr.lines == [], "nothing happened: nothing is said"

    ledger.add("gw0", {"host": "h1", "home": "/h1/bxh", "runtime": "namespace", "stats": {"booted": 2}, "kept": ["k"]})
    ledger.add("gw1", {"host": "h2", "home": "/h2/bxh", "runtime": "vm", "leaked": ["pbx-abc-gw1-1"]})
    ledger.silent.append(("gw2", "socket=h3:1"))
    session.report.worker_stats += [{"booted": 2}, {}]
    reporting.summary(cast(pytest.TerminalReporter, tr), session, remote=ledger)
    text = "\n".join(tr.lines)
    assert "boxes booted 2," in text and "leaked 1" in text, text
    assert "host h1 (gw0; runtime=namespace home=/h1/bxh): boxes booted 2, leaked 0, kept 1" in text, text
    assert "kept box k on host h1: there, enter it with `python -m pytest_boxlite --home /h1/bxh shell k`" in text
    assert "LEAKED boxes on host h2 (removed there at exit): pbx-abc-gw1-1" in text, text
    assert "worker gw2 (socket=h3:1) went down without reporting" in text, text


def test_watch_controller_calls_back_when_the_channel_closes(pytester: pytest.Pytester) -> None:
    config = pytester.parseconfig()
    called = threading.Event()
    assert watch_controller(config, called.set) is None, "no xdist channel: nothing to watch"

    gw = execnet.makegateway("popen")
    try:
        channel = gw.remote_exec("channel.receive()")

        class Interactor:  # what xdist registers on a worker: a plugin with the channel to the controller
            pass

        plugin = Interactor()
        plugin.channel = channel  # type: ignore[attr-defined]
        config.pluginmanager.register(plugin)
        thread = watch_controller(config, called.set)
        assert thread is not None
        assert not called.wait(0.3), "called while the channel is open"
        channel.send("bye")  # the remote side ends: the channel closes
        assert called.wait(10), "not called after the channel closed"
        thread.join(5)
    finally:
        gw.exit()
