"""Workload generators (SPEC section 6): four trace families, each a pure function of a seed.

- ``prefill_lengths``: requests with prompt/output lengths drawn from a length law, served by a
  closed loop of ``concurrency`` slots; each is prefilled, decoded in batched chunks, freed.
- ``decode_streams``: continuous batching; every step is ONE batched append of 1 token over the
  whole running batch; finished sequences are freed and new arrivals join while it decodes.
- ``fork_trees``: beam search (beams pruned and re-forked every few tokens) and parallel sampling
  (branches of their own lengths, one of them forking again): forks at partial tail blocks, forks
  of forks.
- ``tenant_mixes``: several tenants with Fair weights, arrival rates, their own length laws and
  start times, over a block budget (``settings.num_blocks``) that forces eviction.
- ``prefix_sharing``: prompts opening with one of a few shared prefixes, named by block hashes
  (prefix caching: full and partial hits, cached blocks evicted and reused, hits after recompute).
- ``refusals``, ``eviction_edges``, ``wide_forks``, ``decode_edges``, ``long_history``
  (kvbench.traces.edges): the budget's last block, eviction of every candidate, 127+ sharers,
  eviction right after a wide decode step or a fork, several tails spilling into too few free
  blocks, 10^4 operations.
- ``window_decode`` (kvbench.traces.hybrid): one-token and multi-token decode steps across a
  sliding window's block and window edges, before and after a fork; ``window_hits``: a prefix
  hit cut short by a sliding window, taking back older cached blocks.
- ``salted_prefixes`` (kvbench.traces.isolation): one prompt under several salts and adapters,
  named by block hashes and by token ids (which blocks may be shared, SPEC §9).
- ``chunked_prefill``, ``speculative_forks``, ``preemption``, ``swap_preemption``
  (kvbench.traces.lifecycles): SPEC §13's scheduler lifecycles.
- ``tiered_turns``, ``agentic_prefix``, ``tier_races`` (kvbench.traces.tier_workloads): SPEC
  §11's transfers between the device and lower tiers, and operations between their begins and
  completions.

Every draw comes from one ``numpy.random.default_rng(seed)`` in a fixed order. The header records
the family, the generator (with its version), every parameter with defaults filled in (length
laws expanded to dicts), and the seed, so ``generate(h.family, h.seed, **h.params)`` rebuilds the
trace byte for byte. Steps are operation indices (0, 1, 2, ...). Every sequence is freed by the
end of a trace. A request with ``O`` output tokens gets ``O`` appended tokens (final length
``prompt + O``).

Length laws are in :mod:`kvbench.traces.laws`.
"""
from __future__ import annotations

import inspect
import math
from collections import deque

import numpy as np

from kvbench.traces.builder import (
    DEFAULT_TENANT,
    GENERATOR_VERSION,
    _Builder,
    _recorded,
    op_demand,
    peak_blocks,
)
from kvbench.traces.edges import decode_edges, eviction_edges, long_history, refusals, wide_forks
from kvbench.traces.format import Trace
from kvbench.traces.hybrid import hybrid_windows, window_decode, window_hits
from kvbench.traces.isolation import salted_prefixes
from kvbench.traces.lifecycles import chunked_prefill, preemption, speculative_forks, swap_preemption
from kvbench.traces.tier_workloads import agentic_prefix, tier_races, tiered_turns
from kvbench.traces.laws import (
    CONTEXT_LEN,
    LengthLaw,
    _pair,
    _positive_int,
    _probability,
    normalize_law,
    request_laws,
)

# --- the families -------------------------------------------------------------------------------

def prefill_lengths(seed: int = 0, *, num_requests: int = 64, law="sharegpt",
                    max_prompt: int = CONTEXT_LEN, max_output: int = CONTEXT_LEN,
                    concurrency: int = 4, decode_chunk: int = 16) -> Trace:
    """Requests in a closed loop of ``concurrency`` slots: prefill, batched chunked decode, free.

    A freed slot is refilled at once by the next request. Each decode op is one batched append
    over all live requests, each gaining ``min(decode_chunk, tokens it still has to produce)``.
    """
    params = _recorded(locals())
    n = _positive_int("num_requests", num_requests)
    _positive_int("concurrency", concurrency)
    _positive_int("decode_chunk", decode_chunk)
    prompt_law, output_law = request_laws(law, max_prompt, max_output)
    rng = np.random.default_rng(seed)
    prompts, outputs = prompt_law.sample(rng, n), output_law.sample(rng, n)

    b, pending, left = _Builder(), deque(range(n)), {}
    while pending or left:
        while pending and len(left) < concurrency:
            r = pending.popleft()
            left[b.prefill(prompts[r])] = int(outputs[r])
        live = list(left)
        chunk = [min(decode_chunk, left[s]) for s in live]
        b.append(live, chunk)
        for s, c in zip(live, chunk):
            left[s] -= c
            if left[s] == 0:
                del left[s]
                b.free(s)
    return b.trace("prefill_lengths", params, seed, name="prefill_lengths")


