"""What a boxed test left behind, seen from inside its box.  Standard library only.

Shipped into the box with :mod:`pytest_boxlite.guest.worker` (the host sends both sources in one
``remote_exec``); it imports nothing of the package.  The worker takes a :class:`Watch` before a
test's protocol and calls :meth:`Watch.finish` after its teardown, which returns the fields of one
``CHANGES`` message (see :mod:`pytest_boxlite.guest.messages`):

- files: what the box's writable layers gained between the two points.  A forked box's overlays
  each have an upper layer of their own (``guest/fresh.py`` keeps a descriptor of each when asked:
  ``LAYERS``): a file there without an ``origin`` attribute was created, one with it was copied up
  (modified), a whiteout marks a deletion, a directory without it was created (or replaced).  The box's
  fresh tmpfs (``/``, ``/tmp``, ``/workspace``, ``/dev/shm``, ``/run``) are compared with what they
  held at the start.  The test's own temporary space (pytest's base temporary directory, its cache
  directory) and the ignore patterns are left out;
- processes of the box still running (not zombies) that were not there at the start;
- environment variables, working directory and umask that differ from the start.

Every walk is bounded in entries and time and never follows a link (directories are opened with
``O_NOFOLLOW`` relative to their parent's descriptor); what was cut is said in ``notes``.
"""

# Imported here, once, in the warm interpreter: a forked box would pay each import (resource is an
# extension module: a dlopen) at its first test.
import collections
import fnmatch
import getpass
import os
import resource
import stat
import tempfile
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations are quoted: no __future__ import, as this source may run in one blob
    from collections.abc import Callable, Iterable
    from typing import Any

    import pytest

    #: One walked entry: kind, size, mtime (ns), and what the walk adds (overlay attributes of a
    #: layer's entry; inode and device of a worker box's place).
    _Entry = tuple[str, int, int, Any]
    #: What a walk keeps of an entry for the next comparison: kind, size, mtime.
    _Seen = dict[str, tuple[str, int, int]]
    #: What a worker box's test leaves for the next one's start: ``Watch.kept``.
    _Kept = tuple[list[str], list[_Seen], bool, dict[str, "int | None"], bool]

#: Entries one walk of a box's layers and fresh directories looks at, and for how long.
WALK_ENTRIES = 20000
WALK_SECONDS = 0.5
#: A worker box's home (see :func:`worker_places`) is walked on a budget of its own, smaller: it
#: is often the largest place and tests write near its top (``~/.rc``, ``~/.config/tool``).
HOME_ENTRIES = 2000
HOME_SECONDS = 0.05
#: Directories deep the walk goes (each level holds one descriptor open while it is walked).
WALK_DEPTH = 64
#: Changes, processes and variables one message lists (the host caps again).
LISTED = 200
#: Longest path or command line sent.
TEXT_CAP = 1024
#: The tmpfs of a forked box, compared with what they held at the test's start: its own (``/``,
#: ``/tmp``, ``/workspace``, ``/dev/shm``, ``/run``) and the warm box's ``/dev``, which a root test
#: can write and which no fork renews (what it leaves there, the next box sees).
FRESH_DIRS = ("/", "/tmp", "/workspace", "/dev", "/dev/shm", "/run")
#: Always left out: what Python writes as it imports, and hypothesis's database (pytest-boxlite
#: hands its examples back to the host; the rest is that tool's cache, as .pytest_cache is pytest's).
DEFAULT_IGNORE = ("*/__pycache__", "*/.hypothesis")

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)


class _Budget:
    def __init__(self, entries: "int | None" = None, seconds: "float | None" = None) -> None:
        self.left = WALK_ENTRIES if entries is None else entries
        self.deadline = time.monotonic() + (WALK_SECONDS if seconds is None else seconds)
        self.cut = False

    def take(self) -> bool:
        self.left -= 1
        if self.left < 0 or (self.left % 256 == 0 and time.monotonic() > self.deadline):
            self.cut = True
        return not self.cut


def _kind(mode: int, rdev: "int | None" = None) -> str:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISCHR(mode) and rdev == 0:
        return "whiteout"
    return "other"


