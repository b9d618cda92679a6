"""A fresh box for one test, forked from the warm interpreter (namespace runtime).

Standard library only, and :mod:`pytest_boxlite.guest.caps`.  Imported by the warm interpreter
(:mod:`pytest_boxlite.guest.worker`, :mod:`pytest_boxlite.guest.forks`) and by a zygote's agent
(:mod:`pytest_boxlite.guest.agent`).
"""

from __future__ import annotations

import ctypes
import os
import sys

from pytest_boxlite.guest.boxinit import IN_TEST, BareInit, _BoxArgs, native_init
from pytest_boxlite.guest.caps import check_libc
from pytest_boxlite.guest.ids import IdMapper, _enter_user_namespace, _map_own_ids
from pytest_boxlite.guest.layers import _mount, loopback_up, remember_warm_mounts
from pytest_boxlite.guest.linux import (
    CLONE_NEWCGROUP,
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    LIBC,
    MS_NODEV,
    MS_NOSUID,
    PR_SET_DUMPABLE,
    PR_SET_PDEATHSIG,
    SIGCHLD,
)

# Types for mypy only: a zygote's agent imports this file, and typing would cost it milliseconds.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from pytest_boxlite.guest.boxinit import Native

    #: A box's cell as :func:`take_cell` gets it: its cgroups' join files and its stderr.
    Cell = tuple[list[int], int]
    #: A cell, or what of one was received (no stderr: a garbled one, closed at once).
    SomeCell = tuple[list[int], int | None]

# --- a fresh box for one test, forked from this warm interpreter (namespace runtime) -------------
# The child gets new user, mount, uts, ipc, network and pid namespaces; every overlay the box has
# gets a new, empty upper layer, and /tmp, /workspace and /dev/shm new tmpfs, so the test sees the
# box as it was when this interpreter started, and nothing it does reaches this interpreter or the
# host.  Because the namespaces are owned by a new user namespace, every mount of the warm box
# (its layers, masks, /sys, the control directory) is locked beneath the test: it can neither
# unmount nor remount them.  Once the fresh layers are in place, a root test moves one more user
# namespace down (so its own fresh layers are locked beneath it too, and it cannot peel them off
# to reach the template's), where it is root of its own mount, uts and network namespaces; any
# other test keeps no capability at all.


#: clone(2)'s number on machines where its first argument is the flags and its second the new
#: stack (0: a copy of the caller's, as fork(2) makes).  Elsewhere :func:`clone_box` forks twice.
_SYS_CLONE = {"x86_64": 56, "aarch64": 220, "riscv64": 220, "ppc64le": 120, "ppc64": 120}
#: syscall(2) through a PyDLL: the GIL stays held across the call, as os.fork() holds it across
#: fork(2), so the child starts with the GIL that PyOS_AfterFork_Child then re-creates.  Unlike
#: fork(3), a bare clone(2) takes none of libc's locks first (malloc's, stdio's); holding the GIL
#: is what keeps them free: this interpreter's other thread (execnet's reader) runs without it only
#: inside blocking reads, never inside malloc.
_SYSCALL = ctypes.PyDLL(None, use_errno=True).syscall
_SYSCALL.restype = ctypes.c_long
_SYSCALL.argtypes = [ctypes.c_long] * 6


def _threads() -> frozenset[str] | None:
    try:
        return frozenset(os.listdir("/proc/self/task"))
    except OSError:
        return None


#: The threads this interpreter had when this file ran (before any test code was imported): its
#: own and execnet's.  A thread started later (by a conftest, a test module, a C library) may run
#: without the GIL inside malloc, holding a lock a bare clone(2) would copy locked into the box
#: (that box would hang): with any such thread alive, boxes are made with fork(3), which takes
#: libc's locks first.
_KNOWN_THREADS = _threads()


def _only_known_threads() -> bool:
    now = _threads()
    return now is not None and _KNOWN_THREADS is not None and now <= _KNOWN_THREADS


