"""The file & exec contract on top of any runtime's box handle.

Everything here is synchronous and bounded in time.  File operations run a
small standard-library helper (:mod:`pytest_boxlite.guest.files`) in the guest,
which keeps them atomic, binary-safe (base64 where the runtime's stdout is
lossy text) and structured: results are values, errors are exceptions.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import errno
import io
import json
import os
import posixpath
import secrets
import shlex
import stat
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import IO, Any, NamedTuple

from pytest_boxlite.box_changes import take
from pytest_boxlite.errors import (
    BoxTimeoutError,
    CommandError,
    ConfigError,
    GuestToolError,
    InvalidPathError,
    OutputTimeoutError,
    ProcessExitedError,
    file_error,
)
from pytest_boxlite.process import BoxProcess, end_processes
from pytest_boxlite.publish import Relay
from pytest_boxlite.runtimes.base import DEFAULT_MAX_OUTPUT, BoxHandle, RawResult, helper_argv
from pytest_boxlite.spec import check_env

__all__ = ["Change", "ChangeList", "ExecResult", "GrepMatch", "Sandbox", "SearchResult"]

#: Default cap on the bytes one file transfer brings back (``Sandbox.max_transfer``): a file read,
#: a downloaded file or a downloaded tree's tar stream.  Larger answers are refused when the
#: helper announces them, before any of their bytes is read.
DEFAULT_MAX_TRANSFER = 1 << 30
#: Cap on the helper's header line (the JSON of a listing, a glob or a grep's matches).
_HEADER_CAP = 16 << 20
#: Cap on the helper's stderr kept for an error message.
_HELPER_STDERR_CAP = 1 << 20
DEFAULT_TIMEOUT = 60.0


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


class Change(NamedTuple):
    """One change of a box's files (:meth:`Sandbox.changes`): ``change`` is ``created``,
    ``modified`` or ``deleted``; ``kind`` ``file``, ``dir``, ``link``, ``other`` (``entry`` for a
    deletion); a created directory is one change, ``files`` the files in it and ``size`` their
    bytes; ``link`` a link's target (never followed)."""

    change: str
    kind: str
    path: str
    size: int
    files: int
    link: str | None


class ChangeList(list[Change]):
    """:meth:`Sandbox.changes`'s answer, sorted by path; ``notes`` says where it was cut."""

    notes: list[str]


PathLike = str | PurePosixPath


