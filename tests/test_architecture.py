"""The package's shape, read from the source with ``ast``: no import circles, no private name
(``_name``) imported from another module, no file over ``MAX_FILE_LINES`` lines and no function
or method over ``MAX_FUNCTION_LINES`` lines. There are no known exceptions: ``KNOWN_CIRCLES`` and
``KNOWN_PRIVATE_FROM`` are empty, and a new circle, private import or oversized file or function
fails. docs/architecture.md describes the layers these rules keep apart."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlxspec"

KNOWN_CIRCLES: set[frozenset] = set()
KNOWN_PRIVATE_FROM: set[str] = set()

# past these a module or function holds more than one idea: split it rather than raise them
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


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


def _long_files(paths, limit: int = MAX_FILE_LINES) -> list[str]:
    """"path (N lines)" for every file over ``limit`` lines."""
    out = []
    for path in sorted(paths):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out.append(f"{_shown(path)} ({n} lines)")
    return out


def _long_functions(paths, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """"path:line name (N lines)" for every def / async def (methods and nested functions
    included) over ``limit`` lines, from its ``def`` line to its last line."""
    out = []
    for path in sorted(paths):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{_shown(path)}:{node.lineno} {node.name} ({n} lines)")
    return out


def _shown(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent)) if path.is_relative_to(PACKAGE.parent) else str(path)


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


def test_no_file_over_the_line_limit():
    long = _long_files(_modules().values())
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_over_the_line_limit():
    long = _long_functions(_modules().values())
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_size_checks_can_fail(tmp_path):
    """The size readers see a planted long file, long function and long method."""
    path = tmp_path / "big.py"
    path.write_text(
        "def short():\n"
        "    pass\n"
        "\n"
        "async def long():\n"
        "    a = 1\n"
        "    return a\n"
        "\n"
        "class C:\n"
        "    def method(self):\n"
        "        a = 1\n"
        "        return a\n"
    )
    assert _long_files([path], limit=10) == [f"{path} (11 lines)"]
    assert _long_files([path], limit=11) == []
    assert _long_functions([path], limit=2) == [f"{path}:4 long (3 lines)", f"{path}:9 method (3 lines)"]
    assert _long_functions([path], limit=3) == []
