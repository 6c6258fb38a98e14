"""The isolation family: the same prompt under several tenants' salts and adapters, named once
by block hashes and once by token ids (SPEC §9). A pure function of a seed, like the others.

Each round draws a prompt of ``prompt_blocks`` full blocks and replays it in two passes per
naming (block hashes first, then token ids). First every tenant, in the listed order, prefills
the prompt exactly (a multiple of the block size: every block a hit where the keys allow);
then, in a random order, each prefills a prefix of it (block-aligned with ``aligned_rate``),
followed with ``own_rate`` by ``own_tokens`` of its own. Every pass decodes once (one batched
append over the pass) and frees everything in a random order, so its blocks stay cached and
later rounds, over a budget of ``num_blocks`` (default: the most blocks the live sequences
hold, sharing ignored, so nothing is refused), evict them and reuse the freed ids.

By default two tenants share a salt ("a"), a third has another ("b"), a fourth none and a fifth
an adapter named like the shared salt: the same salt must share, every other pair must not, in
either naming. A backend whose keys drop the salt in one naming shows at the second prefill.
"""
from __future__ import annotations

import numpy as np

from kvbench.traces.builder import _Builder, _recorded, op_demand, peak_blocks
from kvbench.traces.format import Trace
from kvbench.traces.hybrid import VOCAB, _tenants
from kvbench.traces.laws import _pair, _positive_int, _probability

TENANTS = [{"name": "alice", "salt": "a"}, {"name": "bob", "salt": "b"},
           {"name": "carol", "salt": "a"}, {"name": "dave"}, {"name": "erin", "adapter": "a"}]


def salted_prefixes(seed: int = 0, *, rounds: int = 2, prompt_blocks=(2, 4),
                    aligned_rate: float = 0.5, own_rate: float = 0.5, own_tokens=(1, 16),
                    output=(1, 12), block_size: int = 8, num_blocks: int | None = None,
                    tenants=None) -> Trace:
    """One prompt per round under every tenant's extra keys (see the module docstring)."""
    params = _recorded(dict(locals()))
    tenants = params["tenants"] = _tenants(tenants if tenants is not None else TENANTS)
    _positive_int("rounds", rounds)
    m_lo, m_hi = _pair("prompt_blocks", prompt_blocks)
    own_lo, own_hi = _pair("own_tokens", own_tokens)
    out_lo, out_hi = _pair("output", output)
    B = _positive_int("block_size", block_size, 2)
    if m_lo < 1 or own_lo < 1 or out_lo < 1:
        raise ValueError("salted_prefixes: prompt_blocks, own_tokens and output must start at 1 or more")
    for name, v in (("aligned_rate", aligned_rate), ("own_rate", own_rate)):
        _probability(name, v)
    rng = np.random.default_rng(seed)
    own_ids = iter(range(VOCAB, VOCAB + 2 * rounds * len(tenants) * own_hi))  # ids no prompt has
    b, request = _Builder(), 0

    def prefill(t, tokens: int, by_hash: bool, shared_ids, own: int) -> int:
        nonlocal request
        keys = dict(salt=t.get("salt"), adapter=t.get("adapter"))
        if by_hash:  # the shared prompt's blocks, then this request's own full blocks
            full, shared = (tokens + own) // B, tokens // B
            hashes = [f"s{r}.{j}" for j in range(shared)] + [f"o{request}.{j}" for j in range(full - shared)]
            seq = b.prefill(tokens + own, t["name"], hashes, **keys)
        else:
            ids = list(shared_ids[:tokens]) + [next(own_ids) for _ in range(own)]
            seq = b.prefill(tokens + own, t["name"], token_ids=ids, **keys)
        request += 1
        return seq

    for r in range(rounds):
        m = int(rng.integers(m_lo, m_hi, endpoint=True))
        shared_ids = rng.integers(0, VOCAB, size=m * B)
        for by_hash in (True, False):
            live = [prefill(t, m * B, by_hash, shared_ids, 0) for t in tenants]
            for i in rng.permutation(len(tenants)).tolist():
                tokens = int(rng.integers(B, m * B, endpoint=True))
                if rng.random() < aligned_rate:
                    tokens = tokens // B * B
                own = int(rng.integers(own_lo, own_hi, endpoint=True)) if rng.random() < own_rate else 0
                live.append(prefill(tenants[i], tokens, by_hash, shared_ids, own))
            b.append(live, rng.integers(out_lo, out_hi, size=len(live), endpoint=True).tolist())
            for i in rng.permutation(len(live)).tolist():
                b.free(live[i])

    need = op_demand(b.ops, B)
    if num_blocks is None:
        num_blocks = max(need, peak_blocks(b.ops, B))
    _positive_int("num_blocks", num_blocks)
    if num_blocks < need:
        raise ValueError(f"salted_prefixes: num_blocks={num_blocks} must be >= {need} (the most one "
                         f"operation touches)")
    return b.trace("salted_prefixes", params, seed, name="salted_prefixes",
                   settings={"block_size": B, "num_blocks": num_blocks, "prefix_caching": True})


__all__ = ["salted_prefixes", "TENANTS"]
