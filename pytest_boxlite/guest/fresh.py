"""A fresh box for one test, forked from the warm interpreter (namespace runtime).

Standard library only.  Shipped into the box together with :mod:`pytest_boxlite.guest.worker`
(the host sends both sources to the box's interpreter in one ``remote_exec``), so it imports nothing
of the package.
"""

import os

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
#: Parts of /proc a box must not write (host-wide sysctls...): read-only, as bubblewrap does.
_PROC_COVERS = ("sys", "sysrq-trigger", "irq", "bus", "fs")


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _mount(libc, src, target, fstype, flags, data):
    enc = lambda v: v.encode() if v is not None else None  # noqa: E731
    check_libc(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), "mount %s" % target)  # noqa: F821 - caps.py


def _mounts():
    """``(mount point, fstype)`` of every mount this process sees, in mount order."""
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            f = line.split()
            point = f[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
            out.append((point, f[f.index("-") + 1]))
    return out


def _overlay(libc, lower, target, stage, n):
    """A new overlay on ``target`` over ``lower``, with an empty upper layer in ``stage``."""
    upper, work = "%s/u%d" % (stage, n), "%s/w%d" % (stage, n)
    os.mkdir(upper)
    os.mkdir(work)
    opts = "lowerdir=%s,upperdir=%s,workdir=%s,userxattr" % (lower, upper, work)
    _mount(libc, "overlay", target, "overlay", 0, opts)


def _write(path, data):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


def _id_maps():
    """The id maps for the new user namespace: the ids of this one, one to one.

    Root (with CAP_SETUID here) maps every id this namespace has, written by a helper that stays
    in this namespace; anyone else maps their own uid and gid, written by themselves.
    """
    lines = {}
    for which in ("uid", "gid"):
        with open("/proc/self/%s_map" % which) as fh:
            rows = [line.split() for line in fh if line.strip()]
        lines[which] = "".join("%s %s %s\n" % (r[0], r[0], r[2]) for r in rows)
    return lines


def _enter_user_namespace(libc, flags):
    """unshare(CLONE_NEWUSER | flags) with this process's ids mapped one to one."""
    if os.geteuid() != 0:
        uid, gid = os.geteuid(), os.getegid()
        check_libc(libc.unshare(_CLONE_NEWUSER | flags), "unshare")  # noqa: F821 - caps.py
        _write("/proc/self/uid_map", "%d %d 1\n" % (uid, uid))
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/gid_map", "%d %d 1\n" % (gid, gid))
        return
    maps = _id_maps()
    me = os.getpid()
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    # The maps are written by a process that stays in this namespace.  A tiny shell started with
    # posix_spawn (vfork + exec) costs far less than forking this large interpreter once more.
    script = 'read x <&3 && printf "%s" "$1" > /proc/$3/uid_map && printf "%s" "$2" > /proc/$3/gid_map && echo m >&4'
    helper = os.posix_spawn(
        "/bin/sh",
        ["sh", "-c", script, "sh", maps["uid"], maps["gid"], str(me)],
        {},
        file_actions=[(os.POSIX_SPAWN_DUP2, go_r, 3), (os.POSIX_SPAWN_DUP2, done_w, 4)],
    )
    os.close(go_r)
    os.close(done_w)
    try:
        check_libc(libc.unshare(_CLONE_NEWUSER | flags), "unshare")  # noqa: F821 - caps.py
        os.write(go_w, b"u\n")
        if os.read(done_r, 2) != b"m\n":
            raise OSError(1, "could not map ids into the fresh box's user namespace")
        # Become root of the new namespace for real (ids were unmapped until now).
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
    finally:
        os.close(go_w)
        os.close(done_r)
        os.waitpid(helper, 0)


def _under(path, top):
    return path.startswith(top.rstrip("/") + "/")


def _fresh_box(hostname, network):
    """In the forked child: new namespaces and pristine writable layers.  Returns in the box's pid 1.

    Every overlay gets a new, empty upper layer.  The masks the box had on top of its overlays
    (credential directories, the boxes' state) are laid again on top of the new layers, and
    /tmp, /workspace, /dev/shm and /run are new tmpfs.
    """
    libc = _libc()
    uid, gid = os.geteuid(), os.getegid()
    flags = _CLONE_NEWNS | _CLONE_NEWUTS | _CLONE_NEWIPC | _CLONE_NEWPID
    if not network and uid != 0:
        flags |= _CLONE_NEWNET  # root gets its network namespace one level down (see the end)
    _enter_user_namespace(libc, flags)
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE, None)
    stage = "/run/.boxlite-fresh"
    os.makedirs(stage, exist_ok=True)
    _mount(libc, "tmpfs", stage, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0700")
    mounts = _mounts()
    overlays = sorted({m for m, fs in mounts if fs == "overlay"}, key=lambda p: (p.count("/"), p))
    hidden = [m for m in overlays if _under(m, "/tmp")]
    private = ("/tmp", "/run", "/proc", "/dev", "/sys")
    masks = [
        (m, fs)
        for m, fs in mounts
        if fs != "overlay" and any(_under(m, o) for o in overlays) and not any(m == p or _under(m, p) for p in private)
    ]
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
    for i, m in enumerate(overlays):
        if m not in hidden:
            _overlay(libc, m, m, stage, i)
    for i, (m, fs) in enumerate(masks):
        if fs == "tmpfs":
            _mount(libc, "tmpfs", m, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755")
        else:
            _mount(libc, "%s/mask%d" % (stage, i), m, None, _MS_BIND, None)
    for d in ("/tmp", "/workspace", "/dev/shm"):
        if os.path.isdir(d):
            _mount(libc, "tmpfs", d, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777" if d != "/workspace" else "mode=0755")
    for i, m in enumerate(hidden):
        os.makedirs(m, exist_ok=True)
        _overlay(libc, "%s/keep%d" % (stage, i), m, stage, len(overlays) + i)
    # Last, a new /run: it hides the staging area and the template's control directory.
    _mount(libc, "tmpfs", "/run", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755")
    pid = os.fork()
    if pid:
        # The intermediate process: wait for the box's pid 1 and exit with its status.
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            import signal

            try:
                signal.signal(-code, signal.SIG_DFL)
            except (OSError, ValueError):
                pass  # SIGKILL and SIGSTOP cannot be handled, so need no reset
            os.kill(os.getpid(), -code)
        os._exit(code)
    import signal
    import socket

    check_libc(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")  # noqa: F821 - caps.py
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
    if uid == 0:
        # Root runs one user namespace further down, as root of it: every mount made so far (the
        # fresh layers included) is locked beneath it, while the hostname, its own mounts and its
        # network namespace (low ports, loopback) are its own to change, as on a machine of its own.
        _enter_user_namespace(libc, _CLONE_NEWNS | _CLONE_NEWUTS | (0 if network else _CLONE_NEWNET))
    if not network:
        _loopback_up()
    if uid != 0:
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        # Anyone but root keeps no capability, as locally.
        limit_caps(libc, ())  # noqa: F821 - from guest/caps.py, sent ahead of this file


def _loopback_up():
    import fcntl
    import socket
    import struct

    try:
        with socket.socket() as s:  # bring loopback up, as a new machine has it
            fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH14s", b"lo", 0x1 | 0x40, b""))
    except OSError:
        pass