class Sandbox:
    """A box with the full file and exec contract.

    Relative guest paths are relative to the box's working directory
    (:attr:`workdir`); ``..`` components are resolved as in a shell.  ``max_output`` caps each
    output stream of a command; ``max_transfer`` caps what one file read or download brings back
    (a larger answer is refused with :class:`~pytest_boxlite.errors.GuestToolError` before any of
    it is read).
    """

    def __init__(
        self,
        handle: BoxHandle,
        *,
        default_timeout: float = DEFAULT_TIMEOUT,
        max_output: int = DEFAULT_MAX_OUTPUT,
        max_transfer: int = DEFAULT_MAX_TRANSFER,
    ) -> None:
        self.handle = handle
        self.default_timeout = default_timeout
        self.max_output = max_output
        self.max_transfer = max_transfer
        #: Processes started with :meth:`spawn` not yet closed, and published ports' relays.
        self._processes: list[BoxProcess] = []
        self._relays: dict[int, Relay] = {}
        self._ports_lock = threading.Lock()

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
        """Default working directory of commands and base of relative paths: ``/workspace``, empty
        and writable on every runtime.  The project (pytest's rootdir) is at its host path, not
        here: pass ``cwd=str(pytestconfig.rootpath)`` to run a command in it."""
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

    # -- processes and ports -----------------------------------------------
    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: PathLike | None = None,
        user: str | None = None,
    ) -> BoxProcess:
        """Start ``argv`` (no shell) in the box and return at once, as :class:`subprocess.Popen`.

        The result has Popen's interface (``stdin``/``stdout``/``stderr`` binary streams, ``poll``,
        ``wait``, ``communicate``, ``send_signal``, ...) plus ``wait_for_output``; see
        :class:`pytest_boxlite.process.BoxProcess` for where it differs.  Each output stream keeps
        at most :attr:`max_output` unread bytes (``stdout.truncated`` says a flood was cut).  A
        process still running when the sandbox ends or goes back to the pool is killed, with a
        :class:`~pytest_boxlite.process.BoxProcessWarning` in the test's report.  A missing
        executable raises :class:`FileNotFoundError` (a
        :class:`~pytest_boxlite.errors.BoxFileNotFoundError`).
        """
        if isinstance(argv, (str, bytes)) or not argv:
            raise ConfigError("spawn() takes a non-empty list of arguments, e.g. ['python3', '-m', 'http.server']")
        args = [str(a) for a in argv]
        for a in args:
            if "\0" in a:
                raise ConfigError(f"argument {a!r} contains a NUL byte")
        env_pairs = dict(check_env(env or {}, "env")) if env else None
        raw = self.handle.spawn(args, env=env_pairs, cwd=self._path(cwd) if cwd is not None else None, user=user)
        proc = BoxProcess(raw, args, box=self.name, max_output=self.max_output)
        with self._ports_lock:
            # Closed ones are dropped here, so a long-lived sandbox keeps no list of them all.
            self._processes[:] = [p for p in self._processes if not p.closed] + [proc]
        return proc

    def publish(self, port: int) -> tuple[str, int]:
        """Make the box's TCP ``port`` (on its own loopback) reachable from the host; returns the
        host's ``(address, port)`` to connect to (an ephemeral port on ``127.0.0.1``).

        Works with the box's network off: the host relays each connection into the box.  Each
        box has its own ports (two boxes may both listen on 8000).  The relay ends with the
        sandbox.  Use :meth:`wait_for_port` to wait until something listens.
        """
        port = _port(port)
        with self._ports_lock:
            if port in self._relays:
                host, hport = self._relays[port].address
                raise ConfigError(f"port {port} of box {self.name} is already published at {host}:{hport}")
            # One connection first: a runtime that cannot reach a box port (UnsupportedError) or
            # a dead box fails here, before the host listens; nothing listening yet is fine.
            with contextlib.suppress(ConnectionRefusedError):
                self.handle.connect_port(port, timeout=5.0).close()
            relay = Relay(lambda t: self.handle.connect_port(port, timeout=t), box=self.name, port=port)
            self._relays[port] = relay
        return relay.address

    def wait_for_port(self, port: int, *, timeout: float, process: BoxProcess | None = None) -> None:
        """Wait until something in the box listens on TCP ``port`` (its loopback), polling.

        Raises :class:`~pytest_boxlite.errors.OutputTimeoutError` after ``timeout`` seconds, or
        :class:`~pytest_boxlite.errors.ProcessExitedError` as soon as ``process`` (the server, when
        given) has exited; both quote its last output lines.
        """
        port = _port(port)
        t = self._timeout(timeout)
        deadline = time.monotonic() + t
        pause = 0.002
        while True:
            left = deadline - time.monotonic()
            try:
                self.handle.connect_port(port, timeout=max(0.5, min(left, 5.0))).close()
                return
            except ConnectionRefusedError:
                pass
            except BoxTimeoutError:
                # One attempt unanswered in its bound (a vm guest's connect command on a loaded host,
                # a remote server's exec): not yet; the wait's own deadline decides.
                pass
            if process is not None and process.poll() is not None:
                process._settle()
                raise ProcessExitedError(
                    f"{process._label()} exited with status {process.returncode} before port {port} listened",
                    process.last_lines(),
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise OutputTimeoutError(
                    f"nothing listened on port {port} of box {self.name} within {t:g} s",
                    process.last_lines() if process is not None else None,
                )
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)

    def end(self, why: str = "its sandbox ended") -> list[str]:
        """Kill and reap every process :meth:`spawn` started that still runs, and stop every
        published port's relay; warns (:class:`~pytest_boxlite.process.BoxProcessWarning`) about
        each process killed, and returns those lines.  The pool calls it when the box goes back."""
        with self._ports_lock:
            procs, self._processes = self._processes, []
            relays, self._relays = list(self._relays.values()), {}
        said = end_processes(procs, why)
        for relay in relays:
            relay.close()
        return said

    def changes(self, *, timeout: float | None = None) -> ChangeList:
        """What the box's commands changed in its files since it started: each file or directory
        created, modified or deleted, anywhere in the box (its ``/``, ``/tmp``, ``/workspace``, the
        host's directories it shows copy-on-write), as a list of :class:`Change` sorted by path.

        So an installer test can assert what ``make install`` wrote and nothing else.  Read from
        the box's own writable layers, which only a sandbox forked from a warm box keeps a handle
        on (the namespace runtime's default); elsewhere :class:`UnsupportedError` says so.  Bounded
        like ``--boxlite-side-effects``: the list is cut (``notes`` says so) after 200 changes, 20,000
        entries walked or half a second; ``__pycache__`` and ``.hypothesis`` directories are left out.
        """
        raw = self.handle.changes(timeout=self._timeout(timeout))
        try:
            checked = take({"files": raw.get("files", []), "notes": raw.get("notes", [])})
        except ValueError as exc:
            raise GuestToolError(f"box {self.name}: its list of changes was refused: {exc}") from None
        out = ChangeList(Change(*f) for f in checked.files)
        out.notes = checked.notes
        return out

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
        self,
        op: str,
        args: dict[str, Any],
        payload: bytes = b"",
        timeout: float | None = None,
        body: Callable[[dict[str, Any]], IO[bytes]] | None = None,
    ) -> tuple[dict[str, Any], IO[bytes]]:
        """Run one helper operation; its header (checked to be a JSON object) and its payload.

        The answer is hostile (a guest is root in its box): it is parsed as it arrives, its header
        and payload are bounded before they are read, and the payload goes to ``body(header)``
        (a file the caller opens once it knows what comes, e.g. on the destination's disk) or to
        an in-memory buffer, never held twice.
        """
        t = self._timeout(timeout)
        cap = self.max_transfer
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise ConfigError(f"max_transfer must be a non-negative number of bytes, got {cap!r}")
        b64 = not self.handle.binary_stdout
        req = dict(args, op=op, payload=len(payload), b64=b64)
        stdin = json.dumps(req).encode() + b"\n" + payload
        what = f"{op} {args.get('path', '')!r}"
        answer = _Answer(f"{what} in box {self.name}", cap, b64, body)
        try:
            raw = self.handle.run_helper(stdin, timeout=t, max_output=_HELPER_STDERR_CAP, sink=answer.feed)
            if raw is None:  # the runtime has no fast way: the helper runs as a guest command
                raw = self.handle.exec(
                    helper_argv(self.handle.guest_python),
                    input=stdin,
                    timeout=t,
                    max_output=_HEADER_CAP + 1 + _encoded_size(cap, b64),
                )
                if raw.stdout_dropped:
                    raise GuestToolError(
                        f"{what}: the answer from box {self.name} exceeds the transfer cap of {cap} bytes "
                        "(Sandbox.max_transfer); refused"
                    )
                answer.feed(raw.stdout)
            if raw.timed_out:
                raise BoxTimeoutError(f"{what} did not finish within {t:.0f}s in box {self.name}")
            if raw.exit_code != 0 or answer.meta is None:
                err = raw.stderr.decode("utf-8", "replace").strip()
                if raw.exit_code == 127 or ("No such file or directory" in err and self.handle.guest_python in err):
                    raise GuestToolError(
                        f"file operations need {self.handle.guest_python} in the guest image of box {self.name}"
                    )
                raise GuestToolError(f"{what} failed in box {self.name} (exit {raw.exit_code}): {err[-2000:]}")
            meta = answer.finish()
        except BaseException:
            answer.close()
            raise
        if not meta.pop("ok"):
            answer.close()
            message = _text(meta, "strerror", what, self.name)[:2000]
            if meta.get("kind") == "pattern":
                raise ConfigError(message)
            filename = meta.get("filename")
            err_no = meta.get("errno")
            if not isinstance(err_no, int) or isinstance(err_no, bool) or not isinstance(filename, (str, type(None))):
                raise GuestToolError(f"{what}: box {self.name} answered a malformed error {meta!r:.300}")
            raise file_error(err_no, message, filename)
        assert answer.body is not None
        return meta, answer.body

    def _bytes(self, op: str, args: dict[str, Any], timeout: float | None) -> bytes:
        """An operation whose payload is wanted in memory (bounded by :attr:`max_transfer`)."""
        _, body = self._helper(op, args, timeout=timeout)
        assert isinstance(body, io.BytesIO)
        return body.getvalue()  # the buffer itself where it is not shared: no second copy

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
        data = self._bytes(
            "read", {"path": self._path(path), "start_line": start_line, "end_line": end_line}, timeout=timeout
        )
        return data.decode("utf-8", "replace")

    def read_bytes(self, path: PathLike, *, timeout: float | None = None) -> bytes:
        """Read a file's exact bytes (at most :attr:`max_transfer` of them)."""
        return self._bytes("read", {"path": self._path(path)}, timeout)

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

    def update_file(
        self, path: PathLike, content: str | bytes, *, append: bool = False, timeout: float | None = None
    ) -> None:
        """Write ``content`` atomically: text as UTF-8 (as :meth:`write_file`), bytes as they are."""
        if isinstance(content, str):
            self.write_file(path, content, append=append, timeout=timeout)
        else:
            self.write_bytes(path, content, append=append, timeout=timeout)

    def _write(self, path: PathLike, data: bytes, append: bool, timeout: float | None) -> None:
        self._helper("write", {"path": self._path(path), "append": append}, data, timeout=timeout)

    def exists(self, path: PathLike, *, timeout: float | None = None) -> bool:
        """Whether the path exists in the box (a dangling symlink counts)."""
        meta, _ = self._helper("exists", {"path": self._path(path)}, timeout=timeout)
        return bool(_typed(meta, "exists", bool, self.name))

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
        """Copy a guest file or directory tree to ``host_path`` (a tree's contents land in it).

        What the box sends is streamed to the destination's disk (at most :attr:`max_transfer`
        bytes), never held in memory.  A tree is recreated by :func:`_extract_tree`: only what
        stays inside ``host_path``, anything else refused with
        :class:`~pytest_boxlite.errors.InvalidPathError`.
        """
        dest = Path(host_path)
        spool: dict[str, Any] = {}

        def open_body(meta: dict[str, Any]) -> IO[bytes]:
            # Called once the header says what comes: a tree is spooled beside its destination
            # (read twice: checked, then extracted), a file written to its temporary name.
            spool["is_dir"] = _typed(meta, "is_dir", bool, self.name)
            if spool["is_dir"]:
                dest.mkdir(parents=True, exist_ok=True)
                return tempfile.TemporaryFile(dir=dest.parent)
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, spool["tmp"] = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
            return os.fdopen(fd, "w+b")

        try:
            _, body = self._helper("fetch", {"path": self._path(guest_path)}, timeout=timeout, body=open_body)
            with body:
                if spool["is_dir"]:
                    body.seek(0)
                    _extract_tree(body, dest, str(guest_path))
                    return
            os.replace(spool.pop("tmp"), dest)
        finally:
            if "tmp" in spool:
                Path(spool["tmp"]).unlink(missing_ok=True)

    # -- search -----------------------------------------------------------
    def list_dir(self, path: PathLike, max_depth: int = 2, *, timeout: float | None = None) -> list[str]:
        """Entries under ``path`` down to ``max_depth`` levels, sorted; directories end with ``/``."""
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ConfigError(f"max_depth must be a positive integer, got {max_depth!r}")
        meta, _ = self._helper("list_dir", {"path": self._path(path), "max_depth": max_depth}, timeout=timeout)
        return _strings(meta, "entries", self.name)

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
        return SearchResult(_strings(meta, "paths", self.name), _typed(meta, "truncated", bool, self.name))

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
        matches = _typed(meta, "matches", list, self.name)
        out = []
        for m in matches:
            if not (
                isinstance(m, list)
                and len(m) == 3
                and isinstance(m[0], str)
                and isinstance(m[1], int)
                and not isinstance(m[1], bool)
                and isinstance(m[2], str)
            ):
                raise GuestToolError(f"grep: box {self.name} answered a malformed match {m!r:.200}")
            out.append(GrepMatch(m[0], m[1], m[2]))
        return SearchResult(out, _typed(meta, "truncated", bool, self.name))


