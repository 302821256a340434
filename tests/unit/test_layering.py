"""The package's shape, read from its source: which room may import which, no import
cycle, and rooms of a readable size (DESIGN.md, STYLE.md habits 7 and the layout).

Every import counts, lazy ones inside functions included (a lazy import still makes the
importing room depend on the imported one); only ``if TYPE_CHECKING:`` blocks are skipped.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "pdserve"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    is_package = MODULES[module].name == "__init__.py"
    base = package if is_package else package[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str) -> set[str]:
    """The pdserve modules ``module`` imports (a ``from pkg import name`` where name is a
    module counts as importing that module)."""
    tree = ast.parse(MODULES[module].read_text())
    found = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            target = _resolve(module, node)
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target
                     for a in node.names]
        found.update(n for n in names if n.split(".")[0] == "pdserve")
    return {n for n in found if n in MODULES and n != module}


GRAPH = {m: imports_of(m) for m in MODULES}


def _room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[1] == "common" and len(parts) > 2 else ".".join(
        parts[:2])


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
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
                out.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert _cycles() == []


def _violations(room: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} imports {i}" for m, deps in GRAPH.items()
                  if m == room or m.startswith(room + ".")
                  for i in deps if any(i == f or i.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize("room, forbidden", [
    # The engine knows no wire, no socket and no role: nodes translate at their edge.
    ("pdserve.engine", ("pdserve.common.protocol", "pdserve.common.codec", "pdserve.node",
                        "pdserve.router", "pdserve.client", "pdserve.launch", "pdserve.cli")),
    # The router never touches a tensor (and so loads no torch).
    ("pdserve.router", ("pdserve.engine", "pdserve.node", "pdserve.kernels", "pdserve.llm",
                        "pdserve.launch", "pdserve.cli")),
    # common/ is below every role.
    ("pdserve.common", ("pdserve.engine", "pdserve.node", "pdserve.router", "pdserve.model",
                        "pdserve.kernels", "pdserve.bench", "pdserve.llm", "pdserve.launch",
                        "pdserve.cli", "pdserve.client")),
    # The model knows no serving.
    ("pdserve.model", ("pdserve.engine", "pdserve.node", "pdserve.router", "pdserve.bench",
                       "pdserve.common.protocol", "pdserve.common.codec")),
])
def test_rooms_import_only_downwards(room, forbidden):
    assert _violations(room, forbidden) == []


def test_kernels_are_leaves():
    assert sorted(f"{m} imports {i}" for m, deps in GRAPH.items()
                  if m.startswith("pdserve.kernels") for i in deps
                  if not i.startswith("pdserve.kernels")) == []


def test_files_and_functions_stay_small():
    long_files = [f"{m} ({n} lines)" for m, p in MODULES.items()
                  if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    long_functions = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{module}.{node.name} ({n} lines)")
    assert (long_files, long_functions) == ([], [])


def test_the_checker_sees_imports():
    """The graph is read right: known edges are found (else every check above passes
    vacuously)."""
    assert "pdserve.engine.engine" in GRAPH["pdserve.llm"]
    assert any(i.startswith("pdserve.router") for i in GRAPH["pdserve.cli"])
    assert len(MODULES) > 80
