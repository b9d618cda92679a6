"""The frozen description of a box: what a pool is keyed by."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from pytest_boxlite.errors import ConfigError

if TYPE_CHECKING:
    import pytest

#: Set in a box's environment for the tests and what they start: "this process runs in a box".
#: It gives no role: a pytest that a boxed test starts itself is an ordinary pytest.
GUEST_ENV = "PYTEST_BOXLITE_GUEST"
#: Set in a box's environment for the box's own pytest alone: the first pytest configuration of
#: that process takes it out of ``os.environ`` (:func:`in_guest`), so neither a subprocess of a
#: test nor a pytester run (in-process or not) inherits the box's role.
ROLE_ENV = "PYTEST_BOXLITE_ROLE"
#: The value of :data:`ROLE_ENV` that makes a pytest the box's own.
GUEST_ROLE = "guest"

# A pytest.StashKey, made at the first use: this module is imported where pytest is not (boxproc).
_role_key: Any = None


def in_guest(config: pytest.Config) -> bool:
    """True for a box's own pytest (the plugin there stays passive: the host does the boxing).

    Decided once per configuration: the first one to ask in a process takes :data:`ROLE_ENV` out of
    the environment, so a pytest that the box's tests start (a subprocess, or pytester's in-process
    runs, which make configurations of their own later) behaves as it would unboxed."""
    global _role_key
    if _role_key is None:
        import pytest

        _role_key = pytest.StashKey[bool]()
    role = config.stash.get(_role_key, None)
    if role is None:
        role = os.environ.pop(ROLE_ENV, None) == GUEST_ROLE
        config.stash[_role_key] = role
    return bool(role)


#: Host variables that describe the host process itself, not the environment tests expect.
#: PYTEST_DEBUG_TEMPROOT names a host directory (pytester sets it under /tmp), which a box's
#: private /tmp does not have: the guest's tmp_path must come from the guest's own temp root.
# The box's pytest sets PYTEST_CURRENT_TEST itself; the host's temporary root is not in the box.
# (xdist's PYTEST_XDIST_* stay: a test in a box of worker gw0 sees what it would see locally.)
# BOXLITE_API_KEY is the key of a remote BoxLite server (--boxlite-url): a box must never hold it.
_HOST_ONLY_ENV = ("PYTEST_CURRENT_TEST", "PYTEST_DEBUG_TEMPROOT", "BOXLITE_API_KEY")

#: An OCI image reference as registries take it (the distribution project's grammar): an optional
#: registry host (and port), lower-case path components, an optional tag and an optional digest.
_REF_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REF_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_REF_HOST = rf"(?:{_REF_LABEL}(?:\.{_REF_LABEL})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_IMAGE_REF = re.compile(
    rf"(?:{_REF_HOST}/)?{_REF_COMPONENT}(?:/{_REF_COMPONENT})*"
    r"(?::[\w][\w.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?\Z"
)
#: The containers ecosystem's transport names for local images (``oci:DIR[:TAG]``...) and
#: ``docker://`` for a registry reference spelled out.
_TRANSPORTS = ("oci:", "oci-archive:", "docker-archive:")
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def default_image() -> str:
    """namespace: none (the host's own files); vm: ``python:<host major.minor>-slim``: the guest
    runs the host's Python version.  The namespace runtime boxes on the host's files unless an
    image is named (``runtimes.images_on_request``)."""
    return f"python:{sys.version_info.major}.{sys.version_info.minor}-slim"


def check_image(image: object) -> str:
    """``image`` if it is an image reference (registry ``[registry/]name[:tag][@digest]``, or a
    transport: ``oci:DIR[:TAG]``, ``oci-archive:PATH[:TAG]``, ``docker-archive:PATH``,
    ``docker://REF``); else a :class:`ConfigError` saying what is expected."""
    if not isinstance(image, str) or not image.strip():
        raise ConfigError(f"image must be a non-empty string, got {image!r}")
    expected = (
        "expected [registry/]name[:tag][@digest] with a lower-case name (e.g. 'python:3.12-slim', "
        "'ghcr.io/org/tool:1.0'), or a local image: 'oci:DIR[:TAG]', 'oci-archive:PATH[:TAG]', "
        "'docker-archive:PATH', 'docker://REF'"
    )
    if len(image) > 4096 or any(ord(c) < 32 for c in image):
        raise ConfigError(f"image {image[:200]!r} is not an OCI image reference: {expected}")
    if image.startswith("docker://"):
        ref = image[len("docker://") :]
        if len(ref) <= 512 and _IMAGE_REF.match(ref):
            return image
    elif image.startswith(_TRANSPORTS):
        if image.partition(":")[2].strip():
            return image
    elif len(image) <= 512 and _IMAGE_REF.match(image):
        return image
    raise ConfigError(f"image {image!r} is not an OCI image reference: {expected}")


@dataclasses.dataclass(frozen=True)
class ImageRoot:
    """An image resolved to its unpacked root filesystem in the image store: what a runtime that
    shows the host's files unless asked (namespace) boots a box of the image on."""

    #: The reference as the user wrote it.
    reference: str
    #: The image's digest, ``sha256:<hex>``.
    digest: str
    #: The complete unpacked tree (never changed: each box lays its own writable layer on it).
    rootfs: str
    #: The image config's ``Env`` (under the spec's env), ``WorkingDir`` and ``User``.
    env: tuple[tuple[str, str], ...] = ()
    workdir: str | None = None
    user: str | None = None

    def label(self) -> str:
        """``<reference>@sha256:<12 hex>`` for headers and box records."""
        algo, _, hexdigest = self.digest.partition(":")
        return f"{self.reference}@{algo}:{hexdigest[:12]}"


def check_env(env: Mapping[str, str] | Iterable[tuple[str, str]], where: str) -> tuple[tuple[str, str], ...]:
    """Validate environment variables and return them as sorted ``(key, value)`` pairs."""
    items = list(env.items()) if isinstance(env, Mapping) else list(env)
    out: dict[str, str] = {}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ConfigError(f"{where}: environment entries must be (key, value) pairs, got {item!r}")
        key, value = item
        if not isinstance(key, str) or not _ENV_KEY.match(key):
            raise ConfigError(
                f"{where}: invalid environment variable name {key!r}; "
                "use letters, digits and '_', not starting with a digit"
            )
        if not isinstance(value, str):
            raise ConfigError(f"{where}: value of environment variable {key} must be a str, got {type(value).__name__}")
        if "\0" in value:
            raise ConfigError(f"{where}: value of environment variable {key} contains a NUL byte")
        out[key] = value
    return tuple(sorted(out.items()))


#: Directories never mounted into a box whole: its own root, and the host's /tmp and /run, which
#: every box has private.  Asked for one of them (pytest invoked from /tmp, ``/`` on sys.path), a
#: box gets the directories below it that were asked for, not the host's whole /tmp: that would
#: show every user's files there (and stacking the credential masks over it cannot even mount).
_NEVER_WHOLE = frozenset({"/", "/tmp", "/run"})


def minimal_dirs(paths: Iterable[str]) -> tuple[str, ...]:
    """Absolute, existing directories, without any that lie inside another one, sorted
    (``/``, ``/tmp`` and ``/run`` themselves are dropped: see ``_NEVER_WHOLE``)."""
    dirs = sorted({os.path.normpath(p) for p in paths if os.path.isabs(p) and os.path.isdir(p)} - _NEVER_WHOLE)
    out: list[str] = []
    for d in dirs:
        if not any(d == o or d.startswith(o.rstrip("/") + "/") for o in out):
            out.append(d)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class BoxSpec:
    """What a box is made of.  Two equal specs can share a warm pool.

    ``memory_mib`` and ``cpus`` of ``None`` mean the runtime's default.
    """

    image: str = dataclasses.field(default_factory=default_image)
    cpus: int | None = None
    memory_mib: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    network: bool = False
    pids_limit: int | None = 4096
    #: A box that runs boxed tests: a warm interpreter (the box's pytest, collected once) inside.
    warm: bool = False
    #: Host directories the guest sees at the same path, copy-on-write (the project, its packages).
    mounts: tuple[str, ...] = ()
    #: A provisioned template (``--boxlite-setup``) the box starts from: its directory, set by the session.
    template: str | None = None
    #: Who runs in the box: a name or ``uid[:gid]``; ``None`` is the runtime's default (boxed tests:
    #: the host user, as locally; sandbox commands: root in the box, like a container's exec).
    user: str | None = None
    #: The image's root filesystem where the runtime boxes on it only when asked (namespace: the
    #: image was named explicitly), set by the session; ``None``: the runtime's default root
    #: (namespace: the host's files; vm: always ``image``, whatever this says).
    root: ImageRoot | None = None

    def __post_init__(self) -> None:
        check_image(self.image)
        if self.root is not None and not isinstance(self.root, ImageRoot):
            raise ConfigError(f"root must be an ImageRoot, got {self.root!r}")
        if self.cpus is not None and (not isinstance(self.cpus, int) or isinstance(self.cpus, bool) or self.cpus < 1):
            raise ConfigError(f"cpus must be a positive integer, got {self.cpus!r}")
        if self.memory_mib is not None and (
            not isinstance(self.memory_mib, int) or isinstance(self.memory_mib, bool) or self.memory_mib < 64
        ):
            raise ConfigError(f"memory must be an integer of at least 64 (MiB), got {self.memory_mib!r}")
        if self.pids_limit is not None and (not isinstance(self.pids_limit, int) or self.pids_limit < 8):
            raise ConfigError(f"pids_limit must be an integer of at least 8, got {self.pids_limit!r}")
        if self.user is not None and not _USER.match(str(self.user)):
            raise ConfigError(f"user must be a name or uid[:gid] (e.g. 'root', '1000:1000'), got {self.user!r}")
        object.__setattr__(self, "env", check_env(self.env, "box env"))
        object.__setattr__(self, "mounts", minimal_dirs(self.mounts))

    @property
    def worker(self) -> bool:
        """Deprecated: the older name of :attr:`warm`."""
        warnings.warn("BoxSpec.worker is now BoxSpec.warm", DeprecationWarning, stacklevel=2)
        return self.warm

    def describe(self) -> str:
        """A short human-readable label, e.g. for the report header."""
        parts = [self.root.label() if self.root is not None else self.image]
        if self.cpus:
            parts.append(f"cpus={self.cpus}")
        if self.memory_mib:
            parts.append(f"memory={self.memory_mib}MiB")
        parts.append(f"network={'on' if self.network else 'off'}")
        if self.env:
            parts.append("env=" + ",".join(k for k, _ in self.env))
        return " ".join(parts)


#: Host variables a boxed test does not see by default (``--boxlite-env-deny``): names that
#: carry credentials, as the credential files are masked.  Matched case-insensitively.
DEFAULT_ENV_DENY = (
    "*TOKEN*",
    "*SECRET*",
    "*PASSWORD*",
    "*PASSWD*",
    "*API_KEY*",
    "*APIKEY*",
    "*ACCESS_KEY*",
    "*PRIVATE_KEY*",
    "*CREDENTIAL*",
)


def denied(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether host variable ``name`` matches one of the ``--boxlite-env-deny`` patterns."""
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, p.upper()) for p in patterns)


def worker_env(spec: BoxSpec, deny: tuple[str, ...] = DEFAULT_ENV_DENY) -> dict[str, str]:
    """A test worker's environment: the host's, as a local run would see it, minus the variables
    ``deny`` matches, then the box's own (given explicitly, so never denied)."""
    env = {k: v for k, v in os.environ.items() if k not in _HOST_ONLY_ENV and not denied(k, deny)}
    env.update(dict(spec.env))
    env[GUEST_ENV] = "1"
    env[ROLE_ENV] = GUEST_ROLE
    return env
