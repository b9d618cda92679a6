"""The runner every table shares: bounded sub-runs, the machine's busy CPU, leak checks, the
temporary work directory, option defaults with a ``--quick`` variant, and table formatting.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import re
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

#: The benchmarks package's directory; the repository root above it.
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: Every pytest run of a generated suite: quiet, no cache, and the installed plugins the suites do
#: not use blocked (importing hypothesis's plugin alone costs ~1.5 s per pytest start here).
QUIET_ARGS = ("-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark")
#: How much of a failed run's output is shown.
TAIL = 3000


def log(msg: str) -> None:
    """Progress goes to stderr; the tables go to stdout."""
    print(msg, file=sys.stderr, flush=True)


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def positive(text: str) -> int:
    """``argparse`` type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def seconds(text: str) -> float:
    """``argparse`` type: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP end a run as Ctrl-C does: the ``finally`` blocks clean up."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)


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


class Skipped(Exception):
    """A row that cannot be measured here; the reason is printed in its place."""


# -- options ------------------------------------------------------------------------------------


def option(
    p: argparse.ArgumentParser, flag: str, normal: Any, quick: Any = None, *, type: Any = positive, help: str = ""
) -> None:
    """An option whose default is ``normal``, or ``quick`` under ``--quick`` (an explicit value wins)."""
    dest = flag.lstrip("-").replace("-", "_")
    defaults: dict[str, tuple[Any, Any]] | None = p.get_default("_defaults")
    if defaults is None:
        defaults = {}
        p.set_defaults(_defaults=defaults)
    quick = normal if quick is None else quick
    defaults[dest] = (normal, quick)
    shown = f"default: {normal}" + (f"; --quick: {quick}" if quick != normal else "")
    p.add_argument(flag, type=type, default=None, help=f"{help} ({shown})")


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the options left unset: their ``--quick`` default or their normal one."""
    for dest, (normal, quick) in (getattr(args, "_defaults", None) or {}).items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, quick if args.quick else normal)
    return args


# -- sub-runs -----------------------------------------------------------------------------------


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


def run_bounded(
    cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float, cgroup: Path | None = None
) -> tuple[int, str, float, bool]:
    """Run ``cmd`` in its own process group; returns (rc, output, wall seconds, timed out).

    With ``cgroup`` (a cgroup directory), the child joins it before its ``exec``, so everything it
    starts is counted there.  On timeout the group gets SIGTERM (pytest-boxlite reaps its boxes on
    it, and pytest prints where it was), then SIGKILL 30 s later.
    """
    join = None
    if cgroup is not None:
        procs = os.open(cgroup / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)

        def join() -> None:
            os.write(procs, b"0\n")  # "0": the writing process itself (cgroup v1 and v2)

    try:
        return _run_bounded(cmd, cwd=cwd, env=env, timeout=timeout, preexec=join)
    finally:
        if cgroup is not None:
            os.close(procs)


def _run_bounded(
    cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float, preexec: Callable[[], None] | None
) -> tuple[int, str, float, bool]:
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
            preexec_fn=preexec,
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


# -- the CPU of a run ------------------------------------------------------------------------------

_CGROUP_FS = Path("/sys/fs/cgroup")


def _own_cgroup(controller: str) -> str | None:
    """This process's cgroup path in the hierarchy of ``controller`` (``""``: the v2 one)."""
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if controller in (controllers.split(",") if controllers else [""]):
            return path
    return None


