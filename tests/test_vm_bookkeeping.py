"""The vm runtime against the real boxlite SDK: everything that works without booting.

BoxLite registers, lists and removes boxes without KVM, so the bookkeeping the
pool and the reaper rely on is tested for real here.  Booting is tested only
where the probe says a VM can boot.
"""

from __future__ import annotations

import gc
import importlib.metadata
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import new_box_name, skip_unless_real_sdk_opens, skip_unless_vm_ok

from pytest_boxlite import errors
from pytest_boxlite.runtimes import choose, open_runtime, probe
from pytest_boxlite.runtimes.vm import VmRuntime, prepare_home
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec

pytestmark = pytest.mark.timeout(60)


def owner() -> str:
    """A fresh owner id, as a session would make."""
    return "t" + uuid.uuid4().hex[:8]


@pytest.fixture
def vm_runtime(tmp_path: Path) -> Iterator[VmRuntime]:
    """A vm runtime on a private, empty home (no VM is booted)."""
    skip_unless_real_sdk_opens()
    rt = open_runtime("vm", tmp_path, owner=owner())
    assert isinstance(rt, VmRuntime)
    try:
        yield rt
    finally:
        rt.close()


def names(rt: VmRuntime) -> set[str]:
    """The names of every box the runtime's home knows of."""
    return {r.name for r in rt.list_boxes()}


def test_open_runtime_uses_a_per_owner_home(tmp_path: Path) -> None:
    skip_unless_real_sdk_opens()
    who = owner()
    rt = open_runtime("vm", tmp_path, owner=who)
    try:
        assert isinstance(rt, VmRuntime)
        assert rt.home == tmp_path / "vm" / who
        assert rt.name == "vm"
        assert "micro-VM" in rt.isolation
    finally:
        rt.close()


def test_register_and_list(vm_runtime: VmRuntime) -> None:
    assert vm_runtime.list_boxes() == []
    a, b = new_box_name(), new_box_name()
    vm_runtime.register_box(BoxSpec(), a)
    vm_runtime.register_box(BoxSpec(network=True, cpus=2), b)
    records = {r.name: r for r in vm_runtime.list_boxes()}
    assert set(records) == {a, b}
    for r in records.values():
        assert r.state == "configured"
        assert r.runtime == "vm"
        assert r.home == str(vm_runtime.home)
        assert r.id and "-" not in r.id  # ids never contain '-': hyphenated names cannot collide
    assert records[a].id != records[b].id


def test_duplicate_name_is_refused(vm_runtime: VmRuntime) -> None:
    name = new_box_name()
    vm_runtime.register_box(BoxSpec(), name)
    with pytest.raises(errors.BoxStartError, match=name):
        vm_runtime.register_box(BoxSpec(), name)
    assert [r.name for r in vm_runtime.list_boxes()] == [name]


def test_remove_box(vm_runtime: VmRuntime) -> None:
    keep, drop = new_box_name(), new_box_name()
    vm_runtime.register_box(BoxSpec(), keep)
    vm_runtime.register_box(BoxSpec(), drop)
    vm_runtime.remove_box(drop)
    assert names(vm_runtime) == {keep}
    vm_runtime.remove_box(drop)  # already gone: not an error
    vm_runtime.remove_box("pbx-test-never-existed")
    vm_runtime.remove_box(keep)
    assert vm_runtime.list_boxes() == []


def test_second_runtime_on_the_same_home_fails_naming_the_lock(vm_runtime: VmRuntime) -> None:
    t0 = time.monotonic()
    with pytest.raises(errors.RuntimeUnavailableError) as info:
        VmRuntime(vm_runtime.home)
    assert time.monotonic() - t0 < 10  # fails at once, does not wait for the lock
    msg = str(info.value)
    assert "lock" in msg.lower()
    assert str(vm_runtime.home) in msg
    # The first runtime is unharmed.
    name = new_box_name()
    vm_runtime.register_box(BoxSpec(), name)
    assert names(vm_runtime) == {name}


def test_close_then_reopen(tmp_path: Path) -> None:
    skip_unless_real_sdk_opens()
    home = prepare_home(tmp_path, owner())
    name = new_box_name()
    rt = VmRuntime(home)
    rt.register_box(BoxSpec(), name)  # handle dropped at once: only the runtime holds the lock
    rt.close()
    rt.close()  # idempotent
    gc.collect()
    again = VmRuntime(home)
    try:
        # Records survive a close (auto_delete is off): a later session can reap them.
        assert [(r.name, r.state) for r in again.list_boxes()] == [(name, "configured")]
        again.remove_box(name)
        assert again.list_boxes() == []
    finally:
        again.close()


