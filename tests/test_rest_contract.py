"""A subset of the sandbox contract (``test_contract.py``) on the vm runtime over the REST client.

The same test functions, run against :class:`~pytest_boxlite.runtimes.rest.RestRuntime` on the
SDK double's server (a separate process holding real sandboxes, ``tests/sdk_double/rest.py``)
instead of a local home.  Exec, stdio and file operations are the vm runtime's code in both; the
subset covers what the REST path changes around them: boxes that are created, started, listed and
removed by requests, with no volumes, and leases renewed while the tests run.  The server drops
one request in three for the whole module (``set_faults``), so every bookkeeping call here also
goes through the retries.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sdk_double
import test_contract as contract
from conftest import SESSION_HEX
from sdk_double.rest import ServerProcess, set_faults
from test_contract import shared  # noqa: F401 - the contract's module fixture, over this module's runtime

from pytest_boxlite.runtimes import Runtime
from pytest_boxlite.runtimes.rest import RestRuntime, remote_target

pytestmark = pytest.mark.timeout(90)
KEY = "blk_contract_91c2"

SUBSET = [
    "test_identity",
    "test_execute_command_captures_stdout_stderr_and_exit_code",
    "test_execute_command_signal_death_is_negative",
    "test_stdin_is_empty_without_input",
    "test_concurrent_commands_on_one_box",
    "test_run_large_input",
    "test_run_env",
    "test_run_cwd",
    "test_run_missing_program_fails",
    "test_timeout_kills_and_keeps_partial_output",
    "test_background_child_holding_output_open_does_not_block",
    "test_output_cap_truncates_and_flags",
    "test_write_bytes_all_byte_values",
    "test_20mb_file_round_trip_write_read",
    "test_upload_download_tree",
    "test_grep_basic",
    "test_run_rejects_nul_in_argument",
]
for _name in SUBSET:
    globals()[_name] = getattr(contract, _name)


@pytest.fixture(scope="module")
def rest_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("rest-server"), key=KEY)
    # One bookkeeping request in three is dropped without an answer: the retries must absorb it.
    set_faults(srv.home, every=3, ops=["list", "create", "remove", "get"])
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def runtime(rest_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runtime]:
    """The vm runtime over REST; the owner is the one ``conftest.new_box_name`` puts in box names."""
    target = remote_target(rest_server.url, credential_file=None, max_boxes=2, environ={"BOXLITE_API_KEY": KEY})
    rt = RestRuntime(target, Path(tmp_path_factory.mktemp("rest-scratch")), f"test{SESSION_HEX}", sdk=sdk_double)
    try:
        yield rt
    finally:
        set_faults(rest_server.home)
        try:
            assert [r.name for r in rt.list_boxes()] == []
            assert rest_server.log().count("dropped") >= 5  # the retries really were exercised
        finally:
            rt.close()


@pytest.fixture(scope="module")
def runtime_kind() -> str:
    return "vm"