# --- no GIL drop request may be pending when clone(2) copies this interpreter ---------------------
# A thread that waits for the GIL longer than the switch interval (5 ms) sets the interpreter's
# "drop request"; the holder gives the GIL up at its next check of the eval breaker and, with a
# request pending, waits in drop_gil until another thread has taken it (CPython's FORCE_SWITCHING).
# os.fork() calls PyOS_AfterFork_Child in C right after fork(2), before any bytecode runs, and that
# re-creates the GIL and clears the request (take_gil resets it).  Our clone(2) goes through
# ctypes: the child comes back into the eval loop first, and the CALL that made the system call
# checks the eval breaker as it returns.  So when execnet's reader woke with data during the clone
# (copying a large interpreter's page tables takes milliseconds) and set the request, the child
# dropped the GIL there and waited forever for a thread it does not have (pid 1 of the box, one
# thread, in eval_frame_handle_pending -> drop_gil -> pthread_cond_wait; its thread list still
# held the reader's state: PyOS_AfterFork_Child never ran).  Clearing the request in the child is
# impossible (no bytecode runs before that check), so none may be pending at the clone, nor be set
# during it: see _hold_off_gil_requests.

#: The switch interval while a box is cloned: no wait for the GIL that starts after it is set can
#: time out (and ask for the GIL) before the clone is over.
_HOLD_OFF_INTERVAL = 30.0
#: futex(2)'s number: the GIL's waits (its condition variable and mutex) block in it.
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "riscv64": 98, "ppc64le": 221, "ppc64": 221}
#: How many times the other threads are looked at (the GIL given up between) before the box is
#: made with fork(3) instead (safe: os.fork runs PyOS_AfterFork_Child before any bytecode).
_HOLD_OFF_TRIES = 50


def _off_the_gil(futex: int, me: str) -> bool:
    """Whether every other thread of this process is blocked in a system call that is no futex
    wait (execnet's reader in its read(2)), as the kernel says: then none is waiting for the GIL."""
    for tid in os.listdir("/proc/self/task"):
        if tid == me:
            continue
        fd = os.open("/proc/self/task/%s/syscall" % tid, os.O_RDONLY)
        try:
            first = os.read(fd, 64).split(b" ", 1)[0]
        finally:
            os.close(fd)
        # "running" (not blocked: it may be about to ask for the GIL), or blocked in a futex.
        if not first.isdigit() or int(first) == futex:
            return False
    return True


def _hold_off_gil_requests() -> float | None:
    """The switch interval to restore once cloned (in the parent right after clone(2), in the child
    right after PyOS_AfterFork_Child), with none of this process's threads able to have a GIL drop
    request pending at the clone or to set one during it; ``None`` where that cannot be made sure
    (the caller forks with fork(3) instead).

    The long interval first: a wait for the GIL that starts after it cannot time out during the
    clone.  Then each other thread must be seen blocked outside the GIL's waits (in its read(2)),
    so every wait it starts from then on is a long one; any request it set before was cleared as
    it took the GIL on its way back to that read, and one this thread set is cleared as it takes
    the GIL back after looking (take_gil clears it).  Not a matter of timing: a thread woken from
    an old 5 ms wait but not yet run reads as "running", never as blocked.  Until all are seen so
    the GIL is given up (os.sched_yield) for them to get on.  Costs one read of /proc per other
    thread (about 10 us) when they are idle.
    """
    futex = _SYS_FUTEX.get(os.uname().machine)
    if futex is None:
        return None
    me = os.readlink("/proc/thread-self").rsplit("/", 1)[-1]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(_HOLD_OFF_INTERVAL)
    try:
        for _ in range(_HOLD_OFF_TRIES):
            if _off_the_gil(futex, me):
                return interval
            os.sched_yield()  # releases the GIL (time.sleep(0) costs ~100 us: timer slack)
    except OSError:
        pass  # no /proc view of the threads here: fork(3)'s path
    sys.setswitchinterval(interval)
    return None


def box_flags(network: bool) -> int:
    """The namespaces of a fresh box.  Root gets its network namespace one level down, in the
    test process (see :func:`enter_test_namespaces`)."""
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID
    if not network and os.geteuid() != 0:
        flags |= CLONE_NEWNET
    return flags


