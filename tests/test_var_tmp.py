"""A box may write where its user may write locally (issue 44, fidelity): ``/var/tmp``.

An ordinary user's box maps only that user, so ``/var/tmp`` (sticky, world-writable, owned by
root) showed as owned by ``nobody`` and overlayfs could not copy it up to the box's layer: every
``mkdir``/``open`` there failed with EOVERFLOW ("Value too large for defined data type"), in
sandboxes and boxed tests alike, where the user writes it locally.  Real boxes, booted and forked,
and real boxed-test sub-runs; as root these held before too (a root host maps every owner).
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from pathlib import Path

import pytest
from conftest import CREATE_TIMEOUT, new_box_name
from subruns import SubRun

from pytest_boxlite.runtimes import Runtime
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not os.access("/var/tmp", os.W_OK | os.X_OK), reason="/var/tmp is not writable here"),
]


def _writable_dirs_of_others(top: str) -> list[str]:
    """The sub-directories of ``top`` this user may write locally but does not own."""
    out = []
    for e in sorted(os.scandir(top), key=lambda e: e.name):
        st = e.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode) and st.st_uid != os.getuid() and os.access(e.path, os.W_OK | os.X_OK):
            out.append(e.path)
    return out


def _leaked(dirs: list[str], name: str) -> list[str]:
    """Where a box's write of ``name`` reached the host (removed, and returned for the assertion)."""
    leaked = [d for d in dirs if os.path.lexists(f"{d}/{name}")]
    for d in leaked:
        shutil.rmtree(f"{d}/{name}", ignore_errors=True)
    return leaked


def test_a_sandbox_writes_var_tmp_as_its_user_does_locally(namespace_runtime: Runtime, namespace_mode: str) -> None:
    """In /var/tmp (and any other directory of /var its user may write), with the host's modes
    shown; each box pristine; the host's directories untouched."""
    name = f"pbx-vartmp-{uuid.uuid4().hex[:10]}"
    dirs = sorted({"/var/tmp", *_writable_dirs_of_others("/var")})
    modes = [f"{stat.S_IMODE(os.stat(d).st_mode):o}" for d in dirs]
    script = "; ".join(
        f"test -e {d}/{name} && echo seen; mkdir {d}/{name} && echo x > {d}/{name}/f && cat {d}/{name}/f" for d in dirs
    )
    try:
        for _ in range(2):
            h = namespace_runtime.create_box(BoxSpec(), new_box_name(), timeout=CREATE_TIMEOUT)
            try:
                if namespace_mode == "forked":
                    assert h.forked_from is not None, namespace_runtime.fork_fallback  # type: ignore[attr-defined]
                r = Sandbox(h).execute_command(f"{script}; stat -c %a {' '.join(dirs)}", timeout=20)
                assert (r.exit_code, r.stdout.split()) == (0, ["x"] * len(dirs) + modes), r
            finally:
                h.destroy()
    finally:
        leaked = _leaked(dirs, name)
    assert leaked == [], f"a box's write reached the host: {leaked}"


BOXED = """
import os
from pathlib import Path

import pytest

NAME = {name!r}


@pytest.mark.boxlite
@pytest.mark.parametrize("n", [1, 2])
def test_writes_var_tmp(n):
    d = Path("/var/tmp") / NAME
    assert not d.exists(), "a box saw the last box's write"
    d.mkdir()
    (d / "f").write_text("x")
    assert (d / "f").read_text() == "x"
"""


@pytest.mark.parametrize("mode", [(), ("--boxlite-fresh=boot",)], ids=["forked", "booted"])
def test_a_boxed_test_writes_var_tmp(tmp_path: Path, mode: tuple[str, ...]) -> None:
    name = f"pbx-vartmp-{uuid.uuid4().hex[:10]}"
    (tmp_path / "test_vartmp.py").write_text(BOXED.format(name=name))
    run = SubRun(tmp_path, tmp_path / "bxh", "vartmp", "-p", "no:randomly", *mode, "test_vartmp.py")
    try:
        rc = run.wait(150)
    finally:
        leaked = _leaked(["/var/tmp"], name)
    assert rc == 0, run.output
    assert "2 passed" in run.output, run.output
    assert leaked == [], f"a boxed test's write reached the host: {leaked}"
