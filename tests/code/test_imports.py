"""The import graph of ``sidecar/`` points one way: no cycle, not even through imports inside
functions or for type checking only, the low-level modules import nothing of the application above
them, and nothing but the app that wires an engine imports the engines (a compiled layout's
``cimport`` counts as an import)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "sidecar"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")} | {_module_name(p): p for p in ROOT.rglob("*.pyx")}


def imports_of(name: str, path: Path, known: set[str], typing: bool = False) -> set[str]:
    """The sidecar modules ``name`` imports, wherever in the file (TYPE_CHECKING blocks only with
    ``typing``); for a .pyx, and for the .pxd beside a .py, the modules it imports or cimports."""
    tree = ast.parse(path.read_text(encoding="utf-8")) if path.suffix == ".py" else None
    out: set[str] = set()
    layouts = [path] if tree is None else [p for p in [path.with_suffix(".pxd")] if p.exists()]
    for layout in layouts:  # read by line: "from sidecar.x import|cimport ..."
        for line in layout.read_text(encoding="utf-8").splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "from" and words[1].startswith("sidecar"):
                out.add(words[1])
    if tree is None:
        return out & known
    type_checking: set[int] = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if (
            not typing
            and isinstance(node, ast.If)
            and getattr(test, "id", getattr(test, "attr", "")) == "TYPE_CHECKING"
        ):
            type_checking.update(id(n) for n in ast.walk(node))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    resolved = set()
    for target in out:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def graph(typing: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    edges = {name: imports_of(name, path, known, typing) for name, path in modules.items()}
    # Importing a module runs its packages' __init__ modules first.
    for name in list(edges):
        for target in list(edges[name]):
            parent = target.rpartition(".")[0]
            while parent:
                if parent in known and parent != name and not name.startswith(parent + "."):
                    edges[name].add(parent)
                parent = parent.rpartition(".")[0]
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        v = todo.pop()
        for w in edges.get(v, ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


@pytest.mark.parametrize("typing", [False, True], ids=["run time", "type checking"])
def test_the_import_graph_has_no_cycle(typing: bool) -> None:
    found = cycles(graph(typing))
    assert found == [], "import cycles (each a set of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


# The one module outside sidecar/engine/ that imports an engine: the app, which wires one.
WIRES_ENGINES = {"sidecar.app"}


def test_only_the_app_imports_the_engines() -> None:
    """Engines call the router, never the reverse: the router layer (router, identity, headers,
    the modes, the state...) imports nothing from sidecar/engine/, not even for typing."""
    upward = {
        name: sorted(t for t in targets if t == "sidecar.engine" or t.startswith("sidecar.engine."))
        for name, targets in graph(typing=True).items()
        if not name.startswith("sidecar.engine") and name not in WIRES_ENGINES
    }
    assert {name: t for name, t in upward.items() if t} == {}


# Modules that parse bytes, build records or hold errors: they import no module of the
# application (config, router, engines, app, admin, metrics, the session tree).
LEAVES = [
    "sidecar.engine.head",
    "sidecar.engine.flow",
    "sidecar.engine.parsers",
    "sidecar.engine.idle_poll",
    "sidecar.engine.relay",
    "sidecar.engine.wire",
    "sidecar.engine.phases",
    "sidecar.engine.request_rules",
    "sidecar.errors",
    "sidecar.headers",
    "sidecar.modes.ids",
    "sidecar.jsonscan",
    "sidecar.state.scripts",
    "sidecar.usage",
]
APPLICATION = {
    "sidecar.config",
    "sidecar.router",
    "sidecar.app",
    "sidecar.engine.base",
    "sidecar.engine.fast",
    "sidecar.engine.fast_connection",
    "sidecar.engine.fast_exchange",
    "sidecar.engine.fast_upstream",
    "sidecar.engine.aiohttp_engine",
    "sidecar.admin",
    "sidecar.metrics",
    "sidecar.lineage",
    "sidecar.health",
    "sidecar.deployments",
}


@pytest.mark.parametrize("module", LEAVES)
def test_low_level_modules_import_nothing_of_the_application(module: str) -> None:
    above = reachable(graph(), module) & APPLICATION
    assert not above, f"{module} reaches {sorted(above)}"


def test_the_checker_sees_cycles_and_hidden_imports(tmp_path: Path) -> None:
    """The check itself can fail: a cycle through an import inside a function is found."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from sidecar.config import Config\n")
    assert imports_of("sidecar.m", src, {"sidecar.config", "sidecar.m"}) == {"sidecar.config"}
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sidecar.config import Config\n")
    assert imports_of("sidecar.m", src, {"sidecar.config", "sidecar.m"}) == set()
    assert imports_of("sidecar.m", src, {"sidecar.config", "sidecar.m"}, typing=True) == {"sidecar.config"}
    src.write_text("")
    src.with_suffix(".pxd").write_text("from sidecar.engine.head cimport lookup\n")
    assert imports_of("sidecar.m", src, {"sidecar.engine.head", "sidecar.m"}) == {"sidecar.engine.head"}