def sandbox_flags(network: bool) -> int:
    """The namespaces of a sandbox box that a zygote agent forks (see guest/agent.py): every one
    a booted box has of its own, the network included unless the spec shares the host's.  Unlike
    a test's box (:func:`box_flags`), its pid 1 is the agent, root of the new user namespace, so
    it owns the new network namespace as bubblewrap's agent owns a booted box's."""
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID
    return flags if network else flags | CLONE_NEWNET


def clone_box(
    network: bool,
    mapper: IdMapper | None = None,
    real_root: bool = False,
    flags: int | None = None,
    cell: Cell | None = None,
    init: BareInit | None = None,
) -> int:
    """``os.fork()`` into a fresh box's new namespaces: the child's pid in the parent; 0 in the
    child, which is pid 1 of its new pid namespace with its ids mapped (root: through ``mapper``,
    an :class:`IdMapper` the parent serves; anyone else maps their own).  ``flags``: the
    namespaces, when not :func:`box_flags`'s (a sandbox box forked by a zygote agent).

    One clone(2) with the namespace flags: no intermediate process.  fork(2) then unshare(2)
    would need one, since unsharing a pid namespace moves only the caller's later children, and
    every extra copy of this large interpreter costs milliseconds to make and to tear down.
    That path stays for machines whose clone(2) number this file does not know, and for an
    interpreter that has started threads of its own (see :data:`_KNOWN_THREADS`).

    ``cell``: what :func:`take_cell` got from the host for this box (its cgroups' join files and
    its stderr): the child enters them before anything else; the parent closes them.

    ``init``: a :class:`BareInit`, for a test's box: pid 1 forks the box's test process at once,
    before anything else, and is that init from then on; the test process takes the steps pid 1
    took (its cell, its ids) and gets :data:`IN_TEST`.  Where the box is made the other way (see
    above) it has no effect: 0 is returned in pid 1, which forks its test process itself.
    """
    flags = box_flags(network) if flags is None else flags
    remember_warm_mounts()  # the box's fresh_box takes the table instead of reading its own
    if real_root:
        # A VM's root makes the box's layers as root of its own kernel, in no new user namespace:
        # mounts of a new user namespace's are locked, and an overlay cannot take a directory
        # with locked mounts beneath it (its disk's /etc with the runtime's /etc/hosts) as its
        # lower layer.  The test process still moves one user namespace down
        # (enter_test_namespaces), so every layer is locked beneath the test all the same.
        flags &= ~CLONE_NEWUSER
    uid, gid = os.geteuid(), os.getegid()
    number = _SYS_CLONE.get(os.uname().machine)
    # No GIL drop request may be pending at the clone (see _hold_off_gil_requests): else the child
    # hangs before PyOS_AfterFork_Child.
    interval = _hold_off_gil_requests() if number is not None and _only_known_threads() else None
    if interval is None:
        return _clone_box_by_forks(flags, mapper, real_root, cell)
    api = ctypes.pythonapi
    native = native_init() if init is not None and not real_root else None
    if native is not None and init is not None:
        return _clone_box_native(native, flags, mapper, cell, init, interval, uid, gid)
    api.PyOS_BeforeFork()
    pid: int = _SYSCALL(number, flags | SIGCHLD, 0, 0, 0, 0)
    err = ctypes.get_errno()
    if pid != 0:
        sys.setswitchinterval(interval)
        api.PyOS_AfterFork_Parent()
        _close_cell(cell)
        if pid < 0:
            raise OSError(err, "clone: %s%s" % (os.strerror(err), _why_no_process(err)))
        if mapper is not None:
            mapper.born_in_namespace = True
        return pid
    if init is not None:
        # Pid 1: before the interpreter's after-fork work (its hooks, the other threads' states:
        # hundreds of pages copied), fork the test process, which does that work once, for both.
        # Nothing raised here may reach the caller: pid 1 would return into the warm
        # interpreter's loop (a signal the warm interpreter had pending runs its handler here).
        try:
            init.seal()
            test = _SYSCALL(number, SIGCHLD, 0, 0, 0, 0)
        except BaseException:
            os._exit(70)
        if test != 0:
            init.run(test)  # never returns
    api.PyOS_AfterFork_Child()
    sys.setswitchinterval(interval)
    if real_root:
        _or_exit(die_with_parent)
    elif init is not None:
        # The test process, as pid 1's copy it is dumpable no more (it sealed itself first): the
        # test's own process is dumpable, as locally.
        _or_exit(check_libc, LIBC.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
        _or_exit(_in_new_box, uid, gid, mapper, None, cell)
        return IN_TEST
    else:
        _or_exit(_in_new_box, uid, gid, mapper, None, cell)
    return 0


def _clone_box_native(
    native: Native,
    flags: int,
    mapper: IdMapper | None,
    cell: Cell | None,
    init: BareInit,
    interval: float,
    uid: int,
    gid: int,
) -> int:
    """:func:`clone_box` for a test's box, with the native pid 1 (see above)."""
    fn, init_fd = native
    a = _BoxArgs()
    a.flags = flags
    a.init_fd = init_fd
    a.proc_fd = -1
    if mapper is not None:
        maps = mapper.id_maps()
        a.proc_fd = mapper.proc
        a.uid_map, a.gid_map = maps["uid"].encode(), maps["gid"].encode()
    a.mask = init.signal_bits
    close = (ctypes.c_int * max(1, len(init.close)))(*init.close)
    a.close_fds, a.n_close = close, len(init.close)
    a.nested_ready = a.nested_done = -1
    if init.nested is not None:
        a.nested_ready, a.nested_done = init.nested.ready_r, init.nested.done_w
        a.nested_uid_map, a.nested_gid_map = init.maps.get("uid", b""), init.maps.get("gid", b"")
    api = ctypes.pythonapi
    api.PyOS_BeforeFork()
    pid: int = fn(ctypes.byref(a))
    if pid != 0:
        sys.setswitchinterval(interval)
        api.PyOS_AfterFork_Parent()
        _close_cell(cell)
        if pid < 0:
            raise OSError(-pid, "clone: %s%s" % (os.strerror(-pid), _why_no_process(-pid)))
        if mapper is not None:
            mapper.born_in_namespace = mapper.written = True
        return pid
    # The test process: a copy of this interpreter made by the box's pid 1 (boxinit by now).
    api.PyOS_AfterFork_Child()
    sys.setswitchinterval(interval)
    _or_exit(_in_new_box, uid, gid, mapper, None, cell)
    return IN_TEST


# --- a forked box's cell: its own stderr and cgroups, from the host, before the fork ---------------
# The warm interpreter's stderr (the host drains it into the warm box's log) must not be shared with
# the boxes forked from it: each gets a pipe of its own, drained by the host for its own reports.
# And each joins cgroups of its own (the host opened their files), so that what one test leaves
# running (threads, memory) counts against its own caps, never the next box's.


def _fd_identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


#: The warm interpreter's stderr as it started (before pytest's capture and terminal writer dup it):
#: every descriptor a forked box inherits on it is pointed at the box's own stderr instead.
_WARM_STDERR = _fd_identity(2)
#: The connection on which the host deals cells, and cells dealt ahead of their FORK.
_CELLS: dict[str, Any] = {"conn": None, "got": {}}


def take_cell(cell: dict[str, Any], timeout: float = 10.0) -> Cell:
    """In the warm interpreter, on a FORK that names ``cell`` (``{"sock", "name", "joins"}``): the
    descriptors the host dealt for that box, ``(join files, stderr)``.  Connects on first use."""
    import json
    import socket
    import time

    name = str(cell["name"])
    got = _CELLS["got"]
    deadline = time.monotonic() + timeout
    while name not in got:
        if _CELLS["conn"] is None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(timeout)
            try:
                conn.connect(str(cell["sock"]))
            except OSError:
                conn.close()
                raise
            _CELLS["conn"] = conn
        conn = _CELLS["conn"]
        left = deadline - time.monotonic()
        if left <= 0:
            raise OSError(110, "the host handed no cgroups and log for box %s in %.0f s" % (name, timeout))
        conn.settimeout(left)
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn, 4096, 16)
        except OSError:
            drop_cells()
            raise
        try:
            head = json.loads(data.decode())
            joins = int(head["joins"])
            if not fds or not 0 <= joins < len(fds):
                raise ValueError(head)
            got[str(head["cell"])] = (fds[:joins], fds[joins])
        except (ValueError, KeyError, TypeError):
            _close_cell((fds, None))
            drop_cells()
            raise OSError(71, "the host's cell for box %s was garbled" % name) from None
        while len(got) > 16:  # cells of FORKs that never came (bounded)
            _close_cell(got.pop(next(iter(got))))
    dealt: Cell = got.pop(name)
    return dealt


