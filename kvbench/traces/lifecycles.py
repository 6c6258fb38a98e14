"""Scheduler lifecycles (SPEC §13) as seeded trace families: chunked prefill beside prefix
sharers, speculative decoding over forks, preemption by recompute (or by swap to a host tier)
under a tight budget.

Each is a pure function of its seed and parameters (one ``numpy.random.default_rng(seed)``, draws
in a fixed order), recorded in the header as the other families are; every sequence is freed by
the end.
"""
from __future__ import annotations

import numpy as np

from kvbench.contract.formulas import blocks_needed
from kvbench.traces.builder import _Builder, _recorded
from kvbench.traces.format import Trace
from kvbench.traces.laws import _pair, _positive_int, _probability
from kvbench.traces.tier_ops import TierSpec


def chunked_prefill(seed: int = 0, *, num_requests: int = 12, prefixes: int = 3,
                    prefix_blocks=(2, 5), own_tokens=(1, 30), chunk: int = 24, whole_rate: float = 0.3,
                    concurrency: int = 4, output=(4, 16), decode_chunk: int = 4,
                    block_size: int = 16) -> Trace:
    """Prompts opening with one of a few shared prefixes (block hashes ``"p<k>.<j>"``, their own
    full blocks ``"r<i>.<j>"``), each written in chunks of ``chunk`` tokens (not a multiple of the
    block size: chunks end inside blocks), or with probability ``whole_rate`` by one prefill,
    ``concurrency`` requests at a time. A request arriving while a sharer is between chunks
    hits only the blocks already complete (SPEC §13);
    the blocks both complete later stay the first writer's entries. Every round appends the next
    chunk of each prompt in progress and ``decode_chunk`` tokens of each request past its
    prompt, in one batch; a request is freed after its ``output`` tokens."""
    params = _recorded(dict(locals()))
    n = _positive_int("num_requests", num_requests)
    k_max = _positive_int("prefixes", prefixes)
    m_lo, m_hi = _pair("prefix_blocks", prefix_blocks)
    own_lo, own_hi = _pair("own_tokens", own_tokens)
    out_lo, out_hi = _pair("output", output)
    _probability("whole_rate", whole_rate)
    for name, v in (("chunk", chunk), ("concurrency", concurrency), ("decode_chunk", decode_chunk),
                    ("block_size", block_size)):
        _positive_int(name, v)
    B, rng = block_size, np.random.default_rng(seed)
    b, prompt_left, out_left, arrived = _Builder(), {}, {}, 0
    while arrived < n or out_left:
        while arrived < n and len(out_left) < concurrency:  # arrivals fill the free slots
            k = int(rng.integers(0, k_max))
            m = int(rng.integers(m_lo, m_hi, endpoint=True))
            own = int(rng.integers(own_lo, own_hi, endpoint=True))
            prompt = m * B + own
            hashes = [f"p{k}.{j}" for j in range(m)] + [f"r{arrived}.{j}" for j in range(own // B)]
            first = prompt if rng.random() < whole_rate else min(chunk, prompt)
            seq = b.prefill(first, block_hashes=hashes, prompt_tokens=prompt if prompt > first else None)
            prompt_left[seq] = prompt - first
            out_left[seq] = int(rng.integers(out_lo, out_hi, endpoint=True))
            arrived += 1
        batch = sorted(out_left)
        if not batch:
            continue
        toks = [min(chunk, prompt_left[s]) if prompt_left[s] else min(decode_chunk, out_left[s])
                for s in batch]
        b.append(batch, toks)
        for s, t in zip(batch, toks):
            if prompt_left[s]:
                prompt_left[s] -= t
                continue
            out_left[s] -= t
            if not out_left[s]:
                del out_left[s], prompt_left[s]
                b.free(s)
    header = {"settings": {"block_size": B, "prefix_caching": True}}
    return b.trace("chunked_prefill", params, seed, name="chunked_prefill", **header)


def speculative_forks(seed: int = 0, *, num_trees: int = 3, width: int = 3, prompt=(20, 70),
                      rounds=(5, 9), k: int = 4, acceptance: float = 0.6, prune_rate: float = 0.2,
                      block_size: int = 16) -> Trace:
    """Speculative decoding over forks (parallel sampling): each tree's root is prefilled and
    forked into ``width`` branches; every round one batched append writes, per branch, the
    token the last verification produced and ``k`` draft tokens (marked ``draft``), then each
    branch accepts ``n`` of them, ``n ~ Binomial(k, acceptance)`` (``acceptance`` is the rate
    serving engines report: accepted / drafted tokens). Between rounds a branch
    may be pruned (``prune_rate``) and a survivor forked in its place, at whatever length it
    has: rollbacks into shared, copied and fresh tail blocks alike."""
    params = _recorded(dict(locals()))
    _positive_int("num_trees", num_trees)
    _positive_int("width", width, 2)
    _positive_int("k", k)
    _positive_int("block_size", block_size)
    p_lo, p_hi = _pair("prompt", prompt)
    r_lo, r_hi = _pair("rounds", rounds)
    _probability("acceptance", acceptance)
    _probability("prune_rate", prune_rate)
    rng = np.random.default_rng(seed)
    b = _Builder()
    for _ in range(num_trees):
        root = b.prefill(int(rng.integers(p_lo, p_hi, endpoint=True)))
        branches = [root] + [b.fork(root) for _ in range(width - 1)]
        for _ in range(int(rng.integers(r_lo, r_hi, endpoint=True))):
            b.append(branches, [1 + k] * len(branches), [k] * len(branches))
            for s in branches:
                b.accept(s, k, int(rng.binomial(k, acceptance)))
            if len(branches) > 1 and rng.random() < prune_rate:
                gone = branches.pop(int(rng.integers(0, len(branches))))
                b.free(gone)
                branches.append(b.fork(branches[int(rng.integers(0, len(branches)))]))
        for s in branches:
            b.free(s)
    return b.trace("speculative_forks", params, seed, name="speculative_forks",
                   settings={"block_size": block_size})


def preemption(seed: int = 0, *, num_requests: int = 10, prompt=(20, 90), output=(20, 60),
               decode_chunk: int = 6, num_blocks: int = 16, block_size: int = 16) -> Trace:
    """Preemption by recompute under a budget of ``num_blocks`` (SPEC §13), as vLLM's scheduler
    does it: requests (prompts named by block hashes of their own, so a resume may hit what its
    preemption left cached) are admitted while their prompt fits and none waits to resume; each
    round decodes ``decode_chunk`` tokens of every running request in one batch; when that batch
    does not fit, the request admitted last is preempted (freed; its resume is a prefill of all
    its tokens) until it does; a preempted request resumes, first come first served, once its
    tokens fit again. The schedule never asks for more than the budget: nothing is evicted."""
    params = _recorded(dict(locals()))
    return _preempting(seed, params, "recompute", **params)


def swap_preemption(seed: int = 0, *, num_requests: int = 10, prompt=(10, 40), output=(30, 80),
                    decode_chunk: int = 8, num_blocks: int = 20, block_size: int = 16,
                    host: int = 8) -> Trace:
    """:func:`preemption`'s schedule with preemption by swap to a host tier of ``host`` blocks
    (SPEC §11, §13): a preempted request's blocks move there, and back at its resume; several
    requests are swapped out at once, and one the tier has no room left for is preempted by
    recompute instead."""
    params = _recorded(dict(locals()))
    _positive_int("host", host)
    return _preempting(seed, params, "swap", **params)


def _preempting(seed, params, mode, *, num_requests, prompt, output, decode_chunk, num_blocks,
                block_size, host=None) -> Trace:
    n = _positive_int("num_requests", num_requests)
    p_lo, p_hi = _pair("prompt", prompt)
    o_lo, o_hi = _pair("output", output)
    _positive_int("decode_chunk", decode_chunk)
    B = _positive_int("block_size", block_size)
    _positive_int("num_blocks", num_blocks)
    if blocks_needed(p_hi + o_hi, B) > num_blocks:
        raise ValueError(f"preemption: one request of {p_hi + o_hi} tokens needs "
                         f"{blocks_needed(p_hi + o_hi, B)} blocks, more than num_blocks={num_blocks}")
    rng = np.random.default_rng(seed)
    b, running, waiting, left, arrived = _Builder(), [], [], {}, 0

    def held():
        return sum(blocks_needed(b.length[s], B) for s in running)

    while arrived < n or running or waiting:
        while waiting and held() + blocks_needed(b.length[waiting[0]], B) <= num_blocks:
            s = waiting.pop(0)
            b.resume(s)
            running.append(s)
        if not waiting and arrived < n:
            tokens = int(rng.integers(p_lo, p_hi, endpoint=True))
            if held() + blocks_needed(tokens, B) <= num_blocks:
                s = b.prefill(tokens, block_hashes=[f"r{arrived}.{j}" for j in range(tokens // B)])
                left[s] = int(rng.integers(o_lo, o_hi, endpoint=True))
                running.append(s)
                arrived += 1
        while running and sum(blocks_needed(b.length[s] + min(decode_chunk, left[s]), B)
                              for s in running) > num_blocks:
            s = running.pop()  # the request admitted (or resumed) last
            b.preempt(s, mode)
            waiting.append(s)
        if not running:
            continue
        toks = [min(decode_chunk, left[s]) for s in running]
        b.append(list(running), toks)
        for s, t in zip(list(running), toks):
            left[s] -= t
            if not left[s]:
                running.remove(s)
                b.free(s)
    header = {"settings": {"block_size": B, "num_blocks": num_blocks, "prefix_caching": True}}
    if mode == "swap":
        header["tiers"] = (TierSpec("host", host),)
    family = "preemption" if mode == "recompute" else "swap_preemption"
    return b.trace(family, params, seed, name=family, **header)
