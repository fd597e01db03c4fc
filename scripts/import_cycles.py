"""Import circles among kiln's modules, counting every import: module level, inside
functions and under TYPE_CHECKING (a lazy import that goes up is a circle postponed).

Run: python scripts/import_cycles.py [--packages]. Exit status 1 when a circle exists.
An import of a.b.c counts as imports of a/__init__ and a/b/__init__ too (they run first).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "kiln"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                # the longest known module that prefixes t (a name imported from a module
                # resolves to the module; a submodule imported from a package to itself)
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
                # importing a.b.c runs a/__init__ and a/b/__init__ first; a module's own
                # ancestors are already running when it imports, so they add no edge
                while "." in t:
                    t = t.rpartition(".")[0]
                    if not mod.startswith(t + ".") and t != mod:
                        graph[mod].add(t)
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    def top(m: str) -> str:
        return ".".join(m.split(".")[:2])

    pg: dict[str, set[str]] = {}
    for m, deps in graph.items():
        pg.setdefault(top(m), set()).update(top(d) for d in deps if top(d) != top(m)
                                            and d != "kiln")
    return pg


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    graph = import_graph()
    if "--packages" in sys.argv:
        graph = package_graph(graph)
    found = cycles(graph)
    for comp in found:
        print(f"circle of {len(comp)}:")
        for m in comp:
            print(f"  {m} -> {', '.join(sorted(d for d in graph[m] if d in comp))}")
    print(f"{len(graph)} modules, {len(found)} circle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
