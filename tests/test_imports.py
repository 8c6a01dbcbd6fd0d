"""The import layering, read from the source with ``ast`` (nothing is imported): research -> hybrid.train -> hybrid
-> headscope, and no import cycle among the modules of headscope, hybrid and research.

Every import counts: module level and inside functions, ``import a.b`` and ``from a import b`` (an edge to the
module ``a.b`` when it is one, else to ``a``), relative imports resolved, and ``importlib.import_module("a.b")``
with a literal string. The lazy ``__init__`` maps (``{"name": "headscope.x"}`` resolved by
``importlib.import_module(_EXPORTS[name])`` on first use) are strings, not imports: they are not counted (a
package's ``__init__`` names its own submodules, which could only make a package and its submodules look cyclic).
Imports under ``if TYPE_CHECKING:`` never run (annotations only) and are not counted either.
An edge goes to the named module only, not to the packages above it that Python also runs first (every submodule
of a package whose ``__init__`` imports it would otherwise be in a cycle with that ``__init__``).
"""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("headscope", "hybrid", "research")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[_module_name(path)] = path
    return found


def _is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def _internal(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _nearest_module(name: str) -> str | None:
    """``name`` if it is one of our modules, else the longest prefix that is (``a.b.attr`` -> ``a.b``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules():
            return candidate
        parts.pop()
    return None


def imports_of(name: str) -> set[str]:
    """The internal modules that module ``name`` imports anywhere in its source."""
    tree = ast.parse(modules()[name].read_text(encoding="utf-8"), filename=str(modules()[name]))
    package = name if _is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):  # drop `if TYPE_CHECKING:` bodies (annotation-only imports, never run)
        if isinstance(node, ast.If) and (
                (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
                or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")):
            node.body = []
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules() else base)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            targets.add(node.args[0].value)
    out = set()
    for target in targets:
        if _internal(target):
            resolved = _nearest_module(target)
            if resolved is not None and resolved != name:
                out.add(resolved)
    return out


@lru_cache(maxsize=None)
def graph() -> dict[str, frozenset[str]]:
    return {name: frozenset(imports_of(name)) for name in modules()}


def _layer(name: str) -> str:
    if name == "hybrid.train" or name.startswith("hybrid.train."):
        return "hybrid.train"
    return name.split(".")[0]


FORBIDDEN = {  # layer -> the layers it must never import
    "headscope": ("hybrid", "hybrid.train", "research"),
    "hybrid": ("hybrid.train", "research"),
    "hybrid.train": ("research",),
}


def test_the_modules_are_found():
    found = modules()
    assert {"headscope", "headscope.registry", "hybrid", "hybrid.modeling", "hybrid.train", "research"} <= set(found)
    assert "headscope.registry" in graph()["headscope.selection"]  # an edge the parser must see


def test_layering_floors():
    """research -> hybrid.train -> hybrid -> headscope: a lower layer never imports a higher one."""
    bad = [f"{name} ({modules()[name].relative_to(ROOT)}) imports {target}"
           for name, targets in sorted(graph().items())
           for target in sorted(targets)
           if _layer(target) in FORBIDDEN.get(_layer(name), ())]
    assert not bad, "imports across the layering (research -> hybrid.train -> hybrid -> headscope):\n  " + \
        "\n  ".join(bad)


def _cycles(g: dict[str, frozenset[str]]) -> list[list[str]]:
    """One cycle path (first module repeated at the end) per strongly connected component with a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:  # Tarjan, iterative over the edges of each node
        work = [(v, iter(sorted(g.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, edges = work[-1]
            advanced = False
            for w in edges:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strongconnect(v)
    paths = []
    for comp in components:  # a shortest cycle through the component's first module (breadth-first)
        members, start = set(comp), comp[0]
        parent: dict[str, str] = {}
        frontier, end = [start], None
        while frontier and end is None:
            nxt = []
            for u in frontier:
                for w in sorted(g[u] & members):
                    if w == start:
                        end = u
                        break
                    if w not in parent:
                        parent[w] = u
                        nxt.append(w)
                if end is not None:
                    break
            frontier = nxt
        path = [start]  # walked back from the last module before start: start <- ... <- end, then reversed
        node = end
        while node != start:
            path.append(node)
            node = parent[node]
        path.append(start)
        paths.append(path[::-1])
    return paths


def test_every_kind_of_import_is_seen(tmp_path, monkeypatch):
    """Module-level and in-function imports, relative ones and literal import_module calls count; TYPE_CHECKING
    blocks do not."""
    code = ("from typing import TYPE_CHECKING\n"
            "import headscope.registry\n"
            "from . import heads\n"
            "from .mask import HeadMask\n"
            "if TYPE_CHECKING:\n    from headscope import selection\n"
            "def f():\n    from headscope.evaluate import api\n    import importlib\n"
            "    importlib.import_module('headscope.fusion')\n")
    (tmp_path / "probe.py").write_text(code)
    monkeypatch.setitem(modules(), "headscope.probe_test", tmp_path / "probe.py")
    assert imports_of("headscope.probe_test") == {"headscope.registry", "headscope.heads", "headscope.mask",
                                                  "headscope.evaluate.api", "headscope.fusion"}


def test_cycle_finder_reports_the_path():
    g = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset({"a"})}
    assert _cycles(g) == [["a", "b", "c", "a"]]
    assert _cycles({"a": frozenset({"b"}), "b": frozenset()}) == []


def test_no_import_cycles():
    cycles = _cycles(graph())
    assert not cycles, "import cycles (each a path a -> b -> ... -> a; move the shared piece into a module both " \
        "can import):\n  " + "\n  ".join(" -> ".join(c) for c in cycles)