def _xattrs(fd: int, name: str) -> "set[str]":
    """The overlay attributes of ``name`` in directory ``fd`` (``origin``, ``opaque``), never
    following a link (through the directory's /proc/self/fd entry: xattr calls take no dir_fd)."""
    path = "/proc/self/fd/%d/%s" % (fd, name)
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return set()
    out = set()
    for n in names:
        if n in ("user.overlay.origin", "trusted.overlay.origin"):
            out.add("origin")
        elif n in ("user.overlay.opaque", "trusted.overlay.opaque"):
            try:
                if os.getxattr(path, n, follow_symlinks=False) == b"y":
                    out.add("opaque")
            except OSError:
                pass
    return out


def _walk(
    fd: int,
    top: str,
    dev: "int | None",
    budget: _Budget,
    state: "dict[str, _Entry]",
    skip: "Callable[[str], bool]",
    link_targets: "dict[str, str]",
    want_attrs: "Callable[[str], bool]",
    depth: int = 0,
) -> None:
    """Every entry beneath directory ``fd`` (shown at ``top``) into ``state``: path -> (kind, size,
    mtime_ns, overlay attributes); on the same device only when ``dev`` is not None (a tmpfs: the
    mounts on it are walked on their own).  ``want_attrs(path)``: whether to read an entry's overlay
    attributes (those the start of the test had not).  Depth first, each directory opened relative
    to its parent without following a link and closed once walked (at most :data:`WALK_DEPTH`
    descriptors open), entries read as they come (a directory of a million names is not listed
    whole first), bounded by ``budget``."""
    try:
        it = os.scandir(fd)
    except OSError:
        return
    with it:
        for e in it:
            if not budget.take():
                return
            path = (top.rstrip("/") + "/" + e.name) if top != "/" else "/" + e.name
            if skip(path):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if dev is not None and st.st_dev != dev:
                continue  # another mount (a layer of its own, or nothing of the test's)
            kind = _kind(st.st_mode, st.st_rdev)
            attrs = _xattrs(fd, e.name) if want_attrs(path) else ()
            state[path] = (kind, st.st_size, st.st_mtime_ns, attrs)
            if kind == "link":
                _note_link(link_targets, path, e.name, fd)
            if kind != "dir":
                continue
            if depth >= WALK_DEPTH:
                budget.cut = True
                return
            try:
                sub = os.open(e.name, _OPEN_DIR, dir_fd=fd)
            except OSError:
                continue
            try:
                _walk(sub, path, dev, budget, state, skip, link_targets, want_attrs, depth + 1)
            finally:
                os.close(sub)
            if budget.cut:
                return


def _note_link(link_targets: "dict[str, str]", path: str, name: str, dir_fd: int) -> None:
    """Record where the link ``name`` in ``dir_fd`` (shown at ``path``) points, never following it
    (bounded: at most :data:`LISTED` links, :data:`TEXT_CAP` characters each)."""
    if len(link_targets) < LISTED:
        try:
            link_targets[path] = os.readlink(name, dir_fd=dir_fd)[:TEXT_CAP]
        except OSError:
            pass


def _open_below(fd: int, parts: "tuple[str, ...]") -> "int | None":
    """The directory ``parts`` (names) beneath directory ``fd``, opened one name at a time without
    following a link, or None; ``fd`` itself (not a new descriptor) for no parts."""
    cur = fd
    try:
        for name in parts:
            nxt = os.open(name, _OPEN_DIR, dir_fd=cur)
            if cur != fd:
                os.close(cur)
            cur = nxt
    except OSError:
        if cur != fd:
            os.close(cur)
        return None
    return cur


