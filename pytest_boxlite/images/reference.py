"""Image references in the containers ecosystem's transport syntax (skopeo, podman, buildah).

``oci:DIR[:TAG]``, ``oci-archive:PATH[:TAG]``, ``docker-archive:PATH[:REF]`` name local images;
``docker://REF`` or a bare ``NAME[:TAG][@DIGEST]`` (``alpine:3.19``, ``ghcr.io/org/img:1``) name a
registry's.  A prefix is a transport only if it is one of those names, so ``alpine:3.19`` is a
registry reference, as containers/image reads it.
"""

from __future__ import annotations

import dataclasses
import re

from pytest_boxlite.errors import ConfigError

__all__ = ["LOCAL_TRANSPORTS", "ImageError", "Reference", "is_image_reference_local", "parse_reference"]

LOCAL_TRANSPORTS = ("oci", "oci-archive", "docker-archive")
_MAX_REFERENCE = 4096
# The distribution reference grammar (docker/distribution reference/regexp.go), simplified to
# what matters here: lower-case path components, an optional registry host[:port], a tag, a digest.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?"
_NAME_RE = re.compile(rf"^(?:({_HOST})/)?({_COMPONENT}(?:/{_COMPONENT})*)$")
_TAG_RE = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


class ImageError(ConfigError):
    """An image cannot be used; the message names the image, the cause and how to fix it."""


@dataclasses.dataclass(frozen=True)
class Reference:
    """A parsed image reference.

    ``transport`` is ``oci``, ``oci-archive``, ``docker-archive`` or ``docker`` (a registry).
    Local transports set ``path`` (and ``tag``, the ``:TAG``/``:REF`` suffix, if given); a registry
    reference sets ``name`` (normalised: ``docker.io/library/alpine``), ``tag`` and/or ``digest``.
    """

    original: str
    transport: str
    path: str | None = None
    tag: str | None = None
    name: str | None = None
    digest: str | None = None

    @property
    def local(self) -> bool:
        """Whether the image is read from this machine's files (no registry involved)."""
        return self.transport in LOCAL_TRANSPORTS

    def registry_ref(self) -> str:
        """``NAME:TAG`` / ``NAME@DIGEST``, what a registry client is given (registry references only)."""
        assert self.name is not None
        if self.digest:
            return f"{self.name}@{self.digest}"
        return f"{self.name}:{self.tag or 'latest'}"

    def __str__(self) -> str:
        return self.original


def is_image_reference_local(ref: str) -> bool:
    """Whether ``ref`` names a local image (``oci:``, ``oci-archive:``, ``docker-archive:``)."""
    transport, sep, _ = ref.partition(":")
    return bool(sep) and transport in LOCAL_TRANSPORTS


def _split_path_tag(rest: str) -> tuple[str, str | None]:
    # containers/image: the path ends at the last ':' when what follows names no directory.
    path, sep, tag = rest.rpartition(":")
    if sep and path and "/" not in tag:
        return path, tag or None
    return rest, None


def parse_reference(ref: str) -> Reference:
    """Parse ``ref``; raise :class:`ImageError` saying what is wrong with it and what is expected."""
    if not isinstance(ref, str) or not ref.strip():
        raise ImageError(
            f"image reference {ref!r} is empty: name an image, e.g. 'oci-archive:/path/img.tar' or 'alpine:3.19'"
        )
    if len(ref) > _MAX_REFERENCE or any(ord(c) < 0x20 or c == "\x7f" for c in ref):
        raise ImageError(f"image reference {ref[:80]!r} is malformed (too long or has control characters)")
    transport, sep, rest = ref.partition(":")
    if sep and transport in LOCAL_TRANSPORTS:
        if not rest:
            raise ImageError(f"image reference {ref!r} names no path: write {transport}:PATH[:TAG]")
        if transport == "docker-archive":
            # docker-archive:PATH[:NAME:TAG]: the reference after the path has colons of its own.
            path, _, dtag = rest.partition(":")
            tag = dtag or None
        else:
            path, tag = _split_path_tag(rest)
        if tag is not None and transport != "docker-archive" and not _TAG_RE.match(tag):
            raise ImageError(f"image reference {ref!r}: {tag!r} is not a valid tag")
        return Reference(ref, transport, path=path, tag=tag)
    body = ref
    if ref.startswith("docker://"):
        body = ref[len("docker://") :]
    elif sep and "/" not in transport and "." not in transport and not rest[:1].isalnum():
        raise ImageError(
            f"image reference {ref!r}: unknown transport {transport!r} "
            "(known: oci:DIR[:TAG], oci-archive:PATH[:TAG], docker-archive:PATH, docker://NAME[:TAG], NAME[:TAG])"
        )
    return _parse_registry(ref, body)


def _parse_registry(ref: str, body: str) -> Reference:
    digest: str | None = None
    if "@" in body:
        body, _, digest = body.partition("@")
        if not _DIGEST_RE.match(digest):
            raise ImageError(f"image reference {ref!r}: {digest!r} is not a sha256 digest (sha256:<64 hex digits>)")
    tag: str | None = None
    last = body.rsplit("/", 1)[-1]
    if ":" in last:
        body, _, tag = body.rpartition(":")
        if not _TAG_RE.match(tag):
            raise ImageError(f"image reference {ref!r}: {tag!r} is not a valid tag")
    m = _NAME_RE.match(body)
    if not m:
        raise ImageError(
            f"image reference {ref!r} is neither a local image (oci:DIR, oci-archive:PATH, docker-archive:PATH) "
            "nor a registry name (lower-case NAME[:TAG], e.g. alpine:3.19 or ghcr.io/org/img:1)"
        )
    host, path = m.group(1), m.group(2)
    # A first component is a registry host only if it looks like one (docker's rule).
    if host is not None and not ("." in host or ":" in host or host == "localhost"):
        if not re.fullmatch(_COMPONENT, host):
            raise ImageError(f"image reference {ref!r}: repository names are lower-case ({host!r} is not)")
        path, host = f"{host}/{path}", None
    if host is None:
        host = "docker.io"
        if "/" not in path:
            path = f"library/{path}"
    if tag is None and digest is None:
        tag = "latest"
    return Reference(ref, "docker", name=f"{host}/{path}", tag=tag, digest=digest)
