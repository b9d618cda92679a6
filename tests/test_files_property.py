"""Property tests of the file contract on one namespace box.

Hypothesis and function-scoped fixtures do not mix, so one module-scoped box
serves every example; each example works in a directory of its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from conftest import new_box_name
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_boxlite.runtimes import Runtime
from pytest_boxlite.sandbox import Sandbox
from pytest_boxlite.spec import BoxSpec

pytestmark = pytest.mark.timeout(120)

PROPS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_seq = itertools.count()


@pytest.fixture(scope="module")
def box(namespace_runtime: Runtime) -> Iterator[Sandbox]:
    """One namespace box shared by every example of this module, destroyed at module end."""
    handle = namespace_runtime.create_box(BoxSpec(), new_box_name(), timeout=30)
    try:
        yield Sandbox(handle, default_timeout=30)
    finally:
        handle.destroy()


def fresh_dir(box: Sandbox) -> str:
    """An absolute guest directory no other example uses."""
    return f"{box.workdir}/ex{next(_seq)}"


# Valid single path components: no '/', no NUL, no surrogates, not '.' or '..'.
# Kept at most 200 bytes in UTF-8: names of 201..255 bytes are valid too, but a
# known bug rejects long multi-byte ones (see test_contract.py::test_longest_file_names).
file_names = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="/\0"),
    min_size=1,
    max_size=100,
).filter(lambda s: s not in (".", "..") and len(s.encode()) <= 200)


@PROPS
@given(data=st.binary(max_size=1 << 16))
def test_bytes_round_trip(box: Sandbox, data: bytes) -> None:
    path = f"{fresh_dir(box)}/blob.bin"
    box.write_bytes(path, data)
    assert box.read_bytes(path) == data


@PROPS
@given(name=file_names)
def test_any_valid_file_name(box: Sandbox, name: str) -> None:
    d = fresh_dir(box)
    full = f"{d}/{name}"
    box.write_file(full, name)
    assert box.list_dir(d) == [full]
    assert box.glob(d, "*").items == [full]
    assert box.read_file(full) == name


@PROPS
@given(text=st.text(max_size=2000))
def test_text_round_trip(box: Sandbox, text: str) -> None:
    path = f"{fresh_dir(box)}/t.txt"
    box.write_file(path, text)
    assert box.read_file(path) == text


@PROPS
@given(
    lines=st.lists(
        st.text(alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\r\n"), max_size=20),
        max_size=20,
    ),
    start=st.integers(min_value=1, max_value=25),
    length=st.integers(min_value=0, max_value=25),
)
def test_read_file_line_slices(box: Sandbox, lines: list[str], start: int, length: int) -> None:
    # Only '\n' separates lines here; characters str.splitlines() also treats as
    # line ends are kept out (they are a separate, known disagreement).
    lines = [ln for ln in lines if len(ln.splitlines()) <= 1]
    text = "".join(ln + "\n" for ln in lines)
    path = f"{fresh_dir(box)}/lines.txt"
    box.write_file(path, text)
    end = start + length
    assert box.read_file(path, start_line=start, end_line=end) == "".join(ln + "\n" for ln in lines[start - 1 : end])
