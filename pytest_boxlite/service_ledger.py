"""The ledger's record of running services: which box runs which service, on which ports.

A service fixture (:mod:`pytest_boxlite.services`) writes ``<home>/services/<box>.json`` when its
service is ready and removes it when the service stops; ``python -m pytest_boxlite ls`` shows the
record on its box's line.  The records are the host's alone: they live in the boxlite home, which
every box masks (``ledger.OwnerLock.acquire`` registers it), and nothing from a box is written into
them but what the host itself chose (names, port numbers).

A record outlives a session killed with ``kill -9``; the box it names is then a leftover, reaped
by the ledger at the next start, and :func:`prune` drops the records of boxes that are gone or
whose owner is dead (a service fixture's first use, and ``clean``).  ``ls`` shows a record only on
the line of a box that exists and whose owner lives.

No pytest here: ``python -m pytest_boxlite ls`` imports this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

from pytest_boxlite import ledger
from pytest_boxlite._homefs import HomeDir

__all__ = ["describe", "prune", "read_all", "remove", "write"]

#: Bound on one record (a name, a few ports): anything larger is not ours.
_MAX_RECORD = 16 * 1024
#: Records read by one ``ls``.
_MAX_RECORDS = 4096
_BOX = re.compile(r"^pbx-[A-Za-z0-9_-]{1,200}$")


def write(home: Path, box: str, record: dict[str, Any]) -> None:
    """Record that ``box`` runs the service ``record`` describes (atomically, never through a link)."""
    if not _BOX.match(box):
        return
    data = json.dumps(record, sort_keys=True).encode()[:_MAX_RECORD]
    # Through the home's descriptor (see _homefs): a ``services`` link is refused, never written through.
    with HomeDir.at(home, "services", create=True) as where:
        where.write(f"{box}.json", data)


def remove(home: Path, box: str) -> None:
    """Forget ``box``'s record (nothing if there is none)."""
    if _BOX.match(box):
        with contextlib.suppress(OSError), HomeDir.at(home, "services") as where:
            where.unlink(f"{box}.json")


def _read(where: HomeDir, name: str) -> dict[str, Any] | None:
    try:
        data = where.read(name, _MAX_RECORD + 1)  # a regular file of ours, never through a link
    except OSError:
        return None
    if len(data) > _MAX_RECORD:
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_all(home: Path) -> dict[str, dict[str, Any]]:
    """Every record under ``home``: box name -> record (malformed ones left out)."""
    found: dict[str, dict[str, Any]] = {}
    try:
        where = HomeDir.at(home, "services")
    except OSError:
        return found  # none, or refused (a link, another user's): nothing in it is read
    with where:
        try:
            names = sorted(os.listdir(where.fd))[:_MAX_RECORDS]
        except OSError:
            return found
        for name in names:
            box = name.removesuffix(".json")
            if name.endswith(".json") and _BOX.match(box):
                record = _read(where, name)
                if record is not None:
                    found[box] = record
    return found


def describe(record: dict[str, Any]) -> str:
    """``service=redis ports=6379->127.0.0.1:40123``: one record, for ``ls``."""
    name = str(record.get("service", "?"))[:100]
    ports = record.get("ports")
    pairs = []
    if isinstance(ports, dict):
        for port, address in list(ports.items())[:32]:
            pairs.append(f"{str(port)[:5]}->{str(address)[:60]}")
    return f"service={name}" + (f" ports={','.join(pairs)}" if pairs else "")


def prune(home: Path) -> list[str]:
    """Remove the records of boxes that are gone or whose owner is dead; returns their box names."""
    boxes = {lo.name: lo for lo in ledger.scan(Path(home))}
    dropped = []
    for box in read_all(home):
        lo = boxes.get(box)
        if lo is None or not lo.owner_alive:
            remove(home, box)
            dropped.append(box)
    return dropped
