"""A service declared with ``image=`` and no ``argv`` runs its image's ``Entrypoint`` + ``Cmd``
(issue 25 item 1: the image's config is honoured where it applies, services included), in the
image's userland, with its ``Env`` and ``WorkingDir``.

Real sub-runs on the namespace runtime with an OCI layout built here from Debian's busybox-static
(tests/images/build.py's layer writer; no registry): busybox's ``httpd`` serves a page of the
image's, reached from the host through the published port.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from images.build import BUSYBOX, _busybox_base, layer_tar, oci_layout
from subruns import QUIET, sub_env

from pytest_boxlite import ledger
from pytest_boxlite.errors import ConfigError
from pytest_boxlite.services import service

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not BUSYBOX.is_file(), reason=f"{BUSYBOX} missing: apt-get install busybox-static"),
]

PAGE = "served from the image's own /srv/work\n"


def _image(root: Path, cfg: dict[str, object]) -> str:
    files = [("srv/work/index.html", "file", PAGE, 0o644)]
    oci_layout(root, [layer_tar(_busybox_base()), layer_tar(files)], cfg=cfg)
    return f"oci:{root}:latest"


def _run(root: Path, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pytest", *QUIET, "-p", "no:randomly", f"--boxlite-home={home}", "-rA", *args]
    return subprocess.run(cmd, cwd=root, env=sub_env(), capture_output=True, text=True, timeout=200, check=False)


def test_a_service_without_argv_runs_its_images_entrypoint_and_cmd(tmp_path: Path, home: Path) -> None:
    ref = _image(
        tmp_path / "web-image",
        {
            "Env": ["PATH=/bin:/sbin", "GREETING=from-the-image-env"],
            "WorkingDir": "/srv/work",
            "Entrypoint": ["/bin/sh", "-c"],
            # The shell shows the image's Env and WorkingDir took effect, then busybox httpd serves.
            "Cmd": ['echo "start $GREETING in $(pwd)"; exec /bin/busybox httpd -f -v -p 127.0.0.1:8080 -h .'],
        },
    )
    empty = _image(tmp_path / "empty-image", {"Env": ["PATH=/bin"]})
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(f"""
        from pytest_boxlite import service, OutputReady, PortReady

        web = service(
            "web", image={ref!r}, ports=[8080], ready=[OutputReady("start (\\\\S+) in (\\\\S+)"), PortReady(8080)]
        )
        nothing = service("nothing", image={empty!r}, ports=[8080])
        """)
    )
    (tmp_path / "test_web.py").write_text(
        textwrap.dedent("""
        import urllib.request

        def test_page(web):
            with urllib.request.urlopen(web.url(path="/index.html"), timeout=30) as r:
                assert r.read().decode() == "served from the image's own /srv/work\\n"
            assert "start from-the-image-env in /srv/work" in web.logs()

        def test_no_command(nothing):
            pass
        """)
    )
    res = _run(tmp_path, home)
    out = res.stdout + res.stderr
    assert "1 passed, 1 error" in out, out
    assert "PASSED test_web.py::test_page" in out, out
    err = out.split("ERROR at setup of test_no_command", 1)[1]
    assert "has neither Entrypoint nor Cmd: give the service an argv" in err, err
    assert [r for r in ledger.scan(home) if r.running] == []


def test_a_service_needs_argv_or_an_image() -> None:
    with pytest.raises(ConfigError, match=r"give argv .* or image= naming an image"):
        service("nothing_to_run")
