"""What the default suite reaches, so that the next blind spot shows before a bug finds it.

For each workload of the default run (the committed ones and the generated boundary ones),
under each policy `kvbench run` replays it with, the oracle alone replays it (the NumPy pool's
capabilities, the run's settings) and reports the operations it holds and the edge conditions it
reaches: the fuzzer's (kvbench.search.fuzz.Watch: exact
fits, refusals, evictions, hits on block-aligned prompts, window releases, forks at partial
tails, wide decode steps, ...) and those below (a hit cut short by a sliding window, the
lifecycles, the tiers, the prompt namings). A condition no run reaches is flagged. With
``functions``, each default backend's runs are replayed under a profiler that records the
functions of impls/ they enter: per module, the functions the default run never enters.
"""
from __future__ import annotations

import ast
import sys
from collections import Counter, defaultdict
from pathlib import Path

from kvbench.analyses import suite
from kvbench.checking.applicable import applicable
from kvbench.checking.checker import check, oracle_for
from kvbench.contract import formulas as F
from kvbench.contract import registry
from kvbench.search.fuzz import EDGES, Watch
from kvbench.traces.tier_ops import Abort, Load, Store

IMPLS = Path(__file__).resolve().parents[2] / "impls"
CUT_HIT = "hit cut short by a window (a sliding, chunked or sinks group)"
# What the trace's operations say alone, beside what the replay reaches (EDGES, the fuzzer's:
# a failed transfer is one of those).
BY_OPS = {
    "fork": lambda op: op.kind == "fork",
    "rollback of drafts (accept)": lambda op: op.kind == "accept",
    "preemption": lambda op: op.kind == "preempt",
    "resume": lambda op: op.kind == "resume",
    "prompt written in chunks": lambda op: op.kind == "prefill" and op.prompt_tokens is not None,
    "prompt named by block hashes": lambda op: op.kind == "prefill" and bool(op.block_hashes),
    "prompt named by token ids": lambda op: op.kind == "prefill" and bool(op.token_ids),
    "salted prompt": lambda op: op.kind == "prefill" and bool(op.salt),
    "prompt with an adapter": lambda op: op.kind == "prefill" and bool(op.adapter),
    "tier store": lambda op: isinstance(op, Store),
    "tier load": lambda op: isinstance(op, Load),
    "aborted load": lambda op: isinstance(op, Abort),
}
CONDITIONS = EDGES + (CUT_HIT,) + tuple(BY_OPS)


def default_runs(paths=None) -> list:
    """(trace, config) of each run of the default suite's workloads, as `kvbench run` makes them."""
    traces = suite.load_traces(paths) if paths else suite.default_traces()
    return [(t, suite.config_for(t, policy=p)) for t in traces for p in suite.policies_for(t, "auto")]


def run_name(trace, config) -> str:
    return trace.name + (f"@{config.policy}" if config.policy else "")


def group_kinds(config) -> set:
    """The kinds of the run's model's groups (KVGroup.family): full, sliding, chunked, ..."""
    return {g.family for g in config.model.kv_groups}


def reached(trace, config, reference: str = "numpy") -> set:
    """The conditions of CONDITIONS one run reaches: the oracle replayed alone, as check()
    would hold ``reference`` to it (or, where ``reference`` runs no such model, the first
    default backend that does: numpy-compressed on a compressed model)."""
    backend = None
    for name in (reference, *registry.DEFAULT_BACKENDS):
        try:
            backend = registry.create(name, config)
            break
        except registry.BackendUnavailable:
            continue
    if backend is None:
        return set()
    try:
        if applicable(trace, backend):
            return set()
        oracle = oracle_for(trace, backend)
    finally:
        getattr(backend, "close", lambda: None)()
    found = set()
    plan = oracle._hit_plan

    def hit_plan(keys):  # a hit shorter than the full groups' cached run: a window cut it
        L, hits = plan(keys)
        if L and any(not rel for rel in oracle.releasing) and L < oracle.full_run(keys):
            found.add(CUT_HIT)
        return L, hits

    oracle._hit_plan = hit_plan
    watch = Watch(oracle, trace)
    v = check(trace, None, model=oracle, progress=watch)
    if v.valid is None:
        raise RuntimeError(f"{run_name(trace, config)}: the oracle could not replay it: {v.error}")
    found |= watch.reached
    for op in trace.ops:
        found |= {name for name, holds in BY_OPS.items() if name not in found and holds(op)}
    return found


