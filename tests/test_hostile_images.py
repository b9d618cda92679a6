"""Images cost what they say, and the image store is below a home (issue 40, classes 5 and 1).

Attacks, as issue 40 found them:

- a 600 KB ``oci-archive:`` whose layer is a gzip of zeros (600 MB of tar) made the host write and
  keep 600 MB: it is refused by the compression ratio bound while it streams, and nothing of it
  stays in the store;
- the store had no bound and no expiry: over its bound, the least recently used image is evicted,
  never one a live session (another real process here) holds; an image unused for its expiry goes;
- links planted in a home (``image-store -> DIR``, ``image-store/tmp -> DIR``, any of the store's
  directories) made ``clean --images``, a session's start or an image's use empty ``DIR``: each is
  refused and reported, ``DIR`` untouched; an entry of another user (a real second account, as
  root) is refused, not removed.

Archives are built here, streaming (the 600 MB are never in memory nor on disk), stores are real
directories, users of an image are real processes, ``clean`` is the real CLI, and one attack is a
real pytest sub-run with a real box.  Run as root and as an ordinary user.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from images.build import ImagesUnavailable, layer_tar, oci_layout, shared_cache, test_images
from subruns import ATTACKER, SubRun, second_user

from pytest_boxlite.images import ImageError, drop_images, ensure_image, list_images, store_dir, store_usage
from pytest_boxlite.images.store import (
    MAX_IMAGE_ENV,
    MAX_RATIO_ENV,
    MAX_STORE_ENV,
    Bounds,
    release_images,
)

pytestmark = [pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parent.parent
OTHER_USER = ATTACKER


@pytest.fixture(autouse=True)
def _released() -> Iterator[None]:
    """Each test starts and ends holding no image (this process is one of the stores' users)."""
    release_images()
    yield
    release_images()


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return store_dir(tmp_path / "home")


# -- a decompression bomb --------------------------------------------------------------------------


class _Hashing(io.RawIOBase):
    """A write-only file that hashes and counts what goes through it to ``out``."""

    def __init__(self, out: IO[bytes] | gzip.GzipFile | None) -> None:
        self.out = out
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:  # type: ignore[override]
        self.sha.update(b)
        self.size += len(b)
        if self.out is not None:
            self.out.write(b)
        return len(b)


def _blob(blobs: Path, data: bytes) -> dict[str, object]:
    hexd = hashlib.sha256(data).hexdigest()
    (blobs / hexd).write_bytes(data)
    return {"digest": f"sha256:{hexd}", "size": len(data)}


def bomb_archive(dest: Path, zeros: int) -> Path:
    """An ``oci-archive`` whose one layer is a gzip of a tar of one file of ``zeros`` zero bytes,
    written as a stream (1 MiB at a time): a sound image, its digests right, a bomb's ratio."""
    lay = dest.with_suffix(".d")
    blobs = lay / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    part = blobs / "layer.part"
    with open(part, "wb") as raw:
        packed = _Hashing(raw)
        with gzip.GzipFile(fileobj=packed, mode="wb", compresslevel=9, mtime=0) as gz:
            plain = _Hashing(gz)
            ti = tarfile.TarInfo("zeros")
            ti.size, ti.mode = zeros, 0o644
            plain.write(ti.tobuf(tarfile.PAX_FORMAT))
            chunk = bytes(1 << 20)
            left = zeros
            while left:
                plain.write(chunk[: min(left, len(chunk))])
                left -= min(left, len(chunk))
            plain.write(bytes(-zeros % 512 + 1024))  # the file's padding, then the end of the archive
    layer = {
        "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
        "digest": f"sha256:{packed.sha.hexdigest()}",
        "size": packed.size,
    }
    part.rename(blobs / packed.sha.hexdigest())
    config = {
        "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine),
        "os": "linux",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{plain.sha.hexdigest()}"]},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            **_blob(blobs, json.dumps(config).encode()),
        },
        "layers": [layer],
    }
    mdesc = {"mediaType": manifest["mediaType"], **_blob(blobs, json.dumps(manifest).encode())}
    (lay / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [mdesc]}))
    (lay / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    with tarfile.open(dest, "w") as tf:
        for path in sorted(lay.rglob("*")):
            tf.add(path, arcname=str(path.relative_to(lay)), recursive=False)
    shutil.rmtree(lay)
    return dest


def _written() -> int:
    """Bytes this process has written so far (write(2) and the like, any file system)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


@pytest.mark.escape_row("image-costs", runtime="host")
@pytest.mark.reliability
@pytest.mark.escape_row("hostile-image", runtime="host")
def test_a_gzip_of_zeros_is_refused_while_it_streams_and_nothing_stays(store: Path, tmp_path: Path) -> None:
    archive = bomb_archive(tmp_path / "bomb.tar", 600 << 20)
    assert archive.stat().st_size < 1 << 20  # ~600 KB for 600 MB of tar
    ref = f"oci-archive:{archive}"
    before = _written()
    with pytest.raises(ImageError) as caught:
        ensure_image(ref, store=store)
    written = _written() - before
    message = str(caught.value)
    assert message.startswith(f"image {ref!r}: layer 1 "), message
    assert "unpack to more than 16777216 bytes (more than 100:1" in message, message
    assert f"{MAX_RATIO_ENV}=" in message, message  # how to raise it
    # Stopped at about the bound, not after the 600 MB were written (the old code wrote them all).
    assert written < 48 << 20, f"the host wrote {written} bytes for a refused bomb"
    for sub in ("rootfs", "meta", "refs", "tmp", "blobs/sha256"):
        assert os.listdir(store / sub) == [], sub
    assert list_images(store) == []


@pytest.mark.reliability
@pytest.mark.escape_row("hostile-image", runtime="host")
def test_the_ratio_bound_can_be_raised_for_an_image_that_is_yours(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = bomb_archive(tmp_path / "sparse-ish.tar", 40 << 20)  # 40 MiB of zeros: ~40 KB
    with pytest.raises(ImageError, match=r"decompression bomb"):
        ensure_image(f"oci-archive:{archive}", store=store)
    monkeypatch.setenv(MAX_RATIO_ENV, "5000")
    image = ensure_image(f"oci-archive:{archive}", store=store)
    assert (image.rootfs / "zeros").stat().st_size == 40 << 20


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (MAX_IMAGE_ENV, "lots", r"PYTEST_BOXLITE_IMAGE_MAX_SIZE='lots' is not a size"),
        (MAX_STORE_ENV, "0", r"PYTEST_BOXLITE_IMAGE_STORE_MAX_SIZE='0' is not a size"),
        (MAX_RATIO_ENV, "-3", r"PYTEST_BOXLITE_IMAGE_MAX_RATIO='-3' is not a positive number"),
    ],
)
def test_bad_bounds_are_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ImageError, match=message):
        Bounds.from_env()


def test_bounds_read_sizes_as_people_write_them() -> None:
    got = Bounds.from_env({MAX_IMAGE_ENV: "1.5G", MAX_STORE_ENV: "40GiB", MAX_RATIO_ENV: "250"})
    assert (got.max_image, got.max_store, got.max_ratio) == (3 << 29, 40 << 30, 250.0)
    assert Bounds.from_env({}) == Bounds()
    assert (Bounds().max_image, Bounds().max_store, Bounds().max_ratio, Bounds().expiry_days) == (
        8 << 30,
        20 << 30,
        100,
        30,
    )


# -- the store's bound and expiry ------------------------------------------------------------------

MiB = 1 << 20
#: Each image: one file of 1 MiB of random bytes (ratio 1), about 2 MiB in the store (blob and tree).
SMALL = Bounds(max_image=MiB + MiB // 2, max_store=5 * MiB + MiB // 2)


def _image(tmp_path: Path, name: str) -> str:
    layer = layer_tar([(name, "file", os.urandom(MiB), 0o644)])
    return f"oci:{oci_layout(tmp_path / name, [layer])}"


def _kept(store: Path) -> set[str]:
    return {Path(i.references[0]).name for i in list_images(store)}


def _holder(ref: str, store: Path) -> subprocess.Popen[str]:
    """Another session, as far as the store can tell: a process that uses ``ref`` and lives on."""
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from pytest_boxlite.images import ensure_image
        ensure_image({ref!r}, store=Path({str(store)!r}))
        print("holding", flush=True)
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout is not None and proc.stdout.readline() == "holding\n"
    return proc


def _ends(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.communicate(timeout=30)


@pytest.mark.escape_row("image-costs", runtime="host")
def test_over_its_bound_the_store_evicts_the_least_recently_used_image(store: Path, tmp_path: Path) -> None:
    a, b, c = (_image(tmp_path, n) for n in ("a", "b", "c"))
    for ref in (a, b):
        ensure_image(ref, store=store, bounds=SMALL)
    time.sleep(0.01)
    ensure_image(a, store=store, bounds=SMALL)  # a used again (a known image: the fast path): b is older
    release_images()
    ensure_image(c, store=store, bounds=SMALL)
    assert _kept(store) == {"a", "c"}
    # b's blobs went with it; what is left is within the bound.
    names = {
        json.loads((store / "blobs/sha256" / i.digest[7:]).read_bytes())["layers"][0]["digest"][7:]
        for i in list_images(store)
    }
    layers = {n for n in os.listdir(store / "blobs/sha256") if (store / "blobs/sha256" / n).stat().st_size > MiB}
    assert layers == names
    assert store_usage(store)[1] <= SMALL.max_store


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_an_image_a_live_session_uses_is_never_evicted(store: Path, tmp_path: Path) -> None:
    a, b, c, d = (_image(tmp_path, n) for n in ("a", "b", "c", "d"))
    holder = _holder(a, store)  # a: the oldest, but in use
    try:
        ensure_image(b, store=store, bounds=SMALL)
        release_images()
        ensure_image(c, store=store, bounds=SMALL)
        assert _kept(store) == {"a", "c"}  # b evicted, though a was used longer ago
        release_images()
        # Both kept images in use, no room left for another: refused, naming the bound and its fix.
        other = _holder(c, store)
        try:
            with pytest.raises(
                ImageError,
                match=rf"image {re.escape(repr(d))}: .*bound of {SMALL.max_store} bytes.*"
                rf"in use by live sessions keep \d+ bytes.*{MAX_STORE_ENV}=",
            ):
                ensure_image(d, store=store, bounds=SMALL)
            assert _kept(store) == {"a", "c"} and os.listdir(store / "tmp") == []
        finally:
            _ends(other)
    finally:
        _ends(holder)
    # The session is over: a may go now.
    ensure_image(d, store=store, bounds=SMALL)
    assert "a" not in _kept(store) and "d" in _kept(store)


@pytest.mark.escape_row("image-costs", runtime="host")
def test_images_unused_past_their_expiry_are_evicted(store: Path, tmp_path: Path) -> None:
    a, b, c = (_image(tmp_path, n) for n in ("a", "b", "c"))
    first = ensure_image(a, store=store)
    ensure_image(b, store=store)
    release_images()
    month = time.time() - 31 * 86400
    for hexd in (first.digest[7:],):
        os.utime(store / "uses" / hexd, (month, month))
    ensure_image(c, store=store)  # any writer expires what is old
    assert _kept(store) == {"b", "c"}
    assert not first.rootfs.exists()


def test_a_session_holding_an_old_image_keeps_it_past_its_expiry(store: Path, tmp_path: Path) -> None:
    a, b = (_image(tmp_path, n) for n in ("a", "b"))
    holder = _holder(a, store)
    try:
        hexd = list_images(store)[0].digest[7:]
        month = time.time() - 31 * 86400
        os.utime(store / "uses" / hexd, (month, month))
        ensure_image(b, store=store)
        assert _kept(store) == {"a", "b"}
    finally:
        _ends(holder)


# -- links and other users' entries in the store ---------------------------------------------------


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A directory outside the home, with what an attack would remove."""
    v = tmp_path / "victim"
    (v / "sub").mkdir(parents=True)
    (v / "precious").write_text("keep me\n")
    (v / "sub" / "deeper").write_text("keep me too\n")
    return v


def untouched(victim: Path) -> None:
    assert sorted(str(p.relative_to(victim)) for p in victim.rglob("*")) == ["precious", "sub", "sub/deeper"]
    assert (victim / "precious").read_text() == "keep me\n"


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    try:
        return test_images(shared_cache(tmp_path_factory))
    except ImagesUnavailable as exc:
        pytest.skip(str(exc))


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest_boxlite", *args, "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )


