"""Service fixtures (issue 24, item 3): ``pytest_boxlite.service(...)`` declared in a conftest.

Real sub-runs of small projects whose conftest declares ``python -m http.server`` services in
boxes (the box's network off; the host reaches them through published ports).  Each service's
command line carries a tag (``-X pbxtag_<uuid>``: an option the interpreter ignores) so the
host can find its processes in the process table, and every test checks that none outlives
its run (normal end, Ctrl-C, ``kill -9`` then the next start).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from pathlib import Path

import pytest
from subruns import QUIET, SubRun, pids_with, process_gone, sub_env, wait_until

from pytest_boxlite import ledger
from pytest_boxlite.errors import ConfigError
from pytest_boxlite.services import CommandReady, HttpReady, OutputReady, PortReady, service

pytestmark = pytest.mark.timeout(240)

#: The head of every sub-run's conftest: a tagged http.server command for the services.
HEAD = """
import os, sys
from pytest_boxlite import service, PortReady, OutputReady, HttpReady, CommandReady

TAG = os.environ["PBX_TAG"]


def server(port=8000):
    return [sys.executable, "-X", "pbxtag_" + TAG, "-u", "-m", "http.server", str(port), "--bind", "127.0.0.1"]
"""

SCOPES_CONFTEST = (
    HEAD
    + """
web_session = service(
    "web_session", server(), ports=[8000], scope="session",
    ready=[PortReady(8000), OutputReady("Serving HTTP", stream="stdout")],
)
web_package = service("web_package", server(8001), ports=[8001], ready=HttpReady(8001), scope="package")
web_module = service(
    "web_module", server(), ports=[8000], scope="module",
    ready=CommandReady([sys.executable, "-c", "import socket; socket.create_connection(('127.0.0.1', 8000), 1)"]),
)
web_class = service("web_class", server(), ports=[8000], ready=HttpReady(8000, "/", 200), scope="class")
web_function = service("web_function", server(), ports=[8000], scope="function", env={"PBX_WHO": "function"})

import uuid
import pytest

# Plain fixtures of the same scopes: a service must have as many instances as pytest makes of these.
for _scope in ("session", "package", "module", "class", "function"):
    globals()[f"plain_{_scope}"] = pytest.fixture(scope=_scope, name=f"plain_{_scope}")(lambda: uuid.uuid4().hex)
"""
)

#: Every test records which instance of each service it got (host side: these tests run unboxed).
SCOPES_TEST = """
import os, urllib.request
from pathlib import Path

SERVICES = ["web_session", "web_package", "web_module", "web_class", "web_function"]


def use(request):
    lines = []
    for name in SERVICES:
        svc = request.getfixturevalue(name)
        port = svc.ports[0]
        with urllib.request.urlopen(svc.url("http", port, "/"), timeout=30) as resp:
            assert resp.status == 200
        assert svc.address(port) == (svc.host, svc.port) and svc.host == "127.0.0.1"
        lines.append(f"{name} {svc.sandbox.name} {svc.port} {request.node.nodeid}\\n")
        plain = name.replace("web_", "plain_")
        lines.append(f"{plain} {request.getfixturevalue(plain)} - {request.node.nodeid}\\n")
    with open(os.environ["PBX_OUT"], "a") as out:
        out.writelines(lines)


def test_one(request):
    use(request)


def test_two(request):
    use(request)


class TestA:
    def test_a1(self, request):
        use(request)

    def test_a2(self, request):
        use(request)
