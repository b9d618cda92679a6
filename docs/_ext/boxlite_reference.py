"""Reference tables generated from pytest-boxlite's own code, so the documentation cannot drift.

Directives (usable from MyST markdown as ```` ```{boxlite-options} ```` and from reStructuredText):

- ``boxlite-options``: every option of ``pytest_boxlite.settings.OPTIONS`` (flag, ini key,
  environment variable, default, help text);
- ``boxlite-marker-args``: the ``@pytest.mark.boxlite`` arguments of ``pytest_boxlite.markers.ALLOWED``;
- ``boxlite-fixtures``: every ``@pytest.fixture`` in ``pytest_boxlite/fixtures.py`` with its scope and
  docstring (read with :mod:`ast`: no pytest internals);
- ``boxlite-envvars``: every environment variable the plugin reads or sets;
- ``boxlite-cli``: ``python -m pytest_boxlite --help`` and each sub-command's help.

Where a description cannot come from the code (the marker arguments and the variables that are
no option have no help text there), it lives in this file, and the build fails (a warning under
``-W``) when the code and this file disagree about which names exist.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

# -- inline text: ``code`` and `code` become literals, the rest is plain text --------------------
_CODE = re.compile(r"``(.+?)``|`([^`]+)`")


def _inline(text: str) -> list[nodes.Node]:
    out: list[nodes.Node] = []
    pos = 0
    for m in _CODE.finditer(text):
        if m.start() > pos:
            out.append(nodes.Text(text[pos : m.start()]))
        code = m.group(1) if m.group(1) is not None else m.group(2)
        out.append(nodes.literal(code, code))
        pos = m.end()
    if pos < len(text):
        out.append(nodes.Text(text[pos:]))
    return out


def _para(text: str) -> nodes.paragraph:
    p = nodes.paragraph()
    p.extend(_inline(" ".join(text.split())))
    return p


def _table(headers: list[str], rows: Iterable[list[str]], widths: list[int]) -> nodes.table:
    table = nodes.table(classes=["boxlite-reference"])
    group = nodes.tgroup(cols=len(headers))
    table += group
    for w in widths:
        group += nodes.colspec(colwidth=w)
    head = nodes.thead()
    group += head
    head += _row(headers)
    body = nodes.tbody()
    group += body
    for r in rows:
        body += _row(r)
    return table


def _row(cells: list[str]) -> nodes.row:
    row = nodes.row()
    for text in cells:
        entry = nodes.entry()
        entry += _para(text)
        row += entry
    return row


# -- options ---------------------------------------------------------------------------------------


def _default_text(default: Callable[[], Any]) -> str:
    """A default as users read it (``code`` marked): a named function's documented value, else the value."""
    if getattr(default, "__name__", "<lambda>") != "<lambda>":
        # default_image / default_home: their docstring starts with the value, then ": why".
        doc = inspect.getdoc(default) or f"``{default.__name__}()``"
        return doc.split(": ", 1)[0]
    return f"``{_value_text(default())}``"


def _value_text(value: Any) -> str:
    """A default as ``--help`` shows it (``settings.default_text``), or ``unset``."""
    from pytest_boxlite.settings import default_text

    return "unset" if value is None else default_text(value)


class OptionsDirective(SphinxDirective):
    """Every option: its flag as a term, then its meaning, ini key, environment variable and default.

    A definition list, not a five-column table: a table that wide hid its default and meaning
    columns behind a horizontal scroll and broke flags mid-word."""

    def run(self) -> list[nodes.Node]:
        from pytest_boxlite.settings import OPTIONS

        items = nodes.definition_list(classes=["boxlite-options"])
        for opt in OPTIONS:
            item = nodes.definition_list_item()
            term = nodes.term()
            flag = opt.flag if opt.flag_only else f"{opt.flag}={opt.metavar}"
            term += nodes.literal(flag, flag)
            item += term
            body = nodes.definition()
            meaning = opt.help
            if opt.flag_only:
                meaning += " (a flag; the ini key and the variable take 1/0, true/false, yes/no, on/off)"
            body += _para(meaning)
            where = f"ini key ``{opt.ini}``; environment variable ``{opt.env}``"
            if "(default" not in opt.help:  # else the meaning says it, better than a bare value
                where += f"; default: {_default_text(opt.default)}"
            body += _para(where)
            item += body
            items += item
        return [items]


