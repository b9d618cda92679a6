"""``--boxlite-env-deny``: which host variables boxed tests see (real sub-runs, namespace runtime)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)

PROBE = """
import os
import pytest


@pytest.mark.boxlite
def test_probe(record_property):
    for name in ("FAKE_SECRET_TOKEN", "PBX_PLAIN_VALUE", "PBX_DB_PASSWORD"):
        record_property(name, os.environ.get(name, "<absent>"))
"""


def _seen(pytester: pytest.Pytester, *args: str) -> dict[str, str]:
    import xml.etree.ElementTree as ET

    pytester.makepyfile(test_probe=PROBE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--junitxml=out.xml", *args)
    result.assert_outcomes(passed=1)
    props = ET.parse(pytester.path / "out.xml").iter("property")
    return {p.get("name", ""): p.get("value", "") for p in props}


@pytest.fixture(autouse=True)
def host_env(monkeypatch: pytest.MonkeyPatch, home: object) -> None:
    monkeypatch.setenv("FAKE_SECRET_TOKEN", "s3cr3t-from-the-host")
    monkeypatch.setenv("PBX_PLAIN_VALUE", "plain")
    monkeypatch.setenv("PBX_DB_PASSWORD", "hunter2")


@pytest.mark.escape_row("host-environment")
def test_default_hides_credential_names_and_keeps_the_rest(pytester: pytest.Pytester) -> None:
    seen = _seen(pytester)
    assert seen["FAKE_SECRET_TOKEN"] == "<absent>"
    assert seen["PBX_DB_PASSWORD"] == "<absent>"
    assert seen["PBX_PLAIN_VALUE"] == "plain"


def test_none_gives_the_whole_host_environment(pytester: pytest.Pytester) -> None:
    seen = _seen(pytester, "--boxlite-env-deny=none")
    assert seen["FAKE_SECRET_TOKEN"] == "s3cr3t-from-the-host"
    assert seen["PBX_DB_PASSWORD"] == "hunter2"


@pytest.mark.escape_row("host-environment")
def test_own_patterns_from_ini_and_environment(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\nboxlite_env_deny = pbx_plain_*\n")
    seen = _seen(pytester)
    assert seen["PBX_PLAIN_VALUE"] == "<absent>"  # case-insensitive
    assert seen["FAKE_SECRET_TOKEN"] == "s3cr3t-from-the-host"  # the ini replaced the default list
    monkeypatch.setenv("PYTEST_BOXLITE_ENV_DENY", "*PASSWORD*")
    seen = _seen(pytester)  # the environment variable wins over the ini key
    assert seen["PBX_DB_PASSWORD"] == "<absent>"
    assert seen["PBX_PLAIN_VALUE"] == "plain"
