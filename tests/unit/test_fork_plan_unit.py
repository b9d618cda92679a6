"""Unit layer: when a zygote's plan serves a box made now (pure data, no box)."""

from __future__ import annotations

from pytest_boxlite.runtimes.namespace.zygote import ForkPlan


def test_a_plan_serves_while_it_hides_at_least_what_is_hidden_now() -> None:
    then = ForkPlan(layout=("/usr", "/home"), hidden=frozenset({"d:/home/u/.ssh", "d:/var/tmp/h1"}))
    assert then.serves(then)
    # A home that ended: less to hide now, the zygote still serves.
    assert then.serves(ForkPlan(layout=("/usr", "/home"), hidden=frozenset({"d:/home/u/.ssh"})))
    # A new credential or home: the zygote does not hide it, a new one is booted.
    assert not then.serves(
        ForkPlan(layout=("/usr", "/home"), hidden=frozenset({"d:/home/u/.ssh", "d:/var/tmp/h1", "f:/home/u/.netrc"}))
    )
    # Another layout (a directory overlaid or shown differently): never served.
    assert not then.serves(ForkPlan(layout=("/usr",), hidden=frozenset()))
    # A file and a directory at one path are different masks.
    assert not ForkPlan(layout=(), hidden=frozenset({"d:/x"})).serves(ForkPlan(layout=(), hidden=frozenset({"f:/x"})))
