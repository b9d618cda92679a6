"""Hostile file transfers (issue 22, item 1 and "the file helper runs nothing the guest controls").

A guest is root in its box and has read our source.  It planted an NSS module (``libnss_*.so.2``
and ``/etc/nsswitch.conf``) in its box; the file helper loaded it (``pwd.getpwuid`` while building
a tar) and the module replaced the helper's answer with a crafted tar: a chain of symbolic links
that a lexical check accepts, a hard link through that chain to a host file, then a regular
member of the same name, and the host's extraction wrote the host file.  Here:

* the same crafted streams go straight to :func:`pytest_boxlite.sandbox._extract_tree`: each is
  refused with :class:`~pytest_boxlite.errors.InvalidPathError` and nothing outside the
  destination changes (nor, for a refused tree, inside it);
* a real NSS module, built with ``gcc`` and planted as root in a real namespace box, is shown to
  load in a guest command and not in any file operation (nor in the agent resolving a user name);
  it answers the whole attack if it is ever loaded;
* over-size and malformed answers of a hostile helper are refused before they are buffered, and a
  real download streams to disk: the host's peak RSS of a sub-process stays under 150 MB.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import new_box_name
from subruns import sub_env

from pytest_boxlite import errors
from pytest_boxlite.sandbox import Sandbox, _extract_tree

pytestmark = [pytest.mark.escapes, pytest.mark.timeout(120)]

#: The issue's bound on the host's peak RSS while a hostile helper answers, in KiB.
HOST_RSS_BOUND_KIB = 150 * 1024
SECRET = b"host secret\n"

Member = tuple[str, str, bytes | str]


def crafted_tar(*members: Member) -> io.BytesIO:
    """A tar stream exactly as given: ``(name, kind, data)`` with kind ``dir``, ``file`` (data: the
    content), ``sym`` or ``hard`` (data: the link target), ``fifo`` or ``chr``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.mode = 0o755 if kind == "dir" else 0o644
            if kind == "dir":
                info.type = tarfile.DIRTYPE
            elif kind == "file":
                assert isinstance(data, bytes)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                continue
            elif kind in ("sym", "hard"):
                info.type = tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE
                assert isinstance(data, str)
                info.linkname = data
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            else:
                info.type = tarfile.CHRTYPE
                info.devmajor, info.devminor = 1, 3
            tar.addfile(info)
    buf.seek(0)
    return buf


def with_parents(members: list[Member]) -> list[Member]:
    """``members``, each preceded by directory members for its parents (as a real tar has them)."""
    out: list[Member] = []
    seen: set[str] = set()
    for name, kind, data in members:
        parts = name.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent not in seen:
                seen.add(parent)
                out.append((parent, "dir", b""))
        out.append((name, kind, data))
    return out


def issue_attack(ups: int) -> io.BytesIO:
    """The issue's tar: ``j`` -> ``../../..`` (lexically inside), ``k`` -> ``j/`` + ``ups`` times
    ``..`` + ``host`` (lexically inside, really the host directory beside the destination's
    ancestors), a hard link through ``k`` to the host's file, then a regular member of its name."""
    return crafted_tar(
        ("x", "dir", b""),
        ("x/y", "dir", b""),
        ("x/y/z", "dir", b""),
        ("x/y/z/w", "dir", b""),
        ("x/y/z/w/j", "sym", "../../.."),
        ("x/y/z/w/k", "sym", "j/" + "../" * ups + "host"),
        ("x/h", "hard", "x/y/z/w/k/secret.txt"),
        ("x/h", "file", b"pwned by the guest\n"),
    )


@pytest.fixture(params=["python-filter", "own-checks"])
def layout(request: pytest.FixtureRequest, host_layout: tuple[Path, Path]) -> tuple[Path, Path]:
    """:func:`host_layout`, extracted with Python's ``tarfile.data_filter`` as a second opinion (where
    this Python has it) and without it: the extraction's own checks must hold alone."""
    if request.param == "own-checks":
        request.getfixturevalue("monkeypatch").delattr(tarfile, "data_filter", raising=False)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python has no tarfile.data_filter (3.12, or a 3.8-3.11 security release)")
    return host_layout