def _cell_fds(cell: SomeCell) -> list[int]:
    joins, err = cell
    return [fd for fd in (*joins, err) if fd is not None]


def _close_cell(cell: SomeCell | None) -> None:
    if cell is None:
        return
    for fd in _cell_fds(cell):
        try:
            os.close(fd)
        except OSError:
            pass


def held_cell_fds(cell: Cell | None) -> list[int]:
    """Every descriptor of the host's cells this process holds: ``cell`` (a box's, from
    :func:`take_cell`; ``None``: none), the cell connection and the cells dealt ahead.  What a
    forked box's pid 1 closes (:class:`BareInit`), as :func:`_enter_cell` and :func:`drop_cells`
    close them in the process that enters the cell."""
    fds = _cell_fds(cell) if cell is not None else []
    conn = _CELLS["conn"]
    if conn is not None:
        fds.append(conn.fileno())
    for other in _CELLS["got"].values():
        fds.extend(_cell_fds(other))
    return fds


def drop_cells() -> None:
    """Close the host's cell connection and every cell dealt ahead (in the warm interpreter after
    an error; in a forked box always: a test must never take the next box's cgroups or log)."""
    conn = _CELLS["conn"]
    _CELLS["conn"] = None
    if conn is not None:
        conn.close()
    got = _CELLS["got"]
    while got:
        _close_cell(got.pop(next(iter(got))))


