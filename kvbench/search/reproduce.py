"""A failure written down so that it replays: the trace header that records it, and a pytest case.

- :func:`divergence_kind`: what "fails the same way" means (the shrinker keeps it);
- :func:`failure_trace`: a failing trace under a header with the settings `kvbench check` reads
  back, the backend, the divergence and where the trace came from (shrunk traces, the histories
  the hypothesis state machines save);
- :func:`emit_pytest`: the trace as a test case in the style of tests/impls/test_faults.py, the
  operations inline with the ledger after each as a comment, to paste into an issue or a suite.
"""
from __future__ import annotations

import dataclasses
import json
import re

from kvbench.checking.checker import check
from kvbench.checking.verdict import OOM, SUCCESS, Divergence
from kvbench.contract import registry
from kvbench.contract.formulas import PRESETS, with_group_kinds
from kvbench.contract.ledger import where
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Trace

# Ledger figures the pytest comments show, by layout (contiguous backends have no blocks).
PAGED_FIGURES = where(lambda q: "paged" in q.shown)
CONTIGUOUS_FIGURES = where(lambda q: "contiguous" in q.shown)


def divergence_kind(d: Divergence) -> str:
    """What a shrunk trace must still show: the quantity that diverged (sequence ids left out,
    since shrinking renumbers them), or the type of the exception the backend raised. For the
    outcome of an operation, which way it went (refused where it fits, or the reverse)."""
    actual = str(d.actual)
    if d.quantity.startswith("outcome of"):
        if actual not in (SUCCESS, OOM):
            return f"raises {actual.split(':', 1)[0]}"
        return f"outcome: {d.expected} expected, {d.actual} actual"
    return re.sub(r"sequence \d+", "sequence *", d.quantity)


