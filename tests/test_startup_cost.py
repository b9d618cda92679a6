"""What a run that boxes nothing pays for the plugin being installed (issue 26): structurally, not
in time.  Without ``--boxlite`` and any boxlite setting, a run whose tests ask for no box makes no
host role: it imports neither the roles, the session, the pool nor the runtimes, touches no home
beyond one look at its state directories, and starts no process.  The role comes as soon as
something needs it: a marked test, a sandbox fixture (also one asked for at run time), or a home
that holds another session's state (whose dead leftovers it reconciles, as every start did)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from subruns import QUIET

from pytest_boxlite import ledger, plugin
from pytest_boxlite.plugin import BOX_FIXTURES, HOME_STATE_DIRS

#: Modules a run that boxes nothing must not import (each one is imported by a run that boxes).
HEAVY = (
    "pytest_boxlite.roles",
    "pytest_boxlite.session",
    "pytest_boxlite.pool",
    "pytest_boxlite.runtimes",
    "pytest_boxlite.ledger",
    "pytest_boxlite.reporting",
    "pytest_boxlite.sandbox",
    "pytest_boxlite.remote",
)

PROBE = f"""
import sys

STARTED = []


def _audit(event, args):
    # Every way this process could start another (a runtime probe, bwrap, a helper).
    if event in ("subprocess.Popen", "os.posix_spawn", "os.fork", "os.exec", "os.system"):
        STARTED.append(event)


sys.addaudithook(_audit)


def pytest_unconfigure(config):
    pm = config.pluginmanager
    print("HOST", pm.get_plugin("boxlite-host") is not None)
    print("LAZY", pm.get_plugin("boxlite-lazy-host") is not None)
    print("HEAVY", sorted(m for m in {HEAVY!r} if m in sys.modules))
    print("STARTED", sorted(set(STARTED)))
"""


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private default home (``$XDG_CACHE_HOME/pytest-boxlite``): the sub-runs set no boxlite
    option, so the home they would use is the default one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in list(os.environ):
        if name.startswith("PYTEST_BOXLITE_"):
            monkeypatch.delenv(name)
    return tmp_path / "cache" / "pytest-boxlite"


def test_a_run_that_boxes_nothing_makes_no_host_role(pytester: pytest.Pytester, cache: Path) -> None:
    pytester.makeconftest(PROBE)
    pytester.makepyfile("def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess("-s", *QUIET)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["HOST False", "LAZY True", "HEAVY []", "STARTED []"])
    assert not cache.exists(), "a run that boxes nothing made the default home"
    assert not any(line.startswith("boxlite:") for line in result.outlines), result.outlines


def test_a_marked_test_without_boxlite_gets_its_box_and_the_header(pytester: pytest.Pytester, cache: Path) -> None:
    """The other side: a marked test makes the role at its collection; the header, written before
    collection, follows the collection line instead."""
    pytester.makeconftest(PROBE)
    pytester.makepyfile(
        """
        import os
        import pytest

        @pytest.mark.boxlite
        def test_boxed():
            assert os.environ.get("PYTEST_BOXLITE_GUEST")

        def test_plain():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-s", *QUIET)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["collected 2 items", "boxlite: runtime=*", "boxlite: image=*", "*HOST True*"])
    ledger.reconcile(cache, include_kept=True)
    assert ledger.scan(cache) == []


def test_a_sandbox_asked_for_at_run_time_makes_the_role(pytester: pytest.Pytester, cache: Path) -> None:
    """``request.getfixturevalue("boxlite_sandbox")`` is seen by no collection hook: the fixture
    itself makes the role (``fixtures.get_session``)."""
    pytester.makepyfile(
        """
        def test_late(request):
            box = request.getfixturevalue("boxlite_sandbox")
            assert box.execute_command("echo hi").stdout.strip() == "hi"
        """
    )
    result = pytester.runpytest_subprocess(*QUIET)
    result.assert_outcomes(passed=1)
    ledger.reconcile(cache, include_kept=True)
    assert ledger.scan(cache) == []