"""


def project(root: Path, conftest: str, files: dict[str, str]) -> None:
    (root / "conftest.py").write_text(textwrap.dedent(conftest))
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def run(root: Path, home: Path, tag: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = sub_env(PBX_TAG=tag, PBX_OUT=str(root / "out.txt"))
    cmd = [sys.executable, "-m", "pytest", *QUIET, "-p", "no:randomly", f"--boxlite-home={home}", *args]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def no_leftovers(home: Path, tag: str) -> None:
    assert wait_until(lambda: not pids_with(tag), 15), "a service's process outlived its run"
    running = [r for r in ledger.scan(home) if r.running]
    assert running == [], f"boxes left running: {running}"


def instances(root: Path) -> dict[str, Counter[str]]:
    """Per service: how many tests got each instance (its box)."""
    seen: dict[str, Counter[str]] = {}
    for line in (root / "out.txt").read_text().splitlines():
        name, box, _port, _nodeid = line.split(" ", 3)
        seen.setdefault(name, Counter())[box] += 1
    return seen


def test_each_scope_has_one_instance_per_scope_and_is_reused_within_it(tmp_path: Path, home: Path) -> None:
    """Two packages, three modules with a class of two each: as many instances as pytest makes of a
    plain fixture of the same scope (session 1; package 1: the declaring conftest is in no package;
    module 3; class 9: a function outside a class is its own class scope; function 12), every
    one reached over HTTP."""
    tag = uuid.uuid4().hex
    project(
        tmp_path,
        SCOPES_CONFTEST,
        {
            "pkg_a/__init__.py": "",
            "pkg_a/test_m1.py": SCOPES_TEST,
            "pkg_a/test_m2.py": SCOPES_TEST,
            "pkg_b/__init__.py": "",
            "pkg_b/test_m3.py": SCOPES_TEST,
        },
    )
    # Five services at once, each holding a box for its scope, beside the default two boxes (--boxlite-max-boxes).
    res = run(tmp_path, home, tag, "-q")
    assert res.returncode == 0, res.stdout + res.stderr
    seen = instances(tmp_path)
    tests = 12
    assert {name: sum(c.values()) for name, c in seen.items()} == dict.fromkeys(seen, tests)
    counts = {name: len(c) for name, c in seen.items()}
    assert counts == {
        **{f"web_{s}": n for s, n in (("session", 1), ("package", 1), ("module", 3), ("class", 9), ("function", 12))},
        **{f"plain_{s}": n for s, n in (("session", 1), ("package", 1), ("module", 3), ("class", 9), ("function", 12))},
    }
    # The same tests shared an instance as shared a plain fixture's value.
    for scope in ("session", "package", "module", "class", "function"):
        assert sorted(seen[f"web_{scope}"].values()) == sorted(seen[f"plain_{scope}"].values()), scope
    # Every instance had a box of its own.
    boxes = [box for name, c in seen.items() if name.startswith("web_") for box in c]
    assert len(set(boxes)) == len(boxes)
    no_leftovers(home, tag)


def test_failing_test_shows_the_service_logs_and_readiness_errors_quote_the_last_lines(
    tmp_path: Path, home: Path
) -> None:
    tag = uuid.uuid4().hex
    conftest = (
        HEAD
        + """
web = service("web", server(), ports=[8000], ready=HttpReady(8000), scope="module")
never = service(
    "never",
    [sys.executable, "-X", "pbxtag_" + TAG, "-u", "-c", "print('warming the cache'); import time; time.sleep(120)"],
    ready=OutputReady("ready to accept"), timeout=2,
)
broken = service(
    "broken",
    [sys.executable, "-X", "pbxtag_" + TAG, "-u", "-c", "print('bad config: no such table'); raise SystemExit(3)"],
    ports=[5432], ready=PortReady(5432), timeout=30,
)
"""
    )
    tests = """
import urllib.request

def test_fails(web):
    urllib.request.urlopen(web.url(path="/no-such-file"), timeout=30).close()

def test_passes(web):
    urllib.request.urlopen(web.url(path="/"), timeout=30).close()

def test_never(never):
    pass

def test_never_again(never):
    pass

def test_broken(broken):
    pass
