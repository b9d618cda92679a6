"""The image unpacker against hostile layers (issue 25, "unpacking is hostile-input code").

Each layer is a real tar (gzip or plain) written here member by member, exactly as an attacker
would; it is applied by :func:`pytest_boxlite.images.unpack.apply_layer` (the code every image
goes through) into a real directory.  A planted path on the host (under this test's tmp_path,
outside the tree) must never be written, removed or linked; the tree must stay inside itself, its
directories removable by the unpacking user, no device nodes, no setuid bits.  Run as root and as
an ordinary user (tests/test_nonroot.py runs the suite so).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pytest_boxlite.images import ImageError
from pytest_boxlite.images.store import _rmtree
from pytest_boxlite.images.unpack import Limits, apply_layer, tree_size

pytestmark = [pytest.mark.escapes, pytest.mark.reliability]

#: (name, kind, data, mode): kind is dir, file (data: bytes), sym or hard (data: the link's
#: target), fifo, chr.  mode None: 0o755 for directories, 0o644 otherwise.
Member = tuple[str, str, "bytes | str | None", "int | None"]


def tar_of(*members: Member) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, data, mode in members:
            ti = tarfile.TarInfo(name)
            ti.mode = mode if mode is not None else (0o755 if kind == "dir" else 0o644)
            ti.uid = ti.gid = 0
            if kind == "file":
                assert isinstance(data, bytes)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
                continue
            ti.type = {
                "dir": tarfile.DIRTYPE,
                "sym": tarfile.SYMTYPE,
                "hard": tarfile.LNKTYPE,
                "fifo": tarfile.FIFOTYPE,
                "chr": tarfile.CHRTYPE,
            }[kind]
            if kind in ("sym", "hard"):
                assert isinstance(data, str)
                ti.linkname = data
            if kind == "chr":
                ti.devmajor, ti.devminor = 1, 3
            tf.addfile(ti)
    return buf.getvalue()


def unpack(tmp_path: Path, *layers: bytes, compress: bool = False, limits: Limits | None = None) -> Path:
    """Apply ``layers`` in order to a fresh tree ``tmp_path/root``, each checked against its diff_id."""
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    for n, data in enumerate(layers):
        blob = tmp_path / f"layer{n}"
        blob.write_bytes(gzip.compress(data) if compress else data)
        diff_id = f"sha256:{hashlib.sha256(data).hexdigest()}"
        apply_layer(root, blob, diff_id=diff_id, limits=limits or Limits(), what=f"test image: layer {n + 1}")
    return root


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host directory outside the tree, holding a file an attack would change."""
    d = tmp_path / "host"
    d.mkdir()
    (d / "secret").write_bytes(b"host secret\n")
    return d


def host_untouched(host: Path) -> None:
    assert sorted(os.listdir(host)) == ["secret"]
    assert (host / "secret").read_bytes() == b"host secret\n"


def test_whiteouts_and_opaque_directories_follow_the_oci_spec(tmp_path: Path) -> None:
    lower = tar_of(
        ("etc", "dir", None, None),
        ("etc/gone", "file", b"lower\n", None),
        ("etc/kept", "file", b"lower\n", None),
        ("etc/tree", "dir", None, None),
        ("etc/tree/deep", "file", b"x", None),
        ("opq", "dir", None, None),
        ("opq/lower", "file", b"lower\n", None),
        ("opq/sub", "dir", None, None),
        ("opq/sub/lower", "file", b"lower\n", None),
    )
    upper = tar_of(
        ("etc/.wh.gone", "file", b"", None),
        ("etc/.wh.tree", "file", b"", None),
        # This layer's own entry before the opaque marker stays (the marker hides lower layers only).
        ("opq/same-layer", "file", b"upper\n", None),
        ("opq/.wh..wh..opq", "file", b"", None),
        ("opq/upper", "file", b"upper\n", None),
    )
    root = unpack(tmp_path, lower, upper, compress=True)
    assert sorted(os.listdir(root / "etc")) == ["kept"]
    assert sorted(os.listdir(root / "opq")) == ["same-layer", "upper"]
    assert not any(n.startswith(".wh.") for _, _, files in os.walk(root) for n in files)


