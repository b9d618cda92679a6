"""Local images on the vm runtime (issue 25, item 4): ``oci:``, ``oci-archive:``, ``docker-archive:``.

The boxlite SDK takes a local image as ``BoxOptions.rootfs_path``, an OCI image layout directory
whose first manifest it boots (docs/how-to/images.md cites its source); the plugin gives it one
(``pytest_boxlite.runtimes._vmimage``).  No VM boots here, so the boxes below are the SDK double's
(``tests/sdk_double/_local_image.py``), which reads ``rootfs_path`` as the real SDK does and boots
its sandbox on the image's tree: a test sees the image's ``/etc/os-release`` and tools, not the
host's.  The real wheel's own answers to a bad ``rootfs_path`` (it refuses before booting, so they
can be had without KVM) are checked against the double's in a subprocess.

The test images are built here from the host's ``busybox`` (Debian's ``busybox-static``), packed
as an OCI layout, an OCI archive and a ``docker save`` archive.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sdk_double

from pytest_boxlite.errors import BoxStartError, ConfigError
from pytest_boxlite.runtimes import _vmimage
from pytest_boxlite.runtimes.vm import VmRuntime
from pytest_boxlite.spec import BoxSpec

pytestmark = pytest.mark.timeout(120)

BUSYBOX = shutil.which("busybox")
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar"
REF_NAME = "org.opencontainers.image.ref.name"
OS_RELEASE = 'ID=pbx-test\nNAME="pytest-boxlite test image"\nVERSION_ID=1\n'


def _static(path: str | None) -> bool:
    if path is None:
        return False
    out = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=30)
    return "not a dynamic executable" in out.stdout + out.stderr or "statically linked" in out.stdout


needs_busybox = pytest.mark.skipif(
    not _static(BUSYBOX), reason="needs a static busybox for the test image: apt-get install busybox-static"
)


def _layer(os_release: str = OS_RELEASE) -> bytes:
    """One layer: /bin/busybox with its applets as links, /etc/os-release, an empty /workspace."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "etc", "workspace"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        assert BUSYBOX is not None
        tar.add(os.path.realpath(BUSYBOX), "bin/busybox")
        for applet in ("sh", "cat", "ls", "mkdir", "true", "env", "id"):
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
        data = os_release.encode()
        info = tarfile.TarInfo("etc/os-release")
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _config(layer: bytes) -> bytes:
    return json.dumps(
        {
            "architecture": "amd64" if os.uname().machine == "x86_64" else "arm64",
            "os": "linux",
            "config": {"Env": ["PATH=/bin", "IMAGE_SAYS=hello"]},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]},
        }
    ).encode()


def _write_blob(root: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / "sha256" / digest).write_bytes(data)
    return f"sha256:{digest}"


def make_layout(root: Path, tags: dict[str, str]) -> dict[str, str]:
    """An OCI layout with one image per tag (``tag -> os-release ID``); returns ``tag -> manifest digest``."""
    manifests, digests = [], {}
    root.mkdir(parents=True)
    for tag, ident in tags.items():
        layer = _layer(OS_RELEASE.replace("pbx-test", ident))
        cfg = _config(layer)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": MT_MANIFEST,
                "config": {"mediaType": MT_CONFIG, "digest": _write_blob(root, cfg), "size": len(cfg)},
                "layers": [{"mediaType": MT_LAYER, "digest": _write_blob(root, layer), "size": len(layer)}],
            }
        ).encode()
        digest = _write_blob(root, manifest)
        digests[tag] = digest
        manifests.append(
            {
                "mediaType": MT_MANIFEST,
                "digest": digest,
                "size": len(manifest),
                "annotations": {REF_NAME: tag},
            }
        )
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))
    return digests