# -- marker arguments ------------------------------------------------------------------------------

#: What each ``@pytest.mark.boxlite`` argument does; its accepted values are checked in markers.py.
MARKER_ARGS = {
    "image": ("str", "OCI image of the test's box (``--boxlite-image`` for this test); used by the ``vm`` runtime"),
    "cpus": ("int >= 1", "vCPUs of the test's box"),
    "memory": ("int >= 64", "memory of the test's box in MiB"),
    "env": (
        "dict[str, str]",
        "variables added to the test's environment in the box (never removed by ``--boxlite-env-deny``)",
    ),
    "network": ("bool", "``True``: network inside the test's box (``--boxlite-network=on`` for this test)"),
    "timeout": ("float > 0", "bound on the whole boxed test in seconds (default ``--boxlite-timeout``)"),
    "user": ("str", "who runs the test in its box: a name or ``uid[:gid]`` (default: the host user's ids)"),
    "side_effects": (
        "'off', 'report', 'fail'",
        "``--boxlite-side-effects`` for this test: list (or fail on) what it leaves behind",
    ),
}


class MarkerArgsDirective(SphinxDirective):
    """The marker's keyword arguments, in the order markers.ALLOWED lists them."""

    def run(self) -> list[nodes.Node]:
        from pytest_boxlite.markers import ALLOWED

        out: list[nodes.Node] = []
        if set(ALLOWED) != set(MARKER_ARGS):
            out.append(
                self.state.document.reporter.warning(
                    f"boxlite-marker-args: markers.ALLOWED {sorted(ALLOWED)} and docs/_ext MARKER_ARGS "
                    f"{sorted(MARKER_ARGS)} differ: describe each marker argument there",
                    line=self.lineno,
                )
            )
        rows = [
            [f"``{name}=``", f"``{MARKER_ARGS.get(name, ('?', ''))[0]}``", MARKER_ARGS.get(name, ("", "?"))[1]]
            for name in ALLOWED
        ]
        out.append(_table(["argument", "type", "meaning"], rows, [14, 16, 60]))
        return out


# -- fixtures --------------------------------------------------------------------------------------


def _fixtures(source: str) -> list[tuple[str, str, str]]:
    """``(name, scope, docstring)`` of each ``@pytest.fixture``-decorated function in ``source``."""
    found = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            call = dec if isinstance(dec, ast.Call) else None
            target = call.func if call is not None else dec
            if ast.unparse(target) not in ("pytest.fixture", "fixture"):
                continue
            scope = "function"
            for kw in call.keywords if call is not None else ():
                if kw.arg == "scope" and isinstance(kw.value, ast.Constant):
                    scope = str(kw.value.value)
            found.append((node.name, scope, ast.get_docstring(node) or ""))
    return found


class FixturesDirective(SphinxDirective):
    """Every public fixture, its scope and its docstring."""

    def run(self) -> list[nodes.Node]:
        import pytest_boxlite.fixtures as mod

        path = Path(mod.__file__ or "")
        self.env.note_dependency(str(path))
        items = nodes.definition_list()
        for name, scope, doc in _fixtures(path.read_text()):
            item = nodes.definition_list_item()
            term = nodes.term()
            term += nodes.literal(name, name)
            term += nodes.Text(f" (scope: {scope})")
            item += term
            body = nodes.definition()
            for chunk in re.split(r"\n\s*\n", doc):
                if chunk.strip():
                    body += _para(chunk)
            item += body
            items += item
        return [items]


# -- environment variables -------------------------------------------------------------------------


