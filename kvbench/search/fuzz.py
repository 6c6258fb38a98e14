"""Fuzzing a backend (`kvbench fuzz`): random histories over random settings under the checker,
every failure shrunk to a small trace and a pytest case, with what the campaign reached.

A campaign draws history after history (kvbench.search.histories: only what the
backend's capabilities declare). For each it replays the trace through the oracle alone under a
budget no operation can exhaust to find its peak demand, sets the budget against that peak as
the history's settings say (exact fit, one block short, one over, tight, roomy), replays the
oracle alone again under that budget watching which edge conditions the history reaches
(kvbench.search.watch.Watch), then checks the backend. A failure is classified by its divergence kind
(kvbench.search.reproduce.divergence_kind: the quantity, or the exception type) and the
operation it happened at; the first of each class is shrunk (kvbench.search.shrink) and
written as NAME.min.jsonl and test_NAME_min.py, later ones only counted. The summary (JSON and
markdown) is rewritten after each new finding and at the end, so Ctrl-C loses nothing found.

Under the same seed the same histories come in the same order; with a history budget
(``max_histories``) and shrinking bounded by attempts, the findings are the same too.
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.checking.checker import check, oracle_for
from kvbench.contract.protocol import CacheConfig, Capabilities, takes_lifecycle, takes_lookup
from kvbench.contract.registry import BackendEntry, BackendUnavailable
from kvbench.model.oracle import Oracle
from kvbench.model.tiers import evictless_modes
from kvbench.outputs import write_text
from kvbench.search.histories import GENERATOR, KV_FORMATS, LIFECYCLES, OP_KINDS, random_history
from kvbench.search.reproduce import divergence_kind, failure_trace, jsonable, settings_of
from kvbench.search.shrink import shrink
from kvbench.search.watch import EDGES, Watch
from kvbench.traces.builder import peak_blocks
from kvbench.traces.format import Trace

DEFAULT_SHRINK_SECONDS = 120.0
DEFAULT_SHRINK_ATTEMPTS = 3000


class _Peak:
    """A progress sink for an oracle-only check(): the most blocks in use after any operation
    (a contiguous arena: its slots not free, in blocks)."""

    def __init__(self, oracle: Oracle):
        self.o, self.blocks = oracle, 0

    def update(self, _n: int = 1) -> None:
        o = self.o
        if o.layout == "paged":
            used = o.blocks_used
        else:
            led = o.expected_ledger(())
            used = -(-(o.config.arena_slots - led.free - led.external_fragmentation) // o.B)
        self.blocks = max(self.blocks, used)


def _peak(trace: Trace, backend) -> int:
    """The most blocks the history holds at once under a budget nothing exhausts (every
    sequence at its longest, sharing ignored) and no eviction policy."""
    config = backend.config
    B, G = config.block_size, len(config.model.kv_groups)
    roomy = (peak_blocks(trace.ops, B) + len(trace.final_lengths()) * -(-config.max_context // B)) * G + 1
    config = dataclasses.replace(config, num_blocks=roomy, policy=None)
    sink = _Peak(oracle_for(trace, _Configured(backend.name, backend.capabilities, config)))
    check(trace, None, model=sink.o, progress=sink)
    return max(1, sink.blocks)


@dataclass
class _Configured:
    """A backend's name, capabilities and settings: what oracle_for reads of a backend."""

    name: str
    capabilities: Capabilities
    config: CacheConfig


def budget_for(mode: str, peak: int, tight: float, own: int | None = None) -> int:
    """The budget of a history set ``mode`` against its ``peak`` (``tight`` in [0, 1) places a
    tight one between a block and the peak; ``own``: the budget a family's trace was built for)."""
    if mode == "as generated":
        return own
    return max(1, {"exact": peak, "one short": peak - 1, "one over": peak + 1,
                   "tight": 1 + int(tight * peak), "roomy": 2 * peak}[mode])


@dataclass
class Finding:
    """One class of failure: its kind and site, the first history that showed it, how often."""

    name: str
    kind: str
    site: str
    history: int
    divergence: dict
    settings: dict
    count: int = 1
    ops_before: int = 0
    ops_after: int | None = None
    shrink: dict = field(default_factory=dict)
    files: list = field(default_factory=list)


