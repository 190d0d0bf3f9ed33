"""No import cycle among regen's packages, counting imports inside functions
(scripts/import_cycles.py reads the source with ast; nothing is imported)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_cycles.py"


def _script():
    spec = importlib.util.spec_from_file_location("import_cycles", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycle_among_regens_packages():
    ic = _script()
    edges = ic.package_edges()
    assert len(edges) >= 10  # it read the package (an empty graph has no cycle either)
    pairs = [f"{x} <-> {y}: {edges[x][y]} and {edges[y][x]}" for x in edges for y in edges[x] if x in edges.get(y, {})]
    assert not pairs and not ic.loops(edges), "\n".join(pairs + [", ".join(c) for c in ic.loops(edges)])


def test_the_check_finds_a_loop_of_three_and_imports_inside_functions(tmp_path):
    ic = _script()
    assert ic.loops({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}, "d": {"a": ""}}) == [["a", "b", "c"]]
    f = tmp_path / "regen" / "x" / "mod.py"
    f.parent.mkdir(parents=True)
    f.write_text("def f():\n    from regen.y.z import w\n    from . import sibling\n")
    ic.ROOT = tmp_path / "regen"
    assert ic.imports(f, "regen.x.mod") == [("regen.y.z", 2), ("regen.x", 3)]