def _enter_cell(cell: Cell) -> None:
    """In a forked box's first process: its own stderr first (so whatever fails next is said in
    the box's own log), then its own cgroups; nothing of other cells stays open."""
    joins, err = cell
    _own_stderr(err)
    for fd in joins:
        try:
            os.write(fd, b"0")  # "0": this process; on cgroup v1's tasks, this thread alone
        finally:
            os.close(fd)
    drop_cells()


def _own_stderr(fd: int) -> None:
    """Point fd 2 and every other descriptor on the warm interpreter's stderr (pytest's saved
    copy, the terminal writer's duplicate) at ``fd``, the box's own stderr; then close ``fd``."""
    targets = {2}
    if _WARM_STDERR is not None:
        for name in os.listdir("/proc/self/fd"):
            n = int(name)
            if n != fd and _fd_identity(n) == _WARM_STDERR:
                targets.add(n)
    for n in sorted(targets):
        os.dup2(fd, n, inheritable=n <= 2 or os.get_inheritable(n))
    os.close(fd)


def _why_no_process(err: int | None) -> str:
    """What a refused clone or fork (``EAGAIN``) means in a box, for the host's report."""
    if err != 11:
        return ""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY:
        return (
            " (the box's process limit, RLIMIT_NPROC %d, is reached: this host gives the boxes no pids "
            "cgroups of their own, so every process of the warm box and of the boxes forked from it "
            "counts against it, those an earlier test left running included)" % soft
        )
    return " (the warm box's pids cgroup is full: processes of earlier boxes still count against it)"


