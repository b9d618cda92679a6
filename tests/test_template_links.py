"""A template's setup plants links where the runtime mounts (issue 25's images, issue 22's rule:
the host never follows a guest's link).

``--boxlite-setup`` runs in a box of the image with the image's own ``/bin/sh``: a hostile image's
shell can replace the image config's ``WorkingDir`` (or the path a boxed test's interpreter is
bound at) with a link to ``/oldroot/...`` in the template's upper layer.  While bubblewrap sets a
later box up, ``/oldroot`` is the host's root, and ``--dir`` / a bind's mount point would be made
through that link on the host.  Each test below builds such an image (busybox, from
``tests/images/build.py``), builds the template with real boxes, starts boxes of it (booted, a
boxed test's, forked) and checks that the canary on the host was never made: as root and as an
ordinary user.  Without an image, the template's layers lie over the host's own directories: the
same setup plants links at and below every path such a box mounts or makes, and the host holds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_nonroot import USER

from pytest_boxlite.runtimes.namespace.provision import remove_tree

pytestmark = [pytest.mark.escapes, pytest.mark.timeout(300)]

MAIN = Path(__file__).resolve().parents[1]
#: An interpreter both users can run (root's own may be a pyenv build boxuser cannot reach): a
#: venv on the system Python, so a boxed test's interpreter has hops the runtime binds as files.
VENV_PY = Path("/home/boxuser/venv/bin/python")

DRIVER = r'''
import dataclasses, json, os, sys, uuid
from pathlib import Path
sys.path.insert(0, os.environ["MAIN"])
from tests.images.build import _busybox_base, layer_tar, oci_layout
from pytest_boxlite.errors import BoxStartError
from pytest_boxlite.images import ensure_image, store_dir
from pytest_boxlite.runtimes import open_runtime
from pytest_boxlite.runtimes.namespace.image import interpreter_mounts
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec, ImageRoot

work, canary_dir, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
home = work / "home"
home.mkdir(parents=True, exist_ok=True)
tag = uuid.uuid4().hex[:8]
rt = open_runtime("namespace", home, owner="tl" + tag)
out = {}


def start(spec, name, forked=False):
    """What a box of ``spec`` did: its working directory, or the error that refused it."""
    rt.allow_forked_boxes(forked)
    try:
        box = rt.create_box(spec, name, timeout=60)
    except BoxStartError as exc:
        return "refused: " + str(exc)
    try:
        r = Sandbox(box).execute_command("pwd", timeout=30)
        return "ran: rc=%s pwd=%s" % (r.exit_code, r.stdout.strip())
    finally:
        box.destroy()


try:
    if mode == "image":
        victim = interpreter_mounts()[1][-1]  # the last hop of a boxed test's interpreter: a file bind
        evil = (
            "#!/bin/busybox sh\n"
            "if [ ! -L /srv/app ]; then /bin/busybox rm -rf /srv/app; /bin/busybox ln -s /oldroot%s /srv/app; fi\n"
            "/bin/busybox mkdir -p %s; /bin/busybox rm -rf %s; /bin/busybox ln -s /oldroot%s/file %s\n"
            'exec /bin/busybox sh "$@"\n'
        ) % (canary_dir, os.path.dirname(victim), victim, canary_dir, victim)
        base = [e for e in _busybox_base() if e[0] != "bin/sh"]
        layout = work / "img"
        top = layer_tar([("srv/app", "dir", None, 0o755), ("bin/sh", "file", evil, 0o755)])
        oci_layout(layout, [layer_tar(base), top], cfg={"WorkingDir": "/srv/app/dir"})
        img = ensure_image(f"oci:{layout}", store=store_dir(home))
        root = ImageRoot(reference=f"oci:{layout}", digest=img.digest, rootfs=str(img.rootfs),
                         workdir=img.config.workdir)
        spec = BoxSpec(image=root.reference, root=root)
        tspec = rt.provision(spec, "true", key="tl" + tag, home=home, cwd=Path("/"), timeout=120, name=f"tl{tag}t")
        upper = Path(tspec.template) / "upper"
        out["planted"] = [os.readlink(p) for p in (upper / "srv/app", upper / victim.lstrip("/")) if p.is_symlink()]
        out["booted"] = start(tspec, f"tl{tag}b")
        out["forked"] = start(tspec, f"tl{tag}f", forked=True)
        out["worker"] = start(dataclasses.replace(tspec, warm=True), f"tl{tag}w")
    else:
        project = Path(sys.argv[4])
        # The host's /bin/sh runs this setup: a hostile project's (its setup.py, say) in a box on the
        # host's files.  Links everywhere the box's later set-up might make or mount something.
        targets = [project / "sub", project / "sub2" / "deep", Path("/workspace"), Path("/workspace") / "x",
                   Path.home() / ".cache" / "boxlite-link"]
        setup = "; ".join(
            f"rm -rf {t} 2>/dev/null; mkdir -p {t.parent} 2>/dev/null; ln -s /oldroot{canary_dir}/{i} {t} 2>/dev/null"
            for i, t in enumerate(targets)
        ) + "; true"
        spec = BoxSpec(mounts=(str(project),))
        tspec = rt.provision(spec, setup, key="tl" + tag, home=home, cwd=project, timeout=120, name=f"tl{tag}t")
        upper = Path(tspec.template) / "upper"
        out["planted"] = sorted(str(p.relative_to(upper)) for p in upper.rglob("*")
                                if p.is_symlink() and "oldroot" in os.readlink(p))
        out["booted"] = start(tspec, f"tl{tag}b")
        out["forked"] = start(tspec, f"tl{tag}f", forked=True)
        out["worker"] = start(dataclasses.replace(tspec, warm=True), f"tl{tag}w")
finally:
    rt.close()
print("RESULT " + json.dumps(out))
'''


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A directory under /tmp that ``boxuser`` can reach too (pytest's own is root's, mode 0700)."""
    d = Path(tempfile.mkdtemp(prefix="boxlite-tlinks-"))
    try:
        yield d
    finally:
        remove_tree(d)