"""
    project(tmp_path, conftest, {"test_logs.py": tests})
    res = run(tmp_path, home, tag, "-rA")
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert re.search(r"1 failed, 1 passed, 3 errors", out), out
    # The failing test's report holds the service's output: the request that failed, with its 404.
    fails = out.split("_ test_fails _", 1)[1].split("_ test_passes _", 1)[0]
    assert "boxlite service web" in fails, fails
    assert '"GET /no-such-file HTTP/1.1" 404' in fails, fails
    assert "Serving HTTP on 127.0.0.1 port 8000" in fails
    passes = out.split("PASSED test_logs.py::test_passes", 1)[0].rsplit("= PASSES =", 1)[-1]
    assert "boxlite service" not in passes, passes
    # A timeout: the service's name, what was awaited, the bound, its last lines.
    never = out.split("ERROR at setup of test_never _", 1)[1].split("ERROR at setup of test_never_again", 1)[0]
    assert "ServiceStartError" in never and "service 'never'" in never, never
    assert "was not ready within 2 s: OutputReady('ready to accept') did not pass" in never, never
    assert "stdout: warming the cache" in never, never
    # Its scope (the session) gets the same error again, without a second start.
    again = out.split("ERROR at setup of test_never_again _", 1)[1]
    assert "was not ready within 2 s" in again.split("ERROR at setup of", 1)[0]
    # An early exit: the exit status and the line it printed, at once (not after 30 s).
    broken = out.split("ERROR at setup of test_broken _", 1)[1]
    assert "service 'broken'" in broken and "exited with status 3 before it was ready (PortReady(5432))" in broken
    assert "stdout: bad config: no such table" in broken, broken
    # The error is the message, not a traceback through the plugin's own frames.
    assert "def _start(" not in out and "services.py" not in out.split("short test summary")[0], out
    no_leftovers(home, tag)


def test_two_xdist_workers_each_get_their_own_session_instance(tmp_path: Path, home: Path) -> None:
    pytest.importorskip("xdist")
    tag = uuid.uuid4().hex
    conftest = HEAD + '\nweb = service("web", server(), ports=[8000], ready=HttpReady(8000))\n'
    tests = """
import os, urllib.request
import pytest

@pytest.mark.parametrize("i", range(8))
def test_get(i, web, worker_id):
    with urllib.request.urlopen(web.url(), timeout=30) as resp:
        assert resp.status == 200
    with open(os.environ["PBX_OUT"], "a") as out:
        out.write(f"{worker_id} {web.sandbox.name} {web.port} t{i}\\n")
"""
    project(tmp_path, conftest, {"test_x.py": tests})
    res = run(tmp_path, home, tag, "-q", "-n", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    per_worker: dict[str, set[str]] = {}
    for line in (tmp_path / "out.txt").read_text().splitlines():
        worker, box, _, _ = line.split()
        per_worker.setdefault(worker, set()).add(box)
    # Each worker that ran tests had exactly one instance, and the two did not share one.
    assert all(len(boxes) == 1 for boxes in per_worker.values()), per_worker
    all_boxes = [b for boxes in per_worker.values() for b in boxes]
    assert len(set(all_boxes)) == len(all_boxes)
    no_leftovers(home, tag)


HOLDING_TEST = """
import os, time
from pathlib import Path

def test_hold(web):
    Path(os.environ["PBX_OUT"]).write_text(f"{web.sandbox.name} {web.host}:{web.port}")
    release = Path(os.environ["PBX_OUT"] + ".release")
    deadline = time.monotonic() + 90
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def _ls(home: Path) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "pytest_boxlite", "ls", "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=sub_env(),
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def _holding(tmp_path: Path, home: Path, tag: str) -> tuple[SubRun, str, str]:
    project(tmp_path, HEAD + '\nweb = service("web", server(), ports=[8000])\n', {"test_hold.py": HOLDING_TEST})
    env = sub_env(PBX_TAG=tag, PBX_OUT=str(tmp_path / "out.txt"))
    holder = SubRun(tmp_path, home, "hold", "-p", "no:randomly", "test_hold.py", env=env)
    out = tmp_path / "out.txt"
    ok = wait_until(lambda: (out.exists() and bool(out.read_text())) or holder.proc.poll() is not None, 90)
    assert ok and out.exists(), f"the service never came up:\n{holder.output}"
    box, address = out.read_text().split()
    return holder, box, address


