"""Every option in one table, resolved once into a frozen :class:`Settings`.

Precedence, lowest first: built-in default < ini key < environment variable
< command line (< marker arguments, applied per test by the marker layer).
A bad value raises :class:`pytest.UsageError` naming where it came from.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_boxlite.spec import DEFAULT_ENV_DENY, default_image

ENV_PREFIX = "PYTEST_BOXLITE_"


def default_home() -> str:
    """``$XDG_CACHE_HOME/pytest-boxlite`` (``~/.cache/pytest-boxlite``): runtime state and image cache."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "pytest-boxlite")


def _positive_int(v: str) -> int:
    n = int(v)
    if n < 1:
        raise ValueError("must be at least 1")
    return n


def _memory(v: str) -> int:
    n = int(v)
    if n < 64:
        raise ValueError("must be at least 64 (MiB)")
    return n


def _non_negative_float(v: str) -> float:
    f = float(v)
    if not f >= 0 or f == float("inf"):
        raise ValueError("must be a number of seconds >= 0")
    return f


def _positive_float(v: str) -> float:
    f = float(v)
    if not f > 0 or f == float("inf"):
        raise ValueError("must be a number of seconds > 0")
    return f


def _bool(v: str) -> bool:
    low = v.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be one of 1/0, true/false, yes/no, on/off")


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(v: str) -> str:
        if v not in choices:
            raise ValueError(f"must be one of: {', '.join(choices)}")
        return v

    return parse


def _runtime(v: str) -> str:
    # The runtimes package only where a runtime is named: every pytest process resolves the settings.
    from pytest_boxlite.runtimes import RUNTIME_CHOICES

    return _choice(*RUNTIME_CHOICES)(v)


def _network(v: str) -> bool:
    return _choice("on", "off")(v.strip().lower()) == "on"


def _patterns(v: str) -> tuple[str, ...]:
    if v.strip().lower() == "none":
        return ()
    return tuple(p.strip() for p in v.replace("\n", ",").split(",") if p.strip())


def _count(v: str) -> int:
    n = int(v)
    if n < 0:
        raise ValueError("must be 0 or more")
    return n


