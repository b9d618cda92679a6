"""Service fixtures: a server declared in a conftest in a few lines, run in a box, reached by tests.

::

    # conftest.py
    from pytest_boxlite import HttpReady, service

    web = service("web", ["python3", "-m", "http.server", "8000"], ports=[8000], ready=HttpReady(8000))

    # a test
    def test_it(web):
        host, port = web.address(8000)

``service(...)`` returns a real pytest fixture (``pytest.fixture(scope=..., name=...)``) that the
conftest binds to a module global.  Its value is a :class:`Service`: the service's addresses, its
recent output (:meth:`Service.logs`), its :class:`~pytest_boxlite.sandbox.Sandbox` and its
:class:`~pytest_boxlite.process.BoxProcess`.

How it works, and why: ``docs/explanation/internals/services.md``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_boxlite import hooks
from pytest_boxlite.errors import BoxliteError, ConfigError, OutputWaitError
from pytest_boxlite.process import _quote, quote_output

if TYPE_CHECKING:
    from pytest_boxlite.pool import Lease
    from pytest_boxlite.process import BoxProcess
    from pytest_boxlite.sandbox import Sandbox
    from pytest_boxlite.session import BoxliteSession

__all__ = [
    "LOG_LINES",
    "CommandReady",
    "HttpReady",
    "OutputReady",
    "PortReady",
    "Ready",
    "Service",
    "ServiceManager",
    "ServiceStartError",
    "descriptions_for",
    "receive",
    "service",
]

#: Output lines of a service that :meth:`Service.logs` and failing reports show.
LOG_LINES = 200
#: The most lines one :meth:`Service.logs` call in a boxed test gets from the host.
LOG_LINES_CAP = 1000
SCOPES = ("session", "package", "module", "class", "function")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")
#: The report section's title for a service's output (``NAME`` is the fixture's name).
SECTION = "boxlite service {name}"


class ServiceStartError(OutputWaitError):
    """A service could not be started, or was not ready in time: the message names the service and
    what was awaited, and quotes the process's last output lines (``lines``)."""

    def __init__(self, service: str, message: str, lines: list[str] | None = None) -> None:
        self.service = service
        super().__init__(message, lines)


# -- readiness checks ---------------------------------------------------------------------------
class Ready:
    """A readiness check of a service.  ``timeout`` bounds this check (the service's own ``timeout``
    bounds them all); ``None``: only the service's."""

    timeout: float | None = None

    def describe(self) -> str:
        raise NotImplementedError

    def wait(self, target: _Starting, deadline: float) -> None:
        """Return once ready; raise :class:`~pytest_boxlite.errors.OutputWaitError` (or a subclass)
        when the deadline passes or the process exits first."""
        raise NotImplementedError

    def _check_timeout(self) -> None:
        t = self.timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise ConfigError(f"{self.describe()}: timeout must be a positive number of seconds, got {t!r}")


def _check_port(port: object, what: str) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"{what}: a port is an int from 1 to 65535, got {port!r}")
    return port


@dataclass(frozen=True)
class PortReady(Ready):
    """Ready once something in the box listens on TCP ``port``.

    A listening port is not always a ready service (a database may accept connections before it
    serves queries): combine it with :class:`OutputReady` or :class:`CommandReady` for those.
    """

    port: int
    timeout: float | None = None

    def __post_init__(self) -> None:
        _check_port(self.port, "PortReady")
        self._check_timeout()

    def describe(self) -> str:
        return f"PortReady({self.port})"

    def wait(self, target: _Starting, deadline: float) -> None:
        target.sandbox.wait_for_port(self.port, timeout=_left(deadline), process=target.process)


@dataclass(frozen=True)
class OutputReady(Ready):
    """Ready once a line of the process's output matches ``pattern`` (``re.search``);
    ``stream``: ``"stdout"``, ``"stderr"`` or ``None`` for either."""

    pattern: str | bytes | re.Pattern[str] | re.Pattern[bytes]
    stream: str | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        if self.stream not in (None, "stdout", "stderr"):
            raise ConfigError(f"OutputReady: stream must be 'stdout', 'stderr' or None, got {self.stream!r}")
        if not isinstance(self.pattern, (str, bytes, re.Pattern)):
            raise ConfigError(f"OutputReady: pattern must be a str, bytes or compiled pattern, got {self.pattern!r}")
        try:
            re.compile(self.pattern) if isinstance(self.pattern, (str, bytes)) else None
        except re.error as exc:
            raise ConfigError(f"OutputReady: bad pattern {self.pattern!r}: {exc}") from None
        self._check_timeout()

    def describe(self) -> str:
        pattern = self.pattern.pattern if isinstance(self.pattern, re.Pattern) else self.pattern
        return f"OutputReady({pattern!r}{'' if self.stream is None else f', stream={self.stream!r}'})"

    def wait(self, target: _Starting, deadline: float) -> None:
        target.process.wait_for_output(self.pattern, timeout=_left(deadline), stream=self.stream)


