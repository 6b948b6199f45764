"""No two modules of the package import each other (a direct circle): each of a pair would see the other
half-initialised depending on which was imported first. Package `__init__` files, which gather names, are left
out. Read from the source with `ast`, function-level imports included."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Set

PACKAGE = Path(__file__).resolve().parent.parent / "fp8_parallel"


def _module_imports() -> Dict[str, Set[str]]:
    modules = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    edges: Dict[str, Set[str]] = {m: set() for m in modules}
    for name, f in modules.items():
        if f.name == "__init__.py":
            continue
        package = name.rsplit(".", 1)[0].split(".")
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            target = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            named = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            for t in named or [target]:
                if t in modules and modules[t].name != "__init__.py" and t != name:
                    edges[name].add(t)
    return edges


def test_no_two_modules_import_each_other():
    edges = _module_imports()
    assert len(edges) > 40 and sum(map(len, edges.values())) > 60  # the scan found the package's imports
    assert "fp8_parallel.megatron_config" in edges["fp8_parallel.megatron_block"]
    circles = sorted({tuple(sorted((a, b))) for a, targets in edges.items() for b in targets if a in edges[b]})
    assert circles == [], f"modules that import each other: {circles}"
