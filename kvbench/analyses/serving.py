"""A closed-loop serving simulation over a real backend, and the memory breakdown of SPEC §3.

:func:`simulate` serves a list of :class:`kvbench.traces.loaders.Request` with continuous batching, the
way vLLM's scheduler does, on one backend; the backend's own free memory decides admission. Every
operation it applies is logged as a :class:`kvbench.traces.format.Trace` (family ``serving``), so the
checker verifies the simulation like any other trace.

One simulated step is one scheduler iteration, in this order (vLLM v1's: running requests first,
waiting ones with what is left):

1. **Decode**: every running sequence gains one token, as ONE batched append. When it does not
   fit (``OutOfMemory``), the most recently admitted running sequence is preempted (vLLM's
   recompute preemption): freed, its request put back at the head of the queue with the tokens it
   generated, and the append retried with the rest of the batch. A sequence that cannot grow even
   alone in the cache can never finish: it is freed and counted as rejected.
2. Sequences that reached their output length are freed.
3. **Admission** (skipped in a step that preempted, as vLLM does): FCFS from the head of the
   queue while the batch has fewer than ``max_batch`` sequences: the backend's prefill of the
   prompt (plus the tokens generated before a preemption, under a NEW sequence id). On
   ``OutOfMemory`` admission stops for this step: the head blocks the queue. A request that does
   not fit in a cache with nothing running can never run: it is dropped and counted as rejected.
   A request with 0 output tokens is prefilled and freed at once.

A request is eligible from step ``ceil(arrival / step_seconds)``; ``step_seconds`` (default
50 ms, about one decode iteration of a 13B model) maps trace seconds onto steps. ``max_steps``
is the admission horizon: after it no new request is admitted, and the running ones (with those
preempted and waiting to resume) are served to the end, so that every length the backend was told
(``final_tokens``, which the contiguous reservations use) is the one the logged trace records.
Refused prefills are never logged (they are retried), so the trace replays with no OOM.

Trace steps are operation indices (SPEC §5: the clock advances once per operation); the
simulated step of each sample is in :attr:`SimResult.samples`.

The breakdown (:func:`breakdown`) averages, over *saturated* steps, each category as a share of
the whole budget. A step is saturated when a request was waiting for memory at its end: its
admission was refused by the backend, or skipped because the step preempted. That is the state
the PagedAttention paper's figure describes (memory is what keeps requests out); steps with an
empty queue measure the arrival rate, not the allocator, and the final drain measures neither.
Paper-style categories: on a saturated step of the contiguous layout, the free tail of the arena
(which the ledger calls ``free``) was too small for the waiting request's reservation (first fit
would have placed it otherwise), so it counts as external fragmentation, as the paper counts
Orca's leftover; a paged pool's free blocks stay ``free`` (any request can use any block; the
waiting one needs more of them).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.contract import formulas as F
from kvbench.contract import registry
from kvbench.traces.loaders import LOADERS, Request, load_requests, split_block_hashes
from kvbench.contract.protocol import Backend, CacheConfig, OutOfMemory, kv_tokens, kv_values
from kvbench.traces.format import Append, Free, Header, Prefill, Trace

SIM_VERSION = 1
STEP_SECONDS = 0.05
DEFAULT_MAX_BATCH = 256  # vLLM's default max_num_seqs
CATEGORIES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation",
              "free")
BREAKDOWN_BACKENDS = ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "numpy", "torch")


@dataclass
class SimResult:
    """What one backend did with one request list."""

    trace: Trace
    backend: str
    config: CacheConfig  # the backend's effective config (registry overrides applied)
    layout: str
    samples: pd.DataFrame  # one row per simulated step that had work (idle steps are skipped)
    requests: int
    admitted: int  # distinct requests admitted at least once
    finished: int
    unserved: int  # still waiting at the end (the horizon stopped admission)
    rejected: dict  # reason -> requests that could never run
    preemptions: int
    recomputed_tokens: int  # tokens re-prefilled after a preemption
    admissions: list  # (simulated step, request index, sequence id), in order
    steps: int  # simulated steps, idle ones included
    prompt_tokens: int  # tokens prefilled (recomputations included)
    output_tokens: int  # tokens appended by decode steps
    wall_seconds: float
    backend_seconds: float  # inside the backend's prefill/append/free calls
    prefix_hit_blocks: int = 0  # prompt blocks the backend found in its prefix cache

    @property
    def max_running(self) -> int:
        return int(self.samples["running"].max()) if len(self.samples) else 0

    def throughput(self) -> dict:
        steps = self.steps or 1
        wall = self.wall_seconds or float("nan")
        return {
            "requests_per_step": self.finished / steps,
            "output_tokens_per_step": self.output_tokens / steps,
            "tokens_per_step": (self.prompt_tokens + self.output_tokens) / steps,
            "steps_per_s": self.steps / wall,
            "ops_per_s": len(self.trace) / wall,
        }


@dataclass
class _Running:
    request: int
    tokens: int
    final: int
    generated: int


def _make_backend(backend, config: CacheConfig | None) -> tuple[Backend, str]:
    config = config or CacheConfig()
    if isinstance(backend, str):
        entry = registry.resolve(backend)
        ok, why = entry.available()
        if not ok:
            raise ValueError(f"backend {backend!r} cannot run here: {why}")
        return entry.create(config), backend
    made = backend(config)
    if not isinstance(made, Backend):
        raise TypeError(f"{backend!r} made a {type(made).__name__}, not a kvbench Backend")
    return made, made.name


def _prompt_hashes(req: Request, index: int, block_size: int):
    """The request's hashes over full blocks of ``block_size`` (None when it has none)."""
    hashes = req.block_hashes
    if hashes is None:
        return None
    size = getattr(req, "hash_block_size", None)
    if size is not None and size != block_size:
        try:
            hashes = split_block_hashes(hashes, req.prompt_tokens, block_size, size)
        except ValueError as e:
            raise ValueError(f"request {index}: its block hashes cannot be mapped onto blocks of "
                             f"{block_size} tokens: {e}") from None
    return tuple(hashes)[:req.prompt_tokens // block_size]


def simulate(requests, backend="numpy", config: CacheConfig | None = None, *,
             max_batch: int = DEFAULT_MAX_BATCH, max_steps: int | None = None,
             step_seconds: float = STEP_SECONDS, seed: int | None = None, name: str | None = None,
             source: dict | None = None) -> SimResult:
    """Serve ``requests`` on one backend (a registry name, a factory or a Backend class).

    ``source`` (what the requests came from) and ``seed`` go into the trace header.
    """
    reqs = list(requests)
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int)
                                  or max_steps < 0):
        raise ValueError(f"max_steps must be a non-negative integer or None, got {max_steps!r}")
    if not (isinstance(step_seconds, (int, float)) and step_seconds > 0 and math.isfinite(step_seconds)):
        raise ValueError(f"step_seconds must be a positive number, got {step_seconds!r}")
    be, label = _make_backend(backend, config)
    cfg = be.config
    if cfg.policy is not None:
        raise ValueError(f"the serving simulation preempts by itself (recompute); run it without an "
                         f"eviction policy (got policy={cfg.policy!r})")
    B = cfg.block_size
    store = cfg.store_kv and be.capabilities.holds_kv
    model, dtype = cfg.model, cfg.kv_dtype

    prompt = np.array([r.prompt_tokens for r in reqs], dtype=np.int64)
    output = np.array([r.output_tokens for r in reqs], dtype=np.int64)
    arrival = np.array([r.arrival for r in reqs], dtype=float)
    for what, bad in (("prompt_tokens must be >= 1", prompt < 1), ("output_tokens must be >= 0", output < 0),
                      ("arrival must be a finite number >= 0", ~(np.isfinite(arrival) & (arrival >= 0)))):
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"request {i}: {what}, got {reqs[i]}")
    hashes = [_prompt_hashes(r, i, B) for i, r in enumerate(reqs)]
    eligible = np.ceil(arrival / step_seconds).astype(np.int64)
    order = np.argsort(eligible, kind="stable")  # FCFS: arrival step, then list order
    rejected: dict[str, int] = {}
    # A request longer than the model's context cannot be served by any backend.
    too_long = prompt + output > cfg.max_context
    if too_long.any():
        rejected[f"longer than max_context {cfg.max_context}"] = int(too_long.sum())
        order = order[~too_long[order]]

    ops: list = []
    queue: deque = deque()
    running: dict[int, _Running] = {}  # insertion order = admission order
    generated = np.zeros(len(reqs), dtype=np.int64)  # tokens generated before a preemption
    started = np.zeros(len(reqs), dtype=bool)
    admissions, samples = [], []
    counts = dict(admitted=0, finished=0, preemptions=0, recomputed=0, prompt=0, output=0)
    backend_seconds = 0.0
    next_seq, ptr, t, hit_blocks = 0, 0, 0, 0

    def timed(fn, *args, **kw):
        nonlocal backend_seconds
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            backend_seconds += time.perf_counter() - t0

    def reject(reason):
        rejected[reason] = rejected.get(reason, 0) + 1

    def free(seq):
        timed(be.free, seq, step=len(ops))
        ops.append(Free(len(ops), seq))

    wall0 = time.perf_counter()
    while True:
        admitting = max_steps is None or t < max_steps
        if admitting:
            while ptr < len(order) and eligible[order[ptr]] <= t:
                queue.append(int(order[ptr]))
                ptr += 1
        resumable = bool(queue) and (admitting or started[queue[0]])
        if not running and not resumable:
            if admitting and ptr < len(order) and (max_steps is None or eligible[order[ptr]] < max_steps):
                t = int(eligible[order[ptr]])  # idle until the next arrival
                continue
            break

        # 1-2. decode the running batch, preempting the latest admitted until it fits.
        preempted = finished = 0
        batch = list(running)
        decoded = 0
        while batch:
            kv = None
            if store:
                kv = kv_tokens(batch, [running[s].tokens for s in batch], model, dtype)
            try:
                timed(be.append, batch, [1] * len(batch), kv, step=len(ops))
            except OutOfMemory:
                victim = batch[-1]
                st = running.pop(victim)
                free(victim)
                if not running:
                    reject("cannot grow even alone in the cache")
                else:
                    generated[st.request] = st.generated
                    queue.appendleft(st.request)
                    preempted += 1
                batch = list(running)
                continue
            ops.append(Append(len(ops), tuple(batch), (1,) * len(batch)))
            decoded = len(batch)
            counts["output"] += decoded
            for s in batch:
                st = running[s]
                st.tokens += 1
                st.generated += 1
                if st.tokens == st.final:
                    del running[s]
                    free(s)
                    finished += 1
            break
        counts["preemptions"] += preempted

        # 3. FCFS admission while memory and the batch allow.
        blocked = False
        prefilled = 0
        while not preempted and queue and len(running) < max_batch:
            i = queue[0]
            if not admitting and not started[i]:
                break
            tokens = int(prompt[i] + generated[i])
            final = int(prompt[i] + output[i])
            seq = next_seq
            kv = kv_values(seq, 0, tokens, model, dtype) if store else None
            try:
                timed(be.prefill, seq, tokens, kv, tenant=reqs[i].tenant, final_tokens=final,
                      step=len(ops), block_hashes=hashes[i])
            except OutOfMemory:
                if running:
                    blocked = True
                    break
                queue.popleft()
                reject("does not fit in an empty cache")
                continue
            queue.popleft()
            next_seq += 1
            ops.append(Prefill(len(ops), seq, reqs[i].tenant, tokens, hashes[i]))
            admissions.append((t, i, seq))
            prefilled += 1
            counts["prompt"] += tokens
            if started[i]:
                counts["recomputed"] += tokens
            else:
                started[i] = True
                counts["admitted"] += 1
            if tokens == final:  # no output token to generate
                free(seq)
                finished += 1
            else:
                running[seq] = _Running(i, tokens, final, int(generated[i]))
        counts["finished"] += finished

        ledger = be.ledger()
        hit_blocks = getattr(ledger, "prefix_hit_blocks", 0)
        samples.append({"step": t, "running": len(running), "waiting": len(queue),
                        "decoded": decoded, "prefilled": prefilled, "preempted": preempted,
                        "finished": finished,
                        "waiting_for_memory": bool(blocked or (preempted and queue)),
                        **{c: getattr(ledger, c) for c in CATEGORIES}})
        t += 1
    wall = time.perf_counter() - wall0
    be.close()  # the samples hold all the ledger we need; free device memory

    header = Header(
        family="serving", generator=f"kvbench.serving.simulate v{SIM_VERSION}",
        params={"backend": label, "requests": len(reqs), "max_batch": max_batch, "max_steps": max_steps,
                "step_seconds": step_seconds, **(source or {})},
        seed=seed,
        settings={"model": cfg.model.name, "block_size": B, "num_blocks": cfg.num_blocks,
                  "max_context": cfg.max_context, **({"prefix_caching": True} if cfg.prefix_caching else {})})
    trace = Trace(header, ops, name=name or f"serving-{label}")  # valid by construction (tests validate)
    return SimResult(
        trace=trace, backend=label, config=cfg, layout=be.capabilities.layout,
        samples=pd.DataFrame(samples, columns=["step", "running", "waiting", "decoded", "prefilled",
                                               "preempted", "finished", "waiting_for_memory",
                                               *CATEGORIES]),
        requests=len(reqs), admitted=counts["admitted"], finished=counts["finished"],
        unserved=len(queue) + (len(order) - ptr), rejected=rejected,
        preemptions=counts["preemptions"], recomputed_tokens=counts["recomputed"],
        admissions=admissions, steps=t, prompt_tokens=counts["prompt"], output_tokens=counts["output"],
        wall_seconds=wall, backend_seconds=backend_seconds, prefix_hit_blocks=hit_blocks)


