"""Preemption told as itself (SPEC §13): a backend with its own preempt and resume gets them, and
its free of a preempted sequence; any other gets a free and a prefill of all the tokens. The
NumPy pool keeps the request across a preemption, so its resume hits its own cached blocks; one
that forgets the hashes fails at the resume, by recompute and by swap."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import make_config

from impls.faults_tiers import ResumeForgetsHashes
from impls.numpy_paged import NumpyPaged
from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.checking.driver import replay
from kvbench.contract.protocol import Backend, takes_lifecycle
from kvbench.traces.format import Append, Free, Header, Prefill, Trace, validate
from kvbench.traces.ops import Preempt, Resume
from kvbench.traces.tier_ops import TierSpec

# 40 tokens, 2 hashed blocks of 16 + 8; decoded to 45; preempted twice, resumed once, freed.
OPS = [Prefill(0, 0, "a", 40, ("h0", "h1")), Append(1, (0,), (5,)), Preempt(2, 0),
       Resume(3, 0), Append(4, (0,), (3,)), Preempt(5, 0), Free(6, 0)]


def recording(base):
    """``base`` noting the calls the driver makes (not those its methods make of each other)."""
    class Recording(base):
        def __init__(self, config):
            super().__init__(config)
            self.calls, self.depth = [], 0

        def noted(self, call, method, *args, **kw):
            if not self.depth:
                self.calls.append(call)
            self.depth += 1
            try:
                return method(*args, **kw)
            finally:
                self.depth -= 1

        def prefill(self, seq, prompt, kv=None, **kw):
            return self.noted(("prefill", seq, prompt.tokens, prompt.block_hashes),
                              super().prefill, seq, prompt, kv, **kw)

        def free(self, seq, **kw):
            return self.noted(("free", seq), super().free, seq, **kw)

        def preempt(self, seq, mode, **kw):
            return self.noted(("preempt", seq, mode), super().preempt, seq, mode, **kw)

        def resume(self, seq, kv=None, **kw):
            return self.noted(("resume", seq), super().resume, seq, kv, **kw)
    if base.preempt is Backend.preempt:  # noting them must not give it them
        Recording.preempt, Recording.resume = Backend.preempt, Backend.resume
    return Recording


class ToldAFree(NumpyPaged):
    """The NumPy pool without its own preempt and resume."""

    preempt, resume = Backend.preempt, Backend.resume


def told_calls(backend_cls, ops=OPS, tiers=()):
    trace = validate(Trace(Header("preempts", tiers=tiers), ops, name="preempts"))
    backend = recording(backend_cls)(make_config(num_blocks=8, prefix_caching=True))
    v = check(trace, backend, gather="all")
    assert v.valid is True, str(v.divergence)
    assert v.preemptions == 2
    return backend.calls


def test_a_backend_with_preempt_and_resume_is_told_the_preemption():
    assert takes_lifecycle(NumpyPaged(make_config()), "preempt")
    # its resume is told nothing but the K/V (the checker holds the ledger after it: 45 = 40 + 5
    # tokens, h0 and h1 hit); the free of the preempted sequence drops what it kept
    assert told_calls(NumpyPaged) == [
        ("prefill", 0, 40, ("h0", "h1")), ("preempt", 0, "recompute"), ("resume", 0),
        ("preempt", 0, "recompute"), ("free", 0)]


def test_a_backend_without_them_is_told_a_free_and_a_prefill_of_all_its_tokens():
    assert not takes_lifecycle(ToldAFree(make_config()), "preempt")
    # the preempt is a free; the resume a prefill of 45 = 40 + 5 tokens with the prompt's hashes
    # given again; the free of a preempted sequence calls nothing (it holds nothing)
    assert told_calls(ToldAFree) == [
        ("prefill", 0, 40, ("h0", "h1")), ("free", 0), ("prefill", 0, 45, ("h0", "h1")),
        ("free", 0)]


def test_the_replay_without_oracle_follows_the_same_rules():
    trace = validate(Trace(Header("preempts"), OPS, name="preempts"))
    told, freed = (recording(c)(make_config(num_blocks=8, prefix_caching=True))
                   for c in (NumpyPaged, ToldAFree))
    for backend in (told, freed):
        counts = replay(backend, trace, np.zeros((48,) + backend.kv_shape, dtype=backend.pool.dtype))
        assert counts["recomputed_tokens"] == 45  # the one resume: 40 + 5 tokens
    assert [c[0] for c in told.calls] == ["prefill", "preempt", "resume", "preempt", "free"]
    assert [c[0] for c in freed.calls] == ["prefill", "free", "prefill", "free"]


def test_a_swap_is_told_as_a_preempt_by_swap_and_resumed_from_the_tier():
    ops = [Prefill(0, 0, "a", 40, ("h0", "h1")), Append(1, (0,), (5,)), Preempt(2, 0, "swap"),
           Resume(3, 0), Append(4, (0,), (3,)), Preempt(5, 0, "swap"), Free(6, 0)]
    calls = told_calls(NumpyPaged, ops, tiers=(TierSpec("host", 4),))
    assert calls == [("prefill", 0, 40, ("h0", "h1")), ("preempt", 0, "swap"), ("resume", 0),
                     ("preempt", 0, "swap"), ("free", 0)]


@pytest.mark.parametrize("backend_cls", [NumpyPaged, ToldAFree])
def test_both_pass_the_preempting_workloads(backend_cls):
    for name in ("lifecycle-preempt", "lifecycle-swap"):
        trace = suite.load_traces([suite.WORKLOADS_DIR / f"{name}.jsonl"])[0]
        backend = backend_cls(suite.config_for(trace))
        try:
            v = check(trace, backend, gather="all")
        finally:
            backend.close()
        assert v.valid is True, str(v.divergence)


def test_a_resume_that_forgot_the_hashes_fails_at_the_resume():
    trace = suite.load_traces([suite.WORKLOADS_DIR / "lifecycle-preempt.jsonl"])[0]
    v = check(trace, ResumeForgetsHashes(suite.config_for(trace)))
    assert v.valid is False
    d = v.divergence
    # Blocks of 16, 16 of them. Step 8 preempts sequence 2 (41 + 3 * 6 = 59 tokens: 4 blocks, 2
    # hashed): 2 cached, 2 free. Step 11 frees sequence 1 (56 + 5 * 6 + 1 = 87 tokens: 6
    # blocks, 3 hashed): 3 cached, 3 free. Sequence 0 holds ceil((80 + 7 * 6) / 16) = 8 blocks,
    # so 16 - 8 - (2 + 3) = 3 are free uncached. The resume at step 12 hits its 2 cached blocks
    # and takes 2 free ones: 5 - 2 = 3 cached. Without its hashes it needs 4 new blocks: the
    # 3 free and 1 cached evicted: 5 - 1 = 4.
    assert (d.step, d.quantity, d.expected, d.actual) == (12, "cached_blocks", 5 - 2, 5 - 1)
    assert d.op["op"] == "resume"
