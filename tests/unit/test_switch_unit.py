"""Unit tests of :class:`pytest_boxlite._switch.SwitchInterval` (this interpreter's own interval,
given back after each test).  The whole-session behaviour is tested by
``tests/test_fidelity_misc.py::test_host_threads_switch_fast_but_host_tests_see_the_users_interval``."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from pytest_boxlite._switch import FAST, SwitchInterval


@pytest.fixture(autouse=True)
def users_interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(before)


def test_lower_then_restore_gives_the_found_value_back() -> None:
    s = SwitchInterval()
    s.lower()
    assert sys.getswitchinterval() == pytest.approx(FAST)
    assert s.lowered()
    s.lower()  # twice: still the value found first is given back
    s.restore()
    assert sys.getswitchinterval() == 0.005
    assert not s.lowered()
    s.restore()  # nothing to give back: no change
    assert sys.getswitchinterval() == 0.005


def test_a_value_set_in_between_is_kept() -> None:
    s = SwitchInterval()
    s.lower()
    sys.setswitchinterval(0.002)  # a conftest, a test, another plugin
    assert not s.lowered()
    s.restore()
    assert sys.getswitchinterval() == 0.002
    s.lower()  # and lowered again, it is that value that comes back
    s.restore()
    assert sys.getswitchinterval() == 0.002


def test_an_interval_already_shorter_is_left_alone() -> None:
    sys.setswitchinterval(FAST / 5)
    s = SwitchInterval()
    s.lower()
    assert sys.getswitchinterval() == pytest.approx(FAST / 5)
    assert not s.lowered()
    s.restore()
    assert sys.getswitchinterval() == pytest.approx(FAST / 5)