def decode_streams(seed: int = 0, *, num_requests: int = 32, law="alpaca",
                   max_prompt: int = CONTEXT_LEN, max_output: int = CONTEXT_LEN,
                   max_batch: int = 8, arrival_rate: float = 0.25) -> Trace:
    """Continuous batching: each step one append of 1 token to every running sequence.

    ``max_batch`` requests arrive at step 0; after each decode step Poisson(``arrival_rate``)
    more arrive. Arrivals wait in a queue and join (prefill) as soon as the batch has room;
    a sequence is freed right after the step that produces its last output token. When the
    batch runs empty, the next request is admitted at once (idle steps emit nothing).
    """
    params = _recorded(locals())
    n = _positive_int("num_requests", num_requests)
    _positive_int("max_batch", max_batch)
    if not isinstance(arrival_rate, (int, float)) or isinstance(arrival_rate, bool) or arrival_rate < 0:
        raise ValueError(f"arrival_rate must be a number >= 0 (requests per step), got {arrival_rate!r}")
    prompt_law, output_law = request_laws(law, max_prompt, max_output)
    rng = np.random.default_rng(seed)
    prompts, outputs = prompt_law.sample(rng, n), output_law.sample(rng, n)

    b, left = _Builder(), {}
    arrived, admitted = min(max_batch, n), 0
    while admitted < n or left:
        if not left and admitted == arrived:
            arrived += 1  # an idle server: the next request comes now
        while admitted < arrived and len(left) < max_batch:
            left[b.prefill(prompts[admitted])] = int(outputs[admitted])
            admitted += 1
        running = list(left)
        b.append(running, [1] * len(running))
        for s in running:
            left[s] -= 1
            if left[s] == 0:
                del left[s]
                b.free(s)
        arrived = min(n, arrived + int(rng.poisson(arrival_rate)))
    return b.trace("decode_streams", params, seed, name="decode_streams")


def fork_trees(seed: int = 0, *, mode: str = "beam", num_trees: int = 4, width: int = 4,
               law="uniform", max_prompt: int = 128, max_output: int = 64,
               depth=(0, 12), prune_every: int = 4, sub_width: int = 2) -> Trace:
    """Trees of forks, one after another. Each root is prefilled, decodes ``depth`` tokens (one
    append), and forks ``width - 1`` children (the root stays one of the ``width`` branches).
    The first fork comes at an odd length, so its tail block is partial for every power-of-two
    block size: the branches' first writes exercise copy-on-write. Branches then decode 1 token
    per step, batched across the tree.

    - ``beam``: all beams decode the tree's output length; every ``prune_every`` tokens 1 to
      ``width - 1`` random beams are pruned (freed) and as many forks of random survivors
      restore the width (forks of forks, at whatever length the beams have then).
    - ``parallel``: every branch draws its own output length and is freed when done; the first
      child forks ``sub_width - 1`` more branches halfway through its output (a fork of a fork),
      each drawing its own remaining length.
    """
    params = _recorded(locals())
    if mode not in ("beam", "parallel"):
        raise ValueError(f"fork_trees mode must be 'beam' or 'parallel', got {mode!r}")
    _positive_int("num_trees", num_trees)
    _positive_int("width", width, 2)
    _positive_int("prune_every", prune_every)
    _positive_int("sub_width", sub_width)
    d_lo, d_hi = _pair("depth", depth)
    prompt_law, output_law = request_laws(law, max_prompt, max_output)
    rng = np.random.default_rng(seed)

    b = _Builder()
    for _ in range(num_trees):
        prompt = int(prompt_law.sample(rng, 1)[0])
        d = int(rng.integers(d_lo, d_hi, endpoint=True))
        d += (prompt + d + 1) % 2  # odd fork length: a partial tail block to copy on write
        root = b.prefill(prompt)
        if d:
            b.append([root], [d])
        branches = [root] + [b.fork(root) for _ in range(width - 1)]
        if mode == "beam":
            _beam(b, rng, branches, int(output_law.sample(rng, 1)[0]), width, prune_every)
        else:
            _parallel(b, rng, branches, output_law, sub_width)
    return b.trace("fork_trees", params, seed, name=f"fork_trees_{mode}")


