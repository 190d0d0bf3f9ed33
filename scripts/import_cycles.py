"""Report the import cycles among regen's packages, counting imports inside functions too.

    python scripts/import_cycles.py            # every cycle between two packages, and each group of packages
                                               # that import each other round a loop; exit 1 when there is one
    python scripts/import_cycles.py --edges    # also every package -> package import, with one place it is made

A package is regen's first level (regen.config, regen.train, ...). A function-level import hides a cycle from
Python's import machinery but not from a reader: to change one package you must still read the other. Read the
source only (ast): nothing is imported or run.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "regen"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def imports(path: Path, module: str) -> list[tuple[str, int]]:
    """(imported regen module, line) for every import statement of the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package
                base = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                out.append((".".join(base + ([node.module] if node.module else [])), node.lineno))
            elif node.module:
                out.append((node.module, node.lineno))
    return [(m, line) for m, line in out if m == "regen" or m.startswith("regen.")]


def package_edges() -> dict[str, dict[str, str]]:
    """package -> {imported package: 'file:line' of one such import}."""
    edges: dict[str, dict[str, str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        for target, line in imports(path, module):
            a, b = package(module), package(target)
            if a != b and b != "regen":
                edges.setdefault(a, {}).setdefault(b, f"{path.relative_to(ROOT.parent)}:{line}")
    return edges


def loops(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--edges", action="store_true", help="also list every package -> package import")
    a = p.parse_args()
    edges = package_edges()
    pairs = [(x, y) for x in sorted(edges) for y in sorted(edges[x]) if x < y and x in edges.get(y, {})]
    for x, y in pairs:
        print(f"{x} <-> {y}: {edges[x][y]} and {edges[y][x]}")
    for comp in loops(edges):
        print(f"loop of {len(comp)} packages: {', '.join(comp)}")
    if a.edges:
        for x in sorted(edges):
            for y, where in sorted(edges[x].items()):
                print(f"  {x} -> {y}  ({where})")
    if not pairs and not loops(edges):
        print("no import cycle among regen's packages")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
