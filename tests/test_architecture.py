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


def _is_main_guard(node) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def _library_nodes(tree):
    """Every node of the module but those under ``if __name__ == "__main__":``: a program's entry
    point, run with ``python -m``, is no part of what importing the module imports."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if not _is_main_guard(c))


def imports_of(name: str, path: Path, known: set, *, programs: bool = True) -> set:
    """The project modules ``name`` imports anywhere in its file (function bodies included: a
    loop through a function-level import is a loop all the same); ``programs=False``: leaving
    out its ``__main__`` block."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in (ast.walk(tree) if programs else _library_nodes(tree)):
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


def import_graph(*, programs: bool = True) -> dict[str, set]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known, programs=programs) for name, path in mods.items()}


# kvbench's wings, bottom first: each imports only from the wings below it (and the shared
# utilities: kvbench.outputs, kvbench.progress, kvbench.charts, which import only contract).
LAYERS = ("contract", "traces", "quant", "model", "checking", "analyses", "bench", "cli")


def wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "kvbench" and len(parts) > 2 else module


def layer_violations(graph: dict) -> list[str]:
    """Imports from a wing to a wing above it."""
    out = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            a, b = wing(m), wing(d)
            if a in LAYERS and b in LAYERS and LAYERS.index(b) > LAYERS.index(a):
                out.append(f"{m} -> {d}")
    return out


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


def test_the_layer_rule_finds_an_import_from_above():
    # The two edges that made a loop of the wings, as they were.
    graph = {"kvbench.checking.suite": {"kvbench.analyses.eviction"},
             "kvbench.bench.gpu": {"kvbench.cli.options", "kvbench.checking.checker"},
             "kvbench.cli.run": {"kvbench.analyses.suite"}}
    assert layer_violations(graph) == ["kvbench.bench.gpu -> kvbench.cli.options",
                                       "kvbench.checking.suite -> kvbench.analyses.eviction"]


def test_wings_import_only_from_below():
    graph = import_graph(programs=False)
    assert graph["kvbench.cli.run"], "the import graph came out empty: the scan is broken"
    assert layer_violations(graph) == []


def test_shared_utilities_import_only_the_contract():
    graph = import_graph(programs=False)
    for util in ("kvbench.charts", "kvbench.outputs", "kvbench.progress"):
        above = sorted(d for d in graph[util] if wing(d) in LAYERS[1:])
        assert above == [], f"{util} imports {above}"


def test_no_import_loops():
    graph = import_graph(programs=False)
    assert "kvbench.checking.checker" in graph and graph["kvbench.checking.checker"], \
        "the import graph came out empty: the scan is broken"
    assert cycles(graph) == []


@pytest.mark.parametrize("wing", ["kvbench.model.oracle", "kvbench.checking.oracle",
                                  "kvbench.checking.checker"])
def test_the_oracle_and_checker_import_no_backend(wing):
    graph = import_graph()
    assert "kvbench.contract.protocol" in reachable(graph, wing)  # the scan sees their imports
    backends = sorted(m for m in reachable(graph, wing) if m.startswith("impls"))
    assert backends == [], f"{wing} reaches backend code: {backends}"


def test_the_model_imports_only_the_wings_below_it():
    # The model (kvbench/model/) is a pure function of the formulas (and the traces' tier
    # operations): checking, the commands and backends sit above it.
    graph = import_graph()
    model = [m for m in graph if m == "kvbench.model" or m.startswith("kvbench.model.")]
    assert "kvbench.model.oracle" in model and "kvbench.model.kinds" in model
    reached = set().union(*(reachable(graph, m) for m in model))
    assert "kvbench.contract.formulas" in reached  # the scan sees its imports
    outside = sorted(m for m in reached if m.startswith("kvbench.") and not m.startswith(
        ("kvbench.model", "kvbench.contract", "kvbench.traces", "kvbench.quant"))
        or m.startswith("impls"))
    assert outside == [], f"kvbench.model reaches {outside}"


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


def test_every_registered_backend_is_exercised_by_the_checker_tests_and_the_asv_suite():
    # The checker tests take their list from the registry (conftest.backends); the asv suite's
    # lists are written out (asv keys its history by them), so a new backend must be added there.
    from conftest import backends

    from kvbench.bench.gates import bench_common
    from kvbench.contract import registry

    common = bench_common()
    in_asv = set(common.PAGED) | set(common.REPLAYED) | set(common.POOLS)  # the lists benchmarks take
    checked = set(backends())
    tests = " ".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    missing = []
    for entry in registry.BUILTIN:
        if "engine" in entry.tags:  # their own opt-in environments and test files
            if f'"{entry.name}"' not in tests:
                missing.append(f"{entry.name}: no test names it")
            continue
        if entry.name not in checked:
            missing.append(f"{entry.name}: not in the checker tests' backends")
        if (entry.asv_name or entry.name) not in in_asv:
            missing.append(f"{entry.name}: not in the asv suite (common.PAGED, REPLAYED or POOLS)")
    assert not missing, missing


def test_no_scope_defines_a_function_or_class_twice():
    # A second definition silently replaces the first (a merge that kept two `free` methods lost
    # one's behaviour; two tests of one name run once).
    twice = []
    for path in [*(ROOT / "kvbench").rglob("*.py"), *(ROOT / "impls").rglob("*.py"),
                 *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]:
        tree = ast.parse(path.read_text())
        for scope in ast.walk(tree):
            if not isinstance(scope, (ast.Module, ast.ClassDef)):
                continue
            seen = set()
            for node in scope.body:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                if any(isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter")
                       for d in node.decorator_list):
                    continue  # a property's setter reuses its name
                if node.name in seen:
                    twice.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}")
                seen.add(node.name)
    assert not twice, twice


def test_tests_mirror_the_packages():
    """A test file lives in the folder named as what it tests: a wing of kvbench
    (tests/checking/ for kvbench/checking/), impls/ or engines/ (impls/engines/), or reproducers/
    (the fuzz campaigns' cases, docs/fuzzing.md); at the root only the project-wide tests and
    those of kvbench's top-level modules. Every folder is on pytest's pythonpath, where test
    modules import each other's helpers by name."""
    import tomllib

    wings = {p.name for p in (ROOT / "kvbench").iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in (ROOT / "tests").iterdir()
               if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders <= wings | {"impls", "engines", "reproducers"}, folders - wings
    at_root = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    top_modules = {f"test_{p.stem}" for p in (ROOT / "kvbench").glob("*.py")}
    assert at_root <= top_modules | {"test_architecture", "test_docs", "test_ci", "test_results", "test_scripts"}, at_root - top_modules
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    path = pyproject["tool"]["pytest"]["ini_options"]["pythonpath"]
    assert sorted(path) == sorted(["tests"] + [f"tests/{f}" for f in folders])