@dataclass
class Campaign:
    """A fuzzing campaign of one backend (``entry``), its findings written into ``out``."""

    entry: BackendEntry
    out: Path
    seed: int = 0
    max_histories: int | None = None
    seconds: float | None = None
    shrink_seconds: float = DEFAULT_SHRINK_SECONDS
    shrink_attempts: int = DEFAULT_SHRINK_ATTEMPTS
    gather: str = "touched"
    first: bool = False  # stop at the first finding (measuring how soon a fault shows)
    model_shapes: bool = True  # models from the presets and random mixes of kinds too (False:
    # tiny and tiny-hybrid's full / sliding mixes only, `kvbench fuzz --base-model-only`)
    progress: object = None  # kvbench.progress.Progress, or anything with update() and note()
    findings: dict = field(default_factory=dict)
    coverage: dict = field(default_factory=lambda: {k: Counter() for k in
                                                    ("ops", "op kinds", "groups", "settings", "edges")})
    histories: int = 0
    ops: int = 0
    not_applicable: Counter = field(default_factory=Counter)
    errors: list = field(default_factory=list)
    lifecycles: tuple = ()  # SPEC §13's the backend takes (read with its capabilities)
    formats: tuple = ()  # the KV formats it declares (read with its capabilities)
    lookups: bool = False  # whether it takes SPEC §11's lookups (read with its capabilities)
    evictless: tuple = ()  # the failed_load modes it runs on a tier evicting nothing (likewise)
    stopped: str = ""
    stop: BaseException | None = field(default=None, repr=False)  # the Ctrl-C or SIGTERM
    elapsed: float = 0.0
    _caps: dict = field(default_factory=dict, repr=False)

    def capabilities(self, prefix_caching: bool = True) -> Capabilities:
        """What the backend declares (an instance may declare per its settings: read once each)."""
        if prefix_caching not in self._caps:
            backend = self.entry.create(dataclasses.replace(_BASE, prefix_caching=prefix_caching))
            try:
                self._caps[prefix_caching] = backend.capabilities
                if prefix_caching:
                    # preempt by recompute is a free and a prefill: every backend takes it
                    self.lifecycles = tuple(name for name in LIFECYCLES if name == "preempt"
                                            or takes_lifecycle(backend, name))
                    self.lookups = takes_lookup(backend)
                    self.evictless = evictless_modes(backend.capabilities.tier_rules)
                    self.formats = self.declared_formats()
            finally:
                getattr(backend, "close", lambda: None)()
        return self._caps[prefix_caching]

    def declared_formats(self) -> tuple:
        """The KV formats of :data:`KV_FORMATS` the backend runs: made with one, it is
        quantized and keeps it (a pool of one format keeps its own whatever it is given; a pool
        without formats is not quantized; one that refuses a format raises)."""
        out = []
        for fmt in KV_FORMATS:
            try:
                backend = self.entry.create(dataclasses.replace(_BASE, kv_format=fmt))
            except BackendUnavailable:
                continue
            try:
                if backend.capabilities.quantized and backend.config.kv_format == fmt:
                    out.append(fmt)
            finally:
                getattr(backend, "close", lambda: None)()
        return tuple(out)

    def run(self) -> Campaign:
        """History after history until the budget is spent or Ctrl-C; returns itself."""
        self.out.mkdir(parents=True, exist_ok=True)
        caps = self.capabilities()
        start = time.monotonic()
        self.stopped = "max-histories"
        try:
            while self.max_histories is None or self.histories < self.max_histories:
                if self.first and self.findings:
                    self.stopped = "first finding"
                    break
                if self.seconds is not None and time.monotonic() - start >= self.seconds:
                    self.stopped = "time"
                    break
                self.one(self.histories, caps)
                self.histories += 1
                self.elapsed = time.monotonic() - start
                self._report()
        except KeyboardInterrupt as e:
            self.stopped, self.stop = "interrupted", e
        self.elapsed = time.monotonic() - start
        self.write_summary()
        return self

    def one(self, index: int, caps: Capabilities) -> None:
        trace, settings, drawn = random_history(self.seed, index, caps, self.lifecycles, self.model_shapes,
                                                self.formats, self.lookups, self.evictless)
        cov = self.coverage
        cov["op kinds"].update(drawn)
        cov["ops"].update(op.kind for op in trace.ops)
        cov["groups"].update({k.split("(")[0] for k in settings.kinds()})
        cov["settings"].update([f"block size {settings.block_size}", f"model {settings.model}",
                                f"policy {settings.policy or 'none'}", f"budget {settings.budget}"]
                               + ["prefix caching"] * settings.prefix_caching
                               + ["salts and adapters"] * settings.keyed
                               + [f"tiers {'+'.join(t.name for t in settings.tiers)}"] * bool(settings.tiers)
                               + [f"lifecycle {name}" for name in settings.lifecycles]
                               + [f"shape {settings.shape}"] * bool(settings.shape)
                               + [f"kv format {settings.kv_format}"] * bool(settings.kv_format))
        peak = _peak(trace, _Configured(self.entry.name, self.capabilities(settings.prefix_caching),
                                        dataclasses.replace(settings.config(1), **self.entry.overrides)))
        config = settings.config(budget_for(settings.budget, peak, settings.tight, settings.own_blocks))
        try:
            backend = self.entry.create(config)
        except BackendUnavailable as e:
            self.not_applicable[f"settings refused: {str(e)[:80]}"] += 1
            return
        try:
            watch = Watch(oracle_for(trace, backend), trace)
            seen = check(trace, None, model=watch.o, progress=watch)
            if seen.valid is None:
                self.errors.append({"history": index, "error": seen.error})
                return
            cov["edges"].update(watch.reached)
            v = check(trace, backend, gather=self.gather)
        finally:
            getattr(backend, "close", lambda: None)()
        self.ops += v.ops
        if v.valid is None:
            if v.not_applicable:
                self.not_applicable[v.not_applicable[:100]] += 1
            else:
                self.errors.append({"history": index, "error": v.error})
            return
        if not v.valid:
            self.found(trace, config, v.divergence, index)

    def found(self, trace: Trace, config, d, index: int) -> None:
        kind = divergence_kind(d)
        site = d.op.get("op", "?")
        key = f"{re.sub(r'[0-9]+', 'N', kind)} @ {site}"  # block ids left out, as the checker's classes
        if key in self.findings:
            self.findings[key].count += 1
            return
        name = f"{len(self.findings) + 1:02d}-{_slug(kind)}-{site}"
        f = Finding(name, kind, site, index, jsonable(d), settings_of(config), ops_before=len(trace))
        self.findings[key] = f
        self._report(f"shrinking {name}")
        result = shrink(trace, self.entry.create, config, gather=self.gather,
                        max_seconds=self.shrink_seconds, max_attempts=self.shrink_attempts,
                        backend=self.entry.name, source=f"kvbench fuzz seed {self.seed} history {index}")
        f.shrink = {k: v for k, v in result.as_record().items() if k != "trace"}
        original = self.out / f"{name}.jsonl"  # under the settings it failed with
        write_text(original, failure_trace(trace, config, d, backend=self.entry.name,
                                           generator=GENERATOR, source=trace.header.params).to_jsonl())
        f.files.append(original.name)
        if result.ok:
            f.ops_after = len(result.trace)
            f.settings = settings_of(result.shrunk_config)
            mini = self.out / f"{name}.min.jsonl"
            test = self.out / f"test_{name.replace('-', '_')}_min.py"
            write_text(mini, result.trace.to_jsonl())
            write_text(test, result.pytest_source(self.entry.create))
            f.files += [mini.name, test.name]
        self.write_summary()
        if result.stopped == "interrupted":
            raise KeyboardInterrupt

    def _report(self, doing: str = "") -> None:
        if self.progress is None:
            return
        rate = self.ops / self.elapsed if self.elapsed else 0.0
        by_kind = ", ".join(f"{f.kind} x{f.count}" for f in self.findings.values())
        self.progress.note(f"{rate:,.0f} ops/s, {len(self.findings)} found"
                           + (f" ({by_kind})" if by_kind else "") + (f"; {doing}" if doing else ""))
        if not doing:
            self.progress.update(1)

    # --- the summary -----------------------------------------------------------------------

    def summary(self) -> dict:
        minutes = self.elapsed / 60
        edges = self.coverage["edges"]
        return {
            "backend": self.entry.name, "seed": self.seed, "model_shapes": self.model_shapes,
            "kv_formats": list(self.formats),
            "stopped": self.stopped,
            "histories": self.histories, "operations": self.ops, "seconds": round(self.elapsed, 2),
            "histories_per_minute": round(self.histories / minutes, 1) if minutes else None,
            "ops_per_second": round(self.ops / self.elapsed, 1) if self.elapsed else None,
            "findings": [dataclasses.asdict(f) for f in self.findings.values()],
            "not_applicable": dict(self.not_applicable), "errors": self.errors,
            "coverage": {"ops": dict(self.coverage["ops"]), "op kinds": dict(self.coverage["op kinds"]),
                         "op kinds not drawn": [k.name for k in OP_KINDS
                                                if k.name not in self.coverage["op kinds"]],
                         "groups": dict(self.coverage["groups"]),
                         "settings": dict(sorted(self.coverage["settings"].items())),
                         "edges": {e: edges.get(e, 0) for e in EDGES},
                         "edges not reached": [e for e in EDGES if not edges.get(e)]},
        }

    def write_summary(self) -> None:
        s = self.summary()
        write_text(self.out / "summary.json", json.dumps(s, indent=1) + "\n")
        write_text(self.out / "summary.md", summary_markdown(s))