def test_upper_layers_replace_lower_entries_of_another_kind(tmp_path: Path) -> None:
    lower = tar_of(
        ("was-dir", "dir", None, None),
        ("was-dir/child", "file", b"x", None),
        ("was-file", "file", b"x", None),
        ("was-link", "sym", "target", None),
        ("target", "file", b"target stays\n", None),
    )
    upper = tar_of(
        ("was-dir", "file", b"now a file\n", None),
        ("was-file/child", "file", b"under a new directory\n", None),
        ("was-link", "file", b"written in place of the link, not through it\n", None),
    )
    root = unpack(tmp_path, lower, upper)
    assert (root / "was-dir").read_bytes() == b"now a file\n"
    assert (root / "was-file" / "child").read_bytes() == b"under a new directory\n"
    assert not (root / "was-link").is_symlink()
    assert (root / "target").read_bytes() == b"target stays\n"


@pytest.mark.parametrize("name", ["../escaped", "a/../../escaped", "./../escaped"])
@pytest.mark.escape_row("hostile-image", runtime="host")
def test_members_leaving_the_root_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ImageError, match=r"test image: layer 1: member .* leaves the image's root"):
        unpack(tmp_path, tar_of(("a", "dir", None, None), (name, "file", b"x", None)))
    assert not (tmp_path / "escaped").exists()


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_absolute_member_names_land_inside_the_tree(tmp_path: Path, host: Path) -> None:
    root = unpack(tmp_path, tar_of((f"{host}/planted", "file", b"x", None)))
    host_untouched(host)
    assert (root / str(host).lstrip("/") / "planted").read_bytes() == b"x"


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_absolute_symlinks_stay_links_that_resolve_inside_the_tree(tmp_path: Path) -> None:
    layer = tar_of(
        ("bin", "dir", None, None),
        ("bin/busybox", "file", b"#!\n", 0o755),
        ("usr/bin", "dir", None, None),
        ("usr/bin/sh", "sym", "/bin/busybox", None),
        ("rootlink", "sym", "/", None),
        ("up", "sym", "../../../../../../../..", None),
    )
    root = unpack(tmp_path, layer)
    # Kept as links (the box sees them), rewritten so the host resolves them where the box does.
    assert os.readlink(root / "usr/bin/sh") == "../../bin/busybox"
    assert (root / "usr/bin/sh").resolve() == (root / "bin/busybox").resolve()
    assert (root / "rootlink").resolve() == root.resolve()
    assert (root / "up").resolve() == root.resolve()


@pytest.mark.parametrize(
    "links",
    [
        [("evil", "sym", "{host}", None)],
        [("evil", "sym", "../host", None)],
        [("evil", "sym", "../../../../../../..{host}", None)],
        # Links through links: each lexically harmless, together they climb out on the host.
        [("a", "dir", None, None), ("a/b", "sym", "..", None), ("evil", "sym", "a/b/../host", None)],
        [("x", "sym", "/", None), ("evil", "sym", "x/../host", None)],
    ],
    ids=["absolute", "relative-up", "climbing", "link-through-link", "root-link-then-up"],
)
@pytest.mark.escape_row("hostile-image", runtime="host")
def test_writes_through_planted_links_stay_in_the_tree(tmp_path: Path, host: Path, links: list[Member]) -> None:
    planted = [(n, k, str(d).replace("{host}", str(host)) if d else d, m) for n, k, d, m in links]
    lower = tar_of(*planted)
    upper = tar_of(
        ("evil/planted", "file", b"x", None),
        ("evil/secret", "file", b"overwritten\n", None),
        ("evil/.wh.secret", "file", b"", None),
    )
    root = unpack(tmp_path, lower, upper)
    host_untouched(host)
    found = [Path(d) / f for d, _, fs in os.walk(root) for f in fs if f == "planted"]
    assert found, "the planted file is nowhere in the tree"


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_whiteouts_through_links_never_remove_host_files(tmp_path: Path, host: Path) -> None:
    lower = tar_of(("evil", "sym", str(host), None), ("rel", "sym", "../host", None))
    upper = tar_of(
        ("evil/.wh.secret", "file", b"", None),
        ("rel/.wh..wh..opq", "file", b"", None),
        ("evil/.wh..wh..opq", "file", b"", None),
    )
    unpack(tmp_path, lower, upper)
    host_untouched(host)