@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_ls_shows_a_running_service_and_nothing_outlives_ctrl_c_or_kill_9(
    tmp_path: Path, home: Path, subruns: list[SubRun], how: str
) -> None:
    tag = uuid.uuid4().hex
    holder, box, address = _holding(tmp_path, home, tag)
    subruns.append(holder)
    listed = [line for line in _ls(home).splitlines() if line.startswith(box)]
    assert len(listed) == 1 and "running" in listed[0], _ls(home)
    assert f"service=web ports=8000->{address}" in listed[0], listed
    server = pids_with(tag)
    assert server, "the service's process is not running on this host"
    if how == "SIGINT":
        holder.proc.send_signal(signal.SIGINT)
        assert holder.wait(60) == pytest.ExitCode.INTERRUPTED, holder.output
        no_leftovers(home, tag)
        assert not (home / "services" / f"{box}.json").exists(), "the service's ledger record outlived it"
    else:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(30)
        # Its box ends with the session (the box's watchdog); the service's processes with the box.
        assert wait_until(lambda: all(process_gone(p) for p in server), 15), server
        assert box not in _ls(home).split("service=")[0] or "service=web" not in _ls(home)
        # The next start reaps the dead session's box and drops its record.
        project(tmp_path, HEAD + '\nweb = service("web", server(), ports=[8000])\n', {"test_hold.py": HOLDING_TEST})
        (tmp_path / "out.txt.release").write_text("go")
        res = run(tmp_path, home, tag, "-q", "test_hold.py")
        assert res.returncode == 0, res.stdout + res.stderr
        assert not (home / "services" / f"{box}.json").exists()
        assert box not in {r.name for r in ledger.scan(home)}
        no_leftovers(home, tag)


def test_keep_keeps_the_box_of_a_failed_test(tmp_path: Path, home: Path) -> None:
    """--boxlite-keep keeps the box of a service a failed test used (its files; the process is
    stopped with its session), and no other box."""
    tag = uuid.uuid4().hex
    conftest = HEAD + '\nweb = service("web", server(), ports=[8000], scope="module")\n'
    tests = """
import os

def test_ok(web):
    pass

def test_fails(web):
    with open(os.environ["PBX_OUT"], "w") as out:
        out.write(web.sandbox.name)
    assert False, "on purpose"
"""
    project(tmp_path, conftest, {"test_keep.py": tests})
    res = run(tmp_path, home, tag, "-q", "--boxlite-keep")
    assert res.returncode == 1, res.stdout + res.stderr
    box = (tmp_path / "out.txt").read_text()
    kept = {r.name: r for r in ledger.scan(home)}
    assert box in kept and kept[box].kept and kept[box].running, kept
    assert [name for name, r in kept.items() if r.kept] == [box], kept
    assert "kept box" in res.stdout and box in res.stdout, res.stdout
    assert wait_until(lambda: not pids_with(tag), 15), "the service outlived its session"
    line = next(line for line in _ls(home).splitlines() if line.startswith(box))
    assert line.endswith(" kept"), line  # no service runs in it any more
    ledger.reconcile(home, include_kept=True)