@dataclass(frozen=True)
class HttpReady(Ready):
    """Ready once ``GET path`` on the box's ``port`` answers ``status``.  The port must be one of
    the service's ``ports``: the request goes through its published address, as a test's would."""

    port: int
    path: str = "/"
    status: int = 200
    timeout: float | None = None

    def __post_init__(self) -> None:
        _check_port(self.port, "HttpReady")
        if not isinstance(self.path, str) or not self.path.startswith("/") or any(c in self.path for c in "\r\n "):
            raise ConfigError(f"HttpReady: path must start with '/' and hold no spaces or newlines, got {self.path!r}")
        if not self.path.isascii():
            raise ConfigError(f"HttpReady: path must be ASCII (percent-encode the rest), got {self.path!r}")
        if isinstance(self.status, bool) or not isinstance(self.status, int) or not 100 <= self.status <= 599:
            raise ConfigError(f"HttpReady: status must be an HTTP status code, got {self.status!r}")
        self._check_timeout()

    def describe(self) -> str:
        return f"HttpReady({self.port}, path={self.path!r}, status={self.status})"

    def wait(self, target: _Starting, deadline: float) -> None:
        host, port = target.addresses[self.port]
        pause = 0.01
        seen = "no answer yet"
        while True:
            try:
                got = _http_status(host, port, self.path, min(deadline, time.monotonic() + 5.0))
                if got == self.status:
                    return
                seen = f"the last answer was {got}"
            except (OSError, ValueError) as exc:
                seen = f"the last try: {type(exc).__name__}: {str(exc)[:200]}"
            target.check_running(f"GET {self.path} on port {self.port} answered {self.status}")
            if time.monotonic() + pause >= deadline:
                raise _Timeout(f"GET {self.path} on port {self.port} did not answer {self.status} in time ({seen})")
            time.sleep(pause)
            pause = min(pause * 2, 0.2)


@dataclass(frozen=True)
class CommandReady(Ready):
    """Ready once ``argv`` (a list, run without a shell; a string: through ``/bin/sh -c``) exits 0
    in the service's box, e.g. ``CommandReady(["pg_isready", "-h", "127.0.0.1"])``."""

    argv: Sequence[str] | str
    timeout: float | None = None

    def __post_init__(self) -> None:
        argv: object = self.argv
        if isinstance(argv, str):
            if not argv.strip():
                raise ConfigError("CommandReady: the command is empty")
        elif not isinstance(argv, (list, tuple)) or not argv or not all(isinstance(a, str) for a in argv):
            raise ConfigError(f"CommandReady: argv must be a non-empty list of str or a shell string: {self.argv!r}")
        else:
            object.__setattr__(self, "argv", tuple(self.argv))
        self._check_timeout()

    def describe(self) -> str:
        return f"CommandReady({self.argv if isinstance(self.argv, str) else list(self.argv)!r})"

    def wait(self, target: _Starting, deadline: float) -> None:
        pause = 0.02
        last = ""
        while True:
            left = _left(deadline)
            t = max(0.5, min(left, 10.0))
            sb = target.sandbox
            argv = self.argv
            res = sb.execute_command(argv, timeout=t) if isinstance(argv, str) else sb.run(argv, timeout=t)
            if res.ok:
                return
            last = f"the last try exited {res.exit_code}" + (
                f": {quote_output(res.stderr, 1)[0]}" if res.stderr.strip() else ""
            )
            target.check_running(f"{self.describe()} succeeded")
            if time.monotonic() + pause >= deadline:
                raise _Timeout(f"{self.describe()} did not succeed in time ({last})")
            time.sleep(pause)
            pause = min(pause * 2, 0.25)


class _Timeout(OutputWaitError):
    """A check's own polling ran out of time (turned into a :class:`ServiceStartError`)."""


class _Exited(OutputWaitError):
    """The process ended while a check polled."""


#: The most of an HTTP answer HttpReady reads looking for its status line.
_STATUS_LINE_MAX = 8 * 1024
_STATUS_LINE = re.compile(rb"HTTP/\d(?:\.\d)? ([1-5]\d\d)(?:[ \t][^\r\n]*)?\r?\n")


def _http_status(host: str, port: int, path: str, deadline: float) -> int:
    """The status of ``GET path`` on ``host:port``, the whole exchange (connect, request, the
    status line) bounded by ``deadline``: each socket operation gets only the time left, so a
    server trickling bytes cannot hold it longer (http.client's timeout bounds each recv
    alone).  Only the status line is read, at most :data:`_STATUS_LINE_MAX` bytes of it."""
    with socket.create_connection((host, port), timeout=_left(deadline)) as sock:
        sock.settimeout(_left(deadline))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode("ascii"))
        got = b""
        while b"\n" not in got:
            if time.monotonic() >= deadline:
                raise TimeoutError("no status line in time")
            if len(got) >= _STATUS_LINE_MAX:
                raise ValueError(f"no status line in the first {_STATUS_LINE_MAX} bytes")
            sock.settimeout(_left(deadline))
            chunk = sock.recv(_STATUS_LINE_MAX - len(got))
            if not chunk:
                raise ConnectionError(f"the connection closed before a status line ({len(got)} bytes)")
            got += chunk
        match = _STATUS_LINE.match(got)
        if match is None:
            first = got.split(b"\n", 1)[0]
            raise ValueError(f"not an HTTP status line: {_quote(first)}")
        return int(match.group(1))


def _left(deadline: float) -> float:
    # A positive bound, however late: the waits reject 0 (they then time out at once).
    return max(deadline - time.monotonic(), 0.001)


