"""The package's structure, checked from its source: layers, import cycles and the runtime boundary.

Every module of ``pytest_boxlite`` is parsed (``ast``, nothing is imported) and checked against
three rules:

1. **No import cycle.** Run-time imports (module level and lazy imports inside functions) must
   form no cycle; imports under ``if TYPE_CHECKING:`` are checked separately, together with the
   run-time ones, and listed in the failure message.
2. **No upward import.** :data:`LAYERS` lists the layers from the top (entry points) to the
   bottom (errors); a module may import from its own layer or any layer below, never above.
   A module that is in no layer fails the test: place it in :data:`LAYERS`.
3. **Runtime-specific code stays in ``runtimes/``.** Outside ``pytest_boxlite/runtimes/``, no
   module may name a runtime kind (a ``"namespace"`` or ``"vm"`` string other than a
   docstring: comparisons with ``choice.kind``, on-disk layouts such as ``home / "vm"``), import
   a concrete runtime module (``runtimes.namespace``, ``runtimes.vm``), use ``isinstance`` on a
   runtime's class, or import a runtime's private name (``_cgroups``, ``_alive``, ...).

The violations that exist today are listed, each with its reason, in :data:`ALLOWED`. That list
may only shrink: the test fails on any violation not in it, and on any entry of it that no
longer occurs (delete the entry: the list stays honest). Guest scripts (``guest/``) are checked
too: they run in a box without the package, so they may import only each other.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import fnmatch
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "pytest_boxlite"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

#: The layers, top first. Names are relative to the package ("" is its ``__init__``); a pattern
#: may end in ``.*`` for a sub-package's modules. A module may import from its own layer or a
#: lower one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "entry points: pytest hooks, the CLI, the public API, processes run by name",
        ("", "__main__", "plugin", "roles", "boxproc", "session_in_box", "selftest"),
    ),
    (
        "pytest glue: fixtures, boxed-test execution, xdist, the terminal report",
        (
            "fixtures",
            "services",
            "remote",
            "remote.*",
            "reporting",
            "side_effects",
            "xdist_support",
            "xdist_guard",
            "hooks",
        ),
    ),
    (
        "test plans: markers to box specs, the marker's registration, the look-ahead over the run order",
        ("markers", "marker_registration", "lookahead"),
    ),
    ("the per-process session", ("session",)),
    ("the warm pool, provisioning and leftover bookkeeping", ("pool", "templates", "ledger", "service_ledger")),
    ("the box API and settings", ("sandbox", "settings", "process", "publish", "reach", "box_changes")),
    ("runtime choice", ("runtimes",)),
    ("the runtimes", ("runtimes.namespace", "runtimes.namespace.*", "runtimes.vm", "runtimes.vm.*", "runtimes.rest")),
    ("runtime parts: protocol, host probe, private helpers", ("runtimes.base", "runtimes.probe", "runtimes._*")),
    ("images: references, the image store and its unpacker", ("images", "images.*")),
    ("shared vocabulary: box specs; guest scripts and their loader", ("spec", "guest", "guest.*")),
    (
        "errors, the home as a trust boundary, removing the host's own directories, the host's switch interval, "
        "escaping printed text",
        ("errors", "_tidy", "_homefs", "_switch", "_shown"),
    ),
]

#: Runtime kinds: naming one outside runtimes/ ties that code to a runtime.
KINDS = frozenset({"namespace", "vm"})
#: Concrete runtime modules (relative names, as patterns).
CONCRETE_RUNTIMES = ("runtimes.namespace", "runtimes.namespace.*", "runtimes.vm", "runtimes.vm.*", "runtimes.rest")

#: Violations that exist today, as ``(rule, module, where, what)`` with their count. Fix one,
#: then delete its line here. ``where`` is the enclosing function or class (``<module>`` at the
#: top level). Issue 10 moved the rest of the runtime boundary into ``runtimes/`` (see
#: shared/reviews/architecture-review.md, change 1): what is left is on purpose.
ALLOWED: collections.Counter[tuple[str, str, str, str]] = collections.Counter(
    {
        # --- selftest.py (doctor --selftest) boots the vm runtime on purpose: it checks that runtime.
        ("concrete-runtime-import", "selftest", "<module>", "runtimes.vm"): 3,
        # --- plugin.py's stand-in host role (LazyHost) tells whether the home holds a dead session's
        # state by the names of its state directories, without importing the runtimes package
        # (~10 ms): a run that boxes nothing must stay cheap (issue 26).
        ("kind-literal", "plugin", "<module>", "namespace"): 1,
        ("kind-literal", "plugin", "<module>", "vm"): 1,
        ("kind-literal", "plugin", "_has_state", "namespace"): 1,
    }
)


@dataclasses.dataclass(frozen=True)
class Import:
    """One import of a package module by another."""

    source: str  # relative module names ("" for the package itself)
    target: str
    name: str | None  # the imported name, for ``from m import name`` where ``name`` is no module
    where: str
    type_only: bool
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
TREES: dict[str, ast.Module] = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}


def relative(absolute: str) -> str | None:
    """``pytest_boxlite.x.y`` -> ``x.y`` (``""`` for the package); None outside the package."""
    if absolute == PACKAGE:
        return ""
    if absolute.startswith(PACKAGE + "."):
        return absolute[len(PACKAGE) + 1 :]
    return None


def nearest_module(name: str) -> str:
    """The module a dotted name lives in: itself, or its closest parent that is a module."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def walk(tree: ast.AST) -> Iterator[tuple[ast.AST, str, bool]]:
    """Every node with its enclosing function/class qualname and whether it is under TYPE_CHECKING."""

    def visit(node: ast.AST, where: list[str], type_only: bool) -> Iterator[tuple[ast.AST, str, bool]]:
        for child in ast.iter_child_nodes(node):
            yield child, ".".join(where) or "<module>", type_only
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from visit(child, [*where, child.name], type_only)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield stmt, ".".join(where) or "<module>", True
                    yield from visit(stmt, where, True)
                for stmt in child.orelse:
                    yield stmt, ".".join(where) or "<module>", type_only
                    yield from visit(stmt, where, type_only)
            else:
                yield from visit(child, where, type_only)

    yield from visit(tree, [], False)


