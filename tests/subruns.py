"""Helpers shared by the test files that start real pytest sub-runs (session, reliability, xdist)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import pwd
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence, Set
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

    from pytest_boxlite.runtimes.namespace import NamespaceRuntime
    from pytest_boxlite.runtimes.namespace.zygote import ForkPlan
    from pytest_boxlite.spec import BoxSpec

#: Plugins installed here that sub-runs do not need and that slow every pytest start.
QUIET = ("-p", "no:hypothesispytest", "-p", "no:benchmark", "-p", "no:cacheprovider")
#: pytester changes $HOME; bwrap is found in boxlite's data directory under the real one.
REAL_DATA_HOME = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(interval)


def sub_env(**extra: str) -> dict[str, str]:
    """A sub-run's environment: no boxlite settings and no outer xdist/pytest state leak in."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_BOXLITE_", "PYTEST_XDIST_")) and k not in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")
    }
    env["XDG_DATA_HOME"] = REAL_DATA_HOME
    env.update(extra)
    return env


def process_gone(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (it runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _proc_read(pid: int, name: str) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return None


def _pids_where(name: str, keep: Callable[[bytes], bool]) -> list[int]:
    """Host pids of live processes whose ``/proc/PID/<name>`` satisfies ``keep``."""
    out = []
    for pid in (int(e) for e in os.listdir("/proc") if e.isdigit()):
        data = _proc_read(pid, name)
        if data is not None and keep(data) and not process_gone(pid):
            out.append(pid)
    return out


def pids_with(tag: str) -> list[int]:
    """Host pids of live processes whose command line contains ``tag``."""
    return _pids_where("cmdline", lambda cmd: tag.encode() in cmd)


def children_of(parent: int) -> list[int]:
    """Host pids of the live children of ``parent``."""
    return _pids_where("stat", lambda stat: int(stat.rsplit(b")", 1)[1].split()[1]) == parent)


def comm_of(pid: int) -> str:
    """A process's name in the process table (``/proc/PID/comm``), or ``""`` when it is gone."""
    return (_proc_read(pid, "comm") or b"").decode(errors="replace").strip()


def pytest_argv(home: Path, *args: str) -> list[str]:
    """``python -m pytest`` with the quiet plugin set and a private boxlite home."""
    return [sys.executable, "-m", "pytest", *QUIET, f"--boxlite-home={home}", *args]


class SubRun:
    """``python -m pytest`` in ``cwd`` as a subprocess; its output goes to a log file.

    A test file sets :attr:`base_args` (given to every one of its sub-runs) and
    :attr:`wait_timeout` in a subclass when it needs them.
    """

    base_args: tuple[str, ...] = ()
    wait_timeout = 120.0

    def __init__(
        self,
        cwd: Path,
        home: Path,
        tag: str,
        *args: str,
        env: dict[str, str] | None = None,
        new_session: bool = False,
    ) -> None:
        self.log_path = cwd / f"{tag}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in wait()/kill()
        self.proc = subprocess.Popen(
            pytest_argv(home, *self.base_args, *args),
            cwd=cwd,
            env=env or sub_env(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float | None = None) -> int:
        try:
            return self.proc.wait(self.wait_timeout if timeout is None else timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if self._own_group():
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.kill()
            self.proc.wait(30)
        self._log.close()

    def _own_group(self) -> bool:
        try:
            return os.getpgid(self.proc.pid) == self.proc.pid
        except ProcessLookupError:
            return False


@contextlib.contextmanager
def host_cleanup(*paths: Path) -> Iterator[None]:
    """Remove ``paths`` from the host afterwards, should a box's write have leaked there."""
    try:
        yield
    finally:
        for p in paths:
            with contextlib.suppress(OSError):
                p.unlink()


#: A test that holds a box until told to let go (or a deadline passes): the subject of the signal tests.
HOLDER = """
import os, time
from pathlib import Path

def test_hold(boxlite_sandbox):
    boxlite_sandbox.write_file("/workspace/held", "yes")
    Path(os.environ["HOLD_MARKER"]).write_text(boxlite_sandbox.name)
    release = Path(os.environ["HOLD_RELEASE"])
    deadline = time.monotonic() + 90
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert release.exists(), "never released"
    assert boxlite_sandbox.read_file("/workspace/held") == "yes"
"""


class TcpServer:
    """A TCP server on the host's 127.0.0.1 that records what each connection sends."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port: int = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    self.received.append(conn.recv(100))

    def got(self, data: bytes, timeout: float = 5.0) -> bool:
        return wait_until(lambda: data in self.received, timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def run_in_pty(
    args: Sequence[str],
    cwd: Path,
    answers: Sequence[tuple[bytes, bytes, float]] = (),
    timeout: float = 150.0,
    columns: int = 120,
) -> tuple[int, bytes]:
    """Run ``args`` on a new pseudo-terminal, as from a user's shell; type each ``(prompt, reply,
    delay)`` of ``answers`` ``delay`` seconds after ``prompt`` appears (after the previous reply).
    Its exit code and everything it wrote to the terminal, as bytes."""
    env = sub_env(TERM="dumb", COLUMNS=str(columns), PY_COLORS="0")
    pid, fd = pty.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.chdir(cwd)
            os.execve(args[0], list(args), env)
        finally:
            os._exit(127)
    out = bytearray()
    seen = 0
    pending = list(answers)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"no end within {timeout}s:\n{out.decode(errors='replace')[-4000:]}")
            ready, _, _ = select.select([fd], [], [], 0.2)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child's side of the terminal closed
                break
            if not chunk:
                break
            out += chunk
            if pending and pending[0][0] in out[seen:]:
                _prompt, reply, delay = pending.pop(0)
                seen = len(out)
                time.sleep(delay)
                os.write(fd, reply)
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)
    assert not pending, f"never prompted for {pending}:\n{out.decode(errors='replace')[-4000:]}"
    return os.waitstatus_to_exitcode(status), bytes(out)


@contextlib.contextmanager
def host_netrc(secret: str) -> Iterator[Path]:
    """``~/.netrc`` holding ``secret``, removed afterwards; skips where the user has one of its own.

    The mask tests need that very name, so runs as the same user (CI's two ordinary-user jobs
    share one home) take turns: an exclusive lock is held from the check to the removal, or one
    run removes the file another is testing (CI: FileNotFoundError at the removal).
    """
    import pytest

    from pytest_boxlite.settings import default_home

    netrc = Path.home() / ".netrc"
    # In the plugin's own default home (~/.cache/pytest-boxlite), not loose in the user's.
    locks = Path(default_home())
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / "test-netrc.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if netrc.exists():
            pytest.skip("this host has a ~/.netrc of its own; not touching it")
        try:
            netrc.write_text(f"machine pbx-test.invalid login x password {secret}\n")
            netrc.chmod(0o600)
            yield netrc
        finally:
            with contextlib.suppress(FileNotFoundError):
                netrc.unlink()


#: The second local account the attack tests act as (another user of a shared machine).
ATTACKER = "boxlite-attacker"


def second_user(runuser: bool = True) -> pwd.struct_passwd:
    """:data:`ATTACKER`'s account, made with ``useradd`` where missing; skips unless root (and
    where ``useradd``, or ``runuser`` when the test becomes that user, is not installed)."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to make a second local user" + (" and become it (runuser)" if runuser else ""))
    for tool in ("useradd", "runuser") if runuser else ("useradd",):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} (util-linux, passwd) is not installed")
    try:
        return pwd.getpwnam(ATTACKER)
    except KeyError:
        made = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if made.returncode != 0 and "already exists" not in made.stderr:  # a parallel run made it
            pytest.fail(f"useradd {ATTACKER} failed: {made.stderr.strip()}")
        return pwd.getpwnam(ATTACKER)