def _as_checks(ready: Ready | Sequence[Ready] | None, ports: tuple[int, ...]) -> tuple[Ready, ...]:
    if ready is None:
        return tuple(PortReady(p) for p in ports)
    checks = (ready,) if isinstance(ready, Ready) else tuple(ready) if isinstance(ready, (list, tuple)) else None
    if checks is None or not all(isinstance(c, Ready) for c in checks):
        raise ConfigError(
            "ready must be a readiness check (PortReady, OutputReady, HttpReady, CommandReady), a list of them, "
            f"or None, got {ready!r}"
        )
    for c in checks:
        if isinstance(c, HttpReady) and c.port not in ports:
            raise ConfigError(f"{c.describe()}: port {c.port} is not one of the service's ports {list(ports)}")
    return checks


# -- declarations ---------------------------------------------------------------------------------
_SEQ = itertools.count(1)
#: Every declaration made in this process, by fixture name (a box's pytest imports the same conftests).
_DECLARED: dict[str, list[ServiceSpec]] = {}


@dataclass(frozen=True, eq=False)
class ServiceSpec:
    """One ``service(...)`` declaration (checked)."""

    name: str
    argv: tuple[str, ...]
    ports: tuple[int, ...]
    checks: tuple[Ready, ...]
    timeout: float
    scope: str
    env: tuple[tuple[str, str], ...] | None
    cwd: str | None
    user: str | None
    image: str | None
    setup: tuple[str, ...]
    #: The file that declared it: a conftest's directory covers the tests below it; a test
    #: module covers itself.
    where: str
    key: str = field(default_factory=lambda: f"s{next(_SEQ)}")

    def covers(self, path: Path) -> bool:
        where = Path(self.where)
        if where.name == "conftest.py":
            return path.is_relative_to(where.parent)
        return path == where

    def label(self) -> str:
        what = " ".join(self.argv)[:200] if self.argv else f"{self.image}'s Entrypoint/Cmd"
        return f"service {self.name!r} ({what!r})"


