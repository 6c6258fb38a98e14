"""Prefix-cache hit rates of a request trace, over cache sizes, confirmed by the checker.

Each request's prompt is prefilled (its full blocks named by hash) and freed at once, so the
cache holds exactly the freed prompt blocks, evicted oldest first when their space is needed.
The hits are the backend's own count (``Ledger.prefix_hit_blocks``), compared after every
operation with the oracle's.
"""
from __future__ import annotations

import pandas as pd

from kvbench.charts import finish
from kvbench.checking.checker import check
from kvbench.checking.raised import make
from kvbench.checking.verdict import divergence_classes
from kvbench.contract.formulas import blocks_needed, get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.progress import Progress
from kvbench.traces.format import Free, Header, Prefill, Trace
from kvbench.traces.loaders import Request, rehash_requests


def cache_trace(requests: list[Request], block_size: int, name: str = "prefix-cache") -> Trace:
    """Prefill then free every request, in order, with its full-block hashes at ``block_size``."""
    reqs = rehash_requests(requests, block_size)
    ops = []
    for i, r in enumerate(reqs):
        ops.append(Prefill(2 * i, i, r.tenant, r.prompt_tokens, tuple(r.block_hashes)))
        ops.append(Free(2 * i + 1, i))
    header = Header(family="prefix-cache", generator="kvbench.prefix.cache_trace",
                    params={"requests": len(reqs)},
                    settings={"block_size": block_size, "prefix_caching": True})
    return Trace(header, ops, name=name)


def hashed_blocks(trace: Trace) -> int:
    return sum(len(op.block_hashes or ()) for op in trace.ops if isinstance(op, Prefill))


def unique_blocks(trace: Trace) -> int:
    """Blocks an unbounded cache ends up holding: every distinct hash."""
    return len({h for op in trace.ops if isinstance(op, Prefill) for h in op.block_hashes or ()})


def hit_rate(trace: Trace, num_blocks: int, backend: str = "numpy", progress: str = "",
             keep_going: bool = False) -> dict:
    """Replay under the checker with a cache of ``num_blocks``; the verified hit rate, or the
    backend's verdict where it is not verified: ``status`` FAIL with its first ``divergence``
    (the step it names), ERROR, n/a. ``keep_going``: past the figures that differ (check's), each
    class of divergence in ``divergences``. ``progress``: a bar (a line every few seconds in a
    log) of the operations done, named so."""
    cfg = CacheConfig(model=get_model("tiny"), block_size=trace.header.settings["block_size"],
                      num_blocks=num_blocks, store_kv=False, prefix_caching=True)
    bar = Progress(len(trace.ops), progress, "ops") if progress else None
    cache = make(backend, cfg)
    try:
        v = check(trace, cache, gather="none", progress=bar, keep_going=keep_going)
    finally:
        cache.close()
        if bar is not None:
            bar.close()
    hits, refs = v.final_ledger.get("prefix_hit_blocks", 0), hashed_blocks(trace)
    return {"backend": backend, "cache_blocks": num_blocks, "hit_blocks": hits, "hashed_blocks": refs,
            "hit_rate": hits / refs if refs else 0.0, "refused": v.ooms, "status": v.status,
            "divergence": str(v.divergence or v.error or v.not_applicable or ""),
            "divergences": divergence_classes(v)}


def hit_rate_curve(trace: Trace, sizes=None, backend: str = "numpy",
                   progress: bool = False, keep_going: bool = False) -> pd.DataFrame:
    """Hit rate against cache size, up to the unbounded cache (every distinct block kept).

    The smallest size is the largest single prompt: a smaller cache would refuse it.
    ``progress``: the operations done at each size, on stderr. A size whose check does not pass
    ends the curve there, unless ``keep_going`` (check's, and on to every size).
    """
    bs = trace.header.settings["block_size"]
    largest = max(blocks_needed(op.tokens, bs) for op in trace.ops if isinstance(op, Prefill))
    unbounded = unique_blocks(trace) + largest
    if sizes is None:
        sizes = sorted({largest, *(int(unbounded * f) for f in (0.05, 0.1, 0.2, 0.35, 0.5, 0.75)),
                        unbounded})
        sizes = [s for s in sizes if s >= largest]
    rows = []
    for i, n in enumerate(sizes, 1):
        rows.append(hit_rate(trace, n, backend, f"cache of {n} blocks ({i} of {len(sizes)})"
                             if progress else "", keep_going=keep_going))
        if rows[-1]["status"] != "pass" and not keep_going:
            break
    return pd.DataFrame(rows)


def plot_curve(curve: pd.DataFrame, path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(curve.cache_blocks, 100 * curve.hit_rate, marker="o")
    ax.set_xlabel("cache size (blocks)")
    ax.set_ylabel("prefix hit rate (% of hashed blocks)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    finish(fig, path, dpi=120)
    plt.close(fig)