class CpuMeter:
    """Counts the CPU of one run and of everything it starts, boxes included.

    ``cgroup``: each run gets a child cgroup of this process's own, which the run joins before its
    ``exec``; its usage is read once the cgroup is empty (every box's last process gone).  The
    cgroup v2 hierarchy where there is one (``cpu.stat`` ``usage_usec``, counted in every cgroup,
    no controller needed), else v1's ``cpuacct``.  A box's own cgroups are made by pytest-boxlite
    under the cgroup of the pytest that makes them (``runtimes/_cgroups.py``: its memory, cpu and
    pids cgroups, v1 here), so in either hierarchy they lie under the run's cgroup, or in another
    hierarchy that leaves the run's membership alone: both count their CPU in the run's, also after
    they are removed.  Other work on the machine is not counted: the figure holds on a busy machine
    (the kernel's own threads' work for a run, e.g. a network namespace's teardown in a kworker, is
    not counted either).  ``proc-stat``: the machine's busy CPU around the run (a quiet machine's
    figure).
    """

    def __init__(self, choice: str = "auto") -> None:
        self.kind = "proc-stat"
        self._parent: Path | None = None
        self._usage = ""
        self._n = 0
        self.note = ""
        if choice == "proc-stat":
            self.note = "--cpu-meter proc-stat"
            return
        found = self._find()
        if found is None:
            if choice == "cgroup":
                raise SystemExit(f"--cpu-meter cgroup: no cgroup to measure in here ({self.note})")
            return
        self.kind = "cgroup"
        self._parent, self._usage = found

    def _find(self) -> tuple[Path, str] | None:
        candidates: list[tuple[Path, str, str]] = []
        v2 = _CGROUP_FS if (_CGROUP_FS / "cgroup.controllers").exists() else _CGROUP_FS / "unified"
        candidates.append((v2, "", "cpu.stat"))
        for mount in ("cpuacct", "cpu,cpuacct"):
            candidates.append((_CGROUP_FS / mount, "cpuacct", "cpuacct.usage"))
        problems = []
        for root, controller, usage in candidates:
            own = _own_cgroup(controller)
            if own is None or not (root / usage).exists():
                continue
            parent = root / own.lstrip("/")
            probe = parent / f"benchmarks-{os.getpid()}-probe"
            try:
                probe.mkdir()
                probe.rmdir()
            except OSError as exc:
                problems.append(f"{parent}: {exc.strerror or exc}")
                continue
            return parent, usage
        self.note = "; ".join(problems) or "no cgroup v2 hierarchy or v1 cpuacct controller"
        return None

    def describe(self) -> str:
        """What the CPU figures are (one line for the table's header)."""
        if self.kind == "cgroup":
            assert self._parent is not None
            return (
                f"CPU: cgroup accounting ({self._usage} of a cgroup per run under {self._parent}: the run and "
                "every process it starts, boxes included; other load on the machine not counted)"
            )
        why = f" (no cgroup: {self.note})" if self.note else ""
        return f"CPU: the machine's busy CPU from /proc/stat around each run (a quiet machine's figure){why}"

    def run(
        self, cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float
    ) -> tuple[int, str, float, bool, float | None]:
        """``run_bounded`` with the CPU seconds of the run: (rc, output, wall, timed out, CPU)."""
        if self.kind != "cgroup" or self._parent is None:
            busy = machine_busy()
            rc, out, wall, timed_out = run_bounded(cmd, cwd=cwd, env=env, timeout=timeout)
            after = machine_busy()
            return rc, out, wall, timed_out, (after - busy if busy is not None and after is not None else None)
        self._n += 1
        group = self._parent / f"benchmarks-{os.getpid()}-{self._n}"
        group.mkdir()
        try:
            rc, out, wall, timed_out = run_bounded(cmd, cwd=cwd, env=env, timeout=timeout, cgroup=group)
            # The boxes' last processes may outlive pytest by a moment (reaped by their own init).
            _wait_empty(group, 30.0)
            return rc, out, wall, timed_out, _read_usage(group / self._usage)
        finally:
            _remove_cgroup(group)


def _wait_empty(group: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if not (group / "cgroup.procs").read_text().split():
                return True
        except OSError:
            return True
        if time.monotonic() > deadline:
            log(f"warning: {group} still holds processes after {timeout:.0f} s; its CPU so far is counted")
            return False
        time.sleep(0.02)


def _read_usage(path: Path) -> float | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    if path.name == "cpuacct.usage":
        return int(text.strip()) / 1e9
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) / 1e6
    return None