def _nonempty(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty")
    return v.strip()


@dataclasses.dataclass(frozen=True)
class Option:
    """One setting: its flag, ini key, environment variable, parser and default."""

    name: str
    parse: Callable[[str], Any]
    default: Callable[[], Any]
    help: str
    metavar: str = "VALUE"
    flag_only: bool = False  # a store_true flag on the command line
    #: The option's older name, still read (flag, ini key, variable) where the new one is not set.
    alias: str | None = None

    @property
    def flag(self) -> str:
        return "--boxlite" if self.name == "all" else "--boxlite-" + self.name.replace("_", "-")

    @property
    def ini(self) -> str:
        return "boxlite_" + self.name

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def older(self) -> Option | None:
        """The option as its older name spells it (flag, ini key, variable), if it has one."""
        return None if self.alias is None else dataclasses.replace(self, name=self.alias, alias=None)


OPTIONS: tuple[Option, ...] = (
    Option(
        "image",
        _nonempty,
        default_image,
        "OCI image of the boxes: a registry reference, oci:DIR[:TAG], oci-archive:FILE or docker-archive:FILE "
        "(default: on the namespace runtime, none: boxes see the host's own files; on vm, "
        "python:<host major.minor>-slim)",
        "IMAGE",
    ),
    Option(
        "max_boxes",
        _positive_int,
        lambda: 2,
        "cap on live boxes per pytest process; also the warm-pool size",
        "N",
        alias="replicas",
    ),
    Option(
        "runtime",
        _runtime,
        lambda: "auto",
        "auto (vm when a VM can boot, else namespace), vm or namespace",
        "KIND",
    ),
    Option(
        "cpus", _positive_int, lambda: None, "vCPUs per box (default: the runtime's: 1 on vm, no cap on namespace)", "N"
    ),
    Option("memory", _memory, lambda: None, "memory per box in MiB (default: runtime default, 1024)", "MIB"),
    Option(
        "idle_timeout",
        _non_negative_float,
        lambda: 600.0,
        "stop warm boxes idle this long, in seconds; 0 = never",
        "SECONDS",
    ),
    Option(
        "timeout",
        _positive_float,
        lambda: 300.0,
        "default bound on each command and each boxed test, in seconds",
        "SECONDS",
    ),
    Option("network", _network, lambda: False, "on or off: outbound network inside boxes (default off)", "on|off"),
    Option("home", _nonempty, default_home, "runtime state and image cache (default: ~/.cache/pytest-boxlite)", "DIR"),
    Option("keep", _bool, lambda: False, "keep the boxes of failed tests for debugging", flag_only=True),
    Option("all", _bool, lambda: False, "run every collected test inside a box (flag: --boxlite)", flag_only=True),
    Option(
        "scope",
        _choice("test", "module", "worker"),
        lambda: "test",
        "test: a box per boxed test (default); module: one per module; worker: each xdist worker "
        "(or, without -n, the whole session) runs inside one box",
        "test|module|worker",
    ),
    Option(
        "fresh",
        _choice("fork", "boot"),
        lambda: "fork",
        "how fresh boxes are made: fork (default: a boxed test's box is forked in a box booted once per worker, "
        "on vm the tests of a worker share one VM kernel; namespace sandboxes are forked from a warm box of "
        "their spec) or boot (every box booted; on vm a whole VM per test: kernel isolation between tests, "
        "at a boot's price)",
        "fork|boot",
    ),
    Option(
        "setup",
        _nonempty,
        lambda: None,
        "command run once per box spec before boxes enter the pool, e.g. 'pip install -e .'; "
        "cached across sessions (python -m pytest_boxlite clean --templates drops it)",
        "COMMAND",
    ),
    Option(
        "boot_timeout", _positive_float, lambda: 120.0, "bound on creating and starting one box, in seconds", "SECONDS"
    ),
    Option(
        "url",
        _nonempty,
        lambda: None,
        "run the boxes (micro-VMs) on a remote BoxLite server (boxlite serve) at this URL; its API key is read from "
        "BOXLITE_API_KEY or --boxlite-credential-file, never from the URL",
        "URL",
    ),
    Option(
        "credential_file",
        _nonempty,
        lambda: None,
        "file holding the API key of the --boxlite-url server (default: the BOXLITE_API_KEY environment variable)",
        "FILE",
    ),
    Option(
        "env_deny",
        _patterns,
        lambda: DEFAULT_ENV_DENY,
        "host variables boxed tests do not see: comma-separated patterns, matched case-insensitively "
        f"(default: {','.join(DEFAULT_ENV_DENY)}; 'none': the whole host environment, as locally)",
        "PATTERNS",
    ),
    Option(
        "lease_timeout",
        _positive_float,
        lambda: 300.0,
        "how long a test waits for a box when every box the cap allows is in use",
        "SECONDS",
    ),
)
OPTIONS += (
    Option(
        "side_effects",
        _choice("off", "report", "fail"),
        lambda: "off",
        "off (default), report or fail: list what each boxed test left behind (files outside its temporary "
        "space, processes still running, environment, working directory or umask not restored) in the summary "
        "and the junitxml property boxlite_side_effects; fail also fails each such test at teardown",
        "off|report|fail",
    ),
    Option(
        "side_effects_ignore",
        _patterns,
        lambda: (),
        "paths a suite writes on purpose, left out of --boxlite-side-effects: fnmatch patterns, comma-separated "
        "(in the ini key also one or more per line) "
        "matched against the path in the box, relative to the project or as ~/... in the home "
        "(a directory's pattern covers what it holds)",
        "PATTERNS",
    ),
    Option(
        "usage",
        _count,
        lambda: 0,
        "list the N boxed tests with the highest peak memory, CPU time and process count (like --durations=N), "
        "from each box's own cgroup where it has one, else from the test process's rusage (the table says which); "
        "junitxml gets boxlite_cpu_s, boxlite_peak_memory_mb and boxlite_max_processes for every boxed test "
        "(default 0: off)",
        "N",
    ),
)
OPTIONS_BY_NAME = {o.name: o for o in OPTIONS}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Resolved session settings.  ``sources`` says where each value came from."""

    image: str
    max_boxes: int
    runtime: str
    cpus: int | None
    memory: int | None
    idle_timeout: float
    timeout: float
    network: bool
    home: str
    keep: bool
    all: bool
    scope: str
    setup: str | None
    boot_timeout: float
    lease_timeout: float
    url: str | None = None
    credential_file: str | None = None
    env_deny: tuple[str, ...] = DEFAULT_ENV_DENY
    fresh: str = "fork"
    side_effects: str = "off"
    side_effects_ignore: tuple[str, ...] = ()
    usage: int = 0
    sources: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)


def default_text(value: Any) -> str:
    """A default value as ``--help`` and the reference show it."""
    if value is False:
        return "off"
    if value is True:
        return "on"
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def help_text(opt: Option) -> str:
    """``opt``'s help with its default, where the help does not say it already."""
    default = opt.default()
    if opt.flag_only or default is None or "(default" in opt.help:
        return opt.help
    return f"{opt.help} (default: {default_text(default)})"


#: The ini type of each option's key (``pytest --help`` shows it): flags are booleans, the list
#: of patterns is a line list (one or more per line, comma-separated), the rest strings.
INI_TYPES = {"all": "bool", "keep": "bool", "env_deny": "linelist", "side_effects_ignore": "linelist"}


def add_options(parser: pytest.Parser) -> None:
    """Register every option as a flag and an ini key; ``--boxlite`` first (it is the one most runs need)."""
    group = parser.getgroup("boxlite", "run tests inside throw-away boxes (pytest-boxlite)")
    for opt in sorted(OPTIONS, key=lambda o: o.name != "all"):
        text = f"{help_text(opt)} [ini: {opt.ini}; env: {opt.env}]"
        old = opt.older()
        flags = [opt.flag] if old is None else [opt.flag, old.flag]  # the older flag: the same option
        if opt.flag_only:
            group.addoption(
                *flags, action="store_const", const="1", default=None, dest=f"boxlite_{opt.name}", help=text
            )
        else:
            group.addoption(*flags, default=None, dest=f"boxlite_{opt.name}", metavar=opt.metavar, help=text)
        parser.addini(opt.ini, help_text(opt), type=INI_TYPES.get(opt.name, "string"), default=None)  # type: ignore[arg-type]
        if old is not None:
            parser.addini(old.ini, f"older name of {opt.ini}", type=INI_TYPES.get(opt.name, "string"), default=None)  # type: ignore[arg-type]


def source_text(source: str) -> str:
    """Where a value came from, as an error message says it (``Settings.sources`` holds the short form)."""
    kind, _, name = source.partition(" ")
    if kind == "command":
        return "the command line"
    if kind == "env":
        return f"the environment variable {name}"
    if kind == "ini":
        return f"the ini key {name}"
    return source


def _ini(config: pytest.Config, opt: Option) -> str | None:
    """The ini key's value as text for ``opt.parse`` (a typed key comes back as a bool or a list)."""
    try:
        ini = config.getini(opt.ini)
    except (ValueError, pytest.UsageError) as exc:
        # A bool key pytest cannot read, "invalid truth value 'x'": a ValueError up to pytest 9.1,
        # a UsageError naming no key from 9.2 on.
        if "invalid truth value" not in str(exc):
            raise
        raw = str(exc).removeprefix("invalid truth value ")
        raise pytest.UsageError(
            f"{opt.flag}: bad value {raw} from ini key {opt.ini}: must be one of 1/0, true/false, yes/no, on/off"
        ) from None
    if ini is None or ini == "" or ini == []:
        return None
    if isinstance(ini, bool):
        return "1" if ini else "0"
    if isinstance(ini, list):
        return "\n".join(str(v) for v in ini)
    return str(ini)


def _parse(opt: Option, raw: str, source: str) -> Any:
    try:
        return opt.parse(raw)
    except ValueError as exc:
        reason = str(exc)
        if reason.startswith(("invalid literal", "could not convert")):
            reason = "must be a number"
        raise pytest.UsageError(f"{opt.flag}: bad value {raw!r} from {source}: {reason}") from None


def _names(opt: Option) -> list[Option]:
    """``opt``, then its older name's spelling (read where the new one is not set)."""
    old = opt.older()
    return [opt] if old is None else [opt, old]


def _typed_flag(config: pytest.Config, names: list[Option]) -> str:
    """Which of ``names`` (an option, then its older spelling: :func:`_names`) the command line
    used last (argparse keeps only the value)."""
    typed = names[0].flag
    for arg in config.invocation_params.args:
        for named in names:
            if isinstance(arg, str) and (arg == named.flag or arg.startswith(named.flag + "=")):
                typed = named.flag
    return typed


def resolve(config: pytest.Config, environ: dict[str, str] | None = None) -> Settings:
    """Resolve every option: default < ini < environment < command line."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for opt in OPTIONS:
        value, source = opt.default(), "default"
        # At each level the option's name wins over its older one (``Option.alias``).
        names = _names(opt)
        for named in names:
            raw_ini = _ini(config, named)
            if raw_ini is not None:
                value, source = _parse(opt, raw_ini, f"ini key {named.ini}"), f"ini {named.ini}"
                break
        for named in names:
            if named.env in env:
                value, source = _parse(opt, env[named.env], f"environment variable {named.env}"), f"env {named.env}"
                break
        cli = config.getoption(f"boxlite_{opt.name}")
        if cli is not None:
            flag = _typed_flag(config, names)
            value, source = _parse(opt, cli, f"the command line ({flag})"), f"command line {flag}"
        values[opt.name] = value
        sources[opt.name] = source
    if values["url"] is not None and values["scope"] == "worker":
        raise pytest.UsageError(
            "--boxlite-scope=worker cannot run on a --boxlite-url server yet (the worker's box is opened "
            "by a helper process on this host): use --boxlite-scope=test or module with --boxlite-url"
        )
    if values["credential_file"] is not None and values["url"] is None:
        raise pytest.UsageError(
            f"--boxlite-credential-file (from {sources['credential_file']}) is only used with --boxlite-url: "
            "give the server's URL too, or drop the credential file"
        )
    return Settings(**values, sources=sources)
