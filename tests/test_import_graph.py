"""The package's import graph has no circle: every import counts, lazy and TYPE_CHECKING ones too,
between modules and between packages (a package and its parent or child included).

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
    """Packages and who imports whom: every import between two packages counts, a package's
    parent or child included, so a package and its sub-packages may not need each other either
    (the piece both need lives in a leaf below them)."""
    packages: dict[str, set[str]] = {package_of(name, files): set() for name in graph}
    for name, targets in graph.items():
        source = package_of(name, files)
        packages[source] |= {package_of(target, files) for target in targets} - {source}
    return packages


def test_the_package_checker_finds_siblings_parents_and_children() -> None:
    files = {n: Path(n.replace(".", "/") + ".py") for n in ("p.a", "p.q.b", "p.r.c")}
    files["p"] = Path("p/__init__.py")
    siblings = {"p": set(), "p.a": set(), "p.q.b": {"p.r.c"}, "p.r.c": {"p.q.b"}}
    assert circles(package_graph(siblings, files)) == [["p.q", "p.r"]]
    parent_and_child = {"p": set(), "p.a": {"p.q.b"}, "p.q.b": {"p.a"}, "p.r.c": set()}
    assert circles(package_graph(parent_and_child, files)) == [["p", "p.q"]]
    init_and_child = {"p": {"p.r.c"}, "p.a": set(), "p.q.b": set(), "p.r.c": {"p"}}
    assert circles(package_graph(init_and_child, files)) == [["p", "p.r"]]
    one_way = {"p": {"p.q.b"}, "p.a": {"p.q.b"}, "p.q.b": {"p.r.c"}, "p.r.c": set()}
    assert circles(package_graph(one_way, files)) == []


def test_no_two_packages_need_each_other() -> None:
    files = module_files()
    graph = import_graph()
    packages = package_graph(graph, files)
    edges = {
        tuple(component): sorted(
            f"{a} -> {b}"
            for a in graph
            for b in graph[a]
            if package_of(a, files) in component
            and package_of(b, files) in component
            and package_of(a, files) != package_of(b, files)
        )
        for component in circles(packages)
    }
    assert edges == {}
