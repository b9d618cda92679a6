"""``--boxlite-scope=worker`` under xdist: each local popen gateway attaches to a box server of its
own, booted ahead of xdist (:func:`pytest_boxlite.xdist_support.box_worker_specs`).

Real box servers (``python -m pytest_boxlite`` processes) boot real boxes here: moved out of
``tests/unit`` (in-process tests that must stay fast on a loaded machine: issue 41).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from subruns import wait_until
from unit.test_session_unit import make_settings

from pytest_boxlite import boxproc
from pytest_boxlite.session import BoxliteSession
from pytest_boxlite.xdist_support import box_worker_specs

pytestmark = pytest.mark.timeout(60)


def ls(home: Path) -> str:
    """``python -m pytest_boxlite ls``: the boxes in ``home``, one per line."""
    cmd = [sys.executable, "-m", "pytest_boxlite", "--home", str(home), "ls"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout.strip()


def test_worker_scope_boxes_every_local_popen_and_refuses_remote_specs(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    session = BoxliteSession(make_settings(tmp_path, scope="worker"), session_id="abc", worker_id=None)
    config = pytester.parseconfig("-d", "--tx", "2*popen", "--tx", "popen//python=/opt/py3")
    servers = box_worker_specs(session, config, boxproc.main)
    try:
        specs = config.option.tx
        assert len(specs) == 3, specs
        # Each gateway attaches to its own box server, started now (booting its box ahead of xdist).
        for i, spec in enumerate(specs):
            assert spec.startswith("popen//") and f"--via {servers.sockets[i]} " in spec, spec
            assert servers.sockets[i].is_socket() and servers.procs[i].poll() is None
        assert specs[2].endswith("-- /opt/py3"), specs[2]
        assert oct(servers.dir.stat().st_mode & 0o777) == "0o700"
        # Each server boots its box without waiting for a worker.
        assert wait_until(lambda: ls(tmp_path).count("pbx-abc-p") == 3, timeout=25), ls(tmp_path)
    finally:
        servers.stop()
    assert [p.returncode for p in servers.procs] == [143] * 3  # 128 + SIGTERM: through its cleanup, not killed
    assert not servers.dir.exists()
    assert ls(tmp_path) == "no boxes"

    config = pytester.parseconfig("-d", "--tx", "popen", "--tx", "socket=127.0.0.1:9")
    with pytest.raises(pytest.UsageError, match=r"'socket=127\.0\.0\.1:9'.*--boxlite-scope=test or module"):
        box_worker_specs(session, config, boxproc.main)
