"""guest/fresh.py's clone_box while another thread wants the GIL: the child must never hang.

A forked box's pid 1 used to hang now and then (click's suite under --boxlite stopped after a few
hundred tests): clone(2) is made through ctypes, so the child runs the eval loop's check of the
eval breaker before PyOS_AfterFork_Child; if execnet's reader thread had woken with data during
the clone and asked for the GIL (a "drop request"), the child gave the GIL up there and waited
forever in drop_gil for a thread it does not have.  Here a reader thread gets a byte every 0.3 ms
from a sender thread (as execnet's reader gets the host's messages) while the interpreter, with
enough mappings that each clone takes milliseconds, clones child after child; a short switch
interval makes the threads ask for the GIL on nearly every clone.  Each child must exit within a
bound; without the fix the first or second child hangs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import json
import mmap
import os
import sys
import threading
import time

forks, bound, with_init = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "init"
sys.setswitchinterval(1e-5)  # the reader asks for the GIL after 10 us of waiting, not 5 ms
r, w = os.pipe()


def receive():  # as execnet's reader: a blocking read, then the GIL to hand the data over
    while os.read(r, 1):
        pass


def send():  # the host's messages
    while True:
        os.write(w, b"x")
        time.sleep(0.0003)


threading.Thread(target=receive, daemon=True).start()
threading.Thread(target=send, daemon=True).start()
# A large interpreter (its mappings, not its memory): each clone(2) copies 10000 mappings first,
# for milliseconds, as it copies a warm box's big heap.  Made after the reader's stack, so they lie
# below it and below the interpreter's data: the reader, woken during that copy, touches no page
# the copy already protected (a fault would hold it until the clone is over) as it asks for the GIL.
ballast = [mmap.mmap(-1, 4096, prot=mmap.PROT_READ | (mmap.PROT_WRITE * (i % 2))) for i in range(10000)]
# Loaded after the reader started, as in the warm interpreter (fresh.py counts it as known).
from pytest_boxlite.guest import boxinit, fresh

ns = {**vars(boxinit), **vars(fresh)}
raw_clone = ns["_SYS_CLONE"].get(os.uname().machine) is not None and ns["_only_known_threads"]()
result = {"raw_clone": raw_clone, "by_forks": 0}
by_forks = ns["_clone_box_by_forks"]


def counted(*args, **kwargs):  # the fork(3) path, where clone_box gives the clone up
    result["by_forks"] += 1
    return by_forks(*args, **kwargs)


ns["_clone_box_by_forks"] = counted
made = 0
try:
    for made in range(1, forks + 1):
        # No namespaces (flags=0, real_root: no id maps), so no privilege is needed: the child
        # only has to get through clone_box and exit.
        # With an init (a test's box): pid 1 forks at once and waits as a bare init, never having
        # run PyOS_AfterFork_Child; its child, the test process, exits.
        init = ns["BareInit"]([], []) if with_init else None
        pid = ns["clone_box"](True, None, True, flags=0, init=init)
        if pid == 0:
            os._exit(0)
        deadline = time.monotonic() + bound
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                with open("/proc/%d/wchan" % pid) as fh:
                    result["hung_in"] = fh.read()
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                result["hung_at"] = made
                raise SystemExit
            time.sleep(0.002)
finally:
    result["forks"] = made
    print(json.dumps(result))
    print(json.dumps(result), file=sys.stderr)
"""


@pytest.mark.reliability
@pytest.mark.skipif(sys.platform != "linux", reason="clone(2) is Linux's")
@pytest.mark.parametrize("mode", ["pid1", "init"])
def test_clone_box_child_never_hangs_while_the_reader_wants_the_gil(tmp_path: Path, mode: str) -> None:
    """``pid1``: the clone's child goes on as pid 1; ``init``: it forks the test process at once
    and waits for it as a bare init (a test's box, guest/fresh.py's BareInit)."""
    forks, bound = 60, 10.0
    script = tmp_path / "clones.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(forks), str(bound), mode],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not result["raw_clone"]:
        pytest.skip("clone_box takes fork(3)'s path on this machine (no clone(2) number known)")
    assert "hung_at" not in result, (
        f"a cloned child hung before it exited (clone {result['hung_at']} of {forks}, "
        f"waiting in {result.get('hung_in')!r} for over {bound} s): a GIL drop request was pending at the clone"
    )
    assert result["forks"] == forks
    # Most children must come from the raw clone(2) this is about, not fork(3)'s fallback.
    assert result["by_forks"] < forks // 2, result
