"""`kvbench route`: one trace served by N replicas behind a router that sees only their events and
their load (SPEC §14), every decision checked by the reference index.

The serving model: requests in arrival order; a request is live on its replica from its arrival to
its finish (a kvbench trace: from its prefill's step to its free's; a public trace: arrival +
prompt / ``prefill_tps`` + output * ``tpot`` seconds), holding its prompt and output blocks; a
replica that cannot fit a request finishes its first-finishing live request early (the request
waits for it). Before each decision every replica's events since the last are drained into the
reference index, the router's index and, where asked, Dynamo's RadixTree.

Per request, in prompt tokens: **available**, the longest cached prefix on any replica (reference
index, engine keys); **captured**, on the chosen replica; **delivered**, what the chosen replica's
engine took from its cache. available >= captured >= delivered; the routing's share of the gap is
available - captured, the engine's captured - delivered.

Findings (each a check that failed, counted by kind, the first one of each kind shown):
``decision`` the choice is not one of least cost under the policy over the reference overlaps;
``index`` the router's index, asked with the engine's keys, disagrees with the reference;
``keys`` the router's keys differ from the engine's (SPEC §14 key parity) while its index agrees;
``dynamo`` Dynamo's RadixTree disagrees with the reference.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from kvbench.contract.protocol import Capabilities, CacheConfig
from kvbench.routing import policies as P
from kvbench.routing.index import INDEXES, ROUTER_KEYS, ReferenceIndex, engine_keys
from kvbench.routing.replica import Replica
from kvbench.traces.format import Trace
from kvbench.traces.loaders import split_block_hashes
from kvbench.traces.ops import Append, Free, Prefill

# Planted faults: which part of the router each replaces (kvbench route --plant).
PLANTED = {"drop-salt": ("keys", "drop-salt"), "own-block-size": ("keys", "own-block-size"),
           "misses-cleared": ("index", "misses-cleared"),
           "sparse-as-prefix": ("index", "sparse-as-prefix")}


@dataclass(frozen=True)
class Job:
    """One request of a routed run."""

    index: int
    arrival: float
    finish: float
    tokens: int  # prompt
    output: int
    hashes: tuple | None
    tenant: str = "default"
    salt: str | None = None
    adapter: str | None = None
    where: str = ""  # where the request stands in its file, for errors


def _chained_hashes(token_ids, block_size: int) -> tuple:
    """Block hashes of a prompt given by token ids: each names its block with its whole prefix
    (hashes of ints and tuples of ints are stable across processes)."""
    out, h = [], 0
    for i in range(len(token_ids) // block_size):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return tuple(out)


def jobs_of_trace(trace: Trace, block_size: int) -> tuple[list, dict]:
    """A kvbench trace's prefills as requests: live from the prefill's step to the free's (the
    trace's end where none), output = the tokens appended to it. Other operations route nothing
    (a fork's child stays with its source): they are left out, counted by kind."""
    where = trace.path or trace.name
    starts, output, ends, left_out = {}, {}, {}, {}
    for i, op in enumerate(trace):
        if isinstance(op, Prefill):
            if op.prompt_tokens is not None:
                raise ValueError(f"{where}: step {op.step}: kvbench route serves whole prompts, "
                                 f"not chunked prefills")
            starts[op.seq] = (i, op)
            output[op.seq] = 0
        elif isinstance(op, Append):
            for s, t in zip(op.seqs, op.tokens):
                if s in output:
                    output[s] += t
        elif isinstance(op, Free) and op.seq in starts:
            ends[op.seq] = op.step
        else:
            left_out[op.kind] = left_out.get(op.kind, 0) + 1
    end = max((op.step for op in trace), default=0) + 1
    jobs = []
    for n, (seq, (i, op)) in enumerate(sorted(starts.items(), key=lambda kv: kv[1][0])):
        hashes = op.block_hashes
        if hashes is None and op.token_ids is not None:
            hashes = _chained_hashes(op.token_ids, block_size)
        jobs.append(Job(n, float(op.step), float(ends.get(seq, end)), op.tokens, output[seq],
                        hashes, op.tenant, op.salt, op.adapter, f"{where}: step {op.step}"))
    return jobs, left_out


def jobs_of_requests(requests, block_size: int, *, tpot: float = 0.05,
                     prefill_tps: float = 10000.0, where: str = "<trace>") -> list:
    """Public-trace requests: live for prompt / prefill_tps + output * tpot seconds."""
    jobs = []
    for n, r in enumerate(requests):
        hashes = None
        if r.block_hashes is not None and r.hash_block_size is not None:
            hashes = split_block_hashes(r.block_hashes, r.prompt_tokens, block_size, r.hash_block_size)
        finish = r.arrival + r.prompt_tokens / prefill_tps + r.output_tokens * tpot
        jobs.append(Job(n, r.arrival, finish, r.prompt_tokens, r.output_tokens, hashes, r.tenant,
                        where=f"{where}: request {n + 1}"))
    return jobs


@dataclass
class RouteResult:
    """A routed run: per request (arrays in request order) and its findings."""

    replicas: int
    policy: str
    block_size: int
    num_blocks: int
    replica: np.ndarray
    prompt: np.ndarray
    available: np.ndarray
    captured: np.ndarray
    delivered: np.ndarray
    waited: int = 0
    events: int = 0
    findings: dict = field(default_factory=dict)  # kind -> [count, first message]
    dynamo_checked: int = 0
    seconds: float = 0.0

    def totals(self) -> dict:
        a, c, d, p = (int(x.sum()) for x in (self.available, self.captured, self.delivered, self.prompt))
        return {"replicas": self.replicas, "policy": self.policy, "block_size": self.block_size,
                "num_blocks": self.num_blocks, "requests": len(self.prompt), "prompt_tokens": p,
                "available": a, "captured": c, "delivered": d,
                "routing_gap": a - c, "engine_gap": c - d,
                "available_frac": a / p if p else 0.0, "captured_frac": c / p if p else 0.0,
                "delivered_frac": d / p if p else 0.0, "waited": self.waited, "events": self.events,
                "dynamo_checked": self.dynamo_checked,
                "findings": {k: v[0] for k, v in self.findings.items()},
                "seconds": round(self.seconds, 3)}

    def rows(self) -> list:
        return [{"request": i, "replica": int(r), "prompt": int(p), "available": int(a),
                 "captured": int(c), "delivered": int(d)}
                for i, (r, p, a, c, d) in enumerate(zip(self.replica, self.prompt, self.available,
                                                        self.captured, self.delivered))]


def route(jobs, config: CacheConfig, replicas: int, policy: str = "longest-prefix", *,
          capabilities: Capabilities | None = None, plant: str | None = None,
          resets=(), overlap_weight: float = 1.0, dynamo: bool = False,
          on_events=None) -> RouteResult:
    """Serve ``jobs`` over ``replicas`` replicas of ``config`` behind a ``policy`` router.

    ``plant``: a planted fault of :data:`PLANTED`; ``resets``: (request index, replica) pairs,
    that replica's cache reset before that request is routed; ``dynamo``: Dynamo's RadixTree fed
    the same events, its matches checked at every request (kvbench.routing.dynamo);
    ``on_events(replica, events)``: called with each replica's events as they are drained."""
    if replicas < 1:
        raise ValueError(f"--replicas: must be at least 1, got {replicas}")
    if plant is not None and plant not in PLANTED:
        raise ValueError(f"--plant: unknown fault {plant!r}; known: {', '.join(PLANTED)}")
    part, which = PLANTED.get(plant, (None, None))
    router_keys = ROUTER_KEYS[which if part == "keys" else "engine"]
    B, groups = config.block_size, config.model.kv_groups
    reps = [Replica(config, capabilities) for _ in range(replicas)]
    reference = ReferenceIndex(replicas, groups, B)
    router_index = INDEXES[which if part == "index" else "reference"](replicas, groups, B)
    router_index.strict = False  # the router's own index holds no order rule
    router, checker = P.make(policy, replicas, overlap_weight=overlap_weight), \
        P.make(policy, replicas, overlap_weight=overlap_weight)
    tree = None
    if dynamo:
        from kvbench.routing.dynamo import DynamoIndex  # the opt-in environment's
        if len(groups) != 1:
            raise ValueError("--dynamo: Dynamo's RadixTree indexes one KV cache group; this model "
                             f"has {len(groups)}")
        tree = DynamoIndex()
    resets_at: dict = {}
    for at, r in resets:
        if not 0 <= r < replicas:
            raise ValueError(f"--reset {r}@{at}: replica {r} is not one of 0..{replicas - 1}")
        resets_at.setdefault(at, []).append(r)

    n = len(jobs)
    out = {k: np.zeros(n, dtype=np.int64) for k in ("replica", "prompt", "available", "captured",
                                                      "delivered")}
    result = RouteResult(replicas, policy, B, config.num_blocks, **out)
    started = time.perf_counter()
    finishing: list = []  # (finish, seq, replica)
    for step, job in enumerate(sorted(jobs, key=lambda j: (j.arrival, j.index))):
        while finishing and finishing[0][0] <= job.arrival:
            _, seq, r = heapq.heappop(finishing)
            if seq in reps[r].live:
                reps[r].finish(seq)
        for r in resets_at.get(job.index, ()):
            reps[r].reset()
        for r, rep in enumerate(reps):
            events = rep.events()
            result.events += len(events)
            if on_events is not None and events:
                on_events(r, events)
            reference.extend(r, events)
            router_index.extend(r, events)
            if tree is not None:
                tree.extend(r, events)
        keys = engine_keys(job.hashes, job.tokens, B, job.salt, job.adapter)
        theirs = router_keys(job.hashes, job.tokens, B, job.salt, job.adapter)
        loads = [rep.load() for rep in reps]
        blocks = -(-job.tokens // B)
        truth = reference.overlaps(keys)
        seen = router_index.overlaps(theirs)
        choice = P.best(router.costs(seen, loads, blocks))[0]
        router.chosen(choice)
        if choice not in P.best(checker.costs(truth, loads, blocks)):
            _note(result, "decision", f"{job.where}: the router chose replica {choice} "
                  f"(overlaps it saw {seen}); under {policy} over the reference's {truth} and "
                  f"loads {[(l.requests, l.blocks) for l in loads]} it is not one of least cost")
        checker.chosen(choice)
        if seen != truth:
            own = router_index.overlaps(keys) if theirs != keys else seen
            if own != truth:
                _note(result, "index", f"{job.where}: the router's index holds prefixes {own} "
                      f"(blocks, per replica) where the replicas' events give {truth}")
            else:
                _note(result, "keys", f"{job.where}: the router's keys differ from the engine's "
                      f"(key parity, SPEC §14): it matched {seen} blocks where its index, asked "
                      f"with the engine's keys, holds {truth}")
        if tree is not None:
            theirs_d = tree.overlaps(keys, replicas)
            result.dynamo_checked += 1
            if theirs_d != truth:
                _note(result, "dynamo", f"{job.where}: Dynamo's RadixTree matches {theirs_d} "
                      f"where the reference holds {truth}")
        delivered, waited = reps[choice].serve(job.index, job, keys, step)
        result.waited += waited
        heapq.heappush(finishing, (job.finish, job.index, choice))
        i = job.index
        result.replica[i], result.prompt[i] = choice, job.tokens
        result.available[i], result.captured[i] = max(truth) * B, truth[choice] * B
        result.delivered[i] = delivered
    result.seconds = time.perf_counter() - started
    return result


def _note(result: RouteResult, kind: str, message: str) -> None:
    entry = result.findings.setdefault(kind, [0, message])
    entry[0] += 1


# --- a routed cell of `kvbench sweep` (kvbench.bench.grid, kvbench.bench.sweep) ------------------

ROUTED = "route:"  # a grid's backend "route:POLICY": the trace routed over `replicas` replicas


def routed_policy(backend: str) -> str | None:
    """The policy of a routed cell's backend name (None: not a routed cell); an unknown policy
    is refused."""
    if not backend.startswith(ROUTED):
        return None
    policy = backend[len(ROUTED):]
    if policy not in P.POLICIES:
        raise ValueError(f"backend {backend!r}: unknown routing policy {policy!r}; known: "
                         f"{', '.join(P.POLICIES)}")
    return policy


def routed_row(trace, config, backend: str, replicas: int) -> dict:
    """A routed cell's record: the run's totals, status pass (no finding) or FAIL, the findings
    by kind as text."""
    jobs, _ = jobs_of_trace(trace, config.block_size)
    result = route(jobs, config, replicas, routed_policy(backend))
    row = result.totals()
    row["router"] = row.pop("policy")  # the grid's own `policy` is the eviction policy
    row["findings"] = ", ".join(f"{k} {n}" for k, n in row["findings"].items())
    row["status"] = "FAIL" if result.findings else "pass"
    return row
