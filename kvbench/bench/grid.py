"""The grid of `kvbench sweep`: traces x backends x settings x seeds, expanded into cells.

A grid file (TOML, or YAML where PyYAML is installed)::

    name = "block-budget"                 # the sweep (default: the file's stem)
    backends = ["numpy", "contiguous-pow2"]
    seeds = [0, 1]                        # seeds of generated traces (trace files have their own)

    [[traces]]
    workload = "decode-stream"            # committed workloads by name or glob ("*", "fork-*")
    [[traces]]
    path = "my-trace.jsonl"               # any trace file, relative to the grid file
    [[traces]]
    family = "fork_trees"                 # a generator (kvbench gen --family) ...
    params = { mode = "beam" }            # ... its fixed parameters ...
    vary = { width = [2, 4] }             # ... and swept ones: each an axis of the grid
    [[traces]]
    loader = "mooncake"                   # a real trace through its loader (kvbench.traces.loaders)
    path = "synthetic_trace.jsonl"        # replayed as a prefix-cache trace at the cell's block
    options = {}                          # size (every prompt prefilled, then freed), first
    max_requests = 200                    # max_requests requests

    [settings]                            # a value, or a list of values (an axis)
    block_size = [8, 16, 32]
    budget = ["4KiB", "8KiB"]
    policy = "none"                       # "auto"/"all": the policies kvbench run would use
    store_kv = false                      # with gather = "none": ledger only, no K/V compared
    gather = "none"

    [[exclude]]                           # drop the cells matching every key (a list: any of)
    backend = "contiguous-pow2"
    block_size = 8
    [[include]]                           # add cells: the keys named take these values, the
    backend = "python-objects"            # others range over the grid's axes (exclude rules do
    block_size = 16                       # not apply to them)

    [[charts]]                            # drawn after the sweep (kvbench.bench.sweep_charts)
    kind = "heatmap"                      # heatmap: metric over x and y, one panel per backend
    x = "block_size"                      # lines: metric against x, one line per backend
    y = "budget"
    metric = "mean_fragmentation"

    [resources]                           # per cell, for the Ray executor (num_gpus is 1 by
    num_cpus = 1                          # default for cells whose device setting is cuda)

Settings are passed through by name: those that are parameters of
:func:`kvbench.analyses.suite.config_for` go there, ``gather`` (and any later parameter of
:func:`~kvbench.analyses.suite.run_one`) to the replay; a name neither knows is refused. A setting
added to ``config_for`` later is a grid setting at once.

A backend ``route:POLICY`` (kvbench.routing) makes routed cells: the trace served by ``replicas``
(a setting of those cells only) replicas behind that router, its totals the record.

A cell's id is a content hash of (trace, backend, settings, seed, code): the code is the commit,
plus a hash of the uncommitted diff when the tree is dirty. Running cells is kvbench.bench.sweep's.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import inspect
import itertools
import json
import math
import re
import subprocess
from pathlib import Path

from kvbench.bench import records
from kvbench import provenance
from kvbench.analyses import suite
from kvbench.contract import registry
from kvbench.outputs import name_problem
from kvbench.routing.route import routed_policy
from kvbench.analyses.settings import POLICIES, RunSettings, flag, one_of
from kvbench.traces.format import Trace, load

# What a cell's code version covers: edits elsewhere (docs, results) leave finished cells valid.
CODE_PATHS = ("kvbench", "impls", "pyproject.toml")
GRID_KEYS = ("name", "backends", "seeds", "traces", "settings", "include", "exclude", "charts",
             "resources")
TRACE_KEYS = {"workload": ("name",), "path": ("name",), "family": ("name", "params", "vary"),
              "loader": ("name", "path", "options", "max_requests")}


def known_settings() -> dict[str, str]:
    """Setting name -> 'config' (a field of RunSettings, or the policy) or 'run' (a setting of
    suite.run_one)."""
    return {**{name: "config" for name in RunSettings.names()}, "policy": "config",
            **{name: "run" for name in RUN_SETTINGS}}


# The settings of how a run checks (suite.run_one), beside RunSettings' fields.
def _seconds(v) -> str:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    return "" if ok else "must be a number of seconds >= 0 (0: no limit)"


def _replicas(v) -> str:
    return "" if isinstance(v, int) and not isinstance(v, bool) and v > 0 else "must be a positive integer"


RUN_SETTINGS = {"gather": one_of("touched", "all", "end", "none"), "keep_going": flag,
                "op_timeout": _seconds,
                "replicas": _replicas}  # a routed cell's (backend "route:POLICY", kvbench.routing)
POLICY_SETTING = one_of("auto", "all", "none", *POLICIES)


def setting_problem(name: str, value) -> str:
    """Why ``value`` is not a value of setting ``name`` ('' when it is): a grid is typed before
    its first cell runs."""
    if name == "policy":
        return POLICY_SETTING(value)
    if name in RUN_SETTINGS:
        return RUN_SETTINGS[name](value)
    return RunSettings.problem(name, value)


class GridError(ValueError):
    def __init__(self, source, reason: str):
        super().__init__(f"{source}: {reason}")


# --- traces --------------------------------------------------------------------------------------


@dataclasses.dataclass
class TraceSource:
    """Where a grid's trace comes from; ``build`` makes it for one cell's seed, parameters and
    block size (a loader's block hashes are cut at the cell's block size)."""

    name: str
    kind: str  # file | family | loader
    path: str | None = None
    family: str | None = None
    params: dict = dataclasses.field(default_factory=dict)
    vary: dict = dataclasses.field(default_factory=dict)  # generator parameter -> values
    loader: str | None = None
    options: dict = dataclasses.field(default_factory=dict)
    max_requests: int | None = None

    @property
    def seeded(self) -> bool:
        if self.kind == "family":
            return True
        if self.kind == "loader":
            from kvbench.traces.loaders import LOADERS
            return "seed" in inspect.signature(LOADERS[self.loader]).parameters
        return False

    def build(self, seed, params: dict, block_size) -> Trace:
        if self.kind == "file":
            return load(self.path)
        if self.kind == "family":
            from kvbench.traces.generators import generate
            trace = generate(self.family, seed=seed, **self.params, **params)
            trace.name = self.name
            return trace
        from kvbench.analyses.prefix import cache_trace
        from kvbench.traces.loaders import load_requests
        opts = dict(self.options, **({"seed": seed} if self.seeded else {}))
        requests = load_requests(self.path, self.loader, **opts)[:self.max_requests]
        return cache_trace(requests, int(block_size or 16), name=self.name)


def _trace_sources(entries, base: Path, where: str) -> list[TraceSource]:
    if not isinstance(entries, list) or not entries:
        raise GridError(where, "'traces' must be a non-empty list of tables ([[traces]])")
    out = []
    for i, e in enumerate(entries):
        at = f"{where}: traces[{i}]"
        if not isinstance(e, dict):
            raise GridError(at, "a trace is a table of keys")
        kinds = ["loader"] if "loader" in e else [k for k in ("workload", "path", "family") if k in e]
        if len(kinds) != 1:
            raise GridError(at, f"name exactly one of workload, path, family, loader (got {kinds or 'none'})")
        kind = kinds[0]
        allowed = {kind, *TRACE_KEYS[kind]}
        unknown = sorted(set(e) - allowed)
        if unknown:
            raise GridError(at, f"unknown key(s) {unknown} for a {kind} trace; known: {sorted(allowed)}")
        if kind == "workload":
            files = sorted(p for p in suite.committed_workloads() if fnmatch.fnmatch(p.stem, e["workload"]))
            if not files:
                raise GridError(at, f"no committed workload matches {e['workload']!r} "
                                    f"(known: {', '.join(p.stem for p in suite.committed_workloads())})")
            out += [TraceSource(p.stem, "file", path=str(p)) for p in files]
        elif kind == "path":
            p = base / e["path"]
            if not p.is_file():
                raise GridError(at, f"no trace file {p}")
            out.append(TraceSource(e.get("name", p.stem), "file", path=str(p)))
        elif kind == "family":
            from kvbench.traces.generators import FAMILIES
            if e["family"] not in FAMILIES:
                raise GridError(at, f"unknown family {e['family']!r}; known: {', '.join(FAMILIES)}")
            vary = e.get("vary", {})
            bad = [k for k, v in vary.items() if not isinstance(v, list) or not v]
            if bad:
                raise GridError(at, f"vary: {bad} must be non-empty lists of values")
            out.append(TraceSource(e.get("name", e["family"]), "family", family=e["family"],
                                   params=dict(e.get("params", {})), vary=dict(vary)))
        else:
            from kvbench.traces.loaders import LOADERS
            if e["loader"] not in LOADERS:
                raise GridError(at, f"unknown loader {e['loader']!r}; known: {', '.join(LOADERS)}")
            if "path" not in e or not (base / e["path"]).is_file():
                raise GridError(at, f"a loader trace needs the path of an existing file (got {e.get('path')!r})")
            out.append(TraceSource(e.get("name", Path(e["path"]).stem), "loader", path=str(base / e["path"]),
                                   loader=e["loader"], options=dict(e.get("options", {})),
                                   max_requests=e.get("max_requests")))
    return out


# --- the grid ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Grid:
    name: str
    traces: list
    backends: list
    seeds: list
    settings: dict  # name -> list of values (an axis of one value when fixed)
    include: list
    exclude: list
    charts: list
    resources: dict
    text: str = ""
    source: str = "<grid>"


def _as_list(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def parse_grid(data: dict, *, base: Path = Path("."), name: str = "sweep", text: str = "",
               source: str = "<grid>") -> Grid:
    unknown = sorted(set(data) - set(GRID_KEYS))
    if unknown:
        raise GridError(source, f"unknown key(s) {unknown}; known: {', '.join(GRID_KEYS)}")
    if not data.get("backends"):
        raise GridError(source, "'backends' must name at least one backend")
    known = known_settings()
    settings = data.get("settings", {})
    bad = sorted(set(settings) - set(known))
    if bad:
        raise GridError(source, f"unknown setting(s) {bad}; known: {', '.join(known)}")
    for key, values in settings.items():
        for i, v in enumerate(_as_list(values)):
            why = setting_problem(key, v)
            if why:
                raise GridError(source, f"settings.{key}[{i}]: {why}, got {v!r}")
    traces = _trace_sources(data.get("traces"), base, source)
    _check_names(data, text, source)
    seeds = _as_list(data.get("seeds", [0]))
    if len(seeds) > 1 and not any(t.seeded for t in traces):
        raise GridError(f"{source}{_line_of(text, 'seeds')}",
                        f"seeds = {seeds}: no trace of this grid takes a seed (committed workloads "
                        f"and trace files are fixed, and so is a loader without one), so every "
                        f"seed would be the same cell; drop seeds, or add a generated trace "
                        f"([[traces]] family = ...)")
    grid = Grid(name=str(data.get("name", name)), traces=traces, backends=_as_list(data["backends"]),
                seeds=seeds,
                settings={k: _as_list(v) for k, v in settings.items()},
                include=list(data.get("include", [])), exclude=list(data.get("exclude", [])),
                charts=list(data.get("charts", [])), resources=dict(data.get("resources", {})),
                text=text, source=source)
    axes = {"trace", "backend", "seed", *known, *(k for t in traces for k in t.vary)}
    for kind in ("include", "exclude"):
        for i, rule in enumerate(getattr(grid, kind)):
            bad = sorted(set(rule) - axes)
            if bad or not rule:
                raise GridError(source, f"{kind}[{i}]: {'empty rule' if not rule else f'unknown key(s) {bad}'}; "
                                        f"keys: {', '.join(sorted(axes))}")
    return grid


def _line_of(text: str, key: str, value=None) -> str:
    """':N', the line of ``text`` that sets ``key`` (to ``value`` where given; TOML or YAML), or
    '' where none does."""
    value = ".*?" if value is None else re.escape(str(value))
    pattern = re.compile(rf"""^\s*{re.escape(key)}\s*[=:]\s*["']?{value}["']?\s*(#.*)?$""")
    return next((f":{n}" for n, line in enumerate(text.splitlines(), 1) if pattern.match(line)), "")


def _check_names(data: dict, text: str, source: str) -> None:
    """The sweep's name and its charts' become file names (the charts' folder, each chart):
    each is one plain name, never a path out of the folder (``../``, absolute)."""
    named = [("name", data["name"])] if "name" in data else []
    named += [(f"charts[{i}].name", c["name"]) for i, c in enumerate(data.get("charts") or [])
              if isinstance(c, dict) and "name" in c]
    for where, value in named:
        why = name_problem(str(value))
        if why:
            raise GridError(f"{source}{_line_of(text, 'name', value)}",
                            f"{where} {value!r} {why}: it names files of the sweep; give a plain name")


def load_grid(path) -> Grid:
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml
        data = yaml.safe_load(text)
    else:
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise GridError(path, str(e)) from None
    if not isinstance(data, dict):
        raise GridError(path, "a grid is a table of keys")
    return parse_grid(data, base=path.parent, name=path.stem, text=text, source=str(path))


# --- cells ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Cell:
    sweep: str
    trace: str
    trace_key: str  # the trace's content hash: its key among the traces shipped to workers
    backend: str
    seed: int | None
    params: dict  # swept generator parameters
    settings: dict
    code: str
    resources: dict
    id: str = ""

    def __post_init__(self):
        if not self.id:
            what = {"trace": self.trace, "trace_sha": self.trace_key, "backend": self.backend,
                    "settings": self.settings, "seed": self.seed, "code": self.code}
            self.id = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]

    def columns(self) -> dict:
        """The cell's parameters by name: trace, seed, generator parameters, backend, settings."""
        return {"trace": self.trace, "seed": self.seed, **self.params, "backend": self.backend,
                **self.settings}