def _extra_envvars() -> list[tuple[str, str]]:
    """Variables that are no option, each checked against the constant the code uses."""
    from pytest_boxlite.images import store
    from pytest_boxlite.runtimes import rest
    from pytest_boxlite.spec import GUEST_ENV, ROLE_ENV

    return [
        (
            rest.API_KEY_ENV,
            "read: the API key of the ``--boxlite-url`` server (or ``--boxlite-credential-file``); "
            "removed from the environment boxed tests see",
        ),
        (
            rest.LEASE_ENV,
            "read: seconds a remote box may sit unused before its server stops it (its lease, "
            f"renewed by a live session; default {rest.DEFAULT_LEASE})",
        ),
        ("XDG_CACHE_HOME", "read: the default ``--boxlite-home`` is ``$XDG_CACHE_HOME/pytest-boxlite``"),
        (
            store.MAX_IMAGE_ENV,
            f"read: bytes of file data one image may unpack to (default {store.DEFAULT_MAX_UNPACKED >> 30} GiB; "
            "``16G``); see how-to/images",
        ),
        (
            store.MAX_RATIO_ENV,
            f"read: the compression ratio a layer and an image may unpack at (default {store.DEFAULT_MAX_RATIO}:1, "
            f"never below {store.RATIO_FLOOR >> 20} MiB)",
        ),
        (
            store.MAX_STORE_ENV,
            f"read: bytes on disk the image store keeps (default {store.DEFAULT_MAX_STORE >> 30} GiB; least "
            "recently used images no session holds are evicted)",
        ),
        (
            store.EXPIRY_ENV,
            f"read: days an unused image stays in the image store (default {store.DEFAULT_EXPIRY_DAYS:g}; 0: "
            "until the store is full)",
        ),
        (
            GUEST_ENV,
            "set to ``1`` in a box, for its tests and what they start: they run in a box. It gives no "
            "pytest a role: a pytest that a boxed test starts itself (a subprocess, pytester) runs as it would unboxed",
        ),
        (
            ROLE_ENV,
            "set for a box's own pytest alone, which takes it out of its environment at its start "
            "(nothing it starts inherits it): that pytest stays passive, the host does the boxing",
        ),
        ("BOXLITE_BOX", "set in ``boxlite_sandbox`` commands on the namespace runtime: the box's name"),
        ("BOXLITE_RUNTIME", "set in ``boxlite_sandbox`` commands on the namespace runtime: ``namespace``"),
    ]


class EnvvarsDirective(SphinxDirective):
    """Every environment variable: the options' and the others."""

    def run(self) -> list[nodes.Node]:
        from pytest_boxlite.settings import OPTIONS

        rows = [[f"``{o.env}``", f"read: the value of ``{o.flag}`` (see the options table)"] for o in OPTIONS]
        rows += [[f"``{name}``", text] for name, text in _extra_envvars()]
        return [_table(["variable", "meaning"], rows, [30, 60])]


# -- command line ----------------------------------------------------------------------------------


def _help(argv: list[str]) -> str:
    from pytest_boxlite.__main__ import main

    buf = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: a fixed width keeps the page stable
    try:
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            main(argv)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return buf.getvalue().rstrip()


class CliDirective(SphinxDirective):
    """``python -m pytest_boxlite --help`` and each sub-command's ``--help``."""

    def run(self) -> list[nodes.Node]:
        top = _help(["--help"])
        m = re.search(r"\{([a-z,]+)\}", top)
        subs = m.group(1).split(",") if m else []
        out: list[nodes.Node] = [nodes.literal_block(top, top, language="text")]
        for sub in subs:
            text = _help([sub, "--help"])
            section = nodes.rubric(text=f"python -m pytest_boxlite {sub}")
            out += [section, nodes.literal_block(text, text, language="text")]
        return out


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("boxlite-options", OptionsDirective)
    app.add_directive("boxlite-marker-args", MarkerArgsDirective)
    app.add_directive("boxlite-fixtures", FixturesDirective)
    app.add_directive("boxlite-envvars", EnvvarsDirective)
    app.add_directive("boxlite-cli", CliDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