def read_line(conn: socket.socket) -> bytes:
    """One line a server sent on ``conn`` (up to its newline, or all it sent before closing)."""
    data = b""
    while not data.endswith(b"\n"):
        more = conn.recv(1)
        if not more:
            break
        data += more
    return data


#: Loaded by a sub-run (and its xdist workers): every namespace box made is written to BOX_SPY.
#: Observation only: the box is still made by the real runtime.
BOX_SPY_CONFTEST = """
import os

from pytest_boxlite.runtimes.namespace import runtime

_make = runtime.NamespaceRuntime._make


def _spied(self, spec, name, *args, **kwargs):
    with open(os.environ["BOX_SPY"], "a") as f:
        f.write(name + "\\n")
    return _make(self, spec, name, *args, **kwargs)


runtime.NamespaceRuntime._make = _spied
"""


def record_fork_plans(rt: NamespaceRuntime, monkeypatch: pytest.MonkeyPatch) -> list[ForkPlan]:
    """Every fork plan the namespace runtime ``rt`` makes from now on, in order; ``monkeypatch``
    puts its own method back at the test's end."""
    plans: list[ForkPlan] = []
    real = rt._fork_plan

    def recorded(spec: BoxSpec) -> ForkPlan:
        plans.append(real(spec))
        return plans[-1]

    monkeypatch.setattr(rt, "_fork_plan", recorded)
    return plans


def plans_grew(hidden: Sequence[Set[str]]) -> int:
    """How many of ``hidden`` (the paths each fork plan hid, in order) hid a path that no plan
    before them hid: each may take a new zygote (another session's home appeared meanwhile; CI
    runs jobs side by side), where a plan with nothing new keeps the one there is."""
    seen: set[str] = set()
    grew = 0
    for i, paths in enumerate(hidden):
        grew += i > 0 and not paths <= seen
        seen |= paths
    return grew
