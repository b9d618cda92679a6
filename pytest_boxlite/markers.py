"""Strict parsing of ``@pytest.mark.boxlite(...)`` into a :class:`BoxPlan`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.session import BoxliteSession
from pytest_boxlite.spec import BoxSpec

ALLOWED = ("image", "cpus", "memory", "env", "network", "timeout", "user")


@dataclasses.dataclass(frozen=True)
class BoxPlan:
    """How one item runs in a box: the box spec and the bound on the whole test."""

    spec: BoxSpec
    timeout: float


def _bad(item: pytest.Item, msg: str) -> pytest.UsageError:
    return pytest.UsageError(f"{item.nodeid}: @pytest.mark.boxlite: {msg}")


def _check(item: pytest.Item, kwargs: Mapping[str, Any]) -> None:
    for key, value in kwargs.items():
        if key == "image" and not (isinstance(value, str) and value.strip()):
            raise _bad(item, f"image must be a non-empty string, got {value!r}")
        if key == "cpus" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise _bad(item, f"cpus must be a positive integer, got {value!r}")
        if key == "memory" and (isinstance(value, bool) or not isinstance(value, int) or value < 64):
            raise _bad(item, f"memory must be an integer number of MiB >= 64, got {value!r}")
        if key == "network" and not isinstance(value, bool):
            raise _bad(item, f"network must be True or False, got {value!r}")
        if key == "env" and not (
            isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
        ):
            raise _bad(item, f"env must be a dict of str to str, got {value!r}")
        if key == "user" and not (isinstance(value, str) and value.strip()):
            raise _bad(item, f"user must be a name or 'uid[:gid]' string, got {value!r}")
        if key == "timeout" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise _bad(item, f"timeout must be a positive number of seconds, got {value!r}")


def plan_for(item: pytest.Item, session: BoxliteSession) -> BoxPlan | None:
    """The item's plan, or ``None`` when it runs locally.  Bad marker arguments raise ``UsageError``."""
    marker = item.get_closest_marker("boxlite")
    if marker is None and not session.settings.all:
        return None
    kwargs: dict[str, Any] = dict(marker.kwargs) if marker is not None else {}
    if marker is not None and marker.args:
        raise _bad(item, f"takes keyword arguments only ({', '.join(ALLOWED)}), got positional {marker.args!r}")
    unknown = sorted(set(kwargs) - set(ALLOWED))
    if unknown:
        raise _bad(item, f"unknown argument(s) {', '.join(unknown)}; allowed: {', '.join(ALLOWED)}")
    _check(item, kwargs)
    timeout = float(kwargs.pop("timeout", session.settings.timeout))
    env = kwargs.pop("env", None)
    try:
        spec = session.spec_for(
            **kwargs, env=tuple(env.items()) if env else None, worker=True, mounts=session.worker_mounts
        )
    except BoxliteError as exc:
        raise _bad(item, str(exc)) from None
    return BoxPlan(spec, timeout)