def _remove_cgroup(group: Path) -> None:
    for _ in range(100):
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    log(f"warning: could not remove the measuring cgroup {group}")


#: The meter every table's runs use (``use_cpu_meter``).
METER = CpuMeter("proc-stat")


def cpu_meter_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cpu-meter",
        choices=("auto", "cgroup", "proc-stat"),
        default="auto",
        help="how a run's CPU is counted: a cgroup per run (every process of the run, boxes included; "
        "holds on a busy machine), the machine's busy CPU from /proc/stat (a quiet machine's), or auto: "
        "cgroup where one can be made (default: auto)",
    )


def use_cpu_meter(args: argparse.Namespace) -> CpuMeter:
    """Set the meter of this invocation's runs from ``--cpu-meter``; returns it."""
    global METER
    METER = CpuMeter(getattr(args, "cpu_meter", "auto"))
    return METER


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


def step(what: str, cmd: list[str], cwd: Path, timeout: float, **env: str) -> str:
    """A preparation step (venv, pip): its output; raises :class:`Skipped` with the reason if it fails."""
    rc, out, wall, timed_out = run_bounded(
        cmd, cwd=cwd, env=clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1", **env), timeout=timeout
    )
    if timed_out or rc != 0:
        tail = " ".join(out.strip().splitlines()[-3:])[-300:]
        raise Skipped(f"{what}: {'timed out' if timed_out else f'exit {rc}'} after {wall:.0f} s: {tail}")
    return out


def leak_check(what: str, home: Path, python: str = sys.executable) -> str:
    """``python -m pytest_boxlite --home H ls`` must say ``no boxes``."""
    cmd = [python, "-m", "pytest_boxlite", "--home", str(home), "ls"]
    rc, out, _, timed_out = run_bounded(cmd, cwd=HERE, env=clean_env(), timeout=60)
    if timed_out or rc != 0 or out.strip() != "no boxes":
        raise RunFailed(f"{what}: leak check", cmd, f"expected 'no boxes', got exit {rc}", out)
    return out.strip()


def check_passed(what: str, cmd: list[str], rc: int, output: str, timed_out: bool, want: int, timeout: float) -> None:
    """A generated suite's run must pass all ``want`` tests."""
    if timed_out:
        raise RunFailed(what, cmd, f"timed out after {timeout:.0f} s", output)
    m = re.search(r"(\d+) passed", output)
    passed = int(m.group(1)) if m else 0
    if rc != 0 or passed != want:
        raise RunFailed(what, cmd, f"exit status {rc}, {passed} of {want} tests passed", output)


def boxlite_summary(output: str) -> str | None:
    """pytest-boxlite's own terminal summary line (boxes booted, lease waits, leaks)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip().startswith("boxes booted")]
    return lines[-1] if lines else None


def pytest_summary(output: str) -> str:
    """pytest's last summary line (``12 passed, 1 failed in 3.2s``), or ''."""
    for line in reversed(output.splitlines()):
        s = line.strip().strip("=").strip()
        if re.search(r"\b(passed|failed|error|errors|skipped|no tests ran)\b", s) and " in " in s:
            return s
    return ""


#: Summary words counted as tests run; ``deselected`` is left out (xdist's controller does not count
#: it), ``warnings`` too (a boxed run may see fewer start-up warnings of plugins it loads once).
COUNTED = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "rerun")


def summary_counts(summary: str) -> dict[str, int]:
    """``12 passed, 1 failed in 3.2s`` -> ``{"passed": 12, "failed": 1}`` (only the :data:`COUNTED` words)."""
    out: dict[str, int] = {}
    for n, word in re.findall(r"(\d+) (\w+)", summary.split(" in ")[0]):
        word = "error" if word == "errors" else word
        if word in COUNTED:
            out[word] = int(n)
    return out


