"""Images in sessions on the namespace runtime (issue 25, items 1 and 3): ``--boxlite-image``,
``boxlite_pool.sandbox(image=...)`` and ``@pytest.mark.boxlite(image=...)``, in real pytest
sub-runs with real boxes.

The images are the test images of ``tests/images/build.py``, made from Debian's ``busybox-static``
(no C library at all) and, for boxed tests, busybox plus the host interpreter's own loader and
libraries (``glibc``), and the broken ones; the image store of each sub-run's home unpacks them.
"""

from __future__ import annotations

import os
import re
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
from images.build import OS_RELEASE, ImagesUnavailable, shared_cache, test_images
from subruns import SubRun
from test_images_namespace import needs_busybox

from pytest_boxlite import ledger

pytestmark = [
    pytest.mark.timeout(180),
    needs_busybox,
    pytest.mark.skipif(
        not hasattr(tarfile, "data_filter"),
        reason="the image store unpacks with tarfile's extraction filters (PEP 706: Python 3.11.4+)",
    ),
]

GLIBC_RELEASE = OS_RELEASE  # the glibc image is busybox's base layer plus the libraries


class Run(SubRun):
    base_args = ("-p", "no:randomly", "--boxlite-runtime=namespace")
    wait_timeout = 150.0


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """References of the test images (tests/images/build.py): ``busybox`` (no C library, Env,
    WorkingDir), ``glibc`` (busybox plus the host interpreter's loader and libraries) and the
    broken ones."""
    try:
        return test_images(shared_cache(tmp_path_factory))
    except ImagesUnavailable as exc:
        pytest.skip(str(exc))


