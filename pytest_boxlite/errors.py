"""One exception hierarchy for everything pytest-boxlite raises.

Every error derives from :class:`BoxliteError`.  Errors about files in a box
also derive from the matching built-in ``OSError`` subclass, so ``except
FileNotFoundError`` works on a sandbox exactly as it does locally.
"""

from __future__ import annotations

import errno as _errno
from typing import Protocol

__all__ = [
    "BoxDeadError",
    "BoxFileExistsError",
    "BoxFileNotFoundError",
    "BoxIsADirectoryError",
    "BoxNotADirectoryError",
    "BoxPermissionError",
    "BoxStartError",
    "BoxTimeoutError",
    "BoxliteError",
    "CommandError",
    "CommandOutcome",
    "ConfigError",
    "GuestToolError",
    "InvalidPathError",
    "LeaseTimeoutError",
    "OutputTimeoutError",
    "OutputWaitError",
    "ProcessExitedError",
    "RuntimeUnavailableError",
    "SandboxFileError",
    "UnsupportedError",
    "file_error",
]


class BoxliteError(Exception):
    """Base class of every error raised by pytest-boxlite."""


class ConfigError(BoxliteError, ValueError):
    """A setting or argument has a bad value; the message says where it came from."""


class RuntimeUnavailableError(BoxliteError):
    """The requested runtime cannot work on this host; the message says why."""


class BoxStartError(BoxliteError):
    """A box could not be created or started."""


class BoxDeadError(BoxliteError):
    """The box stopped answering (crashed, killed, or timed out at the runtime level)."""


class BoxTimeoutError(BoxliteError, TimeoutError):
    """A runtime call or guest operation did not finish within its bound."""


class LeaseTimeoutError(BoxTimeoutError):
    """No box could be leased from the pool within the lease timeout."""


class UnsupportedError(BoxliteError, NotImplementedError):
    """The box's runtime cannot do what was asked (e.g. ``spawn`` or ``publish``); the message names it."""


class OutputWaitError(BoxliteError):
    """A wait on a box process (its output, a port) did not see what it waited for.

    ``lines`` holds the process's last output lines (text, escaped), also quoted in the message.
    """

    def __init__(self, message: str, lines: list[str] | None = None) -> None:
        self.lines = list(lines or [])
        if self.lines:
            message += "\n--- last output lines ---\n" + "\n".join(self.lines)
        super().__init__(message)


class ProcessExitedError(OutputWaitError):
    """The process exited (or its output ended) before what was waited for appeared."""


class OutputTimeoutError(OutputWaitError, BoxTimeoutError):
    """What was waited for did not appear within the timeout."""


class GuestToolError(BoxliteError):
    """A guest-side helper failed in a way that is not a file error."""


class InvalidPathError(BoxliteError, ValueError):
    """A guest path is unusable (empty, contains NUL, ...)."""


class CommandOutcome(Protocol):
    """What :attr:`CommandError.result` provides: :class:`pytest_boxlite.sandbox.ExecResult` implements it.

    A protocol (not an import of the sandbox module) keeps this module at the bottom of the
    package: it imports nothing of pytest-boxlite.
    """

    @property
    def command(self) -> str: ...
    @property
    def exit_code(self) -> int | None: ...
    @property
    def stdout_bytes(self) -> bytes: ...
    @property
    def stderr_bytes(self) -> bytes: ...
    @property
    def timed_out(self) -> bool: ...
    @property
    def duration(self) -> float: ...
    @property
    def stdout_truncated(self) -> bool: ...
    @property
    def stderr_truncated(self) -> bool: ...
    @property
    def stdout(self) -> str: ...
    @property
    def stderr(self) -> str: ...
    @property
    def ok(self) -> bool: ...


class CommandError(BoxliteError):
    """A command run with ``check=True`` exited non-zero or timed out."""

    def __init__(self, result: CommandOutcome) -> None:
        self.result = result
        what = "timed out" if result.timed_out else f"exited with status {result.exit_code}"
        out = _tail(result.stdout)
        err = _tail(result.stderr)
        super().__init__(f"command {result.command!r} {what}\n--- stdout ---\n{out}\n--- stderr ---\n{err}")


def _tail(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


class SandboxFileError(BoxliteError, OSError):
    """A file operation inside a box failed."""


class BoxFileNotFoundError(SandboxFileError, FileNotFoundError):
    """The guest path does not exist."""


class BoxFileExistsError(SandboxFileError, FileExistsError):
    """The guest path already exists."""


class BoxIsADirectoryError(SandboxFileError, IsADirectoryError):
    """A file was expected but the guest path is a directory."""


class BoxNotADirectoryError(SandboxFileError, NotADirectoryError):
    """A directory was expected but the guest path is not one."""


class BoxPermissionError(SandboxFileError, PermissionError):
    """The guest refused access to the path."""


_BY_ERRNO: dict[int, type[SandboxFileError]] = {
    _errno.ENOENT: BoxFileNotFoundError,
    _errno.EEXIST: BoxFileExistsError,
    _errno.EISDIR: BoxIsADirectoryError,
    _errno.ENOTDIR: BoxNotADirectoryError,
    _errno.EACCES: BoxPermissionError,
    _errno.EPERM: BoxPermissionError,
}


def file_error(err_no: int, message: str, path: str | None = None) -> SandboxFileError:
    """Build the right :class:`SandboxFileError` subclass for an errno from the guest."""
    cls = _BY_ERRNO.get(err_no, SandboxFileError)
    if path is None:
        return cls(err_no, message)
    return cls(err_no, message, path)
