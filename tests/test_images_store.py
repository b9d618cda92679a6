"""The image store and the local transports (issue 25, items 2 and 5, "Bad input", the store's performance).

Real images built by tests/images/build.py (busybox-static from Debian, the host's glibc), read
through every transport, unpacked into real stores; concurrent callers are real processes; the
CLI is run as ``python -m pytest_boxlite``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from images.build import (
    OS_RELEASE,
    ImagesUnavailable,
    docker_archive,
    layer_tar,
    oci_layout,
    shared_cache,
    test_images,
)
from images.registry import serve

import pytest_boxlite.images.layout as layout_mod
import pytest_boxlite.images.store as store_mod
from pytest_boxlite.errors import ConfigError
from pytest_boxlite.images import (
    ImageConfig,
    ImageError,
    drop_images,
    ensure_image,
    is_image_reference_local,
    list_images,
    parse_config,
    parse_reference,
    store_dir,
)
from pytest_boxlite.images import pull as pull_mod
from pytest_boxlite.images.pull import INSECURE_ENV
from pytest_boxlite.images.unpack import tree_size

pytestmark = [pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    try:
        return test_images(shared_cache(tmp_path_factory))
    except ImagesUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return store_dir(tmp_path / "home")


def tree_of(root: Path) -> list[tuple[str, str, str, int]]:
    """(path, kind, content digest or link target, permission bits) of every entry under ``root``."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for n in sorted(dirnames + filenames):
            p = Path(dirpath) / n
            st = p.lstat()
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out.append((rel, "link", os.readlink(p), 0))
            elif p.is_dir():
                out.append((rel, "dir", "", st.st_mode & 0o7777))
            else:
                out.append((rel, "file", hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mode & 0o7777))
    return sorted(out)


def test_references_parse_as_the_containers_tools_write_them() -> None:
    assert parse_reference("oci:/srv/layout:v1").path == "/srv/layout"
    assert parse_reference("oci:/srv/layout:v1").tag == "v1"
    assert parse_reference("oci:/srv/layout").tag is None
    assert parse_reference("oci-archive:/a/b.tar").path == "/a/b.tar"
    da = parse_reference("docker-archive:/a/b.tar:boxlite-test/busybox:latest")
    assert (da.path, da.tag) == ("/a/b.tar", "boxlite-test/busybox:latest")
    alpine = parse_reference("alpine:3.19")
    assert (alpine.transport, alpine.name, alpine.tag) == ("docker", "docker.io/library/alpine", "3.19")
    assert parse_reference("docker://ghcr.io/org/img:1").name == "ghcr.io/org/img"
    assert parse_reference("localhost:5000/x").name == "localhost:5000/x"
    assert is_image_reference_local("oci-archive:/x.tar") and not is_image_reference_local("alpine:3.19")
    for bad in ("", "UPPER/case", "foo:/bar", "oci:", "a b", "alpine:bad tag", "x@sha256:12"):
        with pytest.raises(ImageError) as info:
            parse_reference(bad)
        assert repr(bad)[:20].strip("'") in str(info.value) or bad == ""
    assert issubclass(ImageError, ConfigError)


def test_config_is_parsed_with_env_split_at_the_first_equals() -> None:
    doc = {"config": {"Env": ["A=1", "B=x=y", "junk"], "WorkingDir": "/w", "User": "1000:1000", "Cmd": ["sh"]}}
    assert parse_config(json.dumps(doc).encode(), "image 'x'") == ImageConfig(
        env=(("A", "1"), ("B", "x=y")), workdir="/w", user="1000:1000", cmd=("sh",)
    )
    with pytest.raises(ImageError, match=r"image 'x'.*Cmd is not a list of strings"):
        parse_config(json.dumps({"config": {"Cmd": "sh"}}).encode(), "image 'x'")


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"Env": ["A=a\0b"]}, r"image 'x': config Env: 'A=a\\x00b'... holds a NUL byte"),
        ({"Cmd": ["sh", "-c\0"]}, r"image 'x': config Cmd: .* holds a NUL byte"),
        ({"WorkingDir": "/w\0"}, r"image 'x': config WorkingDir: .* holds a NUL byte"),
        ({"Env": ["A=" + "x" * (3 << 20)]}, r"image 'x': config Env: a string of 3145730 characters, more than"),
        ({"Env": [f"A{i}=" + "x" * 100_000 for i in range(12)]}, r"config's Env, Entrypoint and Cmd hold \d+ bytes"),
    ],
    ids=["env-nul", "cmd-nul", "workdir-nul", "env-huge", "env-total"],
)
def test_configs_no_process_could_be_given_are_refused_naming_the_image(cfg: dict[str, object], message: str) -> None:
    # Else every command of every box of the image fails far from the cause ('embedded null
    # byte', or a raw E2BIG from create_box).
    with pytest.raises(ImageError, match=message):
        parse_config(json.dumps({"config": cfg}).encode(), "image 'x'")