def _beam(b: _Builder, rng, beams: list, tokens: int, width: int, prune_every: int) -> None:
    for t in range(1, tokens + 1):
        b.append(beams, [1] * len(beams))
        if t % prune_every == 0 and t < tokens:
            drop = int(rng.integers(1, width))  # 1 .. width-1: at least one beam survives
            victims = set(rng.choice(len(beams), size=drop, replace=False).tolist())
            for i in sorted(victims):
                b.free(beams[i])
            beams = [s for i, s in enumerate(beams) if i not in victims]
            for _ in range(drop):
                beams.append(b.fork(beams[int(rng.integers(len(beams)))]))
    for s in beams:
        b.free(s)


def _parallel(b: _Builder, rng, branches: list, output_law: LengthLaw, sub_width: int) -> None:
    left = dict(zip(branches, output_law.sample(rng, len(branches)).tolist()))
    first_child = branches[1]
    fork_at = left[first_child] // 2  # tokens the first child has produced when it forks again
    produced = 0
    while left:
        if produced == fork_at and first_child in left and sub_width > 1:
            for extra in output_law.sample(rng, sub_width - 1).tolist():
                left[b.fork(first_child)] = extra
        live = list(left)
        b.append(live, [1] * len(live))
        produced += 1
        for s in live:
            left[s] -= 1
            if left[s] == 0:
                del left[s]
                b.free(s)


def tenant_mixes(seed: int = 0, *, tenants=None, num_requests: int = 48,
                 max_prompt: int = CONTEXT_LEN, max_output: int = CONTEXT_LEN,
                 concurrency: int = 8, max_batch: int = 4, decode_chunk: int = 8,
                 block_size: int = 16, num_blocks: int | None = None,
                 budget_fraction: float = 0.5) -> Trace:
    """Interleaved requests of several tenants over a block budget that forces eviction.

    ``tenants``: a list of dicts ``{"name", "weight", "rate", "law", "start"}``. ``weight`` is
    the tenant's Fair-eviction weight (header ``tenants``, kept exactly as given), ``rate`` its
    share of arrivals, ``law`` its length law, ``start`` how many requests arrive before its
    first (a late tenant). Request ``i`` belongs to a tenant drawn among those started, with
    probability proportional to ``rate``. Up to ``concurrency`` requests are admitted; each
    decode op is a batched append of ``decode_chunk`` tokens over the next ``max_batch`` admitted
    requests in round-robin order.

    The header's ``settings`` is ``{"block_size", "num_blocks"}``: ``num_blocks`` (or
    ``ceil(budget_fraction * peak)``) must lie below the peak demand (so eviction is needed) and
    at or above what any single operation touches (so evicting everyone else always suffices).
    """
    if tenants is None:
        tenants = [{"name": "heavy", "weight": 1, "rate": 0.8, "law": "sharegpt"},
                   {"name": "light", "weight": 1, "rate": 0.2, "law": "alpaca"}]
    params = _recorded(dict(locals(), tenants=_normalize_tenants(tenants)))
    tenants = params["tenants"]
    n = _positive_int("num_requests", num_requests)
    _positive_int("concurrency", concurrency)
    _positive_int("max_batch", max_batch)
    _positive_int("decode_chunk", decode_chunk)
    _positive_int("block_size", block_size)
    laws = {t["name"]: request_laws(t["law"], max_prompt, max_output) for t in tenants}
    rng = np.random.default_rng(seed)

    b, left, order, arrived = _Builder(), {}, deque(), 0
    while arrived < n or left:
        while arrived < n and len(left) < concurrency:
            active = [t for t in tenants if t["start"] <= arrived]
            if not active:
                raise ValueError(f"no tenant has started by request {arrived}: some tenant needs start 0")
            rates = np.array([t["rate"] for t in active], dtype=float)
            tenant = active[int(rng.choice(len(active), p=rates / rates.sum()))]["name"]
            prompt_law, output_law = laws[tenant]
            seq = b.prefill(prompt_law.sample(rng, 1)[0], tenant)
            left[seq] = int(output_law.sample(rng, 1)[0])
            order.append(seq)
            arrived += 1
        batch = [order.popleft() for _ in range(min(max_batch, len(order)))]
        chunk = [min(decode_chunk, left[s]) for s in batch]
        b.append(batch, chunk)
        for s, c in zip(batch, chunk):
            left[s] -= c
            if left[s] == 0:
                del left[s]
                b.free(s)
            else:
                order.append(s)

    peak, need = peak_blocks(b.ops, block_size), op_demand(b.ops, block_size)
    if num_blocks is None:
        if not 0 < budget_fraction < 1:
            raise ValueError(f"budget_fraction must be in (0, 1), got {budget_fraction!r}")
        num_blocks = max(need, math.ceil(budget_fraction * peak))
    _positive_int("num_blocks", num_blocks)
    if not need <= num_blocks < peak:
        raise ValueError(f"tenant_mixes: num_blocks={num_blocks} must be >= {need} (the most one "
                         f"operation touches) and < {peak} (the peak demand, else no eviction); "
                         f"change num_blocks, max_batch or concurrency")
    return b.trace("tenant_mixes", params, seed, name="tenant_mixes",
                   tenants={t["name"]: t["weight"] for t in tenants},
                   settings={"block_size": block_size, "num_blocks": num_blocks})