def test_a_run_without_services_does_not_import_them(tmp_path: Path, home: Path) -> None:
    (tmp_path / "test_plain.py").write_text(
        "import sys\n\ndef test_plain():\n    assert 'pytest_boxlite.services' not in sys.modules\n"
    )
    res = run(tmp_path, home, uuid.uuid4().hex, "-q")
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: service("bad-name", ["x"]), "must be a Python identifier"),
        (lambda: service("s", "redis-server"), "argv must be a non-empty list"),
        (lambda: service("s", ["x"], ports=[70000]), "1 to 65535"),
        (lambda: service("s", ["x"], ports=[80, 80]), "listed twice"),
        (lambda: service("s", ["x"], scope="worker"), "scope must be one of"),
        (lambda: service("s", ["x"], timeout=0), "timeout must be a positive"),
        (lambda: service("s", ["x"], env={"A": 1}), "env must be a dict of str to str"),  # type: ignore[dict-item]
        (lambda: service("s", ["x"], ready="port"), "ready must be a readiness check"),  # type: ignore[arg-type]
        (lambda: service("s", ["x"], ports=[80], ready=HttpReady(81)), "port 81 is not one of"),
        (lambda: service("s", ["x"], setup=[1]), "setup must be a shell command"),  # type: ignore[list-item]
        (lambda: PortReady(0), "1 to 65535"),
        (lambda: OutputReady("(", stream="stdout"), "bad pattern"),
        (lambda: OutputReady("x", stream="both"), "stream must be"),
        (lambda: HttpReady(80, path="health"), "path must start with '/'"),
        (lambda: HttpReady(80, path="/sant\u00e9"), "path must be ASCII"),
        (lambda: HttpReady(80, status=42), "HTTP status code"),
        (lambda: CommandReady([]), "non-empty list"),
        (lambda: PortReady(80, timeout=-1), "timeout must be a positive"),
    ],
)
def test_bad_declarations_say_what_is_wrong(call: object, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        call()  # type: ignore[operator]


# -- boxed tests: the service runs on the host, the box gets its description -----------------------

#: The same tests, boxed: they cannot write host files, so each prints what it got (-rP shows it).
BOXED_TEST = """
import os, urllib.request

SERVICES = ["web_session", "web_package", "web_module", "web_class", "web_function"]


def use(request):
    assert os.environ.get("PYTEST_BOXLITE_GUEST") == "1", "this test was to run in a box"
    for name in SERVICES:
        svc = request.getfixturevalue(name)  # named as arguments too: the host must know
        assert svc.sandbox is None and svc.process is None  # on the host, not here
        with urllib.request.urlopen(svc.url("http", svc.ports[0], "/"), timeout=30) as resp:
            assert resp.status == 200
        print(f"SEEN {name} {svc.box} {svc.port} {request.node.nodeid}")


def test_one(request, web_session, web_package, web_module, web_class, web_function):
    use(request)


def test_two(request, web_session, web_package, web_module, web_class, web_function):
    use(request)


class TestA:
    def test_a1(self, request, web_session, web_package, web_module, web_class, web_function):
        use(request)

    def test_a2(self, request, web_session, web_package, web_module, web_class, web_function):
        use(request)


def test_asked_too_late(request):
    request.getfixturevalue("web_function")
"""


def seen_in_output(out: str) -> dict[str, Counter[str]]:
    seen: dict[str, Counter[str]] = {}
    for m in re.finditer(r"^SEEN (\S+) (\S+) (\d+) (\S+)$", out, re.MULTILINE):
        seen.setdefault(m.group(1), Counter())[m.group(2)] += 1
    return seen


@pytest.mark.parametrize("scope", ["test", "module"])
def test_boxed_tests_get_the_hosts_instances_in_every_scope(tmp_path: Path, home: Path, scope: str) -> None:
    """Under --boxlite (a box per test forked from a warm interpreter, or one per module), every
    service is started on the host once per scope, and each boxed test reaches it over HTTP at
    the address its fixture gives."""
    tag = uuid.uuid4().hex
    project(
        tmp_path,
        SCOPES_CONFTEST,
        {
            "pkg_a/__init__.py": "",
            "pkg_a/test_m1.py": BOXED_TEST,
            "pkg_a/test_m2.py": BOXED_TEST,
            "pkg_b/__init__.py": "",
            "pkg_b/test_m3.py": BOXED_TEST,
        },
    )
    res = run(tmp_path, home, tag, "-rP", "--boxlite", f"--boxlite-scope={scope}")
    assert res.returncode == 1, res.stdout + res.stderr
    # A service asked for with getfixturevalue in a box (the host cannot know of it): a clear error.
    assert re.search(r"^3 failed, 12 passed", res.stdout.splitlines()[-1].strip("= ")), res.stdout
    assert res.stdout.count("request.getfixturevalue('web_function') in a box asks too late") == 3, res.stdout
    seen = seen_in_output(res.stdout)
    assert {name: sum(c.values()) for name, c in seen.items()} == {
        f"web_{s}": 12 for s in ("session", "package", "module", "class", "function")
    }, res.stdout
    counts = {name: len(c) for name, c in seen.items()}
    assert counts == {"web_session": 1, "web_package": 1, "web_module": 3, "web_class": 9, "web_function": 12}
    no_leftovers(home, tag)


def test_boxed_and_unboxed_tests_share_an_instance_and_a_boxed_failure_shows_its_logs(
    tmp_path: Path, home: Path
) -> None:
    tag = uuid.uuid4().hex
    conftest = HEAD + '\nweb = service("web", server(), ports=[8000], ready=HttpReady(8000))\n'
    tests = """
import os, urllib.request
import pytest

def test_on_host(web, boxlite_pool):  # a pool fixture keeps it on the host under --boxlite
    assert os.environ.get("PYTEST_BOXLITE_GUEST") != "1"
    print(f"SEEN web {web.box} {web.port} host")

@pytest.mark.boxlite
def test_in_box(web):
    assert os.environ.get("PYTEST_BOXLITE_GUEST") == "1"
    print(f"SEEN web {web.box} {web.port} box")
    urllib.request.urlopen(web.url(path="/"), timeout=30).close()
    # The server's own output, asked of the host (it runs there), as an unboxed test gets it.
    assert '"GET / HTTP/1.1" 200' in web.logs(lines=5), web.logs()
    assert len(web.logs(lines=1).splitlines()) == 1
    urllib.request.urlopen(web.url(path="/from-the-box"), timeout=30).close()
"""
    project(tmp_path, conftest, {"test_mixed.py": tests})
    res = run(tmp_path, home, tag, "-rA")
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    seen = seen_in_output(out)
    assert len(seen["web"]) == 1 and sum(seen["web"].values()) == 2, out  # one instance, both tests
    failure = out.split("_ test_in_box _", 1)[1].split("short test summary", 1)[0]
    assert "HTTPError" in failure and "boxlite service web" in failure, failure
    assert '"GET /from-the-box HTTP/1.1" 404' in failure, failure
    no_leftovers(home, tag)


def test_two_xdist_workers_with_boxed_tests(tmp_path: Path, home: Path) -> None:
    pytest.importorskip("xdist")
    tag = uuid.uuid4().hex
    conftest = HEAD + '\nweb = service("web", server(), ports=[8000], ready=HttpReady(8000))\n'
    tests = """
import os, time, urllib.request
import pytest

@pytest.mark.parametrize("i", range(6))
def test_get(i, web, worker_id):
    assert os.environ.get("PYTEST_BOXLITE_GUEST") == "1"
    with urllib.request.urlopen(web.url(path=f"/?t{i}"), timeout=30) as resp:
        assert resp.status == 200
    # Asked of this worker's host, which reads the server's output as it comes: wait for the line.
    deadline = time.monotonic() + 15
    while f"GET /?t{i} HTTP/1.1" not in web.logs() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"GET /?t{i} HTTP/1.1" in web.logs(), web.logs()
    print(f"SEEN {worker_id} {web.box} {web.port} t{i}")
"""
    project(tmp_path, conftest, {"test_x.py": tests})
    res = run(tmp_path, home, tag, "-rP", "-n", "2", "--boxlite")
    assert res.returncode == 0, res.stdout + res.stderr
    seen = seen_in_output(res.stdout)
    assert sum(sum(c.values()) for c in seen.values()) == 6, res.stdout
    # One instance per worker, none shared.
    assert all(len(c) == 1 for c in seen.values()), seen
    boxes = [box for c in seen.values() for box in c]
    assert len(set(boxes)) == len(boxes)
    no_leftovers(home, tag)


def test_a_service_that_fails_on_the_host_fails_its_boxed_tests_with_its_last_lines(tmp_path: Path, home: Path) -> None:
    tag = uuid.uuid4().hex
    conftest = (
        HEAD
        + """
broken = service(
    "broken",
    [sys.executable, "-X", "pbxtag_" + TAG, "-u", "-c", "print('bad config: no such table'); raise SystemExit(3)"],
    ports=[5432],
)
"""
    )
    tests = """
import pytest

@pytest.mark.boxlite
def test_one(broken):
    pass

@pytest.mark.boxlite
def test_two(broken):
    pass
"""
    project(tmp_path, conftest, {"test_broken.py": tests})
    res = run(tmp_path, home, tag, "-q")
    out = res.stdout
    assert res.returncode == 1 and "2 errors" in out, out + res.stderr
    # Each boxed test's setup error (its section; the short summary repeats the message): what the
    # host saw, with the server's last line.
    errors = out.split("short test summary info", 1)[0]
    assert errors.count("on the host: service 'broken'") == 2, out
    assert errors.count("exited with status 3 before it was ready (PortReady(5432))") == 2, out
    assert "stdout: bad config: no such table" in out, out
    no_leftovers(home, tag)


def test_a_service_on_the_vm_runtime(tmp_path: Path, home: Path) -> None:
    """The vm runtime (through the boxlite SDK double): the image's python3 serves, the host reaches
    it through the published port, and a failing test shows its output."""
    tests_dir = Path(__file__).resolve().parent
    path = [str(tests_dir.parent), str(tests_dir), str(tests_dir / "sdk_double" / "site")]
    conftest = """
from pytest_boxlite import HttpReady, service

web = service("web", ["python3", "-u", "-m", "http.server", "8000", "--bind", "127.0.0.1"], ports=[8000],
              ready=HttpReady(8000), scope="module")
"""
    tests = """
import urllib.request

def test_get(web):
    assert web.sandbox.runtime == "vm"
    assert urllib.request.urlopen(web.url(path="/"), timeout=30).status == 200

def test_fails(web):
    urllib.request.urlopen(web.url(path="/missing"), timeout=30)
"""
    project(tmp_path, conftest, {"test_vm.py": tests})
    env = sub_env(PYTHONPATH=os.pathsep.join(path), BOXLITE_SDK_DOUBLE="1")
    cmd = [sys.executable, "-m", "pytest", *QUIET, "-p", "no:randomly", f"--boxlite-home={home}"]
    cmd.append("--boxlite-runtime=vm")
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
    out = res.stdout
    assert res.returncode == 1 and "1 failed, 1 passed" in out, out + res.stderr
    assert "boxlite service web" in out and '"GET /missing HTTP/1.1" 404' in out, out
    assert ledger.scan(home) == []


def test_a_box_gets_only_its_own_services_logs_and_cannot_flood_the_host(tmp_path: Path, home: Path) -> None:
    """``Service.logs()`` in a boxed test asks the host: a box (root in it, our source read) that
    asks for a service its test does not use gets a refusal, not that service's output; one that
    asks without end fails its own test, and the next test runs."""
    tag = uuid.uuid4().hex
    conftest = (
        HEAD
        + '\nweb = service("web", server(), ports=[8000], ready=HttpReady(8000))\n'
        + 'secret = service("secret", server(8001), ports=[8001], ready=HttpReady(8001))\n'
    )
    tests = """
import time, urllib.request
import pytest
from pytest_boxlite.guest import debugger

def test_uses_secret(secret):
    urllib.request.urlopen(secret.url(path="/?SECRET-PATH"), timeout=30).close()

@pytest.mark.boxlite
def test_asks_for_another(web):
    relay = debugger.current()
    with pytest.raises(LookupError, match="no running service 'secret'"):
        relay.service_logs("secret", 200)
    with pytest.raises(LookupError):
        relay.service_logs("x" * 5000, 200)  # not a fixture name: refused, the test's stream ends

@pytest.mark.boxlite
def test_floods(web):
    relay = debugger.current()
    for _ in range(5000):
        relay.service_logs("web", 1)

@pytest.mark.boxlite
def test_after(web):
    urllib.request.urlopen(web.url(path="/?after"), timeout=30).close()
    deadline = time.monotonic() + 15  # the host reads the server's output as it comes
    while "GET /?after HTTP/1.1" not in web.logs() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "GET /?after HTTP/1.1" in web.logs()
"""
    project(tmp_path, conftest, {"test_logs.py": tests})
    res = run(tmp_path, home, tag, "-rA")
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert "GET /?SECRET-PATH HTTP/1.1" not in out, out  # the other service's output never reached a box
    assert re.search(r"^FAILED test_logs.py::test_asks_for_another", out, re.M), out
    assert "service-logs question that is not a fixture name" in out, out
    assert re.search(r"^FAILED test_logs.py::test_floods", out, re.M), out
    assert "more than 1000 service-logs questions" in out, out
    assert re.search(r"^PASSED test_logs.py::test_after", out, re.M), out
    no_leftovers(home, tag)
