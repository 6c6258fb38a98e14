"""The committed canonical workloads: one small trace per family (and a few variants), each a
generator family, its parameters and a seed. `kvbench gen` rewrites workloads/ from this list,
byte for byte (a test says so)."""
from __future__ import annotations

import os

from kvbench.traces.format import Trace, save
from kvbench.traces.generators import generate

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
    # Prefix caching: full hits of block-aligned prompts, partial hits, misses after
    # hits, cached blocks evicted and reused over a tight budget; then the same under eviction
    # policies, so evicted sequences are recomputed and hit their cached prefixes again.
    ("prefix-reuse.jsonl", "prefix_sharing",
     {"num_requests": 40, "prefixes": 3, "prefix_blocks": [0, 5], "own_tokens": [1, 40],
      "aligned_rate": 0.3, "output": [1, 24], "fork_rate": 0.2, "concurrency": 4, "max_batch": 3,
      "decode_chunk": 8, "block_size": 8, "budget_fraction": 0.6}, 0),
    ("prefix-tenants.jsonl", "prefix_sharing",
     {"num_requests": 40, "prefixes": 2, "prefix_blocks": [1, 4], "own_tokens": [1, 24],
      "aligned_rate": 0.3, "output": [4, 24], "fork_rate": 0.1, "concurrency": 5, "max_batch": 2,
      "decode_chunk": 6, "block_size": 8, "budget_fraction": 0.5,
      "tenants": [{"name": "chat", "weight": 2, "rate": 0.7},
                  {"name": "batch", "weight": 1, "rate": 0.3}]}, 0),
    # Hybrid models: prompts over a small sliding window, decode past it, forks on
    # either side of its edge, prefix reuse under four tenants' salts and adapters (alice's
    # salt "x" is bob's adapter name), cached blocks evicted over a tight budget. `kvbench
    # faults` shows what it catches.
    ("hybrid-windows.jsonl", "hybrid_windows",
     {"model": "tiny-hybrid", "num_requests": 48, "prompts": 1, "prompt_tokens": [24, 120],
      "aligned_rate": 0.3, "own_rate": 0.4, "own_tokens": [1, 24], "output": [8, 48],
      "fork_rate": 0.25, "concurrency": 5, "max_batch": 3, "decode_chunk": 6, "block_size": 8,
      "budget_fraction": 0.6}, 0),
    # The budget's edges: what `kvbench run` must reach that the others never do.
    # Refusals of every kind at Mooncake's block size 256, prompts over 16 blocks;
    ("edge-refusals.jsonl", "refusals",
     {"block_size": 256, "num_blocks": 40, "rounds": 2, "prompt_blocks": [17, 20]}, 0),
    # eviction that takes every candidate and just fits, one block short, a recompute refused
    # then done, a victim that lowers the need, at block size 512, under each policy;
    ("edge-eviction.jsonl", "eviction_edges",
     {"block_size": 512, "num_blocks": 16, "rounds": 2, "tenants": {"fg": 2, "bg": 1}}, 0),
    # 132 sharers of every block of a prompt of 17+ blocks, 132 live sequences, forks 3 deep;
    ("fork-wide.jsonl", "wide_forks",
     {"block_size": 16, "prompt_blocks": [17, 24], "width": 130, "depth": 3}, 0),
    # 10^4 operations over 48 blocks: ids reused many times, ledger-only (its header says).
    ("long-history.jsonl", "long_history",
     {"num_ops": 10000, "block_size": 16, "num_blocks": 48, "max_live": 10,
      "prompt_tokens": [1, 64], "max_tokens": 160, "fork_depth": 3}, 0),
    # Prefix-cache isolation: one prompt under two tenants of salt "a", one of salt "b", one with
    # none and one with adapter "a", named by block hashes and then by token ids, whole (an exact
    # multiple of the block size) and as prefixes; cached blocks evicted by later rounds.
    ("prefix-salts.jsonl", "salted_prefixes",
     {"rounds": 2, "prompt_blocks": [2, 4], "aligned_rate": 0.5, "own_rate": 0.5,
      "own_tokens": [1, 16], "output": [1, 12], "block_size": 8}, 0),
    # Eviction right after a decode step of 9+ sequences and right after a fork; several full
    # tails spilling into too few free blocks (refused with no candidate, then one victim).
    ("edge-decode.jsonl", "decode_edges",
     {"block_size": 16, "num_blocks": 16, "rounds": 2, "width": [9, 12], "spill": [2, 4],
      "tenants": {"fg": 2, "bg": 1}}, 0),
    # Hybrid decode: one-token and multi-token steps across a sliding window's block and window
    # edges, before and after a fork.
    ("hybrid-decode.jsonl", "window_decode",
     {"model": "tiny-hybrid", "rounds": 2, "block_size": 8}, 0),
    # Scheduler lifecycles (SPEC §13). Prompts written in chunks of 24 tokens (ending inside
    # blocks of 16) beside sharers of their prefixes that arrive between the chunks;
    ("lifecycle-chunked.jsonl", "chunked_prefill",
     {"num_requests": 12, "prefixes": 3, "prefix_blocks": [2, 5], "own_tokens": [1, 30],
      "chunk": 24, "whole_rate": 0.3, "concurrency": 4, "output": [4, 16], "decode_chunk": 4,
      "block_size": 16}, 0),
    # speculative decoding, 4 drafts a round, 0.6 of them accepted, over forks;
    ("lifecycle-speculative.jsonl", "speculative_forks",
     {"num_trees": 3, "width": 3, "prompt": [20, 70], "rounds": [5, 9], "k": 4,
      "acceptance": 0.6, "prune_rate": 0.2, "block_size": 16}, 0),
    # preemption by recompute (and resume) under a budget of 16 blocks.
    ("lifecycle-preempt.jsonl", "preemption",
     {"num_requests": 10, "prompt": [20, 90], "output": [20, 60], "decode_chunk": 6,
      "num_blocks": 16, "block_size": 16}, 0),
    # Tiers (SPEC §11): conversations whose turns are stored to host and disk between turns and
    # loaded back, leased blocks freed before their store completes, a failing store, an
    # aborted load, two salts over the same hashes, a device hit beside a load.
    ("tier-turns.jsonl", "tiered_turns", {"conversations": 5, "turns": 4, "block_size": 8}, 0),
    # Agents over one long shared prefix, reloaded every round from host and disk, by loads
    # that overlap (a tier block read by two loads at once, a store between their completions).
    ("tier-agentic.jsonl", "agentic_prefix", {"agents": 2, "rounds": 8}, 0),
    # SPEC §12: Llama-4-style chunked attention (chunked(32) on 3 of 4 layers): prompts across
    # chunk edges, decode into the next chunk (every block of the last released), forks and
    # prefix hits that need only the current chunk's blocks, under a tight budget.
    ("variant-chunked.jsonl", "hybrid_windows",
     {"model": "tiny-chunked", "num_requests": 24, "prompts": 1, "prompt_tokens": [20, 100],
      "aligned_rate": 0.3, "own_rate": 0.4, "own_tokens": [1, 24], "output": [8, 48],
      "fork_rate": 0.25, "concurrency": 4, "max_batch": 3, "decode_chunk": 6, "block_size": 8,
      "budget_fraction": 0.6}, 0),
    # Attention sinks (sinks(8, 24) beside full): the sinks' block kept while the window slides
    # past it, through forks, prefix hits and eviction.
    # MLA (mla(12) on both layers of tiny-mla: one latent per token per layer, no K/V pair):
    # prefix reuse, forks and eviction with K/V arrays of [tokens, 1, layers, 1, 12].
    ("variant-mla.jsonl", "hybrid_windows",
     {"model": "tiny-mla", "num_requests": 24, "prompts": 1, "prompt_tokens": [8, 100],
      "aligned_rate": 0.3, "own_rate": 0.4, "own_tokens": [1, 24], "output": [8, 48],
      "fork_rate": 0.25, "concurrency": 4, "max_batch": 3, "decode_chunk": 6, "block_size": 8,
      "budget_fraction": 0.6}, 0),
    ("variant-sinks.jsonl", "hybrid_windows",
     {"model": "tiny-sinks", "num_requests": 24, "prompts": 1, "prompt_tokens": [8, 100],
      "aligned_rate": 0.3, "own_rate": 0.4, "own_tokens": [1, 24], "output": [8, 48],
      "fork_rate": 0.25, "concurrency": 4, "max_batch": 3, "decode_chunk": 6, "block_size": 8,
      "budget_fraction": 0.6}, 0),
    # A Mamba hybrid (tiny-mamba: state(512) on 3 of 4 layers, one full): prompts sharing a
    # prefix, so that hits need the state cached at the hit's block boundary; forks that copy
    # the state at their first token, eviction under a tight budget.
    ("variant-mamba.jsonl", "hybrid_windows",
     {"model": "tiny-mamba", "num_requests": 24, "prompts": 1, "prompt_tokens": [8, 100],
      "aligned_rate": 0.3, "own_rate": 0.4, "own_tokens": [1, 24], "output": [8, 48],
      "fork_rate": 0.25, "concurrency": 4, "max_batch": 3, "decode_chunk": 6, "block_size": 8,
      "budget_fraction": 0.6}, 0),
    # A hybrid hit cut short by the sliding window (the full group has every prompt block, the
    # window's last block was evicted), taking back older cached blocks, in an exact fit.
    ("hybrid-cut-hits.jsonl", "window_hits", {"model": "tiny-hybrid", "rounds": 3, "block_size": 8}, 0),
    # Preemption by swap (SPEC §13 over §11): up to three requests swapped to a host tier of 8
    # blocks at once, resumed first come first served; one the tier cannot hold is recomputed.
    ("lifecycle-swap.jsonl", "swap_preemption",
     {"num_requests": 10, "prompt": [10, 40], "output": [30, 80], "decode_chunk": 8,
      "num_blocks": 20, "block_size": 16, "host": 8}, 0),
    # Tiers (SPEC §11): between a store's begin and its completion its sequence is freed or
    # aborted, a second store of its blocks begins and completes, a flush takes every block the
    # leases leave, a load begins (and a prefill of its prompt arrives before it completes).
    ("tier-races.jsonl", "tier_races", {"rounds": 10}, 0),
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


__all__ = ["CANONICAL", "canonical_traces", "write_canonical"]
