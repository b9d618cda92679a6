"""Options: default < ini < environment < command line, bad values, and turning the plugin off.

Each case is a real pytest sub-run (``pytester.runpytest``) whose test prints
the settings the plugin resolved, read from ``config.stash``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from subruns import BOX_SPY_CONFTEST, QUIET

from pytest_boxlite.runtimes import probe
from pytest_boxlite.settings import OPTIONS, default_home
from pytest_boxlite.spec import default_image

SHOW_SETTINGS = """
import dataclasses, json
from pytest_boxlite.fixtures import get_session

def test_show(pytestconfig):
    session = get_session(pytestconfig)  # a run that boxes nothing makes its session on demand
    s = session.settings
    values = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "sources"}
    shown = {"values": values, "sources": s.sources, "runtime": session.choice.kind}
    print("\\nBOXLITE-SETTINGS " + json.dumps(shown))
"""

# The settings alone, resolved at configure in a run that only collects (it makes no session): the
# layers' images are names nobody has, which a session refuses at its start (a usage error).
SHOW_RESOLVED = """
import dataclasses, json
from pytest_boxlite.settings import resolve

def pytest_configure(config):
    s = resolve(config)
    values = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "sources"}
    print("\\nBOXLITE-SETTINGS " + json.dumps({"values": values, "sources": s.sources}))
