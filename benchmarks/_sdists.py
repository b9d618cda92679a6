"""Real projects' own test suites: their pinned sdists from the package index, unpacked, each in a
virtual environment of the benchmarks' own (cached between runs)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import tarfile
from pathlib import Path

from benchmarks._bench import ROOT, Skipped, log, step

#: Outside any checkout (a project without pytest configuration of its own would otherwise take
#: this repository's pyproject.toml as its rootdir's) and outside /tmp (which boxes do not see).
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pytest-boxlite-benchmarks"
DOWNLOAD_TIMEOUT = 300.0
INSTALL_TIMEOUT = 900.0
#: What each kind of environment adds to the project and its test dependencies.
FLAVOURS: dict[str, tuple[str, ...]] = {
    # This checkout of pytest-boxlite, editable (new plugin code shows at once), and xdist.
    "boxlite": ("pytest-xdist>=3.6", "-e", str(ROOT)),
    # pytest-forked, which fails every test under pytest 9.
    "pytest8": ("pytest>=8,<9", "pytest-forked"),
}


@dataclasses.dataclass(frozen=True)
class Project:
    """A pinned sdist whose own test suite is run, and what that suite needs."""

    name: str
    version: str
    #: Test-only requirements (the suite's dependency group / tox deps).
    deps: tuple[str, ...] = ()
    #: Arguments after ``python -m pytest`` (paths, deselections) for a run that is green plain here.
    args: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"


def _safe_extract(archive: Path, dest: Path) -> Path:
    """Unpack an sdist, leaving out members that would land outside ``dest`` or are links/devices."""
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            target = (dest / m.name).resolve()
            if not target.is_relative_to(dest.resolve()) or not (m.isfile() or m.isdir()):
                continue
            members.append(m)
        if hasattr(tarfile, "data_filter"):  # drops owners and modes a tarball should not impose
            tar.extractall(dest, members=members, filter="data")
        else:
            tar.extractall(dest, members=members)
    tops = {Path(m.name).parts[0] for m in members}
    if len(tops) != 1:
        raise Skipped(f"{archive.name}: expected one top-level directory, got {sorted(tops)}")
    return dest / tops.pop()


def _sdist(project: Project, cache: Path) -> Path:
    sdists = cache / "sdists"
    sdists.mkdir(parents=True, exist_ok=True)
    norm = re.sub(r"[-_.]+", "[-_.]", project.name)

    def found() -> list[Path]:
        pattern = rf"(?i){norm}-{re.escape(project.version)}\.tar\.gz"
        return [p for p in sdists.iterdir() if re.fullmatch(pattern, p.name)]

    if not found():
        log(f"[{project.key}] downloading the sdist")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        step(f"{project.key}: pip download", [*cmd, f"{project.name}=={project.version}", "-d", str(sdists)], cache,
             DOWNLOAD_TIMEOUT)  # fmt: skip
        if not found():
            raise Skipped(f"{project.key}: pip download produced no .tar.gz sdist in {sdists}")
    return found()[0]


def source(project: Project, cache: Path) -> Path:
    """The unpacked sdist (downloaded and unpacked once)."""
    src_root = cache / "src" / project.key
    ready = src_root / ".ready"
    if ready.exists():
        (src,) = [p for p in src_root.iterdir() if p.is_dir()]
        return src
    archive = _sdist(project, cache)
    shutil.rmtree(src_root, ignore_errors=True)
    src_root.mkdir(parents=True)
    src = _safe_extract(archive, src_root)
    ready.write_text("")
    return src


def venv(project: Project, cache: Path, flavour: str) -> Path:
    """The python of ``project``'s environment of ``flavour`` (see :data:`FLAVOURS`), made once."""
    src = source(project, cache)
    extra = FLAVOURS[flavour]
    path = cache / "venvs" / f"{project.key}-{flavour}"
    py = path / "bin" / "python"
    marker = path / ".ready"
    fingerprint = json.dumps([project.name, project.version, list(project.deps), list(extra)])
    if marker.exists() and marker.read_text() == fingerprint:
        return py
    log(f"[{project.key}] making its {flavour} environment (the project, its test deps, {' '.join(extra)})")
    shutil.rmtree(path, ignore_errors=True)
    step(f"{project.key}: venv", [sys.executable, "-m", "venv", str(path)], cache, 120)
    step(f"{project.key}: pip install", [str(py), "-m", "pip", "install", "-q", str(src), *project.deps, *extra],
         cache, INSTALL_TIMEOUT)  # fmt: skip
    marker.write_text(fingerprint)
    return py
