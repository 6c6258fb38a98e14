"""The package's shape: no import loops, the checking wing free of backends, modules of a size a
reader can hold (or a reason written at their top), and the stable surface the asv suite uses."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvbench", "impls")
MAX_LINES = 500
LONG_MODULE_MARK = "Over 500 lines:"  # the docstring line that gives the reason


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set) -> set:
    """The project modules ``name`` imports anywhere in its file (function bodies included: a
    loop through a function-level import is a loop all the same)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # `from pkg import sub` imports the module pkg.sub when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a module a.b with an attribute c
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_graph() -> dict[str, set]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(graph: dict) -> list[list]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def reachable(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        for w in graph.get(v, ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_the_cycle_finder_finds_a_planted_loop():
    # a -> b -> c -> a is one loop; d -> a hangs off it; e stands alone.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_loops():
    graph = import_graph()
    assert "kvbench.checking.checker" in graph and graph["kvbench.checking.checker"], \
        "the import graph came out empty: the scan is broken"
    assert cycles(graph) == []


@pytest.mark.parametrize("wing", ["kvbench.checking.oracle", "kvbench.checking.checker"])
def test_the_oracle_and_checker_import_no_backend(wing):
    graph = import_graph()
    assert "kvbench.contract.protocol" in reachable(graph, wing)  # the scan sees their imports
    backends = sorted(m for m in reachable(graph, wing) if m.startswith("impls"))
    assert backends == [], f"{wing} reaches backend code: {backends}"


def test_long_modules_say_why():
    long = {}
    for name, path in modules().items():
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n") + 1
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_LINES and LONG_MODULE_MARK not in doc:
            long[name] = lines
    assert long == {}, (f"modules over {MAX_LINES} lines without a '{LONG_MODULE_MARK} ...' line "
                        f"in their docstring: {long}")


def test_the_stable_surface_names_what_the_asv_suite_imports():
    api = importlib.import_module("kvbench.api")
    for name in ("Append", "CacheConfig", "Fork", "Free", "ModelSpec", "OutOfMemory", "Prefill",
                 "get_model", "load", "registry", "quant", "check", "Backend"):
        assert hasattr(api, name), name
    assert set(api.__all__) <= set(dir(api))


def test_plugins_keep_their_import_path():
    old = importlib.import_module("kvbench.protocol")
    new = importlib.import_module("kvbench.contract.protocol")
    for name in new.__all__:
        assert getattr(old, name) is getattr(new, name)