def _walk_wide(
    fd: int,
    top: str,
    dev: "int | None",
    budget: _Budget,
    state: "dict[str, _Entry]",
    skip: "Callable[[str], bool]",
    link_targets: "dict[str, str]",
) -> None:
    """As :func:`_walk`, level by level (a place of a worker's box: a home of 200,000 files is cut
    by the budget, and what lies near its top, where tests write, is seen first).  One descriptor
    open at a time beside ``fd``: each directory is opened again from ``fd``, name by name."""
    queue: "collections.deque[tuple[str, ...]]" = collections.deque([()])
    while queue:
        parts = queue.popleft()
        sub = _open_below(fd, parts)
        if sub is None:
            continue
        try:
            it = os.scandir(sub)
        except OSError:
            if sub != fd:
                os.close(sub)
            continue
        base = top.rstrip("/") + "".join("/" + p for p in parts)
        try:
            with it:
                for e in it:
                    if not budget.take():
                        return
                    path = (base or "") + "/" + e.name
                    if skip(path):
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    kind = _kind(st.st_mode, st.st_rdev)
                    if dev is not None and kind == "dir" and st.st_dev != dev:
                        # Another mount.  Only a directory says: an overlay's files show the
                        # device of the layer that holds them.
                        continue
                    state[path] = (kind, st.st_size, st.st_mtime_ns, (st.st_ino, st.st_dev))
                    if kind == "link":
                        _note_link(link_targets, path, e.name, sub)
                    if kind == "dir":
                        if len(parts) >= WALK_DEPTH:
                            budget.cut = True
                        else:
                            queue.append(parts + (e.name,))
        finally:
            if sub != fd:
                os.close(sub)


def _ignored(path: str, patterns: "tuple[str, ...] | list[str]", aliases: "list[tuple[str, str]]") -> bool:
    """Whether ``path`` or a directory above it matches one of ``patterns`` (fnmatch), as an
    absolute path or in one of its ``aliases`` (``(prefix, shown as)``: relative to the project,
    ``~/...`` in the home)."""
    forms = [path]
    for prefix, alias in aliases:
        top = prefix.rstrip("/")
        if path.startswith(top + "/"):
            forms.append(alias + path[len(top) + 1 :])
    for form in forms:
        parts = form.split("/")
        for n in range(len(parts), 0, -1):
            head = "/".join(parts[:n])
            if head and any(fnmatch.fnmatchcase(head, p) for p in patterns):
                return True
    return False


def _inside(path: str, dirs: "dict[str, Any]") -> "str | None":
    """The directory of ``dirs`` (a dict) that ``path`` lies beneath, or None."""
    head = path
    while True:
        head = head.rsplit("/", 1)[0]
        if not head:
            return None
        if head in dirs:
            return head


class _Area:
    """One place compared: an upper layer (``layer``: shown at ``top``) or a fresh tmpfs."""

    def __init__(
        self, top: str, fd: int, layer: bool, dev: "int | None" = None, own_fd: bool = False, wide: bool = False
    ) -> None:
        self.top, self.fd, self.layer, self.dev, self.own_fd = top, fd, layer, dev, own_fd
        #: A place of a worker's box (see :func:`_places`): walked level by level, and pytest's
        #: temporary directories are left out of it only by their own paths (it may lie in one).
        self.wide = wide
        #: Where the box's own new files lie (the device of its overlay's upper layer: see
        #: :func:`_upper_device`), or None where that cannot be told; and whether only what was
        #: created is listed (the home: the host's other programs change its files as it runs).
        self.upper: "int | None" = None
        self.created_only = False

    def snapshot(
        self, budget: _Budget, skip: "Callable[[str], bool]", want_attrs: "Callable[[str], bool]"
    ) -> "tuple[dict[str, _Entry], dict[str, str]]":
        state: "dict[str, _Entry]" = {}
        links: "dict[str, str]" = {}
        if self.wide:
            _walk_wide(self.fd, self.top, self.dev, budget, state, skip, links)
        else:
            _walk(self.fd, self.top, self.dev, budget, state, skip, links, want_attrs if self.layer else _no)
        return state, links

    @property
    def skip_temp(self) -> bool:
        """Whether pytest's numbered temporary directories are left out of it as a whole."""
        return not self.layer and not self.wide


def _no(path: str) -> bool:
    return False


