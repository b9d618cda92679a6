"""The file & exec contract on top of any runtime's box handle.

Everything here is synchronous and bounded in time.  File operations run a
small standard-library helper (:mod:`pytest_boxlite.guest.files`) in the guest,
which keeps them atomic, binary-safe (base64 where the runtime's stdout is
lossy text) and structured: results are values, errors are exceptions.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json
import os
import posixpath
import shlex
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from pytest_boxlite import guest
from pytest_boxlite.errors import (
    BoxTimeoutError,
    CommandError,
    ConfigError,
    GuestToolError,
    InvalidPathError,
    file_error,
)
from pytest_boxlite.runtimes.base import DEFAULT_MAX_OUTPUT, BoxHandle, RawResult
from pytest_boxlite.spec import check_env

__all__ = ["ExecResult", "GrepMatch", "Sandbox", "SearchResult"]

#: File transfers are not capped the way command output is.
_TRANSFER_CAP = 1 << 40
DEFAULT_TIMEOUT = 60.0


@lru_cache(maxsize=1)
def _helper_source() -> str:
    return guest.source("files")


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """The outcome of one command in a box.

    ``stdout``/``stderr`` are text (UTF-8, invalid bytes replaced);
    ``stdout_bytes``/``stderr_bytes`` are the exact bytes.  When a stream
    exceeded the capture cap its ``*_truncated`` flag is set and the extra
    bytes were discarded.  ``exit_code`` is negative when a signal killed the
    process and ``None`` when no status could be had.
    """

    command: str
    exit_code: int | None
    stdout_bytes: bytes
    stderr_bytes: bytes
    timed_out: bool
    duration: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        """True when the command exited 0 within its timeout."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    def check(self) -> ExecResult:
        """Raise :class:`~pytest_boxlite.errors.CommandError` unless :attr:`ok`."""
        if not self.ok:
            raise CommandError(self)
        return self


class GrepMatch(NamedTuple):
    """One matching line: its file, 1-based line number, and text (without newline)."""

    path: str
    line_number: int
    line: str


class SearchResult(NamedTuple):
    """Results of ``glob``/``grep``; ``truncated`` is true whenever results were cut."""

    items: list[Any]
    truncated: bool


PathLike = str | PurePosixPath


