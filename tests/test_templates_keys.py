"""``--boxlite-setup`` templates keyed by everything the setup can depend on, kept where the setup
wrote (a virtual environment under /tmp too), and removable by their owner (issue 23, item 7).

The sub-runs share one boxlite home, as every project of a user shares the default one.  They run
as whoever runs this file (CI runs it as root and as an ordinary user).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from subruns import QUIET, sub_env

from pytest_boxlite import templates
from pytest_boxlite.runtimes.namespace import provision
from pytest_boxlite.spec import BoxSpec

pytestmark = pytest.mark.timeout(300)

#: The same command in every project, naming no file: only the key's other parts tell them apart.
SAME_SETUP = "sh -c 'cat marker > provisioned.txt'"

PROJECT_TEST = """
import pytest

@pytest.mark.boxlite
def test_sees_its_own_setup():
    with open("provisioned.txt") as fh:
        assert fh.read() == {marker!r}
"""


def _run(python: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, "-m", "pytest", *QUIET, "-p", "no:randomly", *args],
        cwd=cwd,
        env=sub_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest_boxlite", "--home", str(home), *args],
        env=sub_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _project(root: Path, marker: str) -> Path:
    root.mkdir(parents=True)
    (root / "marker").write_text(marker)
    (root / "test_setup.py").write_text(PROJECT_TEST.format(marker=marker))
    return root


def _template_lines(home: Path) -> list[str]:
    ls = _cli(home, "ls")
    assert ls.returncode == 0, ls.stdout + ls.stderr
    return [line for line in ls.stdout.splitlines() if line.startswith("template ")]


def test_two_projects_with_the_same_setup_get_their_own_templates(tmp_path: Path) -> None:
    home = tmp_path / "bxh"
    a = _project(tmp_path / "a", "from project a\n")
    b = _project(tmp_path / "b", "from project b\n")
    for project in (a, b):
        run = _run(sys.executable, project, f"--boxlite-home={home}", "--boxlite-setup", SAME_SETUP)
        assert run.returncode == 0, run.stdout + run.stderr
    lines = _template_lines(home)
    assert len(lines) == 2, lines
    assert any(f"cwd={a}" in line for line in lines) and any(f"cwd={b}" in line for line in lines), lines
    # The setup's writes reached no host file.
    assert not (a / "provisioned.txt").exists() and not (b / "provisioned.txt").exists()


def _venv_under(root: Path) -> str:
    """A virtual environment under /tmp (``root``) that sees this interpreter's packages (pytest,
    pytest-boxlite) through a ``.pth`` file, whatever this interpreter is (a venv or not)."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *sys.path[1:]}
    Path(purelib, "outer.pth").write_text("\n".join(p for p in sorted(ours) if p and os.path.isdir(p)) + "\n")
    return python


def test_a_setup_that_installs_into_a_venv_under_tmp_keeps_its_work(tmp_path: Path) -> None:
    """``mytool: not found``: the setup wrote into the virtual environment (under the host's /tmp,
    mirrored in boxes), and that write was thrown away with the template box."""
    python = _venv_under(tmp_path)
    project = tmp_path / "proj"
    project.mkdir()
    (project / "setup.sh").write_text(
        textwrap.dedent(
            """\
            bindir=$(python -c 'import os, sys; print(os.path.dirname(sys.executable))')
            printf '#!/bin/sh\\necho mytool works\\n' > "$bindir/mytool"
            chmod +x "$bindir/mytool"
            """
        )
    )
    (project / "test_tool.py").write_text(
        textwrap.dedent(
            """\
            import os, subprocess, sys
            import pytest

            @pytest.mark.boxlite
            def test_the_installed_tool_runs():
                tool = os.path.join(os.path.dirname(sys.executable), "mytool")
                out = subprocess.run([tool], capture_output=True, text=True)
                assert out.stdout == "mytool works\\n", out.stderr
            """
        )
    )
    run = _run(python, project, f"--boxlite-home={tmp_path / 'bxh'}", "--boxlite-setup", "sh setup.sh")
    assert run.returncode == 0, run.stdout + run.stderr
    assert not (Path(python).parent / "mytool").exists(), "the setup's write reached the host's venv"


def test_clean_templates_removes_what_ls_lists(tmp_path: Path) -> None:
    """Every template directory goes, the overlay work directories (mode 000) and the setup's
    read-only ones included: an ordinary user's ``clean --templates`` said "dropped 0"."""
    home = tmp_path / "bxh"
    project = _project(tmp_path / "p", "x\n")
    setup = "sh -c 'mkdir -p ro/deep && touch ro/deep/f && chmod 0 ro/deep && chmod 500 ro"
    setup += " && cat marker > provisioned.txt'"
    run = _run(sys.executable, project, f"--boxlite-home={home}", "--boxlite-setup", setup)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = _template_lines(home)
    assert len(lines) == 1 and "setup=" in lines[0], lines
    key = lines[0].split()[1]
    base = provision.templates_dir(home)
    assert (base / key / "ready.json").is_file()
    clean = _cli(home, "clean", "--templates")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert f"dropped 1 template(s): {key}" in clean.stdout
    assert _template_lines(home) == []
    assert not (base / key).exists()
    assert not base.is_dir() or sorted(p.name for p in base.iterdir()) == []


def test_remove_tree_never_follows_a_link_out_of_the_tree(tmp_path: Path) -> None:
    """A template's layers are what a guest wrote: a link there to a host directory is removed, and
    the directory it points at keeps its mode and files."""
    outside = tmp_path / "host-dir"
    outside.mkdir()
    (outside / "keep.txt").write_text("host file\n")
    outside.chmod(0o500)
    tree = tmp_path / "template"
    (tree / "upper" / "locked").mkdir(parents=True)
    (tree / "upper" / "link").symlink_to(outside)
    (tree / "upper" / "locked" / "f").write_text("x")
    (tree / "upper" / "locked").chmod(0)
    try:
        provision.remove_tree(tree)
        assert not tree.exists()
        assert stat.S_IMODE(outside.stat().st_mode) == 0o500
        assert (outside / "keep.txt").read_text() == "host file\n"
    finally:
        outside.chmod(0o700)


def test_the_key_covers_what_the_setup_depends_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit layer: each input of the key on its own changes it (the interpreter's prefix and the
    plugin version are replaced for the test)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    spec = BoxSpec()
    base = templates.template_key(spec, "pip install -e .", a)
    assert templates.template_key(spec, "pip install -e .", a) == base
    assert templates.template_key(spec, "pip install -e .", b) != base, "the project's path"
    assert templates.template_key(BoxSpec(image="debian:12"), "pip install -e .", a) != base, "the image"
    assert templates.template_key(spec, "pip install .", a) != base, "the command"
    (a / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    with_manifest = templates.template_key(spec, "pip install -e .", a)
    assert with_manifest != base, "the project's manifest (named by no word of the command)"
    (a / "pyproject.toml").write_text("[project]\nname = 'y'\n")
    assert templates.template_key(spec, "pip install -e .", a) != with_manifest, "the manifest's content"
    current = templates.template_key(spec, "pip install -e .", a)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other-venv"))
    assert templates.template_key(spec, "pip install -e .", a) != current, "the virtual environment"
    monkeypatch.undo()
    monkeypatch.setattr(templates, "_plugin_version", lambda: "0.0.0-other")
    assert templates.template_key(spec, "pip install -e .", a) != current, "the plugin version"
