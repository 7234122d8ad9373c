"""The package layout keeps its rules: no import cycles, no private names across modules, small
modules, and package `__init__` files that only re-export."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fscale"
MAX_LINES = 460  # "about 450": one idea per module


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


MODULES = _modules()


def _runtime_imports(path: pathlib.Path) -> list[ast.ImportFrom | ast.Import]:
    """Module-level imports that run at import time (not those under TYPE_CHECKING)."""
    body = ast.parse(path.read_text()).body
    return [node for node in body if isinstance(node, (ast.Import, ast.ImportFrom))]


def _imported_modules(path: pathlib.Path) -> set[str]:
    out = set()
    for node in _runtime_imports(path):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in MODULES)
        elif node.module and node.module.startswith("fscale"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                out.add(candidate if candidate in MODULES else node.module)
    return out


def test_no_import_cycles():
    graph = {name: _imported_modules(path) - {name} for name, path in MODULES.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        for dep in sorted(graph.get(name, ())):
            if dep in path:
                cycle = [*path[path.index(dep) :], dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in done:
                visit(dep, [*path, dep])
        done.add(name)

    for name in MODULES:
        visit(name, [name])


def test_no_private_name_is_imported_across_modules():
    offenders = []
    for name, path in MODULES.items():
        for node in _runtime_imports(path):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("fscale")
            ):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private or any(part.startswith("_") for part in node.module.split(".")):
                    offenders.append(f"{name}: from {node.module} import {', '.join(private)}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by idea"


def test_package_inits_only_re_export():
    for name, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            allowed = (
                ast.Import,
                ast.ImportFrom,
                ast.Expr,
                ast.Assign,
                ast.If,
                ast.FunctionDef,
                ast.AnnAssign,
            )
            assert isinstance(node, allowed), f"{name}/__init__.py holds a {type(node).__name__}"
            if isinstance(node, ast.FunctionDef):  # only the lazy-attribute hooks of PEP 562
                assert node.name in ("__getattr__", "__dir__"), f"{name}: def {node.name}"