# --- the memory breakdown (SPEC §3) -------------------------------------------------------------

def paper_categories(result: SimResult) -> pd.DataFrame:
    """Per-step slots in the paper's categories (see the module docstring for the rule)."""
    s = result.samples[list(CATEGORIES)].copy()
    if result.layout == "contiguous":
        tail = result.samples["waiting_for_memory"].to_numpy()
        s.loc[tail, "external_fragmentation"] += s.loc[tail, "free"]
        s.loc[tail, "free"] = 0
    return s


def breakdown(result: SimResult, over: str = "saturated") -> dict:
    """Each category's mean share of the budget, over ``saturated`` steps (a request waited for
    memory) or ``all`` steps the simulation recorded; falls back to ``all`` when none saturated."""
    if over not in ("saturated", "all"):
        raise ValueError(f"over must be 'saturated' or 'all', got {over!r}")
    cats = paper_categories(result)
    mask = result.samples["waiting_for_memory"].to_numpy()
    if over == "all" or not mask.any():
        over, mask = "all", np.ones(len(cats), dtype=bool)
    total = result.config.arena_slots
    shares = (cats[mask].mean() / total) if mask.any() else pd.Series(0.0, index=list(CATEGORIES))
    return {**{c: float(shares[c]) for c in CATEGORIES}, "averaged_over": over,
            "steps_averaged": int(mask.sum()),
            "mean_running": float(result.samples["running"][mask].mean()) if mask.any() else 0.0}


