"""The import direction of docs/design.md ("Layering"), read from the source: every import of a zplan module in every
installed module (top level, inside functions, under TYPE_CHECKING), checked against the layers.

    schemas  <-  model, cuda  <-  planner | runtime  <-  codegen (schemas only)  <-  zplan/ (CLI and API)

`zplan.errors` and `zplan.safe_files` sit below every layer. Imports inside functions are kept for an optional
dependency or start-up time only, each with a comment on its line or the line above saying which."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {"schemas": "zplan.schemas", "model": "zplan.model", "cuda": "zplan.cuda", "planner": "zplan.planner",
           "runtime": "zplan.runtime", "codegen": "zplan.codegen", "zplan": "zplan", "examples": "zplan.examples"}
BASE = {"zplan.errors", "zplan.safe_files"}  # below every layer
# layer -> the layers it may import (besides itself and BASE)
ALLOWED = {
    "schemas": set(),
    "model": {"schemas"},
    "cuda": {"schemas"},
    "examples": set(),
    "planner": {"schemas", "model"},
    "runtime": {"schemas", "model", "cuda"},
    "codegen": {"schemas"},
    "zplan": {"schemas", "model", "cuda", "planner", "runtime", "codegen", "examples"},
}
MAX_FUNCTION_IMPORTS = 25  # imports of zplan modules inside functions, each commented


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED and parts[1] != "zplan" else "zplan"


def _imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported zplan module, line, inside a function) for every import statement in `path`."""
    tree = ast.parse(path.read_text())
    in_function = {id(inner) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for inner in ast.walk(node) if isinstance(inner, (ast.Import, ast.ImportFrom))}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found += [(target, node.lineno, id(node) in in_function) for target in targets
                  if target == "zplan" or target.startswith("zplan.")]
    return found


IMPORTS = {module: _imports(module, path) for module, path in MODULES.items()}


def test_every_import_goes_down_the_layers():
    against = []
    for module, imports in IMPORTS.items():
        for target, line, _ in imports:
            if target in BASE or module in BASE or layer(target) == layer(module):
                continue
            if layer(target) not in ALLOWED[layer(module)]:
                against.append(f"{MODULES[module].relative_to(REPO)}:{line} imports {target}")
    assert not against, "imports against the layering (docs/design.md):\n" + "\n".join(against)


def test_base_modules_import_nothing_but_each_other():
    for module in BASE:
        assert {target for target, _, _ in IMPORTS[module]} <= BASE, module


def test_no_package_cycles():
    """Packages (zplan.runtime.parallel, zplan.planner.cost, ...) import each other one way only."""
    edges = defaultdict(set)
    for module, imports in IMPORTS.items():
        for target, _, _ in imports:
            source_pkg, target_pkg = layer(module), layer(target)
            if source_pkg != target_pkg and target not in BASE and module not in BASE:
                edges[source_pkg].add(target_pkg)
    for source, targets in edges.items():
        for target in targets:
            assert source not in edges.get(target, ()), f"{source} and {target} import each other"


def test_imports_inside_functions_are_few_and_say_why():
    inside = [(module, line) for module, imports in IMPORTS.items() for _, line, nested in imports if nested]
    statements = sorted(set(inside))
    assert len(statements) <= MAX_FUNCTION_IMPORTS, f"{len(statements)} imports of zplan modules inside functions"
    silent = []
    for module, line in statements:
        lines = MODULES[module].read_text().splitlines()
        context = lines[line - 2:line + 3]  # the line above, the statement (possibly parenthesized) and its names
        if not any("#" in text for text in context):
            silent.append(f"{MODULES[module].relative_to(REPO)}:{line}")
    assert not silent, "imports inside functions without a comment saying why:\n" + "\n".join(silent)


@pytest.mark.parametrize("module", ["zplan.planner.search", "zplan.planner.cost.step", "zplan.schemas.plan"])
def test_a_planner_module_knows_no_runtime(module):
    """A hand-checked case of the rule: the search, the cost model and the plan schema reach no runtime module."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current in seen or current not in MODULES:
            continue
        seen.add(current)
        todo += [target for target, _, _ in IMPORTS[current]]
    assert not [m for m in seen if layer(m) in ("runtime", "codegen", "cuda")]
