"""A fresh box for one test, forked from the warm interpreter (namespace runtime).

Standard library only.  Shipped into the box together with :mod:`pytest_boxlite.guest.worker`
(the host sends both sources to the box's interpreter in one ``remote_exec``), so it imports nothing
of the package.
"""

import ctypes
import gc
import os
import sys

# check_libc and limit_caps come from guest/caps.py, which the host sends ahead of this file in the
# same remote_exec (this file imports nothing of the package).

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

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWPID = 0x20000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MS_REC, _MS_PRIVATE = 16384, 1 << 18
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_CLONE_NEWCGROUP = 0x02000000
#: Parts of /proc a box must not write (host-wide sysctls...): read-only, as bubblewrap does.
_PROC_COVERS = ("sys", "sysrq-trigger", "irq", "bus", "fs")


#: The C library, opened once in the warm interpreter (ctypes is imported at load time for the same
#: reason): every forked box would otherwise pay the import and the dlopen (several ms) itself.
_LIBC = ctypes.CDLL(None, use_errno=True)
#: The same library through a PyDLL: its calls keep the GIL held (see :class:`BareInit`).
_PYLIBC = ctypes.PyDLL(None, use_errno=True)


def _libc():
    return _LIBC


def _mount(libc, src, target, fstype, flags, data):
    enc = lambda v: v.encode() if v is not None else None  # noqa: E731
    check_libc(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), "mount %s" % target)  # noqa: F821 - caps.py


def _mounts():
    """``(mount point, fstype)`` of every mount this process sees, in mount order."""
    return [(point, fstype) for point, fstype, _, _ in _mount_table()]


#: ``xino=on``: every file of an overlay reports the overlay's device, as its directory does (with
#: its layers on two file systems and xino off, a file reports its layer's, and os.path.ismount()
#: says True of it).  Emptied where the kernel does not know the option (before 4.17).
_XINO = [",xino=on"]


#: ``[True]`` when a fresh box must keep a handle on its upper layers (guest/changes.py reads what
#: the test wrote there); each is then in :data:`LAYERS` as ``(target, lower, fd)``.  The stage that
#: holds them is hidden by the box's new /run; the box's test holds only these descriptors.
KEEP_LAYERS = [False]
LAYERS = []


def _overlay(libc, lower, target, stage, n):
    """A new overlay on ``target`` over ``lower``, with an empty upper layer in ``stage``."""
    upper, work = "%s/u%s" % (stage, n), "%s/w%s" % (stage, n)
    os.mkdir(upper)
    os.mkdir(work)
    if KEEP_LAYERS[0]:
        LAYERS.append((target, lower, os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)))
    opts = "lowerdir=%s,upperdir=%s,workdir=%s,userxattr" % (lower, upper, work)
    try:
        _mount(libc, "overlay", target, "overlay", 0, opts + _XINO[0])
    except OSError as exc:
        if not _XINO[0] or exc.errno != 22:
            raise
        _mount(libc, "overlay", target, "overlay", 0, opts)  # raises if xino was not the reason
        _XINO[0] = ""


def _renewed_overlays(table):
    """The writable overlays of ``table`` (:func:`_mount_table`): each gets a new upper layer in a
    fresh box.  A read-only one (a host directory holding other mounts, shown as a snapshot with
    its sub-directories as overlays of their own: see the runtime's mounts.py) is kept whole: no
    box can write to it, and overlayfs refuses a lower directory with locked mounts beneath it."""
    return [m for m, fs, _, sopts in table if fs == "overlay" and "ro" not in sopts]


def _write(path, data, dir_fd=None):
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

    def __init__(self, proc=True):
        # /proc as the parent sees it now, held open: the child may mount its own /proc over it
        # (in a mount namespace the parent shares) before it asks, where the child's pid, as the
        # parent knows it, means another process or none.  (``proc=False``: a :class:`BareInit`
        # serves it, in the box's own /proc.)
        self.proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if proc else None
        #: The maps to write (:func:`_id_maps`), once worked out.
        self.maps = None
        self.ready_r, self.ready_w = os.pipe()
        self.done_r, self.done_w = os.pipe()
        #: Set by clone_box: the child was born in its user namespace, so the maps can be written
        #: at once, without waiting for it to say it has unshared.
        self.born_in_namespace = False
        #: Set by clone_box: the native helper (:func:`native_init`) wrote the maps already; only
        #: the child's go-ahead is left to send.
        self.written = False

    def close_parent_side(self):
        for fd in (self.ready_r, self.done_w, self.proc):
            if fd is not None:
                os.close(fd)

    def fds(self):
        """Every descriptor of this mapper's (both sides)."""
        return tuple(fd for fd in (self.ready_r, self.ready_w, self.done_r, self.done_w, self.proc) if fd is not None)

    def id_maps(self):
        """The maps this mapper writes (:func:`_id_maps`), worked out once."""
        if self.maps is None:
            self.maps = _id_maps(self.proc)
        return self.maps

    def close_child_side(self):
        for fd in (self.ready_w, self.done_r):
            os.close(fd)

    def serve(self, pid):
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

    def request(self, libc, flags=None):
        """In the child: unshare(CLONE_NEWUSER | flags) (``None``: it is in its new user namespace
        already, made by :func:`clone_box`), have the parent write the maps, become root."""
        self.close_parent_side()
        try:
            if flags is not None:
                check_libc(libc.unshare(_CLONE_NEWUSER | flags), "unshare")  # noqa: F821 - caps.py
                os.write(self.ready_w, b"u\n")  # born in it (clone_box), the parent does not wait
            if os.read(self.done_r, 2) != b"m\n":
                raise OSError(1, "could not map ids into the fresh box's user namespace")
        finally:
            self.close_child_side()
        # Become root of the new namespace for real (ids were unmapped until now).
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)