def summary_row(result: SimResult, over: str = "saturated") -> dict:
    return {"backend": result.backend, "layout": result.layout, **breakdown(result, over),
            "max_running": result.max_running, "requests": result.requests,
            "admitted": result.admitted, "finished": result.finished, "unserved": result.unserved,
            "rejected": sum(result.rejected.values()), "preemptions": result.preemptions,
            "recomputed_tokens": result.recomputed_tokens, "prefix_hit_blocks": result.prefix_hit_blocks,
            "steps": result.steps, "ops": len(result.trace),
            **result.throughput(), "wall_s": result.wall_seconds, "backend_s": result.backend_seconds}


def available_backends(device: str = "cpu") -> list[str]:
    """The breakdown's backends that run here. torch only on CUDA: on CPU it must report the very
    ledger numpy does (the checker holds both to the oracle), at a fraction of the speed; name it
    explicitly to include it anyway."""
    names = [n for n in BREAKDOWN_BACKENDS if n != "torch" or str(device).startswith("cuda")]
    return [n for n in names if registry.resolve(n).available()[0]]


def memory_breakdown(requests, config: CacheConfig, backends=None, *, over: str = "saturated",
                     progress: bool = False, **sim) -> tuple[pd.DataFrame, dict]:
    """Simulate each backend on the same requests: (one row per backend, {backend: SimResult})."""
    names = list(backends) if backends else available_backends(config.device)
    results = {}
    for n in names:
        if progress:
            print(f"simulating {n} ...", file=sys.stderr, flush=True)
        results[n] = simulate(requests, n, config, **sim)
    return pd.DataFrame([summary_row(r, over) for r in results.values()]), results