def imports_of(source: str) -> list[Import]:
    out: list[Import] = []
    is_package = MODULES[source].name == "__init__.py"
    for node, where, type_only in walk(TREES[source]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                rel = relative(alias.name)
                if rel is not None:
                    out.append(Import(source, nearest_module(rel), None, where, type_only, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = source.split(".") if source else []
                if not is_package:
                    base_parts = base_parts[:-1]
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                rel_base = relative(node.module or "")
                if rel_base is None:
                    continue
                base = rel_base
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                if sub in MODULES:
                    out.append(Import(source, sub, None, where, type_only, node.lineno))
                else:
                    out.append(Import(source, nearest_module(base), alias.name, where, type_only, node.lineno))
    return [i for i in out if i.target != source]


IMPORTS: list[Import] = [i for m in MODULES for i in imports_of(m)]


def layer_of(module: str) -> int | None:
    found = [i for i, (_, patterns) in enumerate(LAYERS) if any(fnmatch.fnmatchcase(module, p) for p in patterns)]
    assert len(found) <= 1, f"module {module!r} matches more than one layer: {found}"
    return found[0] if found else None


def in_runtimes(module: str) -> bool:
    return module == "runtimes" or module.startswith("runtimes.")


def is_concrete_runtime(module: str) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in CONCRETE_RUNTIMES)


def shown(module: str) -> str:
    return module or "pytest_boxlite (the package)"


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(MODULES):
        if v not in index:
            strongconnect(v)
    return found


def boundary_violations() -> collections.Counter[tuple[str, str, str, str]]:
    """Rule 3, for every module outside runtimes/."""
    found: collections.Counter[tuple[str, str, str, str]] = collections.Counter()
    for imp in IMPORTS:
        if in_runtimes(imp.source) or not in_runtimes(imp.target):
            continue
        names = [*imp.target.split("."), *([imp.name] if imp.name else [])]
        if any(part.startswith("_") for part in names):
            detail = ".".join(names)
            found["private-import", imp.source, imp.where, detail] += 1
        elif is_concrete_runtime(imp.target):
            found["concrete-runtime-import", imp.source, imp.where, imp.target] += 1
    for module, tree in TREES.items():
        if in_runtimes(module):
            continue
        runtime_classes = {
            alias.asname or alias.name
            for imp_node, _, _ in walk(tree)
            if isinstance(imp_node, ast.ImportFrom) and imp_node.module
            for rel in [relative(imp_node.module)]
            if rel is not None and is_concrete_runtime(rel)
            for alias in imp_node.names
        }
        docstrings = {
            id(body[0].value)
            for node in [tree, *ast.walk(tree)]
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            for body in [node.body]
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        }
        for node, where, _ in walk(tree):
            if isinstance(node, ast.Constant) and node.value in KINDS and id(node) not in docstrings:
                found["kind-literal", module, where, node.value] += 1
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2
            ):
                classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                for cls in classes:
                    name = cls.id if isinstance(cls, ast.Name) else cls.attr if isinstance(cls, ast.Attribute) else ""
                    if name in runtime_classes:
                        found["isinstance-runtime", module, where, name] += 1
    return found


def describe(entries: collections.Counter[tuple[str, str, str, str]]) -> str:
    return "\n".join(f"  {key!r}: {n}," for key, n in sorted(entries.items()))


# -- the tests ---------------------------------------------------------------------------------


def test_the_parser_sees_the_package() -> None:
    """Guards the checks below against passing vacuously (no modules found, no imports parsed)."""
    assert {"", "plugin", "pool", "session", "errors", "runtimes.base"} <= set(MODULES)
    assert Import("pool", "sandbox", "Sandbox", "<module>", False, 0) in [
        dataclasses.replace(i, line=0) for i in IMPORTS
    ]
    assert any(i.where != "<module>" for i in IMPORTS), "lazy imports inside functions were not seen"


def test_every_module_is_in_a_layer() -> None:
    missing = sorted(shown(m) for m in MODULES if layer_of(m) is None)
    assert missing == [], f"modules in no layer of tests/test_layering.py LAYERS (add them): {missing}"


def test_no_run_time_import_cycle() -> None:
    edges = {(i.source, i.target) for i in IMPORTS if not i.type_only}
    found = cycles(edges)
    assert found == [], "import cycles (run-time imports): " + "; ".join(
        " <-> ".join(shown(m) for m in c) for c in found
    )


def test_no_cycle_even_with_type_only_imports() -> None:
    """``if TYPE_CHECKING:`` imports do not run, but a cycle through one is still a layering knot."""
    type_only = sorted({(i.source, i.target) for i in IMPORTS if i.type_only})
    found = cycles({(i.source, i.target) for i in IMPORTS})
    listing = ", ".join(f"{shown(a)} -> {shown(b)}" for a, b in type_only) or "none"
    assert found == [], f"import cycles through type-only imports ({listing}): {found}"


def test_no_import_from_a_higher_layer() -> None:
    upward = []
    for i in IMPORTS:
        src, dst = layer_of(i.source), layer_of(i.target)
        if src is not None and dst is not None and dst < src:
            kind = "type-only import" if i.type_only else "import"
            upward.append(
                f"{shown(i.source)} (layer {src}: {LAYERS[src][0]}) line {i.line}: {kind} of {shown(i.target)} "
                f"(layer {dst}: {LAYERS[dst][0]})"
            )
    assert upward == [], "imports from a higher layer:\n" + "\n".join(upward)


def test_guest_scripts_import_nothing_of_the_package_but_each_other() -> None:
    """Guest scripts run in a box, under ``python -I -S`` or execnet, where the package is absent."""
    bad = [
        f"{i.source} line {i.line} imports {shown(i.target)}"
        for i in IMPORTS
        if i.source.startswith("guest") and not (i.target == "guest" or i.target.startswith("guest."))
    ]
    assert bad == []


def test_runtime_specific_code_stays_in_runtimes() -> None:
    found = boundary_violations()
    new = found - ALLOWED
    gone = ALLOWED - found
    message = []
    if new:
        message.append(
            "runtime-specific code outside pytest_boxlite/runtimes/ (move it behind the runtime protocol):\n"
            + describe(new)
        )
    if gone:
        message.append(
            "fixed, so delete these entries (or lower their counts) in ALLOWED of tests/test_layering.py:\n"
            + describe(gone)
        )
    assert not message, "\n\n".join(message)


_CGROUPS = "from pytest_boxlite.runtimes._cgroups import Cgroups"
_ALIVE = "from pytest_boxlite.runtimes.namespace import _alive"
_ISINSTANCE = "from pytest_boxlite.runtimes.namespace import NamespaceRuntime\nok = isinstance(rt, NamespaceRuntime)"
_DOCSTRING = 'def f():\n    """Docstrings may say "vm"."""\n    return "namespace"'


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('x = kind == "vm"', [("kind-literal", "mod", "<module>", "vm")]),
        (_DOCSTRING, [("kind-literal", "mod", "f", "namespace")]),
        (_CGROUPS, [("private-import", "mod", "<module>", "runtimes._cgroups.Cgroups")]),
        (_ALIVE, [("private-import", "mod", "<module>", "runtimes.namespace._alive")]),
        (
            _ISINSTANCE,
            [
                ("concrete-runtime-import", "mod", "<module>", "runtimes.namespace"),
                ("isinstance-runtime", "mod", "<module>", "NamespaceRuntime"),
            ],
        ),
        ("from pytest_boxlite.runtimes import BoxHandle\nok = isinstance(h, BoxHandle)", []),
    ],
)
def test_the_boundary_check_catches_each_kind_of_violation(
    source: str, expected: list[tuple[str, str, str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule-3 detector on small made-up modules, so a broken detector cannot pass silently."""
    path = ROOT / "mod.py"  # never written: only its name is used
    monkeypatch.setitem(MODULES, "mod", path)
    monkeypatch.setitem(TREES, "mod", ast.parse(source))
    monkeypatch.setattr(sys.modules[__name__], "IMPORTS", [*IMPORTS, *imports_of("mod")])
    found = boundary_violations()
    mine = collections.Counter({k: n for k, n in found.items() if k[1] == "mod"})
    assert mine == collections.Counter(expected)


# -- features join through hookspecs (issue 41) ----------------------------------------------------

#: Modules a feature reaches the boxed-test path through: only its hook implementations call them.
HOOKED = {"reach"}


def module_probes(tree: ast.Module) -> list[str]:
    """``sys.modules.get("pytest_boxlite...")`` and ``sys.modules["pytest_boxlite..."]`` in a module:
    asking whether a feature was imported, instead of a hook it implements."""
    found = []
    for node in ast.walk(tree):
        target: ast.expr | None = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in ("get", "__contains__", "pop"):
                owner, target = node.func.value, node.args[0]
            else:
                continue
        elif isinstance(node, ast.Subscript):
            owner, target = node.value, node.slice
        elif isinstance(node, ast.Compare) and len(node.comparators) == 1 and isinstance(node.ops[0], ast.In):
            owner, target = node.comparators[0], node.left
        else:
            continue
        is_modules = isinstance(owner, ast.Attribute) and owner.attr == "modules"
        if is_modules and isinstance(target, ast.Constant) and str(target.value).startswith(PACKAGE):
            found.append(f"line {node.lineno}: {target.value!s}")
    return found


def test_no_module_probes_and_remote_reaches_no_feature_directly() -> None:
    """Services join a boxed test's path through ``pytest_boxlite.hooks`` (its hookspecs), not by
    asking ``sys.modules`` whether a conftest imported them; ``remote/`` calls ``reach`` only
    through the hook services implement."""
    probes = [f"{shown(m)} {p}" for m, tree in TREES.items() for p in module_probes(tree)]
    direct = [
        f"{shown(i.source)} line {i.line} imports {shown(i.target)}"
        for i in IMPORTS
        if (i.source == "remote" or i.source.startswith("remote.")) and i.target in HOOKED
    ]
    assert probes == [], "sys.modules probes of the package (implement a pytest_boxlite_ hook instead):\n" + "\n".join(
        probes
    )
    assert direct == [], "remote/ imports a feature's module (call it through a pytest_boxlite_ hook):\n" + "\n".join(
        direct
    )


@pytest.mark.parametrize(
    "source",
    [
        'import sys\ns = sys.modules.get("pytest_boxlite.services")',
        'import sys\ns = sys.modules["pytest_boxlite.services"]',
        'import sys\nok = "pytest_boxlite.services" in sys.modules',
    ],
)
def test_the_probe_check_catches_each_form(source: str) -> None:
    """The probe detector on made-up modules, so a broken one cannot pass silently."""
    assert module_probes(ast.parse(source)) == ["line 2: pytest_boxlite.services"]
    assert module_probes(ast.parse('import sys\nc = sys.modules.get("coverage")')) == []