class Sandbox:
    """A box with the full file and exec contract.

    Relative guest paths are relative to the box's working directory
    (:attr:`workdir`); ``..`` components are resolved as in a shell.
    """

    def __init__(
        self, handle: BoxHandle, *, default_timeout: float = DEFAULT_TIMEOUT, max_output: int = DEFAULT_MAX_OUTPUT
    ) -> None:
        self.handle = handle
        self.default_timeout = default_timeout
        self.max_output = max_output

    # -- identity ---------------------------------------------------------
    @property
    def name(self) -> str:
        """The box's name; it carries the owning session's id."""
        return self.handle.name

    @property
    def id(self) -> str:
        """The runtime's id of the box."""
        return self.handle.id

    @property
    def runtime(self) -> str:
        """``"vm"`` or ``"namespace"``."""
        return self.handle.runtime_name

    @property
    def workdir(self) -> str:
        """Default working directory of commands and base of relative paths."""
        return self.handle.workdir

    def __repr__(self) -> str:
        return f"<Sandbox {self.name} runtime={self.runtime}>"

    # -- exec -------------------------------------------------------------
    def execute_command(
        self,
        command: str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: PathLike | None = None,
        timeout: float | None = None,
        user: str | None = None,
        check: bool = False,
    ) -> ExecResult:
        """Run ``command`` through ``/bin/sh -c`` in the box."""
        if not isinstance(command, str):
            raise ConfigError(
                f"execute_command takes a shell command string, got {type(command).__name__}; use run() for argv lists"
            )
        return self._exec(["/bin/sh", "-c", command], command, None, env, cwd, timeout, user, check)

    def run(
        self,
        argv: Sequence[str],
        *,
        input: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: PathLike | None = None,
        timeout: float | None = None,
        check: bool = False,
        user: str | None = None,
    ) -> ExecResult:
        """Run ``argv`` without a shell, like :func:`subprocess.run`."""
        if isinstance(argv, (str, bytes)) or not argv:
            raise ConfigError("run() takes a non-empty list of arguments; use execute_command() for a shell string")
        args = [str(a) for a in argv]
        for a in args:
            if "\0" in a:
                raise ConfigError(f"argument {a!r} contains a NUL byte")
        data = input.encode() if isinstance(input, str) else input
        return self._exec(args, shlex.join(args), data, env, cwd, timeout, user, check)

    def _exec(
        self,
        argv: list[str],
        label: str,
        data: bytes | None,
        env: Mapping[str, str] | None,
        cwd: PathLike | None,
        timeout: float | None,
        user: str | None,
        check: bool,
    ) -> ExecResult:
        env_pairs = dict(check_env(env or {}, "env")) if env else None
        t = self._timeout(timeout)
        raw = self.handle.exec(
            argv,
            input=data,
            env=env_pairs,
            cwd=self._path(cwd) if cwd is not None else None,
            user=user,
            timeout=t,
            max_output=self.max_output,
        )
        result = _to_result(label, raw)
        return result.check() if check else result

    def _timeout(self, timeout: float | None) -> float:
        t = self.default_timeout if timeout is None else timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(t)

    # -- paths ------------------------------------------------------------
    def _path(self, path: PathLike) -> str:
        if not isinstance(path, (str, PurePosixPath)):
            raise InvalidPathError(f"guest paths are str or PurePosixPath, got {type(path).__name__}")
        p = str(path)
        if not p:
            raise InvalidPathError("guest path is empty")
        if "\0" in p:
            raise InvalidPathError(f"guest path {p!r} contains a NUL byte")
        if not p.startswith("/"):
            p = posixpath.join(self.workdir, p)
        p = posixpath.normpath(p)
        return "/" + p.lstrip("/")

    # -- guest helper -----------------------------------------------------
    def _helper(
        self, op: str, args: dict[str, Any], payload: bytes = b"", timeout: float | None = None
    ) -> tuple[dict[str, Any], bytes]:
        t = self._timeout(timeout)
        req = dict(args, op=op, payload=len(payload), b64=not self.handle.binary_stdout)
        stdin = json.dumps(req).encode() + b"\n" + payload
        raw = self.handle.run_helper(stdin, timeout=t, max_output=_TRANSFER_CAP)
        if raw is None:  # the runtime has no fast way: the helper runs as a guest command
            raw = self.handle.exec(
                [self.handle.guest_python, "-I", "-S", "-c", _helper_source()],
                input=stdin,
                timeout=t,
                max_output=_TRANSFER_CAP,
            )
        what = f"{op} {args.get('path', '')!r}"
        if raw.timed_out:
            raise BoxTimeoutError(f"{what} did not finish within {t:.0f}s in box {self.name}")
        head, sep, body = raw.stdout.partition(b"\n")
        if raw.exit_code != 0 or not sep:
            err = raw.stderr.decode("utf-8", "replace").strip()
            if raw.exit_code == 127 or ("No such file or directory" in err and self.handle.guest_python in err):
                raise GuestToolError(
                    f"file operations need {self.handle.guest_python} in the guest image of box {self.name}"
                )
            raise GuestToolError(f"{what} failed in box {self.name} (exit {raw.exit_code}): {err[-2000:]}")
        meta: dict[str, Any] = json.loads(head.decode())
        if not meta.pop("ok"):
            if meta.get("kind") == "pattern":
                raise ConfigError(meta["strerror"])
            raise file_error(int(meta["errno"]), meta["strerror"], meta.get("filename"))
        if len(body) != meta["payload"]:
            raise GuestToolError(f"{what}: expected {meta['payload']} bytes from box {self.name}, got {len(body)}")
        if req["b64"]:
            body = base64.b64decode(body)
        return meta, body

    # -- files ------------------------------------------------------------
    def read_file(
        self,
        path: PathLike,
        *,
        start_line: int | None = None,
        end_line: int | None = None,
        timeout: float | None = None,
    ) -> str:
        """Read a text file (UTF-8, invalid bytes replaced); lines are 1-based and inclusive."""
        for v, n in ((start_line, "start_line"), (end_line, "end_line")):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{n} must be a positive integer, got {v!r}")
        _, data = self._helper(
            "read", {"path": self._path(path), "start_line": start_line, "end_line": end_line}, timeout=timeout
        )
        return data.decode("utf-8", "replace")

    def read_bytes(self, path: PathLike, *, timeout: float | None = None) -> bytes:
        """Read a file's exact bytes."""
        return self._helper("read", {"path": self._path(path)}, timeout=timeout)[1]

    download_file = read_bytes

    def write_file(self, path: PathLike, content: str, *, append: bool = False, timeout: float | None = None) -> None:
        """Write text (UTF-8) atomically, creating parent directories."""
        if not isinstance(content, str):
            raise ConfigError(f"write_file takes str content, got {type(content).__name__}; use write_bytes for bytes")
        self._write(path, content.encode(), append, timeout)

    def write_bytes(self, path: PathLike, data: bytes, *, append: bool = False, timeout: float | None = None) -> None:
        """Write bytes atomically (temp file + rename), creating parent directories."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ConfigError(f"write_bytes takes bytes, got {type(data).__name__}")
        self._write(path, bytes(data), append, timeout)

    update_file = write_bytes

    def _write(self, path: PathLike, data: bytes, append: bool, timeout: float | None) -> None:
        self._helper("write", {"path": self._path(path), "append": append}, data, timeout=timeout)

    def exists(self, path: PathLike, *, timeout: float | None = None) -> bool:
        """Whether the path exists in the box (a dangling symlink counts)."""
        return bool(self._helper("exists", {"path": self._path(path)}, timeout=timeout)[0]["exists"])

    def remove(self, path: PathLike, *, timeout: float | None = None) -> None:
        """Remove a file, symlink or directory tree."""
        self._helper("remove", {"path": self._path(path)}, timeout=timeout)

    def upload(self, host_path: str | os.PathLike[str], guest_path: PathLike, *, timeout: float | None = None) -> None:
        """Copy a host file or directory tree to ``guest_path`` (a tree's contents land in it)."""
        src = Path(host_path)
        dest = self._path(guest_path)
        if src.is_dir():
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                tar.add(src, arcname=".", filter=_owned_by_root)
            self._helper("tar_in", {"path": dest}, buf.getvalue(), timeout=timeout)
        elif src.exists():
            self._write(dest, src.read_bytes(), False, timeout)
        else:
            raise FileNotFoundError(2, "No such file or directory (on the host)", str(src))

    def download(
        self, guest_path: PathLike, host_path: str | os.PathLike[str], *, timeout: float | None = None
    ) -> None:
        """Copy a guest file or directory tree to ``host_path`` (a tree's contents land in it)."""
        meta, data = self._helper("fetch", {"path": self._path(guest_path)}, timeout=timeout)
        dest = Path(host_path)
        if meta["is_dir"]:
            dest.mkdir(parents=True, exist_ok=True)
            _extract_tree(data, dest, str(guest_path))
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    # -- search -----------------------------------------------------------
    def list_dir(self, path: PathLike, max_depth: int = 2, *, timeout: float | None = None) -> list[str]:
        """Entries under ``path`` down to ``max_depth`` levels, sorted; directories end with ``/``."""
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ConfigError(f"max_depth must be a positive integer, got {max_depth!r}")
        return list(
            self._helper("list_dir", {"path": self._path(path), "max_depth": max_depth}, timeout=timeout)[0]["entries"]
        )

    def glob(
        self,
        path: PathLike,
        pattern: str,
        *,
        include_dirs: bool = False,
        max_results: int = 200,
        timeout: float | None = None,
    ) -> SearchResult:
        """Paths under ``path`` whose relative path matches ``pattern`` (``**`` spans directories).

        Returns ``(paths, truncated)``.  Symlinks are listed, never followed.
        """
        _positive("max_results", max_results)
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"glob pattern must be a non-empty string, got {pattern!r}")
        meta, _ = self._helper(
            "glob",
            {"path": self._path(path), "pattern": pattern, "include_dirs": include_dirs, "max_results": max_results},
            timeout=timeout,
        )
        return SearchResult(list(meta["paths"]), bool(meta["truncated"]))

    def grep(
        self,
        path: PathLike,
        pattern: str,
        *,
        glob: str | None = None,
        literal: bool = False,
        case_sensitive: bool = True,
        max_results: int = 100,
        timeout: float | None = None,
    ) -> SearchResult:
        """Lines matching ``pattern`` (a Python regex, or a plain string with ``literal``).

        ``glob`` filters files by name (or relative path when it contains ``/``).
        Binary files and symlinks are skipped.  Returns ``(matches, truncated)``.
        """
        _positive("max_results", max_results)
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"grep pattern must be a non-empty string, got {pattern!r}")
        meta, _ = self._helper(
            "grep",
            {
                "path": self._path(path),
                "pattern": pattern,
                "glob": glob,
                "literal": literal,
                "case_sensitive": case_sensitive,
                "max_results": max_results,
            },
            timeout=timeout,
        )
        return SearchResult([GrepMatch(p, int(n), line) for p, n, line in meta["matches"]], bool(meta["truncated"]))


