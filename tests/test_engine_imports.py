"""The engine package's import graph: no circle, and no engine module imports another engine."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "hsx" / "engine"
ENGINES = {"hf", "sglang", "vllm", "stored"}  # the modules that run a model; ``loader`` is the one that picks among them


def imports() -> dict[str, set[str]]:
    """Module -> the hsx.engine modules it imports (at any depth of its code, lazy imports included)."""
    graph = {}
    for path in ENGINE.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hsx.engine."):
                found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("hsx.engine.")}
        graph[path.stem] = found
    return graph


def test_no_engine_imports_another():
    graph = imports()
    assert ENGINES <= set(graph)
    crossing = {m: graph[m] & (ENGINES - {m}) for m in ENGINES if graph[m] & (ENGINES - {m})}
    assert not crossing, crossing


def test_the_engine_package_has_no_import_circle():
    graph = imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            assert state.get(n) != 1, " -> ".join(path + [m, n])
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