def service(
    name: str,
    argv: Sequence[str] | None = None,
    *,
    ports: Sequence[int] = (),
    ready: Ready | Sequence[Ready] | None = None,
    timeout: float = 30.0,
    scope: str = "session",
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    user: str | None = None,
    image: str | None = None,
    setup: str | Sequence[str] | None = None,
) -> Any:
    """Declare a service and return its pytest fixture (bind it to a module global of a conftest).

    ``argv`` runs without a shell in a box of its own, leased from the session's pool (``image``:
    the box's image, as ``boxlite_pool.sandbox(image=...)``).  Without ``argv``, the image's
    ``Entrypoint`` followed by its ``Cmd`` runs, as ``docker run IMAGE`` would (an ``argv`` given
    replaces both, as ``--entrypoint`` does); ``setup``: shell commands run in that
    box first, in order, each of which must succeed (like ``--boxlite-setup``, but per instance).
    ``env``, ``cwd`` and ``user`` are the process's.  ``ports``: the box's TCP ports to publish on
    the host's loopback.  ``ready``: a readiness check, a list of them (all must pass, in order), or
    ``None`` for "each of ``ports`` listens".  ``timeout``: seconds from start to ready.
    ``scope``: the fixture's scope; one instance per scope and xdist worker.

    The fixture's value is a :class:`Service`.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"service name must be a Python identifier (it is the fixture's name), got {name!r}")
    if argv is None:
        if image is None:
            raise ConfigError(
                f"service {name!r}: give argv (the command to run), or image= naming an image whose "
                "Entrypoint/Cmd to run"
            )
        argv = ()
    elif isinstance(argv, (str, bytes)) or not argv or not all(isinstance(a, str) for a in argv):
        raise ConfigError(f"service {name!r}: argv must be a non-empty list of str (no shell), got {argv!r}")
    if any("\0" in a for a in argv):
        raise ConfigError(f"service {name!r}: an argument contains a NUL byte")
    if isinstance(ports, (str, bytes, int)):
        raise ConfigError(f"service {name!r}: ports must be a list of ints, got {ports!r}")
    port_list = tuple(_check_port(p, f"service {name!r}") for p in ports)
    if len(set(port_list)) != len(port_list):
        raise ConfigError(f"service {name!r}: a port is listed twice in {list(port_list)}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"service {name!r}: timeout must be a positive number of seconds, got {timeout!r}")
    if scope not in SCOPES:
        raise ConfigError(f"service {name!r}: scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if env is not None and not (
        isinstance(env, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise ConfigError(f"service {name!r}: env must be a dict of str to str, got {env!r}")
    for what, value in (("cwd", cwd), ("user", user), ("image", image)):
        if value is not None and not (isinstance(value, str) and value.strip()):
            raise ConfigError(f"service {name!r}: {what} must be a non-empty string or None, got {value!r}")
    if setup is None:
        steps: tuple[str, ...] = ()
    elif isinstance(setup, str):
        steps = (setup,)
    elif isinstance(setup, (list, tuple)) and all(isinstance(s, str) for s in setup):
        steps = tuple(setup)
    else:
        raise ConfigError(f"service {name!r}: setup must be a shell command, a list of them, or None, got {setup!r}")
    try:
        checks = _as_checks(ready, port_list)
    except ConfigError as exc:
        raise ConfigError(f"service {name!r}: {exc}") from None
    caller = sys._getframe(1).f_code.co_filename
    spec = ServiceSpec(
        name=name,
        argv=tuple(argv),
        ports=port_list,
        checks=checks,
        timeout=float(timeout),
        scope=scope,
        env=tuple(env.items()) if env else None,
        cwd=cwd,
        user=user,
        image=image,
        setup=steps,
        where=os.path.abspath(caller),
    )
    # A conftest imported again (pytester runs, importlib mode) declares anew: the newest wins.
    same = [s for s in _DECLARED.get(name, []) if s.where != spec.where]
    _DECLARED[name] = [*same, spec]

    def provide(request: pytest.FixtureRequest) -> Service:
        __tracebackhide__ = True  # a failing start shows its message, not this plugin's frames
        return _provide(request, spec)

    provide.__doc__ = f"The service {name!r}: {' '.join(argv)[:200]} (a pytest_boxlite.Service)."
    provide.__name__ = name
    provide.__qualname__ = name
    return pytest.fixture(scope=scope, name=name)(provide)  # type: ignore[call-overload]


def _provide(request: pytest.FixtureRequest, spec: ServiceSpec) -> Service:
    __tracebackhide__ = True
    from pytest_boxlite.spec import in_guest

    if in_guest(request.config):
        return _guest_service(spec, request)
    return manager(request.config).instance(spec, request.node.nodeid)


def spec_for(item: pytest.Item, name: str) -> ServiceSpec | None:
    """The declaration the fixture ``name`` of ``item`` comes from (the closest one covering it)."""
    path = Path(str(item.path))
    found = [s for s in _DECLARED.get(name, ()) if s.covers(path)]
    if not found:
        return None
    # The deepest conftest wins, as pytest's own fixture overriding goes; a test module's own first.
    return max(found, key=lambda s: (Path(s.where).name != "conftest.py", len(Path(s.where).parts)))


def scope_node(item: pytest.Item, spec: ServiceSpec) -> str:
    """The node id of ``spec``'s scope for ``item``: that of ``request.node`` of its fixture, as
    pytest chooses it (a package scope is the declaring conftest's package, else the session; a
    class scope outside a class is the test itself)."""
    if spec.scope == "function":
        return item.nodeid
    if spec.scope == "session":
        return item.session.nodeid
    if spec.scope == "package":
        here = Path(spec.where).parent
        for n in item.listchain():
            if isinstance(n, pytest.Package) and Path(str(n.path)) == here:
                return n.nodeid
        return item.session.nodeid
    if spec.scope == "class":
        cls = item.getparent(pytest.Class)
        return cls.nodeid if cls is not None else item.nodeid
    module = item.getparent(pytest.Module)
    return module.nodeid if module is not None else item.nodeid


def services_of(item: pytest.Item) -> list[tuple[str, ServiceSpec]]:
    """``(fixture name, declaration)`` of each service in ``item``'s fixture closure."""
    names = getattr(item, "fixturenames", ())
    out = []
    for name in names:
        if name in _DECLARED:
            spec = spec_for(item, name)
            if spec is not None:
                out.append((name, spec))
    return out


def _image_command(spec: ServiceSpec, home: Path, timeout: float) -> tuple[str, ...]:
    """A service declared without ``argv``: its image's ``Entrypoint`` + ``Cmd``, read from the
    image store (the image is already there: its box was just made from it)."""
    from pytest_boxlite.images import ImageError, ensure_image, store_dir

    assert spec.image is not None  # service() refuses a declaration with neither
    try:
        config = ensure_image(spec.image, store=store_dir(home), timeout=max(timeout, 1.0)).config
    except ImageError as exc:
        raise ServiceStartError(spec.name, f"{spec.label()}: could not read the image's Entrypoint/Cmd: {exc}") from exc
    argv = (*config.entrypoint, *config.cmd)
    if not argv:
        raise ServiceStartError(
            spec.name, f"{spec.label()}: image {spec.image!r} has neither Entrypoint nor Cmd: give the service an argv"
        )
    return argv