def _id_maps(proc):
    """The id maps for the new user namespace: the ids of this one, one to one (``proc``: a
    descriptor of this process's /proc)."""
    lines = {}
    for which in ("uid", "gid"):
        with open(os.open("self/%s_map" % which, os.O_RDONLY, dir_fd=proc)) as fh:
            rows = [line.split() for line in fh if line.strip()]
        lines[which] = "".join("%s %s %s\n" % (r[0], r[0], r[2]) for r in rows)
    return lines


def _map_own_ids(uid, gid):
    """In a new user namespace, as anyone but root: map one's own uid and gid, written by oneself."""
    _write("/proc/self/uid_map", "%d %d 1\n" % (uid, uid))
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/gid_map", "%d %d 1\n" % (gid, gid))


def _enter_user_namespace(libc, flags, mapper=None):
    """unshare(CLONE_NEWUSER | flags) with this process's ids mapped one to one.

    Root maps every id this namespace has, written by its parent through ``mapper`` (an
    :class:`IdMapper` made before the fork); anyone else maps their own uid and gid, written by
    themselves.
    """
    if os.geteuid() != 0:
        uid, gid = os.geteuid(), os.getegid()
        check_libc(libc.unshare(_CLONE_NEWUSER | flags), "unshare")  # noqa: F821 - caps.py
        _map_own_ids(uid, gid)
        return
    if mapper is None:
        raise OSError(1, "a root box needs its parent to write its id maps (no IdMapper given)")
    mapper.request(libc, flags)


_SIGCHLD = 17
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


def _threads():
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


def _only_known_threads():
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


def _off_the_gil(futex, me):
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


def _hold_off_gil_requests():
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


def box_flags(network):
    """The namespaces of a fresh box.  Root gets its network namespace one level down, in the
    test process (see :func:`enter_test_namespaces`)."""
    flags = _CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWUTS | _CLONE_NEWIPC | _CLONE_NEWPID
    if not network and os.geteuid() != 0:
        flags |= _CLONE_NEWNET
    return flags


def sandbox_flags(network):
    """The namespaces of a sandbox box that a zygote agent forks (see guest/agent.py): every one
    a booted box has of its own, the network included unless the spec shares the host's.  Unlike
    a test's box (:func:`box_flags`), its pid 1 is the agent, root of the new user namespace, so
    it owns the new network namespace as bubblewrap's agent owns a booted box's."""
    flags = _CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWUTS | _CLONE_NEWIPC | _CLONE_NEWPID
    return flags if network else flags | _CLONE_NEWNET


