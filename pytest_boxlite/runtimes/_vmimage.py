"""Local images for the ``vm`` runtime: ``oci:``, ``oci-archive:`` and ``docker-archive:`` references
handed to the boxlite SDK in the form it takes.

What the SDK supports (boxlite 0.10.8; ``docs/how-to/images.md`` has the citations): a registry
reference in ``BoxOptions.image``, pulled on the host; and ``BoxOptions.rootfs_path``, a string
naming a local **OCI image layout directory** (``oci-layout``, ``index.json``, ``blobs/``), which
wins over ``image`` when it is non-empty.  At ``start`` (before anything boots) it checks that the
directory exists and has ``oci-layout``, reads ``index.json`` and takes its **first** manifest (an
image index there is resolved for the host's platform), and reads the blobs in place.  There is no
call that loads an image archive (``Boxlite.import_box`` takes a ``.boxlite`` box export, not an
image), and a tag in the layout is not looked at.

So a local image goes through the machine's image store first
(:func:`pytest_boxlite.images.ensure_image`: the transports, the checks of hostile archives, each
blob verified and stored once, shared with the namespace runtime), and the SDK gets a layout of
three entries made for that one image in ``<store>/vm-layouts/<manifest hex>``: ``oci-layout``,
an ``index.json`` listing the image's manifest alone, and ``blobs``, a link to the store's
verified blobs.  Nothing is copied; the layout appears whole (renamed in) or not at all.  A missing,
corrupt or ambiguous image is the store's :class:`~pytest_boxlite.images.ImageError` (a
:class:`~pytest_boxlite.errors.ConfigError`) naming the image and the cause, before any box exists.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

from pytest_boxlite._tidy import remove_own_dir

__all__ = ["LocalLayout", "is_local", "local_layout"]

OCI_LAYOUT = '{"imageLayoutVersion":"1.0.0"}'
#: The descriptor type the SDK accepts for an image in ``index.json`` (else "Unsupported media type").
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


@dataclasses.dataclass(frozen=True)
class LocalLayout:
    """An OCI image layout the SDK's ``rootfs_path`` can take, holding one image."""

    #: The reference as written.
    reference: str
    #: The layout directory (absolute), for ``BoxOptions.rootfs_path``.
    path: str
    #: The digest of the image's manifest, ``sha256:<hex>``.
    digest: str

    def label(self) -> str:
        """``<reference>@sha256:<12 hex>``, as headers and errors show an image."""
        algo, _, hexdigest = self.digest.partition(":")
        return f"{self.reference}@{algo}:{hexdigest[:12]}"


def is_local(ref: str) -> bool:
    """Whether ``ref`` names a local image (``oci:``, ``oci-archive:``, ``docker-archive:``)."""
    from pytest_boxlite.images.reference import is_image_reference_local

    return is_image_reference_local(ref)


def local_layout(ref: str, store: Path, *, timeout: float = 600.0) -> LocalLayout:
    """The layout for the local image ``ref``, through the image store ``store`` (see the module)."""
    from pytest_boxlite.images import ensure_image

    image = ensure_image(ref, store=store, timeout=timeout)
    hexd = image.digest.removeprefix("sha256:")
    manifest = Path(store) / "blobs" / "sha256" / hexd
    final = Path(store) / "vm-layouts" / hexd
    if not (final / "index.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
        try:
            (tmp / "oci-layout").write_text(OCI_LAYOUT)
            desc = {"mediaType": MT_MANIFEST, "digest": image.digest, "size": manifest.stat().st_size}
            (tmp / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [desc]}))
            # Relative, so the store can move; the SDK follows it to the verified blobs.
            os.symlink(os.path.join("..", "..", "blobs"), tmp / "blobs", target_is_directory=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "index.json").is_file():
                    raise
                # Another session or worker made the same layout first: theirs is the same.
        finally:
            remove_own_dir(tmp, "a staging directory of the image store")
    return LocalLayout(ref, str(final), image.digest)