def test_a_dead_session_s_state_is_still_reconciled(pytester: pytest.Pytester, cache: Path) -> None:
    """A home with another session's state makes the role at the session's start, which removes
    what dead sessions left (here: a dead owner's lock, which nothing holds)."""
    stale = cache / "sessions" / "deadbeef.lock"
    stale.parent.mkdir(parents=True)
    stale.write_text("1\n")
    pytester.makeconftest(PROBE)
    pytester.makepyfile("def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess("-s", *QUIET)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["HOST True"])
    assert not stale.exists(), "the dead session's lock was not reconciled"


def test_a_live_session_s_state_is_no_reason_to_make_the_role(pytester: pytest.Pytester, cache: Path) -> None:
    """A concurrent run in the same home (or this run's own xdist controller) holds its lock and
    has its boxes there: nothing of it is reconciled, so it makes no role either; the same home
    with that owner dead does."""
    owner = "cafe0001"
    lock = ledger.OwnerLock(cache, owner)
    lock.acquire()
    box = cache / "namespace" / f"pbx-{owner}-1"
    box.mkdir(parents=True)
    box.with_name(box.name + ".ctl").mkdir()  # its control directory (the namespace runtime's layout)
    pytester.makeconftest(PROBE)
    pytester.makepyfile("def test_ok():\n    pass\n")
    try:
        result = pytester.runpytest_subprocess("-s", *QUIET)
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines(["HOST False", "HEAVY []"])
    finally:
        # The owner dies as a killed session does: its lock file stays behind, held by nobody.
        fd, lock._fd = lock._fd, None
        assert fd is not None
        os.close(fd)
    assert not plugin._owner_alive(cache, owner)
    assert plugin._has_state(cache)


def test_kept_boxes_of_a_dead_session_are_no_reason_to_make_the_role(pytester: pytest.Pytester, cache: Path) -> None:
    """A box kept by --boxlite-keep (namespace: its ``.keep`` mark; vm: the owner's home's ``keep``)
    stays until ``clean --kept``: reconciling leaves it, so a plain run beside it must not pay for
    the host role each time (it did: +100 ms of CPU per run until the box was cleaned).  The same
    box without its mark is a leftover, and makes the role."""
    owner = "cafe0002"
    box = cache / "namespace" / f"pbx-{owner}-1"
    box.mkdir(parents=True)
    box.with_name(box.name + ".ctl").mkdir()
    box.with_name(box.name + ".keep").write_text('{"kept_at": 0}')
    vm_home = cache / "vm" / "cafe0003"
    vm_home.mkdir(parents=True)
    (vm_home / "keep").write_text("kept for debugging\n")
    assert not plugin._has_state(cache)
    pytester.makeconftest(PROBE)
    pytester.makepyfile("def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess("-s", *QUIET)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["HOST False", "HEAVY []"])
    assert box.exists() and (vm_home / "keep").exists()
    (vm_home / "keep").unlink()
    assert plugin._has_state(cache)  # an unmarked vm home of a dead owner: a leftover
    (vm_home / "keep").write_text("kept\n")
    box.with_name(box.name + ".keep").unlink()
    assert plugin._has_state(cache)  # an unmarked box of a dead owner: a leftover


def test_the_lazy_host_knows_every_box_fixture_and_state_directory() -> None:
    """Its copies of what the roles, the ledger and the runtimes define (it imports none of them)."""
    from pytest_boxlite import roles
    from pytest_boxlite.runtimes import LOCAL_KINDS

    assert BOX_FIXTURES == roles._BOX_FIXTURES
    assert {*LOCAL_KINDS, "sessions"} == set(HOME_STATE_DIRS)
    assert plugin.BOX_NAME.pattern == ledger._NAME.pattern


WANTS = """
from pytest_boxlite import session

WANTED = []
_want = session.BoxliteSession.want


def _recording(self, spec):
    WANTED.append("worker" if spec.warm else "pool")
    return _want(self, spec)


session.BoxliteSession.want = _recording


def pytest_collection_finish(session):
    print("WANTED", len(WANTED), sorted(set(WANTED)))
"""


@pytest.mark.parametrize(
    ("args", "fixture", "kinds"),
    [(("--boxlite",), "", "worker"), ((), "boxlite_sandbox", "pool")],
    ids=["boxlite-unmarked", "sandbox-fixture"],
)
def test_collection_asks_for_the_default_boxes_once_not_per_item(
    pytester: pytest.Pytester, cache: Path, args: tuple[str, ...], fixture: str, kinds: str
) -> None:
    """While collection goes on, the boxes its items need start booting: an unmarked item under
    ``--boxlite`` wants the default worker box, one with a sandbox fixture the pool's.  Each is
    asked for once, not worked out again for each of a suite's items (issue 26: 33,000 collected
    items paid 0.3 s).  Every item is deselected: what collection asks for is all there is."""
    pytester.makeconftest(WANTS)
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.parametrize("i", range(300))
        def test_many(i, {fixture or "request"}):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-s", "-k", "nothing_is_called_this", *args, *QUIET)
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED, result.outlines
    wanted = next(line for line in result.outlines if line.startswith("WANTED"))
    count, kind = wanted.split(" ", 2)[1:]
    assert 1 <= int(count) <= 2 and kind == f"['{kinds}']", wanted
    ledger.reconcile(cache, include_kept=True)
    assert ledger.scan(cache) == []
