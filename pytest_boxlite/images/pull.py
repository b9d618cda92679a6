"""Registry references: pulled by a maintained client into an OCI layout, then read like a local one.

``skopeo`` (Debian's package) is used where it is on ``PATH``: ``skopeo copy docker://REF oci:DIR:TAG``,
for this machine's platform.  Without it, registry images cannot be pulled for namespace boxes
(the boxlite SDK's puller keeps images in its own home for its micro-VMs and exposes no layout to
read them from); the error says how to bring the image in as a local archive instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from pytest_boxlite.images.layout import host_platform
from pytest_boxlite.images.reference import ImageError, Reference

__all__ = ["PULL_TAG", "pull"]

PULL_TAG = "pulled"
_MAX_ERR = 4000


def _offline_hint(ref: Reference) -> str:
    return (
        f"bring it in as a local archive instead: on a machine with a registry, run "
        f"'skopeo copy docker://{ref.registry_ref()} oci-archive:IMAGE.tar' "
        f"(or 'docker save -o IMAGE.tar {ref.registry_ref()}') "
        f"and use image='oci-archive:/path/IMAGE.tar' (or 'docker-archive:/path/IMAGE.tar')"
    )


def pull(ref: Reference, work: Path, *, timeout: float) -> Path:
    """Pull registry image ``ref`` into an OCI layout under ``work``; return the layout's directory."""
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        raise ImageError(
            f"image {ref.original!r}: no registry client is available to pull it (skopeo is not installed; "
            f"'apt-get install skopeo' provides one); or {_offline_hint(ref)}"
        )
    dest = work / "pulled"
    _os, arch = host_platform()
    argv = [
        skopeo,
        "--override-os",
        "linux",
        "--override-arch",
        arch,
        "copy",
        "--quiet",
        f"docker://{ref.registry_ref()}",
        f"oci:{dest}:{PULL_TAG}",
    ]
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
            env={**os.environ, "LC_ALL": "C"},
        )
    except subprocess.TimeoutExpired:
        raise ImageError(
            f"image {ref.original!r}: pulling it did not finish within {timeout:.0f} s; or {_offline_hint(ref)}"
        ) from None
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip()[-_MAX_ERR:]
        raise ImageError(
            f"image {ref.original!r}: the registry could not be reached or has no such image: "
            f"skopeo said: {err}; or {_offline_hint(ref)}"
        )
    return dest