def clone_box(network, mapper=None, real_root=False, flags=None, cell=None, init=None):
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
    if real_root:
        # A VM's root makes the box's layers as root of its own kernel, in no new user namespace:
        # mounts of a new user namespace's are locked, and an overlay cannot take a directory
        # with locked mounts beneath it (its disk's /etc with the runtime's /etc/hosts) as its
        # lower layer.  The test process still moves one user namespace down
        # (enter_test_namespaces), so every layer is locked beneath the test all the same.
        flags &= ~_CLONE_NEWUSER
    uid, gid = os.geteuid(), os.getegid()
    number = _SYS_CLONE.get(os.uname().machine)
    # No GIL drop request may be pending at the clone (see _hold_off_gil_requests): else the child
    # hangs before PyOS_AfterFork_Child.
    interval = _hold_off_gil_requests() if number is not None and _only_known_threads() else None
    if interval is None:
        return _clone_box_by_forks(flags, mapper, real_root, cell)
    api = ctypes.pythonapi
    native = native_init() if init is not None and not real_root else None
    if native is not None:
        return _clone_box_native(native, flags, mapper, cell, init, interval, uid, gid)
    api.PyOS_BeforeFork()
    pid = _SYSCALL(number, flags | _SIGCHLD, 0, 0, 0, 0)
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
            test = _SYSCALL(number, _SIGCHLD, 0, 0, 0, 0)
        except BaseException:
            os._exit(70)
        if test != 0:
            init.run(test)  # never returns
    api.PyOS_AfterFork_Child()
    sys.setswitchinterval(interval)
    if real_root:
        _or_exit(_die_with_parent)
    elif init is not None:
        # The test process, as pid 1's copy it is dumpable no more (it sealed itself first): the
        # test's own process is dumpable, as locally.
        _or_exit(check_libc, _LIBC.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")  # noqa: F821 - caps.py
        _or_exit(_in_new_box, uid, gid, mapper, None, cell)
        return IN_TEST
    else:
        _or_exit(_in_new_box, uid, gid, mapper, None, cell)
    return 0


#: What :func:`clone_box` returns in the test process of a box whose pid 1 forked it (``init``).
IN_TEST = -1
_SIG_BLOCK, _WNOHANG, _SIGKILL = 0, 1, 9


class BareInit:
    """Pid 1 of a test's box, as it runs once it has forked the test process (see
    :func:`clone_box`): it forwards ``signals`` to the test process, reaps whatever else ends in
    the box, serves the id maps of a root test's nested user namespace (``nested``, an
    :class:`IdMapper` made with ``proc=False``, and ``maps``, what to write), and exits as the test
    process exits (128+N when a signal N killed it: pid 1 cannot die by a signal it sends itself;
    the host reads it back that way).

    It is made in the warm interpreter, with all it needs ready: pid 1 is a copy of that
    interpreter that never ran ``PyOS_AfterFork_Child`` (its GIL's lock, the import lock and the
    other threads' states are as the clone found them, possibly held by a thread that is not
    there), so it only makes libc calls that keep the GIL held (``_PYLIBC``), imports nothing,
    runs no Python code of the interpreter's (signals are waited for, not handled; no garbage
    collection) and so copies few of the interpreter's pages.  ``close``: descriptors of the warm
    interpreter's that pid 1 must not hold (the box's cell and id mapper, other boxes' cells).
    """

    #: The signal sets made so far, by the signals in them: the same few for every box (a set
    #: costs ten ctypes calls to make; a box's pid 1 only reads its own copy of it).
    _masks = {}

    def __init__(self, signals, close, nested=None, maps=None):
        self.close = tuple(close)
        self.nested = nested
        self.maps = {k: v.encode() for k, v in (maps or {}).items()}
        self.mask = self._mask(tuple(sorted({*(int(s) for s in signals), _SIGCHLD})))
        #: The same signals as a bit mask (bit N-1: signal N), for the native pid 1's boxinit.
        self.signal_bits = sum(1 << (int(s) - 1) for s in set(signals))
        self.status = ctypes.c_int()
        self.byte = ctypes.create_string_buffer(2)

    @classmethod
    def _mask(cls, signals):
        mask = cls._masks.get(signals)
        if mask is None:
            mask = ctypes.create_string_buffer(128)  # a sigset_t (glibc's is 128 bytes)
            check_libc(_LIBC.sigemptyset(mask), "sigemptyset")  # noqa: F821 - caps.py
            for signum in signals:
                check_libc(_LIBC.sigaddset(mask, signum), "sigaddset")  # noqa: F821 - caps.py
            cls._masks[signals] = mask
        return mask

    def discard(self):
        """In the warm interpreter, after the clone (or when it failed): the nested mapper's descriptors."""
        if self.nested is not None:
            for fd in self.nested.fds():
                os.close(fd)
            self.nested = None

    def seal(self):
        """In pid 1, before it forks: nothing in the box may ptrace it or open its descriptors
        through /proc (the warm interpreter's, until it has closed them); the test process makes
        itself dumpable again."""
        if _PYLIBC.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            os._exit(70)

    def run(self, test):
        """Pid 1, from the fork of its test process ``test`` (< 0: the fork failed) on; never returns."""
        try:
            self._run(test)
        finally:
            os._exit(70)  # _run ends only by exiting: anything raised ends pid 1 here, never its caller

    def _run(self, test):
        libc = _PYLIBC
        gc.disable()
        if test < 0 or libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0) != 0:
            os._exit(70)
        for fd in self.close:
            libc.close(fd)
        # Signals pid 1 forwards, and SIGCHLD, are taken with sigwaitinfo: blocked, never handled.
        if libc.sigprocmask(_SIG_BLOCK, self.mask, None) != 0:
            os._exit(70)
        if self.nested is not None:
            self._serve_nested(libc, test)
        status = ctypes.byref(self.status)
        while True:
            while True:  # what ended before SIGCHLD was blocked, or since the last one
                pid = libc.waitpid(-1, status, _WNOHANG)
                if pid == test:
                    code = os.waitstatus_to_exitcode(self.status.value)
                    os._exit(code if code >= 0 else 128 - code)
                if pid == 0:
                    break
                if pid < 0:
                    os._exit(70)  # no child left, the test process unseen: cannot be
            signum = libc.sigwaitinfo(self.mask, None)
            if signum > 0 and signum != _SIGCHLD:
                libc.kill(test, signum)

    def _serve_nested(self, libc, test):
        """Write the maps of the test process's nested user namespace once it asks (see
        :meth:`IdMapper.serve`), in the box's /proc, which the test process has mounted by then
        (the mount namespace is pid 1's too) and where ``test`` is its pid."""
        n = self.nested
        libc.close(n.ready_w)
        libc.close(n.done_r)
        if libc.read(n.ready_r, self.byte, 2) == 2 and self.byte.raw == b"u\n":
            written = 0
            for which in ("uid", "gid"):
                data = self.maps.get(which, b"")
                fd = libc.open(b"/proc/%d/%s_map" % (test, which.encode()), os.O_WRONLY | os.O_CLOEXEC)
                if fd >= 0:
                    if libc.write(fd, data, len(data)) == len(data):
                        written += 1
                    libc.close(fd)
            if written == 2:
                libc.write(n.done_w, b"m\n", 2)
        libc.close(n.ready_r)
        libc.close(n.done_w)


# --- the native pid 1: no copy of the warm interpreter (guest/_init/boxclone.c, boxinit.c) ---------
# Where the package was built with a C compiler, a test's box is made by boxclone.c's box_clone: a
# clone(CLONE_VM) into the box's namespaces whose child, pid 1, forks the test process and then
# executes boxinit, which does BareInit's duties.  The test process is the box's only copy of this
# interpreter (pytest-forked's one fork); the Python BareInit stays for where there is no helper,
# for an interpreter whose clone(2) this file cannot make (see clone_box), and when switched off.

#: The off switch: ``PYTEST_BOXLITE_NATIVE_INIT=0`` (the Python pid 1 runs).
NATIVE_INIT_ENV = "PYTEST_BOXLITE_NATIVE_INIT"
#: ``{"helper": (box_clone, boxinit's descriptor, args type) or None, "why": why none}``, found once.
_NATIVE = {}


def _native_files(package_dir):
    """``(shared object, boxinit)`` of the native pid 1 in the package directory ``package_dir``,
    or a string saying why there is none (the same rule as the host's ``guest.native_init``)."""
    import glob

    guest = os.path.join(package_dir, "guest")
    found = sorted(glob.glob(os.path.join(glob.escape(guest), "_boxclone*.so")))
    init = os.path.join(guest, "_boxinit")
    if not found or not os.path.isfile(init):
        return "not built (no C compiler when the package was installed)"
    return found[0], init


