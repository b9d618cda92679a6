"""A one-command check that the vm runtime really works on this host: boot one box, run the contract's core.

``python -m pytest_boxlite doctor --selftest`` calls :func:`run_selftest`.  It
opens a throw-away BoxLite home, boots one micro-VM of the default image and
checks, each bounded in time, what the plugin relies on and what the SDK
review could only settle on a host that boots VMs:

* a command runs, in ``/workspace`` (which the box itself creates: review #13);
* a command that reads stdin gets EOF at once when given no input (#18);
* a 6 MiB stdin arrives whole (#17) and files round-trip byte for byte;
* a timeout kills the command's whole process tree, not only its leader (#20);
* the stdio bridge (what test workers and xdist use) is binary-clean and
  relays SIGTERM to the command (#21, #22 and #16's framing).

Each step prints one line with its time; the result is 0 when every step
passed.  The tests run it against the SDK double (``tests/sdk_double``); on a
machine with KVM it is the first thing to run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TextIO

from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.runtimes.vm import VmBox, VmRuntime, prepare_home
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec

#: Bound on booting the one box (the first boot in a fresh home pulls the image).
BOOT_TIMEOUT = 300.0


class SelftestFailure(AssertionError):
    """One self-test step found the runtime misbehaving."""


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise SelftestFailure(what)


def _steps(box: VmBox) -> list[tuple[str, Callable[[], None]]]:
    sb = Sandbox(box)

    def workdir() -> None:
        r = box.exec(["pwd"], timeout=30)
        _check(r.exit_code == 0 and r.stdout == b"/workspace\n", f"pwd gave {r.exit_code} {r.stdout!r}")

    def stdin_eof() -> None:
        start = time.monotonic()
        r = box.exec(["cat"], timeout=10)
        _check(r.exit_code == 0 and not r.timed_out, f"cat without input: {r}")
        _check(time.monotonic() - start < 10, "cat without input waited for EOF")

    def big_input() -> None:
        r = box.exec(["wc", "-c"], input=b"x" * (6 << 20), timeout=60)
        _check(r.stdout.strip() == str(6 << 20).encode(), f"6 MiB stdin arrived as {r.stdout!r}")
        data = os.urandom(3 << 20)
        sb.write_bytes("selftest.bin", data, timeout=60)
        _check(sb.read_bytes("selftest.bin", timeout=60) == data, "a 3 MiB file did not round-trip")

    def tree_kill() -> None:
        r = box.exec(["sh", "-c", "sleep 300 & echo $!; wait"], timeout=2)
        child = r.stdout.decode().strip()
        _check(r.timed_out and child.isdigit(), f"timeout run gave {r}")
        # A killed child is a zombie until the box's init reaps it (its orphan reaper runs every
        # half second), and kill -0 succeeds on a zombie: it must be gone within a few seconds.
        deadline = time.monotonic() + 5.0
        while box.exec(["kill", "-0", child], timeout=10).exit_code == 0:
            _check(time.monotonic() < deadline, "a timed-out command's child lives on")
            time.sleep(0.2)

    def bridge() -> None:
        data = bytes(range(256)) * 1024
        cmd = box.attach_argv(["cat"])
        r = subprocess.run(cmd, input=data, capture_output=True, timeout=60)
        _check(r.returncode == 0 and r.stdout == data, f"bridge round trip: exit {r.returncode}, {r.stderr[-300:]!r}")
        prog = (
            "import signal, sys, time\n"
            "signal.signal(15, lambda *a: sys.exit(7))\n"
            "print('up', flush=True)\n"
            "time.sleep(60)\n"
        )
        with subprocess.Popen(box.attach_argv([box.guest_python, "-c", prog]), stdout=subprocess.PIPE) as p:
            assert p.stdout is not None
            _check(p.stdout.readline() == b"up\n", "the bridged command did not start")
            p.send_signal(signal.SIGTERM)
            try:
                code = p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                raise SelftestFailure("SIGTERM did not reach the bridged command") from None
        _check(code == 7, f"the bridged command exited {code} after SIGTERM, not 7")

    return [
        ("exec in /workspace", workdir),
        ("stdin gets EOF without input", stdin_eof),
        ("6 MiB stdin and a 3 MiB file", big_input),
        ("timeout kills the command tree", tree_kill),
        ("stdio bridge: bytes and signals", bridge),
    ]


def run_selftest(
    *,
    image: str | None = None,
    home: Path | None = None,
    sdk: Any | None = None,
    out: TextIO | None = None,
    only: Collection[str] | None = None,
) -> int:
    """Boot one micro-VM and check the vm runtime end to end; 0 when every step passed.

    ``home`` defaults to a temporary directory (removed afterwards); ``sdk``
    replaces the ``boxlite`` module (the tests pass the SDK double); ``only``
    runs just the steps whose labels start with one of its strings.
    """
    import sys

    out = out or sys.stdout
    tmp = None
    if home is None:
        tmp = tempfile.TemporaryDirectory(prefix="boxlite-selftest-")
        home = Path(tmp.name)
    failures = 0
    try:
        t0 = time.monotonic()
        try:
            rt = VmRuntime(prepare_home(home, "selftest"), sdk=sdk)
        except BoxliteError as exc:
            print(f"FAIL open runtime: {exc}", file=out)
            return 1
        try:
            spec = BoxSpec(image=image) if image else BoxSpec()
            try:
                box = rt.create_box(spec, f"pbx-selftest-{uuid.uuid4().hex[:8]}", timeout=BOOT_TIMEOUT)
            except BoxliteError as exc:
                print(f"FAIL boot {spec.describe()}: {exc}", file=out)
                return 1
            print(f"ok   boot {spec.describe()} ({time.monotonic() - t0:.2f}s)", file=out)
            try:
                for label, step in _steps(box):
                    if only is not None and not label.startswith(tuple(only)):
                        continue
                    t = time.monotonic()
                    try:
                        step()
                    except (SelftestFailure, BoxliteError, OSError, subprocess.SubprocessError) as exc:
                        failures += 1
                        print(f"FAIL {label}: {exc}", file=out)
                    else:
                        print(f"ok   {label} ({time.monotonic() - t:.2f}s)", file=out)
            finally:
                box.destroy()
        finally:
            rt.close()
        verdict = "all steps passed" if not failures else f"{failures} step(s) failed"
        print(f"selftest: {verdict} in {time.monotonic() - t0:.1f}s", file=out)
        return 1 if failures else 0
    finally:
        if tmp is not None:
            tmp.cleanup()