@pytest.mark.parametrize(
    "members",
    [
        [("hl", "hard", "../host/secret", None)],
        [("hl", "hard", "/etc/passwd", None)],
        # A hard link through a planted link to the host's directory.
        [("evil", "sym", "{host}", None), ("hl", "hard", "evil/secret", None)],
        [("hl", "hard", "not/in/the/image", None)],
    ],
    ids=["relative-out", "absolute", "through-a-link", "missing"],
)
@pytest.mark.escape_row("hostile-image", runtime="host")
def test_hard_links_outside_the_tree_are_refused(tmp_path: Path, host: Path, members: list[Member]) -> None:
    layer = tar_of(*[(n, k, str(d).replace("{host}", str(host)) if d else d, m) for n, k, d, m in members])
    with pytest.raises(ImageError, match=r"test image: layer 1: (hard link|member) 'hl'"):
        unpack(tmp_path, layer)
    host_untouched(host)
    assert (host / "secret").stat().st_nlink == 1


def test_hard_links_inside_the_layer_work(tmp_path: Path) -> None:
    root = unpack(
        tmp_path, tar_of(("f", "file", b"data\n", None), ("d", "dir", None, None), ("d/hl", "hard", "f", None))
    )
    assert (root / "f").stat().st_ino == (root / "d/hl").stat().st_ino


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_device_nodes_and_fifos_are_skipped_and_privilege_bits_cleared(tmp_path: Path) -> None:
    limits = Limits()
    layer = tar_of(
        ("dev", "dir", None, None),
        ("dev/mem", "chr", None, 0o666),
        ("fifo", "fifo", None, None),
        ("suid", "file", b"#!/bin/sh\n", 0o4755),
        ("sgid-dir", "dir", None, 0o2775),
        ("world-writable", "file", b"x", 0o666),
    )
    root = unpack(tmp_path, layer, limits=limits)
    assert os.listdir(root / "dev") == []
    assert not os.path.lexists(root / "fifo")
    assert limits.skipped_special == 2
    assert stat.S_IMODE((root / "suid").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "sgid-dir").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "world-writable").stat().st_mode) == 0o644
    assert (root / "suid").stat().st_uid == os.getuid()  # never chowned to the tar's owner


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_unreadable_directories_stay_removable_by_their_owner(tmp_path: Path) -> None:
    layer = tar_of(
        ("locked", "dir", None, 0o000), ("locked/inner", "dir", None, 0o000), ("locked/inner/f", "file", b"x", 0o000)
    )
    root = unpack(tmp_path, layer)
    assert stat.S_IMODE((root / "locked").stat().st_mode) & 0o700 == 0o700
    assert stat.S_IMODE((root / "locked/inner").stat().st_mode) & 0o700 == 0o700
    _rmtree(root)
    assert not root.exists()


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_sizes_and_member_counts_are_bounded(tmp_path: Path) -> None:
    big = tar_of(("big", "file", b"\0" * 200_000, None))
    with pytest.raises(ImageError, match="more than 100000 bytes"):
        unpack(tmp_path, big, compress=True, limits=Limits(max_unpacked=100_000))
    many = tar_of(*[(f"f{i}", "file", b"", None) for i in range(50)])
    (tmp_path / "other").mkdir()
    with pytest.raises(ImageError, match="more than 20 members"):
        unpack(tmp_path / "other", many, limits=Limits(max_members=20))


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_huge_extended_headers_are_refused_before_they_are_read(tmp_path: Path) -> None:
    # A GNU long name of 3 MiB: tarfile reads it whole into memory unless bounded first.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        ti = tarfile.TarInfo("d/" * (3 << 19) + "f")
        tf.addfile(ti)
    root = tmp_path / "root"
    root.mkdir()
    blob = tmp_path / "layer"
    blob.write_bytes(buf.getvalue())
    with pytest.raises(ImageError, match=r"an extended header of \d+ bytes \(at most 65536\)"):
        apply_layer(root, blob, diff_id=None, limits=Limits(), what="test image")


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_a_layer_that_does_not_match_its_diff_id_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    blob = tmp_path / "layer"
    blob.write_bytes(tar_of(("f", "file", b"x", None)))
    with pytest.raises(ImageError, match="does not match the image config's diff_id"):
        apply_layer(root, blob, diff_id="sha256:" + "0" * 64, limits=Limits(), what="test image")


