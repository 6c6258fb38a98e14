"""A closed-loop serving simulation over a real backend, and the memory breakdown of SPEC §3.

:func:`simulate` serves a list of :class:`kvbench.traces.loaders.Request` with continuous batching, the
way vLLM's scheduler does, on one backend; the backend's own free memory decides admission. Every
operation it applies is logged as a :class:`kvbench.traces.format.Trace` (family ``serving``), so the
checker verifies the simulation like any other trace.

One simulated step is one scheduler iteration, in this order (vLLM v1's: running requests first,
waiting ones with what is left):

1. **Decode**: every running sequence gains one token, as ONE batched append (with speculative
   decoding, ``speculative_k`` draft tokens after it, at most what its output has left; then
   each sequence's accept keeps ``n ~ Binomial(k, acceptance)`` of them, drawn in batch order
   from ``numpy.random.default_rng(seed)``, SPEC §13). When it does not
   fit (``OutOfMemory``), a running sequence is preempted (recompute): by default the most
   recently admitted (``victim="newest"``, vLLM's FCFS scheduler), or the one with the fewest
   tokens generated, the longest prompt among those (``"fewest-output"``, SGLang's retraction
   order), the newest of any still tied (with ``preemption="swap"``, its blocks are moved to a host
   tier of ``swap_blocks`` blocks instead, SPEC §13 over §11, and its resume moves them back under
   the same sequence id, at the head of the queue; if the tier cannot hold them it is freed and
   its resume recomputes it; resumes are never chunked): freed, its request put back at the head of the queue with the tokens it
   generated, and the append retried with the rest of the batch. A sequence that cannot grow even
   alone in the cache can never finish: it is freed and counted as rejected.
2. Sequences that reached their output length are freed.
3. **Admission** (skipped in a step that preempted, as vLLM does): FCFS from the head of the
   queue while the batch has fewer than ``max_batch`` sequences: the backend's prefill of the
   prompt (plus the tokens generated before a preemption, under a NEW sequence id). On
   ``OutOfMemory`` admission stops for this step: the head blocks the queue. A request that does
   not fit in a cache with nothing running can never run: it is dropped and counted as rejected.
   A request with 0 output tokens is prefilled and freed at once.

With a ``token_budget`` (vLLM's ``max_num_batched_tokens``), a step computes at most that many
tokens: the decode step's first (never held back), then the next chunk of each prompt being
written in chunks (admission order, one batched append; out of memory preempts as a decode step
does), then admission, whose last prompt gets the budget left as its first chunk (chunked
prefill, SPEC §13: a prefill of that chunk with the prompt's length, its rest appended in later
steps; it decodes once its prompt is complete). Without one, a prompt is prefilled whole.

A request is eligible from step ``ceil(arrival / step_seconds)``; ``step_seconds`` (default
50 ms, about one decode iteration of a 13B model) maps trace seconds onto steps. ``max_steps``
is the admission horizon: after it no new request is admitted, and the running ones (with those
preempted and waiting to resume) are served to the end, so that every length the backend was told
(``final_tokens``, which the contiguous reservations use) is the one the logged trace records.
Refused prefills are never logged (they are retried), so the trace replays with no OOM.

With ``offload`` (lower tiers, SPEC §11: host, then disk), a sequence's full hashed blocks are
stored to every tier when it is freed (write-through, as LMCache's local CPU and disk backends
are; each store completed at once), and every admission is a load: after the device's own hit,
the run of following blocks some tier holds is loaded (each from the nearest tier that holds it,
completed at once), the rest computed. :attr:`SimResult.tier_hits` counts the blocks each tier
served; ``prefix_hit_blocks`` the device's.

Trace steps are operation indices (SPEC §5: the clock advances once per operation); the
simulated step of each sample is in :attr:`SimResult.samples`.

The memory breakdown over these samples is in :mod:`kvbench.analyses.breakdown`.

Over 500 lines: one scheduler loop (admission, chunked prompts, drafts and accepts, preemption by
recompute or swap) whose steps share the running set, the queue and the backend's free memory.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvbench.contract import registry
from kvbench.contract.ledger import MEMORY_CATEGORIES
from kvbench.contract.protocol import (
    Backend,
    CacheConfig,
    OutOfMemory,
    Prompt,
    kv_tokens,
    kv_values,
    takes_lifecycle,
)
from kvbench.contract.formulas import blocks_needed
from kvbench.traces.format import Accept, Append, Free, Header, Preempt, Prefill, Resume, Trace
from kvbench.traces.tier_ops import Done, Load, Store, TierSpec
from kvbench.traces.loaders import Request, split_block_hashes

SIM_VERSION = 1
STEP_SECONDS = 0.05
DEFAULT_MAX_BATCH = 256  # vLLM's default max_num_seqs
VICTIM_ORDERS = ("newest", "fewest-output")
PREEMPTION_MODES = ("recompute", "swap")


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
    # Speculative decoding: draft tokens written and rejected; accepts that rolled back at
    # least one; blocks taken only for drafts (ceil((T+1+k)/B) - ceil((T+1)/B) per sequence and
    # step, T its length before) and those its rollbacks released (... - ceil((T+1+n)/B)).
    drafted_tokens: int = 0
    rejected_tokens: int = 0
    rollbacks: int = 0
    draft_blocks: int = 0
    rollback_blocks: int = 0
    # Chunked prefill (token_budget): prompts written over more than one step, and the chunks
    # appended after their first
    chunked_prompts: int = 0
    prompt_chunks: int = 0
    # Preemption by swap: sequences whose blocks went to the host tier, and resumed from it
    swapped_out: int = 0
    swapped_in: int = 0
    # Offload (lower tiers): prompt blocks each tier served, by tier name (tier 1 first), of the
    # hashed full prompt blocks admitted (each one a hit could serve; recomputes included)
    tier_hits: dict = field(default_factory=dict)
    prompt_blocks: int = 0

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
    prompt_left: int = 0  # of a prompt written in chunks: its tokens still to write
    recomputing: bool = False


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
             source: dict | None = None, progress=None, speculative_k: int = 0,
             acceptance: float = 0.0, token_budget: int | None = None,
             victim: str = "newest", preemption: str = "recompute", swap_blocks: int = 0,
             offload=()) -> SimResult:
    """Serve ``requests`` on one backend (a registry name, a factory or a Backend class).
    ``speculative_k`` > 0: speculative decoding with that many drafts per step, of which a
    share ``acceptance`` is kept on average (the backend must implement accept).
    ``token_budget``: the tokens one step computes at most, prompts written in chunks (the
    backend must take ``prompt_tokens``). ``victim``: which running sequence a step that does
    not fit preempts (VICTIM_ORDERS); ``preemption``: how (PREEMPTION_MODES; "swap" to a host
    tier of ``swap_blocks`` blocks, for a backend declaring swap). ``offload``: TierSpecs of
    the lower tiers freed blocks are stored to and admissions load from (nearest first).

    ``source`` (what the requests came from) and ``seed`` go into the trace header.
    ``progress`` (a kvbench.progress.Progress) is told the requests done after each step.
    """
    reqs = list(requests)
    _check_options(max_batch, max_steps, step_seconds)
    if isinstance(speculative_k, bool) or not isinstance(speculative_k, int) or speculative_k < 0:
        raise ValueError(f"speculative_k must be an integer >= 0, got {speculative_k!r}")
    if not (isinstance(acceptance, (int, float)) and 0 <= acceptance <= 1):
        raise ValueError(f"acceptance must be a number in [0, 1], got {acceptance!r}")
    if token_budget is not None and (isinstance(token_budget, bool) or not isinstance(token_budget, int)
                                     or token_budget < 1):
        raise ValueError(f"token_budget must be an integer >= 1 or None, got {token_budget!r}")
    if victim not in VICTIM_ORDERS:
        raise ValueError(f"victim must be one of {', '.join(VICTIM_ORDERS)}, got {victim!r}")
    if preemption not in PREEMPTION_MODES:
        raise ValueError(f"preemption must be one of {', '.join(PREEMPTION_MODES)}, got {preemption!r}")
    if preemption == "swap" and (isinstance(swap_blocks, bool) or not isinstance(swap_blocks, int)
                                 or swap_blocks < 1):
        raise ValueError(f"preemption='swap' needs swap_blocks, an integer >= 1, got {swap_blocks!r}")
    offload = tuple(offload)
    if offload and preemption == "swap":
        raise ValueError("offload and preemption='swap' each bring their own host tier: give one")
    if offload and token_budget is not None:
        raise ValueError("offload loads whole prompts: it cannot serve with a token budget")
    be, label = _make_backend(backend, config)
    cfg = be.config
    tiers = (TierSpec("host", swap_blocks),) if preemption == "swap" else ()
    if offload:
        missing = sorted({t.policy for t in offload} - set(be.capabilities.tiers))
        if missing:
            raise ValueError(f"backend {label!r} runs no lower tier of policy {missing[0]!r} (SPEC "
                             f"§11; its tiers: {', '.join(be.capabilities.tiers) or 'none'}): it "
                             f"cannot serve with offload")
        if not cfg.prefix_caching:
            raise ValueError("offload moves hashed blocks: it needs prefix caching on")
        be.attach_tiers(offload)
    if tiers:
        if not (be.capabilities.swap and "lru" in be.capabilities.tiers):
            raise ValueError(f"backend {label!r} does not preempt by swap (SPEC §13): it cannot serve "
                             f"with preemption='swap'")
        be.attach_tiers(tiers)
    if token_budget is not None and not takes_lifecycle(be, "chunked"):
        raise ValueError(f"backend {label!r} does not take a prompt in chunks (no chunked_prefill): "
                         f"it cannot serve with a token budget")
    if speculative_k and not takes_lifecycle(be, "speculative"):
        raise ValueError(f"backend {label!r} does not roll back draft tokens (no accept): it cannot "
                         f"serve with speculative decoding")
    if cfg.policy is not None:
        raise ValueError(f"the serving simulation preempts by itself (recompute); run it without an "
                         f"eviction policy (got policy={cfg.policy!r})")
    server = _Server(be, reqs, max_batch)
    server.k, server.acceptance, server.budget = speculative_k, float(acceptance), token_budget
    server.victim, server.swap = victim, "host" if tiers else None
    server.offload = [t.name for t in offload]
    server.rng = np.random.default_rng(0 if seed is None else seed)
    eligible = np.ceil(server.arrival / step_seconds).astype(np.int64)
    order = np.argsort(eligible, kind="stable")  # FCFS: arrival step, then list order
    # A request longer than the model's context cannot be served by any backend.
    too_long = server.prompt + server.output > cfg.max_context
    if too_long.any():
        server.rejected[f"longer than max_context {cfg.max_context}"] = int(too_long.sum())
        order = order[~too_long[order]]

    ptr, t = 0, 0
    wall0 = time.perf_counter()
    while True:
        admitting = max_steps is None or t < max_steps
        if admitting:
            while ptr < len(order) and eligible[order[ptr]] <= t:
                server.queue.append(int(order[ptr]))
                ptr += 1
        queue = server.queue
        resumable = bool(queue) and (admitting or server.started[queue[0]])
        if not server.running and not resumable:
            if admitting and ptr < len(order) and (max_steps is None or eligible[order[ptr]] < max_steps):
                t = int(eligible[order[ptr]])  # idle until the next arrival
                continue
            break
        server.left = token_budget
        decoded, preempted, finished = server.decode()
        chunk_preempted, chunk_done = server.chunks()
        preempted += chunk_preempted
        prefilled, admitted_done, blocked = (0, 0, False) if preempted else server.admit(admitting, t)
        finished += chunk_done
        server.sample(t, decoded=decoded, prefilled=prefilled, preempted=preempted,
                      finished=finished + admitted_done,
                      waiting_for_memory=bool(blocked or (preempted and queue)))
        t += 1
        if progress is not None:
            progress.set(server.counts["finished"] + sum(server.rejected.values()))
    wall = time.perf_counter() - wall0
    tier_hits = {t["name"]: t["hits"] for t in be.tier_ledgers()} if offload else {}
    be.close()  # the samples hold all the ledger we need; free device memory

    header = Header(
        # The generator name is a stable identifier recorded in logged traces.
        family="serving", generator=f"kvbench.serving.simulate v{SIM_VERSION}",
        params={"backend": label, "requests": len(reqs), "max_batch": max_batch, "max_steps": max_steps,
                "step_seconds": step_seconds,
                **({"speculative_k": speculative_k, "acceptance": acceptance} if speculative_k else {}),
                **({"token_budget": token_budget} if token_budget is not None else {}),
                **({"victim": victim} if victim != "newest" else {}),
                **({"preemption": preemption, "swap_blocks": swap_blocks} if tiers else {}),
                **({"offload": {t.name: t.capacity for t in offload}} if offload else {}),
                **(source or {})},
        seed=seed,
        settings={"model": cfg.model.name, "block_size": cfg.block_size, "num_blocks": cfg.num_blocks,
                  "max_context": cfg.max_context, **({"prefix_caching": True} if cfg.prefix_caching else {})},
        tiers=tiers or offload)
    trace = Trace(header, server.ops, name=name or f"serving-{label}")  # valid by construction (tests validate)
    c = server.counts
    return SimResult(
        trace=trace, backend=label, config=cfg, layout=be.capabilities.layout,
        samples=pd.DataFrame(server.samples, columns=SAMPLE_COLUMNS),
        requests=len(reqs), admitted=c["admitted"], finished=c["finished"],
        unserved=len(server.queue) + (len(order) - ptr), rejected=server.rejected,
        preemptions=c["preemptions"], recomputed_tokens=c["recomputed"],
        admissions=server.admissions, steps=t, prompt_tokens=c["prompt"], output_tokens=c["output"],
        wall_seconds=wall, backend_seconds=server.backend_seconds, prefix_hit_blocks=server.hit_blocks,
        tier_hits=tier_hits, prompt_blocks=c["prompt_blocks"], **{f: c[f] for f in LIFECYCLE_COUNTS})


LIFECYCLE_COUNTS = ("drafted_tokens", "rejected_tokens", "rollbacks", "draft_blocks", "rollback_blocks",
                      "chunked_prompts", "prompt_chunks", "swapped_out", "swapped_in")


SAMPLE_COLUMNS = ["step", "running", "waiting", "decoded", "prefilled", "preempted", "finished",
                  "waiting_for_memory", *MEMORY_CATEGORIES]


def _check_options(max_batch, max_steps, step_seconds) -> None:
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int)
                                  or max_steps < 0):
        raise ValueError(f"max_steps must be a non-negative integer or None, got {max_steps!r}")
    if not (isinstance(step_seconds, (int, float)) and step_seconds > 0 and math.isfinite(step_seconds)):
        raise ValueError(f"step_seconds must be a positive number, got {step_seconds!r}")


class _Server:
    """One simulation's state: the queue, the running batch, the operations logged so far."""

    def __init__(self, be: Backend, reqs: list, max_batch: int):
        self.be, self.reqs, self.max_batch = be, reqs, max_batch
        cfg = be.config
        self.store = cfg.store_kv and be.capabilities.holds_kv
        self.model, self.dtype = cfg.model, cfg.kv_dtype
        self.prompt = np.array([r.prompt_tokens for r in reqs], dtype=np.int64)
        self.output = np.array([r.output_tokens for r in reqs], dtype=np.int64)
        self.arrival = np.array([r.arrival for r in reqs], dtype=float)
        for what, bad in (("prompt_tokens must be >= 1", self.prompt < 1),
                          ("output_tokens must be >= 0", self.output < 0),
                          ("arrival must be a finite number >= 0",
                           ~(np.isfinite(self.arrival) & (self.arrival >= 0)))):
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(f"request {i}: {what}, got {reqs[i]}")
        self.hashes = [_prompt_hashes(r, i, cfg.block_size) for i, r in enumerate(reqs)]
        self.rejected: dict[str, int] = {}
        self.ops: list = []
        self.queue: deque = deque()
        self.running: dict[int, _Running] = {}  # insertion order = admission order
        self.generated = np.zeros(len(reqs), dtype=np.int64)  # tokens generated before a preemption
        self.started = np.zeros(len(reqs), dtype=bool)
        self.admissions, self.samples = [], []
        self.counts = dict(admitted=0, finished=0, preemptions=0, recomputed=0, prompt=0, output=0,
                           drafted_tokens=0, rejected_tokens=0, rollbacks=0, draft_blocks=0,
                           rollback_blocks=0, chunked_prompts=0, prompt_chunks=0, swapped_out=0,
                           swapped_in=0, prompt_blocks=0)
        self.k, self.acceptance, self.rng = 0, 0.0, None
        self.budget = self.left = None  # token_budget, and what this step has left of it
        self.victim, self.swap = "newest", None  # swap: the tier preemption moves blocks to
        self.held: dict = {}  # request -> (its sequence, its _Running, whether the tier holds it)
        self.backend_seconds = 0.0
        self.next_seq = self.hit_blocks = 0
        self.offload: list = []  # the tiers a free stores to, nearest first
        self.transfers = 0  # transfer ids handed out

    def timed(self, fn, *args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            self.backend_seconds += time.perf_counter() - t0

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def free(self, seq: int) -> None:
        for tier in self.offload:  # its full hashed blocks to every tier, each store done at once
            tid = self.transfer()
            self.timed(self.be.store, tid, seq, tier, step=len(self.ops))
            self.ops.append(Store(len(self.ops), tid, seq, tier))
            self.done(tid)
        self.timed(self.be.free, seq, step=len(self.ops))
        self.ops.append(Free(len(self.ops), seq))

    def transfer(self) -> int:
        self.transfers += 1
        return self.transfers - 1

    def done(self, tid: int) -> None:
        self.timed(self.be.complete, tid, True, step=len(self.ops))
        self.ops.append(Done(len(self.ops), tid, True))

    def decode(self) -> tuple[int, int, int]:
        """Steps 1-2: one token for every running sequence as one batched append, preempting the
        latest admitted until it fits; free the finished. Returns (decoded, preempted, finished)."""
        running = self.running
        preempted = finished = decoded = 0
        batch = self.decoding()
        while batch:
            # 1 token each, then as many drafts as the output has left (at most k)
            drafts = [min(self.k, running[s].final - running[s].tokens - 1) for s in batch]
            toks = [1 + d for d in drafts]
            kv = None
            if self.store:
                writers = np.repeat(batch, toks)
                starts = np.repeat([running[s].tokens for s in batch], toks)
                offsets = np.arange(len(writers)) - np.repeat(np.cumsum(toks) - toks, toks)
                kv = kv_tokens(writers, starts + offsets, self.model, self.dtype)
            try:
                self.timed(self.be.append, batch, toks, kv, step=len(self.ops))
            except OutOfMemory:
                preempted += self.preempt_victim()
                batch = self.decoding()
                continue
            if self.left is not None:
                self.left -= sum(toks)
            self.ops.append(Append(len(self.ops), tuple(batch), tuple(toks),
                                   tuple(drafts) if any(drafts) else None))
            kept = self.accept(batch, drafts)
            decoded = len(batch)
            self.counts["output"] += decoded + sum(kept)
            for s, n in zip(batch, kept):
                st = running[s]
                st.tokens += 1 + n
                st.generated += 1 + n
                if st.tokens == st.final:
                    del running[s]
                    self.free(s)
                    finished += 1
            break
        self.counts["preemptions"] += preempted
        return decoded, preempted, finished

    def decoding(self) -> list:
        """The running sequences whose prompt is complete, in admission order."""
        return [s for s, st in self.running.items() if not st.prompt_left]

    def preempt_victim(self) -> int:
        """Preempt the running sequence the victim order names (recompute): 1, or 0 when it was
        the last one running and can never grow (rejected)."""
        running = self.running
        victim = next(reversed(running)) if self.victim == "newest" else \
            min(reversed(running), key=lambda s: (running[s].generated, -int(self.prompt[running[s].request])))
        st = self.running.pop(victim)
        if not self.running:
            self.free(victim)
            self.reject("cannot grow even alone in the cache")
            return 0
        if self.swap is not None and not st.prompt_left:
            stored = self.be.tier_ledgers()[0]["stored"]
            self.timed(self.be.swap_out, victim, self.swap, step=len(self.ops))
            self.ops.append(Preempt(len(self.ops), victim, "swap"))
            in_tier = self.be.tier_ledgers()[0]["stored"] > stored  # else freed: a recompute
            self.held[st.request] = (victim, st, in_tier)
            self.counts["swapped_out"] += in_tier
        else:
            self.free(victim)
            self.generated[st.request] = st.generated
        self.queue.appendleft(st.request)
        return 1

    def resume(self, i: int, t: int) -> bool:
        """The resume of request ``i``, swapped out (or freed by a swap the tier could not hold):
        False when it does not fit."""
        seq, st, in_tier = self.held[i]
        kv = kv_values(seq, 0, st.tokens, self.model, self.dtype) if self.store else None
        call = self.be.swap_in if in_tier else self.be.prefill
        try:
            self.timed(call, seq, Prompt(st.tokens, self.reqs[i].tenant, st.final, self.hashes[i]),
                       kv, step=len(self.ops))
        except OutOfMemory:
            return False
        del self.held[i]
        self.ops.append(Resume(len(self.ops), seq))
        self.admissions.append((t, i, seq))
        self.running[seq] = st
        self.counts["swapped_in"] += in_tier
        if not in_tier:
            self.counts["prompt"] += st.tokens
            self.counts["recomputed"] += st.tokens
        if self.left is not None and not in_tier:
            self.left -= st.tokens
        return True

    def chunks(self) -> tuple[int, int]:
        """The next chunk of every prompt written in chunks, within the budget left, as one
        batched append (out of memory: a victim preempted, the rest retried).
        Returns (preempted, finished: prompts complete with no output to generate)."""
        preempted = finished = 0
        while self.left is not None:
            plan, left = [], self.left
            for s, st in self.running.items():
                take = min(left, st.prompt_left)
                if take > 0:
                    plan.append((s, take))
                    left -= take
            if not plan:
                break
            seqs, toks = [s for s, _ in plan], [t for _, t in plan]
            kv = None
            if self.store:
                kv = np.concatenate([kv_values(s, self.running[s].tokens, t, self.model, self.dtype)
                                     for s, t in plan])
            try:
                self.timed(self.be.append, seqs, toks, kv, step=len(self.ops))
            except OutOfMemory:
                preempted += self.preempt_victim()
                continue
            self.ops.append(Append(len(self.ops), tuple(seqs), tuple(toks)))
            self.left = left
            for s, t in plan:
                st = self.running[s]
                st.tokens += t
                st.prompt_left -= t
                self.counts["prompt"] += t
                self.counts["recomputed"] += t if st.recomputing else 0
                self.counts["prompt_chunks"] += 1
                if st.tokens == st.final:
                    del self.running[s]
                    self.free(s)
                    finished += 1
            break
        self.counts["preemptions"] += preempted
        return preempted, finished

    def accept(self, batch, drafts) -> list:
        """Each sequence's accept of its drafts (none without): how many it kept."""
        kept, B, c = [], self.be.config.block_size, self.counts
        for s, d in zip(batch, drafts):
            n = int(self.rng.binomial(d, self.acceptance)) if d else 0
            kept.append(n)
            if not d:
                continue
            self.timed(self.be.accept, s, n, drafted=d, step=len(self.ops))
            self.ops.append(Accept(len(self.ops), s, n))
            base = self.running[s].tokens + 1  # its length with the token before the drafts
            c["drafted_tokens"] += d
            c["rejected_tokens"] += d - n
            c["rollbacks"] += n < d
            c["draft_blocks"] += blocks_needed(base + d, B) - blocks_needed(base, B)
            c["rollback_blocks"] += blocks_needed(base + d, B) - blocks_needed(base + n, B)
        return kept

    def admit(self, admitting: bool, t: int) -> tuple[int, int, bool]:
        """Step 3: FCFS admission while memory and the batch allow. Returns (prefilled, finished
        at once, blocked: the head of the queue waits for memory)."""
        prefilled = finished = 0
        queue = self.queue
        while queue and len(self.running) < self.max_batch and (self.left is None or self.left > 0):
            i = queue[0]
            if not admitting and not self.started[i]:
                break
            if i in self.held:
                if not self.resume(i, t):
                    return prefilled, finished, True
                queue.popleft()
                prefilled += 1
                continue
            whole = int(self.prompt[i] + self.generated[i])
            final = int(self.prompt[i] + self.output[i])
            tokens = whole if self.left is None else min(whole, self.left)  # its first chunk
            seq = self.next_seq
            kv = kv_values(seq, 0, tokens, self.model, self.dtype) if self.store else None
            chunked = whole if tokens < whole else None  # the whole prompt's length
            tid = self.transfer() if self.offload else None
            prompt = Prompt(tokens, self.reqs[i].tenant, final, self.hashes[i],
                            prompt_tokens=chunked if tid is None else None)  # a load is whole
            try:
                if tid is None:
                    self.timed(self.be.prefill, seq, prompt, kv, step=len(self.ops))
                else:  # after the device's hit, what the tiers hold
                    self.timed(self.be.load, tid, seq, prompt, kv, step=len(self.ops))
            except OutOfMemory:
                if self.running:
                    return prefilled, finished, True
                queue.popleft()
                self.reject("does not fit in an empty cache")
                continue
            queue.popleft()
            self.next_seq += 1
            if tid is None:
                self.ops.append(Prefill(len(self.ops), seq, self.reqs[i].tenant, tokens, self.hashes[i],
                                        prompt_tokens=chunked))
            else:
                self.ops.append(Load(len(self.ops), seq, self.reqs[i].tenant, tokens, self.hashes[i],
                                     id=tid))
                self.done(tid)
            if self.left is not None:
                self.left -= tokens
            self.counts["chunked_prompts"] += chunked is not None
            self.counts["prompt_blocks"] += len(self.hashes[i] or ())
            self.admissions.append((t, i, seq))
            prefilled += 1
            self.counts["prompt"] += tokens
            again = bool(self.started[i])  # a preempted request's recompute
            if again:
                self.counts["recomputed"] += tokens
            else:
                self.started[i] = True
                self.counts["admitted"] += 1
            if tokens == final:  # no output token to generate
                self.free(seq)
                finished += 1
            else:
                self.running[seq] = _Running(i, tokens, final, int(self.generated[i]),
                                             whole - tokens, again)
        return prefilled, finished, False

    def sample(self, t: int, **counts) -> None:
        """The step's figures and the backend's ledger after it."""
        self.counts["finished"] += counts["finished"]
        ledger = self.be.ledger()
        self.hit_blocks = getattr(ledger, "prefix_hit_blocks", 0)
        self.samples.append({"step": t, "running": len(self.running), "waiting": len(self.queue),
                             **counts, **{c: getattr(ledger, c) for c in MEMORY_CATEGORIES}})


__all__ = ["simulate", "SimResult", "DEFAULT_MAX_BATCH", "STEP_SECONDS", "VICTIM_ORDERS",
           "PREEMPTION_MODES"]