class _BoxArgs(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_long),
        ("init_fd", ctypes.c_long),
        ("proc_fd", ctypes.c_long),
        ("uid_map", ctypes.c_char_p),
        ("gid_map", ctypes.c_char_p),
        ("mask", ctypes.c_ulong),
        ("close_fds", ctypes.POINTER(ctypes.c_int)),
        ("n_close", ctypes.c_long),
        ("nested_ready", ctypes.c_long),
        ("nested_done", ctypes.c_long),
        ("nested_uid_map", ctypes.c_char_p),
        ("nested_gid_map", ctypes.c_char_p),
        ("stage", ctypes.c_long),
    ]


def native_init():
    """``(box_clone, boxinit's descriptor)`` where the native pid 1 can run here, loaded once;
    ``None`` elsewhere (:data:`_NATIVE` ``["why"]`` says why)."""
    if "why" in _NATIVE:
        return _NATIVE["helper"]
    _NATIVE["helper"], _NATIVE["why"] = None, None
    if os.environ.get(NATIVE_INIT_ENV, "1").strip() == "0":
        _NATIVE["why"] = "switched off (%s=0)" % NATIVE_INIT_ENV
        return None
    if os.uname().machine not in ("x86_64", "aarch64"):
        _NATIVE["why"] = "no native pid 1 for %s" % os.uname().machine
        return None
    try:
        import importlib.util

        spec = importlib.util.find_spec("pytest_boxlite")
        where = list(spec.submodule_search_locations or ()) if spec is not None else []
        files = _native_files(where[0]) if where else "the package is not importable here"
        if isinstance(files, str):
            _NATIVE["why"] = files
            return None
        lib = ctypes.PyDLL(files[0])  # the GIL stays held across box_clone, as across clone(2)
        fn = lib.box_clone
        fn.restype = ctypes.c_long
        fn.argtypes = [ctypes.POINTER(_BoxArgs)]
        fd = os.open(files[1], os.O_RDONLY | os.O_CLOEXEC)
        # pid 1 executes it by this descriptor: a file it may not execute would end every box.
        if not os.access(files[1], os.X_OK) or os.fstatvfs(fd).f_flag & os.ST_NOEXEC:
            os.close(fd)
            _NATIVE["why"] = "%s is not executable here (its mode, or a noexec mount)" % files[1]
            return None
        _NATIVE["helper"] = (fn, fd)
    except (OSError, ImportError, ValueError, AttributeError) as exc:
        _NATIVE["why"] = "cannot load: %s" % (exc,)
    return _NATIVE["helper"]


def _clone_box_native(native, flags, mapper, cell, init, interval, uid, gid):
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
    pid = fn(ctypes.byref(a))
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


def _fd_identity(fd):
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


#: The warm interpreter's stderr as it started (before pytest's capture and terminal writer dup it):
#: every descriptor a forked box inherits on it is pointed at the box's own stderr instead.
_WARM_STDERR = _fd_identity(2)
#: The connection on which the host deals cells, and cells dealt ahead of their FORK.
_CELLS = {"conn": None, "got": {}}


def take_cell(cell, timeout=10.0):
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
            _drop_cells()
            raise
        try:
            head = json.loads(data.decode())
            joins = int(head["joins"])
            if not fds or not 0 <= joins < len(fds):
                raise ValueError(head)
            got[str(head["cell"])] = (fds[:joins], fds[joins])
        except (ValueError, KeyError, TypeError):
            _close_cell((fds, None))
            _drop_cells()
            raise OSError(71, "the host's cell for box %s was garbled" % name) from None
        while len(got) > 16:  # cells of FORKs that never came (bounded)
            _close_cell(got.pop(next(iter(got))))
    return got.pop(name)


def _cell_fds(cell):
    joins, err = cell
    return [fd for fd in (*joins, err) if fd is not None]


def _close_cell(cell):
    if cell is None:
        return
    for fd in _cell_fds(cell):
        try:
            os.close(fd)
        except OSError:
            pass


def held_cell_fds(cell):
    """Every descriptor of the host's cells this process holds: ``cell`` (a box's, from
    :func:`take_cell`; ``None``: none), the cell connection and the cells dealt ahead.  What a
    forked box's pid 1 closes (:class:`BareInit`), as :func:`_enter_cell` and :func:`_drop_cells`
    close them in the process that enters the cell."""
    fds = _cell_fds(cell) if cell is not None else []
    conn = _CELLS["conn"]
    if conn is not None:
        fds.append(conn.fileno())
    for other in _CELLS["got"].values():
        fds.extend(_cell_fds(other))
    return fds


def _drop_cells():
    """Close the host's cell connection and every cell dealt ahead (in the warm interpreter after
    an error; in a forked box always: a test must never take the next box's cgroups or log)."""
    conn = _CELLS["conn"]
    _CELLS["conn"] = None
    if conn is not None:
        conn.close()
    got = _CELLS["got"]
    while got:
        _close_cell(got.pop(next(iter(got))))


def _enter_cell(cell):
    """In a forked box's first process: its own stderr first (so whatever fails next is said in
    the box's own log), then its own cgroups; nothing of other cells stays open."""
    joins, err = cell
    _own_stderr(err)
    for fd in joins:
        try:
            os.write(fd, b"0")  # "0": this process; on cgroup v1's tasks, this thread alone
        finally:
            os.close(fd)
    _drop_cells()


def _own_stderr(fd):
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


def _why_no_process(err):
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