"""

# name -> (ini raw, env raw, cli args, parsed ini, parsed env, parsed cli)
LAYERS: dict[str, tuple[str, str, list[str], Any, Any, Any]] = {
    "max_boxes": ("3", "4", ["--boxlite-max-boxes", "5"], 3, 4, 5),
    "image": (
        "ini/image:1",
        "env/image:2",
        ["--boxlite-image", "cli/image:3"],
        "ini/image:1",
        "env/image:2",
        "cli/image:3",
    ),
    "network": ("on", "off", ["--boxlite-network", "on"], True, False, True),
    "runtime": ("namespace", "auto", ["--boxlite-runtime", "namespace"], "namespace", "auto", "namespace"),
    "idle_timeout": ("11", "0", ["--boxlite-idle-timeout", "12.5"], 11.0, 0.0, 12.5),
    "timeout": ("21", "22", ["--boxlite-timeout", "23.5"], 21.0, 22.0, 23.5),
    "cpus": ("2", "3", ["--boxlite-cpus", "4"], 2, 3, 4),
    "memory": ("256", "512", ["--boxlite-memory", "768"], 256, 512, 768),
    "keep": ("true", "no", ["--boxlite-keep"], True, False, True),
    "scope": ("module", "test", ["--boxlite-scope", "module"], "module", "test", "module"),
    "fresh": ("boot", "fork", ["--boxlite-fresh", "boot"], "boot", "fork", "boot"),
    "boot_timeout": ("31", "32", ["--boxlite-boot-timeout", "33"], 31.0, 32.0, 33.0),
    "lease_timeout": ("41", "42", ["--boxlite-lease-timeout", "43"], 41.0, 42.0, 43.0),
}
# home is set per test, under tmp_path: see home_layers().


def home_layers(tmp_path: Path) -> tuple[str, str, str]:
    return str(tmp_path / "ini-home"), str(tmp_path / "env-home"), str(tmp_path / "cli-home")


def write_ini(pytester: pytest.Pytester, values: dict[str, str]) -> None:
    lines = ["[pytest]"] + [f"boxlite_{k} = {v}" for k, v in values.items()]
    pytester.makeini("\n".join(lines) + "\n")


def run_show(pytester: pytest.Pytester, *args: str, session: bool = True) -> dict[str, Any]:
    if session:
        pytester.makepyfile(test_show=SHOW_SETTINGS)
    else:
        pytester.makeconftest(SHOW_RESOLVED)
        pytester.makepyfile(test_show="def test_show():\n    pass\n")
        args = ("--collect-only", *args)
    result = pytester.runpytest("-s", *QUIET, *args)
    assert result.ret == pytest.ExitCode.OK, "\n".join(result.outlines + result.errlines)
    for line in result.outlines:
        if "BOXLITE-SETTINGS " in line:
            shown: dict[str, Any] = json.loads(line.split("BOXLITE-SETTINGS ", 1)[1])
            return shown
    raise AssertionError("the sub-run printed no settings:\n" + "\n".join(result.outlines))


# -- precedence --------------------------------------------------------------


@pytest.mark.timeout(60)
def test_defaults(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    shown = run_show(pytester)
    values, sources = shown["values"], shown["sources"]
    assert set(sources) == {o.name for o in OPTIONS}
    assert all(src == "default" for src in sources.values()), sources
    assert values["image"] == default_image()
    assert values["max_boxes"] == 2
    assert values["runtime"] == "auto"
    assert values["network"] is False
    assert values["idle_timeout"] == 600.0
    assert values["timeout"] == 300.0
    assert values["keep"] is False
    assert values["cpus"] is None
    assert values["memory"] is None
    # The default home is under the user's cache directory, as seen by the sub-run (pytester sets $HOME).
    assert values["home"] == default_home()
    assert values["home"].endswith(os.path.join(".cache", "pytest-boxlite"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layers", ["ini", "ini+env", "ini+env+cli"])
def test_precedence(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, layers: str) -> None:
    ini_home, env_home, cli_home = home_layers(tmp_path)
    write_ini(pytester, {**{k: v[0] for k, v in LAYERS.items()}, "home": ini_home})
    args: list[str] = []
    if "env" in layers:
        for name, layer in LAYERS.items():
            monkeypatch.setenv("PYTEST_BOXLITE_" + name.upper(), layer[1])
        monkeypatch.setenv("PYTEST_BOXLITE_HOME", env_home)
    if "cli" in layers:
        for layer in LAYERS.values():
            args += layer[2]
        args += ["--boxlite-home", cli_home]

    shown = run_show(pytester, *args, session=False)
    values, sources = shown["values"], shown["sources"]
    idx = {"ini": 3, "ini+env": 4, "ini+env+cli": 5}[layers]
    for name, layer in LAYERS.items():
        assert values[name] == layer[idx], f"{name} under {layers}"
    assert values["home"] == {"ini": ini_home, "ini+env": env_home, "ini+env+cli": cli_home}[layers]
    for name in [*LAYERS, "home"]:
        if layers == "ini":
            assert sources[name] == f"ini boxlite_{name}"
        elif layers == "ini+env":
            assert sources[name] == f"env PYTEST_BOXLITE_{name.upper()}"
        else:
            assert sources[name].startswith("command line --boxlite-"), sources[name]
    # Options nobody set keep their defaults.
    assert sources["all"] == "default"


@pytest.mark.timeout(60)
def test_env_beats_default_and_cli_beats_ini_without_the_middle_layer(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    write_ini(pytester, {"max_boxes": "3", "image": "ini/image:1", "home": str(tmp_path / "ini-home")})
    monkeypatch.setenv("PYTEST_BOXLITE_NETWORK", "on")
    monkeypatch.setenv("PYTEST_BOXLITE_IDLE_TIMEOUT", "7")
    shown = run_show(pytester, "--boxlite-max-boxes=6", "--boxlite-timeout", "9", session=False)
    values, sources = shown["values"], shown["sources"]
    assert (values["max_boxes"], sources["max_boxes"]) == (6, "command line --boxlite-max-boxes")
    assert (values["image"], sources["image"]) == ("ini/image:1", "ini boxlite_image")
    assert (values["network"], sources["network"]) == (True, "env PYTEST_BOXLITE_NETWORK")
    assert (values["idle_timeout"], sources["idle_timeout"]) == (7.0, "env PYTEST_BOXLITE_IDLE_TIMEOUT")
    assert (values["timeout"], sources["timeout"]) == (9.0, "command line --boxlite-timeout")
    assert sources["runtime"] == "default"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layer", ["ini", "env", "cli"])
def test_the_older_name_replicas_still_sets_max_boxes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, layer: str
) -> None:
    """--boxlite-replicas (and boxlite_replicas, PYTEST_BOXLITE_REPLICAS) is the older name of
    --boxlite-max-boxes: suites written against it keep working; the new name wins at one level."""
    write_ini(pytester, {"home": str(tmp_path / "h"), **({"replicas": "3"} if layer == "ini" else {})})
    if layer == "env":
        monkeypatch.setenv("PYTEST_BOXLITE_REPLICAS", "4")
    args = ["--boxlite-replicas=5"] if layer == "cli" else []
    shown = run_show(pytester, *args, session=False)
    expected = {"ini": (3, "ini boxlite_replicas"), "env": (4, "env PYTEST_BOXLITE_REPLICAS")}
    got = (shown["values"]["max_boxes"], shown["sources"]["max_boxes"])
    assert got == expected.get(layer, (5, "command line --boxlite-replicas"))
    # Both names at one level: the new one is read.
    if layer == "env":
        monkeypatch.setenv("PYTEST_BOXLITE_MAX_BOXES", "6")
        shown = run_show(pytester, session=False)
        assert (shown["values"]["max_boxes"], shown["sources"]["max_boxes"]) == (6, "env PYTEST_BOXLITE_MAX_BOXES")


def test_a_bad_value_under_the_older_name_names_it(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_BOXLITE_REPLICAS", "0")
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("--boxlite", *QUIET)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--boxlite-max-boxes: bad value '0' from environment variable PYTEST_BOXLITE_REPLICAS*"]
    )


@pytest.mark.timeout(60)
def test_runtime_namespace_is_used_when_asked(pytester: pytest.Pytester, tmp_path: Path) -> None:
    shown = run_show(pytester, "--boxlite-runtime=namespace", f"--boxlite-home={tmp_path / 'h'}")
    assert shown["runtime"] == "namespace"


# -- bad values ----------------------------------------------------------------

# (option name, bad raw value, expected reason fragment); each is tried from every source that can express it.
BAD_VALUES = [
    ("max_boxes", "0", "must be at least 1"),
    ("max_boxes", "many", "must be a number"),
    ("image", " ", "must not be empty"),
    ("network", "maybe", "must be one of: on, off"),
    ("runtime", "docker", "must be one of: auto, vm, namespace"),
    ("idle_timeout", "-1", "must be a number of seconds >= 0"),
    ("idle_timeout", "inf", "must be a number of seconds >= 0"),
    ("timeout", "0", "must be a number of seconds > 0"),
    ("timeout", "nan", "must be a number of seconds > 0"),
    ("cpus", "two", "must be a number"),
    ("memory", "10", "must be at least 64"),
    ("keep", "perhaps", "must be one of 1/0, true/false"),
    ("scope", "class", "must be one of: test, module"),
    ("fresh", "clone", "must be one of: fork, boot"),
    ("lease_timeout", "-5", "must be a number of seconds > 0"),
]
SOURCES = ["ini", "env", "cli"]


def _bad_cases() -> list[Any]:
    cases = []
    for name, raw, reason in BAD_VALUES:
        for source in SOURCES:
            if name == "keep" and source == "cli":
                continue  # a flag on the command line: it has no value to get wrong
            if source == "ini" and not raw.strip():
                continue  # an empty ini value means "not set"
            cases.append(pytest.param(name, raw, reason, source, id=f"{name}={raw.strip() or 'blank'}-{source}"))
    return cases


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "raw", "reason", "source"), _bad_cases())
def test_bad_value_is_a_usage_error_naming_source_and_option(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, name: str, raw: str, reason: str, source: str
) -> None:
    flag = "--boxlite-" + name.replace("_", "-")
    env = "PYTEST_BOXLITE_" + name.upper()
    args: list[str] = []
    if source == "ini":
        write_ini(pytester, {name: raw})
        where = f"ini key boxlite_{name}"
    elif source == "env":
        monkeypatch.setenv(env, raw)
        where = f"environment variable {env}"
    else:
        args.append(f"{flag}={raw}")
        where = f"the command line ({flag})"
    pytester.makepyfile("def test_never_runs():\n    raise AssertionError('must not run')\n")
    result = pytester.runpytest(*QUIET, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = "\n".join(result.errlines)
    assert f"{flag}: bad value {raw!r} from {where}" in err, err
    assert reason in err, err
    assert "must not run" not in "\n".join(result.outlines)


@pytest.mark.timeout(60)
def test_empty_home_on_the_command_line_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest(*QUIET, "--boxlite-home=")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--boxlite-home: bad value '' from the command line (--boxlite-home): must not be empty*"]
    )


@pytest.mark.timeout(60)
def test_unwritable_home_from_the_command_line_is_a_usage_error(pytester: pytest.Pytester, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("a file, not a directory")
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest(*QUIET, f"--boxlite-home={not_a_dir / 'home'}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--boxlite-home*is not usable*"])


@pytest.mark.timeout(60)
def test_runtime_vm_where_no_vm_boots_fails_fast_with_the_reason(pytester: pytest.Pytester, tmp_path: Path) -> None:
    p = probe()
    if p.vm_ok:
        pytest.skip("a micro-VM can boot here: runtime=vm is valid")
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest(*QUIET, "--boxlite-runtime=vm", f"--boxlite-home={tmp_path / 'h'}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = "\n".join(result.errlines)
    assert err.count("cannot boot") == 1, err  # said once, not twice
    assert p.reason in err
    assert "--boxlite-url" in err and "--boxlite-runtime=auto" in err, err  # the ways forward


# -- the plugin as a whole -------------------------------------------------------


@pytest.mark.timeout(60)
def test_p_no_boxlite_disables_the_plugin_cleanly(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_plain():
            pass

        def test_boxed(boxlite_sandbox):
            pass
        """
    )
    result = pytester.runpytest("-p", "no:boxlite", *QUIET)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*fixture 'boxlite_sandbox' not found*"])
    assert not any(line.startswith("boxlite:") for line in result.outlines)
    assert not any("- boxlite -" in line for line in result.outlines)