def failure_text(exc: RunFailed) -> str:
    return f"error: {exc}\ncommand: {shlex.join(exc.cmd)}\noutput tail:\n{exc.output[-TAIL:]}"


class Workdir:
    """A temporary directory for one table, with private boxlite homes inside it.

    Leaving it (also on Ctrl-C or SIGTERM) reaps whatever a run stopped half-way left in a home
    (``python -m pytest_boxlite --home H clean``) and removes the directory.
    """

    def __init__(self, prefix: str) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"pbx-bench-{prefix}-"))
        self._homes: list[Path] = []

    def home(self, name: str) -> Path:
        """A fresh, not yet existing home path (the plugin makes it)."""
        path = self.root / "homes" / f"{name}-{len(self._homes)}"
        path.parent.mkdir(exist_ok=True)
        self._homes.append(path)
        return path

    def __enter__(self) -> Workdir:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with deferred_signals():
            for home in self._homes:
                if home.exists():
                    with contextlib.suppress(Exception):
                        cmd = [sys.executable, "-m", "pytest_boxlite", "--home", str(home), "clean"]
                        run_bounded(cmd, cwd=HERE, env=clean_env(), timeout=60)
            shutil.rmtree(self.root, ignore_errors=True)


# -- reporting ----------------------------------------------------------------------------------


def machine_header() -> list[str]:
    """Where the figures come from: versions, runtime, load."""
    import pytest

    from pytest_boxlite.runtimes import choose

    try:
        choice = choose("auto")
        runtime = f"{choice.kind} ({choice.reason})"
    except Exception as exc:  # noqa: BLE001 - shown; the boxed runs fail on it
        runtime = f"unavailable: {exc}"
    load = os.getloadavg()
    return [
        f"python {platform.python_version()}, pytest {pytest.__version__}, {platform.platform()}",
        f"boxlite runtime: {runtime}",
        f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs "
        "(a shared machine makes absolute times noisy; ratios less so)",
    ]


def fmt_time(value: float | None) -> str:
    """Seconds, shown in the unit that suits them."""
    if value is None:
        return "-"
    ms = value * 1e3
    if abs(ms) >= 1000:
        return f"{value:.2f} s"
    return f"{ms:.3f} ms" if abs(ms) < 1 else (f"{ms:.2f} ms" if abs(ms) < 10 else f"{ms:.1f} ms")


def fmt_delta(value: float | None) -> str:
    """A signed difference in seconds: noise can make an overhead negative."""
    return "-" if value is None else ("+" if value >= 0 else "-") + fmt_time(abs(value))


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:,.0f}x"
    return f"{value:.2f}x" if value < 10 else f"{value:.1f}x"


def div(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None where either is unknown or ``b`` is not positive (an overhead within noise)."""
    return None if a is None or b is None or b <= 0 else a / b


def table(header: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = (0,)) -> list[str]:
    """Aligned columns: those in ``left`` left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        return "  ".join(cells).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


@dataclasses.dataclass(frozen=True)
class Table:
    """One sub-command of ``python -m benchmarks``: its name, a one-line summary, the text of its
    ``--help``, its options, and the measurement, which prints the table and returns its exit
    status and its results (for ``--json``)."""

    name: str
    summary: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], tuple[int, dict[str, Any]]]
    #: Part of ``all``.
    in_all: bool = True
    #: Part of ``all --quick``.
    in_quick: bool = True


def summary(samples: list[float]) -> dict[str, Any]:
    """p50/p90/min/max of ``samples`` (seconds), with the samples themselves."""
    p90 = statistics.quantiles(samples, n=10, method="inclusive")[8] if len(samples) >= 2 else samples[0]
    return {
        "n": len(samples),
        "p50": statistics.median(samples),
        "p90": p90,
        "min": min(samples),
        "max": max(samples),
        "samples": samples,
    }
