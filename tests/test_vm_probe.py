"""The host probe (can a micro-VM boot here?) and ``auto``'s fallback when the VM runtime cannot open."""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path

import pytest

from pytest_boxlite.errors import RuntimeUnavailableError
from pytest_boxlite.runtimes import Choice, choose, open_choice
from pytest_boxlite.runtimes.vm import VmRuntime, prepare_home

pytestmark = pytest.mark.timeout(60)
#: The module (``pytest_boxlite.runtimes.probe`` the attribute is the function of the same name).
probe_mod = importlib.import_module("pytest_boxlite.runtimes.probe")


@pytest.mark.skipif(not os.access("/dev/kvm", os.R_OK | os.W_OK), reason="no read-writable /dev/kvm here")
def test_kvm_smoke_test_runs_a_guest() -> None:
    """BoxLite's HLT check, done by the probe.  It passes under PVM too, hence the PVM rule."""
    start = time.perf_counter()
    ok, why = probe_mod.kvm_smoke_test()
    assert ok, why
    assert time.perf_counter() - start < probe_mod.SMOKE_TIMEOUT


def test_pvm_rule_is_kept() -> None:
    if not Path("/sys/module/kvm_pvm").exists():
        pytest.skip("not a PVM host")
    ok, why = probe_mod._kvm_state()
    assert not ok and "PVM" in why


def _fake_sysctl(tmp_path: Path, value: str) -> str:
    """A stand-in ``sysctl`` (this is Linux): prints ``value`` for kern.hv_support."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    exe = bindir / "sysctl"
    exe.write_text(f'#!/bin/sh\n[ "$2" = kern.hv_support ] && echo {value}\n')
    exe.chmod(0o755)
    return f"{bindir}:{os.environ['PATH']}"


@pytest.mark.parametrize(("value", "ok"), [("0", False), ("1", True), ("", False)])
def test_macos_needs_hypervisor_framework(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, ok: bool
) -> None:
    monkeypatch.setenv("PATH", _fake_sysctl(tmp_path, value))
    monkeypatch.setattr(probe_mod.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(probe_mod.platform, "machine", lambda: "arm64")
    got = probe_mod.probe.__wrapped__()
    assert got.vm_ok is ok
    if not ok:
        assert "Hypervisor.framework is not available" in got.reason


def test_macos_intel_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe_mod.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(probe_mod.platform, "machine", lambda: "x86_64")
    assert "Apple silicon" in probe_mod.probe.__wrapped__().reason


def test_auto_carries_a_fallback_only_when_it_picks_vm() -> None:
    c = choose("auto")
    assert (c.kind, c.fallback) in (("vm", "namespace"), ("namespace", None))
    assert choose("namespace").fallback is None


def test_auto_falls_back_to_namespace_when_the_vm_runtime_cannot_open(tmp_path: Path) -> None:
    owner = "tprobe"
    try:
        holder = VmRuntime(prepare_home(tmp_path, owner))  # holds BoxLite's home lock
    except RuntimeUnavailableError as exc:
        pytest.skip(f"the real boxlite runtime cannot open here: {exc}")
    try:
        rt, choice = open_choice(Choice("vm", "probe said yes", fallback="namespace"), tmp_path, owner)
        try:
            assert rt.name == "namespace" and choice.kind == "namespace"
            assert "could not open" in choice.reason and "Another BoxliteRuntime" in choice.reason
        finally:
            rt.close()
        with pytest.raises(RuntimeUnavailableError):
            open_choice(Choice("vm", "requested"), tmp_path, owner)
    finally:
        holder.close()