@pytest.mark.escape_row("hostile-image", runtime="host")
@pytest.mark.parametrize(
    "where",
    [
        "image-store",
        "image-store/tmp",
        "image-store/rootfs",
        "image-store/blobs",
        "image-store/meta",
        "image-store/refs",
        "image-store/uses",
        "image-store/vm-layouts",
    ],
)
def test_a_link_planted_in_the_store_is_refused_and_its_target_untouched(
    tmp_path: Path, victim: Path, images: dict[str, str], where: str
) -> None:
    home = tmp_path / "home"
    store = store_dir(home)
    if where != "image-store":
        ensure_image(images["busybox"], store=store)  # a store in use, then the link
        release_images()
        if (home / where).exists():
            shutil.rmtree(home / where)
        (victim / "stale-work").mkdir()  # what tmp/ cleaning would remove
    else:
        home.mkdir(mode=0o700)
    (home / where).symlink_to(victim)
    before = sorted(os.listdir(victim))
    with pytest.raises(
        ImageError, match=rf"image store {re.escape(str(store))}: refused {re.escape(str(home / where))}"
    ):
        ensure_image(images["no-shell"], store=store)
    for args in (("clean", "--images"), ("ls", "--images")):
        done = _cli(home, *args)
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert f"refused {home / where}" in done.stderr and "never follows links" in done.stderr, done.stderr
    assert sorted(os.listdir(victim)) == before
    if where != "image-store":
        (victim / "stale-work").rmdir()
    untouched(victim)
    assert (home / where).is_symlink()  # reported, not removed either