def _owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Uploaded files belong to root in the box: a box may map no other id (non-root host), and
    tarfile skips a member's mode when its chown fails."""
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _inside(rel: str) -> bool:
    """Whether a normalized relative path stays inside its base."""
    return rel != ".." and not rel.startswith("../") and not rel.startswith("/")


def _extract_tree(data: bytes, dest: Path, label: str) -> None:
    """Unpack a guest's tar stream into ``dest``, trusting nothing in it.

    Every member must land inside ``dest``: no absolute names, no ``..``, no member below a
    link.  A symbolic link is recreated only when its target stays inside ``dest`` (the same
    tree), and a hard link only to a member already extracted; anything else (a link leaving
    the destination, a device, a FIFO) refuses the whole download with :class:`InvalidPathError`
    *before* anything is written.  Modes keep their permission bits only (no setuid/setgid),
    files are created without following links, and ownership is never taken from the stream.
    """
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        members = tar.getmembers()
        plan: list[tuple[tarfile.TarInfo, str]] = []
        for m in members:
            rel = posixpath.normpath(m.name)
            if m.name.startswith("/") or not _inside(rel):
                raise InvalidPathError(f"download of {label!r}: member {m.name!r} would land outside {dest}; refused")
            if m.issym():
                target = m.linkname
                resolved = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
                if target.startswith("/") or not _inside(resolved) or resolved == ".":
                    raise InvalidPathError(
                        f"download of {label!r}: {m.name!r} is a link to {target!r}, which leaves the destination "
                        f"{dest}; refused (links are kept only when they point inside the downloaded tree)"
                    )
            elif m.islnk():
                target = posixpath.normpath(m.linkname)
                if m.linkname.startswith("/") or not _inside(target):
                    raise InvalidPathError(
                        f"download of {label!r}: {m.name!r} is a hard link to {m.linkname!r}, outside the tree; refused"
                    )
            elif not (m.isdir() or m.isreg()):
                raise InvalidPathError(
                    f"download of {label!r}: {m.name!r} is a device, FIFO or other special file; refused"
                )
            plan.append((m, rel))
        base = os.path.realpath(dest)
        for m, rel in plan:
            if rel == ".":
                continue
            target_path = os.path.join(base, rel)
            _check_no_link_below(base, rel, label)
            if m.isdir():
                with contextlib.suppress(FileExistsError):
                    os.mkdir(target_path, 0o700)
                if os.path.islink(target_path) or not os.path.isdir(target_path):
                    raise InvalidPathError(f"download of {label!r}: {rel!r} exists and is not a directory")
                os.chmod(target_path, (m.mode & 0o777) | 0o700)
            elif m.issym():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(target_path)
                os.symlink(m.linkname, target_path)
            elif m.islnk():
                source = os.path.join(base, posixpath.normpath(m.linkname))
                if os.path.islink(source) or not os.path.isfile(source):
                    raise InvalidPathError(f"download of {label!r}: {rel!r} links to a member not extracted")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(target_path)
                os.link(source, target_path, follow_symlinks=False)
            else:
                src = tar.extractfile(m)
                assert src is not None
                fd = os.open(target_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "wb") as fh:
                    while chunk := src.read(1 << 20):
                        fh.write(chunk)
                    os.fchmod(fh.fileno(), m.mode & 0o777)


def _check_no_link_below(base: str, rel: str, label: str) -> None:
    """Refuse a member whose parent directories include a link (it could lead out of ``base``)."""
    parts = rel.split("/")[:-1]
    here = base
    for part in parts:
        here = os.path.join(here, part)
        if os.path.islink(here):
            raise InvalidPathError(f"download of {label!r}: {rel!r} lies below a link ({part!r}); refused")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _to_result(label: str, raw: RawResult) -> ExecResult:
    return ExecResult(
        command=label,
        exit_code=raw.exit_code,
        stdout_bytes=raw.stdout,
        stderr_bytes=raw.stderr,
        timed_out=raw.timed_out,
        duration=raw.duration,
        stdout_truncated=raw.stdout_dropped > 0,
        stderr_truncated=raw.stderr_dropped > 0,
    )
