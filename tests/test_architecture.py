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
LAYERS = ("contract", "traces", "quant", "model", "checking", "search", "analyses", "routing", "bench", "cli")


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


def test_the_search_sits_above_the_checker():
    # The search drives the checker; the checker knows nothing of who drives it.
    graph = {"kvbench.checking.checker": {"kvbench.search.shrink"},
             "kvbench.search.shrink": {"kvbench.checking.checker", "kvbench.model.oracle"},
             "kvbench.search.fuzz": {"kvbench.analyses.suite"},
             "kvbench.model.oracle": {"kvbench.search.histories"}}
    assert layer_violations(graph) == ["kvbench.checking.checker -> kvbench.search.shrink",
                                       "kvbench.model.oracle -> kvbench.search.histories",
                                       "kvbench.search.fuzz -> kvbench.analyses.suite"]


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
    # Every import counts, function bodies' and programs' (`if __name__ == "__main__":`) too: a
    # program that imports its caller's module is a loop all the same (bench.gpu <-> cli.gpu was).
    graph = import_graph()
    assert "kvbench.checking.checker" in graph and graph["kvbench.checking.checker"], \
        "the import graph came out empty: the scan is broken"
    assert cycles(graph) == []


def test_the_import_scan_sees_function_level_and_program_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text('if __name__ == "__main__":\n    from pkg.a import f\n')
    known = {"pkg", "pkg.a", "pkg.b"}
    graph = {m: imports_of(m, pkg / f"{m.split('.')[1]}.py", known) for m in ("pkg.a", "pkg.b")}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def _string_arg(call) -> str:
    arg = call.args[0] if call.args else None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else ""


