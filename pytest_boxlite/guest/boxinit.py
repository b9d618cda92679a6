"""Pid 1 of a test's box: the Python :class:`BareInit`, or the native one (guest/_init/) where built.

Standard library only.  Imported by :mod:`pytest_boxlite.guest.fresh` (which clones the box with
it) and :mod:`pytest_boxlite.guest.forks` (which makes it, in the warm interpreter, before the clone).
"""

from __future__ import annotations

import ctypes
import gc
import os

from pytest_boxlite.guest.caps import check_libc
from pytest_boxlite.guest.linux import LIBC, PR_SET_DUMPABLE, PR_SET_PDEATHSIG, PYLIBC, SIGCHLD

# Types for mypy only: a zygote's agent imports this file, and typing would cost it milliseconds.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

    from pytest_boxlite.guest.ids import IdMapper

    #: The native pid 1's ``box_clone`` and boxinit's descriptor (see :func:`native_init`).
    Native = tuple[Any, int]

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
    there), so it only makes libc calls that keep the GIL held (``PYLIBC``), imports nothing,
    runs no Python code of the interpreter's (signals are waited for, not handled; no garbage
    collection) and so copies few of the interpreter's pages.  ``close``: descriptors of the warm
    interpreter's that pid 1 must not hold (the box's cell and id mapper, other boxes' cells).
    """

    #: The signal sets made so far, by the signals in them: the same few for every box (a set
    #: costs ten ctypes calls to make; a box's pid 1 only reads its own copy of it).
    _masks: dict[tuple[int, ...], ctypes.Array[ctypes.c_char]] = {}

    def __init__(
        self,
        signals: Iterable[int],
        close: Iterable[int],
        nested: IdMapper | None = None,
        maps: dict[str, str] | None = None,
    ) -> None:
        self.close = tuple(close)
        self.nested = nested
        self.maps = {k: v.encode() for k, v in (maps or {}).items()}
        self.mask = self._mask(tuple(sorted({*(int(s) for s in signals), SIGCHLD})))
        #: The same signals as a bit mask (bit N-1: signal N), for the native pid 1's boxinit.
        self.signal_bits = sum(1 << (int(s) - 1) for s in set(signals))
        self.status = ctypes.c_int()
        self.byte = ctypes.create_string_buffer(2)

    @classmethod
    def _mask(cls, signals: tuple[int, ...]) -> ctypes.Array[ctypes.c_char]:
        mask = cls._masks.get(signals)
        if mask is None:
            mask = ctypes.create_string_buffer(128)  # a sigset_t (glibc's is 128 bytes)
            check_libc(LIBC.sigemptyset(mask), "sigemptyset")
            for signum in signals:
                check_libc(LIBC.sigaddset(mask, signum), "sigaddset")
            cls._masks[signals] = mask
        return mask

    def discard(self) -> None:
        """In the warm interpreter, after the clone (or when it failed): the nested mapper's descriptors."""
        if self.nested is not None:
            for fd in self.nested.fds():
                os.close(fd)
            self.nested = None

    def seal(self) -> None:
        """In pid 1, before it forks: nothing in the box may ptrace it or open its descriptors
        through /proc (the warm interpreter's, until it has closed them); the test process makes
        itself dumpable again."""
        if PYLIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            os._exit(70)

    def run(self, test: int) -> None:
        """Pid 1, from the fork of its test process ``test`` (< 0: the fork failed) on; never returns."""
        try:
            self._run(test)
        finally:
            os._exit(70)  # _run ends only by exiting: anything raised ends pid 1 here, never its caller

    def _run(self, test: int) -> None:
        libc = PYLIBC
        gc.disable()
        if test < 0 or libc.prctl(PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0) != 0:
            os._exit(70)
        for fd in self.close:
            libc.close(fd)
        # Signals pid 1 forwards, and SIGCHLD, are taken with sigwaitinfo: blocked, never handled.
        if libc.sigprocmask(_SIG_BLOCK, self.mask, None) != 0:
            os._exit(70)
        if self.nested is not None:
            self._serve_nested(libc, test, self.nested)
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
            if signum > 0 and signum != SIGCHLD:
                libc.kill(test, signum)

    def _serve_nested(self, libc: Any, test: int, n: IdMapper) -> None:
        """Write the maps of the test process's nested user namespace once it asks (see
        :meth:`IdMapper.serve`), in the box's /proc, which the test process has mounted by then
        (the mount namespace is pid 1's too) and where ``test`` is its pid."""
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
_NATIVE: dict[str, Any] = {}


def _native_files(package_dir: str) -> tuple[str, str] | str:
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


def native_init() -> Native | None:
    """``(box_clone, boxinit's descriptor)`` where the native pid 1 can run here, loaded once;
    ``None`` elsewhere (:data:`_NATIVE` ``["why"]`` says why)."""
    if "why" in _NATIVE:
        found: Native | None = _NATIVE["helper"]
        return found
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
    found = _NATIVE["helper"]
    return found