@pytest.mark.parametrize("damage", ["truncated-gzip", "truncated-tar", "garbage"])
def test_broken_layers_are_refused_clearly(tmp_path: Path, damage: str) -> None:
    data = tar_of(("f", "file", os.urandom(50_000), None))
    raw = {
        "truncated-gzip": gzip.compress(data)[:20_000],
        "truncated-tar": data[:20_000],
        "garbage": b"\x1f\x8b" + os.urandom(1000),
    }[damage]
    root = tmp_path / "root"
    root.mkdir()
    blob = tmp_path / "layer"
    blob.write_bytes(raw)
    with pytest.raises(ImageError, match=r"test image: .*(truncated or corrupt|not a valid tar)"):
        apply_layer(root, blob, diff_id=None, limits=Limits(), what="test image")


def test_zstd_layers_need_the_module(tmp_path: Path) -> None:
    try:
        import zstandard  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("zstandard is installed here: the missing-module error cannot be shown")
    root = tmp_path / "root"
    root.mkdir()
    blob = tmp_path / "layer"
    blob.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 32)
    with pytest.raises(ImageError, match=r"zstd-compressed.*pip install zstandard"):
        apply_layer(root, blob, diff_id=None, limits=Limits(), what="test image")


_PEAK_HEAP = """
import sys, tracemalloc
from pathlib import Path
from pytest_boxlite.images.unpack import Limits, apply_layer, tree_size
root = Path(sys.argv[1]); root.mkdir()
tracemalloc.start()
# The ratio bound off: it would stop this 1000:1 layer first (its own test is below).
apply_layer(root, Path(sys.argv[2]), diff_id=None, limits=Limits(max_ratio=10**9), what="test image")
print(tracemalloc.get_traced_memory()[1] >> 20)
"""


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_memory_does_not_grow_with_the_layers_metadata(tmp_path: Path) -> None:
    # 4000 members of ~60 KiB PAX headers each (240 MB of metadata, a tiny gzip): tarfile keeps
    # every TarInfo it reads unless the unpacker drops them; the peak must stay far below that.
    # (The peak of Python's heap, in a fresh process: its RSS high-water mark would start at
    # this one's, which fork passes on.)
    blob = tmp_path / "layer"
    with (
        gzip.open(blob, "wb", compresslevel=1) as gz,
        tarfile.open(fileobj=gz, mode="w|", format=tarfile.PAX_FORMAT) as tf,
    ):
        for i in range(4000):
            ti = tarfile.TarInfo(f"nodir/.wh.{i}")
            ti.pax_headers = {"comment": "C" * 60_000}
            tf.addfile(ti)
            tf.members.clear()  # type: ignore[attr-defined]  # the writer keeps them too
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_HEAP, str(tmp_path / "root"), str(blob)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    peak_mib = int(out.stdout.split()[-1])
    assert peak_mib < 64, f"unpacking a layer of 240 MB of headers peaked at {peak_mib} MiB of heap"


