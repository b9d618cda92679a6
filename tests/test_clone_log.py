"""A zygote clone's log stays bounded on the host (issue 22, item 3, for sandbox boxes forked
from a zygote): its agent's stderr is a pipe the host drains into ``box.log`` up to 4 MiB, not an
``O_APPEND`` descriptor of the host file.

A guest cannot reach its agent's stderr (the agent is not dumpable, so ``/proc/1/fd/2`` is closed
to it); the test takes the place of one that could: the host opens the clone agent's descriptor 2
through ``/proc`` (root only) and writes 6 MiB there, as anything holding that descriptor in the
box would.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CREATE_TIMEOUT, new_box_name
from subruns import wait_until

from pytest_boxlite.runtimes.namespace.clone_log import LOG_CAP, TAIL_KEPT, CappedBoxLog
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec

pytestmark = [pytest.mark.escapes, pytest.mark.timeout(120)]


@pytest.fixture
def clone(runtimes: object) -> Iterator[Sandbox]:
    rt = runtimes.get("namespace-forked")  # type: ignore[attr-defined]
    handle = rt.create_box(BoxSpec(), new_box_name(), timeout=CREATE_TIMEOUT)
    try:
        yield Sandbox(handle)
    finally:
        handle.destroy()


@pytest.mark.escape_row("inherited-descriptors", users="root")
def test_a_clones_stderr_is_a_capped_pipe_not_the_host_file(clone: Sandbox) -> None:
    if os.geteuid() != 0:
        pytest.skip("the clone's agent is not dumpable: only root reads its descriptors through /proc")
    handle = clone.handle
    assert handle.forked_from, "not forked from a zygote"  # type: ignore[attr-defined]
    agent = handle.agent_pid  # type: ignore[attr-defined]
    fd2 = f"/proc/{agent}/fd/2"
    assert stat.S_ISFIFO(os.stat(fd2).st_mode), os.readlink(fd2)  # a pipe, not the host's box.log
    log_path = _box_log(handle)
    before = log_path.stat().st_size

    w = os.open(fd2, os.O_WRONLY)  # the pipe's write end, as a holder in the box has it
    try:
        chunk = b"x" * (1 << 20)
        for _ in range(6):
            os.write(w, chunk)  # blocks while the pipe is full: the host drains it
    finally:
        os.close(w)
    note = b"reached its cap of %d bytes" % LOG_CAP
    assert wait_until(lambda: note in log_path.read_bytes(), timeout=30), log_path.stat().st_size
    assert clone.execute_command("echo still answers", timeout=30).stdout.strip() == "still answers"
    size = log_path.stat().st_size
    assert size - before <= LOG_CAP + 200, size


@pytest.mark.escape_row("inherited-descriptors", runtime="host")
def test_what_comes_last_after_the_cap_is_kept(tmp_path: Path) -> None:
    """The unit layer (a real pipe and the host's real drainer thread, no box): past the cap only
    the last bytes are written, once the pipe ends."""
    path = tmp_path / "box.log"
    log = CappedBoxLog(path, cap=1000)
    w = log.write_end
    log.write_end = -1  # this test is the box: it holds the write end
    try:
        for _ in range(50):
            os.write(w, b"y" * 1000)
        os.write(w, b"THE-LAST-WORDS\n")
    finally:
        os.close(w)
    assert wait_until(lambda: log.ended, timeout=30)
    text = path.read_bytes()
    assert text.startswith(b"y" * 1000 + b"\n[pytest-boxlite: this log reached its cap of 1000 bytes")
    assert b"49000 bytes dropped" in text or b"bytes dropped" in text
    assert text.endswith(b"THE-LAST-WORDS\n")
    assert len(text) <= 1000 + TAIL_KEPT + 400


def _box_log(handle: object) -> Path:
    """The host-side ``box.log`` of a namespace box (in its private control directory)."""
    from pytest_boxlite.runtimes.namespace.layout import ctl_dir

    return ctl_dir(Path(handle.box_dir)) / "box.log"  # type: ignore[attr-defined]