@pytest.mark.escape_row("hostile-image", "image-costs", runtime="host")
def test_a_link_in_the_stores_tmp_is_refused_not_followed(tmp_path: Path, victim: Path, images: dict[str, str]) -> None:
    store = store_dir(tmp_path / "home")
    ensure_image(images["busybox"], store=store)
    (store / "tmp" / "work-planted").symlink_to(victim)
    with pytest.raises(ImageError, match=r"tmp/work-planted is refused \(a link\)"):
        ensure_image(images["no-shell"], store=store)
    untouched(victim)
    assert (store / "tmp" / "work-planted").is_symlink()
    drop_images(store)  # clean --images: the store goes, the link in it unlinked, never followed
    assert not store.joinpath("tmp").exists()
    untouched(victim)


@pytest.fixture(scope="module")
def other_user() -> pwd.struct_passwd:
    """A second local account (made here with useradd where missing; skips unless root)."""
    return second_user(runuser=False)


@pytest.mark.escape_row("hostile-image", runtime="host", users="root")
def test_entries_of_another_user_are_refused_never_removed(
    tmp_path: Path, images: dict[str, str], other_user: pwd.struct_passwd
) -> None:
    home = tmp_path / "home"
    store = store_dir(home)
    ensure_image(images["busybox"], store=store)
    release_images()
    theirs = store / "tmp" / "work-theirs"
    theirs.mkdir()
    (theirs / "file").write_text("theirs\n")
    os.chown(theirs, other_user.pw_uid, other_user.pw_gid)
    os.chown(theirs / "file", other_user.pw_uid, other_user.pw_gid)
    with pytest.raises(ImageError, match=rf"tmp/work-theirs is refused \(it belongs to {OTHER_USER}"):
        ensure_image(images["no-shell"], store=store)
    done = _cli(home, "clean", "--images")
    assert done.returncode == 1 and "left in place" in done.stderr, done.stderr
    assert (theirs / "file").read_text() == "theirs\n"
    # A whole store of theirs: not used at all.
    other = store_dir(tmp_path / "home2")
    other.mkdir(parents=True)
    os.chown(other, other_user.pw_uid, other_user.pw_gid)
    with pytest.raises(ImageError, match=rf"refused {re.escape(str(other))}: it belongs to {OTHER_USER}"):
        ensure_image(images["busybox"], store=other)
    assert os.listdir(other) == []


