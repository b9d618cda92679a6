"""The namespace runtime as this host sees it without opening it: doctor's facts, leftovers,
templates, and attaching to a running box (``python -m pytest_boxlite``, the ledger)."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import termios
from collections.abc import Sequence
from pathlib import Path

from pytest_boxlite import guest
from pytest_boxlite._homefs import HomeDir
from pytest_boxlite._shown import shown
from pytest_boxlite.runtimes import _cgroups
from pytest_boxlite.runtimes.base import Capabilities, Leftover, Owners
from pytest_boxlite.runtimes.namespace import provision
from pytest_boxlite.runtimes.namespace.box import attach, kept_cwd
from pytest_boxlite.runtimes.namespace.bwrap import find_bwrap
from pytest_boxlite.runtimes.namespace.layout import _read_info, ctl_dir, keep_marker
from pytest_boxlite.runtimes.namespace.leftovers import box_dirs, remove_box_state, running
from pytest_boxlite.runtimes.namespace.mounts import device_note, plan_note
from pytest_boxlite.runtimes.namespace.privileges import (
    DEFAULT_MEMORY_MIB,
    forked_box_sharing,
    plan_limits,
    seccomp_status,
    userns_problem,
)
from pytest_boxlite.spec import BoxSpec


def state_dir(home: Path) -> Path:
    """Where the namespace boxes of ``home`` live (see :class:`~.runtime.NamespaceRuntime`)."""
    return Path(home) / "namespace"


class NamespaceKind:
    """The namespace runtime's host-side operations (a :class:`~pytest_boxlite.runtimes.base.RuntimeKind`)."""

    name = "namespace"
    #: Boxes fork per test from a warm interpreter: new namespaces over the parent's mounts.
    capabilities = Capabilities(fork=True)

    def host_facts(self) -> list[tuple[str, str]]:
        """bubblewrap, user namespaces, the privilege model, seccomp, the mount plan and the limits."""
        facts: list[tuple[str, str]] = []
        bwrap, why = find_bwrap()
        facts.append(("bwrap", why))
        problem = userns_problem(bwrap) if bwrap else "no bubblewrap to try them with"
        facts.append(("user ns", "allowed" if problem is None else "FORBIDDEN: " + problem))
        if os.geteuid() == 0:
            ids = "the whole id range mapped one to one (chown, su work in a box)"
        else:
            ids = (
                f"only uid {os.getuid()} mapped, as root in a box (no chown to other ids; root-owned host dirs "
                "read-only)"
            )
        facts.append(
            (
                "privileges",
                "guest root holds Docker's default capabilities of the box's own user namespace "
                f"(no CAP_SYS_ADMIN), no_new_privs; {ids}",
            )
        )
        facts.append(("seccomp", seccomp_status()))
        if not (bwrap and problem is None):
            facts.append(("namespace", f"unavailable: {problem if bwrap else 'no usable bubblewrap'}"))
            return facts
        facts.append(("namespace", f"available: host filesystem copy-on-write{plan_note()}"))
        facts.append(("pid 1", guest.pid1_line()))
        facts.append(("devices", device_note()))
        pids = BoxSpec().pids_limit or 4096
        # A probe cgroup, made and removed at once: which caps a box would get here.
        cg = _cgroups.create(f"doctor-{os.getpid()}", memory_mib=DEFAULT_MEMORY_MIB, cpus=1, pids=pids)
        cg.remove()
        limits = plan_limits(cg, memory_mib=DEFAULT_MEMORY_MIB, cpus=1, pids=pids)
        line = f"in force: {', '.join(limits.holding) or 'none'}"
        if limits.missing:
            line += f"; NOT enforced: {'; '.join(limits.missing)} (commands and tests stay bounded by their timeouts)"
        facts.append(("limits", line))
        facts.append(("test boxes", forked_box_sharing(cg, pids=pids)))
        return facts

    def leftovers(self, home: Path, owners: Owners, *, each_box: bool = True) -> list[Leftover]:
        """Every namespace box under ``home`` (one entry per box, whatever ``each_box``)."""
        found = []
        for box_dir in box_dirs(state_dir(home)):
            owner = owners.owner_of(box_dir.name)
            found.append(
                Leftover(
                    name=box_dir.name,
                    runtime=self.name,
                    owner=owner,
                    owner_alive=owner is not None and owners.alive(owner),
                    running=running(box_dir),
                    kept=keep_marker(box_dir).exists(),
                    location=str(box_dir),
                )
            )
        return found

    def remove_leftover(self, home: Path, leftover: Leftover) -> str | None:
        """Kill the box and remove its state (host-side facts only, see :func:`remove_box_state`)."""
        if "/" in leftover.name or leftover.name in ("", ".", ".."):
            return None
        remove_box_state(state_dir(home) / leftover.name)
        return leftover.name

    def drop_templates(self, home: Path) -> list[str]:
        """Remove the templates ``--boxlite-setup`` built for ``home`` (every one :meth:`list_templates` lists)."""
        return provision.drop_templates(home)

    def list_templates(self, home: Path) -> list[str]:
        """One line per template ``--boxlite-setup`` built for ``home`` (``ls``)."""
        return [t.describe() for t in provision.list_templates(home)]

    def attach_existing(self, home: Path, name: str, argv: Sequence[str]) -> int | None:
        """Run ``argv`` in the running box ``name`` with this process's stdio, through its agent.

        From a terminal, ``argv`` runs on a pty of the box's own (:mod:`pytest_boxlite.guest.terminal`):
        its controlling terminal, so a shell has job control and Ctrl-C reaches its foreground job.
        The terminal's mode is put back here too, should the box end before the script restores it.
        A kept boxed test's box starts ``argv`` in the test's working directory (its mark records it).
        """
        box_dir = state_dir(home) / name
        if "/" in name or name in ("", ".", ".."):
            return None
        try:
            # The box's control directory, reached through no link and ours (else refused, raised).
            with HomeDir.at(home, f"namespace/{ctl_dir(box_dir).name}") as ctl:
                if not stat.S_ISSOCK(ctl.stat("agent.sock").st_mode):
                    return None
        except FileNotFoundError:
            return None
        recorded = _read_info(box_dir).get("listener_pid")
        listener = recorded if isinstance(recorded, int) and recorded > 0 else None
        cwd = _kept_cwd(home, name)
        if not (os.isatty(0) and os.isatty(1)):
            return _attach_in(box_dir, argv, listener, cwd)
        # The interpreter and this package are at the host's paths in every box (see mounts._own_dirs).
        wrapped = [sys.executable, "-I", "-S", str(guest.path("terminal")), "--", *argv]
        try:
            saved = termios.tcgetattr(0)
        except termios.error:
            saved = None
        try:
            return _attach_in(box_dir, wrapped, listener, cwd)
        finally:
            if saved is not None:
                with contextlib.suppress(termios.error):
                    termios.tcsetattr(0, termios.TCSAFLUSH, saved)


def _kept_cwd(home: Path, name: str) -> str | None:
    """The working directory recorded in box ``name``'s keep mark (see :func:`.box.kept_cwd`), or
    ``None``: the mark is read through the home's descriptors, bounded, and checked there."""
    try:
        with HomeDir.at(home, "namespace") as state:
            return kept_cwd(state.read(keep_marker(Path(name)).name, 16384))
    except OSError:  # Refused among them: no mark to use
        return None


def _attach_in(box_dir: Path, argv: Sequence[str], listener: int | None, cwd: str | None) -> int:
    """:func:`.box.attach` in ``cwd``; where the box has no such directory (the test removed it),
    in the box's default one, saying so."""
    if cwd is not None:
        try:
            return attach(box_dir, argv, cwd=cwd, listener_pid=listener)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            print(
                f"pytest-boxlite: {shown(cwd)} cannot be entered in the box: starting in its default directory",
                file=sys.stderr,
            )
    return attach(box_dir, argv, listener_pid=listener)


KIND = NamespaceKind()
