"""``--boxlite-setup`` on vm: one template box per setup, exported once, cloned per pool box (SDK double).

The double models ``Box.clone_box`` (a copy of the box's disk, stopped),
``Box.export`` and ``Boxlite.import_box`` on persistent per-box disks, so the
vm runtime's template path runs here; that BoxLite clones boot cold with the
template's disk is what remains to confirm on a KVM host.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import pytest
import sdk_double
from conftest import CREATE_TIMEOUT, new_box_name

from pytest_boxlite import errors
from pytest_boxlite.runtimes.vm import VmRuntime
from pytest_boxlite.spec import BoxSpec

pytestmark = pytest.mark.timeout(180)

# Records when it ran; fails if it runs a second time in a box made from the template.
SETUP = "test ! -e /root/built-at && date +%s%N > /root/built-at && mkdir -p /opt/tpl && echo tool > /opt/tpl/f"


def built_at(rt: VmRuntime, spec: BoxSpec) -> list[str]:
    out = []
    for _ in range(2):
        box = rt.create_box(spec, new_box_name(), timeout=CREATE_TIMEOUT)
        try:
            r = box.exec(["sh", "-c", "cat /root/built-at /opt/tpl/f; pwd"], timeout=20)
            assert r.exit_code == 0, r
            stamp, tool, pwd = r.stdout.decode().split()
            assert (tool, pwd) == ("tool", "/workspace")
            out.append(stamp)
            box.exec(["sh", "-c", "echo mine > /root/only-this-box"], timeout=20)
        finally:
            box.destroy()
    return out


def test_setup_runs_once_and_every_box_starts_from_it(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = VmRuntime(tmp_path / "home1", sdk=sdk_double)
    try:
        spec = first.ensure_template(BoxSpec(), SETUP, key="k1", store=store, cwd=Path("/"), timeout=60)
        assert spec.template is not None
        stamps = built_at(first, spec)
        assert stamps[0] == stamps[1], "each box ran the setup again instead of starting from the template"
        assert (store / f"{spec.template.split(':', 1)[1]}.boxlite").is_file()
        # Clones are independent: what one box wrote is not in the next.
        box = first.create_box(spec, new_box_name(), timeout=CREATE_TIMEOUT)
        try:
            assert box.exec(["test", "-e", "/root/only-this-box"], timeout=20).exit_code != 0
        finally:
            box.destroy()
    finally:
        first.close()
    # Another home (a later session, an xdist worker) imports the archive: the setup does not run again.
    second = VmRuntime(tmp_path / "home2", sdk=sdk_double)
    try:
        spec2 = second.ensure_template(BoxSpec(), SETUP, key="k1", store=store, cwd=Path("/"), timeout=60)
        assert built_at(second, spec2)[0] == stamps[0]
    finally:
        second.close()
    assert not (tmp_path / "home2").exists(), "the template's copy was left in the closed home"


def test_failing_setup_is_a_clear_error_and_caches_nothing(tmp_path: Path) -> None:
    rt = VmRuntime(tmp_path / "home", sdk=sdk_double)
    try:
        with pytest.raises(errors.BoxStartError, match="exited with status 3") as info:
            rt.ensure_template(
                BoxSpec(), "echo broken-setup; exit 3", key="k2", store=tmp_path / "s", cwd=Path("/"), timeout=60
            )
        assert "broken-setup" in str(info.value)
        assert list((tmp_path / "s").glob("*.boxlite")) == []
        assert [r.name for r in rt.list_boxes()] == []
    finally:
        rt.close()


def test_unknown_template_is_a_config_error(tmp_path: Path) -> None:
    rt = VmRuntime(tmp_path / "home", sdk=sdk_double)
    try:
        with pytest.raises(errors.ConfigError, match="ensure_template"):
            rt.create_box(BoxSpec(template="vm-template:nope"), new_box_name(), timeout=CREATE_TIMEOUT)
    finally:
        rt.close()


def test_clean_templates_drops_vm_archives_but_not_one_in_use(tmp_path: Path) -> None:
    """``python -m pytest_boxlite clean --templates`` removes the store's archives, except one a
    session holds the lock of (it is being built or imported)."""
    home = tmp_path / "home"
    rt = VmRuntime(tmp_path / "vmhome", sdk=sdk_double)
    try:
        for key in ("k1", "k2"):
            rt.ensure_template(BoxSpec(), SETUP, key=key, store=home / "vm-templates", cwd=Path("/"), timeout=60)
    finally:
        rt.close()
    store = home / "vm-templates"
    k1, k2 = sorted(p.name.removesuffix(".boxlite") for p in store.glob("*.boxlite"))
    assert k1.startswith("k1-") and k2.startswith("k2-")
    with open(store / f"{k2}.lock", "w") as busy:
        fcntl.flock(busy, fcntl.LOCK_EX)
        out = subprocess.run(
            [sys.executable, "-m", "pytest_boxlite", "--home", str(home), "clean", "--templates"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 0, out.stderr
    assert f"dropped 1 template(s): {k1}" in out.stdout, out.stdout
    assert [p.name for p in store.glob("*.boxlite")] == [f"{k2}.boxlite"]
