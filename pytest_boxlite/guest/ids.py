"""A fresh box's user namespace: its ids, mapped one to one (root's by its parent).

Standard library only.  Imported by :mod:`pytest_boxlite.guest.fresh` (the box's first steps),
:mod:`pytest_boxlite.guest.forks` and a zygote's agent (which serve the maps of the boxes they fork).
"""

from __future__ import annotations

import os

from pytest_boxlite.guest.caps import check_libc
from pytest_boxlite.guest.linux import CLONE_NEWUSER

# Types for mypy only: a zygote's agent imports this file, and typing would cost it milliseconds.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def _write(path: str, data: str, dir_fd: int | None = None) -> None:
    fd = os.open(path, os.O_WRONLY, dir_fd=dir_fd)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


class IdMapper:
    """The id maps of a child that enters a new user namespace as root, written by its parent.

    Mapping every id of this namespace (not only one's own) takes CAP_SETUID in the parent user
    namespace, which the child gives up by unsharing: the process that stays behind writes them.
    The parent that forks the child anyway does it (the warm interpreter for the box's pid 1, and
    pid 1 for the root test process's nested namespace), so no helper process is started per box.
    Made before the fork; then :meth:`serve` in the parent and :meth:`request` in the child.
    """

    #: Bound on the parent's wait for the child to unshare: a child that dies first closes its pipe
    #: end and ends the wait at once; this is only for a child that hangs before it gets there.
    TIMEOUT = 30.0

    def __init__(self, proc: bool = True) -> None:
        # /proc as the parent sees it now, held open: the child may mount its own /proc over it
        # (in a mount namespace the parent shares) before it asks, where the child's pid, as the
        # parent knows it, means another process or none.  (``proc=False``: a :class:`BareInit`
        # serves it, in the box's own /proc.)
        self.proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if proc else None
        #: The maps to write (:func:`_id_maps`), once worked out.
        self.maps: dict[str, str] | None = None
        self.ready_r, self.ready_w = os.pipe()
        self.done_r, self.done_w = os.pipe()
        #: Set by clone_box: the child was born in its user namespace, so the maps can be written
        #: at once, without waiting for it to say it has unshared.
        self.born_in_namespace = False
        #: Set by clone_box: the native helper (:func:`native_init`) wrote the maps already; only
        #: the child's go-ahead is left to send.
        self.written = False

    def close_parent_side(self) -> None:
        for fd in (self.ready_r, self.done_w, self.proc):
            if fd is not None:
                os.close(fd)

    def fds(self) -> tuple[int, ...]:
        """Every descriptor of this mapper's (both sides)."""
        return tuple(fd for fd in (self.ready_r, self.ready_w, self.done_r, self.done_w, self.proc) if fd is not None)

    def id_maps(self) -> dict[str, str]:
        """The maps this mapper writes (:func:`_id_maps`), worked out once."""
        if self.maps is None:
            self.maps = _id_maps(self.proc)
        return self.maps

    def close_child_side(self) -> None:
        for fd in (self.ready_w, self.done_r):
            os.close(fd)

    def serve(self, pid: int) -> None:
        """In the parent, after the fork: map ``pid``'s new namespace when it asks.  Never raises:
        a child that died or hung before asking fails on its own (its end of the pipe closes)."""
        import select

        self.close_child_side()
        try:
            if not self.born_in_namespace:
                ready, _, _ = select.select([self.ready_r], [], [], self.TIMEOUT)
                if not ready or os.read(self.ready_r, 2) != b"u\n":
                    return  # the child ended (or hung) before unsharing: it reports that itself
            if not self.written:
                maps = self.id_maps()
                for which in ("uid", "gid"):
                    _write("%d/%s_map" % (pid, which), maps[which], dir_fd=self.proc)
            os.write(self.done_w, b"m\n")
        except OSError:
            pass  # the child dies without its maps (its read ends empty) and says so
        finally:
            self.close_parent_side()

    def request(self, libc: Any, flags: int | None = None) -> None:
        """In the child: unshare(CLONE_NEWUSER | flags) (``None``: it is in its new user namespace
        already, made by :func:`clone_box`), have the parent write the maps, become root."""
        self.close_parent_side()
        try:
            if flags is not None:
                check_libc(libc.unshare(CLONE_NEWUSER | flags), "unshare")
                os.write(self.ready_w, b"u\n")  # born in it (clone_box), the parent does not wait
            if os.read(self.done_r, 2) != b"m\n":
                raise OSError(1, "could not map ids into the fresh box's user namespace")
        finally:
            self.close_child_side()
        # Become root of the new namespace for real (ids were unmapped until now).
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)


def _id_maps(proc: int | None) -> dict[str, str]:
    """The id maps for the new user namespace: the ids of this one, one to one (``proc``: a
    descriptor of this process's /proc)."""
    lines: dict[str, str] = {}
    for which in ("uid", "gid"):
        with open(os.open("self/%s_map" % which, os.O_RDONLY, dir_fd=proc)) as fh:
            rows = [line.split() for line in fh if line.strip()]
        lines[which] = "".join("%s %s %s\n" % (r[0], r[0], r[2]) for r in rows)
    return lines


def _map_own_ids(uid: int, gid: int) -> None:
    """In a new user namespace, as anyone but root: map one's own uid and gid, written by oneself."""
    _write("/proc/self/uid_map", "%d %d 1\n" % (uid, uid))
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/gid_map", "%d %d 1\n" % (gid, gid))


def _enter_user_namespace(libc: Any, flags: int, mapper: IdMapper | None = None) -> None:
    """unshare(CLONE_NEWUSER | flags) with this process's ids mapped one to one.

    Root maps every id this namespace has, written by its parent through ``mapper`` (an
    :class:`IdMapper` made before the fork); anyone else maps their own uid and gid, written by
    themselves.
    """
    if os.geteuid() != 0:
        uid, gid = os.geteuid(), os.getegid()
        check_libc(libc.unshare(CLONE_NEWUSER | flags), "unshare")
        _map_own_ids(uid, gid)
        return
    if mapper is None:
        raise OSError(1, "a root box needs its parent to write its id maps (no IdMapper given)")
    mapper.request(libc, flags)