def _pax_record(key: str, value: str) -> bytes:
    """One PAX record, ``LEN key=value\\n`` where LEN counts the whole record, itself included."""
    body = f" {key}={value}\n".encode()
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n = len(str(n)) + len(body)
    return str(n).encode() + body


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_global_extended_headers_are_bounded_in_all(tmp_path: Path) -> None:
    # Global PAX headers are merged into the reader and kept for the whole layer: 40 of 40 KB
    # each, all under the bound of one header, with distinct keys (nothing overwritten).
    data = bytearray()
    for i in range(40):
        body = _pax_record(f"comment{i}", "G" * 40_000)
        ti = tarfile.TarInfo(f"g{i}")
        ti.type = tarfile.XGLTYPE
        ti.size = len(body)
        data += ti.tobuf(tarfile.USTAR_FORMAT) + body + b"\0" * (-len(body) % 512)
    blob = tmp_path / "layer"
    blob.write_bytes(bytes(data) + b"\0" * 1024)
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(ImageError, match=r"global extended headers of more than 1048576 bytes"):
        apply_layer(root, blob, diff_id=None, limits=Limits(), what="test image")


@pytest.mark.parametrize(
    "members",
    [
        [("/".join(["a"] * 300) + "/f", "file", b"x", None)],  # 600 bytes, 300 levels
        [("/".join(["d" * 200] * 18) + "/f", "file", b"x", None)],  # 18 levels, 3618 bytes
        # 200 levels, then 200 more through a link to them: each name is short, the real path not.
        [
            ("/".join(["a"] * 200) + "/f", "file", b"x", None),
            ("l", "sym", "/".join(["a"] * 200), None),
            ("l/" + "/".join(["b"] * 200) + "/g", "file", b"y", None),
        ],
    ],
    ids=["levels", "bytes", "through-a-link"],
)
@pytest.mark.escape_row("hostile-image", runtime="host")
def test_trees_deeper_than_the_bound_are_refused(tmp_path: Path, members: list[Member]) -> None:
    # Python's os.walk and shutil.rmtree recurse once per level (RecursionError at ~1000), and a
    # path over PATH_MAX cannot be named: a tree too deep would jam every tool that walks it.
    with pytest.raises(ImageError, match=r"is deeper than an image may go \(256 levels, 3500 bytes\)"):
        unpack(tmp_path, tar_of(*members))
    _rmtree(tmp_path / "root")
    assert not (tmp_path / "root").exists()