def summary_markdown(s: dict) -> str:
    missed = s["coverage"]["edges not reached"]
    lines = [f"# kvbench fuzz: {s['backend']}", "",
             f"Seed {s['seed']}: {s['histories']} histories, {s['operations']:,} operations in "
             f"{s['seconds']:.0f} s ({s['histories_per_minute']} histories per minute), stopped by "
             f"{s['stopped']}. " + (f"{len(s['findings'])} kinds of failure found." if s["findings"]
                                 else "Nothing found: the coverage below says what was tried."), "",
             f"Edge conditions reached (each counted only where it acted): "
             f"{len(s['coverage']['edges']) - len(missed)} of {len(s['coverage']['edges'])}."
             + (f" Not reached, so not tested: {'; '.join(missed)}." if missed else ""), "",
             "Models: " + ("the presets' patterns and random mixes of the kinds declared"
                           if s["model_shapes"] else "tiny and tiny-hybrid only (--base-model-only)")
             + "; KV formats: " + (", ".join(s["kv_formats"]) or "none declared") + ".", ""]
    if s["findings"]:
        lines += ["| finding | kind | at | hit | ops (shrunk) | first divergence | settings |",
                  "|---|---|---|---|---|---|---|"]
        for f in s["findings"]:
            d = f["divergence"]
            first = f"step {d['step']}: {d['quantity']} expected {d['expected']!r}, got {d['actual']!r}"
            st = ", ".join(f"{k} {v}" for k, v in f["settings"].items())
            lines.append(f"| {f['name']} | {f['kind']} | {f['site']} | {f['count']} | "
                         f"{f['ops_before']} ({f['ops_after']}) | {_cell(first)} | {_cell(st)} |")
        lines.append("")
    if s["errors"]:
        lines += [f"{len(s['errors'])} histories the harness could not check (first: "
                  f"{_cell(str(s['errors'][0]['error']))})", ""]
    cov = s["coverage"]
    lines += ["## Coverage", "", "| edge condition | histories reaching it |", "|---|---|"]
    lines += [f"| {e} | {n} |" for e, n in cov["edges"].items()]
    for title in ("op kinds", "ops", "groups", "settings"):
        lines += ["", f"{title}: " + ", ".join(f"{k} {v}" for k, v in cov[title].items())]
    if cov["op kinds not drawn"]:
        lines += ["", "op kinds not drawn (the backend does not declare them): "
                  + ", ".join(cov["op kinds not drawn"])]
    if s["not_applicable"]:
        lines += ["", "not applicable: " + "; ".join(f"{k} ({v})" for k, v in s["not_applicable"].items())]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:200]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40]


_BASE = CacheConfig(block_size=16, num_blocks=64)  # the settings capabilities are read under