# -- the fixture's value ------------------------------------------------------------------------------
class Service:
    """A running service: where to reach it, its recent output, its box and process.

    On the host, :attr:`sandbox` and :attr:`process` are the service's
    :class:`~pytest_boxlite.sandbox.Sandbox` and :class:`~pytest_boxlite.process.BoxProcess`.  In a
    boxed test they are ``None`` (the service runs on the host; its addresses are those the box
    reaches it at).
    """

    def __init__(
        self,
        name: str,
        addresses: Mapping[int, tuple[str, int]],
        *,
        sandbox: Sandbox | None = None,
        process: BoxProcess | None = None,
        scope: str = "session",
        key: str = "",
        box: str | None = None,
    ) -> None:
        self.name = name
        self._addresses = dict(addresses)
        #: The name of the service's box (``python -m pytest_boxlite ls`` and ``shell`` know it).
        self.box = box if box is not None else (sandbox.name if sandbox is not None else None)
        #: The service's box (``None`` in a boxed test).
        self.sandbox = sandbox
        #: The service's process in its box (``None`` in a boxed test).
        self.process = process
        self.scope = scope
        self.key = key

    def __repr__(self) -> str:
        where = ", ".join(f"{p}->{h}:{hp}" for p, (h, hp) in self._addresses.items())
        return f"<Service {self.name} {where or 'no ports'}>"

    @property
    def ports(self) -> list[int]:
        """The box ports the service publishes, in declaration order."""
        return list(self._addresses)

    def address(self, port: int | None = None) -> tuple[str, int]:
        """``(host, port)`` to connect to for the box's ``port`` (default: the first of ``ports``)."""
        if not self._addresses:
            raise ConfigError(f"service {self.name!r} publishes no ports (declare them with ports=[...])")
        if port is None:
            port = next(iter(self._addresses))
        try:
            return self._addresses[port]
        except KeyError:
            raise ConfigError(
                f"port {port!r} is not published by service {self.name!r}: its ports are {self.ports}"
            ) from None

    @property
    def host(self) -> str:
        """The host part of the first port's address."""
        return self.address()[0]

    @property
    def port(self) -> int:
        """The port part of the first port's address."""
        return self.address()[1]

    def url(self, scheme: str = "http", port: int | None = None, path: str = "") -> str:
        """``scheme://host:port/path`` for the box's ``port`` (default: the first)."""
        host, hport = self.address(port)
        if path and not path.startswith("/"):
            path = "/" + path
        return f"{scheme}://{host}:{hport}{path}"

    def logs(self, lines: int = LOG_LINES) -> str:
        """The service's last ``lines`` output lines (each ``stdout: ...``/``stderr: ...``, escaped).

        In a boxed test the service runs on the host: the lines are asked of the host (at most
        :data:`LOG_LINES_CAP`), and :class:`~pytest_boxlite.errors.BoxliteError` is raised where
        it cannot answer (the test's run is over, or its box runs no relay to the host).
        """
        if self.process is not None:
            return "\n".join(self.process.last_lines(lines))
        try:
            from pytest_boxlite.guest import debugger
        except ImportError as exc:
            raise BoxliteError(f"service {self.name!r}: its output cannot be asked of the host here ({exc})") from None
        relay = debugger.current()
        if relay is None:
            raise BoxliteError(
                f"service {self.name!r} runs on the host, and this box has no way to ask it for the "
                "output (only a running boxed test has one)"
            )
        try:
            return relay.service_logs(self.name, lines)
        except LookupError as exc:
            raise BoxliteError(f"service {self.name!r}: the host gave no output: {exc}") from None

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (what a boxed test's fixture is built from)."""
        return {
            "name": self.name,
            "scope": self.scope,
            "key": self.key,
            "box": self.box,
            "ports": {str(p): [h, hp] for p, (h, hp) in self._addresses.items()},
        }


# -- starting and stopping ----------------------------------------------------------------------------
@dataclass
class _Starting:
    """What the readiness checks see of a service being started."""

    spec: ServiceSpec
    sandbox: Sandbox
    process: BoxProcess
    addresses: dict[int, tuple[str, int]]

    def check_running(self, awaited: str) -> None:
        if self.process.poll() is not None:
            raise _Exited(f"it exited with status {self.process.returncode} before {awaited}")


@dataclass
class _Instance:
    spec: ServiceSpec
    scope_key: str
    lease: Lease
    service: Service
    #: A test that used it failed (its box is kept with --boxlite-keep).
    failed: bool = False


class ServiceManager:
    """The service instances of one pytest process (see the module docstring), and its hooks."""

    NAME = "boxlite-services"

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._lock = threading.RLock()
        self._live: dict[tuple[str, str], _Instance] = {}
        #: A start that failed: raised again to the other tests of its scope (as pytest keeps a
        #: fixture's error for its scope), without trying again.
        self._failed: dict[tuple[str, str], ServiceStartError] = {}
        self._item: pytest.Item | None = None
        self._pruned = False
        #: The session's items that use services, by node id (see :func:`activate`).
        self.items: dict[str, pytest.Item] = {}
        #: Places this manager added to the pool's cap whose service has stopped (see _take_room).
        self._owed = 0

    def _session(self) -> BoxliteSession:
        from pytest_boxlite.fixtures import get_session

        return get_session(self.config)

    # -- instances ------------------------------------------------------------------------------
    def instance(self, spec: ServiceSpec, scope_key: str) -> Service:
        """The running instance of ``spec`` for the scope node ``scope_key``, started if need be."""
        __tracebackhide__ = True
        key = (spec.key, scope_key)
        with self._lock:
            live = self._live.get(key)
            if live is not None:
                return live.service
            failed = self._failed.get(key)
            if failed is not None:
                raise failed
            try:
                inst = self._start(spec, scope_key)
            except ServiceStartError as exc:
                self._failed[key] = exc
                raise
            self._live[key] = inst
            return inst.service

    def _start(self, spec: ServiceSpec, scope_key: str) -> _Instance:
        __tracebackhide__ = True
        from pytest_boxlite import service_ledger
        from pytest_boxlite.fixtures import BoxlitePool

        session = self._session()
        if not self._pruned:
            self._pruned = True
            with contextlib.suppress(OSError):
                service_ledger.prune(session.home)
        fields: dict[str, Any] = {} if spec.image is None else {"image": spec.image}
        deadline = time.monotonic() + spec.timeout
        # A service's box comes on top of --boxlite-max-boxes: held for a whole scope, it would
        # otherwise starve the tests (a boxed test waiting for a box that services hold).
        pool = session.pool()
        self._take_room(pool)
        try:
            lease = BoxlitePool(session)._lease(f"service {spec.name!r}", spec.timeout, False, fields)
        except BoxliteError as exc:
            self._owed += 1
            raise ServiceStartError(spec.name, f"{spec.label()}: could not get a box: {exc}") from exc
        ok = False
        proc: BoxProcess | None = None
        try:
            sb = lease.sandbox
            for step in spec.setup:
                try:
                    res = sb.execute_command(step, timeout=_left(deadline))
                except BoxliteError as exc:
                    why = f"{spec.label()}: setup {step!r} in box {sb.name}: {exc}"
                    raise ServiceStartError(spec.name, why) from exc
                if not res.ok:
                    # Guest bytes: escaped and cut, as a process's last lines are.
                    out = quote_output(res.stdout) + quote_output(res.stderr)
                    out = out[-20:]
                    why = "timed out" if res.timed_out else f"exited {res.exit_code}"
                    raise ServiceStartError(spec.name, f"{spec.label()}: setup {step!r} {why} in box {sb.name}", out)
            argv = spec.argv or _image_command(spec, session.home, _left(deadline))
            try:
                proc = sb.spawn(argv, env=dict(spec.env) if spec.env else None, cwd=spec.cwd, user=spec.user)
            except (BoxliteError, OSError) as exc:
                raise ServiceStartError(spec.name, f"{spec.label()}: could not start in box {sb.name}: {exc}") from exc
            try:
                addresses = {p: sb.publish(p) for p in spec.ports}
            except (BoxliteError, OSError) as exc:
                raise ServiceStartError(
                    spec.name, f"{spec.label()}: could not publish its ports in box {sb.name}: {exc}", proc.last_lines()
                ) from exc
            starting = _Starting(spec, sb, proc, addresses)
            for check in spec.checks:
                own = deadline if check.timeout is None else min(deadline, time.monotonic() + check.timeout)
                try:
                    check.wait(starting, own)
                except OutputWaitError as exc:
                    raise self._not_ready(spec, check, proc, sb, own == deadline, exc) from None
                except (BoxliteError, OSError) as exc:
                    # The box itself failed (died, stopped answering): not a readiness answer.
                    why = f"{spec.label()} in box {sb.name}: {check.describe()} failed: {exc}"
                    raise ServiceStartError(spec.name, why, proc.last_lines()) from exc
            svc = Service(spec.name, addresses, sandbox=sb, process=proc, scope=spec.scope, key=scope_key)
            inst = _Instance(spec, scope_key, lease, svc)
            with contextlib.suppress(OSError):
                service_ledger.write(
                    session.home,
                    sb.name,
                    {
                        "service": spec.name,
                        "scope": spec.scope,
                        "ports": {str(p): f"{h}:{hp}" for p, (h, hp) in addresses.items()},
                        "pid": os.getpid(),
                    },
                )
            ok = True
            return inst
        finally:
            if not ok:
                if proc is not None:
                    proc.close()
                # A service that never got ready: its box (files, setup's work) kept to look into.
                try:
                    lease.release(keep=session.settings.keep)
                finally:
                    self._owed += 1

    def _take_room(self, pool: Any) -> None:
        """Room in the pool for one more service's box, on top of ``--boxlite-max-boxes``: a place a
        stopped service left, once its box is gone (the pool has room again), else a new one.

        The cap never shrinks back while the session runs: a stopped service's box is destroyed in
        the background and counts until then, and a cap lowered before that would leave a lease at
        the cap, which makes the pool ask the session to give a box up (a boxed test's warm
        interpreter).  Under the pool's own condition, which waiting leases sleep on (a private of
        the pool; this package's own)."""
        with pool._cond:
            if self._owed > 0 and pool._live < pool.max_boxes:
                self._owed -= 1
            else:
                pool.max_boxes += 1
            pool._cond.notify_all()

    def _not_ready(
        self, spec: ServiceSpec, check: Ready, proc: BoxProcess, sb: Sandbox, overall: bool, exc: OutputWaitError
    ) -> ServiceStartError:
        code = proc.poll()
        if code is not None:
            proc._settle()
        lines = proc.last_lines()
        if code is not None:
            what = f"exited with status {code} before it was ready ({check.describe()})"
        else:
            bound = f"{spec.timeout:g} s" if overall else f"its check's {check.timeout:g} s"
            what = f"was not ready within {bound}: {check.describe()} did not pass"
        # The wait's own words say what it saw last (an HTTP status, a command's error); after an
        # exit they would only say the exit again.
        detail = "" if code is not None else "; " + str(exc).split("\n--- last output lines ---", 1)[0]
        return ServiceStartError(spec.name, f"{spec.label()} in box {sb.name} {what}{detail}", lines)

    def stop(self, key: tuple[str, str]) -> None:
        from pytest_boxlite import service_ledger

        with self._lock:
            inst = self._live.pop(key, None)
            self._failed.pop(key, None)
        if inst is None:
            return
        sb = inst.lease.sandbox
        settings = self._session().settings
        keep = settings.keep and inst.failed
        with contextlib.suppress(OSError):
            service_ledger.remove(self._session().home, sb.name)
        proc = inst.service.process
        if proc is not None:
            # Its process group too; no "left running" warning: it is ours to stop.  A kept box
            # keeps its files; the process ends here all the same (a box kills a process whose
            # host end went away), to be started again there with ``python -m pytest_boxlite shell``.
            # A dead box cannot be asked: its process went with it (the lease's end reaps the box).
            with contextlib.suppress(BoxliteError, OSError):
                proc.close()
        if keep:
            # The summary's "kept box" line names the service (reporting.BOX_PROPERTY).
            item = self._item
            if item is not None:
                item.user_properties.append(("boxlite_box", sb.name))
        try:
            with contextlib.suppress(BoxliteError):
                inst.lease.release(keep=keep)
        finally:
            self._owed += 1

    def stop_all(self) -> None:
        with self._lock:
            keys = list(self._live)
            self._failed.clear()
        for key in reversed(keys):  # the newest (narrowest) first
            self.stop(key)

    def used_by(self, item: pytest.Item) -> list[tuple[str, _Instance]]:
        """The running instances ``item`` uses: ``(fixture name, instance)``."""
        out = []
        with self._lock:
            for name, spec in services_of(item):
                inst = self._live.get((spec.key, scope_node(item, spec)))
                if inst is not None:
                    out.append((name, inst))
        return out

    def descriptions_for(self, item: pytest.Item, *, wide_only: bool = False) -> dict[str, dict[str, Any]]:
        """Start (or reuse) on the host every service ``item`` uses, for its scopes, and describe
        each (fixture name -> :meth:`Service.describe`).  A start that fails is described as
        ``{"name", "error": message}``: the box's fixture raises it for the test.  ``wide_only``:
        only the services wider than a function (what a warm interpreter sets up ahead)."""
        out: dict[str, dict[str, Any]] = {}
        for name, spec in services_of(item):
            if wide_only and spec.scope == "function":
                continue
            try:
                out[name] = self.instance(spec, scope_node(item, spec)).describe()
            except BoxliteError as exc:  # a ServiceStartError, or a session that cannot lease
                out[name] = {"name": name, "error": str(exc)[:64_000]}
        return out

    # -- hooks ----------------------------------------------------------------------------------
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
        self._item = item
        try:
            return (yield)
        finally:
            try:
                keep = {n.nodeid for n in nextitem.listchain()} if nextitem is not None else set()
                with self._lock:
                    done = [k for k in self._live if k[1] not in keep]
                    for k in list(self._failed):
                        if k[1] not in keep:
                            self._failed.pop(k, None)
                for key in reversed(done):
                    self.stop(key)
            finally:
                self._item = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        item = self._item
        if not report.failed or item is None or report.nodeid != item.nodeid:
            return
        for name, inst in self.used_by(item):
            inst.failed = True
            title = SECTION.format(name=name)
            if any(t == title for t, _ in report.sections):
                continue
            text = inst.service.logs() or "(no output)"
            report.sections.append((title, f"{inst.service!r} in box {inst.lease.sandbox.name}\n{text}"))

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.stop_all()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.stop_all()


_MANAGER_KEY = pytest.StashKey[ServiceManager]()


def manager(config: pytest.Config) -> ServiceManager:
    """This process's :class:`ServiceManager` (registered as a plugin at first use)."""
    found = config.stash.get(_MANAGER_KEY, None)
    if found is None:
        found = ServiceManager(config)
        config.stash[_MANAGER_KEY] = found
        config.pluginmanager.register(found, ServiceManager.NAME)
    return found


def activate(config: pytest.Config, items: Sequence[pytest.Item] = ()) -> None:
    """Register the manager before the first test runs, where services are declared (the plugin
    calls it after collection, only once this module was imported by a conftest)."""
    from pytest_boxlite.fixtures import SESSION_KEY

    if _DECLARED and SESSION_KEY in config.stash:
        # The items that use services, by node id: a box made ahead is asked for by node id.
        manager(config).items = {it.nodeid: it for it in items if services_of(it)}


def descriptions_for(config: pytest.Config, item: pytest.Item) -> dict[str, dict[str, Any]]:
    """Host side of the boxed-test contract (see the module docstring)."""
    if not _DECLARED or not services_of(item):
        return {}
    return manager(config).descriptions_for(item)


def logs_for(item: pytest.Item, name: str, lines: int) -> str | None:
    """The last ``lines`` output lines of the service fixture ``name`` that ``item`` (a boxed
    test) uses, running on the host; ``None`` where ``item`` uses no such running service."""
    found = item.config.stash.get(_MANAGER_KEY, None)
    if found is None:
        return None
    for fixture, inst in found.used_by(item):
        if fixture == name:
            return inst.service.logs(lines)
    return None


def box_fields(
    config: pytest.Config, *, item: pytest.Item | None = None, nodeid: str | None = None, wide_only: bool = False
) -> dict[str, Any]:
    """The fields that a ``RUN`` (``item``) or ``FORK`` (``nodeid``, ``wide_only``: the warm
    interpreter sets up only the wider fixtures) message carries for the box's service
    fixtures: ``{"services": descriptions}``, or nothing when the item uses none.  The box hands
    them to :func:`receive`."""
    if not _DECLARED:
        return {}
    found = config.stash.get(_MANAGER_KEY, None)
    if item is None and nodeid is not None and found is not None:
        item = found.items.get(nodeid)
    if item is None or not services_of(item):
        return {}
    descriptions = manager(config).descriptions_for(item, wide_only=wide_only)
    return {"services": descriptions} if descriptions else {}


class ServiceHooks:
    """Services' implementations of :mod:`pytest_boxlite.hooks`, registered with each run once a
    conftest (or a test module) imports this module (:func:`pytest_boxlite.hooks.join`); each does
    nothing until a service is declared."""

    NAME = "boxlite-service-hooks"

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """The manager joins before the first test; service fixtures run sandboxes, so a host role
        that waits for the first boxed test is promoted now."""
        from pytest_boxlite.fixtures import PROMOTE_KEY

        promote = config.stash.get(PROMOTE_KEY, None)
        if promote is not None and _DECLARED:
            promote()
        activate(config, items)

    def pytest_boxlite_box_fields(
        self, config: pytest.Config, item: pytest.Item | None, nodeid: str, wide_only: bool
    ) -> dict[str, Any] | None:
        return box_fields(config, item=item, nodeid=nodeid, wide_only=wide_only) or None

    def pytest_boxlite_reach(
        self, config: pytest.Config, box: hooks.BoxAccess, item: pytest.Item | None, nodeid: str, wide_only: bool
    ) -> str | None:
        """The services' host addresses, reachable at the same addresses in ``box``
        (:mod:`pytest_boxlite.reach`'s relay)."""
        from pytest_boxlite import reach

        if item is not None and not wide_only:
            described: object = descriptions_for(config, item)
        else:
            described = box_fields(config, item=item, nodeid=nodeid, wide_only=wide_only).get("services")
        targets = reach.targets_of(described) if isinstance(described, dict) else []
        if not targets:
            return None
        try:
            if box.stream is not None:
                reach.prepare_forked(box.name, box.stream, targets, agent=box.agent)
            else:
                reach.prepare_booted(box.name, box.agent, targets)
        except reach.BoxGone:
            return None  # a box that ended: its RUN (or FORK) finds it and says so, as for any test
        except (BoxliteError, OSError) as exc:
            where = "its warm box" if wide_only else "its box"
            return f"could not make the test's services reachable in {where}: {exc}"
        return None

    def pytest_boxlite_box_done(self, config: pytest.Config, name: str) -> None:
        from pytest_boxlite import reach

        reach.close_box(name)

    def pytest_boxlite_box_received(self, config: pytest.Config, fields: dict[str, Any]) -> None:
        described = fields.get("services")
        receive(described if isinstance(described, Mapping) else {})


#: The one :class:`ServiceHooks` of this process (stateless: its state is each run's manager).
HOOKS = ServiceHooks()
# Joined as this module is imported (by a conftest that declares a service, or imports its names):
# a run that never imports it registers nothing for services.
hooks.join(HOOKS)


# -- in a box -------------------------------------------------------------------------------------
#: Descriptions the transport handed to this box's pytest (see :func:`receive`), by fixture name.
_RECEIVED: dict[str, dict[str, Any]] = {}


def receive(descriptions: Mapping[str, Any]) -> None:
    """Box side of the contract: the descriptions of the services of the item about to be set up,
    their ``ports`` already the addresses this box reaches them at.  They replace the last item's:
    a fixture of a service that the host did not start for this item (one asked for with
    ``getfixturevalue``) fails, instead of finding an instance of another scope that may be gone.
    Parsed defensively all the same (never followed)."""
    _RECEIVED.clear()
    for name, desc in dict(descriptions).items():
        if isinstance(name, str) and isinstance(desc, dict):
            _RECEIVED[name] = desc


def _guest_service(spec: ServiceSpec, request: pytest.FixtureRequest) -> Service:
    __tracebackhide__ = True
    desc = _RECEIVED.get(spec.name)
    if desc is None:
        raise ServiceStartError(
            spec.name,
            f"{spec.label()}: this test runs in a box, and the host handed it no address of the service. "
            "The host starts the services that a boxed test names as arguments (directly or through its "
            f"fixtures, or with usefixtures); request.getfixturevalue({spec.name!r}) in a box asks too late: "
            f"name {spec.name!r} as an argument of the test. (Under --boxlite-scope=worker the whole "
            "session is in a box: no service can be started for it.)",
        )
    error = desc.get("error")
    if isinstance(error, str):
        raise ServiceStartError(spec.name, f"on the host: {error}")
    addresses: dict[int, tuple[str, int]] = {}
    raw = desc.get("ports")
    if isinstance(raw, dict):
        for port, address in raw.items():
            with contextlib.suppress(TypeError, ValueError):
                host, hport = address
                addresses[int(port)] = (str(host), int(hport))
    box = desc.get("box")
    return Service(
        spec.name,
        addresses,
        scope=spec.scope,
        key=str(desc.get("key", ""))[:1000],
        box=box[:200] if isinstance(box, str) else None,
    )