def make_oci_archive(layout: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w") as tar:
        for name in ("oci-layout", "index.json", "blobs"):
            tar.add(layout / name, name)
    return dest


def make_docker_archive(dest: Path, repo_tag: str = "pbx/test:1") -> Path:
    """What ``docker save`` (before 25) writes: manifest.json, <id>.json, <id>/layer.tar."""
    layer = _layer()
    cfg = _config(layer)
    cid = hashlib.sha256(cfg).hexdigest()
    with tarfile.open(dest, "w") as tar:
        manifest = json.dumps([{"Config": f"{cid}.json", "RepoTags": [repo_tag], "Layers": ["abc/layer.tar"]}]).encode()
        for name, data in (("manifest.json", manifest), (f"{cid}.json", cfg), ("abc/layer.tar", layer)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return dest


@pytest.fixture
def images(tmp_path: Path) -> dict[str, Any]:
    layout = tmp_path / "layout"
    digests = make_layout(layout, {"one": "pbx-one", "two": "pbx-two"})
    single = tmp_path / "single"
    single_digest = make_layout(single, {"latest": "pbx-test"})["latest"]
    return {
        "layout": layout,
        "digests": digests,
        "single": single,
        "single_digest": single_digest,
        "oci_archive": make_oci_archive(single, tmp_path / "img.oci.tar"),
        "docker_archive": make_docker_archive(tmp_path / "img.docker.tar"),
        "cache": tmp_path / "cache",
    }


# -- the layouts handed to the SDK ----------------------------------------------------------------
def _listed(layout: _vmimage.LocalLayout) -> list[str]:
    index = json.loads((Path(layout.path) / "index.json").read_text())
    return [m["digest"] for m in index["manifests"]]


@needs_busybox
def test_each_transport_becomes_a_layout_of_one_image(images: dict[str, Any]) -> None:
    store = images["cache"]
    for ref, digest in (
        (f"oci:{images['single']}", images["single_digest"]),
        # A tag of a layout of several: a layout listing that image alone (the SDK boots the first).
        (f"oci:{images['layout']}:two", images["digests"]["two"]),
        (f"oci-archive:{images['oci_archive']}", images["single_digest"]),
        (f"docker-archive:{images['docker_archive']}", None),  # its OCI manifest is synthesised
    ):
        lay = _vmimage.local_layout(ref, store)
        assert _listed(lay) == [lay.digest] and (digest is None or lay.digest == digest), ref
        assert lay.label() == f"{ref}@{lay.digest[:19]}"
        # The SDK reads the blobs through the layout: the store's, verified, not copied.
        manifest = json.loads((Path(lay.path) / "blobs" / "sha256" / lay.digest[7:]).read_bytes())
        for blob in [manifest["config"], *manifest["layers"]]:
            assert (Path(lay.path) / "blobs" / "sha256" / blob["digest"][7:]).is_file()
        assert (Path(lay.path) / "blobs").resolve() == (store / "blobs").resolve()
        assert _vmimage.local_layout(ref, store) == lay  # a second call finds it
    assert not [p for p in (store / "vm-layouts").iterdir() if p.name.startswith(".tmp-")]


@needs_busybox
@pytest.mark.reliability
def test_bad_local_images_are_usage_errors_naming_them(images: dict[str, Any], tmp_path: Path) -> None:
    store = images["cache"]

    def refused(ref: str) -> str:
        with pytest.raises(ConfigError) as info:
            _vmimage.local_layout(ref, store)
        assert repr(ref) in str(info.value)
        return str(info.value)

    assert "exist" in refused(f"oci-archive:{tmp_path / 'nope.tar'}")
    assert "exist" in refused(f"oci:{tmp_path / 'nope'}")
    assert "one" in refused(f"oci:{images['layout']}:three")  # names the tags it has
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(images["oci_archive"].read_bytes()[:5000])
    refused(f"oci-archive:{truncated}")
    refused(f"docker-archive:{images['oci_archive']}")
    assert not (store / "vm-layouts").exists()  # nothing was laid out for any of them


# -- through the SDK double ------------------------------------------------------------------------
@pytest.fixture
def vm(tmp_path: Path) -> Iterator[VmRuntime]:
    rt = VmRuntime(tmp_path / "home", sdk=sdk_double, images=tmp_path / "cache")
    try:
        yield rt
    finally:
        rt.close()


@needs_busybox
@pytest.mark.parametrize("transport", ["oci", "oci-tag", "oci-archive", "docker-archive"])
def test_a_vm_box_of_a_local_image_sees_the_images_userland(
    vm: VmRuntime, images: dict[str, Any], transport: str
) -> None:
    ref, ident = {
        "oci": (f"oci:{images['single']}", "pbx-test"),
        "oci-tag": (f"oci:{images['layout']}:one", "pbx-one"),
        "oci-archive": (f"oci-archive:{images['oci_archive']}", "pbx-test"),
        "docker-archive": (f"docker-archive:{images['docker_archive']}", "pbx-test"),
    }[transport]
    box = vm.create_box(BoxSpec(image=ref, network=False), "pbx-img-1", timeout=60)
    try:
        out = box.exec(["cat", "/etc/os-release"], timeout=30)
        assert out.exit_code == 0 and f"ID={ident}" in out.stdout.decode(), out
        # The image's tools and config, not the host's: busybox's ls, no Debian files, the image's Env.
        assert box.exec(["ls", "/etc/debian_version"], timeout=30).exit_code != 0
        env = box.exec(["env"], timeout=30).stdout.decode()
        assert "IMAGE_SAYS=hello" in env
        records = {r.name: r for r in vm.list_boxes()}
        assert "pbx-img-1" in records
        # No registry was contacted: the image was read in place.
        assert not (vm.home / "db" / "registry_contacts").exists()
    finally:
        box.destroy()


@needs_busybox
def test_the_sdk_gets_rootfs_path_and_the_digest_is_known(vm: VmRuntime, images: dict[str, Any]) -> None:
    ref = f"oci:{images['layout']}:two"
    opts = vm.box_options(BoxSpec(image=ref))
    layout = vm.local_image(ref)
    assert opts.image is None and opts.rootfs_path == layout.path and isinstance(opts.rootfs_path, str)
    assert layout.digest == images["digests"]["two"]
    # A registry reference goes to the puller as before; docker:// is the transport's name.
    assert vm.box_options(BoxSpec(image="docker://alpine:3.19")).image == "alpine:3.19"
    assert vm.box_options(BoxSpec(image="alpine:3.19")).rootfs_path is None
    # A missing archive is a usage error before any box record exists.
    with pytest.raises(ConfigError, match="does not exist"):
        vm.register_box(BoxSpec(image=f"oci-archive:{images['cache']}/none.tar"), "pbx-img-2")
    assert vm.list_boxes() == []
    # Any other refusal of the options is still a failed create, as before images were resolved here.
    with pytest.raises(BoxStartError, match="could not create box"):
        vm.register_box(BoxSpec(image="alpine:3.19", cpus=300), "pbx-img-3")


# -- the double's rootfs_path against the real wheel's --------------------------------------------
_PROBE = r"""
import asyncio, json, os, sys
sys.path.insert(0, sys.argv[3])
if sys.argv[1] == "real":
    import boxlite as bl
else:
    import sdk_double as bl
async def main():
    rt = bl.Boxlite(bl.Options(home_dir=sys.argv[2] + "/home-" + sys.argv[1]))
    out = {}
    try:
        bl.BoxOptions(rootfs_path=__import__("pathlib").Path("/x"))
    except TypeError as e:
        out["type"] = str(e)
    for case in sorted(os.listdir(sys.argv[2] + "/cases")):
        path = sys.argv[2] + "/cases/" + case
        box = await rt.create(bl.BoxOptions(rootfs_path=path, image="alpine:3.19", auto_delete=0), name=case)
        info = await rt.get_info(case)
        try:
            await asyncio.wait_for(box.start(), 60)
            out[case] = "started"
        except Exception as e:
            out[case] = [type(e).__name__, str(e).replace(path, "<P>"), info.image.replace(path, "<P>")]
    print(json.dumps(out), flush=True)
    os._exit(0)  # the real runtime can abort at exit (a thread-local panic): the answer is out
asyncio.run(main())
"""


def test_the_doubles_rootfs_path_refusals_are_the_wheels(tmp_path: Path) -> None:
    cases = tmp_path / "cases"
    for name in ("empty", "noindex", "nomanifest", "badjson", "noblob"):
        (cases / name).mkdir(parents=True)
        if name != "empty":
            (cases / name / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (cases / "nomanifest" / "index.json").write_text('{"schemaVersion":2,"manifests":[]}')
    (cases / "badjson" / "index.json").write_text("nope")
    (cases / "noblob" / "index.json").write_text(
        json.dumps(
            {
                "schemaVersion": 2,
                "manifests": [{"mediaType": MT_MANIFEST, "digest": "sha256:" + "a" * 64, "size": 1}],
            }
        )
    )
    os.symlink(tmp_path / "missing", cases / "missing")
    here = str(Path(__file__).parent)
    answers = {}
    for which in ("real", "double"):
        run = subprocess.run(
            [sys.executable, "-c", _PROBE, which, str(tmp_path), here], capture_output=True, text=True, timeout=100
        )
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
        if which == "real" and not lines:
            pytest.skip(f"the real boxlite runtime cannot open here: {run.stderr.strip()[-300:]}")
        assert lines, run.stderr
        answers[which] = json.loads(lines[-1])
    for ans in answers.values():  # the parser's own words (serde's, json's) differ; the rest must not
        ans["badjson"][1] = ans["badjson"][1].partition("index.json: ")[0]
    assert answers["double"] == answers["real"]
    assert answers["real"]["empty"][1].startswith("storage error: Local image must contain oci-layout file")


# -- a remote server cannot read this machine's files -----------------------------------------------
def test_a_remote_server_refuses_local_images_before_any_request(tmp_path: Path) -> None:
    from sdk_double.rest import ServerProcess

    from pytest_boxlite.runtimes.rest import RestRuntime, remote_target

    key = "blk_test_images_0001"
    srv = ServerProcess(tmp_path / "server-host", key=key)
    try:
        target = remote_target(srv.url, credential_file=None, max_boxes=1, environ={"BOXLITE_API_KEY": key})
        rt = RestRuntime(target, tmp_path / "scratch", "img001", sdk=sdk_double)
        try:
            for ref in (f"oci:{tmp_path}", f"oci-archive:{tmp_path}/x.tar", f"docker-archive:{tmp_path}/x.tar"):
                with pytest.raises(ConfigError, match="cannot read") as info:
                    rt.register_box(BoxSpec(image=ref), "pbx-img001-1")
                assert repr(ref) in str(info.value) and "skopeo copy" in str(info.value)
            assert rt.list_boxes() == []  # nothing was created on the server
            assert rt.box_options(BoxSpec(image="docker://alpine:3.19")).image == "alpine:3.19"
        finally:
            rt.close()
    finally:
        srv.stop()


# -- a session on vm: the header's digest, the usage error ----------------------------------------
SESSION_TEST = """
def test_in_the_image(boxlite_sandbox):
    out = boxlite_sandbox.execute_command("cat /etc/os-release; ls /etc/debian_version 2>&1 || true")
    assert "ID=pbx-test" in out.stdout and "No such file" in out.stdout, out.stdout
"""


@needs_busybox
def test_a_vm_session_on_a_local_image_shows_its_digest(images: dict[str, Any], tmp_path: Path) -> None:
    from subruns import QUIET, sub_env

    tests = Path(__file__).resolve().parent
    env = sub_env(PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests)]))
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "test_in_image.py").write_text(SESSION_TEST)
    ref = f"oci-archive:{images['oci_archive']}"
    argv = [sys.executable, "-m", "pytest", *QUIET, "-p", "sdk_double.activate", "--boxlite-runtime=vm"]
    argv += [f"--boxlite-home={tmp_path / 'home'}", "-p", "no:randomly"]
    run = subprocess.run(
        [*argv, f"--boxlite-image={ref}"], cwd=proj, env=env, capture_output=True, text=True, timeout=200
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"boxlite: image={ref}@{images['single_digest'][:19]} " in run.stdout, run.stdout
    # The layout the SDK got lies in the session's image store, next to the verified blobs.
    assert [p.name for p in (tmp_path / "home" / "image-store" / "vm-layouts").iterdir()] == [
        images["single_digest"][7:]
    ]
    # A missing archive: named in the header at once and in the test's error; no box is made.
    bad = f"oci-archive:{tmp_path / 'gone.tar'}"
    run = subprocess.run(
        [*argv, f"--boxlite-image={bad}"], cwd=proj, env=env, capture_output=True, text=True, timeout=200
    )
    out = run.stdout + run.stderr
    assert run.returncode in (1, 4) and f"image {bad!r} cannot be used" in out, out
    assert "INTERNALERROR" not in out and "1 passed" not in out, out