def _owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Uploaded files belong to root in the box: a box may map no other id (non-root host), and
    tarfile skips a member's mode when its chown fails."""
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _encoded_size(size: int, b64: bool) -> int:
    """How many bytes ``size`` payload bytes take on the wire (base64 where stdout is text)."""
    return 4 * ((size + 2) // 3) if b64 else size


class _Answer:
    """The file helper's answer, parsed as it arrives and trusted in nothing.

    The runtime hands each chunk of the helper's stdout to :meth:`feed`: first one JSON header
    line (at most :data:`_HEADER_CAP` bytes), then exactly the payload it announces (at most the
    transfer cap, checked against the announcement before a byte of it is read).  Anything over a
    bound raises at once, which ends the helper; the payload goes straight to its destination.
    """

    def __init__(self, what: str, cap: int, b64: bool, body: Callable[[dict[str, Any]], IO[bytes]] | None) -> None:
        self.what = what
        self.cap = cap
        self.b64 = b64
        self._open_body = body
        self._head = bytearray()
        self.meta: dict[str, Any] | None = None
        self.body: IO[bytes] | None = None
        self._expected = 0
        self._got = 0
        self._carry = b""  # base64 not yet decoded (fewer than 4 characters)

    def _refuse(self, why: str) -> GuestToolError:
        return GuestToolError(f"{self.what}: {why}; refused")

    def feed(self, chunk: bytes) -> None:
        if self.meta is None:
            end = chunk.find(b"\n")
            if len(self._head) + (len(chunk) if end < 0 else end) > _HEADER_CAP:
                raise self._refuse(f"the helper's header line exceeds {_HEADER_CAP} bytes")
            if end < 0:
                self._head += chunk
                return
            self._head += chunk[:end]
            chunk = chunk[end + 1 :]
            self._start(bytes(self._head))
            self._head = bytearray()
        if not chunk:
            return
        self._got += len(chunk)
        if self._got > self._expected:
            raise self._refuse(f"the helper sent more than the {self._expected} bytes it announced")
        assert self.body is not None
        if self.b64:
            data = self._carry + chunk
            cut = len(data) - len(data) % 4
            self._carry = data[cut:]
            try:
                self.body.write(base64.b64decode(data[:cut], validate=True))
            except binascii.Error as exc:
                raise self._refuse(f"the helper's payload is not base64 ({exc})") from None
        else:
            self.body.write(chunk)

    def _start(self, head: bytes) -> None:
        try:
            meta = json.loads(head.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise self._refuse(f"the helper's header is not JSON: {head[:200]!r}") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("ok"), bool):
            raise self._refuse(f"the helper's header is not an answer: {head[:200]!r}")
        size = meta.get("payload")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise self._refuse(f"the helper announced a payload of {size!r:.50} bytes")
        if size > _encoded_size(self.cap, self.b64):
            raise self._refuse(
                f"the answer ({size} bytes) exceeds the transfer cap of {self.cap} bytes (raise Sandbox.max_transfer "
                "to allow more)"
            )
        if size and not meta["ok"]:
            raise self._refuse("the helper sent a payload with an error")
        self._expected = size
        self.body = self._open_body(meta) if (self._open_body is not None and meta["ok"]) else io.BytesIO()
        self.meta = meta

    def finish(self) -> dict[str, Any]:
        """The header, once the helper has exited: the whole payload must have come."""
        assert self.meta is not None
        if self._got != self._expected:
            raise self._refuse(f"the helper announced {self._expected} bytes and sent {self._got}")
        if self._carry:
            raise self._refuse("the helper's base64 payload is cut short")
        assert self.body is not None
        self.body.flush()
        return self.meta

    def close(self) -> None:
        if self.body is not None:
            self.body.close()


def _typed(meta: dict[str, Any], key: str, kind: type, box: str) -> Any:
    value = meta.get(key)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise GuestToolError(f"box {box} answered {key}={value!r:.100}, not a {kind.__name__}; refused")
    return value


def _strings(meta: dict[str, Any], key: str, box: str) -> list[str]:
    items = _typed(meta, key, list, box)
    if not all(isinstance(i, str) for i in items):
        raise GuestToolError(f"box {box} answered a {key} list that is not all strings; refused")
    return list(items)


def _text(meta: dict[str, Any], key: str, what: str, box: str) -> str:
    value = meta.get(key)
    if not isinstance(value, str):
        raise GuestToolError(f"{what}: box {box} answered a malformed error {meta!r:.300}")
    return value


# --- extracting a downloaded tree ------------------------------------------------------------

#: Most entries one downloaded tree may hold, and most bytes of their names and link targets:
#: the checks keep every name until the tree is written.
_MAX_MEMBERS = 500_000
_MAX_NAME_BYTES = 64 << 20
#: The kernel's bound on symbolic links followed in one path lookup (MAXSYMLINKS).
_MAX_HOPS = 40
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR, _FILE, _LINK = "d", "f", "l"


def _inside(rel: str) -> bool:
    """Whether a normalized relative path stays inside its base."""
    return rel != ".." and not rel.startswith("../")


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The archive's members one at a time, keeping none: a ``TarFile`` keeps every header it
    read in its (undocumented) ``members`` list, and a hostile stream of tiny members costs far
    more memory as headers than as bytes."""
    while (m := tar.next()) is not None:
        held = vars(tar).get("members")
        if isinstance(held, list):
            held.clear()
        yield m


class _ReadBound(io.BufferedIOBase):
    """A seekable stream whose single reads are bounded: ``tarfile`` reads a pax or GNU long-name
    header whole, so a hostile one could be as large as the answer; member data is read in
    chunks of a MiB by :func:`_write`."""

    def __init__(self, raw: IO[bytes], bound: int = 1 << 20) -> None:
        super().__init__()
        self._raw = raw
        self._bound = bound

    def read(self, size: int | None = -1, /) -> bytes:
        if size is None or size < 0 or size > self._bound:
            raise tarfile.ReadError(f"a header of the tar stream is larger than {self._bound} bytes")
        return self._raw.read(size)

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def _parts(name: str, label: str, what: str) -> list[str]:
    """A member name (or hard-link target) as path components below the destination; refuses
    absolute names, ``..`` and NUL rather than normalizing them away."""
    if "\0" in name:
        raise InvalidPathError(f"download of {label!r}: {what} {name!r} contains a NUL byte; refused")
    if name.startswith("/"):
        raise InvalidPathError(f"download of {label!r}: {what} {name!r} is absolute; refused")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidPathError(
            f"download of {label!r}: {what} {name!r} has '..' in it, which leaves the destination; refused"
        )
    return parts


def _existing_link(root_fd: int, parts: list[str]) -> str | None:
    """Whether ``parts`` (below the destination, before anything is written) is a link or
    passes through one: the first such prefix, else ``None``.  Opens nothing but directories,
    each without following a link."""
    fd = os.dup(root_fd)
    try:
        for i, part in enumerate(parts):
            try:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return None
            if stat.S_ISLNK(st.st_mode):
                return "/".join(parts[: i + 1])
            if not stat.S_ISDIR(st.st_mode) or i == len(parts) - 1:
                return None
            new = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = new
        return None
    finally:
        os.close(fd)


def _resolve(model: dict[str, str], links: dict[str, str], root_fd: int, link: str) -> list[str] | None:
    """Where the tree's link ``link`` -> ``target`` leads, through the tree's other links, as
    components below the destination; ``None`` when it leaves (or passes through a link that was
    in the destination already, which no check of this tree can vouch for).  A chain longer than
    the kernel follows resolves nowhere, which is harmless, and counts as inside."""
    here = link.split("/")[:-1]
    todo = [p for p in links[link].split("/") if p not in ("", ".")]
    hops = 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            if not here:
                return None
            here.pop()
            continue
        here.append(part)
        path = "/".join(here)
        kind = model.get(path)
        if kind in (_DIR, _FILE):
            continue
        if kind is None:  # not in the tree: a link already in the destination would lead anywhere
            if _existing_link(root_fd, here) is not None:
                return None
            continue
        hops += 1
        if hops > _MAX_HOPS:
            return here
        here.pop()
        todo[:0] = [p for p in links[path].split("/") if p not in ("", ".")]
    return here


def _plan(tar: tarfile.TarFile, dest: Path, root_fd: int, label: str) -> None:
    """Check every member before anything is written; raises :class:`InvalidPathError`.

    The model maps each path of the tree as it will stand to ``"d"``, ``"f"`` or ``"l"`` (a link,
    its target in ``links``): links are followed by :func:`_resolve` through the model, never
    through the host's filesystem.
    """
    model: dict[str, str] = {}
    links: dict[str, str] = {}
    count = name_bytes = 0
    vetted = getattr(tarfile, "data_filter", None)
    for m in _members(tar):
        count += 1
        name_bytes += len(m.name) + len(m.linkname)
        if count > _MAX_MEMBERS or name_bytes > _MAX_NAME_BYTES:
            raise InvalidPathError(
                f"download of {label!r}: the tree has more than {_MAX_MEMBERS} entries or {_MAX_NAME_BYTES} bytes "
                "of names; refused (pack it into one file in the box and download that)"
            )
        parts = _parts(m.name, label, "member")
        rel = "/".join(parts)
        if not (m.isdir() or m.isreg() or m.issym() or m.islnk()):
            raise InvalidPathError(
                f"download of {label!r}: {m.name!r} is a device, FIFO or other special file; refused"
            )
        if m.issym() and (
            not m.linkname
            or "\0" in m.linkname
            or m.linkname.startswith("/")
            or not _inside(posixpath.normpath(posixpath.join(posixpath.dirname(rel), m.linkname)))
        ):
            raise InvalidPathError(
                f"download of {label!r}: {m.name!r} is a link to {m.linkname!r}, which leaves the destination "
                f"{dest}; refused (links are kept only when they point inside the downloaded tree)"
            )
        if vetted is not None:
            # Python's own check (3.12, and the 3.8-3.11 security releases) as a second opinion on
            # names, link targets and kinds; the checks here and in _write are what guarantee.
            try:
                vetted(m, str(dest))
            except tarfile.FilterError as exc:
                raise InvalidPathError(f"download of {label!r}: {exc}; refused") from None
        if not parts:
            if not m.isdir():
                raise InvalidPathError(f"download of {label!r}: member {m.name!r} would replace the destination")
            continue
        for i in range(1, len(parts)):
            above = "/".join(parts[:i])
            kind = model.setdefault(above, _DIR)
            if kind != _DIR:
                raise InvalidPathError(
                    f"download of {label!r}: {m.name!r} lies below {above!r}, which is not a directory of the "
                    "tree (a link, or a file); refused"
                )
        old = model.get(rel)
        if m.isdir():
            if old not in (None, _DIR):
                raise InvalidPathError(f"download of {label!r}: {m.name!r} is both a directory and something else")
            model[rel] = _DIR
            continue
        links.pop(rel, None)
        if old == _DIR:
            raise InvalidPathError(f"download of {label!r}: {m.name!r} is both a directory and something else")
        if m.issym():
            model[rel] = _LINK
            links[rel] = m.linkname
        elif m.islnk():
            tparts = _parts(m.linkname, label, f"hard link {m.name!r} to")
            target = "/".join(tparts)
            through = [p for i in range(1, len(tparts)) if model.get(p := "/".join(tparts[:i])) != _DIR]
            if not tparts or model.get(target) != _FILE or through:
                raise InvalidPathError(
                    f"download of {label!r}: {m.name!r} is a hard link to {m.linkname!r}, which is not a regular "
                    "file written earlier by this download; refused"
                )
            model[rel] = _FILE
        else:
            model[rel] = _FILE
    for rel, target in links.items():
        if _resolve(model, links, root_fd, rel) is None:
            raise InvalidPathError(
                f"download of {label!r}: {rel!r} is a link to {target!r}, which leaves the destination {dest} "
                "(followed through the tree's links); refused (links are kept only when they point inside "
                "the downloaded tree)"
            )


class _Dirs:
    """Directory descriptors below the destination, each opened without following a link, so no
    link (the tree's, or one already there) can lead a write out of it.  Keeps the last one."""

    def __init__(self, root_fd: int, label: str) -> None:
        self.root_fd = root_fd
        self.label = label
        self._key: tuple[str, ...] | None = None
        self._fd = -1

    def open(self, parts: Sequence[str], *, create: bool) -> int:
        key = tuple(parts)
        if key == self._key:
            return self._fd
        self.close()
        fd = os.dup(self.root_fd)
        try:
            for i, part in enumerate(parts):
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o700, dir_fd=fd)
                try:
                    new = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                        raise InvalidPathError(
                            f"download of {self.label!r}: {'/'.join(parts[: i + 1])!r} in the destination is not a "
                            "directory (a link, or a file); refused"
                        ) from None
                    raise
                os.close(fd)
                fd = new
        except BaseException:
            os.close(fd)
            raise
        self._key, self._fd = key, fd
        return fd

    def close(self) -> None:
        if self._key is not None:
            os.close(self._fd)
        self._key, self._fd = None, -1


def _replace(tmp: str, name: str, dir_fd: int, label: str, rel: str) -> None:
    """Put ``tmp`` in place of ``name``: the name is replaced, never written through (a hard or
    symbolic link already there keeps pointing where it did, untouched)."""
    try:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        os.unlink(tmp, dir_fd=dir_fd)
        if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise InvalidPathError(f"download of {label!r}: {rel!r} is a directory in the destination") from None
        raise


def _write(tar: tarfile.TarFile, root_fd: int, label: str) -> None:
    """Create the checked tree below ``root_fd``: directories, regular files (new files renamed
    into place), links as checked, hard links only to files this call wrote."""
    dirs = _Dirs(root_fd, label)
    written: set[tuple[int, int]] = set()
    try:
        for m in _members(tar):
            parts = _parts(m.name, label, "member")
            if not parts:
                continue
            rel, name = "/".join(parts), parts[-1]
            parent = dirs.open(parts[:-1], create=True)
            tmp = f".boxlite-{secrets.token_hex(6)}"
            if m.isdir():
                fd = dirs.open(parts, create=True)
                os.chmod(fd, (m.mode & 0o777) | 0o700)
            elif m.issym():
                os.symlink(m.linkname, tmp, dir_fd=parent)
                _replace(tmp, name, parent, label, rel)
            elif m.islnk():
                tparts = _parts(m.linkname, label, "hard link target")
                src_dir = os.open(".", _DIR_FLAGS, dir_fd=dirs.open(tparts[:-1], create=False))
                try:
                    st = os.stat(tparts[-1], dir_fd=src_dir, follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) not in written:
                        raise InvalidPathError(
                            f"download of {label!r}: {rel!r} links to {m.linkname!r}, not a file this download wrote"
                        )
                    parent = dirs.open(parts[:-1], create=True)
                    os.link(tparts[-1], tmp, src_dir_fd=src_dir, dst_dir_fd=parent, follow_symlinks=False)
                finally:
                    os.close(src_dir)
                linked = os.stat(tmp, dir_fd=parent, follow_symlinks=False)
                if (linked.st_dev, linked.st_ino) not in written:  # the name changed under us
                    os.unlink(tmp, dir_fd=parent)
                    raise InvalidPathError(f"download of {label!r}: {rel!r}'s link target changed while extracting")
                _replace(tmp, name, parent, label, rel)
            else:
                src = tar.extractfile(m)
                assert src is not None
                fd = os.open(tmp, _NEW_FILE, 0o600, dir_fd=parent)
                try:
                    with os.fdopen(fd, "wb") as fh:
                        while chunk := src.read(1 << 20):
                            fh.write(chunk)
                        os.fchmod(fh.fileno(), m.mode & 0o777)
                        st = os.fstat(fh.fileno())
                except BaseException:
                    os.unlink(tmp, dir_fd=parent)
                    raise
                written.add((st.st_dev, st.st_ino))
                _replace(tmp, name, parent, label, rel)
    finally:
        dirs.close()


def _extract_tree(stream: IO[bytes], dest: Path, label: str) -> None:
    """Unpack a guest's tar stream (a seekable file) into ``dest``, trusting nothing in it.

    First every member is checked, before anything is written: no absolute names, no ``..``,
    nothing below a link or a file, no device or FIFO, symbolic links only where they resolve
    inside ``dest`` (followed through the tree's other links, and refused where they pass through
    a link already in ``dest``), hard links only to a regular file of the tree that comes before
    them.  Then the tree is written through directory descriptors opened without following any
    link, so no link (the tree's or one already in ``dest``) can lead a write out; a file is
    written under a new name and renamed into place, so nothing already there is written
    through; a hard link is made only to a file this call wrote (checked by inode).  Modes keep
    their permission bits only (no setuid/setgid), and ownership is never taken from the stream.
    A member that breaks any of this refuses the download with :class:`InvalidPathError`.
    """
    root_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            with tarfile.open(fileobj=_ReadBound(stream), mode="r:") as tar:
                _plan(tar, dest, root_fd, label)
            stream.seek(0)
            with tarfile.open(fileobj=_ReadBound(stream), mode="r:") as tar:
                _write(tar, root_fd, label)
        except tarfile.TarError as exc:
            raise GuestToolError(
                f"download of {label!r}: the box sent a malformed tar stream ({exc}); refused"
            ) from None
    finally:
        os.close(root_fd)


def _port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"a port is a number from 1 to 65535, got {port!r}")
    return port


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