@pytest.mark.timeout(60)
def test_plugin_is_active_by_default(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """The counterpart of the test above: without ``-p no:boxlite`` the header is there."""
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest(*QUIET, f"--boxlite-home={tmp_path / 'h'}")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["boxlite: runtime=*", "boxlite: image=* max-boxes=2 *"])


@pytest.mark.timeout(60)
def test_fixtures_listing_shows_the_docstrings(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest("--fixtures", *QUIET, f"--boxlite-home={tmp_path / 'h'}")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "boxlite_module_sandbox*module scope*",
            "*One box shared by every test of a module*",
        ],
        consecutive=True,
    )
    result.stdout.fnmatch_lines(
        ["boxlite_pool*session scope*", "*Session-wide access to the warm pool of boxes.*"], consecutive=True
    )
    result.stdout.fnmatch_lines(["boxlite_sandbox*", "*A pristine box for this test*"], consecutive=True)


# -- the run's own image, and pytest --help ------------------------------------------------------

IMAGE_TESTS = """
import pytest


def test_sandbox(boxlite_sandbox):
    assert boxlite_sandbox.run(["true"]).ok


@pytest.mark.boxlite
def test_marked_without_image():
    pass


def test_plain():
    pass
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", [(), ("--boxlite",), ("-n", "2")], ids=["plain", "boxlite", "n2"])
@pytest.mark.parametrize("source", ["cli", "env", "ini"])
def test_an_unusable_run_image_is_one_usage_error_at_the_start(
    tmp_path: Path, source: str, mode: tuple[str, ...]
) -> None:
    """``--boxlite-image=oci-archive:/nonexistent.tar`` (or its ini key or variable): one usage error
    before any box, naming the option and where the value came from; never the marker of a test
    that names no image, no traceback per test."""
    import subprocess

    from subruns import pytest_argv, sub_env

    bad = "oci-archive:/nonexistent.tar"
    (tmp_path / "conftest.py").write_text(BOX_SPY_CONFTEST)
    (tmp_path / "test_image.py").write_text(IMAGE_TESTS)
    spy = tmp_path / "boxes-made"
    env = sub_env(BOX_SPY=str(spy))
    args = ["--boxlite-runtime=namespace", *mode, "test_image.py"]
    where = {
        "cli": "the command line",
        "env": "the environment variable PYTEST_BOXLITE_IMAGE",
        "ini": "the ini key boxlite_image",
    }
    if source == "cli":
        args.insert(0, f"--boxlite-image={bad}")
    elif source == "env":
        env["PYTEST_BOXLITE_IMAGE"] = bad
    else:
        (tmp_path / "pytest.ini").write_text(f"[pytest]\nboxlite_image = {bad}\n")
    home = tmp_path / "bxh"
    proc = subprocess.run(
        pytest_argv(home, *args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert (
        f"--boxlite-image (from {where[source]}): image {bad!r} cannot be used: archive /nonexistent.tar does not exist"
        in out
    ), out
    assert "@pytest.mark.boxlite" not in out and "Traceback" not in out and "passed" not in out, out
    assert out.count("cannot be used") == 1, out
    assert len(out.splitlines()) < 15, out
    assert not spy.exists(), f"boxes were made: {spy.read_text()}"


def test_help_lists_boxlite_first_with_defaults_and_typed_ini_keys(pytester: pytest.Pytester) -> None:
    """``pytest --help``: ``--boxlite`` heads the plugin's group, the counts and timeouts show their
    defaults, the image's help says what boxes see without one, the ini keys have their types."""
    result = pytester.runpytest_subprocess("--help", *QUIET)
    assert result.ret == 0
    out = result.stdout.str()
    group = out.split("run tests inside throw-away boxes (pytest-boxlite):", 1)[1]
    flags = [ln.split()[0].split("=")[0] for ln in group.splitlines() if ln.startswith("  --boxlite")]
    assert flags[0] == "--boxlite", flags
    text = " ".join(group.split())
    for flag, default in (
        ("--boxlite-max-boxes=N, --boxlite-replicas=N", "2"),
        ("--boxlite-timeout=SECONDS", "300"),
        ("--boxlite-idle-timeout=SECONDS", "600"),
        ("--boxlite-boot-timeout=SECONDS", "120"),
        ("--boxlite-lease-timeout=SECONDS", "300"),
    ):
        entry = text.split(flag, 1)[1].split("--boxlite", 1)[0]
        assert f"(default: {default})" in entry, (flag, entry)
    image = text.split("--boxlite-image=IMAGE", 1)[1].split("--boxlite", 1)[0]
    assert "host's own files" in image, image
    ini = " ".join(out.split("[pytest] configuration options", 1)[1].split())
    for key, kind in (("boxlite_all", "bool"), ("boxlite_keep", "bool"), ("boxlite_env_deny", "linelist")):
        assert f"{key} ({kind})" in ini, (key, ini[:3000])
    assert "boxlite_max_boxes (string)" in ini and "boxlite_replicas (string)" in ini
