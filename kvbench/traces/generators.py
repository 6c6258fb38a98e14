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
import json
import math
import os
from collections import deque

import numpy as np

from kvbench.contract.formulas import blocks_needed
from kvbench.traces.format import (
    Append,
    Fork,
    Free,
    Header,
    Prefill,
    Trace,
    save,
    validate,
)
from kvbench.traces.laws import (
    CONTEXT_LEN,
    LengthLaw,
    _pair,
    _positive_int,
    normalize_law,
    request_laws,
)

GENERATOR_VERSION = 1

DEFAULT_TENANT = "default"
# --- helpers ------------------------------------------------------------------------------------

def _recorded(args: dict) -> dict:
    """A generator's arguments as its header records them (JSON types, laws expanded)."""
    params = {k: (normalize_law(v) if k == "law" else v) for k, v in args.items() if k != "seed"}
    return json.loads(json.dumps(params))


class _Builder:
    """Emits ops with consecutive steps and fresh sequence ids; tracks live lengths."""

    def __init__(self):
        self.ops: list = []
        self.length: dict = {}
        self.next_seq = 0

    def prefill(self, tokens: int, tenant: str = DEFAULT_TENANT) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.ops.append(Prefill(len(self.ops), seq, tenant, int(tokens)))
        self.length[seq] = int(tokens)
        return seq

    def append(self, seqs, tokens) -> None:
        seqs = [int(s) for s in seqs]
        tokens = [int(t) for t in tokens]
        if min(tokens) < 1:
            raise AssertionError(f"generator bug: append of {tokens} tokens at step {len(self.ops)}")
        self.ops.append(Append(len(self.ops), tuple(seqs), tuple(tokens)))
        for s, t in zip(seqs, tokens):
            self.length[s] += t

    def fork(self, src: int) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.ops.append(Fork(len(self.ops), seq, int(src)))
        self.length[seq] = self.length[src]
        return seq

    def free(self, seq: int) -> None:
        self.ops.append(Free(len(self.ops), int(seq)))
        del self.length[seq]

    def trace(self, family: str, params: dict, seed: int, name: str, **header) -> Trace:
        h = Header(family=family, generator=f"kvbench.generators.{family} v{GENERATOR_VERSION}",
                   params=params, seed=seed, **header)
        return validate(Trace(h, self.ops, name=name))


def _walk(ops):
    """Yield (op, lengths of the live sequences after it, the sequences it wrote or created)."""
    length = {}
    for op in ops:
        if isinstance(op, Prefill):
            length[op.seq] = op.tokens
            touched = (op.seq,)
        elif isinstance(op, Append):
            for s, t in zip(op.seqs, op.tokens):
                length[s] += t
            touched = op.seqs
        elif isinstance(op, Fork):
            length[op.seq] = length[op.src]
            touched = (op.seq,)
        else:
            del length[op.seq]
            touched = ()
        yield op, length, touched


def peak_blocks(ops, block_size: int) -> int:
    """max over time of sum over live sequences of ceil(T / B): an upper bound (sharing ignored)."""
    blocks, total, peak = {}, 0, 0
    for op, length, touched in _walk(ops):
        if isinstance(op, Free):
            total -= blocks.pop(op.seq)
        for s in touched:
            new = blocks_needed(length[s], block_size)
            total += new - blocks.get(s, 0)
            blocks[s] = new
        peak = max(peak, total)
    return peak


def op_demand(ops, block_size: int) -> int:
    """max over operations of the blocks held by the sequences one operation writes, after it.

    Under eviction these must fit in the budget at once (a served sequence is never a victim).
    """
    return max((sum(blocks_needed(length[s], block_size) for s in touched)
                for _, length, touched in _walk(ops)), default=0)


# --- the four families --------------------------------------------------------------------------

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


# --- dispatch and the committed canonical traces -------------------------------------------------