def prefix_sharing(seed: int = 0, *, num_requests: int = 40, prefixes: int = 3,
                   prefix_blocks=(0, 6), own_tokens=(1, 40), aligned_rate: float = 0.3,
                   output=(1, 24), fork_rate: float = 0.2, concurrency: int = 4,
                   max_batch: int = 3, decode_chunk: int = 8, block_size: int = 16,
                   num_blocks: int | None = None, budget_fraction: float = 0.6,
                   tenants=None) -> Trace:
    """Prompts that open with one of a few shared prefixes (system prompts, few-shot examples,
    earlier turns), for prefix caching by block hash.

    Request ``i`` picks prefix ``k`` among ``prefixes`` (the popular ones more often: weight
    ``1/(k+1)``) and opens with its first ``m`` blocks (``m`` drawn from ``prefix_blocks``),
    hashed ``"p<k>.<j>"``: equal ids name the same block with the same prefix. With probability
    ``aligned_rate`` the prompt is exactly those ``m`` blocks (a block-aligned prompt: every block
    a hit once cached); otherwise it adds ``own_tokens`` of its own, whose full blocks get hashes
    nobody else has. So the trace holds full hits, partial hits (a shorter or longer run of a
    cached chain), misses right after hits, and, over a budget of ``num_blocks`` (default
    ``ceil(budget_fraction * peak)``), cached blocks evicted and reused. A forked request
    (``fork_rate``: parallel sampling) shares its prompt's blocks. With ``tenants`` (as in
    :func:`tenant_mixes`) the header names their weights, so runs evict whole sequences under a
    policy and recompute them: hits after recompute. Decoding is round robin over
    ``max_batch`` of the admitted requests, ``decode_chunk`` tokens each.
    """
    if tenants is not None:  # a tenant here is a name, a Fair weight and a share of arrivals
        tenants = [{k: t[k] for k in ("name", "weight", "rate")} for t in _normalize_tenants(tenants)]
    params = _recorded(dict(locals()))
    n = _positive_int("num_requests", num_requests)
    k_max = _positive_int("prefixes", prefixes)
    m_lo, m_hi = _pair("prefix_blocks", prefix_blocks)
    own_lo, own_hi = _pair("own_tokens", own_tokens)
    out_lo, out_hi = _pair("output", output)
    for name, v in (("concurrency", concurrency), ("max_batch", max_batch),
                    ("decode_chunk", decode_chunk), ("block_size", block_size)):
        _positive_int(name, v)
    if own_lo < 1 or out_lo < 1:
        raise ValueError("prefix_sharing: own_tokens and output must start at 1 or more")
    for name, v in (("aligned_rate", aligned_rate), ("fork_rate", fork_rate)):
        _probability(name, v)
    named = params["tenants"] or [{"name": DEFAULT_TENANT, "rate": 1}]
    rates = np.array([t["rate"] for t in named], dtype=float)
    popular = 1.0 / np.arange(1, k_max + 1)
    B = block_size
    rng = np.random.default_rng(seed)

    b, left, order, arrived = _Builder(), {}, deque(), 0
    while arrived < n or left:
        while arrived < n and len(left) < concurrency:
            tenant = named[int(rng.choice(len(named), p=rates / rates.sum()))]["name"]
            k = int(rng.choice(k_max, p=popular / popular.sum()))
            m = int(rng.integers(m_lo, m_hi, endpoint=True))
            own = 0 if m and rng.random() < aligned_rate else int(rng.integers(own_lo, own_hi,
                                                                               endpoint=True))
            hashes = [f"p{k}.{j}" for j in range(m)] + [f"r{arrived}.{j}" for j in range(own // B)]
            seq = b.prefill(m * B + own, tenant, hashes)
            left[seq] = int(rng.integers(out_lo, out_hi, endpoint=True))
            order.append(seq)
            if rng.random() < fork_rate:
                child = b.fork(seq)
                left[child] = int(rng.integers(out_lo, out_hi, endpoint=True))
                order.append(child)
            arrived += 1
        batch = [order.popleft() for _ in range(min(max_batch, len(order)))]
        chunk = [min(decode_chunk, left[s]) for s in batch]
        b.append(batch, chunk)
        for s, c in zip(batch, chunk):
            left[s] -= c
            if left[s] == 0:
                del left[s]
                b.free(s)
            else:
                order.append(s)

    peak, need = peak_blocks(b.ops, B), op_demand(b.ops, B)
    if num_blocks is None:
        if not 0 < budget_fraction <= 1:
            raise ValueError(f"budget_fraction must be in (0, 1], got {budget_fraction!r}")
        num_blocks = max(need, math.ceil(budget_fraction * peak))
    _positive_int("num_blocks", num_blocks)
    if num_blocks < need:
        raise ValueError(f"prefix_sharing: num_blocks={num_blocks} must be >= {need} (the most one "
                         f"operation touches)")
    header = {"settings": {"block_size": B, "num_blocks": num_blocks, "prefix_caching": True}}
    if tenants is not None:
        header["tenants"] = {t["name"]: t["weight"] for t in params["tenants"]}
    return b.trace("prefix_sharing", params, seed, name="prefix_sharing", **header)


def _normalize_tenants(tenants) -> list:
    if not isinstance(tenants, (list, tuple)) or not tenants:
        raise ValueError(f"tenants must be a non-empty list of dicts, got {tenants!r}")
    out, names = [], set()
    for i, t in enumerate(tenants):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise ValueError(f"tenants[{i}] must be a dict with a non-empty string 'name', got {t!r}")
        unknown = set(t) - {"name", "weight", "rate", "law", "start"}
        if unknown:
            raise ValueError(f"tenants[{i}] ({t['name']!r}) has unknown key(s) {sorted(unknown)}; "
                             f"known: name, weight, rate, law, start")
        if t["name"] in names:
            raise ValueError(f"tenants[{i}]: duplicate tenant name {t['name']!r}")
        names.add(t["name"])
        full = {"name": t["name"], "weight": t.get("weight", 1), "rate": t.get("rate", 1),
                "law": normalize_law(t.get("law", "sharegpt")), "start": t.get("start", 0)}
        for key in ("weight", "rate"):
            v = full[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"tenants[{i}] ({t['name']!r}): {key} must be a positive number, got {v!r}")
        _positive_int(f"tenants[{i}] ({t['name']!r}) start", full["start"], 0)
        out.append(full)
    return out


# --- dispatch (the committed canonical traces are in kvbench.traces.canonical) --------------------

FAMILIES = {
    "prefill_lengths": prefill_lengths,
    "decode_streams": decode_streams,
    "fork_trees": fork_trees,
    "tenant_mixes": tenant_mixes,
    "prefix_sharing": prefix_sharing,
    "hybrid_windows": hybrid_windows,
    "refusals": refusals,
    "eviction_edges": eviction_edges,
    "wide_forks": wide_forks,
    "long_history": long_history,
    "salted_prefixes": salted_prefixes,
    "decode_edges": decode_edges,
    "window_decode": window_decode,
    "window_hits": window_hits,
    "chunked_prefill": chunked_prefill,
    "speculative_forks": speculative_forks,
    "preemption": preemption,
    "swap_preemption": swap_preemption,
    "tiered_turns": tiered_turns,
    "agentic_prefix": agentic_prefix,
    "tier_races": tier_races,
}


def generate(family: str, seed: int = 0, **params) -> Trace:
    """Build a trace of ``family`` (a key of FAMILIES) from ``seed`` and keyword parameters."""
    if family not in FAMILIES:
        raise ValueError(f"unknown trace family {family!r}; known: {', '.join(FAMILIES)}")
    fn = FAMILIES[family]
    known = [p for p in inspect.signature(fn).parameters if p != "seed"]
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"{family} has no parameter(s) {unknown}; known: {', '.join(known)}")
    _positive_int("seed", seed, 0)
    return fn(seed, **params)


__all__ = [
    "GENERATOR_VERSION", "prefill_lengths", "decode_streams", "fork_trees", "tenant_mixes",
    "prefix_sharing", "hybrid_windows", "refusals", "eviction_edges", "wide_forks", "long_history",
    "salted_prefixes", "decode_edges", "window_decode", "window_hits", "chunked_prefill", "speculative_forks",
    "preemption", "swap_preemption", "FAMILIES", "generate",
]