def test_removal_and_sizes_need_no_recursion(tmp_path: Path) -> None:
    # A tree 3000 levels deep (as an unpacker without the depth bound left them, 6000 bytes of
    # path): measured (what a path can name of it) and removed whole, without recursion.
    top = tmp_path / "deep"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(3000):
            os.mkdir("a", dir_fd=fd)
            nfd = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
        os.symlink("/etc", "l", dir_fd=fd)
    finally:
        os.close(fd)
    assert tree_size(top) >= 3000 * 512
    _rmtree(top)
    assert not top.exists()


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_hard_links_to_symlinks_are_symlinks_that_still_resolve_inside_the_tree(tmp_path: Path) -> None:
    # A symlink's relative target is written for its own directory; a hard link (a second name of
    # the same inode) in another directory would climb out of the tree on the host.
    root = unpack(
        tmp_path,
        tar_of(
            ("a/b/c", "dir", None, None),
            ("a/b/c/l", "sym", "../../../oldroot/etc", None),
            ("a/b/abs", "sym", "/usr/bin", None),
            ("etc", "hard", "a/b/c/l", None),
            ("usr/l2", "hard", "a/b/c/l", None),
            ("top", "hard", "a/b/abs", None),
        ),
    )
    assert os.readlink(root / "etc") == "oldroot/etc"
    assert os.readlink(root / "usr/l2") == "../oldroot/etc"
    assert os.readlink(root / "top") == "usr/bin"
    real_root = os.path.realpath(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            if os.path.islink(p):
                assert os.path.commonpath([os.path.realpath(p), real_root]) == real_root, p


_FEW_FDS = """
import resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
from pytest_boxlite.images.unpack import Limits, apply_layer
root = Path(sys.argv[1]); root.mkdir()
# The ratio bound off: it would stop this 1000:1 layer first (its own test is below).
apply_layer(root, Path(sys.argv[2]), diff_id=None, limits=Limits(max_ratio=10**9), what="test image")
print(len(list(root.iterdir())))
"""


def test_an_image_with_more_directories_than_fds_unpacks(tmp_path: Path) -> None:
    # The unpacker keeps directory fds for the next members: never more than a process may hold
    # (1024 is a common soft limit; a Debian image has more directories than that).
    blob = tmp_path / "layer"
    blob.write_bytes(tar_of(*[(f"d{i}/f", "file", b"x", None) for i in range(1000)]))
    out = subprocess.run(
        [sys.executable, "-c", _FEW_FDS, str(tmp_path / "root"), str(blob)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr[-500:]
    assert out.stdout.split()[-1] == "1000"


def _zeros_layer(size: int) -> bytes:
    return tar_of(("zeros", "file", b"\0" * size, None))


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_a_layer_past_the_compression_ratio_is_stopped_while_it_streams(tmp_path: Path) -> None:
    # 64 MiB of zeros gzip to ~64 KB (1000:1): past max(100 x in, 16 MiB), refused, and the
    # unpacker stopped reading at about the bound (what it wrote is in the file: at most ~16 MiB).
    with pytest.raises(
        ImageError,
        match=r"layer 1: the layer's \d+ compressed bytes unpack to more than 16777216 .*"
        r"more than 100:1.*decompression bomb",
    ):
        unpack(tmp_path, _zeros_layer(64 << 20), compress=True)
    written = (tmp_path / "root" / "zeros").stat().st_size
    assert written <= (16 << 20) + (1 << 20), written


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_the_ratio_holds_for_the_image_too_so_many_small_layers_cannot_each_use_the_floor(tmp_path: Path) -> None:
    # Each layer alone is under the floor (1 MiB here) and passes; together they are past 100:1 of
    # what all their blobs hold, which the image's own bound stops at the second layer.
    limits = Limits(ratio_floor=1 << 20)
    layers = [_zeros_layer(900_000 + i) for i in range(5)]
    with pytest.raises(ImageError, match=r"layer 2: the image's \d+ compressed bytes unpack to more than 1048576"):
        unpack(tmp_path, *layers, compress=True, limits=limits)
    (tmp_path / "one").mkdir()
    unpack(tmp_path / "one", layers[0], compress=True, limits=Limits(ratio_floor=1 << 20))  # one alone passes


def test_real_and_tiny_layers_pass_the_ratio(tmp_path: Path) -> None:
    # Tiny layers (tar headers and padding: thousands to one) pass by the floor; data that
    # compresses as real files do passes by the ratio, well past the floor.
    text = b"".join(b"line %d of a config file, as text compresses\n" % i for i in range(400_000))
    root = unpack(
        tmp_path,
        tar_of(("etc", "dir", None, None), ("etc/empty", "file", b"", None)),
        tar_of(("etc/big.txt", "file", text, None), ("bin", "file", os.urandom(1 << 20), 0o755)),
        compress=True,
        limits=Limits(ratio_floor=1 << 20),
    )
    assert (root / "etc/big.txt").stat().st_size == len(text) > 16 << 20


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_a_layer_listed_again_counts_its_blob_once_for_the_image(tmp_path: Path) -> None:
    # A layer at ~70:1 (40 KB of noise, 3 MB of zeros) passes alone; a manifest listing the same
    # blob again gets no second allowance for it: the image is at 140:1 of what the archive holds.
    data = tar_of(("noise", "file", os.urandom(40_000), None), ("zeros", "file", bytes(3 << 20), None))
    root = tmp_path / "root"
    root.mkdir()
    blob = tmp_path / "same"
    blob.write_bytes(gzip.compress(data))
    limits = Limits(ratio_floor=1 << 20)
    apply_layer(root, blob, diff_id=None, limits=limits, what="test image: layer 1")
    with pytest.raises(ImageError, match=r"layer 2: the image's \d+ compressed bytes unpack to more than"):
        apply_layer(root, blob, diff_id=None, limits=limits, what="test image: layer 2")
