"""The package's import graph, read from the source (every import at any depth, lazy ones included).

The folders follow the pipeline, and a layer imports only the layers below it:

    errors, version < storage, align, demo < shards, compare < config, device < data < heads
        < engine < recompute < run < eagle3, analysis < export < cli

Inside ``hsx.engine``: ``contract`` and ``families`` below the engines (``hf``, ``sglang``, ``vllm``,
``replay``), which import none of each other, and ``registry`` above them all. No module imports the
package root (``hsx/__init__.py`` is the public facade, not a library), ``import sglang`` lives in
``hsx/engine/sglang/`` only and ``import vllm`` in ``hsx/engine/vllm/`` only, and there is no
circle between modules.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

import pytest

HSX = Path(__file__).resolve().parents[1] / "hsx"

RANKS = {
    "errors": 0, "version": 0,
    "storage": 1, "align": 1, "demo": 1,
    "shards": 2, "compare": 2,
    "config": 3, "device": 3,
    "data": 4,
    "heads": 5,
    "engine": 6,
    "recompute": 7,
    "run": 8,
    "eagle3": 9, "analysis": 9,
    "export": 10,
    "cli": 11,
}
ENGINES = ("hf", "sglang", "vllm", "replay")
ENGINE_RANKS = {"contract": 0, "families": 0, **{e: 1 for e in ENGINES}, "registry": 2}


def module_name(path: Path) -> str:
    parts = path.relative_to(HSX.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    path = HSX.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


@lru_cache(maxsize=1)
def graph() -> dict[str, set[str]]:
    """hsx module -> the hsx modules (or packages) it imports, and the outside top-level names as ``:name``."""
    out: dict[str, set[str]] = {}
    for path in sorted(HSX.rglob("*.py")):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "hsx" or node.module.startswith("hsx."):
                    # ``from package import module`` imports that module; ``from module import name`` the module
                    found |= {f"{node.module}.{a.name}" if is_module(f"{node.module}.{a.name}") else node.module
                              for a in node.names}
                else:
                    found.add(":" + node.module.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.level:
                found.add("relative")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    found.add(a.name if a.name == "hsx" or a.name.startswith("hsx.") else ":" + a.name.split(".")[0])
        out[module_name(path)] = found
    return out


def layer(module: str) -> str:
    return module.split(".")[1]


def test_every_layer_is_ranked():
    tops = {layer(m) for m in graph() if m != "hsx"}
    assert tops <= set(RANKS), f"packages with no rank: {sorted(tops - set(RANKS))}"
    assert {p.name for p in (HSX / "engine").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(ENGINES)


def test_a_layer_imports_only_the_layers_below_it():
    wrong = []
    for mod, deps in graph().items():
        if mod == "hsx":
            continue
        for dep in deps:
            if dep.startswith(":") or dep == "relative":
                continue
            if dep == "hsx":
                wrong.append(f"{mod} imports the package root")
            elif layer(dep) != layer(mod) and RANKS[layer(dep)] >= RANKS[layer(mod)]:
                wrong.append(f"{mod} ({RANKS[layer(mod)]}) imports {dep} ({RANKS[layer(dep)]})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_relative_imports():
    assert not [m for m, deps in graph().items() if "relative" in deps]


def engine_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "engine" else None


def test_no_engine_imports_another_and_the_registry_sits_above_them():
    wrong = []
    for mod, deps in graph().items():
        mine = engine_part(mod)
        if mine is None:
            continue
        for dep in deps:
            theirs = engine_part(dep)
            if theirs is None or theirs == mine:
                continue
            if ENGINE_RANKS[theirs] >= ENGINE_RANKS[mine]:
                wrong.append(f"{mod} imports {dep}")
    assert not wrong, "\n".join(sorted(wrong))


@pytest.mark.parametrize("outside,home", [("sglang", "hsx/engine/sglang/"), ("vllm", "hsx/engine/vllm/")])
def test_a_server_engine_is_imported_in_its_folder_only(outside, home):
    users = {m for m, deps in graph().items() if f":{outside}" in deps}
    assert users, f"nothing imports {outside}"  # the check reads the imports it means to read
    strays = {m for m in users if not m.replace(".", "/").startswith(home.rstrip("/"))}
    assert not strays, strays


def test_no_import_circle_between_modules():
    g = {m: {d for d in deps if d in graph()} for m, deps in graph().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(g[m]):
            assert state.get(n) != 1, " -> ".join(path + [m, n])
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])
