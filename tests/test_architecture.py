"""The package's import graph, read from the source with ``ast``: no import circles and no
private name (``_name``) imported from another module, except the ones listed here, which the
redesign still has to remove (the CLI and the server). A new circle or private import fails."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlxspec"

KNOWN_CIRCLES: set[frozenset] = set()
KNOWN_PRIVATE_FROM: set[str] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict) -> list[tuple[str, str | None]]:
    """(module imported, name taken from it) for every import in the file, functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = here[: len(here) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.append((sub, None) if sub in modules else (module, alias.name))
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
    return found


def _graph():
    modules = _modules()
    graph, private = {m: set() for m in modules}, []
    for name, path in modules.items():
        for target, taken in _imports(name, path, modules):
            if target in modules and target != name:
                graph[name].add(target)
                if taken and taken.startswith("_") and not taken.startswith("__"):
                    private.append((name, target, taken))
    return graph, private


def _circles(graph) -> list[frozenset]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_new_import_circles():
    graph, _ = _graph()
    assert "mlxspec.engine.speculate" in graph  # the reader found the package
    new = [sorted(c) for c in _circles(graph) if c not in KNOWN_CIRCLES]
    assert not new, f"import circles: {new}"


def test_no_private_names_imported_across_modules():
    _, private = _graph()
    new = [p for p in private if p[1] not in KNOWN_PRIVATE_FROM]
    assert not new, f"private names imported from another module: {new}"


def test_the_checks_can_fail(tmp_path):
    """The circle finder and the private-import reader see a planted circle and import."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [frozenset({"a", "b", "c"})]
    mods = {"p.x": tmp_path / "x.py", "p.y": tmp_path / "y.py"}
    mods["p.x"].write_text("from .y import _hidden, shown\n")
    assert _imports("p.x", mods["p.x"], mods) == [("p.y", "_hidden"), ("p.y", "shown")]