def backend_imports(source: str) -> list[str]:
    """Where ``source`` imports a module of impls/: an import statement (anywhere in the file), or
    importlib.import_module / __import__ of a string naming one. (A ``"impls.x:Factory"`` target
    handed to the registry's loader is how kvbench reaches a backend, as it reaches a plug-in's.)"""
    found = []
    for node in sorted((n for n in ast.walk(ast.parse(source)) if hasattr(n, "lineno")),
                       key=lambda n: (n.lineno, n.col_offset)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if not node.level else []
        elif isinstance(node, ast.Call) and (
                isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                or isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")):
            names = [_string_arg(node)]
        else:
            continue
        found += [f"line {node.lineno}: {n}" for n in names if n == "impls" or n.startswith("impls.")]
    return found


def test_the_backend_import_scan_finds_each_way_in():
    planted = ("import impls.numpy_paged\n"
               "def f():\n    from impls import faults\n"
               "import importlib\nimportlib.import_module('impls.torch_paged')\n"
               "__import__('impls')\n"
               "from kvbench.contract import registry\nregistry.load('impls.faults:CATALOGUE')\n"
               "import implsx\n")
    assert backend_imports(planted) == ["line 1: impls.numpy_paged", "line 3: impls",
                                        "line 5: impls.torch_paged", "line 6: impls"]


def test_kvbench_imports_nothing_of_impls():
    # Backends (and the fault catalogue, the kernels the ratio gates time) are reached through the
    # registry, as a plug-in's are: kvbench stands without impls/, and impls/ depends on kvbench.
    found = {name: got for name, path in modules().items() if name.startswith("kvbench")
             for got in [backend_imports(path.read_text(encoding="utf-8"))] if got}
    assert "kvbench.contract.registry" in modules()  # the scan sees kvbench's modules
    assert found == {}, found


def asv_paths(source: str) -> list[str]:
    """The string literals of ``source`` that are a path into asv_bench/ (a docstring or a message
    that names the folder is no path)."""
    return [f"line {n.lineno}: {n.value}" for n in sorted(
        (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant)
         and isinstance(n.value, str) and n.value.removeprefix("./").partition("/")[0] == "asv_bench"),
        key=lambda n: (n.lineno, n.col_offset))]


def test_the_asv_path_scan_finds_a_path_and_not_a_mention():
    planted = ('"""Fixtures of asv_bench/benchmarks."""\n'
               'COMMON = ROOT / "asv_bench" / "benchmarks" / "common.py"\n'
               'OTHER = "asv_bench/benchmarks/common.py"\n'
               'raise RuntimeError(f"append it to asv_bench/benchmarks/common.py in {ROOT}")\n')
    assert asv_paths(planted) == ["line 2: asv_bench", "line 3: asv_bench/benchmarks/common.py"]


def test_kvbench_loads_nothing_of_asv_bench_by_path():
    # The asv suite is above kvbench (it imports kvbench, and loads kvbench/bench/fixtures.py):
    # `kvbench gates` runs from an installed kvbench, without the asv suite beside it.
    found = {name: got for name, path in modules().items() if name.startswith("kvbench")
             for got in [asv_paths(path.read_text(encoding="utf-8"))] if got}
    assert found == {}, found


@pytest.mark.parametrize("wing", ["kvbench.model.oracle", "kvbench.checking.checker",
                                  "kvbench.search.shrink", "kvbench.search.fuzz"])
def test_the_model_checker_and_search_import_no_backend(wing):
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


def _doc_entries(doc: str, package: str) -> dict[str, str]:
    """docs/architecture.md's one-line entries under ``kvbench/<package>/``: name -> its text."""
    entries, inside, name = {}, False, None
    for line in doc.splitlines():
        if line.startswith("kvbench/"):
            inside = line.startswith(f"kvbench/{package}/ ")
        elif inside and line.startswith("  ") and not line.startswith("   "):
            name, _, text = line.strip().partition(" ")
            entries[name] = text
        elif inside and name and line.startswith(" "):
            entries[name] += " " + line.strip()  # an entry's second line
        else:
            inside = False
    return entries


@pytest.mark.parametrize("package", ["model", "checking", "search"])
def test_the_architecture_doc_names_every_module_of_the_model_checking_and_search(package):
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    entries = _doc_entries(doc, package)
    folder = ROOT / "kvbench" / package
    expected = ({p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
                | {f"{p.parent.name}/" for p in folder.glob("*/__init__.py")})
    assert set(entries) == expected  # a module with no line, or a line naming no module
    for sub in folder.glob("*/__init__.py"):  # a subpackage's line names its modules
        unnamed = [p.name for p in sub.parent.glob("*.py")
                   if p.name != "__init__.py" and p.name not in entries[f"{sub.parent.name}/"]]
        assert unnamed == [], f"docs/architecture.md's {package}/{sub.parent.name}/ line: {unnamed}"


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


def test_one_verdict_shape():
    # The checker's verdict and the quantization checker's read alike: valid, status, the first
    # failure of each kind (quantity, expected, actual, detail), first, explain(), as_dict().
    from kvbench.checking.verdict import Divergence, Verdict
    from kvbench.quant.check import QuantFailure, QuantVerdict

    d1 = Divergence("t", 3, 7, {"op": "free"}, "blocks_used", 2, 3, "one block kept")
    d2 = Divergence("t", 5, 9, {"op": "append"}, "kv of sequence 1", "zeros", "ones")
    q1 = QuantFailure("max_abs_error", (0, 4), 0.5, 0.75, "bound")
    q2 = QuantFailure("stored_bytes", None, 64, 72)
    failing = [
        (Verdict("t", "numpy", False, ops=6, divergence=d1,
                 divergences=[{"kind": "blocks_used", "first": d1, "count": 2, "stopped": False},
                              {"kind": "kv of sequence N", "first": d2, "count": 1, "stopped": True}]),
         (d1, d2)),
        (QuantVerdict(False, (q1, q2), scheme="int8"), (q1, q2)),
    ]
    for v, failures in failing:
        assert (v.valid, v.status) == (False, "FAIL")
        assert v.failures == failures and v.first is failures[0]
        assert v.quantities() == [f.quantity for f in failures]
        assert v.failure(failures[1].quantity) is failures[1] and v.failure("nothing") is None
        assert all(str(f) in v.explain() for f in failures), v.explain()
        assert v.as_dict()["valid"] is False
        for f in v.failures:
            assert {"quantity", "expected", "actual", "detail"} <= set(vars(f))
    # a verdict that stopped at its first divergence, without keep_going, has that one failure
    assert Verdict("t", "numpy", False, divergence=d1).failures == (d1,)
    for v in (Verdict("t", "numpy", True, ops=6), QuantVerdict(True, scheme="int8")):
        assert (v.valid, v.status, v.failures, v.first) == (True, "pass", (), None)
