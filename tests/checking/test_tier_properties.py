"""Random histories of tier operations (SPEC §11): stores, loads, completions that succeed or
fail, aborts, frees and appends over a small pool and small tiers, shrunk by hypothesis. The NumPy
pool with its host and disk tiers must pass every one, copying at begin or at completion."""
from __future__ import annotations

import pytest
from conftest import make_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.checking.checker import check
from kvbench.contract.registry import create
from kvbench.traces.tier_ops import TierSpec
from kvbench.traces.format import Append, Free, Header, Prefill, Trace, validate
from kvbench.traces.tier_ops import Abort, Done, Load, Store

B = 4
PROMPTS = [(1, 2, 3, 4), (1, 2, 5), (6, 7)]  # block hashes: two prompts share a prefix


@st.composite
def histories(draw, pool: int = 6):
    """Turns of: a prefill (stored, completed now or later, and freed, or kept), a flush of
    unhashed blocks (the device forgets its cached prefixes), a load (completed now or later,
    failed, or aborted), a completion of something in flight, an append or a free."""
    ops, live, loading, flight = [], [], {}, []
    ids = iter(range(10 ** 6))

    def add(op):
        ops.append(op)

    def prompt():
        hashes = PROMPTS[draw(st.integers(0, len(PROMPTS) - 1))]
        n = draw(st.integers(1, len(hashes)))
        return n * B + draw(st.integers(0, B - 1)), hashes[:n], draw(st.sampled_from([None, None, "x"]))

    seq = 0
    often = st.sampled_from([True, True, True, False])
    for _ in range(draw(st.integers(1, 24))):
        kind = draw(st.sampled_from(["prefill", "prefill", "prefill", "load", "load", "load", "flush",
                                     "done", "append", "free"]))
        if len(live) > 2:  # a small pool: make room
            kind = "free"
        idle = [q for q in live if q not in loading]
        if kind == "prefill":
            tokens, hashes, salt = prompt()
            add(Prefill(len(ops), seq, "t", tokens, hashes, salt))
            if draw(often):
                tid = next(ids)
                blocks = draw(st.one_of(st.none(), st.lists(st.integers(0, 4), min_size=1, max_size=3,
                                                             unique=True).map(tuple)))
                add(Store(len(ops), tid, seq, draw(st.sampled_from(["host", "disk"])), blocks))
                if draw(often):
                    add(Done(len(ops), tid, draw(often)))
                else:
                    flight.append(tid)
            if draw(often):
                add(Free(len(ops), seq))
            else:
                live.append(seq)
            seq += 1
        elif kind == "flush":  # one block at a time, each that fits: every free block, cached ones last
            for q in range(seq, seq + pool):
                add(Prefill(len(ops), q, "t", B))
            for q in range(seq, seq + pool):
                add(Free(len(ops), q))
            seq += pool
        elif kind == "load":
            tokens, hashes, salt = prompt()
            tid = next(ids)
            add(Load(len(ops), seq, "t", tokens, hashes, salt, id=tid))
            then = draw(st.sampled_from(["done", "fail", "abort", "later"]))
            if then in ("done", "fail"):
                add(Done(len(ops), tid, then == "done"))
                live.append(seq)
            elif then == "abort":
                add(Abort(len(ops), seq))
            else:
                loading[seq] = tid
                flight.append(tid)
                live.append(seq)
            seq += 1
        elif kind == "done" and flight:
            tid = draw(st.sampled_from(flight))
            flight.remove(tid)
            add(Done(len(ops), tid, draw(st.booleans())))
            for q, lt in list(loading.items()):
                if lt == tid:
                    del loading[q]
        elif kind == "append" and idle:
            add(Append(len(ops), (draw(st.sampled_from(idle)),), (draw(st.integers(1, 6)),)))
        elif kind == "free" and live:
            q = draw(st.sampled_from(live))
            live.remove(q)
            if q in loading:  # a load in flight ends by abort
                flight.remove(loading.pop(q))
                add(Abort(len(ops), q))
            else:
                add(Free(len(ops), q))
    return ops


@pytest.mark.parametrize("pool", ["numpy", "torch"])
@pytest.mark.parametrize("when", ["begin", "completion"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.integers(4, 6).flatmap(lambda n: st.tuples(st.just(n), histories(n))),
       host=st.integers(0, 3))
def test_pool_tiers_pass_random_histories(pool, when, case, host):
    blocks, ops = case
    tiers = (TierSpec("host", host), TierSpec("disk", 4))
    trace = validate(Trace(Header("random", tiers=tiers), ops, name="random"))
    backend = create(pool, make_config(block_size=B, num_blocks=blocks, prefix_caching=True))
    backend.TRANSFER_AT = when
    try:
        v = check(trace, backend, gather="all")
    finally:
        backend.close()
    assert v.valid is True, (v.divergence, v.error)