def report(paths=None, functions: bool = False) -> dict:
    """The coverage of the default suite: per condition the runs reaching it, per operation kind
    the operations and workloads, and (``functions``) per module of impls/ the functions no
    default backend's run enters."""
    runs = default_runs(paths)
    edges = {c: [] for c in CONDITIONS}
    kinds = sorted({k for _, config in runs for k in group_kinds(config)}, key=F.KIND_FAMILIES.index)
    by_kind = {c: Counter() for c in CONDITIONS}
    ops, op_workloads = Counter(), defaultdict(set)
    for trace, config in runs:
        for c in reached(trace, config):
            edges[c].append(run_name(trace, config))
            by_kind[c].update(group_kinds(config))
    for trace in {id(t): t for t, _ in runs}.values():
        for op in trace.ops:
            ops[op.kind] += 1
            op_workloads[op.kind].add(trace.name)
    rep = {"runs": len(runs), "edges": edges, "kinds": kinds, "by kind": by_kind,
           "ops": {k: (ops[k], sorted(op_workloads[k])) for k in sorted(ops)},
           "not reached": [c for c in CONDITIONS if not edges[c]],
           "not reached on": {c: [k for k in kinds if not by_kind[c][k]] for c in CONDITIONS}}
    if functions:
        rep["functions"] = function_coverage(runs)
    return rep


def defined_functions(path: Path) -> list:
    """(qualified name, first line) of every function and method a module of impls/ defines."""
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child.lineno))
                walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
    walk(ast.parse(path.read_text()), "")
    return out


def function_coverage(runs, backends=None) -> dict:
    """Per module of impls/ (its engines left out): the functions it defines and those none of
    the default backends' runs entered, by (first line, qualified name)."""
    entered = set()  # (file, first line)

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(str(IMPLS)):
                entered.add((code.co_filename, code.co_firstlineno))

    for name in backends or registry.DEFAULT_BACKENDS:
        for trace, config in runs:
            try:
                backend = registry.create(name, config)
            except (NotImplementedError, registry.BackendUnavailable):
                continue
            sys.setprofile(profile)
            try:
                check(trace, backend)
            finally:
                sys.setprofile(None)
                getattr(backend, "close", lambda: None)()
    out = {}
    for path in sorted(IMPLS.glob("*.py")):
        if path.name == "__init__.py":
            continue
        defined = defined_functions(path)
        never = [q for q, line in defined if (str(path), line) not in entered]
        out[path.name] = {"defined": len(defined), "never": never}
    return out


def markdown(rep: dict, provenance: str) -> str:
    lines = ["# What the default suite reaches", "", provenance, "",
             f"Each of the {rep['runs']} runs of `kvbench run` (a committed workload under a policy its "
             "header implies) replayed by the oracle alone. A condition no run reaches is **not reached**: "
             "a bug that shows only there passes the default run.", "",
             "The runs by the attention kinds of their model's groups (a run on a model of a full and a "
             "sliding group counts under both); 0: no run on a model with that kind reaches it.", "",
             "| edge condition | runs reaching it | " + " | ".join(rep["kinds"]) + " | workloads |",
             "|---|---|" + "---|" * len(rep["kinds"]) + "---|"]
    for c, names in rep["edges"].items():
        shown = ", ".join(sorted({n.split("@")[0] for n in names})) if names else "**not reached**"
        counts = " | ".join(str(rep["by kind"][c][k]) for k in rep["kinds"])
        lines.append(f"| {c} | {len(names)} | {counts} | {shown} |")
    lines += ["", "| operation | in the suite | workloads |", "|---|---|---|"]
    lines += [f"| {k} | {n} | {len(w)} |" for k, (n, w) in rep["ops"].items()]
    if "functions" in rep:
        lines += ["", "Functions of impls/ that no default backend's run enters (engines left out):", "",
                  "| module | functions | never entered |", "|---|---|---|"]
        lines += [f"| {m} | {f['defined']} | {', '.join(f['never']) or '-'} |"
                  for m, f in rep["functions"].items()]
    return "\n".join(lines) + "\n"


def edges_csv(rep: dict) -> str:
    rows = ["condition,runs," + ",".join(rep["kinds"]) + ",workloads"]
    rows += [f'"{c}",{len(n)},' + ",".join(str(rep["by kind"][c][k]) for k in rep["kinds"])
             + f',"{" ".join(sorted(n))}"' for c, n in rep["edges"].items()]
    return "\n".join(rows) + "\n"


__all__ = ["CONDITIONS", "default_runs", "reached", "report", "markdown", "edges_csv",
           "function_coverage", "defined_functions"]
