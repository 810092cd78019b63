"""The package's import graph: no cycle, and no module imports another module's private names.

Every import statement of every module under ``nmst_fast/`` counts, a function's lazy import included, except
those under ``if TYPE_CHECKING``. An edge goes from the importing module to the module it names (``from pkg
import sub`` to the submodule ``pkg.sub`` where there is one); the implicit import of a module's parent
packages is not an edge (a package's ``__init__`` re-exporting its submodules would otherwise always close a
cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import nmst_fast

PACKAGE = Path(nmst_fast.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _resolve(module: str, level: int, target: str | None) -> str:
    """The absolute name of ``from {'.' * level}{target} import ...`` inside ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports(module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) of every import in ``module`` that stays in the package."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    skip = _type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node.level, node.module)
            names = [alias.name for alias in node.names]
            submodules = [f"{source}.{name}" for name in names if f"{source}.{name}" in MODULES]
            others = [name for name in names if f"{source}.{name}" not in MODULES]
            found += [(sub, [], node.lineno) for sub in submodules]
            if others or not submodules:
                found.append((source, others, node.lineno))
    return [(target, names, line) for target, names, line in found if target in MODULES]


def test_the_graph_holds_every_module():
    assert {"nmst_fast", "nmst_fast.integrations.hf.scoring", "nmst_fast.integrations.trl"} <= set(MODULES)
    edges = {(m, t) for m in MODULES for t, _, _ in imports(m)}
    assert ("nmst_fast.integrations.trl", "nmst_fast.integrations.hf") in edges  # `from .hf import ...` is seen
    assert ("nmst_fast.loss", "nmst_fast.ops") in edges  # `from . import ops` is an edge to the submodule


def test_the_package_has_no_import_cycle():
    graph = {m: sorted({t for t, _, _ in imports(m) if t != m}) for m in MODULES}
    state: dict[str, str] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in graph[node]:
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_imports_another_modules_private_names():
    private = [f"{m}:{line} imports {name} from {t}" for m in MODULES for t, names, line in imports(m)
               for name in names if name.startswith("_") and t != m]
    assert not private, "\n".join(private)