LABELS = {"token_states": "token states", "reservation": "reservation",
          "internal_fragmentation": "internal fragmentation",
          "external_fragmentation": "external fragmentation", "free": "free"}
COLORS = {"token_states": "#4c72b0", "reservation": "#dd8452", "internal_fragmentation": "#c44e52",
          "external_fragmentation": "#8172b3", "free": "#cccccc"}


def plot_breakdown(table: pd.DataFrame, path, title: str = "KV cache memory breakdown") -> Path:
    """A stacked bar per backend (shares of the budget), written as PNG with the Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.6 * len(table) + 3.2, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(table))
    bottom = np.zeros(len(table))
    for c in CATEGORIES:
        vals = table[c].to_numpy(dtype=float) * 100
        ax.bar(x, vals, bottom=bottom, color=COLORS[c], label=LABELS[c], width=0.6)
        bottom += vals
    for xi, v in zip(x, table["token_states"].to_numpy(dtype=float) * 100):
        ax.text(xi, v / 2, f"{v:.1f}%", ha="center", va="center", color="white", fontsize=9)
    if "paper_token_states" in table:
        for xi, v in zip(x, table["paper_token_states"].to_numpy(dtype=float) * 100):
            if np.isfinite(v):
                ax.plot([xi - 0.3, xi + 0.3], [v, v], color="black", lw=1.5, ls="--")
        ax.plot([], [], color="black", lw=1.5, ls="--", label="paper: token states")
    ax.set_xticks(x, table["backend"].tolist(), fontsize=9)
    ax.set_ylabel("share of the KV budget (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


# --- the paper's setting: OPT-13B, 12 GiB of KV cache, ShareGPT lengths -------------------------

OPT13B = {
    "model": "opt-13b",  # 819,200 B/token = 800 KiB
    "budget": "12GiB",  # floor(12 GiB / (16 * 800 KiB)) = 983 blocks = 15,728 slots
    "block_size": 16,
    "max_context": 2048,
    "law": "sharegpt",  # lognormal, means 161 prompt / 338 output tokens (kvbench.traces.laws)
    "num_requests": 400,
    "max_steps": 3000,  # admission horizon; the running requests then finish
    "seed": 0,
}
# Token-state shares reported by the PagedAttention paper (Kwon et al., SOSP'23, Figure 2).
PAPER_TOKEN_STATES = {"contiguous-max": 0.204, "contiguous-pow2": 0.268, "contiguous-oracle": 0.382,
                      "numpy": 0.963, "torch": 0.963}
PAPER_SYSTEM = {"contiguous-max": "Orca (Max)", "contiguous-pow2": "Orca (Pow2)",
                "contiguous-oracle": "Orca (Oracle)", "numpy": "vLLM", "torch": "vLLM"}


def opt13b_config(device: str = "cpu") -> CacheConfig:
    """Ledger only: with K/V arrays the pool would take the whole 12 GiB."""
    model = F.get_model(OPT13B["model"])
    blocks = F.budget_blocks(OPT13B["budget"], OPT13B["block_size"], model)
    return CacheConfig(model=model, block_size=OPT13B["block_size"], num_blocks=blocks, store_kv=False,
                       device=device, max_context=OPT13B["max_context"])


def opt13b_requests(num_requests: int = OPT13B["num_requests"], seed: int = OPT13B["seed"]) -> list[Request]:
    """ShareGPT-like lengths, all waiting at time 0 (a saturated server).

    Prompt and output are drawn from the ``sharegpt`` law clipped to the 2,048-token context; the
    output is then cut so that prompt + output fits the context (OPT-13B cannot go further).
    """
    from kvbench.traces.generators import request_laws
    ctx = OPT13B["max_context"]
    prompt_law, output_law = request_laws(OPT13B["law"], max_prompt=ctx, max_output=ctx)
    rng = np.random.default_rng(seed)
    prompts, outputs = prompt_law.sample(rng, num_requests), output_law.sample(rng, num_requests)
    outputs = np.minimum(outputs, ctx - prompts)
    return [Request(0.0, int(p), int(o), "sharegpt") for p, o in zip(prompts, outputs)]


def run_opt13b(backends=None, *, num_requests: int = OPT13B["num_requests"],
               max_steps: int | None = OPT13B["max_steps"], seed: int = OPT13B["seed"],
               max_batch: int = DEFAULT_MAX_BATCH, device: str = "cpu",
               progress: bool = False) -> tuple[pd.DataFrame, dict]:
    """The breakdown table of the paper's setting, with the paper's token-state shares beside it."""
    reqs = opt13b_requests(num_requests, seed)
    table, results = memory_breakdown(
        reqs, opt13b_config(device), backends, max_batch=max_batch, max_steps=max_steps, seed=seed,
        progress=progress, source={"scenario": "opt13b", **{k: v for k, v in OPT13B.items()
                                                             if k not in ("max_steps", "seed")},
                                   "num_requests": num_requests})
    table.insert(1, "paper_system", table["backend"].map(PAPER_SYSTEM).fillna("-"))
    table.insert(2, "paper_token_states", table["backend"].map(PAPER_TOKEN_STATES))
    return table, results


PAPER_COLUMNS = ["backend", "paper_system", "paper_token_states", *CATEGORIES, "averaged_over",
                 "steps_averaged", "mean_running", "max_running", "finished", "preemptions",
                 "recomputed_tokens", "steps", "output_tokens_per_step"]


def markdown_table(table: pd.DataFrame) -> str:
    """The breakdown as a markdown table, shares in percent."""
    cols = [c for c in PAPER_COLUMNS if c in table]
    df = table[cols].copy()
    for c in ("paper_token_states", *CATEGORIES):
        if c in df:
            df[c] = df[c].map(lambda v: "-" if pd.isna(v) else f"{100 * v:.1f}%")
    for c in ("mean_running", "output_tokens_per_step"):
        if c in df:
            df[c] = df[c].map(lambda v: f"{v:.2f}")
    head = "| " + " | ".join(cols) + " |"
    rule = "|" + "|".join("---" for _ in cols) + "|"
    rows = ["| " + " | ".join(str(v) for v in r) + " |" for r in df.itertuples(index=False)]
    return "\n".join([head, rule, *rows]) + "\n"


def write_paper_files(table: pd.DataFrame, directory="results/paper",
                      num_requests: int = OPT13B["num_requests"]) -> list[Path]:
    """``breakdown.csv``, ``breakdown.md`` and ``breakdown.png`` of a :func:`run_opt13b` table."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path, png_path = out / "breakdown.csv", out / "breakdown.md", out / "breakdown.png"
    cols = [c for c in PAPER_COLUMNS if c in table] + [c for c in table if c not in PAPER_COLUMNS]
    table[cols].to_csv(csv_path, index=False, float_format="%.6g")
    md_path.write_text(
        "# OPT-13B, 12 GiB KV budget, ShareGPT-like lengths: memory breakdown\n\n"
        f"Generated by `kvbench.analyses.breakdown.write_paper_results` ({num_requests} requests, all waiting at "
        "time 0; shares of the 15,728-slot budget averaged over saturated steps).\n\n"
        + markdown_table(table), encoding="utf-8")
    plot_breakdown(table, png_path, title=f"OPT-13B, 12 GiB KV, ShareGPT-like ({num_requests} requests), "
                                          "saturated steps (dashed: paper)")
    return [csv_path, md_path, png_path]


