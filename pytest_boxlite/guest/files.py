"""Guest-side file helper.  Standard library only; runs as ``python3 -I -S -c``.

The host writes one JSON header line to stdin, then the payload bytes (if
any).  The helper answers with one JSON header line on stdout, then the
payload: raw bytes, or base64 when ``"b64"`` is set because the runtime's
stdout is lossy text.  File errors are answers (``"ok": false`` with errno),
not crashes.  Keep this file compatible with Python 3.8: it runs under the
guest image's interpreter.

It runs nothing the guest controls: no user or group name is ever looked up (that would load
the NSS modules named by the box's ``/etc/nsswitch.conf``, code a guest can plant): ids stay
numbers.  Where it is exec'd it runs under ``-I -S`` (no ``PYTHON*`` variables, ``.pth`` files
or ``sitecustomize``); in a namespace box it runs in a fork of the box's agent, which imported
all it needs (:data:`LAZY_IMPORTS`) before any guest process ran.
"""

from __future__ import annotations

import json
import os
import stat
import sys

# Types for mypy only: this file runs in a new interpreter per operation, and importing typing
# would cost each one milliseconds (mypy reads this name as typing's own).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import re
    import tarfile
    from collections.abc import Callable, Iterator
    from typing import IO, Any

    #: A request (the JSON header) and its payload -> the answer's header fields and payload.
    Op = Callable[[dict[str, Any], bytes], tuple[dict[str, Any], bytes]]

# re, fnmatch, tarfile, io and base64 are imported where needed: every file operation
# starts a fresh interpreter, and unused imports would cost each one.  A process that forks the
# helper imports these first (a module imported after a guest ran could be the guest's file).
LAZY_IMPORTS = ("base64", "fnmatch", "io", "re", "shutil", "tarfile", "traceback")


class PatternError(Exception):
    """The caller's regular expression or glob does not compile."""


def _compile(pattern: str, flags: int = 0) -> re.Pattern[str]:
    import re

    try:
        return re.compile(pattern, flags)
    except re.error as exc:
        raise PatternError("invalid regular expression %r: %s" % (pattern, exc)) from None


def _regex_for_glob(pattern: str) -> re.Pattern[str]:
    """Translate a glob with ``**`` (any depth) into a regex over relative POSIX paths."""
    import re

    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        else:
            c = pattern[i]
            if c == "*":
                out.append("[^/]*")
            elif c == "?":
                out.append("[^/]")
            elif c == "[":
                j = pattern.find("]", i + 1)
                if j == -1:
                    out.append(re.escape(c))
                else:
                    body = pattern[i + 1 : j]
                    if body.startswith("!"):
                        body = "^" + body[1:]
                    out.append("[" + body.replace("\\", "\\\\") + "]")
                    i = j
            else:
                out.append(re.escape(c))
            i += 1
    return _compile("".join(out) + r"\Z", re.DOTALL)


def _walk(top: str, max_depth: int | None = None) -> Iterator[tuple[str, bool, bool, str]]:
    """Yield ``(relpath, is_dir, is_symlink, abspath)`` depth-first in sorted order; never follows symlinks.

    With ``max_depth``, nothing deeper than that many levels is even read.
    """
    stack = [("", top, 1)]
    while stack:
        rel, path, depth = stack.pop()
        try:
            with os.scandir(path) as it:
                entries = sorted(it, key=lambda e: e.name, reverse=True)
        except (PermissionError, NotADirectoryError, FileNotFoundError):
            continue
        subdirs: list[tuple[str, str, int]] = []
        for e in reversed(entries):
            r = rel + "/" + e.name if rel else e.name
            try:
                is_dir = e.is_dir(follow_symlinks=False)
                link = e.is_symlink()
            except OSError:
                continue
            yield r, is_dir, link, e.path
            if is_dir and (max_depth is None or depth < max_depth):
                subdirs.append((r, e.path, depth + 1))
        stack.extend(reversed(subdirs))