class Run(SubRun):
    base_args = ("-p", "no:randomly", "--boxlite-runtime=namespace")
    wait_timeout = 150.0


@pytest.mark.escape_row("hostile-image", runtime="host")
def test_a_session_using_an_image_refuses_a_planted_link_and_removes_nothing(
    tmp_path: Path, home: Path, victim: Path, images: dict[str, str]
) -> None:
    # The attack of issue 40: a session using an image emptied DIR through image-store/tmp -> DIR.
    (home / "image-store").mkdir(parents=True, mode=0o700)
    home.chmod(0o700)
    (home / "image-store" / "tmp").symlink_to(victim)
    (victim / "stale-work").mkdir()
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "test_img.py").write_text(
        textwrap.dedent(
            f"""
            def test_uses_the_image(boxlite_pool):
                with boxlite_pool.sandbox(image={images["busybox"]!r}) as sb:
                    assert sb.execute_command("true").ok
            """
        )
    )
    run = Run(tmp_path / "proj", home, "img", "test_img.py")
    rc = run.wait()
    out = run.output
    assert rc != 0, out
    assert f"refused {home / 'image-store' / 'tmp'}" in out, out
    assert sorted(os.listdir(victim)) == ["precious", "stale-work", "sub"], out
    (victim / "stale-work").rmdir()
    untouched(victim)
