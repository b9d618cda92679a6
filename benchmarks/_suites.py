"""The generated test suites the tables run: trivial tests, ``boxlite_sandbox`` tests, parametrized
modules, and the conftest that times each test on the host."""

from __future__ import annotations

import dataclasses
from pathlib import Path

#: Host-side per-test timing: logstart -> logfinish in the process that logs the reports (junitxml
#: durations would not do: a boxed test's are measured inside the box and leave out the lease and
#: the round trip).
TIMING_CONFTEST = '''\
"""Host-side per-test timing for the benchmarks (logstart -> logfinish)."""

import json
import os
import time

_start = {}
_times = []


def pytest_runtest_logstart(nodeid, location):
    _start[nodeid] = time.perf_counter()


def pytest_runtest_logfinish(nodeid, location):
    t0 = _start.pop(nodeid, None)
    if t0 is not None:
        _times.append(time.perf_counter() - t0)


def pytest_unconfigure(config):
    out = os.environ.get("BENCH_TIMING_FILE")
    # Not from a box's test worker (it sees the same conftest), nor from an xdist worker.
    if out and os.environ.get("PYTEST_BOXLITE_GUEST") != "1" and not hasattr(config, "workerinput"):
        with open(out, "w") as f:
            json.dump(_times, f)
'''

SANDBOX_TEST = """\
def test_sandbox_{i}(boxlite_sandbox):
    assert boxlite_sandbox.execute_command("true").exit_code == 0


"""

PARAM_MODULE = """\
import pytest


@pytest.mark.parametrize("i", range({n}))
def test_case(i):
    pass
"""


@dataclasses.dataclass(frozen=True)
class Suite:
    """A generated suite: its directory, and the node ids of its tests."""

    path: Path
    nodeids: tuple[str, ...]

    @property
    def tests(self) -> int:
        return len(self.nodeids)


def _trivial(names: list[str], marked: bool = False) -> str:
    mark = "@pytest.mark.boxlite\n" if marked else ""
    body = "".join(f"{mark}def {name}():\n    pass\n\n\n" for name in names).rstrip() + "\n"
    return ("import pytest\n\n\n" + body) if marked else body


def _directory(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "pytest.ini").write_text("[pytest]\n")
    (path / "conftest.py").write_text(TIMING_CONFTEST)


def trivial(path: Path, n: int, per_module: int | None = None, *, marked: bool = False) -> Suite:
    """``n`` trivial tests (``def test_i(): pass``), ``per_module`` a module (all in one if None);
    ``marked``: each decorated ``@pytest.mark.boxlite``."""
    _directory(path)
    per = per_module or n
    nodeids: list[str] = []
    for m in range((n + per - 1) // per):
        names = [f"test_{i}" for i in range(m * per, min(n, (m + 1) * per))]
        module = path / f"test_trivial_{m:03d}.py"
        module.write_text(_trivial(names, marked))
        nodeids += [f"{module.name}::{name}" for name in names]
    return Suite(path, tuple(nodeids))


def sandbox(path: Path, n: int) -> Suite:
    """``n`` tests that each take ``boxlite_sandbox`` and run one ``execute_command("true")``."""
    _directory(path)
    (path / "test_sandbox.py").write_text("".join(SANDBOX_TEST.format(i=i) for i in range(n)))
    return Suite(path, tuple(f"test_sandbox.py::test_sandbox_{i}" for i in range(n)))


def parametrized(path: Path, n: int) -> Suite:
    """One test parametrized with ``n`` cases."""
    _directory(path)
    (path / "test_param.py").write_text(PARAM_MODULE.format(n=n))
    return Suite(path, tuple(f"test_param.py::test_case[{i}]" for i in range(n)))
