"""Imports point down the layers only, and no product files import each other in a cycle.

The layers (DESIGN.md, "Roles and where they live"), highest on top; a file may import its
own layer and the ones below it::

    benchmarks/                      experiments, the cluster simulator
        │
    launch/                          processes; launch/placement carries out plans
        │
    workers/                         the roles that hold models
        │
    yatt/rl/      yatt/placement/    siblings: neither imports the other
        │             │
    yatt/runtime/ (with yatt/errors.py and yatt/__init__.py): actors, transport; knows no RL
        │
    protocols/                       messages and the one codec

The product files (every .py under those folders) are read with ``ast``, never imported, so
every import counts: at module level, inside a function, under ``if TYPE_CHECKING:``, and
``importlib.import_module("literal")``. ``from pkg import name`` is an import of
``pkg.name`` when that is a module, else of ``pkg`` (its ``__init__.py``); relative imports
are made absolute. Third-party and standard-library imports are not looked at.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocols", "yatt", "workers", "launch", "benchmarks")
LAYERS = {  # module prefix -> height; the same height with another name: siblings
    "protocols": 0,
    "yatt.runtime": 1,
    "yatt.rl": 2,
    "yatt.placement": 2,
    "workers": 3,
    "launch": 4,
    "benchmarks": 5,
}
WITH_RUNTIME = {"yatt", "yatt.errors"}  # the package's own __init__ and the error tree


@dataclass(frozen=True)
class Import:
    file: str  # importing file, relative to the repository root
    line: int
    module: str  # the product module imported, as resolved
    target: str  # the file of ``module``


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def product_files() -> dict[str, str]:
    """Module name -> file (relative to the root) of every product file."""
    return {
        module_name(p): str(p.relative_to(ROOT))
        for package in PACKAGES
        for p in sorted((ROOT / package).rglob("*.py"))
    }


def imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str, str]]:
    """(line, module, name) of every import in ``tree``: ``import a.b`` gives ``a.b`` and no
    name, ``from a import b`` gives ``a`` and ``b``, relative ones are made absolute."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                parent = ".".join(package[: len(package) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            out += [(node.lineno, base, alias.name) for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append((node.lineno, node.args[0].value, ""))
    return out


def resolve(module: str, name: str) -> str | None:
    """The product module an import loads: ``module.name`` when that is a submodule, else
    ``module``; None for third-party code (and for a product module that does not exist,
    which fails on import anyway)."""
    files = product_files()
    return next((m for m in (f"{module}.{name}" if name else "", module) if m in files), None)


@functools.cache
def product_imports() -> tuple[Import, ...]:
    out = []
    for module, file in product_files().items():
        tree = ast.parse((ROOT / file).read_text(), filename=file)
        for line, imported, name in imported_names(tree, module, file.endswith("__init__.py")):
            target = resolve(imported, name)
            if target is not None and target != module:
                out.append(Import(file=file, line=line, module=target, target=product_files()[target]))
    return tuple(sorted(set(out), key=lambda i: (i.file, i.line, i.module)))


def layer_of(module: str) -> str | None:
    if module in WITH_RUNTIME:
        return "yatt.runtime"
    return next((layer for layer in LAYERS if module == layer or module.startswith(f"{layer}.")), None)


def test_every_import_points_down_the_layers() -> None:
    broken = [
        f"{file}: in no layer (add its package to LAYERS in tests/test_layers.py)"
        for module, file in product_files().items()
        if layer_of(module) is None
    ]
    for imp in product_imports():
        src, dst = layer_of(module_name(ROOT / imp.file)), layer_of(imp.module)
        if src is None or dst is None or src == dst or LAYERS[dst] < LAYERS[src]:
            continue
        if LAYERS[dst] == LAYERS[src]:
            rule = f"{src} and {dst} are siblings: neither may import the other"
        else:
            rule = f"{src} may not import {dst}, a layer above it"
        broken.append(f"{imp.file}:{imp.line}: imports {imp.module}: {rule}")
    assert not broken, "imports against the layers:\n" + "\n".join(broken)


def shortest_cycle(start: str, edges: dict[str, dict[str, int]]) -> list[str] | None:
    """The shortest import path from ``start`` back to itself (breadth first), or None."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(edges.get(v, {})):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    return None


def test_no_import_cycles_between_product_files() -> None:
    edges: dict[str, dict[str, int]] = {}  # file -> imported file -> line of the first such import
    for imp in product_imports():
        edges.setdefault(imp.file, {}).setdefault(imp.target, imp.line)
    found: dict[frozenset[str], list[str]] = {}  # each cycle once, whichever file it was found from
    for file in sorted(edges):
        cycle = shortest_cycle(file, edges)
        if cycle is not None:
            found.setdefault(frozenset(cycle), cycle)
    report = [
        " -> ".join(f"{f}:{edges[f][g]}" for f, g in zip(cycle, cycle[1:], strict=False)) + f" -> {cycle[-1]}"
        for cycle in found.values()
    ]
    assert not report, "import cycles (file:line of the import -> the file it imports):\n" + "\n".join(report)
