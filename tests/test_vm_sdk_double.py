"""The SDK double against the real boxlite wheel: same surface, same non-booting behaviour.

The first half introspects both and fails when a new boxlite changes a class,
method or signature the plugin relies on (then the double, and perhaps the
plugin, must follow).  The second half runs the same non-booting calls on the
real SDK and on the double and expects the same answers; the real half skips
where the real runtime cannot open (no usable /dev/kvm).  The last part checks
the double's booting semantics (section 4 of the review) on its sandboxes.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boxlite as real
import pytest
import sdk_double as double
from conftest import skip_unless_real_sdk_opens

pytestmark = pytest.mark.timeout(60)

#: Every member of the SDK the plugin (and the double's users) touch, by class.
SURFACE: dict[str, list[str]] = {
    "Options": ["__init__"],
    "Boxlite": ["__init__", "create", "list_info", "get", "get_info", "remove", "shutdown", "close", "import_box"],
    "BoxOptions": ["__init__"],
    "NetworkSpec": ["__init__"],
    "OutboundNetworkSpec": ["__init__"],
    "Box": ["id", "name", "start", "stop", "info", "exec", "clone_box", "export"],
    "Execution": ["id", "stdin", "stdout", "stderr", "wait", "kill", "signal", "resize_tty"],
    "ExecStdin": ["send_input", "close", "is_closed"],
    "ExecStdout": ["__aiter__", "__anext__"],
    "ExecStderr": ["__aiter__", "__anext__"],
}
ERRORS = [
    "BoxliteError",
    "NotFoundError",
    "InvalidArgumentError",
    "InvalidStateError",
    "StoppedError",
    "InternalError",
    "UnsupportedError",
    "ConfigError",
    "ExecutionError",
    "AlreadyExistsError",
]


def _real_class(name: str) -> Any:
    return getattr(real, name, None) or getattr(real.boxlite, name)


def _version() -> str:
    import importlib.metadata

    return importlib.metadata.version("boxlite")


def _signature(obj: Any) -> str:
    if isinstance(obj, (property, types.GetSetDescriptorType)):
        return "<attribute>"
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "<no signature>"


def _member(cls: Any, name: str) -> Any:
    if name == "__init__":
        return cls
    return inspect.getattr_static(cls, name)


@pytest.mark.parametrize(("cls", "member"), [(c, m) for c, ms in SURFACE.items() for m in ms])
def test_double_matches_the_installed_wheel(cls: str, member: str) -> None:
    real_cls = _real_class(cls)
    dbl_cls = getattr(double, cls)
    want = _signature(_member(real_cls, member))
    got = _signature(_member(dbl_cls, member))
    assert got == want, f"boxlite {_version()}: {cls}.{member}{want} but the double has {got}: update the double"


def test_the_wheel_is_the_reviewed_one() -> None:
    import importlib.metadata

    version = importlib.metadata.version("boxlite")
    assert version.startswith("0.10."), f"boxlite {version}: re-run the SDK review before moving the pin"


@pytest.mark.parametrize("name", ERRORS)
def test_errors_are_the_real_classes(name: str) -> None:
    cls = getattr(double, name)
    assert cls is getattr(real, name)
    if name != "BoxliteError":
        assert issubclass(cls, RuntimeError)
        assert isinstance(cls.code, str)


# -- same behaviour, real and double ------------------------------------------------------------------
def _open_real(home: Path) -> Any:
    try:
        return real.Boxlite(real.Options(home_dir=str(home)))
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        pytest.skip(f"the real boxlite runtime cannot open on this host: {exc}")


@pytest.fixture(params=["real", "double"])
def sdk(request: pytest.FixtureRequest) -> Any:
    """The real SDK and the double in turn."""
    return real if request.param == "real" else double


@pytest.fixture
def opened(sdk: Any, tmp_path: Path) -> Iterator[Any]:
    home = tmp_path / "home"
    rt = _open_real(home) if sdk is real else sdk.Boxlite(sdk.Options(home_dir=str(home)))
    yield rt
    asyncio.run(_shutdown(rt))


async def _shutdown(rt: Any) -> None:
    await rt.shutdown()


def test_calls_outside_a_loop_need_one(sdk: Any, opened: Any) -> None:
    with pytest.raises(RuntimeError, match="no running event loop"):
        opened.list_info()


def test_relative_home_is_refused(sdk: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if sdk is real:
        skip_unless_real_sdk_opens()  # the SDK checks /dev/kvm before it looks at the home
    monkeypatch.chdir(tmp_path)
    with pytest.raises(sdk.InternalError, match="absolute"):
        sdk.Boxlite(sdk.Options(home_dir="rel"))


def test_one_runtime_per_home_until_handles_are_gone(sdk: Any, tmp_path: Path) -> None:
    home = tmp_path / "home"
    rt = _open_real(home) if sdk is real else sdk.Boxlite(sdk.Options(home_dir=str(home)))

    async def make(runtime: Any) -> Any:
        return await runtime.create(sdk.BoxOptions(image="python:3.11-slim", auto_delete=0), name="held")

    box = asyncio.run(make(rt))
    with pytest.raises(sdk.InternalError, match="Another BoxliteRuntime"):
        sdk.Boxlite(sdk.Options(home_dir=str(home)))
    del rt
    gc.collect()
    with pytest.raises(sdk.InternalError, match="Another BoxliteRuntime"):
        sdk.Boxlite(sdk.Options(home_dir=str(home)))
    del box
    gc.collect()
    sdk.Boxlite(sdk.Options(home_dir=str(home)))
    for lst in (home / ".lock", home / "boxes", home / "db", home / "images" / "layers", home / "logs"):
        assert lst.exists(), lst


def test_records_without_booting(sdk: Any, opened: Any) -> None:
    async def go() -> None:
        box = await opened.create(sdk.BoxOptions(image="python:3.11-slim"), name="pbx-rec-1")
        kept = await opened.create(sdk.BoxOptions(image="python:3.11-slim", auto_delete=False), name="pbx-rec-2")
        assert isinstance(box.id, str) and len(box.id) == 12 and "-" not in box.id
        infos = {i.name: i for i in await opened.list_info()}
        assert infos["pbx-rec-1"].state.status == "configured"
        assert infos["pbx-rec-1"].state.running is False
        assert infos["pbx-rec-1"].auto_delete == 1
        assert infos["pbx-rec-2"].auto_delete == 0
        with pytest.raises(sdk.InvalidArgumentError, match="already exists"):
            await opened.create(sdk.BoxOptions(image="python:3.11-slim"), name="pbx-rec-1")
        with pytest.raises(sdk.NotFoundError, match="not found: nope") as info:
            await opened.remove("nope", force=True)
        assert info.value.code == "not_found"
        await opened.remove("pbx-rec-1", force=True)
        await opened.remove(kept.id, force=True)
        assert await opened.list_info() == []
        await opened.shutdown()
        with pytest.raises(sdk.StoppedError, match="shut down"):
            await opened.create(sdk.BoxOptions(image="python:3.11-slim"), name="late")

    asyncio.run(go())


def test_network_disabled_is_recorded_and_bad_modes_fail_at_create(sdk: Any, opened: Any) -> None:
    async def go() -> None:
        off = sdk.NetworkSpec(outbound=sdk.OutboundNetworkSpec(mode="disabled"))
        await opened.create(sdk.BoxOptions(image="python:3.11-slim", network=off), name="pbx-net")
        (info,) = await opened.list_info()
        assert info.network.outbound.mode == "disabled"
        bad = sdk.NetworkSpec(outbound=sdk.OutboundNetworkSpec(mode="off"))
        with pytest.raises(sdk.InvalidArgumentError):
            await opened.create(sdk.BoxOptions(image="python:3.11-slim", network=bad), name="pbx-bad")

    asyncio.run(go())


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"env": {"A": "1"}}, TypeError),
        ({"env": [["A", "1"]]}, TypeError),
        ({"cpus": 300}, OverflowError),
        ({"volumes": ["/x:/y"]}, RuntimeError),
    ],
)
def test_box_options_checks(sdk: Any, kwargs: dict[str, Any], exc: type[BaseException]) -> None:
    with pytest.raises(exc):
        sdk.BoxOptions(image="python:3.11-slim", **kwargs)


# -- the double's booting semantics --------------------------------------------------------------------
@pytest.fixture
def dbl(tmp_path: Path) -> Iterator[Any]:
    rt = double.Boxlite(double.Options(home_dir=str(tmp_path / "home")))
    yield rt
    asyncio.run(_shutdown(rt))
    double.set_throttle(None)


async def _collect(stream: Any) -> str:
    return "".join([c async for c in stream])


async def _run(box: Any, argv: list[str], cwd: str | None = None, stdin: bytes | None = None) -> tuple[int, str, str]:
    ex = await box.exec(argv[0], argv[1:], None, False, None, None, cwd)
    if stdin is not None:
        s = ex.stdin()
        await s.send_input(stdin)
        await s.close()
    out, err = await asyncio.gather(_collect(ex.stdout()), _collect(ex.stderr()))
    return (await ex.wait()).exit_code, out, err


def _opts(**kw: Any) -> Any:
    return double.BoxOptions(image="python:3.11-slim", auto_delete=0, **kw)


def test_double_exec_semantics(dbl: Any, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()

    async def go() -> None:
        box = await dbl.create(_opts(env=[("BOXV", "b")], volumes=[(str(ro), "/mnt/ro", True)]), name="pbx-sem")
        # exec on a configured box starts it; cwd None is "/"; env merged over the box's
        code, out, _ = await _run(box, ["sh", "-c", "pwd; echo $BOXV; echo $PATH"])
        assert (code, out.splitlines()[:2]) == (0, ["/", "b"])
        assert (await box.info()).state.status == "running"
        code, _, err = await _run(box, ["touch", "/mnt/ro/x"])
        assert code != 0 and "Read-only file system" in err
        # lossy text: invalid bytes become U+FFFD, a code point split across writes survives
        code, out, _ = await _run(box, ["python3", "-c", "import os;os.write(1,b'\\xff\\xc3');os.write(1,b'\\xa9')"])
        assert out == "\ufffd\u00e9"
        code, _, _ = await _run(box, ["sh", "-c", "kill -TERM $$"])
        assert code == -15
        ex = await box.exec("sh", ["-c", "sleep 30 & echo $!; wait"], None, False, None, None, None)
        out_stream = ex.stdout()
        with pytest.raises(RuntimeError, match="stdout stream not available"):
            ex.stdout()
        first = await out_stream.__anext__()
        await ex.kill()
        assert (await ex.wait()).exit_code == -9
        child = first.strip()
        # leader only: the background child lives on
        code, _, _ = await _run(box, ["kill", "-0", child])
        assert code == 0
        await _run(box, ["kill", "-9", child])

    asyncio.run(go())


def test_double_send_input_cap_and_stdin_held_open(dbl: Any) -> None:
    async def go() -> None:
        box = await dbl.create(_opts(), name="pbx-in")
        _, out, _ = await _run(box, ["wc", "-c"], stdin=b"x" * (1 << 20))
        assert out.strip() == str(1 << 20)
        _code, out, _ = await _run(box, ["wc", "-c"], stdin=b"x" * (5 << 20))
        assert out.strip() == "0"  # the oversized message failed the stream: EOF, nothing delivered
        ex = await box.exec("cat", [], None, False, None, None, None)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ex.wait(), 1.0)
        await ex.kill()

    asyncio.run(go())


def test_double_output_ring_drops_with_a_marker_when_the_transport_lags(dbl: Any) -> None:
    async def go() -> None:
        box = await dbl.create(_opts(), name="pbx-ring")
        _, out, _ = await _run(box, ["python3", "-c", "import sys; sys.stdout.write('a' * (3 << 20))"])
        assert out == "a" * (3 << 20)  # full speed: nothing lost
        double.set_throttle(8 << 20)
        _code, out, _ = await _run(box, ["python3", "-c", "import sys; sys.stdout.write('a' * (3 << 20))"])
        assert "[boxlite] stdout output dropped " in out
        assert len(out) < (3 << 20)

    asyncio.run(go())


def test_double_lost_channel_is_minus_one_and_layout(dbl: Any, tmp_path: Path) -> None:
    async def go() -> None:
        box = await dbl.create(_opts(), name="pbx-lost")
        ex = await box.exec("sleep", ["30"], None, False, None, None, None)
        err = ex.stderr()
        start = time.monotonic()
        await dbl.remove("pbx-lost", force=True)
        result = await asyncio.wait_for(ex.wait(), 10)
        assert result.exit_code == -1 and result.error_message is None
        assert "Attach stream error" in await _collect(err)
        assert time.monotonic() - start < 10

    asyncio.run(go())
    home = tmp_path / "home"
    assert list((home / "logs").glob("boxlite.log.*"))
    assert (home / "db" / "registry_contacts").read_text() == "1"


def test_double_box_dir_layout(dbl: Any, tmp_path: Path) -> None:
    async def go() -> str:
        box = await dbl.create(_opts(), name="pbx-lay")
        await box.start()
        return str(box.id)

    bid = asyncio.run(go())
    bdir = tmp_path / "home" / "boxes" / bid
    assert (bdir / "logs" / "console.log").is_file()
    assert (bdir / "shim.stderr").exists()
    assert os.path.isdir(bdir)


def test_double_volume_host_path_checked_at_start(dbl: Any, tmp_path: Path) -> None:
    async def go() -> None:
        box = await dbl.create(_opts(volumes=[(str(tmp_path / "missing"), "/m", True)]), name="pbx-vol")
        with pytest.raises(double.ConfigError, match="Volume host path does not exist"):
            await box.start()

    asyncio.run(go())
