"""The vm runtime over REST (``RestRuntime``) on the SDK double's server, for the contract tests of
``spawn`` and ``publish`` (``tests/test_spawn.py``, ``tests/test_publish.py``).  TESTS ONLY.

The server is the one ``tests/test_rest_contract.py`` uses (``tests/sdk_double/rest.py``, a
separate process holding real sandboxes), opened the same way, with its key and the owner that
``conftest.new_box_name`` puts in box names; without its faults (those tests are about the
bookkeeping retries, these about processes and ports).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sdk_double
from conftest import SESSION_HEX
from sdk_double.rest import ServerProcess
from test_rest_contract import KEY

from pytest_boxlite.runtimes.rest import RestRuntime, remote_target


@contextmanager
def rest_runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, RestRuntime]]:
    """A fresh double server and a REST runtime on it; on exit, no box of it is left on the server."""
    srv = ServerProcess(tmp_path_factory.mktemp("rest-server"), key=KEY)
    try:
        target = remote_target(srv.url, credential_file=None, max_boxes=4, environ={"BOXLITE_API_KEY": KEY})
        rt = RestRuntime(target, Path(tmp_path_factory.mktemp("rest-scratch")), f"test{SESSION_HEX}", sdk=sdk_double)
        try:
            yield srv, rt
        finally:
            try:
                left = [r.name for r in rt.list_boxes()]
                for name in left:  # a test that failed midway: still removed, and said
                    rt.remove_box(name)
                assert left == [], f"boxes left on the REST server: {left}"
            finally:
                rt.close()
    finally:
        srv.stop()