def jsonable(d):
    """A divergence (or any value) as plain JSON types."""
    if d is None:
        return None
    raw = d.__dict__ if isinstance(d, Divergence) else d
    return json.loads(json.dumps(raw, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def settings_of(config: CacheConfig) -> dict:
    """The settings a trace header carries so that `kvbench check` replays with them."""
    s = {"model": config.model.name, "block_size": config.block_size,
         "num_blocks": config.num_blocks, "max_context": config.max_context,
         "prefix_caching": bool(config.prefix_caching),
         "policy": config.policy or "none"}  # "none" said: a tenant mix is otherwise run under all three
    if config.kv_format:  # the format a pool of several failed in
        s["kv_format"] = config.kv_format
    return s


def failure_trace(trace: Trace, config: CacheConfig, divergence: Divergence, *, backend: str,
                  generator: str = "kvbench shrink", source: dict | None = None,
                  name: str | None = None) -> Trace:
    """``trace`` under a header that says how its failure replays: the settings (which
    `kvbench check` reads back), the backend, the divergence and its kind, and where it came from."""
    params = {"backend": backend, "kind": divergence_kind(divergence), "divergence": jsonable(divergence)}
    if source:
        params["source"] = source
    header = dataclasses.replace(trace.header, generator=generator, params=params,
                                 tenants=dict(trace.header.tenants), settings=settings_of(config))
    return Trace(header, list(trace.ops), name=name or trace.name)


# --- the pytest case ---------------------------------------------------------------------------

class _Ledgers:
    """A progress sink for check(): the backend's ledger after every operation that passed."""

    def __init__(self, backend):
        self.backend, self.rows = backend, []

    def update(self, _):
        self.rows.append(self.backend.ledger().as_dict())


def _op_source(op) -> str:
    args = ", ".join(f"{f.name}={getattr(op, f.name)!r}" for f in dataclasses.fields(op)
                     if f.default is dataclasses.MISSING or getattr(op, f.name) != f.default)
    return f"{type(op).__name__}({args})"


def _config_source(config: CacheConfig, groups) -> tuple[str, str]:
    """CacheConfig(...) as code (fields that differ from the defaults), and what it imports from
    kvbench.contract.formulas."""
    m, base = config.model, PRESETS.get(config.model.name)
    if base == m:
        model, names = f"get_model({m.name!r})", "get_model"
    elif base is not None and groups and with_group_kinds(base, groups) == m:
        model, names = f"with_group_kinds(get_model({m.name!r}), {list(groups)!r})", "get_model, with_group_kinds"
    else:
        model, names = repr(m), "KVGroup, ModelSpec"
    parts = [f"model={model}"]
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.name != "model" and v != default:
            parts.append(f"{f.name}={v!r}")
    return f"CacheConfig({', '.join(parts)})", names


def _figures(row: dict, quantity: str) -> str:
    names = PAGED_FIGURES if row.get("blocks_used") is not None else CONTIGUOUS_FIGURES
    named = [q for q in row if quantity.startswith(q) and q not in names]
    return ", ".join(f"{q} {row[q]!r}" for q in (*names, *named))


def emit_pytest(trace: Trace, factory, config: CacheConfig, backend: str, *,
                gather: str = "touched", title: str = "") -> str:
    """A pytest module replaying ``trace`` (a failing one, e.g. a shrunk trace) on ``backend``
    (a registry name or ``module:Class``; ``factory`` builds the same backend here, to read its
    ledger after every operation). The test asserts the check passes, so it fails while the bug
    is there, with the divergence as its message."""
    b = factory(config)
    sink = _Ledgers(b)
    try:
        v = check(trace, b, gather=gather, progress=sink)
    finally:
        getattr(b, "close", lambda: None)()
    d = v.divergence
    lines = []
    for i, op in enumerate(trace.ops):
        if d is not None and i == d.index:
            note = f"FAILS: {d.quantity} expected {d.expected!r}, actual {d.actual!r}"
        elif i < len(sink.rows):
            note = _figures(sink.rows[i], d.quantity if d else "")
        else:
            note = "(not reached)"
        lines.append(f"    {_op_source(op)},  # {note}")
    config_src, formulas = _config_source(config, trace.header.groups)
    ident = re.sub(r"\W+", "_", trace.name).strip("_").lower() or "trace"
    used = sorted({type(op).__name__ for op in trace.ops})
    h = trace.header
    header = (f"Header(family={h.family!r}, tenants={dict(h.tenants)!r}"
              + (f", groups={tuple(h.groups)!r}" if h.groups else "")
              + (f", tiers={tuple(h.tiers)!r}" if h.tiers else "") + ")")
    verdict = (f"fails at step {d.step}: {d.quantity} expected {d.expected!r}, actual {d.actual!r}"
               if d is not None else f"does not fail here ({v.status})")
    engine = "engine" in registry.resolve(backend).tags
    imports = "import pytest\n\n" if engine else ""
    # An engine runs only in its opt-in environment: elsewhere the case skips, saying why.
    guard = (f"\n# {backend} is a serving engine's own classes, installed in its opt-in environment "
             f"(docs/engines.md).\nAVAILABLE, WHY_NOT = registry.resolve({backend!r}).available()\n"
             f"pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)\n") if engine else ""
    return f'''"""{title or f"{trace.name}: {backend}"}

{len(trace.ops)} operations; {backend} {verdict}.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
"""
{imports}from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import {formulas}
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import {", ".join(used + ["Header", "Trace", "validate"])}
{"from kvbench.traces.tier_ops import TierSpec" + chr(10) if h.tiers else ""}
CONFIG = {config_src}
OPS = [
{chr(10).join(lines)}
]
{guard}

def test_{ident}():
    trace = validate(Trace({header}, OPS, name={trace.name!r}))
    verdict = check(trace, registry.create({backend!r}, CONFIG), gather={gather!r})
    assert verdict.valid, str(verdict.divergence)
'''


__all__ = ["divergence_kind", "jsonable", "settings_of", "failure_trace", "emit_pytest"]
