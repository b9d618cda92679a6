"""A second userland: a box of another image, built on this machine without a registry.

The image is a small OCI archive made from Debian's ``busybox-static`` (its ``/bin/busybox`` and
applets, its own ``/etc/os-release``) by the project's test-image builder,
``tests/images/build.py``.  A box of it sees that image's files and tools, not the host's: on the
namespace runtime the image's tree replaces the host's files, on the vm runtime BoxLite boots it
from a local OCI layout.  Your own images work the same way: ``oci:DIR``, ``oci-archive:PATH``
(``skopeo copy``, ``podman save --format oci-archive``), ``docker-archive:PATH`` (``docker save``),
or a registry reference such as ``alpine:3.19`` where a registry is reachable.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

BUILDER = Path(__file__).resolve().parent.parent / "tests" / "images" / "build.py"


def _builder() -> Any:
    spec = importlib.util.spec_from_file_location("boxlite_example_image_builder", BUILDER)
    if spec is None or spec.loader is None or not BUILDER.is_file():
        pytest.skip(f"the test-image builder {BUILDER} is not there (run the examples from a checkout)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def busybox_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The reference of a busybox image (an ``oci-archive:``), built once per session."""
    build = _builder()
    try:
        refs: dict[str, str] = build.test_images(tmp_path_factory.mktemp("images"))
    except build.ImagesUnavailable as exc:
        pytest.skip(f"cannot build the example image: {exc} (Debian/Ubuntu: apt-get install busybox-static)")
    return refs["busybox"]


def test_a_second_userland(boxlite_pool: Any, busybox_image: str) -> None:
    # Runs on the host (a test of boxlite_pool always does); its commands run in a box of the image.
    host_release = Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else ""
    with boxlite_pool.sandbox(image=busybox_image) as sb:
        # (cat, not sb.read_file: on vm the file API runs the image's python3, and busybox has none)
        release = sb.execute_command("cat /etc/os-release").stdout
        assert "ID=boxlite-test" in release and release != host_release
        # The image's tools: busybox answers as `sh`, and the host's package database is not there.
        result = sb.execute_command("busybox | head -n 1; ls /var/lib/dpkg 2>&1 || true")
        assert result.ok and result.stdout.startswith("BusyBox v"), result.stdout
        assert "No such file or directory" in result.stdout
        # What a box writes stays in its own layer: the image itself is unchanged for the next box.
        assert sb.execute_command("echo changed > /etc/os-release").ok
    with boxlite_pool.sandbox(image=busybox_image) as sb:
        assert "ID=boxlite-test" in sb.execute_command("cat /etc/os-release").stdout