def _drive(tmp_path: Path, mode: str, *, as_user: bool) -> tuple[dict[str, Any], Path]:
    """Run the driver (root, or ``boxuser``) in ``tmp_path``; ``(its result, the canary directory)``."""
    if not VENV_PY.exists():
        pytest.skip(f"{VENV_PY} (the ordinary user's venv, made by .ci/run) is missing")
    work = tmp_path / "w"
    canary = tmp_path / "canary"  # the host directory the planted links lead into
    project = tmp_path / "proj"
    for d in (work, canary, project / "sub", project / "sub2"):
        d.mkdir(parents=True)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "MAIN": str(MAIN), "PYTHONPATH": str(MAIN)}
    argv = [str(VENV_PY), "-B", str(driver), str(work), str(canary), mode, str(project)]
    if as_user:
        for p in [tmp_path, *tmp_path.rglob("*")]:
            os.chown(p, *_ids())
        env["HOME"] = f"/home/{USER}"
        argv = [
            shutil.which("runuser") or "runuser",
            "-u",
            USER,
            "--",
            "/usr/bin/env",
            "-i",
            *(f"{k}={v}" for k, v in env.items()),
            *argv,
        ]
    else:
        env["HOME"] = "/root"
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    print(proc.stdout[-2000:])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"driver failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return json.loads(lines[-1][len("RESULT ") :]), canary


def _ids() -> tuple[int, int]:
    import pwd

    pw = pwd.getpwnam(USER)
    return pw.pw_uid, pw.pw_gid


def _user_skip() -> str | None:
    """Why the driver cannot run as ``boxuser`` here (it runs :data:`VENV_PY`, not this interpreter)."""
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        return "needs root and runuser to run the driver as another user"
    try:
        probe = subprocess.run(
            ["runuser", "-u", USER, "--", str(VENV_PY), "-c", "pass"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{USER} cannot run {VENV_PY}: {exc}"
    return None if probe.returncode == 0 else f"{USER} cannot run {VENV_PY}: {probe.stderr.strip()[-300:]}"


def _users() -> list[object]:
    why = _user_skip()
    return [
        pytest.param(False, id="root", marks=pytest.mark.skipif(os.geteuid() != 0, reason="needs root")),
        pytest.param(True, id=USER, marks=pytest.mark.skipif(why is not None, reason=str(why))),
    ]


@pytest.mark.parametrize("as_user", _users())
@pytest.mark.escape_row("hostile-image")
def test_links_an_images_shell_plants_in_a_template_are_never_followed(scratch: Path, as_user: bool) -> None:
    result, canary = _drive(scratch, "image", as_user=as_user)
    # The attack happened: the image's shell left both links in the template's layer.
    assert len(result["planted"]) == 2 and all(t.startswith("/oldroot") for t in result["planted"]), result
    # Nothing was made on the host through them, by any box of the template.
    assert sorted(os.listdir(canary)) == [], (sorted(os.listdir(canary)), result)
    # The image's WorkingDir lies through the link: those boxes start in /workspace instead.
    for kind in ("booted", "forked"):
        assert result[kind] == "ran: rc=0 pwd=/workspace", result
    # A boxed test's interpreter cannot be bound through the link: its box is refused, saying why.
    assert str(result["worker"]).startswith("refused: "), result
    assert "is a link in the image or its template's layer (or not a directory there)" in str(result["worker"]), result
    assert "clean --templates" in str(result["worker"]), result


@pytest.mark.parametrize("as_user", _users())
@pytest.mark.escape_row("hostile-image")
def test_links_a_setup_plants_over_the_hosts_files_are_never_followed(scratch: Path, as_user: bool) -> None:
    result, canary = _drive(scratch, "host", as_user=as_user)
    assert any(p.endswith("proj/sub") for p in result["planted"]), result  # the setup did plant links
    assert sorted(os.listdir(canary)) == [], (sorted(os.listdir(canary)), result)
    for kind in ("booted", "forked", "worker"):
        # Each box either runs (in /workspace) or is refused (a link where its interpreter is): the
        # host is unchanged either way, checked above.
        assert str(result[kind]).startswith(("ran: rc=0 pwd=/workspace", "refused: ")), result
