"""Whether a backend can run a trace: '' or why not, decided in one place from what the trace
uses (``trace_uses``) and what the backend declares: its group kinds, its rule set, the
operations it takes (SPEC §13's lifecycles, fork, salts) and its tiers (SPEC §11). Each reason
names the backend's declaration and what the trace or model needs of it.
"""
from __future__ import annotations

from kvbench.contract.protocol import Backend, refuse_kinds, takes_lifecycle
from kvbench.model.rules import rule_set
from kvbench.traces.columns import OpTable
from kvbench.traces.format import Trace


def lifecycle(trace: Trace) -> set:
    """The scheduler lifecycles (SPEC §13) the trace uses: 'speculative' (an accept), 'chunked'
    (a prefill of a prompt's first chunk), 'preempt', 'swap' (a preempt by swap)."""
    return trace_uses(trace) & {"speculative", "chunked", "preempt", "swap"}


def trace_uses(trace: Trace) -> set:
    """What the trace asks of a backend: its lifecycles (``lifecycle``), 'fork', 'salted' (a
    prefill names a salt, an adapter or token ids) and 'transfers' (a store or a load)."""
    ops = trace.ops
    used = set()
    table = isinstance(ops, OpTable)
    if table:  # its forks counted in its columns, its prefills' keys apart
        if ops.count("fork"):
            used.add("fork")
        if ops.keys:
            used.add("salted")
        ops = ops.side.values()  # the operations its columns do not hold: every kind below
    for op in ops:
        kind = op.kind
        if kind == "accept":
            used.add("speculative")
        elif kind == "preempt":
            used.update(("preempt", "swap") if op.mode == "swap" else ("preempt",))
        elif kind == "prefill":
            if op.prompt_tokens is not None:
                used.add("chunked")
            if not table and (op.salt or op.adapter or op.token_ids):
                used.add("salted")
        elif kind == "fork" and not table:
            used.add("fork")
        elif kind in ("store", "load"):
            used.add("transfers")
    return used


def applicable(trace: Trace, backend: Backend) -> str:
    """'' when the backend can run the trace, else why not."""
    caps, cfg = backend.capabilities, backend.config
    model, name = cfg.model, backend.name
    uses = trace_uses(trace)
    if model.hybrid and not caps.groups:
        return (f"{name} does not run KV cache groups or sliding windows, and model "
                f"{model.name} has {', '.join(g.kind for g in model.kv_groups)}")
    refused = refuse_kinds(name, caps, model)
    if refused:
        return refused
    try:
        rules = rule_set(caps)
    except ValueError as e:  # the backend's declaration, named as its
        raise ValueError(f"{name}'s Capabilities: {e}") from None
    if rules.hit_drops_last_block and any(g.releases for g in model.kv_groups):
        return (f"{name} drops an EAGLE hit's last block, which beside the windows of "
                f"model {model.name} is not modelled")
    if not caps.fork and "fork" in uses:
        return f"{name} does not support fork and the trace forks"
    if cfg.policy and cfg.policy not in caps.eviction:
        return f"{name} does not implement eviction policy {cfg.policy!r}"
    if cfg.prefix_caching and caps.prefix_caching and not caps.cache_salt and "salted" in uses:
        # Its cache would share blocks across the salts and adapters it is never told (SPEC §9).
        return (f"{name} does not declare cache_salt: it cannot take the salts, adapters "
                f"or token ids this trace's prompts carry")
    return _lifecycles(uses, backend) or _tiers(trace, uses, backend)


def _lifecycles(uses: set, backend: Backend) -> str:
    caps, model, name = backend.capabilities, backend.config.model, backend.name
    if "speculative" in uses:
        if not takes_lifecycle(backend, "speculative"):
            return f"{name} does not roll back draft tokens (no accept: speculative decoding, SPEC §13)"
        if any(g.state_bytes is not None for g in model.kv_groups):
            return (f"a rollback of model {model.name}'s state groups would need the state before "
                    f"the drafts (SPEC §12): not modelled")
        if any(g.releases for g in model.kv_groups):  # sliding, chunked and sinks groups
            return (f"a rollback under the {', '.join(g.kind for g in model.kv_groups if g.releases)} "
                    f"group(s) of model {model.name} would need blocks the group already released: "
                    f"not modelled")
    if "swap" in uses and caps.tiers and not caps.swap:  # without tiers: _tiers says so
        return (f"{name} does not preempt by swap (SPEC §13: swap_out and swap_in over "
                f"its tiers)")
    if "chunked" in uses and not takes_lifecycle(backend, "chunked"):
        return f"{name} does not take a prompt in chunks (no chunked_prefill, SPEC §13)"
    return ""


def _tiers(trace: Trace, uses: set, backend: Backend) -> str:
    """The tier replay's part (SPEC §11; kvbench.checking.tier_replay replays them)."""
    tiers = trace.header.tiers
    if not tiers:
        return ""
    caps, cfg, name = backend.capabilities, backend.config, backend.name
    names = ", ".join(t.name for t in tiers)
    if not caps.tiers:
        moves = "stores to and loads from" if "transfers" in uses else "swaps sequences out to"
        return f"{name} declares no tiers (SPEC §11) and the trace {moves} {names}"
    missing = sorted({t.policy for t in tiers} - set(caps.tiers))
    if missing:
        return f"{name}'s tiers do not run policy {missing[0]!r} (they run {', '.join(caps.tiers)})"
    if cfg.model.hybrid:
        return f"tier replays run models of one full-attention group, and {cfg.model.name} has more"
    if not (cfg.prefix_caching and caps.prefix_caching) and "transfers" in uses:  # a swap needs no hash
        return "a tier holds hashed blocks only: the replay needs prefix caching on"
    if cfg.policy:
        return "tier replays run without an eviction policy (a load in flight is never a victim yet)"
    return ""


__all__ = ["applicable", "lifecycle", "trace_uses"]
