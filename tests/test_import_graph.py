"""The package's import graph has no circle: every import counts, lazy and TYPE_CHECKING ones too.

A circle means two modules each need the other: a piece lives in the wrong room. The graph is
read from the source with `ast`, so no module is imported (and no torch is loaded) to check it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "zerohop"
GENERATED = "grpc_gen"


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        if GENERATED in path.parts:
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def imported_modules(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """Every module of the package that `name` imports, wherever in the file it does so."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in known:
                    yield submodule
                elif target in known:
                    yield target


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: set(imported_modules(name, path, known)) for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_checker_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["e"]]


def test_the_graph_is_read_from_the_package() -> None:
    graph = import_graph()
    assert "zerohop.cli" in graph
    assert "zerohop.engine.sched.scheduler" in graph["zerohop.engine.engine"]


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph()
    edges = {
        tuple(component): sorted(
            f"{a} -> {b}" for a in component for b in graph[a] if b in component
        )
        for component in circles(graph)
    }
    assert edges == {}


def package_of(name: str, files: dict[str, Path]) -> str:
    return name if files[name].name == "__init__.py" else name.rsplit(".", 1)[0]


def package_graph(graph: dict[str, set[str]], files: dict[str, Path]) -> dict[str, set[str]]:
    """Packages and who imports whom between siblings: a child may use its parent's modules
    and a parent its children's, but two sibling packages may not need each other."""
    packages: dict[str, set[str]] = {package_of(name, files): set() for name in graph}
    for name, targets in graph.items():
        source = package_of(name, files)
        for target in map(lambda t: package_of(t, files), targets):
            related = source.startswith(target + ".") or target.startswith(source + ".")
            if target != source and not related:
                packages[source].add(target)
    return packages


def test_the_package_checker_allows_parents_and_finds_siblings() -> None:
    files = {n: Path(n.replace(".", "/") + ".py") for n in ("p.a", "p.q.b", "p.r.c")}
    files["p"] = Path("p/__init__.py")
    graph = {"p": set(), "p.a": {"p.q.b"}, "p.q.b": {"p.a", "p.r.c"}, "p.r.c": {"p.q.b"}}
    assert circles(package_graph(graph, files)) == [["p.q", "p.r"]]


def test_no_two_packages_need_each_other() -> None:
    files = module_files()
    graph = package_graph(import_graph(), files)
    assert circles(graph) == []