def test_prepare_home_shares_images(tmp_path: Path) -> None:
    a = prepare_home(tmp_path, "towner1")
    b = prepare_home(tmp_path, "towner2")
    assert a == tmp_path / "vm" / "towner1"
    assert a != b
    for home in (a, b):
        link = home / "images"
        assert link.is_symlink()
        assert link.resolve() == (tmp_path / "images").resolve()
    (a / "images" / "blob").write_text("layer")
    assert (b / "images" / "blob").read_text() == "layer"
    # Idempotent: a second call keeps the same link.
    assert prepare_home(tmp_path, "towner1") == a
    assert os.readlink(a / "images") == os.readlink(b / "images")


def test_box_options_mapping(vm_runtime: VmRuntime) -> None:
    off = vm_runtime.box_options(BoxSpec(image="alpine:3", env=(("B", "2"), ("A", "1")), cpus=2, memory_mib=512))
    assert off.image == "alpine:3"
    assert off.cpus == 2
    assert off.memory_mib == 512
    assert sorted(off.env) == [("A", "1"), ("B", "2")]
    # No working_dir (whether the OCI runtime creates it is unverified, #13): the box makes it.
    assert off.working_dir is None
    assert off.auto_delete == 0  # keep the record after a stop
    assert off.network is not None
    assert "disabled" in repr(off.network)

    on = vm_runtime.box_options(BoxSpec(network=True))
    assert on.network is None or "disabled" not in repr(on.network)
    assert on.cpus is None
    assert on.memory_mib is None
    assert on.env == []


def test_options_are_accepted_by_the_sdk(vm_runtime: VmRuntime) -> None:
    spec = BoxSpec(env=(("K", "v"),), cpus=2, memory_mib=256)
    name = new_box_name()
    vm_runtime.register_box(spec, name)
    [rec] = vm_runtime.list_boxes()
    assert rec.name == name


def test_create_box_boots_a_vm(vm_runtime: VmRuntime) -> None:
    skip_unless_vm_ok()
    handle = vm_runtime.create_box(BoxSpec(), new_box_name(), timeout=120)
    try:
        sb = Sandbox(handle)
        assert sb.runtime == "vm"
        assert sb.execute_command("echo booted", timeout=30).stdout == "booted\n"
    finally:
        handle.destroy()
    assert vm_runtime.list_boxes() == []


# --------------------------------------------------------------------------
# probe and runtime choice
# --------------------------------------------------------------------------


def test_probe_matches_this_host() -> None:
    p = probe()
    assert p is probe()  # cached
    assert p.reason
    dev = Path("/dev/kvm")
    modules = Path("/sys/module")
    pvm_only = (modules / "kvm_pvm").exists() and not (
        (modules / "kvm_intel").exists() or (modules / "kvm_amd").exists()
    )
    if not dev.exists():
        assert not p.vm_ok
        assert "/dev/kvm" in p.reason
    elif pvm_only:
        assert not p.vm_ok
        assert "PVM" in p.reason
    if p.vm_ok:
        assert dev.exists()
        assert os.access(dev, os.R_OK | os.W_OK)
        assert not pvm_only
    assert p.boxlite_version == importlib.metadata.version("boxlite")


def test_probe_is_fast() -> None:
    uncached = probe.__wrapped__
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        result = uncached()
        best = min(best, time.perf_counter() - t0)
    assert result == probe()
    assert best < 0.05, f"probe took {best * 1000:.1f} ms (bound: 50 ms)"


def test_choose_vm_fails_fast_with_the_reason() -> None:
    p = probe()
    if p.vm_ok:
        assert choose("vm").kind == "vm"
        return
    t0 = time.monotonic()
    with pytest.raises(errors.RuntimeUnavailableError) as info:
        choose("vm")
    assert time.monotonic() - t0 < 1
    assert p.reason in str(info.value)


def test_choose_auto() -> None:
    p = probe()
    c = choose("auto")
    if p.vm_ok:
        assert c.kind == "vm"
    else:
        assert c.kind == "namespace"
        assert c.reason == p.reason


def test_choose_namespace_and_bad_names() -> None:
    assert choose("namespace").kind == "namespace"
    for bad in ("", "VM", "docker", "namespaces"):
        with pytest.raises(errors.ConfigError):
            choose(bad)
    with pytest.raises(errors.ConfigError):
        open_runtime("docker", Path("/nonexistent"), owner="t0")