@pytest.fixture
def host_layout(tmp_path: Path) -> tuple[Path, Path]:
    """``(dest, host_dir)``: an empty destination four levels below ``tmp_path`` and, beside those
    levels, a host directory holding ``secret.txt``."""
    host = tmp_path / "host"
    host.mkdir()
    (host / "secret.txt").write_bytes(SECRET)
    dest = tmp_path / "a" / "b" / "c" / "dest"
    dest.mkdir(parents=True)
    return dest, host


def snapshot(root: Path) -> dict[str, tuple[str, bytes | str | None]]:
    """Every entry under ``root`` (links not followed): its kind and content or target."""
    out: dict[str, tuple[str, bytes | str | None]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", None)
            else:
                out[rel] = ("file", p.read_bytes())
    return out


@pytest.mark.escape_row("download-links", runtime="host")
def test_the_issue_link_chain_and_hard_link_cannot_write_a_host_file(layout: tuple[Path, Path]) -> None:
    dest, host = layout
    before = snapshot(dest.parents[3])
    # k leads from dest/x up five levels: dest, c, b, a, tmp_path, then into host/.
    with pytest.raises(errors.InvalidPathError, match=r"'x/h' is a hard link to 'x/y/z/w/k/secret.txt', which is"):
        _extract_tree(issue_attack(5), dest, "t")
    assert (host / "secret.txt").read_bytes() == SECRET
    assert snapshot(dest.parents[3]) == before  # refused before anything was written


@pytest.mark.parametrize(
    "members",
    [
        # Each link is inside by a lexical check (normpath), and the chain leaves.
        # d/e/j is d, so k -> d/e/j/../.. is the destination's parent
        [("d/e/j", "sym", ".."), ("k", "sym", "d/e/j/../..")],
        # three links: p/q/r is p, p/q/t is p/q/r/q/r, which is p again, so u leaves
        [("p/q/r", "sym", ".."), ("p/q/t", "sym", "r/q/r"), ("u", "sym", "p/q/t/../../host")],
        # through a link that comes later in the stream
        [("k", "sym", "a/b/later/../../x"), ("a/b/later", "sym", "..")],
        # the plain cases
        [("abs", "sym", "/etc/passwd")],
        [("up", "sym", "../dest-sibling")],
    ],
    ids=["chain", "three-deep", "defined-later", "absolute", "parent"],
)
@pytest.mark.escape_row("download-links", runtime="host")
def test_a_symlink_resolving_out_is_refused(layout: tuple[Path, Path], members: list[Member]) -> None:
    dest, host = layout
    with pytest.raises(errors.InvalidPathError, match="leaves the destination"):
        _extract_tree(crafted_tar(*with_parents(members)), dest, "t")
    assert list(dest.iterdir()) == []
    assert (host / "secret.txt").read_bytes() == SECRET


@pytest.mark.escape_row("download-through-links", runtime="host")
def test_no_write_goes_through_a_link_already_in_the_destination(layout: tuple[Path, Path]) -> None:
    dest, host = layout
    (dest / "out").symlink_to(host)
    os.link(host / "secret.txt", dest / "same-inode")
    # Below a symbolic link that was there: refused, and the host directory gains nothing.
    with pytest.raises(errors.InvalidPathError, match=r"'out'|outside the destination"):
        _extract_tree(crafted_tar(("out/secret.txt", "file", b"pwned\n")), dest, "t")
    with pytest.raises(errors.InvalidPathError):
        _extract_tree(crafted_tar(("out/new", "file", b"pwned\n")), dest, "t")
    # A link of the tree through the one that was there: its target is not the tree's to vouch for.
    with pytest.raises(errors.InvalidPathError, match=r"(leaves|outside) the destination"):
        _extract_tree(crafted_tar(("peek", "sym", "out/secret.txt")), dest, "t")
    # A hard link that was there is replaced by the new file, never written through.
    _extract_tree(crafted_tar(("same-inode", "file", b"new content\n")), dest, "t")
    assert (dest / "same-inode").read_bytes() == b"new content\n"
    assert (host / "secret.txt").read_bytes() == SECRET
    assert sorted(p.name for p in host.iterdir()) == ["secret.txt"]


@pytest.mark.escape_row("download-through-links", runtime="host")
def test_hard_links_only_to_files_this_download_wrote(layout: tuple[Path, Path]) -> None:
    dest, host = layout
    (dest / "there").write_bytes(b"the user's\n")
    for members in (
        [("h", "hard", "there")],  # a file that was in the destination already
        [("d", "dir", b""), ("h", "hard", "d")],  # a directory
        [("h", "hard", "../host/secret.txt")],
        [("l", "sym", "f"), ("f", "file", b"x"), ("h", "hard", "l")],  # a link, not a file
    ):
        with pytest.raises(errors.InvalidPathError, match=r"hard link|'\.\.'|outside the destination"):
            _extract_tree(crafted_tar(*members), dest, "t")
    assert sorted(p.name for p in dest.iterdir()) == ["there"]
    # To a file of the tree written before it: a real hard link.
    _extract_tree(crafted_tar(("a/f", "file", b"shared\n"), ("b", "hard", "a/f")), dest, "t")
    assert (dest / "b").read_bytes() == b"shared\n"
    assert os.stat(dest / "b").st_ino == os.stat(dest / "a" / "f").st_ino
    assert (host / "secret.txt").read_bytes() == SECRET


@pytest.mark.parametrize("kind", ["fifo", "chr"])
@pytest.mark.escape_row("download-links", runtime="host")
def test_devices_and_fifos_are_refused(layout: tuple[Path, Path], kind: str) -> None:
    dest, _ = layout
    with pytest.raises(errors.InvalidPathError, match="special file"):
        _extract_tree(crafted_tar(("ok", "file", b"x"), ("odd", kind, b"")), dest, "t")
    assert list(dest.iterdir()) == []


@pytest.mark.escape_row("download-links", runtime="host")
def test_names_that_leave_are_refused(layout: tuple[Path, Path]) -> None:
    dest, host = layout
    for name in ("../host/secret.txt", "/tmp/boxlite-absolute", "a/../../host/secret.txt"):
        with pytest.raises(errors.InvalidPathError):
            _extract_tree(crafted_tar((name, "file", b"pwned\n")), dest, "t")
    assert (host / "secret.txt").read_bytes() == SECRET
    assert not Path("/tmp/boxlite-absolute").exists()
    assert list(dest.iterdir()) == []


@pytest.mark.escape_row("download-links", runtime="host")
def test_an_honest_tree_with_links_inside_extracts(layout: tuple[Path, Path]) -> None:
    dest, _ = layout
    buf = crafted_tar(
        ("sub", "dir", b""),
        ("sub/f", "file", b"data\n"),
        ("inside", "sym", "sub/f"),
        ("via", "sym", "inside"),  # a link to a link, still inside
        ("top", "sym", "."),  # the destination itself
        ("sub/up", "sym", ".."),
        ("loop", "sym", "loop"),  # resolves nowhere: harmless
        ("sub/h", "hard", "sub/f"),
    )
    _extract_tree(buf, dest, "t")
    assert (dest / "via").read_bytes() == b"data\n"
    assert os.readlink(dest / "top") == "."
    assert (dest / "sub" / "up" / "inside").read_bytes() == b"data\n"
    assert os.stat(dest / "sub" / "h").st_ino == os.stat(dest / "sub" / "f").st_ino
    assert not any(p.name.startswith(".boxlite-") for p in dest.rglob("*"))


# --------------------------------------------------------------------------------------------
# a real NSS module, planted as root in a real box

NSS_MODULE = r"""
#include <fcntl.h>
#include <unistd.h>
/* Runs when anything in the box loads the module (an NSS lookup): it leaves a mark and, where
   the guest prepared one, writes the crafted answer on stdout and ends the process, as the
   issue's attack did to the file helper. */
__attribute__((constructor)) static void planted(void) {
    int mark = open("/tmp/nss-loaded", O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (mark >= 0) { write(mark, "loaded\n", 7); close(mark); }
    int fd = open("/tmp/evil-answer", O_RDONLY);
    if (fd < 0) return;
    char buf[65536];
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0) write(1, buf, n);
    _exit(0);
}
"""
LIBDIR = "/usr/lib/x86_64-linux-gnu"


@pytest.fixture
def nss_module(tmp_path: Path) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None or not Path(LIBDIR, "libnss_files.so.2").exists():
        pytest.skip(f"planting an NSS module needs gcc and glibc's libnss_files.so.2 in {LIBDIR}")
    src = tmp_path / "nss.c"
    src.write_text(NSS_MODULE)
    lib = tmp_path / "libnss_boxlite.so.2"
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    return lib


@pytest.mark.escape_row("file-helper-nss", "agent-nss", users="root")
def test_a_planted_nss_module_is_never_loaded_by_file_operations(
    ns_sandbox: Sandbox, nss_module: Path, host_layout: tuple[Path, Path], tmp_path: Path
) -> None:
    sb = ns_sandbox
    dest, host = host_layout
    # The guest plants the module and names it first for users and groups, and prepares the
    # issue's answer: the helper's header, then the crafted tar (its k reaches the host directory
    # from the destination, as a guest that read our tests would aim it).
    evil = issue_attack(5).getvalue()
    header = json.dumps({"is_dir": True, "ok": True, "payload": len(evil)}).encode() + b"\n"
    sb.write_bytes("/tmp/evil-answer", header + evil)
    try:
        sb.write_bytes(f"{LIBDIR}/libnss_boxlite.so.2", nss_module.read_bytes())
    except errors.BoxPermissionError:
        if os.geteuid() == 0:
            raise
        # The box's root is this user: the host's root-owned /usr/lib and /etc stay read-only.
        pytest.skip(f"an ordinary user's box cannot write {LIBDIR} or /etc: no NSS module can be planted")
    sb.execute_command("mkdir -p t/sub && echo honest > t/sub/f && chown 0:0 t/sub/f", check=True, timeout=20)
    sb.write_file("/etc/nsswitch.conf", "passwd: boxlite files\ngroup: boxlite files\nshadow: files\n")
    # Control: a guest command that looks a user up loads it (and answers the crafted stream).
    control = sb.run(["python3", "-I", "-S", "-c", "import pwd; pwd.getpwuid(0)"], timeout=20)
    assert control.stdout_bytes == header + evil
    assert sb.read_file("/tmp/nss-loaded") == "loaded\n"
    sb.remove("/tmp/nss-loaded")

    sb.download("t", dest)  # a tree: the helper builds a tar, where pwd.getpwuid loaded it
    assert (host / "secret.txt").read_bytes() == SECRET
    assert snapshot(dest) == {"sub": ("dir", None), "sub/f": ("file", b"honest\n")}
    sb.download("t/sub/f", tmp_path / "one")
    assert sb.read_bytes("t/sub/f") == b"honest\n"
    up = tmp_path / "up"
    (up / "d").mkdir(parents=True)
    (up / "d" / "g").write_text("uploaded\n")
    sb.upload(up, "u")  # extracted as root in the box: names would be looked up for chown
    assert sb.read_file("u/d/g") == "uploaded\n"
    sb.write_file("w.txt", "w\n")
    assert sb.exists("w.txt")
    assert sb.list_dir("t", max_depth=3)
    assert sb.glob("t", "**").items
    assert sb.grep("t", "honest").items
    sb.remove("w.txt")
    # The agent resolving a user name reads /etc/passwd itself (pwd would load it into pid 1).
    assert sb.execute_command("echo $(cat /proc/self/status | grep ^Uid)", user="nobody", timeout=20).ok

    assert not sb.exists("/tmp/nss-loaded"), sb.read_file("/tmp/nss-loaded")
    assert (host / "secret.txt").read_bytes() == SECRET
    assert sorted(p.name for p in host.iterdir()) == ["secret.txt"]


# --------------------------------------------------------------------------------------------
# hostile answers: bounded before they are buffered

HOSTILE_HELPER = r'''
import json, sys
from pytest_boxlite import errors
from pytest_boxlite.runtimes.base import BoxDefaults, RawResult
from pytest_boxlite.sandbox import Sandbox

MIB = 1 << 20

class Hostile(BoxDefaults):
    """A fault injected where the helper's answer arrives (a fake box: the answer is what a
    subverted helper could send): ``chunks`` yields its stdout."""

    name = id = "hostile"
    runtime_name = "fake"
    guest_python = "python3"
    binary_stdout = True
    workdir = "/workspace"

    def __init__(self, chunks):
        self.chunks = chunks
        self.fed = 0

    def run_helper(self, payload, *, timeout, max_output, sink=None):
        if sink is None:  # a host that takes the whole answer at once
            return RawResult(0, b"".join(self.chunks()), b"", False, 0.0)
        for chunk in self.chunks():
            self.fed += len(chunk)
            sink(chunk)
        return RawResult(0, b"", b"", False, 0.0)

def announcing(size, sent):
    def chunks():
        yield json.dumps({"ok": True, "payload": size}).encode() + b"\n"
        block = b"\0" * MIB
        for _ in range(sent // MIB):
            yield block
    return chunks

def endless_header():
    block = b"x" * MIB
    for _ in range(800):
        yield block

cases = {
    "over-size": announcing(800 * MIB, 800 * MIB),
    "more-than-announced": announcing(10, 800 * MIB),
    "header-without-end": endless_header,
}
out = {}
for name, chunks in cases.items():
    box = Hostile(chunks)
    try:
        Sandbox(box, max_transfer=64 * MIB).read_bytes("/x")
        out[name] = "accepted"
    except errors.GuestToolError as exc:
        out[name] = "refused: %s (after %d bytes)" % (exc, box.fed)
out["maxrss_kib"] = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps(out))
'''


def run_measured(script: str, tmp_path: Path, *args: str) -> dict[str, object]:
    """Run ``script`` in a fresh interpreter; its last stdout line as JSON.

    The scripts report their peak as ``VmHWM``, their own address space's: ``ru_maxrss`` of
    ``RUSAGE_SELF`` keeps across execve the peak of the process before it, a fork of this pytest
    (hundreds of MB in a whole suite's run).
    """
    path = tmp_path / "measure.py"
    path.write_text(script)
    proc = subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=100, env=sub_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.escape_row("download-gigabytes", runtime="host")
def test_an_over_size_answer_is_refused_before_it_is_buffered(tmp_path: Path) -> None:
    out = run_measured(HOSTILE_HELPER, tmp_path)
    for case in ("over-size", "more-than-announced", "header-without-end"):
        assert str(out[case]).startswith("refused"), (case, out[case])
    assert "exceeds the transfer cap" in str(out["over-size"])
    assert "after 0 bytes" not in str(out["over-size"])
    assert int(str(out["over-size"]).rsplit("after ", 1)[1].split()[0]) < 1 << 20  # the header only
    assert "header line exceeds" in str(out["header-without-end"])
    assert int(str(out["maxrss_kib"])) < HOST_RSS_BOUND_KIB, out


class _Scripted:
    """A fault injected where the helper's answer arrives: it answers ``answer`` to anything."""

    name = id = "scripted"
    runtime_name = "fake"
    guest_python = "python3"
    binary_stdout = True
    workdir = "/workspace"

    def __init__(self, answer: bytes) -> None:
        self.answer = answer

    def run_helper(self, payload: bytes, *, timeout: float, max_output: int, sink: object) -> object:
        from pytest_boxlite.runtimes.base import RawResult

        assert callable(sink)
        sink(self.answer)
        return RawResult(0, b"", b"", False, 0.0)


@pytest.mark.parametrize(
    ("call", "answer"),
    [
        ("read", b"not json\n"),
        ("read", b"[1, 2]\n"),
        ("read", b'{"ok": true, "payload": -1}\n'),
        ("read", b'{"ok": true, "payload": "10"}\n'),
        ("read", b'{"payload": 0}\n'),
        ("read", b'{"ok": true, "payload": 10}\nshort'),
        ("read", b'{"ok": false, "payload": 0, "errno": "2", "strerror": "x"}\n'),
        ("read", b'{"ok": false, "payload": 0, "errno": 2, "strerror": {"a": 1}}\n'),
        ("list", b'{"ok": true, "payload": 0, "entries": [1]}\n'),
        ("list", b'{"ok": true, "payload": 0, "entries": "abc"}\n'),
        ("grep", b'{"ok": true, "payload": 0, "matches": [["/f", "1", "x"]], "truncated": false}\n'),
        ("grep", b'{"ok": true, "payload": 0, "matches": [["/f", 1]], "truncated": false}\n'),
        ("exists", b'{"ok": true, "payload": 0, "exists": "yes"}\n'),
        ("download", b'{"ok": true, "payload": 0, "is_dir": 1}\n'),
        ("download", b'{"ok": true, "payload": 3, "is_dir": true}\nabc'),
    ],
)
@pytest.mark.escape_row("download-gigabytes", runtime="host")
def test_a_malformed_answer_is_a_clear_error(call: str, answer: bytes, tmp_path: Path) -> None:
    sb = Sandbox(_Scripted(answer))  # type: ignore[arg-type]
    calls: dict[str, Callable[[], object]] = {
        "read": lambda: sb.read_bytes("/x"),
        "list": lambda: sb.list_dir("/x"),
        "grep": lambda: sb.grep("/x", "y"),
        "exists": lambda: sb.exists("/x"),
        "download": lambda: sb.download("/x", tmp_path / "d"),
    }
    with pytest.raises(errors.GuestToolError, match=r"scripted|refused"):
        calls[call]()
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary file left


REAL_DOWNLOAD = r"""
import json, os, sys, tempfile
from pathlib import Path
from pytest_boxlite import errors
from pytest_boxlite.runtimes import open_runtime
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec

home, dest, name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
rt = open_runtime("namespace", home, owner="t" + name[-8:])
out = {}
try:
    box = rt.create_box(BoxSpec(), name, timeout=30)
    try:
        sb = Sandbox(box, default_timeout=60)
        sb.execute_command("mkdir -p t && head -c 120M /dev/zero > t/big", check=True)
        sb.download("t/big", dest / "big")
        sb.download("t", dest / "tree")
        out["sizes"] = [os.path.getsize(dest / "big"), os.path.getsize(dest / "tree" / "big")]
        sb.max_transfer = 100 << 20
        try:
            sb.read_bytes("t/big")
            out["capped"] = "accepted"
        except errors.GuestToolError as exc:
            out["capped"] = str(exc)
    finally:
        box.destroy()
finally:
    rt.close()
out["maxrss_kib"] = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps(out))
"""


@pytest.mark.escape_row("download-gigabytes")
def test_a_real_download_streams_to_disk(tmp_path: Path) -> None:
    """120 MiB downloaded as a file and as a tree from a real box: the host's peak RSS stays
    under the bound (it held three copies of the answer before), and a read over the cap is refused."""
    home = tmp_path / "home"
    home.mkdir()
    out = run_measured(REAL_DOWNLOAD, tmp_path, str(home), str(tmp_path), new_box_name())
    assert out["sizes"] == [120 << 20, 120 << 20]
    assert "exceeds the transfer cap" in str(out["capped"])
    assert int(str(out["maxrss_kib"])) < HOST_RSS_BOUND_KIB, out


@pytest.fixture(autouse=True)
def _no_stray_absolute() -> Iterator[None]:
    yield
    Path("/tmp/boxlite-absolute").unlink(missing_ok=True)


@pytest.mark.escape_row("download-gigabytes", runtime="host")
def test_a_huge_tar_header_is_refused_unread(layout: tuple[Path, Path]) -> None:
    """tarfile reads a pax header whole: one larger than a MiB is refused before it is read."""
    dest, _ = layout
    buf = crafted_tar(("d/" + "n" * 200 + "/" * (2 << 20) + "f", "file", b"x"))
    with pytest.raises(errors.GuestToolError, match="larger than"):
        _extract_tree(buf, dest, "t")
    assert list(dest.iterdir()) == []


FORK_IMPORTS = r"""
import importlib.util, io, json, os, sys

# As the namespace agent does at boot (guest/agent.py _load_helper): the helper, then its lazy imports.
spec = importlib.util.spec_from_file_location("_boxlite_guest_helper", sys.argv[1])
helper = importlib.util.module_from_spec(spec)
spec.loader.exec_module(helper)
for name in helper.LAZY_IMPORTS:
    importlib.import_module(name)
root = sys.argv[2]
with open(sys.argv[3], "rb") as fh:
    upload = fh.read()
before = set(sys.modules)
os.symlink("d/f", os.path.join(root, "link"))
requests = [
    ({"op": "tar_in", "path": root}, upload),
    ({"op": "write", "path": root + "/w", "append": False}, b"w\n"),
    ({"op": "read", "path": root + "/w", "start_line": 1, "end_line": 1}, b""),
    ({"op": "fetch", "path": root}, b""),
    ({"op": "fetch", "path": root + "/w", "b64": True}, b""),
    ({"op": "list_dir", "path": root, "max_depth": 3}, b""),
    ({"op": "glob", "path": root, "pattern": "**/f", "include_dirs": False, "max_results": 9}, b""),
    ({"op": "grep", "path": root, "pattern": "x", "glob": "*f", "literal": False, "case_sensitive": False,
      "max_results": 9}, b""),
    ({"op": "grep", "path": root, "pattern": "(", "glob": None}, b""),
    ({"op": "exists", "path": root + "/nope"}, b""),
    ({"op": "remove", "path": root + "/d"}, b""),
    ({"op": "read", "path": root + "/gone"}, b""),
]
answers = []
for req, payload in requests:
    req["payload"] = len(payload)
    out = io.BytesIO()
    helper.main(io.BytesIO(json.dumps(req).encode() + b"\n" + payload), out)
    answers.append(json.loads(out.getvalue().split(b"\n", 1)[0])["ok"])
print(json.dumps({"new": sorted(set(sys.modules) - before), "ok": answers}))
"""


@pytest.mark.escape_row("file-helper-nss", runtime="host")
def test_file_operations_import_nothing_after_boot(tmp_path: Path) -> None:
    """In a namespace box the helper runs in a fork of the agent: every module its operations use
    must be imported at boot, before a guest could replace a module file in the box."""
    from pytest_boxlite import guest

    upload = tmp_path / "upload.tar"
    with tarfile.open(upload, "w") as tar:  # as Sandbox.upload sends it: names "root"
        info = tarfile.TarInfo("d/f")
        info.size, info.uname, info.gname = 2, "root", "root"
        tar.addfile(info, io.BytesIO(b"x\n"))
    root = tmp_path / "root"
    root.mkdir()
    out = run_measured(FORK_IMPORTS, tmp_path, str(guest.path("files")), str(root), str(upload))
    assert out["new"] == [], "imported by a file operation after boot"
    assert out["ok"] == [True] * 8 + [False, True, True, False]  # a bad pattern and a missing file answer errors


@pytest.mark.escape_row("download-gigabytes")
def test_the_transfer_cap_holds_on_every_runtime(sandbox: Sandbox, tmp_path: Path) -> None:
    """Each runtime streams the helper's answer (the vm one as base64 text): over the cap it is
    refused when announced, nothing is left at the destination, and the box goes on serving."""
    sandbox.write_bytes("big.bin", os.urandom(300_000))
    small = Sandbox(sandbox.handle, max_transfer=100_000)
    for call in (
        lambda: small.read_bytes("big.bin"),
        lambda: small.download("big.bin", tmp_path / "one" / "big.bin"),
        lambda: small.download(".", tmp_path / "tree"),
    ):
        with pytest.raises(errors.GuestToolError, match="exceeds the transfer cap of 100000 bytes"):
            call()
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []
    sandbox.write_bytes("small.bin", b"fits\n")
    assert small.read_bytes("small.bin") == b"fits\n"
