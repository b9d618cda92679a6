"""Pieces the benchmark scripts share: logging, signal handling, bounded sub-runs, the leak check.

Each script stays runnable on its own (``python benchmarks/<name>.py``): this directory is on
``sys.path`` when one of them runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: The repository root's benchmarks directory, where leak checks run from.
HERE = Path(__file__).resolve().parent


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def positive(text: str) -> int:
    """``argparse`` type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def cli(
    parse_args: Callable[[list[str] | None], argparse.Namespace],
    run: Callable[[argparse.Namespace], int],
    *,
    interrupted: str,
    argv: list[str] | None = None,
) -> int:
    """Every script's ``main``: parse, run; SIGTERM/SIGHUP/Ctrl-C end the run as an interruption.

    ``run`` cleans up in its ``finally`` blocks (under :func:`deferred_signals`); then this logs
    ``interrupted: <interrupted>`` and returns 130, as a shell does for SIGINT.
    """
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)
    try:
        return run(args)
    except KeyboardInterrupt:
        log(f"interrupted: {interrupted}")
        return 130


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold off Ctrl-C/SIGTERM while cleaning up; re-raise afterwards."""
    got: list[int] = []
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    old = {s: signal.signal(s, lambda signum, _frame: got.append(signum)) for s in sigs}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if got:
            raise KeyboardInterrupt(f"signal {got[0]} during cleanup")


class RunFailed(Exception):
    """A measured run failed: its result would be meaningless."""

    def __init__(self, what: str, cmd: list[str], detail: str, output: str) -> None:
        super().__init__(f"{what}: {detail}")
        self.what = what
        self.cmd = cmd
        self.detail = detail
        self.output = output


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without PYTEST_* settings (PYTEST_ADDOPTS, PYTEST_BOXLITE_*...), and
    with Python's bytecode caches on, as a user's machine has them: a shell that sets
    PYTHONDONTWRITEBYTECODE (some CI and agent shells do) makes every interpreter compile every
    module of an editable checkout, and pytest rewrite every plugin's asserts, at each start."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "PYTHONDONTWRITEBYTECODE"}
    env.update(extra)
    return env


def machine_busy() -> float | None:
    """Seconds of CPU this machine has spent busy since boot, all cores together (``/proc/stat``:
    user, nice, system, irq, softirq; not idle, iowait or steal), or ``None`` off Linux.

    Read around a run, it counts what no rusage of the run would: boxes reaped by their own init,
    and the kernel's own threads tearing namespaces down.  It also counts anything else running
    on the machine, so it means something on a quiet machine only.
    """
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def run_bounded(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, float, bool]:
    """Run ``cmd`` in its own process group; returns (rc, output, wall seconds, timed out).

    On timeout the group gets SIGTERM (pytest-boxlite reaps its boxes on it, and
    pytest prints where it was), then SIGKILL 30 s later.
    """
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        timed_out = False
        try:
            if not _wait_exactly(proc, timeout):
                raise subprocess.TimeoutExpired(cmd, timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        wall = time.perf_counter() - t0
        out.seek(0)
        text = out.read().decode(errors="replace")
    return proc.returncode, text, wall, timed_out


def _wait_exactly(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait for ``proc`` up to ``timeout``; whether it ended.  Woken by the exit itself (a pidfd):
    ``Popen.wait(timeout)`` polls, up to 50 ms apart, which put up to 50 ms (25 on average) on
    every wall measured, and as much noise on every ratio of two of them."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux 5.3+: the polling wait
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    if not ready:
        return False
    proc.wait()
    return True


def leak_check(what: str, home: Path) -> str:
    """``python -m pytest_boxlite --home H ls`` must say ``no boxes``."""
    cmd = [sys.executable, "-m", "pytest_boxlite", "--home", str(home), "ls"]
    rc, out, _, timed_out = run_bounded(cmd, cwd=HERE, env=clean_env(), timeout=60)
    if timed_out or rc != 0 or out.strip() != "no boxes":
        raise RunFailed(f"{what}: leak check", cmd, f"expected 'no boxes', got exit {rc}", out)
    return out.strip()