def test_every_transport_gives_the_same_tree(images: dict[str, str], store: Path) -> None:
    archive = ensure_image(images["busybox"], store=store)
    layout = ensure_image(images["busybox-oci"], store=store)
    docker = ensure_image(images["busybox-docker"], store=store)
    tagged = ensure_image(images["busybox-docker"] + ":boxlite-test/busybox:latest", store=store)
    assert archive.digest == layout.digest and archive.rootfs == layout.rootfs
    assert docker.digest == tagged.digest
    assert tree_of(archive.rootfs) == tree_of(docker.rootfs)
    root = archive.rootfs
    assert (root / "etc/os-release").read_text() == OS_RELEASE
    assert os.readlink(root / "bin/sh") == "../bin/busybox"  # an absolute link, kept inside
    # Layer 2's whiteout and opaque directory.
    assert not (root / "etc/removed-by-layer2").exists() and (root / "etc/layer2").exists()
    assert sorted(os.listdir(root / "opaque")) == ["upper"]
    assert archive.config == ImageConfig(
        env=(("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), ("BOXLITE_TEST_IMAGE", "busybox"), ("WITH_EQUALS", "a=b")),
        workdir="/srv/work",
        user="root",
        entrypoint=("/bin/sh", "-c"),
        cmd=("cat /etc/os-release",),
    )
    assert archive.size == tree_size(root) > 1_000_000
    assert archive.reference == images["busybox"] and layout.reference == images["busybox-oci"]
    listed = {i.digest: i for i in list_images(store)}
    assert set(listed) == {archive.digest, docker.digest}
    assert set(listed[archive.digest].references) == {images["busybox"], images["busybox-oci"]}


def test_the_busybox_image_runs_its_own_userland(images: dict[str, str], store: Path) -> None:
    image = ensure_image(images["busybox"], store=store)
    out = subprocess.run(
        [str(image.rootfs / "bin/busybox"), "cat", str(image.rootfs / "etc/os-release")],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "ID=boxlite-test" in out.stdout


def test_a_second_ensure_does_no_work(images: dict[str, str], store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = ensure_image(images["busybox"], store=store)

    def no_unpack(*_a: object, **_k: object) -> None:
        raise AssertionError("unpacked again")

    monkeypatch.setattr(store_mod, "apply_layer", no_unpack)
    # Another reference to the same manifest: read, recognised, not unpacked.
    other = ensure_image(images["busybox-oci"], store=store)
    assert other.rootfs == first.rootfs

    def no_read(*_a: object, **_k: object) -> None:
        raise AssertionError("read the source again")

    monkeypatch.setattr(layout_mod, "open_source", no_read)
    for ref in (images["busybox"], images["busybox-oci"]):
        again = ensure_image(ref, store=store)
        assert (again.digest, again.rootfs, again.config) == (first.digest, first.rootfs, first.config)


def test_a_changed_archive_is_read_again(images: dict[str, str], store: Path, tmp_path: Path) -> None:
    path = tmp_path / "img.tar"
    shutil.copy(images["busybox"].split(":", 1)[1], path)
    first = ensure_image(f"oci-archive:{path}", store=store)
    shutil.copy(images["no-shell"].split(":", 1)[1], path)
    second = ensure_image(f"oci-archive:{path}", store=store)
    assert second.digest != first.digest
    assert not (second.rootfs / "bin").exists()


def test_the_store_never_holds_a_blob_twice(images: dict[str, str], store: Path) -> None:
    for name in ("busybox", "busybox-oci", "glibc", "busybox-docker"):
        ensure_image(images[name], store=store)
    blobs = sorted(os.listdir(store / "blobs/sha256"))
    assert all(hashlib.sha256((store / "blobs/sha256" / b).read_bytes()).hexdigest() == b for b in blobs)
    # busybox and glibc share their (gzip) base layer: one file; docker-archive's are plain tars.
    manifests = [json.loads((store / "blobs/sha256" / i.digest[7:]).read_bytes()) for i in list_images(store)]
    referenced = {d["digest"][7:] for m in manifests for d in [m["config"], *m["layers"]]}
    assert set(blobs) == referenced | {i.digest[7:] for i in list_images(store)}
    assert len(os.listdir(store / "rootfs")) == 3
    assert os.listdir(store / "tmp") == []


def test_concurrent_callers_unpack_once(images: dict[str, str], store: Path, tmp_path: Path) -> None:
    go = tmp_path / "go"
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from pathlib import Path
        from pytest_boxlite.images import ensure_image
        while not os.path.exists({str(go)!r}):
            time.sleep(0.005)
        im = ensure_image({images["glibc"]!r}, store=Path({str(store)!r}))
        print(im.digest, im.rootfs)
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    go.touch()
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert len({o[0] for o in outs}) == 1
    assert len(os.listdir(store / "rootfs")) == 1
    assert os.listdir(store / "tmp") == []


def test_a_failed_unpack_leaves_nothing_behind(images: dict[str, str], store: Path) -> None:
    with pytest.raises(ImageError, match=r"image 'oci:.*corrupt-oci': layer 2: .*does not match.*the image is corrupt"):
        ensure_image(images["corrupt"], store=store)
    assert os.listdir(store / "rootfs") == [] and os.listdir(store / "meta") == []
    assert os.listdir(store / "tmp") == [] and os.listdir(store / "refs") == []
    assert os.listdir(store / "blobs" / "sha256") == []  # layer 1 was sound: not kept for a refused image
    # A writer that died mid-unpack left its work: the next writer removes it, and nothing of it is used.
    stale = store / "tmp" / "work-dead" / "rootfs"
    stale.mkdir(parents=True)
    (stale / "half").write_text("x")
    image = ensure_image(images["busybox"], store=store)
    assert os.listdir(store / "tmp") == []
    assert list(os.listdir(store / "rootfs")) == [image.digest[7:]]


def test_a_writer_killed_mid_unpack_leaves_nothing_that_is_used(images: dict[str, str], store: Path) -> None:
    # Fault injection: the writer stops after its first layer (a sleep), and is SIGKILLed there.
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        import pytest_boxlite.images.store as s
        real = s.apply_layer
        def slow(*a, **k):
            real(*a, **k)
            print("one layer", flush=True)
            time.sleep(120)
        s.apply_layer = slow
        s.ensure_image({images["busybox"]!r}, store=Path({str(store)!r}))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "one layer\n"
        half = list((store / "tmp").glob("work-*/rootfs"))
        assert half and (half[0] / "bin/busybox").exists()  # half a tree exists, in tmp only
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert os.listdir(store / "rootfs") == [] and os.listdir(store / "refs") == []
    image = ensure_image(images["busybox"], store=store)  # the dead writer's lock went with it
    assert (image.rootfs / "etc/layer2").exists() and not (image.rootfs / "etc/removed-by-layer2").exists()
    assert os.listdir(store / "tmp") == []


def test_a_locked_store_times_out_clearly(images: dict[str, str], store: Path) -> None:
    store.mkdir(parents=True)
    fd = os.open(store / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(ImageError, match=r"image 'oci-archive:.*busybox.tar'.*stayed locked for 0 s"):
            ensure_image(images["busybox"], store=store, timeout=0.3)
    finally:
        os.close(fd)


def _bad(images: dict[str, str], tmp_path: Path, case: str) -> str:
    if case == "missing-archive":
        return f"oci-archive:{tmp_path}/nope.tar"
    if case == "missing-dir":
        return f"oci:{tmp_path}/nope"
    if case == "not-a-tar":
        (tmp_path / "junk.tar").write_bytes(os.urandom(3000))
        return f"oci-archive:{tmp_path}/junk.tar"
    if case == "oci-as-docker":
        return images["busybox"].replace("oci-archive:", "docker-archive:")
    if case == "docker-as-oci":
        return images["busybox-docker"].replace("docker-archive:", "oci-archive:")
    if case == "unknown-tag":
        return images["busybox-oci"].replace(":latest", ":nope")
    if case == "blob-is-a-link":
        layout = tmp_path / "linked"
        shutil.copytree(images["busybox-oci"].split(":")[1], layout)
        blob = max((layout / "blobs/sha256").iterdir(), key=lambda p: p.stat().st_size)
        blob.unlink()
        blob.symlink_to("/etc/passwd")
        return f"oci:{layout}"
    if case == "blobs-is-a-link":
        real = tmp_path / "elsewhere"
        shutil.copytree(images["busybox-oci"].split(":")[1], real)
        layout = tmp_path / "linked-blobs"
        layout.mkdir()
        for name in ("oci-layout", "index.json"):
            shutil.copy(real / name, layout / name)
        (layout / "blobs").symlink_to(real / "blobs")
        return f"oci:{layout}"
    if case == "huge-index":
        layout = tmp_path / "huge"
        layout.mkdir()
        (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        (layout / "index.json").write_text(" " * (5 << 20) + "{}")
        return f"oci:{layout}"
    if case == "docker-paths":
        # A docker save manifest naming host paths: only the archive's own members are ever read.
        manifest = [{"Config": "/etc/passwd", "RepoTags": ["x:1"], "Layers": ["../../../etc/shadow"]}]
        data = layer_tar([("manifest.json", "file", json.dumps(manifest), 0o644)])
        (tmp_path / "paths.tar").write_bytes(data)
        return f"docker-archive:{tmp_path}/paths.tar"
    if case == "nested-index":
        layout = tmp_path / "nested"
        layout.mkdir()
        (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        (layout / "index.json").write_text("[" * 200_000)  # json.loads recurses once per level
        return f"oci:{layout}"
    if case == "huge-header":
        with tarfile.open(tmp_path / "huge.tar", "w", format=tarfile.GNU_FORMAT) as tf:
            tf.addfile(tarfile.TarInfo("d/" * (3 << 19) + "f"))
        return f"oci-archive:{tmp_path}/huge.tar"
    if case == "wrong-size":
        layout = oci_layout(tmp_path / "wrong", [layer_tar([("f", "file", "x", 0o644)])])
        index = json.loads((layout / "index.json").read_text())
        index["manifests"][0]["size"] += 1
        (layout / "index.json").write_text(json.dumps(index))
        return f"oci:{layout}"
    return images[case]


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing-archive", r"archive .*nope.tar does not exist"),
        ("missing-dir", r"directory .*nope does not exist"),
        ("not-a-tar", r"is not a readable tar archive .*truncated or corrupt"),
        ("truncated", r"truncated.tar is not a readable tar archive .*truncated or corrupt"),
        ("corrupt", r"layer 2: blob sha256:\w+ does not match its content.*corrupt"),
        ("other-arch", r"the image is for linux/\w+, this machine is linux/\w+: use an image built for"),
        ("oci-as-docker", r"this is an OCI archive, not a docker save one: write oci-archive:"),
        ("docker-as-oci", r"this is a docker save archive, not an OCI one: write docker-archive:"),
        ("unknown-tag", r"no image is tagged 'nope' \(tags in it: latest\)"),
        ("blob-is-a-link", r"cannot open blobs/sha256/\w+: .*link"),
        ("blobs-is-a-link", r"linked-blobs': blobs is a symbolic link; an OCI layout's directories must be"),
        ("huge-index", r"index.json has \d+ bytes, more than the \d+ allowed"),
        ("wrong-size", r"blob sha256:\w+ has \d+ bytes, its descriptor says \d+"),
        ("docker-paths", r"config /etc/passwd is missing from the archive"),
        ("nested-index", r"index.json is not valid JSON .*the image is corrupt"),
        ("huge-header", r"huge.tar is not a readable tar archive \(an extended header of \d+ bytes"),
    ],
)
@pytest.mark.escape_row("hostile-image", runtime="host")
def test_bad_images_are_refused_naming_the_image_and_the_cause(
    images: dict[str, str], store: Path, tmp_path: Path, case: str, message: str
) -> None:
    ref = _bad(images, tmp_path, case)
    with pytest.raises(ImageError, match=message) as info:
        ensure_image(ref, store=store)
    assert f"image {ref!r}" in str(info.value)
    if store.is_dir():
        assert os.listdir(store / "rootfs") == [] and os.listdir(store / "tmp") == []


def test_registry_references_without_a_client_say_how_to_bring_the_image_in(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fault injection: neither the SDK (import fails) nor skopeo (not on PATH) is there.
    monkeypatch.setitem(sys.modules, "boxlite", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    for ref in ("alpine:3.19", "no-such-registry.invalid/nope:404"):
        with pytest.raises(ImageError) as info:
            ensure_image(ref, store=store)
        text = str(info.value)
        assert f"image {ref!r}" in text and "no registry client is available" in text
        assert "skopeo copy docker://" in text and "oci-archive:" in text


@pytest.mark.reliability
def test_unreachable_registries_fail_clearly(store: Path) -> None:
    ref = "no-such-registry.invalid/nope:404"
    with pytest.raises(ImageError) as info:
        ensure_image(ref, store=store, timeout=60)
    text = str(info.value)
    reason = _sdk_refusal()
    if reason is None:
        assert text.startswith(f"image {ref!r}: the boxlite SDK could not pull it (is the registry reachable")
        assert "no-such-registry.invalid" in text
    elif shutil.which("skopeo") is None:  # an ordinary user without KVM access: the SDK opens no runtime
        assert text.startswith(f"image {ref!r}: no registry client is available to pull it (the boxlite SDK cannot")
    assert "oci-archive:" in text
    assert os.listdir(store / "rootfs") == [] and os.listdir(store / "tmp") == []


@pytest.fixture
def registry(images: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``127.0.0.1:PORT``: a registry serving the busybox image as ``test/busybox:latest``."""
    server = serve(Path(images["busybox-oci"].split(":")[1]))
    host = f"127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv(INSECURE_ENV, host)
    yield host
    server.shutdown()
    server.server_close()


def _sdk_refusal() -> str | None:
    """Why the boxlite SDK opens no runtime here (it refuses users without KVM access), or None."""
    import boxlite

    async def probe() -> None:
        with tempfile.TemporaryDirectory() as home:
            rt = boxlite.Boxlite(boxlite.Options(home_dir=home))
            await rt.shutdown()

    try:
        pull_mod._run_bounded(probe, 30)
    except Exception as exc:  # noqa: BLE001 - any refusal is the reason
        return " ".join(str(exc).split())
    return None


def test_registry_references_are_pulled_by_the_sdk(images: dict[str, str], store: Path, registry: str) -> None:
    reason = _sdk_refusal()
    if reason is not None:
        pytest.skip(f"the boxlite SDK opens no runtime for this user, so it cannot pull: {reason}")
    ref = f"{registry}/test/busybox:latest"
    pulled = ensure_image(ref, store=store)
    local = ensure_image(images["busybox-oci"], store=store)
    assert pulled.digest == local.digest and pulled.rootfs == local.rootfs  # one image, stored once
    assert (pulled.rootfs / "etc/os-release").read_text() == OS_RELEASE
    assert pulled.config.workdir == "/srv/work"
    # Layers, config and manifest once each; the SDK's own copies went with the work directory.
    assert len(os.listdir(store / "blobs/sha256")) == 4 and os.listdir(store / "tmp") == []
    # Kept like a container engine's local image: the second ensure asks no registry.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pull_mod, "pull", lambda *a, **k: pytest.fail("pulled again"))
        assert ensure_image(ref, store=store).rootfs == pulled.rootfs
    with pytest.raises(ImageError, match=r"the boxlite SDK could not pull it .*NOT_FOUND"):
        ensure_image(f"{registry}/test/busybox:nope", store=store)


@pytest.mark.skipif(
    shutil.which("skopeo") is None, reason="skopeo is not installed (the SDK pulls; skopeo is its fallback)"
)
def test_skopeo_pulls_where_the_sdk_cannot_be_imported(
    images: dict[str, str], store: Path, registry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "boxlite", None)
    pulled = ensure_image(f"{registry}/test/busybox:latest", store=store)
    assert pulled.digest == ensure_image(images["busybox-oci"], store=store).digest


def test_drop_images_empties_the_store(images: dict[str, str], store: Path) -> None:
    a = ensure_image(images["busybox"], store=store)
    b = ensure_image(images["no-shell"], store=store)
    derived = store / "vm-layouts" / a.digest[7:]  # what the vm runtime makes of the blobs
    derived.mkdir(parents=True)
    (derived / "blobs").symlink_to("../../blobs")
    assert sorted(drop_images(store)) == sorted([a.digest, b.digest])
    assert list_images(store) == [] and not a.rootfs.exists()
    assert os.listdir(store) == ["lock"]
    assert ensure_image(images["busybox"], store=store).rootfs == a.rootfs  # unpacked again


def _cli(home: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest_boxlite", *args, "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_cli_lists_and_cleans_the_image_store(images: dict[str, str], tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert "(empty: images are unpacked there on first use)" in _cli(home, "doctor")
    image = ensure_image(images["busybox"], store=store_dir(home))
    listed = _cli(home, "ls", "--images")
    assert f"image store {store_dir(home)}: 1 image(s)" in listed
    assert image.digest[:19] in listed and images["busybox"] in listed
    assert "1 image(s)" in _cli(home, "doctor")
    cleaned = _cli(home, "clean", "--images")
    assert f"dropped 1 image(s) from {store_dir(home)}: {image.digest[:19]}" in cleaned
    assert "0 image(s)" in _cli(home, "ls", "--images")
    assert not image.rootfs.exists()


def test_the_store_is_hidden_from_boxes_like_the_rest_of_a_home() -> None:
    from pytest_boxlite.runtimes._homes import STATE_ENTRIES

    assert store_dir(Path("/h")).name in STATE_ENTRIES
    assert store_dir(Path("/h")) != Path("/h/images")  # BoxLite's own blob store


def test_archives_written_by_this_suite_are_real_tars(images: dict[str, str]) -> None:
    with tarfile.open(images["busybox"].split(":", 1)[1]) as tf:
        names = tf.getnames()
    assert "oci-layout" in names and "index.json" in names


_BIG = 256 << 20


def _sparse_oci(out: Path, size: int) -> str:
    """An OCI layout whose one layer blob is ``size`` bytes of hole (no disk used), its digest never
    checked: the size bound must refuse it from its descriptor, before a byte is copied."""
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    hexd = hashlib.sha256(b"never hashed").hexdigest()
    with open(blobs / hexd, "wb") as f:
        f.truncate(size)
    cfg = json.dumps({"os": "linux", "config": {}, "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hexd}"]}})
    chex = hashlib.sha256(cfg.encode()).hexdigest()
    (blobs / chex).write_text(cfg)
    man = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"digest": f"sha256:{chex}", "size": len(cfg)},
            "layers": [{"digest": f"sha256:{hexd}", "size": size}],
        }
    )
    mhex = hashlib.sha256(man.encode()).hexdigest()
    (blobs / mhex).write_text(man)
    index = {
        "schemaVersion": 2,
        "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": f"sha256:{mhex}", "size": len(man)}
        ],
    }
    (out / "index.json").write_text(json.dumps(index))
    (out / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return f"oci:{out}"


def _sparse_docker(dest: Path, size: int) -> str:
    """A docker save archive whose one layer member is ``size`` bytes of hole, written last."""
    config = json.dumps({"os": "linux", "config": {}, "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "0" * 64]}})
    manifest = json.dumps([{"Config": "config.json", "RepoTags": ["x:1"], "Layers": ["l/layer.tar"]}])
    out = bytearray()
    for name, body in (("config.json", config.encode()), ("manifest.json", manifest.encode()), ("l/layer.tar", b"")):
        ti = tarfile.TarInfo(name)
        ti.size = len(body) if body else size
        out += ti.tobuf(tarfile.USTAR_FORMAT) + body + b"\0" * (-len(body) % 512)
    with open(dest, "wb") as f:
        f.write(out)
        f.truncate(len(out) + size + (-size % 512) + 1024)  # the layer's data and the end blocks: all hole
    return f"docker-archive:{dest}"


@pytest.mark.reliability
@pytest.mark.parametrize("transport", ["oci", "docker-archive"])
@pytest.mark.escape_row("hostile-image", runtime="host")
def test_layers_over_the_size_bound_are_refused_before_they_are_copied(
    store: Path, tmp_path: Path, transport: str
) -> None:
    # A 256 MiB layer blob (a hole: the attacker's layout costs nothing) for an image bounded to
    # 16 MiB unpacked: refused from its size alone; nothing copied, nothing kept (a sparse 1 TB
    # blob would otherwise fill the disk).
    ref = _sparse_oci(tmp_path / "lay", _BIG) if transport == "oci" else _sparse_docker(tmp_path / "a.tar", _BIG)
    with pytest.raises(ImageError, match=rf"its layers are {_BIG} bytes, more than an image bounded to 16777216"):
        ensure_image(ref, store=store, max_unpacked=16 << 20)
    assert os.listdir(store / "blobs" / "sha256") == [] and os.listdir(store / "tmp") == []


@pytest.mark.reliability
@pytest.mark.parametrize("transport", ["oci", "docker-archive"])
@pytest.mark.escape_row("hostile-image", runtime="host")
def test_a_refused_image_keeps_none_of_its_blobs(store: Path, tmp_path: Path, transport: str) -> None:
    # Sound layers (their digests right), but the image unpacks to more than its bound: refused,
    # and its layers (docker-archive ones hashed into the store as they are read) are not kept.
    layer = layer_tar([("big", "file", os.urandom(200_000), 0o644)])
    if transport == "oci":
        ref = f"oci:{oci_layout(tmp_path / 'lay', [layer])}"
    else:
        ref = f"docker-archive:{docker_archive(tmp_path / 'a.tar', [layer], cfg={}, repo_tag='x:1')}"
    with pytest.raises(ImageError, match=r"unpacks to more than 100000 bytes"):
        ensure_image(ref, store=store, max_unpacked=100_000)
    assert os.listdir(store / "blobs" / "sha256") == [] and os.listdir(store / "tmp") == []
    assert os.listdir(store / "rootfs") == [] and os.listdir(store / "meta") == []


def _deep(top: Path, levels: int) -> None:
    """A directory ``levels`` deep under ``top`` (made through fds: its path is too long to name)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir("a", dir_fd=fd)
            nfd = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


@pytest.mark.reliability
@pytest.mark.escape_row("hostile-image", runtime="host")
def test_a_deep_image_is_refused_and_a_deep_leftover_does_not_jam_the_store(store: Path, tmp_path: Path) -> None:
    # One file 2000 directories deep (4000 characters, under the name bound): refused whole, the
    # store left clean, and the next image unpacks.
    deep = "/".join(["a"] * 2000)
    bad = oci_layout(tmp_path / "deep", [layer_tar([(deep + "/f", "file", "x", 0o644)])])
    with pytest.raises(ImageError, match=r"is deeper than an image may go"):
        ensure_image(f"oci:{bad}", store=store)
    assert os.listdir(store / "tmp") == [] and os.listdir(store / "rootfs") == []
    # A deep work tree left in tmp/ (by a writer killed there, or a version without the bound) and
    # a deep rootfs: the next writer clears tmp/, clean --images the rest (Python's recursive
    # rmtree raised RecursionError on them, for every later image).
    _deep(store / "tmp", 2000)
    good = oci_layout(tmp_path / "good", [layer_tar([("etc/os-release", "file", "ID=ok\n", 0o644)])])
    image = ensure_image(f"oci:{good}", store=store)
    assert os.listdir(store / "tmp") == []
    _deep(image.rootfs, 2000)
    assert drop_images(store) == [image.digest]
    assert sorted(os.listdir(store)) == ["lock"]


@pytest.mark.reliability
@pytest.mark.escape_row("hostile-image", runtime="host")
def test_an_archives_extended_headers_are_bounded_in_all(store: Path, tmp_path: Path) -> None:
    # An archive read in place keeps every member's TarInfo, PAX headers included: 300 members of
    # 60 KB headers each (each under the bound of one header) is 18 MB kept, refused.
    with tarfile.open(tmp_path / "pax.tar", "w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(300):
            ti = tarfile.TarInfo(f"m{i}")
            ti.pax_headers = {"comment": "C" * 60_000}
            tf.addfile(ti)
    with pytest.raises(
        ImageError, match=r"pax.tar is not a readable tar archive \(extended headers of more than 16777216"
    ):
        ensure_image(f"oci-archive:{tmp_path}/pax.tar", store=store)