def seal_init():
    """In a forked box's pid 1, once its test process is forked: nothing in the box may ptrace it
    or open its descriptors through /proc (it holds the box's connection set-up, the id mapper)."""
    check_libc(_LIBC.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")  # noqa: F821 - caps.py


def _or_exit(step, *args):
    """``step(*args)``, or exit: a child that raised would return into the warm interpreter's
    loop with its channel still open (and speak on it as a second warm interpreter)."""
    try:
        step(*args)
    except BaseException as exc:
        sys_stderr_write("pytest-boxlite: the fresh box could not start: %r\n" % (exc,))
        os._exit(70)


def _die_with_parent():
    import signal

    check_libc(_LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")  # noqa: F821 - caps.py


def _in_new_box(uid, gid, mapper, flags=None, cell=None):
    """The child's first steps into its new user namespace: die with its parent, enter its cell
    (``cell``: its own stderr and cgroups, see :func:`take_cell`), map its ids.

    ``flags``: the namespaces it has still to unshare (fork(3)'s path); ``None``: clone(2) made
    it in them already.
    """
    _die_with_parent()
    if cell is not None:
        _enter_cell(cell)
    if uid != 0:
        if flags is not None:
            check_libc(_LIBC.unshare(flags), "unshare")  # noqa: F821 - caps.py
        _map_own_ids(uid, gid)
    elif mapper is None:
        raise OSError(1, "a root box needs its parent to write its id maps (no IdMapper given)")
    else:
        # Root: unshares (unless born in the namespace), then waits for the maps its parent writes.
        mapper.request(_LIBC, None if flags is None else flags & ~_CLONE_NEWUSER)
    if cell is not None and cell[0]:
        # A cgroup namespace whose root is the box's own cgroup (as bubblewrap gives a booted box).
        check_libc(_LIBC.unshare(_CLONE_NEWCGROUP), "unshare(CLONE_NEWCGROUP)")  # noqa: F821 - caps.py


def _clone_box_by_forks(flags, mapper, real_root=False, cell=None):
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
            _die_with_parent()
            check_libc(_LIBC.unshare(flags), "unshare")  # noqa: F821 - caps.py
        else:
            _in_new_box(uid, gid, mapper, flags, cell)
        child = os.fork()
        if child == 0:
            _or_exit(_die_with_parent)
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


def sys_stderr_write(text):
    import sys

    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # no stderr left to say it on: the exit status says it


def enter_test_namespaces(network, mapper=None):
    """In the test process, forked by the box's pid 1: root moves one user namespace further
    down, as root of it (``mapper``: an :class:`IdMapper` pid 1 serves), so every mount made so far
    (the fresh layers included) is locked beneath it, while the hostname, its own mounts and its
    network namespace (low ports, loopback) are its own to change, as on a machine of its own."""
    if os.geteuid() != 0:
        return
    _enter_user_namespace(_LIBC, _CLONE_NEWNS | _CLONE_NEWUTS | (0 if network else _CLONE_NEWNET), mapper)
    if not network:
        _loopback_up()


def _under(path, top):
    return path.startswith(top.rstrip("/") + "/")


#: What a fresh box gets anew (tmpfs, its own /proc...), never renewed as a layer.
_PRIVATE = ("/tmp", "/run", "/proc", "/dev", "/sys")


def _masks_over(mounts, overlays):
    """The mounts other than the renewed ``overlays`` laid over part of one of them (outside
    :data:`_PRIVATE`): the masks a fresh box must lay again on its new layers (a read-only overlay,
    a host directory shown in an image's, is one too)."""
    renewed = set(overlays)
    return [
        (m, fs)
        for m, fs in mounts
        if m not in renewed
        and any(_under(m, o) for o in overlays)
        and not any(m == p or _under(m, p) for p in _PRIVATE)
    ]


#: At most this much of the files in the warm box's /tmp is copied into each fresh box, and at
#: most so many of its directories are shown (each is one more mount per box).
_TMP_FILES_BYTES = 4 << 20
_TMP_DIRS = 64


def _tmp_view(mounts):
    """What of the warm box's /tmp a fresh box sees (see :func:`_fresh_box`): ``(paths, dirs,
    files)``: the directories on the way to mounts beneath /tmp (made anew), the directories with no
    mount on or beneath them (shown copy-on-write) and the regular files beside them, as ``(path,
    mode, content)`` (copied, up to :data:`_TMP_FILES_BYTES` in all)."""
    import stat

    paths, dirs, files = [], [], []
    total = 0
    todo = ["/tmp"]
    while todo:
        here = todo.pop(0)
        try:
            names = sorted(os.listdir(here))
        except OSError:
            continue
        for name in names:
            p = here + "/" + name
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if any(m == p for m, _ in mounts):
                continue  # a mount point: laid again on its own (the hidden overlays)
            if stat.S_ISDIR(st.st_mode):
                if any(_under(m, p) for m, _ in mounts):
                    paths.append(p)
                    todo.append(p)
                elif len(dirs) < _TMP_DIRS:
                    dirs.append(p)
            elif stat.S_ISREG(st.st_mode) and total + st.st_size <= _TMP_FILES_BYTES:
                # Non-blocking, and checked again once open: a FIFO put in its place must not hang the box.
                try:
                    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                except OSError:
                    continue  # not this box's to read (it would not be in the new /tmp either)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        continue
                    data = os.read(fd, st.st_size)
                finally:
                    os.close(fd)
                total += len(data)
                files.append((p, stat.S_IMODE(st.st_mode), data))
    return paths, dirs, files


#: At most this many entries of the warm box's /dev are laid again in a box's own, and a file
#: there is copied only up to this size (bubblewrap's /dev holds a dozen entries, no file).
_DEV_ENTRIES = 256
_DEV_FILE_BYTES = 1 << 16


def _fresh_dev(libc, stage, table):
    """A /dev of the box's own: a new tmpfs holding what the warm box's /dev holds (its device
    nodes, /dev/pts and other mounts bound again; links and small files copied; directories
    made anew, empty).  The warm box's /dev is one tmpfs (bubblewrap's) that every box forked
    from it shared: a file one test wrote there (``/dev/x``), the next test saw.  A VM's /dev is
    the kernel's devtmpfs, not renewed here (``renew_all``)."""
    import stat

    mounted = {m for m, _, _, _ in table if m.startswith("/dev/") and m.count("/") == 2}
    held = stage + "/dev"
    os.mkdir(held, 0o700)
    entries = []
    for name in sorted(os.listdir("/dev"))[:_DEV_ENTRIES]:
        path = "/dev/" + name
        st = os.lstat(path)
        if path in mounted:
            os.mkdir(held + "/" + name) if stat.S_ISDIR(st.st_mode) else open(held + "/" + name, "w").close()
            _mount(libc, path, held + "/" + name, None, _MS_BIND | _MS_REC, None)
            entries.append((name, "mount", stat.S_ISDIR(st.st_mode)))
        elif stat.S_ISLNK(st.st_mode):
            entries.append((name, "link", os.readlink(path)))
        elif stat.S_ISDIR(st.st_mode):
            entries.append((name, "dir", stat.S_IMODE(st.st_mode)))
        elif stat.S_ISREG(st.st_mode) and st.st_size <= _DEV_FILE_BYTES:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                entries.append((name, "file", (stat.S_IMODE(st.st_mode), os.read(fd, _DEV_FILE_BYTES))))
            finally:
                os.close(fd)
        # Nothing else is kept: a device node there is a bound mount (above), never made here.
    mode = stat.S_IMODE(os.stat("/dev").st_mode)
    # No MS_NODEV: the device nodes bound back must still open.
    _mount(libc, "tmpfs", "/dev", "tmpfs", _MS_NOSUID, "mode=%o" % mode)
    for name, kind, what in entries:
        path = "/dev/" + name
        if kind == "mount":
            os.mkdir(path) if what else open(path, "w").close()
            _mount(libc, held + "/" + name, path, None, _MS_BIND | _MS_REC, None)
        elif kind == "link":
            os.symlink(what, path)
        elif kind == "dir":
            os.mkdir(path, what)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, what[0])
            try:
                os.write(fd, what[1])
            finally:
                os.close(fd)


def _fresh_box(hostname, network, renew_all=False, own_root=False):
    """In pid 1 of a box made by :func:`clone_box`: pristine writable layers, /proc, hostname.

    Every overlay gets a new, empty upper layer.  The masks the box had on top of its overlays
    (credential directories, the boxes' state) are laid again on top of the new layers, and
    /tmp, /workspace, /dev/shm and /run are new tmpfs.  Anyone but root ends with no capability
    (root's test process moves one user namespace down instead: :func:`enter_test_namespaces`).

    ``renew_all`` (a VM: its root is a disk, its volumes virtio-fs, no overlays): every other
    writable directory is renewed too (:func:`_renew_plain`) and the root itself made read-only.
    ``own_root``: the box then moves to a root directory of its own (:func:`fresh_root`) holding
    the warm box's top-level mount points, keeping its working directory.
    """
    libc = _libc()
    uid, gid = os.geteuid(), os.getegid()
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE, None)
    stage = "/run/.boxlite-fresh"
    os.makedirs(stage, exist_ok=True)
    _mount(libc, "tmpfs", stage, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0700")
    table = _mount_table()
    mounts = [(m, fs) for m, fs, _, _ in table]
    # The warm box's top-level mount points: the stage above is no top-level one.
    tops = _top_level(mounts)
    overlays = sorted(set(_renewed_overlays(table)), key=lambda p: (p.count("/"), p))
    hidden = [m for m in overlays if _under(m, "/tmp")]
    masks = _masks_over(mounts, overlays)
    # Overlays under /tmp and bind masks vanish under what is mounted next: keep a handle on them.
    for i, m in enumerate(hidden):
        os.mkdir("%s/keep%d" % (stage, i))
        _mount(libc, m, "%s/keep%d" % (stage, i), None, _MS_BIND | _MS_REC, None)
    for i, (m, fs) in enumerate(masks):
        if fs != "tmpfs":
            held = "%s/mask%d" % (stage, i)
            if os.path.isdir(m):
                os.mkdir(held)
            else:
                open(held, "w").close()
            _mount(libc, m, held, None, _MS_BIND, None)
    if renew_all:
        # Root here is root of the VM's kernel (clone_box's real_root): it can pivot into an overlay of /.
        plain_root = _renew_plain(libc, stage, _PRIVATE + ("/workspace",), pivot=uid == 0)
    for i, m in enumerate(overlays):
        if m not in hidden:
            _overlay(libc, m, m, stage, i)
    for i, (m, fs) in enumerate(masks):
        if fs == "tmpfs":
            _mount(libc, "tmpfs", m, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755")
        else:
            _mount(libc, "%s/mask%d" % (stage, i), m, None, _MS_BIND, None)
    # What the warm interpreter made in /tmp (the fixtures it set up for every box: under
    # /tmp/pytest-of-<user>, tmp_path_factory's) is seen in the new /tmp, copy-on-write: each
    # directory with no mount beneath as a layer (a locked mount cannot be left out of a layer's
    # lower), the way to the mounts made anew.
    paths, dirs, files = _tmp_view(mounts)
    shown = []
    for d in dirs:
        held = "%s/tmp%d" % (stage, len(shown))
        os.mkdir(held)
        try:
            _mount(libc, d, held, None, _MS_BIND, None)
        except OSError:
            os.rmdir(held)  # one the box may not bind: it is not shown (as before, when none was)
            continue
        shown.append(d)
    if not renew_all:
        _fresh_dev(libc, stage, table)
    for d in ("/tmp", "/workspace", "/dev/shm"):
        if os.path.isdir(d):
            _mount(libc, "tmpfs", d, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777" if d != "/workspace" else "mode=0755")
    for d in paths:
        os.makedirs(d, exist_ok=True)
    for i, d in enumerate(shown):
        os.mkdir(d)
        _overlay(libc, "%s/tmp%d" % (stage, i), d, stage, "t%d" % i)
    for path, mode, data in files:  # the files beside them: copies (a layer is a directory's)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    for i, m in enumerate(hidden):
        os.makedirs(m, exist_ok=True)
        _overlay(libc, "%s/keep%d" % (stage, i), m, stage, len(overlays) + i)
    # Last, a new /run: it hides the staging area and the template's control directory.
    _mount(libc, "tmpfs", "/run", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755")
    if renew_all and plain_root is not None:
        # What the box would write directly in / would reach the next box (the directories in it
        # are renewed, / itself cannot be): / is read-only, with the flags it had (locked ones
        # cannot be dropped in this user namespace).
        _mount(libc, None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | plain_root, None)
    import socket

    _mount(libc, "proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
    for name in _PROC_COVERS:
        cover = "/proc/" + name
        if os.path.exists(cover):
            _mount(libc, cover, cover, None, _MS_BIND | _MS_REC, None)
            ro = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
            _mount(libc, None, cover, None, ro, None)
    socket.sethostname(hostname)
    with open("/proc/self/oom_score_adj", "w") as fh:
        fh.write("1000")  # under memory pressure the test dies, not the warm interpreter
    if own_root:
        # The warm box's root directory (bubblewrap's tmpfs) is shared with every box forked from
        # it: a top-level entry one test made would reach the next.  Before the capabilities go.
        here = os.getcwd()
        fresh_root(tops, lambda new_root: None)
        os.chdir(here)  # the same path in the new root: reports name files relative to it
    if uid != 0:
        if not network:
            _loopback_up()
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        # Anyone but root keeps no capability, as locally.
        limit_caps(libc, ())  # noqa: F821 - from guest/caps.py, sent ahead of this file


#: File systems that hold no one's files (the kernel's views): never renewed.
_VIRTUAL = frozenset(
    (
        "proc", "sysfs", "devtmpfs", "devpts", "mqueue", "cgroup", "cgroup2", "securityfs", "debugfs",
        "tracefs", "bpf", "pstore", "hugetlbfs", "fusectl", "configfs", "binfmt_misc", "efivarfs",
        "autofs", "nsfs",
    )
)  # fmt: skip
#: Per-mount options as mount(2) flags, to remount with the flags a mount already has.
_FLAG_OF = {
    "ro": _MS_RDONLY,
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
    "strictatime": 1 << 24,
}


def _mount_table():
    """``(mount point, fstype, per-mount options, super options)`` of every mount this process sees, in
    mount order."""
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            f = line.split()
            point = f[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
            dash = f.index("-")
            out.append((point, f[dash + 1], f[5].split(","), f[dash + 3].split(",") if len(f) > dash + 3 else []))
    return out


#: pivot_root(2)'s number (glibc has no wrapper), where this file knows it.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203}
_MNT_DETACH = 2


def _renew_plain(libc, stage, private, pivot=False):
    """Renew what is writable in the box but no overlay (a VM's disk, its writable volumes).

    Each writable mount that is no overlay, no mask on one and not in ``private`` (renewed as new
    tmpfs anyway) gets an overlay of itself with an empty upper layer in ``stage``; a file mount
    gets a copy.  Mounts beneath one are held and laid back on top of its overlay (an overlay
    shows only its lower directory).  When / itself is such a mount: with ``pivot`` (root of the
    VM's kernel, whose mounts are not locked), the box moves into an overlay of / (see
    :func:`_pivot_into_overlay`) and ``None`` is returned; without, each directory directly in /
    gets an overlay and the flags of / are returned, for the caller to make / read-only (a file
    created directly in / would outlive the box).
    """
    table = _mount_table()
    top = {}
    for m, fs, opts, _ in table:
        top[m] = (fs, opts)  # the last mount on a point is the one seen
    overlays = [m for m, (fs, _) in top.items() if fs == "overlay"]

    def skipped(m):
        return any(m == p or _under(m, p) for p in private) or any(_under(m, o) for o in overlays)

    targets = [
        m
        for m, (fs, opts) in top.items()
        if m != "/" and fs != "overlay" and fs not in _VIRTUAL and "rw" in opts and not skipped(m)
    ]
    root_flags = None
    fs, opts = top.get("/", ("", ()))
    root_plain = fs != "overlay" and "rw" in opts
    pivot = pivot and root_plain and os.uname().machine in _SYS_PIVOT_ROOT
    if root_plain and not pivot:
        root_flags = 0
        for opt in opts:
            root_flags |= _FLAG_OF.get(opt, 0)
        for name in os.listdir("/"):
            m = "/" + name
            if m not in top and not skipped(m) and os.path.isdir(m) and not os.path.islink(m):
                targets.append(m)
    work = stage + "/plain"
    os.mkdir(work)
    n = 0
    for target in sorted(targets, key=lambda p: (p.count("/"), p)):
        beneath = [m for m in top if _under(m, target)]
        held = [m for m in beneath if not any(_under(m, o) for o in beneath)]
        for m in held:
            n += 1
            keep = "%s/hold%d" % (work, n)
            if os.path.isdir(m):
                os.mkdir(keep)
            else:
                open(keep, "w").close()
            _mount(libc, m, keep, None, _MS_BIND | _MS_REC, None)
        n += 1
        if os.path.isdir(target):
            _overlay(libc, target, target, work, n)
        elif os.path.isfile(target):
            copy = "%s/file%d" % (work, n)
            with open(target, "rb") as src, open(copy, "wb") as dst:
                dst.write(src.read())
            _mount(libc, copy, target, None, _MS_BIND, None)
        else:
            continue  # a socket, a device: nothing a test writes into
        for i, m in enumerate(held):
            _mount(libc, "%s/hold%d" % (work, n - len(held) + i), m, None, _MS_BIND | _MS_REC, None)
    if pivot:
        _pivot_into_overlay(libc, work, list(top), n + 1)
    return root_flags


def _pivot_into_overlay(libc, work, points, n):
    """Make an overlay of / (empty upper layer) the box's root, every mount laid in it in place.

    An overlay of / shows only the root file system, so each mount tree on it (``points``: every
    mount point of the box, renewed ones included) is bound whole into the same place in the new
    root; then pivot_root(".", ".") stacks the old root on the new one and detaching it leaves the
    new one alone.  The working directory is taken along (the same path, in the new root).
    """
    import ctypes

    new = "%s/root" % work
    os.mkdir(new)
    _overlay(libc, "/", new, work, n)
    firsts = [m for m in points if m != "/" and not any(_under(m, o) for o in points if o != "/")]
    # The tree that holds the new root itself goes first, while the new root has no mounts yet:
    # its copy then carries one bare copy of it, not of every tree bound after.
    for m in sorted(firsts, key=lambda p: (not _under(new, p), p)):
        _mount(libc, m, new + m, None, _MS_BIND | _MS_REC, None)
    cwd = os.getcwd()
    os.chdir(new)
    number = ctypes.c_long(_SYS_PIVOT_ROOT[os.uname().machine])
    check_libc(0 if libc.syscall(number, b".", b".") == 0 else -1, "pivot_root")  # noqa: F821 - caps.py
    check_libc(libc.umount2(b".", _MNT_DETACH), "detaching the old root")  # noqa: F821 - caps.py
    os.chdir("/")
    os.chdir(cwd)


def fork_blocked_by_mounts():
    """Why fresh boxes forked from this (namespace) box could not renew its copy-on-write
    directories, or ``None``.

    A fork makes a new user namespace, in which every mount of this box is locked, and overlayfs
    refuses a lower directory with locked mounts beneath it.  Credentials are masked by overlay
    layers for that reason; a credential masked by a mount instead (the layer could not be made:
    no user xattrs where the layers live) sits over part of an overlay directory, and every fresh
    overlay over that directory would fail.  Such a box is booted per test instead.
    """
    table = _mount_table()
    mounts = [(m, fs) for m, fs, _, _ in table]
    overlays = _renewed_overlays(table)
    masks = _masks_over(mounts, overlays)
    if not masks:
        return None
    m = masks[0][0]
    o = next(o for o in overlays if _under(m, o))
    return "%s is mounted over part of %s (a credential masked by a mount, or a host directory in an image's)" % (m, o)


def fork_refused():
    """Why this kernel refuses a fresh box's namespaces (asked in a child that tries them and a
    tmpfs in them), or ``None``.  Bounded: the child is killed after 10 s."""
    import select
    import signal

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        why = b""
        try:
            flags = _CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWUTS | _CLONE_NEWIPC | _CLONE_NEWPID | _CLONE_NEWNET
            check_libc(_LIBC.unshare(flags), "unshare of the fresh box's namespaces")  # noqa: F821 - caps.py
            _mount(_LIBC, "tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0700")
        except BaseException as exc:
            why = str(exc).encode()[:500] or repr(exc).encode()[:500]
        os.write(w, why)
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


def _loopback_up():
    import fcntl
    import socket
    import struct

    try:
        with socket.socket() as s:  # bring loopback up, as a new machine has it
            fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH14s", b"lo", 0x1 | 0x40, b""))
    except OSError:
        pass


#: pivot_root(2)'s number where this file knows it; elsewhere a sandbox box is booted instead.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203}
_MNT_DETACH = 2


def _top_level(mounts):
    """The top-level mount points (``/usr``, ``/tmp``...) of ``mounts`` (:func:`_mounts`)."""
    return {m for m, _ in mounts if m != "/" and m.count("/") == 1}


def top_mounts():
    """The top-level mount points (``/usr``, ``/tmp``...) this process sees."""
    return _top_level(_mounts())


def fresh_root(keep, before_pivot):
    """In a sandbox box made by :func:`clone_box` (after :func:`_fresh_box`): a new, empty root.

    The box's root directory is the warm box's own tmpfs (bubblewrap's), shared by every box
    cloned from it: a top-level entry one box makes or removes (``mkdir /data``, ``rm /bin``)
    would reach the next box and the warm box itself.  So the box moves to a new tmpfs root of
    its own holding the same entries: the mount points in ``keep`` (those of the warm box, with
    the fresh layers on them) bound recursively, every other entry made anew (directories empty,
    as bubblewrap made them: ``/workspace``), then pivot_root and the old root detached.
    ``before_pivot(new_root)`` runs just before the move, with the new root's path.
    """
    libc = _libc()
    new = "/run/.boxlite-root"
    os.mkdir(new, 0o755)
    _mount(libc, "tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755")
    for entry in sorted(os.listdir("/")):
        path, target = "/" + entry, new + "/" + entry
        if os.path.islink(path):
            os.symlink(os.readlink(path), target)
        elif path in keep:
            if os.path.isdir(path):
                os.mkdir(target, 0o755)
            else:
                open(target, "w").close()
            # /run holds the new root itself: only its own mount (ours, so nothing is locked under it).
            _mount(libc, path, target, None, _MS_BIND | (0 if path == "/run" else _MS_REC), None)
        elif os.path.isdir(path):
            if os.listdir(path) and path not in top_mounts():
                raise OSError(39, "the warm box's root holds files in %s: cannot make it anew" % path)
            os.mkdir(target, os.stat(path).st_mode & 0o7777)
        else:
            raise OSError(22, "unexpected entry %s in the warm box's root" % path)
    number = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(38, "pivot_root: unknown system call number on %s" % os.uname().machine)
    before_pivot(new)
    os.mkdir(new + "/.old-root", 0o700)
    check_libc(libc.syscall(number, new.encode(), (new + "/.old-root").encode()), "pivot_root")  # noqa: F821 - caps.py
    os.chdir("/")
    check_libc(libc.umount2(b"/.old-root", _MNT_DETACH), "umount /.old-root")  # noqa: F821 - caps.py
    os.rmdir("/.old-root")