def parameter_columns(df) -> list[str]:
    """The parameter columns of stored cells (each record lists its own in ``parameters``)."""
    names: dict = {}
    for text in df.get("parameters", []):
        names.update(dict.fromkeys(str(text).split(",")))
    return [n for n in names if n in df.columns]


def code_version(root: Path = records.REPO_ROOT) -> dict:
    """The commit, and ``code``: the commit plus a hash of the uncommitted diff when dirty."""
    info = provenance.commit_info(root)
    code = info["commit"]

    def git(*args) -> bytes:
        try:
            return subprocess.run(["git", *args, "--", *CODE_PATHS], cwd=root, capture_output=True,
                                  timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return b""
    h = hashlib.sha256(git("diff", "HEAD"))
    new = git("ls-files", "--others", "--exclude-standard").decode().split()
    for name in new:  # a module not yet committed is code all the same
        h.update(name.encode() + b"\0" + (root / name).read_bytes())
    if h.digest() != hashlib.sha256(b"").digest():
        code += "+" + h.hexdigest()[:12]
    return {**info, "dirty": code != info["commit"], "code": code}


def _matches(rule: dict, values: dict) -> bool:
    return all(k in values and any(str(values[k]) == str(v) if k != "trace"
                                   else fnmatch.fnmatch(str(values[k]), str(v)) for v in _as_list(want))
               for k, want in rule.items())


def expand(grid: Grid, code: str) -> tuple[list[Cell], dict]:
    """The grid's cells, in a stable order, and the traces they replay by content hash."""
    built: dict = {}
    traces: dict = {}

    def trace_for(src: TraceSource, seed, params, block_size):
        key = (src.name, src.path, src.family, json.dumps(params, sort_keys=True), seed,
               block_size if src.kind == "loader" else None)
        if key not in built:
            t = src.build(seed, params, block_size)
            sha = hashlib.sha256(t.to_jsonl().encode()).hexdigest()
            traces.setdefault(sha, t)
            built[key] = sha
        return built[key]

    def cells_of(src: TraceSource, axes: dict) -> list[Cell]:
        out = []
        seeds = axes.pop("seed") if src.seeded else [None]
        axes.pop("seed", None)
        vary = {k: axes.pop(k) for k in list(axes) if k in src.vary}
        backends = axes.pop("backend")
        names = list(axes)
        for seed, vals, sets, backend in itertools.product(
                seeds, itertools.product(*vary.values()), itertools.product(*axes.values()), backends):
            params, settings = dict(zip(vary, vals)), dict(zip(names, sets))
            sha = trace_for(src, seed, params, settings.get("block_size"))
            for pol in _policies(traces[sha], settings.get("policy")):
                s = dict(settings, **({"policy": pol} if "policy" in settings else {}))
                res = dict(grid.resources)
                if s.get("device") == "cuda":
                    res.setdefault("num_gpus", 1)
                out.append(Cell(grid.name, src.name, sha, backend, seed, params, s, code, res))
        return out

    def grid_axes(src):
        return {"seed": grid.seeds, **src.vary, **grid.settings, "backend": grid.backends}

    cells = [c for src in grid.traces for c in cells_of(src, grid_axes(src))
             if not any(_matches(rule, c.columns()) for rule in grid.exclude)]
    generator_params = {k for t in grid.traces for k in t.vary}
    for i, rule in enumerate(grid.include):
        added = 0
        for src in grid.traces:
            if "trace" in rule and not _matches({"trace": rule["trace"]}, {"trace": src.name}):
                continue
            if any(k in generator_params and k not in src.vary for k in rule):
                continue  # names a generator parameter this trace does not have
            axes = grid_axes(src)
            axes.update({k: _as_list(v) for k, v in rule.items() if k != "trace"})
            new = cells_of(src, axes)
            cells += new
            added += len(new)
        if not added:
            raise GridError(grid.source, f"include[{i}] {rule} matches no trace")
    unique = list({c.id: c for c in cells}.values())
    return unique, {c.trace_key: traces[c.trace_key] for c in unique}


def check_cells(grid: Grid, cells: list, traces: dict) -> None:
    """Before the first cell runs: the grid has cells, each names a backend kvbench resolves, and
    its settings make a configuration for its trace; else a GridError naming what is wrong."""
    if not cells:
        raise GridError(grid.source, "no cells: the exclude rules remove every one")
    for name in dict.fromkeys(c.backend for c in cells):
        try:
            if routed_policy(name) is None:
                registry.resolve(name)
        except ValueError as e:
            raise GridError(grid.source, f"backends: {e}") from None
    for c in cells:
        if "replicas" in c.settings and routed_policy(c.backend) is None:
            raise GridError(grid.source, f"cell {c.columns()}: 'replicas' is a setting of routed "
                                         f"cells (backend \"route:POLICY\"), not of {c.backend}")
    where, tried = known_settings(), set()
    for c in cells:
        kwargs = {k: (None if k == "policy" and v == "none" else v) for k, v in c.settings.items()
                  if where[k] == "config"}
        key = (c.trace_key, json.dumps(kwargs, sort_keys=True, default=str))
        if key in tried:
            continue
        tried.add(key)
        try:
            suite.config_for(traces[c.trace_key], **kwargs)
        except ValueError as e:
            raise GridError(grid.source, f"cell {c.columns()}: {e}") from None


def _policies(trace: Trace, policy) -> list:
    if policy not in ("auto", "all"):
        return [policy]
    return [p or "none" for p in suite.policies_for(trace, policy)]




__all__ = ["Grid", "Cell", "GridError", "TraceSource", "load_grid", "parse_grid", "expand", "check_cells",
           "known_settings", "code_version", "parameter_columns"]
