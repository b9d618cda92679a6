"""OCI images for boxes: references, the per-user image store, and a hostile-safe unpacker.

``ensure_image(ref, store=store_dir(home))`` returns an :class:`Image` whose ``rootfs`` is the
complete unpacked tree of the image ``ref`` names (``oci:DIR[:TAG]``, ``oci-archive:PATH[:TAG]``,
``docker-archive:PATH[:REF]``, or a registry reference pulled with skopeo where installed).
"""

from __future__ import annotations

from pytest_boxlite.images.layout import host_platform
from pytest_boxlite.images.reference import (
    LOCAL_TRANSPORTS,
    ImageError,
    Reference,
    is_image_reference_local,
    parse_reference,
)
from pytest_boxlite.images.store import (
    STORE_NAME,
    Bounds,
    Image,
    ImageConfig,
    StoredImage,
    drop_images,
    ensure_image,
    list_images,
    parse_config,
    release_images,
    store_dir,
    store_usage,
)
from pytest_boxlite.images.unpack import DEFAULT_MAX_UNPACKED

__all__ = [
    "DEFAULT_MAX_UNPACKED",
    "LOCAL_TRANSPORTS",
    "STORE_NAME",
    "Bounds",
    "Image",
    "ImageConfig",
    "ImageError",
    "Reference",
    "StoredImage",
    "drop_images",
    "ensure_image",
    "host_platform",
    "is_image_reference_local",
    "list_images",
    "parse_config",
    "parse_reference",
    "release_images",
    "store_dir",
    "store_usage",
]