#: Where guest/fresh.py stages a fresh box's layers: a layer whose lower lies in ``tmp*`` there
#: shows a directory of the warm box's /tmp (its fixtures' files), not one of the host's.
_STAGE = "/run/.boxlite-fresh/"


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _areas(layers: "Iterable[tuple[str, str, int]]", temp_root: "str | None") -> "list[_Area]":
    """The places to compare: each kept upper layer (``layers``: ``(shown at, lower, fd)`` from
    guest/fresh.py) and each fresh tmpfs the box has.  A copy of the warm box's pytest temporary
    directory is the test's own temporary space: left out."""
    out = []
    for target, lower, fd in layers:
        top = lower if target.startswith(_STAGE) else target
        if temp_root and lower.startswith(_STAGE + "tmp") and _within(top, temp_root):
            continue
        out.append(_Area(top, fd, True))
    for d in FRESH_DIRS:
        try:
            fd = os.open(d, _OPEN_DIR)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            continue
        out.append(_Area(d, fd, False, dev=st.st_dev, own_fd=True))
    return out


#: A worker's box, walked whole at each test's start and end (it has no layers of its own that
#: it can see): where the project and the home are not, the directories a later test would see.
PLACES = ("/tmp", "/workspace", "/run", "/dev/shm", "/dev")
PLACES_NOTE = (
    "files: compared in the project, /tmp, /workspace, /run and /dev, and what was created in the home "
    "(one box runs every test of a worker: its other directories are not walked)"
)


def _upper_device(fd: int, dev: int) -> "int | None":
    """The device a new file in directory ``fd`` (on device ``dev``) shows: on an overlay over
    the host's files (a worker's box) that of its upper layer, which holds what the box wrote,
    while a file of a lower layer (the host's, as it is now) shows its own.  None where the two
    cannot be told apart (the probe shows ``dev`` itself, or cannot be made).  The probe is
    removed at once; it lies in the box's layer, never on the host."""
    name = ".boxlite-probe-%d-%s" % (os.getpid(), os.urandom(6).hex())
    try:
        probe = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
    except OSError:
        return None
    try:
        upper = os.fstat(probe).st_dev
    except OSError:
        upper = None
    finally:
        os.close(probe)
        try:
            os.unlink(name, dir_fd=fd)
        except OSError:
            pass
    return None if upper == dev else upper


def _places(places: "list[str]", home: str, uppers: "dict[str, int | None] | None") -> "list[_Area]":
    """An area for each directory of ``places`` (a worker's box, in the order given)
    that is there, but one inside an earlier one on the same file system (walked with it).
    ``uppers``: each place's upper device as an earlier test found it (see
    :func:`_upper_device`), else None (it is probed now)."""
    out: "list[_Area]" = []
    for d in places:
        try:
            fd = os.open(d, _OPEN_DIR)
        except OSError:
            continue
        try:
            dev = os.fstat(fd).st_dev
        except OSError:
            os.close(fd)
            continue
        if any(a.dev == dev and _within(d, a.top) for a in out):
            os.close(fd)
            continue
        area = _Area(d, fd, False, dev=dev, own_fd=True, wide=d not in FRESH_DIRS)
        if area.wide:
            area.upper = uppers[d] if uppers is not None and d in uppers else _upper_device(fd, dev)
            area.created_only = d == home
        out.append(area)
    return out


def _unique(files: "list[list[Any]]") -> "list[list[Any]]":
    """``files`` sorted by path, each path once (a directory may be seen by two walks: /workspace
    as a layer of its own and as part of the root's tmpfs; the first walk, a layer's, says more)."""
    seen: "dict[str, list[Any]]" = {}
    for f in files:
        seen.setdefault(f[2], f)
    return [seen[p] for p in sorted(seen)]


def _pids() -> "set[int]":
    try:
        return {int(p) for p in os.listdir("/proc") if p.isdigit()}
    except OSError:
        return set()


