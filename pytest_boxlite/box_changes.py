"""A box's list of what changed in it, checked on the host: :func:`take` and :class:`Changes`.

The box computes the list (:mod:`pytest_boxlite.guest.changes`) for a boxed test's ``CHANGES``
message (:mod:`pytest_boxlite.side_effects`) and for ``Sandbox.changes()``; here every field's type
and bound is checked (``ValueError`` naming what is wrong) and the lines shown are escaped.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pytest_boxlite._shown import shown

#: What the host keeps of one message (the box lists at most 200 of each; a hostile one may send more).
FILES_CAP = 200
PROCESSES_CAP = 200
ENV_CAP = 200
NOTES_CAP = 10
TEXT_CAP = 1024
_CHANGES = ("created", "modified", "deleted", "replaced")
_KINDS = ("file", "dir", "link", "other", "entry")
_ENV_CHANGES = ("set", "changed", "removed")


@dataclasses.dataclass
class Changes:
    """One test's ``CHANGES`` message, checked."""

    files: list[tuple[str, str, str, int, int, str | None]]
    processes: list[tuple[int, str]]
    env: list[tuple[str, str]]
    cwd: tuple[str, str] | None
    umask: tuple[int, int] | None
    cpu_s: float | None
    peak_kib: int | None
    notes: list[str]

    def lines(self) -> list[str]:
        """What the test left, one escaped line per thing."""
        out = []
        for change, kind, path, size, count, link in self.files:
            what = (
                f"{change} {shown(path, line=True)}" if kind == "entry" else f"{change} {kind} {shown(path, line=True)}"
            )
            if kind == "dir" and change != "deleted":
                what += f" ({count} file{'s' if count != 1 else ''}, {_size(size)})"
            elif kind == "file" and change != "deleted":
                what += f" ({_size(size)})"
            if link is not None:
                what += f" -> {shown(link, line=True)}"
            out.append(what)
        for pid, command in self.processes:
            out.append(f"process left running (pid {pid} in the box): {shown(command, line=True)}")
        for name, change in self.env:
            out.append(f"environment variable {shown(name, line=True)} {change}")
        if self.cwd is not None:
            out.append(f"working directory changed: {shown(self.cwd[0], line=True)} -> {shown(self.cwd[1], line=True)}")
        if self.umask is not None:
            out.append(f"umask changed: {self.umask[0]:03o} -> {self.umask[1]:03o}")
        return out


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return ("1 byte" if n == 1 else f"{n} {unit}") if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _text(v: object, what: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{what} is not a string: {type(v).__name__}")
    return v[:TEXT_CAP]


def _count(v: object, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > 1 << 62:
        raise ValueError(f"{what} is not a count: {shown(repr(v), line=True, limit=50)}")
    return v


def _list(v: object, what: str, cap: int) -> list[Any]:
    if not isinstance(v, list):
        raise ValueError(f"{what} is not a list")
    if len(v) > cap:
        raise ValueError(f"{what} lists {len(v)} entries (at most {cap})")
    return v


def take(fields: object) -> Changes:
    """A ``CHANGES`` message's fields, checked; ``ValueError`` naming what is wrong."""
    if not isinstance(fields, dict):
        raise ValueError("its fields are not a mapping")
    files = []
    for f in _list(fields.get("files", []), "files", FILES_CAP):
        if not isinstance(f, list) or len(f) != 6:
            raise ValueError("a file entry is not [change, kind, path, size, count, link]")
        change, kind, path, size, count, link = f
        if change not in _CHANGES or kind not in _KINDS:
            raise ValueError(f"a file entry's change or kind is unknown: {shown(repr(f[:2]), line=True, limit=80)}")
        files.append(
            (
                change,
                kind,
                _text(path, "a path"),
                _count(size, "a size"),
                _count(count, "a count"),
                None if link is None else _text(link, "a link"),
            )
        )
    processes = []
    for p in _list(fields.get("processes", []), "processes", PROCESSES_CAP):
        if not isinstance(p, list) or len(p) != 2:
            raise ValueError("a process entry is not [pid, command]")
        processes.append((_count(p[0], "a pid"), _text(p[1], "a command")))
    env = []
    for e in _list(fields.get("env", []), "env", ENV_CAP):
        if not isinstance(e, list) or len(e) != 2 or e[1] not in _ENV_CHANGES:
            raise ValueError("an env entry is not [name, set|changed|removed]")
        env.append((_text(e[0], "a variable's name"), e[1]))
    cwd = fields.get("cwd")
    if cwd is not None:
        if not isinstance(cwd, list) or len(cwd) != 2:
            raise ValueError("cwd is not [before, after]")
        cwd = (_text(cwd[0], "a directory"), _text(cwd[1], "a directory"))
    umask = fields.get("umask")
    if umask is not None:
        if not isinstance(umask, list) or len(umask) != 2 or any(_count(u, "a umask") > 0o777 for u in umask):
            raise ValueError("umask is not [before, after] (each at most 0o777)")
        umask = (umask[0], umask[1])
    usage = fields.get("usage")
    cpu = peak = None
    if usage is not None:
        if not isinstance(usage, dict):
            raise ValueError("usage is not a mapping")
        raw_cpu = usage.get("cpu_s")
        if (
            not isinstance(raw_cpu, (int, float))
            or isinstance(raw_cpu, bool)
            or not math.isfinite(raw_cpu)
            or raw_cpu < 0
        ):
            raise ValueError("usage's cpu_s is not a number of seconds")
        cpu, peak = float(raw_cpu), _count(usage.get("peak_kib"), "usage's peak_kib")
    notes = [_text(n, "a note")[:500] for n in _list(fields.get("notes", []), "notes", NOTES_CAP)]
    return Changes(files, processes, env, cwd, umask, cpu, peak, notes)