def _lines(data: bytes) -> list[bytes]:
    """Lines ending in ``\n`` only, as grep and sed count them (not ``str.splitlines``' many breaks)."""
    parts = data.split(b"\n")
    out = [p + b"\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def _need_dir(path: str) -> None:
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(20, "Not a directory", path)


def op_read(req: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
    path = req["path"]
    with open(path, "rb") as fh:
        data = fh.read()
    start, end = req.get("start_line"), req.get("end_line")
    if start is not None or end is not None:
        lines = _lines(data)
        s = max(1, start or 1) - 1
        e = len(lines) if end is None else end
        data = b"".join(lines[s:e])
    return {}, data


def op_write(req: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
    path = req["path"]
    if len(os.fsencode(path)) >= 4096:
        # Longer than PATH_MAX: fail before creating any of its directories.
        raise OSError(36, "File name too long", path)
    parent = os.path.dirname(path) or "."
    try:
        os.makedirs(parent, exist_ok=True)
    except FileExistsError:
        # A component of the parent is a file: say so as the local filesystem would.
        raise NotADirectoryError(20, "Not a directory", parent) from None
    mode = None
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "Is a directory", path)
        mode = stat.S_IMODE(st.st_mode)
    except FileNotFoundError:
        pass
    # A short name: the target's own name may already be at the 255-byte limit.
    tmp = os.path.join(parent, ".boxlite-tmp-%d-%s" % (os.getpid(), os.urandom(4).hex()))
    try:
        with open(tmp, "wb") as fh:
            if req.get("append") and mode is not None:
                with open(path, "rb") as old:
                    while True:
                        chunk = old.read(1 << 20)
                        if not chunk:
                            break
                        fh.write(chunk)
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return {"size": os.path.getsize(path)}, b""


def op_exists(req: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
    return {"exists": os.path.lexists(req["path"])}, b""


def op_remove(req: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
    path = req["path"]
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        import shutil

        shutil.rmtree(path)
    else:
        os.unlink(path)
    return {}, b""


def op_list_dir(req: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
    top = req["path"]
    _need_dir(top)
    depth = int(req.get("max_depth", 2))
    base = top.rstrip("/") or "/"
    out: list[str] = []
    for rel, is_dir, _link, _abs in _walk(top, depth):
        full = base + "/" + rel if base != "/" else "/" + rel
        out.append(full + "/" if is_dir else full)
    return {"entries": sorted(out)}, b""


def op_glob(req: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
    top = req["path"]
    _need_dir(top)
    rx = _regex_for_glob(req["pattern"])
    limit = int(req.get("max_results", 200))
    include_dirs = bool(req.get("include_dirs"))
    base = top.rstrip("/") or "/"
    out: list[str] = []
    truncated = False
    for rel, is_dir, _link, _abs in _walk(top):
        if is_dir and not include_dirs:
            continue
        if rx.match(rel):
            if len(out) >= limit:
                truncated = True
                break
            out.append(base + "/" + rel if base != "/" else "/" + rel)
    return {"paths": out, "truncated": truncated}, b""


def op_grep(req: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
    import fnmatch
    import re

    top = req["path"]
    flags = 0 if req.get("case_sensitive", True) else re.IGNORECASE
    pat = req["pattern"]
    rx = _compile(re.escape(pat) if req.get("literal") else pat, flags)
    file_glob = req.get("glob")
    grx = _regex_for_glob(file_glob) if file_glob and "/" in file_glob else None
    limit = int(req.get("max_results", 100))
    out: list[list[Any]] = []
    truncated = False
    st = os.stat(top)
    files: Iterator[tuple[str, str]]
    if stat.S_ISDIR(st.st_mode):
        base = top.rstrip("/") or "/"
        files = (
            (base + "/" + rel if base != "/" else "/" + rel, rel)
            for rel, is_dir, link, _abs in _walk(top)
            if not is_dir and not link
        )
    else:
        files = iter([(top, os.path.basename(top))])
    for full, rel in files:
        if file_glob:
            if grx is not None:
                if not grx.match(rel):
                    continue
            elif not fnmatch.fnmatchcase(os.path.basename(rel), file_glob):
                continue
        try:
            if not stat.S_ISREG(os.stat(full).st_mode):
                continue
            with open(full, "rb") as fh:
                head = fh.read(8192)
                if b"\0" in head:
                    continue  # binary file
                data = head + fh.read()
        except OSError:
            continue
        for n, raw in enumerate(_lines(data), 1):
            line = raw.rstrip(b"\n").decode("utf-8", "replace")
            if rx.search(line):
                if len(out) >= limit:
                    truncated = True
                    break
                out.append([full, n, line])
        if truncated:
            break
    return {"matches": out, "truncated": truncated}, b""


def _tar_info(name: str, st: os.stat_result) -> tarfile.TarInfo:
    """A tar header from ``lstat`` alone.  ``TarFile.gettarinfo`` would look up the owner's user
    and group names (``pwd``/``grp``), which loads the box's NSS modules: ids stay numbers."""
    import tarfile

    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode)
    info.uid, info.gid = st.st_uid, st.st_gid
    info.uname = info.gname = ""
    info.mtime = int(st.st_mtime)
    return info


def _tar_tree(top: str, out: IO[bytes]) -> None:
    """``top``'s contents as a tar stream on ``out``: directories, regular files, symbolic links
    (never followed) and hard links between files of the tree; FIFOs and devices as such."""
    import tarfile

    seen: dict[tuple[int, int], str] = {}  # (dev, ino) of regular files with several links -> the first one's name
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        root = _tar_info(".", os.lstat(top))
        root.type = tarfile.DIRTYPE
        tar.addfile(root)
        for rel, _is_dir, _link, path in _walk(top):
            try:
                st = os.lstat(path)
            except OSError:
                continue  # gone since it was listed
            info = _tar_info("./" + rel, st)
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                info.type = tarfile.DIRTYPE
            elif stat.S_ISLNK(mode):
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(path)
            elif stat.S_ISREG(mode):
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in seen:
                    info.type = tarfile.LNKTYPE
                    info.linkname = seen[key]
                    tar.addfile(info)
                    continue
                seen[key] = info.name
                # O_NONBLOCK|O_NOFOLLOW: a name swapped for a FIFO or a link since lstat fails.
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
                with os.fdopen(fd, "rb") as fh:
                    now = os.fstat(fd)
                    if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != key:
                        raise OSError(11, "File changed while it was read", path)
                    info.size = now.st_size
                    tar.addfile(info, fh)
                continue
            elif stat.S_ISFIFO(mode):
                info.type = tarfile.FIFOTYPE
            elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                info.type = tarfile.CHRTYPE if stat.S_ISCHR(mode) else tarfile.BLKTYPE
                info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
            else:
                continue  # a socket: tar has no such member
            tar.addfile(info)


def op_fetch(req: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
    """A file's bytes, or a directory's contents as a tar stream."""
    path = req["path"]
    if not os.path.isdir(path):
        with open(path, "rb") as fh:
            return {"is_dir": False}, fh.read()
    import io

    buf = io.BytesIO()
    _tar_tree(path, buf)
    return {"is_dir": True}, buf.getvalue()


def op_tar_in(req: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
    dest = req["path"]
    os.makedirs(dest, exist_ok=True)
    import io
    import tarfile

    # "r:": the host sends a plain tar; "r" would try gzip, bz2 and lzma first (imports).
    with tarfile.open(fileobj=io.BytesIO(payload), mode="r:") as tar:
        kwargs: dict[str, Any] = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}
        # numeric_owner: as root, tarfile would otherwise look the names up (the box's NSS modules).
        tar.extractall(dest, numeric_owner=True, **kwargs)
    return {}, b""


OPS: dict[str, Op] = {
    "read": op_read,
    "write": op_write,
    "exists": op_exists,
    "remove": op_remove,
    "list_dir": op_list_dir,
    "glob": op_glob,
    "grep": op_grep,
    "fetch": op_fetch,
    "tar_in": op_tar_in,
}


def main(stdin: IO[bytes] | None = None, out: IO[bytes] | None = None) -> None:
    """Serve one request from ``stdin`` to ``out`` (binary streams; this process's by default)."""
    stdin = stdin or sys.stdin.buffer
    out = out or sys.stdout.buffer
    req = json.loads(stdin.readline().decode("utf-8"))
    payload = stdin.read(req.get("payload", 0)) if req.get("payload") else b""
    try:
        meta, data = OPS[req["op"]](req, payload)
        meta["ok"] = True
    except OSError as exc:
        meta, data = (
            {"ok": False, "errno": exc.errno or 0, "strerror": exc.strerror or str(exc), "filename": exc.filename},
            b"",
        )
    except PatternError as exc:
        meta, data = (
            {"ok": False, "errno": 0, "strerror": str(exc), "kind": "pattern"},
            b"",
        )
    if req.get("b64"):
        import base64

        data = base64.b64encode(data)
    meta["payload"] = len(data)
    out.write((json.dumps(meta) + "\n").encode("ascii"))
    out.write(data)
    out.flush()


if __name__ == "__main__":
    main()