def write_paper_results(directory="results/paper", backends=None, **opts) -> list[Path]:
    """Run the OPT-13B scenario (``opts`` go to :func:`run_opt13b`) and write its files."""
    table, _ = run_opt13b(backends, **opts)
    return write_paper_files(table, directory, opts.get("num_requests", OPT13B["num_requests"]))


# --- command line: `kvbench run --trace PATH --format F` and `kvbench run --scenario opt13b` ----

SCENARIOS = ("opt13b",)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Options of the serving simulation. An option the parser already has (``kvbench run``'s
    --backend, --model, --block-size, --budget, --max-context, --device, --output, --quiet, ...)
    is kept as it is, so the same call serves `kvbench run` and a parser of its own."""
    g = parser.add_argument_group("serving simulation (--trace PATH --format F, or --scenario opt13b)")

    def add(*flags, **kw):
        try:
            g.add_argument(*flags, **kw)
        except argparse.ArgumentError:  # the host parser defines it already
            pass

    add("--trace", help="a public request trace to serve (see --format)")
    add("--format", choices=sorted(LOADERS), help="format of --trace")
    add("--scenario", choices=SCENARIOS,
        help="opt13b: the PagedAttention paper's setting (OPT-13B, 12 GiB, ShareGPT lengths)")
    add("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="most running sequences")
    add("--max-steps", type=int, help="admission horizon in steps (running requests then finish)")
    add("--step-seconds", type=float, default=STEP_SECONDS,
        help="simulated seconds per step: maps trace arrivals onto steps")
    add("--max-requests", type=int, help="serve only the first N requests")
    add("--seed", type=int, default=0, help="seed of generated arrivals / lengths")
    add("--rate", type=float, default=1.0, help="--format lengths: arrivals per second")
    add("--prefix-caching", action="store_true", help="reuse prompt blocks by their hashes")
    add("--store-kv", action="store_true", help="hold real K/V arrays (default: ledger only)")
    add("--check", action="store_true", help="replay each backend's logged trace through the checker")
    add("--save-traces", metavar="DIR", help="write each backend's logged trace there")
    add("--plot", metavar="PNG", help="write the stacked-bar breakdown there")
    add("--paper-out", metavar="DIR",
        help="--scenario opt13b: write breakdown.csv/.md/.png there (e.g. results/paper)")
    add("--backend", action="append", help="backend name (repeatable)")
    add("--model", help="model preset (default opt-13b)")
    add("--block-size", type=int, help="default 16")
    add("--budget", help="blocks ('1024') or bytes (default '12GiB')")
    add("--max-context", type=int, help="default: next pow2 of the longest request")
    add("--device", default="cpu")
    add("--output", help="results file")
    add("--quiet", action="store_true")


def wants_serving(args) -> bool:
    """True when ``kvbench run`` was asked for a serving simulation."""
    return bool(getattr(args, "trace", None) or getattr(args, "scenario", None))


SERVE_COLUMNS = ["backend", *CATEGORIES, "averaged_over", "steps_averaged", "max_running", "finished",
                 "rejected", "unserved", "preemptions", "steps", "output_tokens_per_step", "steps_per_s"]


def _serve_config(args, requests) -> CacheConfig:
    model = F.get_model(getattr(args, "model", None) or OPT13B["model"])
    bs = getattr(args, "block_size", None) or OPT13B["block_size"]
    blocks = F.budget_blocks(getattr(args, "budget", None) or OPT13B["budget"], bs, model)
    longest = max((r.prompt_tokens + r.output_tokens for r in requests), default=1)
    mc = getattr(args, "max_context", None) or F.next_pow2(longest)
    return CacheConfig(model=model, block_size=bs, num_blocks=blocks,
                       store_kv=bool(getattr(args, "store_kv", False)),
                       device=getattr(args, "device", "cpu") or "cpu", max_context=int(mc),
                       prefix_caching=bool(getattr(args, "prefix_caching", False)))


def _load(args) -> list[Request]:
    opts = {}
    if args.format == "lengths":
        opts = {"rate": args.rate, "seed": args.seed, "max_requests": args.max_requests}
    elif args.format == "servegen":
        opts = {"seed": args.seed, "max_requests": args.max_requests}
    elif args.format == "mooncake":
        opts = {"block_size": getattr(args, "block_size", None) or OPT13B["block_size"]}
    reqs = load_requests(args.trace, args.format, **opts)
    return reqs[:args.max_requests] if args.max_requests is not None else reqs


def run_serving(args) -> int:
    """Run the simulation the options ask for; print the table; 1 if a checked trace failed."""
    from kvbench.bench import records
    from kvbench.cli import print_table
    from kvbench.traces.format import save

    policy = getattr(args, "policy", None)
    if policy not in (None, "auto", "none"):
        raise ValueError(f"the serving simulation preempts by itself; --policy {policy} does not apply")
    if args.trace and args.scenario:
        raise ValueError("give --trace or --scenario, not both")
    backends = getattr(args, "backend", None) or available_backends(getattr(args, "device", "cpu") or "cpu")
    sim = {"max_batch": args.max_batch, "max_steps": args.max_steps, "seed": args.seed}
    progress = not getattr(args, "quiet", False)
    if args.scenario == "opt13b":
        n = args.max_requests or OPT13B["num_requests"]
        steps = args.max_steps if args.max_steps is not None else OPT13B["max_steps"]
        table, sims = run_opt13b(backends, num_requests=n, max_steps=steps, seed=args.seed,
                                 max_batch=args.max_batch, device=getattr(args, "device", "cpu"),
                                 progress=progress)
        if args.paper_out:
            for p in write_paper_files(table, args.paper_out, n):
                print(f"wrote {p}")
        params = {"scenario": "opt13b", **OPT13B, "num_requests": n, "max_steps": steps}
    else:
        if not args.trace or not args.format:
            raise ValueError("a serving run needs --trace PATH and --format "
                             f"({', '.join(sorted(LOADERS))}), or --scenario opt13b")
        reqs = _load(args)
        cfg = _serve_config(args, reqs)
        source = {"trace": str(args.trace), "format": args.format}
        table, sims = memory_breakdown(reqs, cfg, backends, step_seconds=args.step_seconds,
                                       source=source, progress=progress, **sim)
        params = {**source, "model": cfg.model.name, "block_size": cfg.block_size,
                  "num_blocks": cfg.num_blocks, "max_context": cfg.max_context, **sim,
                  "step_seconds": args.step_seconds, "prefix_caching": cfg.prefix_caching}
    paper = ["paper_token_states"] if "paper_token_states" in table else []
    cols = ["backend", *paper, *SERVE_COLUMNS[1:]]
    print_table(table, cols)
    code = 0
    if args.check:
        from kvbench.checking.checker import check
        for name, r in sims.items():
            fresh = registry.create(name, r.config)
            try:
                v = check(r.trace, fresh, gather="touched")
            finally:
                fresh.close()
            print(f"{v.status:4} {name}: replay of {len(r.trace)} logged ops"
                  + (f"\n     first divergence: {v.divergence}" if v.divergence else ""))
            code = max(code, 1 if v.valid is False else 0)
    if args.save_traces:
        out = Path(args.save_traces)
        out.mkdir(parents=True, exist_ok=True)
        for name, r in sims.items():
            save(r.trace, str(out / f"{r.trace.name}.jsonl"))
        print(f"logged traces in {out}")
    if args.plot:
        print(f"wrote {plot_breakdown(table, args.plot)}")
    rec = records.record("serve", table.to_dict("records"), {**params, "backends": backends},
                         device=getattr(args, "device", None))
    print(f"results in {records.write(rec, getattr(args, 'output', None))}")
    return code


def main(argv=None) -> int:
    """Stand-alone entry (the CLI wires the same options into `kvbench run`)."""
    parser = argparse.ArgumentParser(prog="kvbench-serve", description=__doc__.splitlines()[0])
    add_serve_args(parser)
    return run_serving(parser.parse_args(argv))


__all__ = ["simulate", "SimResult", "breakdown", "paper_categories", "memory_breakdown",
           "plot_breakdown", "opt13b_config", "opt13b_requests", "run_opt13b", "write_paper_results",
           "write_paper_files",
           "add_serve_args", "run_serving", "wants_serving", "OPT13B", "PAPER_TOKEN_STATES"]