def seal_init() -> None:
    """In a forked box's pid 1, once its test process is forked: nothing in the box may ptrace it
    or open its descriptors through /proc (it holds the box's connection set-up, the id mapper)."""
    check_libc(LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


def _or_exit(step: Callable[..., object], *args: Any) -> None:
    """``step(*args)``, or exit: a child that raised would return into the warm interpreter's
    loop with its channel still open (and speak on it as a second warm interpreter)."""
    try:
        step(*args)
    except BaseException as exc:
        sys_stderr_write("pytest-boxlite: the fresh box could not start: %r\n" % (exc,))
        os._exit(70)


def die_with_parent() -> None:
    import signal

    check_libc(LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")


def _in_new_box(
    uid: int, gid: int, mapper: IdMapper | None, flags: int | None = None, cell: Cell | None = None
) -> None:
    """The child's first steps into its new user namespace: die with its parent, enter its cell
    (``cell``: its own stderr and cgroups, see :func:`take_cell`), map its ids.

    ``flags``: the namespaces it has still to unshare (fork(3)'s path); ``None``: clone(2) made
    it in them already.
    """
    die_with_parent()
    if cell is not None:
        _enter_cell(cell)
    if uid != 0:
        if flags is not None:
            check_libc(LIBC.unshare(flags), "unshare")
        _map_own_ids(uid, gid)
    elif mapper is None:
        raise OSError(1, "a root box needs its parent to write its id maps (no IdMapper given)")
    else:
        # Root: unshares (unless born in the namespace), then waits for the maps its parent writes.
        mapper.request(LIBC, None if flags is None else flags & ~CLONE_NEWUSER)
    if cell is not None and cell[0]:
        # A cgroup namespace whose root is the box's own cgroup (as bubblewrap gives a booted box).
        check_libc(LIBC.unshare(CLONE_NEWCGROUP), "unshare(CLONE_NEWCGROUP)")


def _clone_box_by_forks(flags: int, mapper: IdMapper | None, real_root: bool = False, cell: Cell | None = None) -> int:
    """:func:`clone_box` where this module knows no clone(2) number: fork, unshare, fork pid 1.

    The process in between waits for pid 1 and exits as it exits (a signal that killed pid 1 kills
    it too), so the parent sees the box's status either way.
    """
    uid, gid = os.geteuid(), os.getegid()
    try:
        pid = os.fork()
    except OSError as exc:
        _close_cell(cell)
        raise OSError(exc.errno, "fork: %s%s" % (exc.strerror, _why_no_process(exc.errno))) from None
    if pid:
        _close_cell(cell)
        return pid
    code = 70
    try:
        import signal

        if real_root:
            die_with_parent()
            check_libc(LIBC.unshare(flags), "unshare")
        else:
            _in_new_box(uid, gid, mapper, flags, cell)
        child = os.fork()
        if child == 0:
            _or_exit(die_with_parent)
            return 0
        _, status = os.waitpid(child, 0)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            try:
                signal.signal(-code, signal.SIG_DFL)
            except (OSError, ValueError):
                pass  # SIGKILL and SIGSTOP cannot be handled, so need no reset
            os.kill(os.getpid(), -code)
    except BaseException as exc:
        sys_stderr_write("pytest-boxlite: the fresh box could not start: %r\n" % (exc,))
    os._exit(code)


def sys_stderr_write(text: str) -> None:
    import sys

    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # no stderr left to say it on: the exit status says it


def enter_test_namespaces(network: bool, mapper: IdMapper | None = None) -> None:
    """In the test process, forked by the box's pid 1: root moves one user namespace further
    down, as root of it (``mapper``: an :class:`IdMapper` pid 1 serves), so every mount made so far
    (the fresh layers included) is locked beneath it, while the hostname, its own mounts and its
    network namespace (low ports, loopback) are its own to change, as on a machine of its own."""
    if os.geteuid() != 0:
        return
    _enter_user_namespace(LIBC, CLONE_NEWNS | CLONE_NEWUTS | (0 if network else CLONE_NEWNET), mapper)
    if not network:
        loopback_up()


def fork_refused() -> str | None:
    """Why this kernel refuses a fresh box's namespaces (asked in a child that tries them and a
    tmpfs in them), or ``None``.  Bounded: the child is killed after 10 s."""
    import select
    import signal

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        refused = b""
        try:
            flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET
            check_libc(LIBC.unshare(flags), "unshare of the fresh box's namespaces")
            _mount(LIBC, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700")
        except BaseException as exc:
            refused = str(exc).encode()[:500] or repr(exc).encode()[:500]
        os.write(w, refused)
        os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 10.0)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            return "the probe of the fresh box's namespaces did not answer within 10 s"
        why = os.read(r, 1000).decode("utf-8", "replace")
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return why or None
