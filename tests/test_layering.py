"""The package's layering (ARCHITECTURE.md), from the imports in its source: no cycle between
its packages, and each package imports only what its layer may."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "streamgr"

# package -> the streamgr packages/modules it may import (besides itself)
ALLOWED = {
    "protocol": set(),
    "errors": set(),
    "api": set(),
    "aio": set(),
    "kernels": {"errors"},
    "selection": {"errors"},
    "streams": {"kernels", "errors"},
    "cache": {"kernels", "errors"},
    "models": {"kernels", "config", "errors"},
    "runtime": {"models", "kernels", "selection", "config", "errors"},
    "engine": {"api", "aio", "cache", "config", "errors", "kernels", "models", "runtime",
               "streams", "selection"},
    "client": {"api", "aio", "errors", "protocol"},
    "server": {"api", "engine", "errors", "protocol", "tokens", "config"},
    "deploy": {"api", "engine", "errors", "config", "server", "protocol", "tokens"},
}


def unit(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for f in ROOT.rglob("*.py"):
        me = unit(f)
        pkg = f.relative_to(ROOT.parent).with_suffix("").parts
        base = list(pkg[:-1]) if f.name != "__init__.py" else list(pkg[:-1])
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                parts = base[:len(base) - node.level + 1]
                target = parts + (node.module.split(".") if node.module else [])
                names = [target] if node.module else [target + [a.name] for a in node.names]
                for t in names:
                    if len(t) >= 2 and t[0] == "streamgr" and t[1] != me:
                        edges[me].add(t[1])
            elif isinstance(node, ast.Import):
                for a in node.names:
                    t = a.name.split(".")
                    if t[0] == "streamgr" and len(t) > 1 and t[1] != me:
                        edges[me].add(t[1])
    return edges


def test_no_cycle_between_packages():
    edges = graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n):
        state[n] = 1
        path.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
            if m not in state:
                visit(m)
        path.pop()
        state[n] = 2
    for n in sorted(edges):
        if n not in state:
            visit(n)


def test_each_layer_imports_only_what_it_may():
    edges = graph()
    bad = {pkg: sorted(edges.get(pkg, set()) - allowed) for pkg, allowed in ALLOWED.items()
           if edges.get(pkg, set()) - allowed}
    assert not bad, f"layering breaches (ARCHITECTURE.md): {bad}"


def test_no_module_over_400_lines():
    """Files split by responsibility before they grow past ~400 lines (ARCHITECTURE.md)."""
    long = {str(f.relative_to(ROOT)): n for f in ROOT.rglob("*.py")
            if (n := len(f.read_text().splitlines())) > 400}
    assert not long, long


def test_the_engine_core_stays_a_facade():
    """engine/core.py is admission and lifecycle only (issue 14): resources, status, updates
    and runners live in their own modules."""
    n = len((ROOT / "engine" / "core.py").read_text().splitlines())
    assert n < 200, n


def test_the_graph_sees_imports():  # the parser works: known edges are found
    edges = graph()
    assert "protocol" in edges["client"] and "engine" in edges["server"]
    assert "kernels" in edges["models"]