FAMILIES = {
    "prefill_lengths": prefill_lengths,
    "decode_streams": decode_streams,
    "fork_trees": fork_trees,
    "tenant_mixes": tenant_mixes,
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


# (file name, family, params, seed). Tiny sequences: the checker replays all of them in seconds.
# Append only; never change an entry (stored results refer to these traces by name).
CANONICAL = [
    ("prefill-sharegpt.jsonl", "prefill_lengths",
     {"num_requests": 48, "law": {"name": "sharegpt", "scale": 0.25}, "max_prompt": 128,
      "max_output": 128, "concurrency": 6, "decode_chunk": 16}, 0),
    ("prefill-alpaca.jsonl", "prefill_lengths",
     {"num_requests": 32, "law": "alpaca", "max_prompt": 100, "max_output": 100,
      "concurrency": 8, "decode_chunk": 8}, 0),
    ("decode-stream.jsonl", "decode_streams",
     {"num_requests": 24, "law": {"name": "alpaca", "scale": 0.5}, "max_prompt": 100,
      "max_output": 60, "max_batch": 8, "arrival_rate": 0.25}, 0),
    ("fork-beam.jsonl", "fork_trees",
     {"mode": "beam", "num_trees": 3, "width": 4, "law": {"name": "uniform", "prompt": [17, 100],
      "output": [16, 40]}, "max_prompt": 100, "max_output": 40, "depth": [0, 12],
      "prune_every": 4, "sub_width": 2}, 0),
    ("fork-parallel.jsonl", "fork_trees",
     {"mode": "parallel", "num_trees": 3, "width": 4, "law": {"name": "uniform", "prompt": [17, 100],
      "output": [8, 40]}, "max_prompt": 100, "max_output": 40, "depth": [0, 12],
      "prune_every": 4, "sub_width": 3}, 0),
    ("tenant-flood.jsonl", "tenant_mixes",
     {"tenants": [{"name": "heavy", "weight": 1, "rate": 0.9, "law": {"name": "sharegpt", "scale": 0.25}},
                  {"name": "light", "weight": 1, "rate": 0.1, "law": "alpaca"}],
      "num_requests": 32, "max_prompt": 100, "max_output": 100, "concurrency": 8, "max_batch": 3,
      "decode_chunk": 8, "block_size": 16, "budget_fraction": 0.5}, 0),
    # Weights 0.1/0.2/0.3 over 10 blocks: c's quota is exactly 5 blocks (SPEC section 5), and a
    # float comparison puts it over at 5.
    ("tenant-fractional.jsonl", "tenant_mixes",
     {"tenants": [{"name": "a", "weight": 0.1, "law": {"name": "uniform", "prompt": [4, 40], "output": [4, 24]}},
                  {"name": "b", "weight": 0.2, "law": {"name": "uniform", "prompt": [4, 40], "output": [4, 24]}},
                  {"name": "c", "weight": 0.3, "law": {"name": "uniform", "prompt": [4, 40], "output": [4, 24]}}],
      "num_requests": 30, "max_prompt": 40, "max_output": 24, "concurrency": 6, "max_batch": 2,
      "decode_chunk": 4, "block_size": 16, "num_blocks": 10}, 0),
    ("tenant-late.jsonl", "tenant_mixes",
     {"tenants": [{"name": "early", "weight": 1, "law": "alpaca"},
                  {"name": "steady", "weight": 2, "law": {"name": "uniform", "prompt": [8, 64], "output": [8, 48]}},
                  {"name": "late", "weight": 1, "rate": 2, "law": "alpaca", "start": 24}],
      "num_requests": 48, "max_prompt": 100, "max_output": 100, "concurrency": 8, "max_batch": 3,
      "decode_chunk": 8, "block_size": 16, "budget_fraction": 0.5}, 0),
]


def canonical_traces() -> list[tuple[str, Trace]]:
    return [(fname, generate(family, seed, **params)) for fname, family, params, seed in CANONICAL]


def write_canonical(directory: str) -> list[str]:
    """Write every CANONICAL trace into ``directory`` (created if missing); returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for fname, trace in canonical_traces():
        trace.name = os.path.splitext(fname)[0]
        path = os.path.join(directory, fname)
        save(trace, path)
        paths.append(path)
    return paths


__all__ = [
    "GENERATOR_VERSION", "peak_blocks", "op_demand",
    "prefill_lengths", "decode_streams", "fork_trees", "tenant_mixes", "FAMILIES", "generate",
    "CANONICAL", "canonical_traces", "write_canonical",
]