def _running(pid: int) -> "str | None":
    """``pid``'s command line if it runs (not a zombie), else None."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            state = fh.read(4096).rsplit(b")", 1)[1].split()[0]
        if state in (b"Z", b"X"):
            return None
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            cmd = fh.read(TEXT_CAP)
    except (OSError, IndexError):
        return None
    return cmd.replace(b"\0", b" ").strip().decode("utf-8", "replace")[:TEXT_CAP] or "[%d]" % pid


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def own_temp(config: "pytest.Config | None") -> "tuple[list[str], str | None]":
    """The test's own temporary space, left out: ``(paths, temp_root)``: ``--basetemp`` and
    pytest's cache directory (left out wherever they are), and ``<tmp>/pytest-of-<user>``, where
    pytest makes its numbered base directories (left out but for the way to a mount beneath it:
    a project that lies in an outer pytest's temporary directory is still the project).  No
    ``config`` (a sandbox's agent): none."""
    out: "list[str]" = []
    if config is None:
        return out, None
    base = getattr(config.option, "basetemp", None)
    if base:
        out.append(os.path.abspath(str(base)))
    try:
        cache = config.getini("cache_dir")
        out.append(os.path.abspath(os.path.join(str(config.rootpath), os.path.expanduser(str(cache)))))
    except (ValueError, TypeError):
        pass
    try:
        user = getpass.getuser()
    except (KeyError, OSError, ImportError):
        user = None
    root = os.path.join(os.path.realpath(tempfile.gettempdir()), "pytest-of-%s" % user) if user else None
    return out, root


class Watch:
    """Taken at a test's start; :meth:`finish` after its teardown says what it left.

    ``layers``: the box's kept upper layers (``guest/fresh.py``'s ``LAYERS``, empty where it keeps
    none: a booted box, whose files are then not seen and ``notes`` says so); ``options``: the
    ``changes`` field of the host's ``RUN`` (``ignore``: patterns); ``config``: the box's pytest
    config (its temporary space is left out).  ``places``: directories compared whole instead of
    layers (a worker's box, see :func:`worker_places`): its files are seen there, and a note says
    where; ``previous``: the last test's :attr:`kept`, its walks' end, taken as this start.
    """

    def __init__(
        self,
        layers: "Iterable[tuple[str, str, int]]",
        options: object,
        config: "pytest.Config | None",
        forked: bool,
        places: "list[str] | None" = None,
        previous: "_Kept | None" = None,
    ) -> None:
        self.options: "dict[str, Any]" = options if isinstance(options, dict) else {}
        patterns = self.options.get("ignore")
        self.ignore: "tuple[str, ...]" = (
            tuple(p for p in patterns if isinstance(p, str)) if isinstance(patterns, list) else ()
        )
        self.ignore += DEFAULT_IGNORE
        #: Directories the box's own machinery makes (a sandbox agent's private homes): never listed
        #: as created themselves, what is made in them is.
        containers = self.options.get("containers")
        self.containers: "tuple[str, ...]" = (
            tuple(p for p in containers if isinstance(p, str)) if isinstance(containers, list) else ()
        )
        #: Inode numbers of the files the run's own output goes to (a worker's box: ``pytest >
        #: out.log`` in the project), which the box shows growing: not a test's doing.
        quiet = self.options.get("quiet")
        self.quiet: "set[int]" = {q for q in quiet if isinstance(q, int)} if isinstance(quiet, list) else set()
        #: Side effects asked (else only the usage).
        self.effects = bool(self.options.get("files", True))
        self.forked = forked
        self.layers = list(layers)
        paths, temp_root = own_temp(config)
        home = os.environ.get("HOME") or ""
        root = [(str(config.rootpath), "")] if config is not None else []
        self.aliases: "list[tuple[str, str]]" = root + ([(home, "~/")] if home.startswith("/") and home != "/" else [])
        self.t0 = time.time_ns()
        self.budget = _Budget()
        self.places = places
        self.areas: "list[_Area]"
        if not self.effects:
            self.areas = []
        elif places is not None:
            uppers = previous[3] if previous is not None else None
            self.areas = _places(places, os.environ.get("HOME") or "", uppers)
        else:
            self.areas = _areas(self.layers, temp_root) if forked else []
        tops = [a.top for a in self.areas if a.layer or a.wide]

        def skip_in_layer(path: str) -> bool:
            return any(_within(path, p) for p in paths)

        def skip_in_tmpfs(path: str) -> bool:
            if skip_in_layer(path):
                return True
            # pytest's own numbered directories; not the way to a mount (a project) beneath them
            return temp_root is not None and _within(path, temp_root) and not any(_within(t, path) for t in tops)

        self.skips = (skip_in_layer, skip_in_tmpfs)
        self.start: "list[_Seen]" = []
        tops = [a.top for a in self.areas]
        if previous is not None and previous[0] == tops:
            # What the test before found at its end (a worker's box): the walk is not made again.
            self.start, self.start_cut, self.home_cut = previous[1], previous[2], previous[4]
        else:
            home_budget = _Budget(HOME_ENTRIES, HOME_SECONDS)
            for area in self.areas:
                budget = home_budget if area.created_only else self.budget
                state, _ = area.snapshot(budget, self.skips[1 if area.skip_temp else 0], _no)
                self.start.append({p: v[:3] for p, v in state.items()})
            self.start_cut, self.home_cut = self.budget.cut, home_budget.cut
        #: What the walks at :meth:`finish` found (``(tops, states, cut)``), for the next test's start.
        self.kept: "_Kept | None" = None
        self.pids = _pids()
        self.env = dict(os.environ)
        self.cwd: "str | None"
        try:
            self.cwd = os.getcwd()
        except OSError:
            self.cwd = None
        self.umask = _umask()
        self.usage = (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))

    def close(self) -> None:
        for area in self.areas:
            if area.own_fd:
                try:
                    os.close(area.fd)
                except OSError:
                    pass
        self.areas = []

    def listing(self) -> "dict[str, Any]":
        """What the box's files gained since the start, as ``finish`` lists them, the walk's
        descriptors kept for the next call (``Sandbox.changes()``: the agent asks again and again):
        ``{"files", "notes"}``."""
        notes: "list[str]" = []
        return {"files": self._changed_files(notes), "notes": notes}

    def _changed_files(self, notes: "list[str]") -> "list[list[Any]]":
        """The files changed since the start (at most :data:`LISTED`); why the list is cut, if
        it is, goes to ``notes``."""
        files: "list[list[Any]]" = []
        budget = _Budget()
        home_budget = _Budget(HOME_ENTRIES, HOME_SECONDS)
        ended = []
        for i, area in enumerate(self.areas):
            ended.append(self._compare(area, self.start[i], home_budget if area.created_only else budget, files))
        uppers = {a.top: a.upper for a in self.areas}
        self.kept = ([a.top for a in self.areas], ended, budget.cut, uppers, home_budget.cut)
        if budget.cut or self.start_cut:
            notes.append(
                "the walk of the box's files stopped after %d entries or %.1f s: the list is cut"
                % (WALK_ENTRIES, WALK_SECONDS)
            )
        if home_budget.cut or self.home_cut:
            notes.append(
                "the home was walked level by level for its first %d entries: what a test created deeper "
                "is not listed" % HOME_ENTRIES
            )
        files = _unique(files)
        if len(files) > LISTED:
            notes.append("%d more changed files not listed" % (len(files) - LISTED))
            files = files[:LISTED]
        return files

    def finish(self) -> "dict[str, Any]":
        """The fields of the ``CHANGES`` message: ``files`` (``[change, kind, path, size, count,
        link]``), ``processes`` (``[pid, command]``), ``env`` (``[name, change]``), ``cwd`` and
        ``umask`` (``[before, after]`` or None), ``usage`` and ``notes``."""
        notes: "list[str]" = []
        files = []
        if not self.effects:
            self.close()
            return {"usage": self._usage()}
        if self.places is not None:
            files = self._changed_files(notes)
            notes.append(PLACES_NOTE)
        elif self.forked:
            files = self._changed_files(notes)
        else:
            notes.append("files: not seen in a booted box (its writable layers lie outside it)")
        self.close()
        me = os.getpid()
        processes = []
        for pid in sorted(_pids() - self.pids - {1, me}):
            cmd = _running(pid)
            if cmd is not None:
                processes.append([pid, cmd])
        if len(processes) > LISTED:
            processes = processes[:LISTED]
            notes.append("more processes not listed")
        env = []
        now = dict(os.environ)
        for name in sorted(set(now) | set(self.env)):
            if name == "PYTEST_CURRENT_TEST":
                continue
            if name not in self.env:
                env.append([name[:TEXT_CAP], "set"])
            elif name not in now:
                env.append([name[:TEXT_CAP], "removed"])
            elif now[name] != self.env[name]:
                env.append([name[:TEXT_CAP], "changed"])
        env = env[:LISTED]
        try:
            cwd = os.getcwd()
        except OSError:
            cwd = "(deleted)"
        umask = _umask()
        return {
            "files": files,
            "processes": processes,
            "env": env,
            "cwd": [self.cwd[:TEXT_CAP], cwd[:TEXT_CAP]] if self.cwd is not None and cwd != self.cwd else None,
            "umask": [self.umask, umask] if umask != self.umask else None,
            "usage": self._usage(),
            "notes": notes,
        }

    def _usage(self) -> "dict[str, Any]":
        s0, c0 = self.usage
        s1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (s1.ru_utime + s1.ru_stime - s0.ru_utime - s0.ru_stime) + (
            c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
        )
        return {"cpu_s": round(max(cpu, 0.0), 4), "peak_kib": max(s1.ru_maxrss, c1.ru_maxrss)}

    def _compare(self, area: _Area, start: "_Seen", budget: _Budget, files: "list[list[Any]]") -> "_Seen":
        state, links = area.snapshot(budget, self.skips[1 if area.skip_temp else 0], lambda p: p not in start)
        # Directories created (or replaced) by the test are listed once, with what they hold.
        new_dirs: "dict[str, list[Any]]" = {}
        for path in sorted(state):
            kind, size, mtime, attrs = state[path]
            before = start.get(path)
            start_cut = self.home_cut if area.created_only else self.start_cut
            if before is None and start_cut and mtime < self.t0 - 1_000_000_000:
                continue  # older than the test: beyond the start's cut walk, not the test's
            if before is not None and before[0] == kind and (kind == "dir" or before[1:] == (size, mtime)):
                continue
            if area.wide:
                if before is not None and (area.created_only or (kind == "file" and attrs[0] in self.quiet)):
                    continue  # changed in the home (the host's programs change it too), or the run's own output
                if before is None and kind != "dir" and area.upper is not None and attrs[1] != area.upper:
                    continue  # on a lower layer: the host made it, as the box shows the host's files live
            holder = _inside(path, new_dirs)
            if holder is not None:
                if kind != "dir" and kind != "whiteout":
                    new_dirs[holder][0] += 1
                    new_dirs[holder][1] += size if kind == "file" else 0
                continue
            if _ignored(path, self.ignore, self.aliases):
                continue
            if kind == "dir" and before is None and any(fnmatch.fnmatchcase(path, p) for p in self.containers):
                continue
            if area.layer:
                if kind == "whiteout":
                    change, kind, size = "deleted", "entry", 0
                elif kind == "dir":
                    # Opaque marks a directory made anew (overlayfs sets it on any directory
                    # created in a merged one, a replaced one included: both are "created").
                    if ("origin" in attrs and "opaque" not in attrs) or before is not None:
                        continue  # a directory copied up to hold what changed in it
                    change = "created"
                else:
                    change = "modified" if ("origin" in attrs or before is not None) else "created"
            else:
                if kind == "dir" and before is not None:
                    continue
                change = "modified" if before is not None else "created"
            if kind == "dir":
                new_dirs[path] = [0, 0, change]
                continue
            files.append([change, kind, path[:TEXT_CAP], size, 0, links.get(path)])
        for path, (count, size, change) in new_dirs.items():
            if area.wide and area.upper is not None and count == 0:
                continue  # nothing of the box's in it: the host's (an empty one cannot be told)
            files.append([change, "dir", path[:TEXT_CAP], size, count, None])
        for path, before in start.items():
            if path not in state and not budget.cut and not area.created_only:
                if before[0] == "whiteout" or _inside(path, new_dirs) is not None:
                    continue
                gone = path.rsplit("/", 1)[0]
                if gone in start and gone not in state:
                    continue  # its directory went too: listed once, as that directory
                if not _ignored(path, self.ignore, self.aliases):
                    files.append(["deleted", before[0], path[:TEXT_CAP], before[1], 0, None])

        return {p: v[:3] for p, v in state.items()}


def worker_places(config: "pytest.Config") -> "list[str]":
    """The directories a worker's box compares whole for each test (``Watch``'s ``places``): the
    project, the directory pytest was started in, :data:`PLACES`, then the home."""
    home = os.environ.get("HOME") or ""
    first = [str(config.rootpath), str(config.invocation_params.dir)]
    # The home last: a large one uses up the walk's budget, which the others then still had.
    return first + list(PLACES) + ([home] if home.startswith("/") and home != "/" else [])