def write(directory: Path, name: str, source: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(textwrap.dedent(source))


def finished(run: SubRun) -> tuple[int, str]:
    rc = run.wait()
    return rc, run.output


def no_leftovers(home: Path, output: str) -> None:
    assert ledger.scan(home) == [], f"boxes left behind in {home}\n{output[-3000:]}"


SANDBOX_TESTS = """
import os

def test_default_sandbox(boxlite_sandbox):
    r = boxlite_sandbox.execute_command("cat /etc/os-release; echo $BOXLITE_TEST_IMAGE; pwd")
    assert r.stdout == {release!r} + "busybox\\n/srv/work\\n", r
    assert boxlite_sandbox.execute_command("busybox true").exit_code == 0
    assert boxlite_sandbox.execute_command("test -e /etc/debian_version").exit_code == 1
    boxlite_sandbox.execute_command("echo dirty > /etc/os-release")

def test_second_box_is_pristine(boxlite_sandbox):
    assert boxlite_sandbox.execute_command("cat /etc/os-release").stdout == {release!r}

def test_leased_with_the_image(boxlite_pool):
    for _ in range(2):
        with boxlite_pool.sandbox(image={image!r}) as sb:
            assert sb.read_file("/etc/os-release") == {release!r}
            sb.write_file("/etc/os-release", "dirty")

def test_host_files_by_default(boxlite_pool):
    # No image asked for in this call, but the session's --boxlite-image holds for it too.
    with boxlite_pool.sandbox(env={{"X": "1"}}) as sb:
        assert sb.execute_command("cat /etc/os-release").stdout == {release!r}
"""


@pytest.mark.parametrize("fresh", ["fork", "boot"])
def test_boxlite_image_gives_sandboxes_the_image(
    tmp_path: Path, home: Path, images: dict[str, str], fresh: str
) -> None:
    image = images["busybox"]
    write(tmp_path, "test_sb.py", SANDBOX_TESTS.format(release=OS_RELEASE, image=image))
    rc, out = finished(Run(tmp_path, home, "sb", f"--boxlite-image={image}", f"--boxlite-fresh={fresh}", "test_sb.py"))
    assert rc == 0, out
    assert re.search(r"\b4 passed\b", out), out
    m = re.search(r"^boxlite: image=(\S+) ", out, re.M)
    assert m is not None, out
    assert re.fullmatch(re.escape(image) + r"@sha256:[0-9a-f]{12}", m.group(1)), m.group(1)
    assert "unused" not in out and "has no effect" not in out, out
    no_leftovers(home, out)


HOST_DEFAULT_TESTS = """
import os, socket

def test_host_filesystem(boxlite_sandbox):
    assert boxlite_sandbox.read_file("/etc/os-release") == open("/etc/os-release").read()

def test_pool_image(boxlite_pool):
    with boxlite_pool.sandbox(image={image!r}) as sb:
        assert sb.execute_command("cat /etc/os-release").stdout == {release!r}
        assert sb.execute_command("test -e {exe}; echo $?").stdout == "1\\n"
"""


def test_without_an_image_boxes_show_the_host(tmp_path: Path, home: Path, images: dict[str, str]) -> None:
    source = HOST_DEFAULT_TESTS.format(
        image=images["busybox"], release=OS_RELEASE, exe=os.path.realpath(sys.executable)
    )
    write(tmp_path, "test_host.py", source)
    rc, out = finished(Run(tmp_path, home, "host", "test_host.py"))
    assert rc == 0, out
    assert re.search(r"^boxlite: image=host filesystem ", out, re.M), out
    assert re.search(r"\b2 passed\b", out) and "has no effect" not in out, out
    no_leftovers(home, out)


BOXED_TESTS = """
import os, subprocess, sys
import pytest

@pytest.mark.boxlite(image={image!r})
def test_in_the_image():
    assert open("/etc/os-release").read() == {release!r}
    assert subprocess.run(["cat", "/etc/os-release"], capture_output=True, text=True).stdout == {release!r}
    assert not os.path.exists("/etc/debian_version")
    import json, ssl  # the host's stdlib and extension modules on the image's libraries
    assert os.path.exists(__file__)

@pytest.mark.boxlite(image={image!r})
def test_second_box_of_the_image(tmp_path):
    assert open("/etc/os-release").read() == {release!r}
"""


@pytest.mark.parametrize("fresh", ["fork", "boot"])
def test_a_boxed_test_runs_in_the_image(tmp_path: Path, home: Path, images: dict[str, str], fresh: str) -> None:
    write(tmp_path, "test_boxed.py", BOXED_TESTS.format(image=images["glibc"], release=GLIBC_RELEASE))
    rc, out = finished(Run(tmp_path, home, "boxed", f"--boxlite-fresh={fresh}", "test_boxed.py"))
    assert rc == 0, out
    assert re.search(r"\b2 passed\b", out), out
    no_leftovers(home, out)


def test_boxlite_with_an_image_boxes_every_test_there(tmp_path: Path, home: Path, images: dict[str, str]) -> None:
    image = images["glibc"]
    write(tmp_path, "test_all.py", f"def test_all():\n    assert open('/etc/os-release').read() == {GLIBC_RELEASE!r}\n")
    rc, out = finished(Run(tmp_path, home, "all", "--boxlite", f"--boxlite-image={image}", "test_all.py"))
    assert rc == 0, out
    assert re.search(r"\b1 passed\b", out), out
    no_leftovers(home, out)


def test_an_image_that_cannot_run_the_interpreter(tmp_path: Path, home: Path, images: dict[str, str]) -> None:
    image = images["busybox"]
    write(
        tmp_path, "test_nolibc.py", f"import pytest\n\n@pytest.mark.boxlite(image={image!r})\ndef test_x():\n    pass\n"
    )
    rc, out = finished(Run(tmp_path, home, "nolibc", "test_nolibc.py"))
    assert rc == pytest.ExitCode.USAGE_ERROR, out
    exe = os.path.realpath(sys.executable)
    assert f"test_nolibc.py::test_x: @pytest.mark.boxlite: image {image} cannot run {exe}" in out, out
    assert "no dynamic loader /lib" in out and "glibc >= " in out, out
    assert "INTERNALERROR" not in out and "Traceback" not in out, out
    no_leftovers(home, out)
    # --boxlite with that image: the same error, before any test.
    rc, out = finished(Run(tmp_path, home, "nolibc-all", "--boxlite", f"--boxlite-image={image}", "test_nolibc.py"))
    assert rc == pytest.ExitCode.USAGE_ERROR and f"image {image} cannot run {exe}" in out, out
    no_leftovers(home, out)


BAD_POOL = """
import pytest
from pytest_boxlite.errors import ConfigError

def test_bad(boxlite_pool):
    with pytest.raises(ConfigError, match="{match}"):
        with boxlite_pool.sandbox(image={image!r}):
            pass

def test_fine(boxlite_sandbox):
    assert boxlite_sandbox.execute_command("true").exit_code == 0
"""


@pytest.mark.reliability
def test_bad_references_fail_clearly_and_leak_nothing(tmp_path: Path, home: Path, images: dict[str, str]) -> None:
    missing = tmp_path / "nowhere"
    corrupt = tmp_path / "corrupt.tar"
    corrupt.write_bytes(b"this is no tar archive" * 50)
    for tag, image in (
        ("missing", f"oci:{missing}:test"),
        ("not-a-tar", f"oci-archive:{corrupt}"),
        ("tag", images["busybox-oci"].rsplit(":", 1)[0] + ":no-such-tag"),
        ("truncated", images["truncated"]),
        ("corrupt", images["corrupt"]),
        ("other-arch", images["other-arch"]),
    ):
        # --boxlite-image, with --boxlite or not: a usage error at the session's start naming the
        # option and where the value came from (no test runs, no traceback).
        write(tmp_path, "test_one.py", "def test_one(boxlite_sandbox):\n    pass\n\ndef test_no_box():\n    pass\n")
        rc, out = finished(Run(tmp_path, home, f"bad-{tag}", f"--boxlite-image={image}", "test_one.py"))
        assert rc == pytest.ExitCode.USAGE_ERROR, out
        assert f"--boxlite-image (from the command line): image {image!r} cannot be used" in out, out
        assert "Traceback" not in out and "passed" not in out, out
        rc, out = finished(Run(tmp_path, home, f"all-{tag}", "--boxlite", f"--boxlite-image={image}", "test_one.py"))
        assert rc == pytest.ExitCode.USAGE_ERROR and f"image {image!r} cannot be used" in out, out
        # boxlite_pool.sandbox(image=...): that test fails, the others pass.
        write(
            tmp_path, "test_pool.py", BAD_POOL.format(image=image, match=re.escape(f"image {image!r} cannot be used"))
        )
        rc, out = finished(Run(tmp_path, home, f"pool-{tag}", "test_pool.py"))
        assert rc == 0 and re.search(r"\b2 passed\b", out), out
        no_leftovers(home, out)
    store = home / "image-store"
    left = [p for p in store.rglob("*") if p.name.endswith((".tmp", ".partial"))] if store.exists() else []
    assert left == []
