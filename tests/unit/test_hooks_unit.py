"""The hookspecs' plumbing (``pytest_boxlite/hooks.py``), on a plugin manager of its own.

A real ``PytestPluginManager`` with the package's hookspecs, and plugin objects of the test's
making; the config handed to the host's callers is a stand-in holding only that manager's
``hook`` (the callers read nothing else of it), so nothing is registered with this session's own
pytest.  The boxed path through these hooks, in real boxes, is ``tests/test_hooks.py``.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from pytest_boxlite import hooks, services
from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.hooks import BoxAccess
from pytest_boxlite.remote.worker_host import _first_problem, _service_fields


@pytest.fixture
def manager() -> pytest.PytestPluginManager:
    pm = pytest.PytestPluginManager()
    pm.add_hookspecs(hooks)
    return pm


def config_of(pm: pytest.PytestPluginManager) -> Any:
    return types.SimpleNamespace(hook=pm.hook)


class Fields:
    def __init__(self, result: object) -> None:
        self.result = result

    def pytest_boxlite_box_fields(self, config: Any, item: Any, nodeid: str, wide_only: bool) -> object:
        return self.result


class Reach:
    def __init__(self, why: str | None) -> None:
        self.why = why
        self.boxes: list[BoxAccess] = []

    def pytest_boxlite_reach(self, config: Any, box: BoxAccess, item: Any, nodeid: str, wide_only: bool) -> str | None:
        self.boxes.append(box)
        return self.why


def test_a_joined_plugin_is_registered_once_with_each_manager(
    manager: pytest.PytestPluginManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hooks, "_joining", [])
    hooks.enrol(manager)  # nothing joined: nothing happens
    plugin = Fields({"a": 1})
    hooks.join(plugin)
    hooks.join(plugin)
    assert hooks.joined() == [plugin]
    other = pytest.PytestPluginManager()
    other.add_hookspecs(hooks)
    for pm in (manager, other, manager):  # a second enrol of one manager registers nothing twice
        hooks.enrol(pm)
    assert manager.is_registered(plugin) and other.is_registered(plugin)
    assert manager.hook.pytest_boxlite_box_fields(config=None, item=None, nodeid="t", wide_only=False) == [{"a": 1}]


def test_every_plugins_fields_are_merged(manager: pytest.PytestPluginManager) -> None:
    manager.register(Fields({"a": 1}))
    manager.register(Fields(None))
    manager.register(Fields({"b": [2]}))
    assert _service_fields(config_of(manager), nodeid="t.py::x") == {"a": 1, "b": [2]}


@pytest.mark.parametrize(
    ("results", "error"),
    [
        ([["not", "a", "dict"]], "a pytest_boxlite_box_fields hook returned ['not', 'a', 'dict'], not a dict"),
        ([{1: "int key"}], "a pytest_boxlite_box_fields hook returned {1: 'int key'}, not a dict with str keys"),
        ([{"a": 1, "b": 2}, {"b": 3, "a": 4}], "two pytest_boxlite_box_fields hooks returned the field(s) a, b"),
    ],
)
def test_a_malformed_or_clashing_result_is_an_error_naming_the_hook(
    manager: pytest.PytestPluginManager, results: list[object], error: str
) -> None:
    for result in results:
        manager.register(Fields(result))
    with pytest.raises(BoxliteError) as info:
        _service_fields(config_of(manager), nodeid="t.py::x")
    assert error in str(info.value)


def test_the_first_reason_a_box_cannot_reach_is_the_tests_failure(manager: pytest.PytestPluginManager) -> None:
    fine, broken = Reach(None), Reach("the relay would not start")
    manager.register(fine)
    assert _first_problem(config_of(manager), BoxAccess("b.1", 42), None, "t.py::x", wide_only=False) is None
    manager.register(broken)
    why = _first_problem(config_of(manager), BoxAccess("b.1", 42), None, "t.py::x", wide_only=True)
    assert why == "the relay would not start"
    assert [b.name for b in broken.boxes] == ["b.1"] and fine.boxes[0] == BoxAccess("b.1", 42, None)


def test_services_take_only_a_mapping_of_descriptions_in_the_box(monkeypatch: pytest.MonkeyPatch) -> None:
    """The box's side: what the host described replaces the last item's; anything that is not a
    mapping (the box's bytes came from the host, but are parsed as hostile all the same) is none."""
    monkeypatch.setattr(services, "_RECEIVED", {})
    services.HOOKS.pytest_boxlite_box_received(None, {"services": {"web": {"ports": {}}, 3: "x", "bad": []}})  # type: ignore[arg-type]
    assert services._RECEIVED == {"web": {"ports": {}}}
    services.HOOKS.pytest_boxlite_box_received(None, {"services": ["not", "a", "mapping"]})  # type: ignore[arg-type]
    assert services._RECEIVED == {}
