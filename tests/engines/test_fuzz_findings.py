"""What `kvbench fuzz` found (tests/engines/findings/), each minimal trace as a test: these
pass on the fixed backends."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import require_sglang, without_block_state

from impls.numpy_paged import NumpyPaged
from kvbench.checking.checker import check
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Append, Fork, Free, Header, Prefill, Trace, load, validate
from kvbench.traces.ops import Preempt, Resume


def _chunk_past_the_window():
    """One-token blocks, sliding(3) beside full: a chunked prompt of 4 tokens written 1 + 3.
    The append completes the block of position 1 and the window slides past it in the same
    operation (4 - 3 + 1 = 2: positions 0 and 1 released)."""
    groups = ("sliding(3)", "full")
    config = CacheConfig(model=with_group_kinds(get_model("tiny-hybrid"), groups), block_size=1,
                         num_blocks=16, prefix_caching=True, max_context=8)
    hashes = ("h0", "h1", "h2", "h3")
    ops = [Prefill(0, 0, "a", 1, hashes, prompt_tokens=4), Append(1, (0,), (3,))]
    trace = validate(Trace(Header("fuzz-finding", groups=groups), ops, name="chunk_past_the_window"))
    return trace, config


@pytest.mark.parametrize("pool", ["numpy", "torch"])
def test_a_chunk_block_the_window_passes_in_the_same_append_stays_cached(pool):
    # Found by `kvbench fuzz --backend numpy` (seed 0, history 4): the pool cached a chunk's
    # completed blocks after the window released them, so the block of position 1 went back
    # uncached (cached_blocks 1, the oracle 2).
    trace, config = _chunk_past_the_window()
    if pool == "torch":
        pytest.importorskip("torch")
        from impls.torch_paged import TorchPaged as Pool
    else:
        Pool = NumpyPaged
    backend = Pool(config)
    v = check(trace, backend)
    assert v.valid, v.divergence
    # 2 = the sliding group's blocks of positions 0 and 1, both complete, both released
    assert backend.ledger().cached_blocks == 2


def test_an_abort_of_a_preempted_sequence_is_its_free():
    # Found by `kvbench fuzz --backend numpy` (campaign 01): the tier replay called the
    # backend's abort of a sequence its preemption had already freed (KeyError).
    from kvbench.traces.ops import Abort, Preempt
    from kvbench.traces.tier_ops import TierSpec
    ops = [Prefill(0, 0, "a", 1), Preempt(1, 0), Abort(2, 0)]
    trace = validate(Trace(Header("fuzz-finding", tiers=(TierSpec("host", 16),)), ops, name="abort"))
    config = CacheConfig(model=get_model("tiny"), block_size=1, num_blocks=1, prefix_caching=True,
                         max_context=2)
    v = check(trace, NumpyPaged(config))
    assert v.valid, v.divergence


def test_a_rollback_under_a_chunked_group_is_not_applicable():
    # Found by `kvbench fuzz --backend numpy` (campaign 02): accept under chunked(1) rolled
    # back into blocks the group had released (seq_blocks -2); the checker said n/a for
    # sliding windows only.
    from kvbench.traces.ops import Accept
    groups = ("chunked(1)",)
    config = CacheConfig(model=with_group_kinds(get_model("tiny-hybrid"), groups), block_size=1,
                         num_blocks=4, prefix_caching=True, max_context=16)
    ops = [Prefill(0, 0, "a", 1), Append(1, (0,), (4,), (4,)), Accept(2, 0, 0)]
    v = check(validate(Trace(Header("fuzz-finding", groups=groups), ops, name="rollback")),
              NumpyPaged(config))
    assert v.valid is None and "chunked(1)" in v.not_applicable


@pytest.mark.parametrize("groups", [("sliding(1)", "full"), ("state(127)", "full")])
def test_a_chunk_completing_a_block_whose_cached_copy_its_append_evicts_is_cached(groups):
    # Found by `kvbench fuzz --backend numpy --model-shapes` (seed 0, histories 348 and 361, on
    # state models): the oracle registered a chunk's completed block while the append still
    # took blocks, so a cached copy those allocations then evicted left the key uncached.
    # B = 2, 4 blocks, LRU. Seq 0 writes 1 token of a 20-token prompt (block 0 of each group);
    # seq 1 prefills p1.0's 2 tokens. Seq 0's append of 2 completes its block 0 (p1.0) and
    # needs block 1 of both groups: 2 new blocks, 1 free, so LRU evicts seq 1 and the append
    # takes the blocks that cached p1.0. Seq 0's block 0 is then p1.0's entry in each group.
    config = CacheConfig(model=with_group_kinds(get_model("tiny-hybrid"), groups), block_size=2,
                         num_blocks=4, prefix_caching=True, max_context=64, policy="lru",
                         tenant_weights={"a": 1})
    hashes = ("p1.0", "p1.1", "p1.2", "p1.3", "p1.4", "p1.5", "p1.6", "p1.7", "r2.8", "r2.9")
    ops = [Prefill(0, 0, "a", 1, hashes, prompt_tokens=20), Prefill(1, 1, "a", 2, ("p1.0",)),
           Append(2, (0,), (2,))]
    trace = validate(Trace(Header("fuzz-finding", groups=groups, tenants={"a": 1}), ops,
                           name="chunk_copy_evicted"))
    backend = NumpyPaged(config)
    v = check(trace, backend)
    assert v.valid, v.divergence
    # 1 = the first group's block 0 of seq 0, released at 3 tokens (sliding(1): below
    # 3 - 1 + 1 = 3; a state: below its last token's block (3 - 1) // 2 = 1), cached under p1.0
    assert backend.ledger().cached_blocks == 1


# --- engine findings: pinned where the engine's rule is not kvbench's (they skip without it) ---

# The traces each test replays, as `kvbench fuzz` and `kvbench shrink` wrote them.
FINDINGS = Path(__file__).resolve().parent / "findings"
CAMPAIGNS = FINDINGS / "campaigns"
SERVING_FUZZ = FINDINGS / "serving"


def _engine_check(name: str, trace, structures: bool = True, **rules):
    """``rules``: declared rules put back to SPEC's; ``structures=False``: its block structures
    not read (as before SGLang's block_state)."""
    from kvbench.analyses import suite
    from kvbench.contract import registry
    config = suite.config_for(trace, policy=suite.policies_for(trace, None)[0])
    backend = registry.create(name, dataclasses.replace(config, store_kv=False))
    backend.capabilities = dataclasses.replace(
        backend.capabilities, rule_params={**backend.capabilities.rule_params, **rules})
    if not structures:
        backend.__class__ = without_block_state(type(backend))
    try:
        return check(trace, backend)
    finally:
        getattr(backend, "close", lambda: None)()


def _with_window(trace, old: str, new: str):
    groups = tuple(new if g == old else g for g in trace.header.groups)
    return dataclasses.replace(trace, header=dataclasses.replace(trace.header, groups=groups))


@pytest.mark.parametrize("finding", ["earlier/vllm-kvmanager/01-cached-blocks-append",
                                     "earlier/vllm-kvmanager/02-blocks-used-fork",
                                     "earlier/vllm-kvmanager/03-cached-blocks-free",
                                     "earlier/vllm-kvmanager/04-blocks-used-prefill",
                                     "vllm-kvmanager/01-blocks-used-fork",
                                     "vllm-kvmanager/06-cached-blocks-preempt",
                                     "vllm-kvmanager/09-outcome-success-expected-out-of-memory-a-fork",
                                     "vllm-kvmanager-dense/04-cached-blocks-append",
                                     "vllm-kvmanager-dense/05-cached-blocks-free"])
def test_vllm_a_one_token_window_costs_every_prefix_hit(finding):
    """vLLM's bug candidate 1 (results/engines/vllm-kvmanager/README.md), found again nine ways
    by three campaigns: with a sliding(1) group vLLM caches none of its blocks and hits nothing, so
    it holds more blocks, caches fewer or refuses a fork SPEC admits; the same trace with
    sliding(2) passes. Held under dense retention, vllm-kvmanager-dense; the serving default's
    sparse retention: the next test."""
    pytest.importorskip("vllm", reason="vLLM is not installed (opt-in): see docs/engines.md for its recipe")
    trace = load(str(CAMPAIGNS / f"{finding}.min.jsonl"))
    assert "sliding(1)" in trace.header.groups
    d = _engine_check("vllm-kvmanager-dense", trace).divergence
    assert d is not None
    fewer_cached = d.quantity == "cached_blocks" and d.actual < d.expected
    more_used = d.quantity == "blocks_used" and d.actual > d.expected
    refused = (d.expected, d.actual) == ("success", "out-of-memory")
    assert fewer_cached or more_used or refused, d
    assert _engine_check("vllm-kvmanager-dense", _with_window(trace, "sliding(1)", "sliding(2)")).valid


@pytest.mark.parametrize("finding", ["01-cached-blocks-append", "02-blocks-used-fork",
                                     "03-cached-blocks-free", "04-blocks-used-prefill"])
def test_vllm_under_its_sparse_retention_a_one_token_window_still_costs_a_forks_hit(finding):
    """The same four at vLLM's serving default, held to its declared sparse retention (which
    caches no sliding(1) block either: a hit needs cdiv(1 - 1, B) = 0 of them). Three pass: 01
    and 03 only showed the uncached window blocks, which the rule now declares; in 04 the
    sliding(28) group keeps no block of an 8-token prompt (the run below (8 - 1) // 8 = 0 is
    empty), so neither hits. 02 still FAILs: a prompt of 2 one-token blocks, then a fork (a new
    request of the 2 tokens): the rule hits the full group's (2 - 1) // 1 = 1 block and sliding(1)
    needs none, so the parent's 2 * 2 blocks and 2 * (2 - 1) new ones, 6 in use; vLLM's hit search
    wants one cached block of the group at the hit's end, finds none, hits nothing: 4 + 2 * 2 = 8."""
    pytest.importorskip("vllm", reason="vLLM is not installed (opt-in): see docs/engines.md for its recipe")
    trace = load(str(CAMPAIGNS / "earlier" / "vllm-kvmanager" / f"{finding}.min.jsonl"))
    v = _engine_check("vllm-kvmanager", trace)
    if finding != "02-blocks-used-fork":
        assert v.valid, v.divergence
        return
    d = v.divergence
    assert (d.step, d.op["op"], d.quantity, d.expected, d.actual) == (1, "fork", "blocks_used", 6, 8)
    assert _engine_check("vllm-kvmanager", _with_window(trace, "sliding(1)", "sliding(2)")).valid


@pytest.mark.parametrize("finding", ["02-cached-blocks-free", "04-cached-blocks-append",
                                     "05-blocks-used-prefill"])
def test_vllm_serving_default_findings_of_sparse_retention_pass_under_the_declared_rule(finding):
    """Found at vLLM's serving default before the oracle modelled its sparse retention of sliding
    groups' blocks (retention 0; tests/engines/findings/): held to the declared rule, each
    passes, as it passes under dense retention (vllm-kvmanager-dense) held to SPEC's."""
    pytest.importorskip("vllm", reason="vLLM is not installed (opt-in): see docs/engines.md for its recipe")
    trace = load(str(CAMPAIGNS / "vllm-kvmanager" / f"{finding}.min.jsonl"))
    v = _engine_check("vllm-kvmanager", trace)
    assert v.valid, v.divergence
    assert _engine_check("vllm-kvmanager-dense", trace).valid


@pytest.mark.parametrize("finding", ["vllm-kvmanager/03-outcome-out-of-memory-expected-success-a-prefill",
                                     "vllm-kvmanager/07-blocks-used-resume",
                                     "vllm-kvmanager-dense/02-outcome-out-of-memory-expected-success-a-prefill",
                                     "vllm-kvmanager-dense/06-blocks-used-prefill",
                                     "vllm-kvmanager-dense/07-blocks-used-resume"])
def test_vllm_a_chunked_group_holds_only_its_current_chunk_at_a_prefill(finding):
    """A declared-rule gap, now modelled (``chunk_start_hit``): a prompt on one chunked(C) group
    computes only the chunk holding its last token in vLLM, whose hit search counts the blocks
    left of it as computed, unnamed as these prompts are (14 tokens under chunked(13) at B = 1:
    (14 - 1) // 13 * 13 = 13 blocks skipped, 14 - 13 = 1 block). Held to the declared rule each
    passes at both retentions; held to the oracle's own (a hit only over blocks the trace names:
    none) it fails at its prefill, where every prompt block is taken."""
    pytest.importorskip("vllm", reason="vLLM is not installed (opt-in): see docs/engines.md for its recipe")
    trace = load(str(CAMPAIGNS / f"{finding}.min.jsonl"))
    assert len(trace.header.groups) == 1 and trace.header.groups[0].startswith("chunked")
    for name in ("vllm-kvmanager", "vllm-kvmanager-dense"):
        v = _engine_check(name, trace)
        assert v.valid is True and v.ops == len(trace.ops), str(v.divergence)
        d = _engine_check(name, trace, chunk_start_hit=False).divergence
        assert d is not None and d.index == 0, d
        fewer = d.quantity == "blocks_used" and d.actual < d.expected
        assert fewer or (d.expected, d.actual) == ("out-of-memory", "success"), d


@pytest.mark.parametrize("finding", ["vllm-kvmanager-dense/08-outcome-out-of-memory-expected-success-a-fork",
                                     "vllm-kvmanager-dense/09-shared-blocks-fork",
                                     "vllm-kvmanager/08-outcome-out-of-memory-expected-success-a-fork"])
def test_vllm_findings_of_a_resumed_sequence_pass_now(finding):
    """Found as "a resume finds its own unhashed blocks" (tests/engines/findings/); they were
    two kvbench bugs, both fixed: the oracle gave a resume's blocks the keys of the sequence's
    blocks before its preemption (test_a_resumed_sequence_caches_its_blocks_anew), and the
    adapter made a resume a request of the prompt's token ids alone, fewer than its tokens. 08:
    prefill 3 tokens at B = 1 into 4 blocks, preempt, resume, fork; 09: a fork of the resumed
    sequence. Each passes to its last operation at both retentions."""
    pytest.importorskip("vllm", reason="vLLM is not installed (opt-in): see docs/engines.md for its recipe")
    trace = load(str(CAMPAIGNS / f"{finding}.min.jsonl"))
    assert {"preempt", "resume"} <= {op.kind for op in trace.ops}
    for name in ("vllm-kvmanager", "vllm-kvmanager-dense"):
        v = _engine_check(name, trace)
        assert v.valid is True and v.ops == len(trace.ops), str(v.divergence)


def test_vllm_a_resume_is_a_request_of_all_its_tokens():
    """The serving default's campaign (tests/engines/findings/serving/seed1/05): a
    1-token prompt named by its token id, 1 token appended, preempted, resumed, forked. The
    resume recomputes 2 tokens, so the fork is a request of 2 (the adapter once gave the resume
    the prompt's 1 id alone, and the fork came out 1 token long)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (opt-in): see docs/engines.md for its recipe")
    trace = load(str(SERVING_FUZZ / "seed1" / "05-tokens-fork.min.jsonl"))
    v = _engine_check("vllm-kvmanager", trace)
    assert v.valid is True and v.ops == len(trace.ops), str(v.divergence)  # tokens checked each op


# The serving default's sliding(1) findings: (finding, step, quantity, SPEC's value, vLLM's).
ONE_TOKEN_WINDOW_AT_SERVING = [
    # sliding(1) alone, B = 32: the hit is (33 - 1) // 32 = 1 block, and sliding(1) needs no
    # cached block below it, so 1 block computed; vLLM hits nothing: ceil(33 / 32) = 2
    ("seed0/03-blocks-used-prefill", 0, "blocks_used", 1, 2),
    # (sliding(1), full), B = 1, 6 blocks: the prompt's 2 * 2 = 4, then the fork hits the full
    # group's (2 - 1) // 1 = 1 block: 2 * (2 - 1) = 2 new fit; vLLM's 2 * 2 = 4 do not
    ("seed0/05-outcome-success-expected-out-of-memory-a-fork", 1, "outcome of fork", "success",
     "out-of-memory"),
    # four groups, B = 8, 12 blocks: 4 * ceil(9 / 8) = 8, the second prompt hits (9 - 1) // 8 = 1
    # block (sliding(16)'s block 0 cached, sliding(1) needing none): 4 * 1 new fit; 4 * 2 do not
    ("seed0/06-outcome-success-expected-out-of-memory-a-prefill", 1, "outcome of prefill",
     "success", "out-of-memory"),
    # (sliding(1), sliding(9)), B = 8: 2 * 2 = 4, the fork hits 1 block: 4 + 2 * 1 = 6; vLLM 4 + 4
    ("seed1/01-blocks-used-fork", 1, "blocks_used", 6, 8),
    # (full, sliding(1), full, full), B = 1, 12 blocks: 4 * 2 = 8, the fork 4 * (2 - 1) = 4 fit
    ("seed1/02-outcome-success-expected-out-of-memory-a-fork", 1, "outcome of fork", "success",
     "out-of-memory"),
    # sliding(1) alone, B = 2: (3 - 1) // 2 = 1 block hit, 1 computed; vLLM ceil(3 / 2) = 2
    ("seed1/03-blocks-used-prefill", 0, "blocks_used", 1, 2),
    # sliding(1) alone, B = 3, 1 block: (4 - 1) // 3 = 1 hit, 1 block fits; ceil(4 / 3) = 2 do not
    ("seed1/04-outcome-success-expected-out-of-memory-a-prefill", 0, "outcome of prefill",
     "success", "out-of-memory"),
]


@pytest.mark.parametrize("finding, step, quantity, expected, actual", ONE_TOKEN_WINDOW_AT_SERVING)
def test_vllm_at_its_serving_default_a_one_token_window_finds_no_hit(finding, step, quantity,
                                                                       expected, actual):
    """vLLM's bug candidate 1 at the serving default (results/engines/vllm-kvmanager/README.md):
    SPEC §8's hit needs every sliding group's blocks covering [max(0, L - W + 1), L) cached,
    none for W = 1, so the other groups' hit stands, and on a model of sliding(1) groups alone
    every block below the prompt's last token is a hit with nothing cached (as vLLM's own
    ChunkedLocalAttentionManager counts blocks outside its attention). vLLM's
    SlidingWindowManager.find_longest_cache_hit accepts a hit only at a cached block, and caches
    none of the group's: it computes the whole prompt. Each fails at the engine's step, at
    both retentions, and passes with sliding(2), whose hit needs a cached block."""
    pytest.importorskip("vllm", reason="vLLM is not installed (opt-in): see docs/engines.md for its recipe")
    trace = load(str(SERVING_FUZZ / f"{finding}.min.jsonl"))
    assert "sliding(1)" in trace.header.groups
    for name in ("vllm-kvmanager", "vllm-kvmanager-dense"):
        d = _engine_check(name, trace).divergence
        assert d is not None
        assert (d.step, d.quantity, d.expected, d.actual) == (step, quantity, expected, actual), d
    assert _engine_check("vllm-kvmanager", _with_window(trace, "sliding(1)", "sliding(2)")).valid


def test_vllm_a_second_fork_hits_what_a_first_computed_of_kept_drafts():
    """The serving default's campaign, seed 1, 08 (a kvbench oracle bug, fixed): B = 1, 1 token,
    its fork appends 5 drafts and keeps 2 (blocks 1 and 2 full of kept drafts, which vLLM caches
    at the fork's next allocate_slots), then two forks of it. The first computes blocks 1 and 2
    and caches them; the second hits them (vLLM: 10 blocks in use). The oracle keyed the first
    fork's blocks as its own, so the second hit block 0 alone (11)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (opt-in): see docs/engines.md for its recipe")
    trace = load(str(SERVING_FUZZ / "seed1" / "08-blocks-used-free.min.jsonl"))
    for name in ("vllm-kvmanager", "vllm-kvmanager-dense"):
        v = _engine_check(name, trace)
        # 10 = 1 (0's) + 6 (the fork's 1 + 5, kept as lookahead) + 2 (fork 2) + (3 - 2) (fork 3)
        assert v.valid is True and v.final_ledger["blocks_used"] == 10, str(v.divergence)


SGLANG_SPEC_RULES = {"evicts_whole_leaves": False, "eviction_demand": "need",
                     "capped_hit_recomputed": False}
SGLANG_FINDINGS = ["01-cached-blocks-append", "02-cached-blocks-prefill", "03-cached-blocks-fork",
                   "04-cached-blocks-free", "05-outcome-success-expected-out-of-memory-a-fork",
                   "06-cached-blocks-resume"]


@pytest.mark.parametrize("finding", SGLANG_FINDINGS)
def test_sglang_findings_are_its_declared_rules(finding):
    """Every SGLang finding of the campaign was a rule it now declares (tests/engines/findings/):
    a page per request over-evicted (01, B = 32), a whole radix leaf evicted (03, 04 and 06 at
    B = 1 and 2: the resumed sequence's 3 tokens need 2 of its 3 cached ones' pages, and its
    node goes whole), the capped hit's page computed again (05: a fork of 6 tokens in 6 pages is
    refused). Its whole history checks clean under them; its shrunk trace, held to SPEC's rules,
    diverges as it was found (the divergence its header records)."""
    require_sglang()
    whole = load(str(CAMPAIGNS / "earlier" / "sglang-radix" / f"{finding}.jsonl"))
    v = _engine_check("sglang-radix", whole)
    assert v.valid is True and v.ops == len(whole.ops), str(v.divergence)
    shrunk = load(str(CAMPAIGNS / "earlier" / "sglang-radix" / f"{finding}.min.jsonl"))
    assert _engine_check("sglang-radix", shrunk).valid is True
    # As it was found: the campaign predates RadixCache's block order, which shows each at its
    # first cached order instead (an earlier step: test_sglang_block_state.py).
    d = _engine_check("sglang-radix", shrunk, structures=False, **SGLANG_SPEC_RULES).divergence
    found = shrunk.header.params["divergence"]
    assert (d.index, d.quantity, d.expected, d.actual) == (
        found["index"], found["quantity"], found["expected"], found["actual"])


def test_a_resumed_sequence_caches_its_blocks_anew():
    """SGLang's 02, 04 and 06 histories, shrunk again under the declared rules, showed an oracle
    bug (fixed): the blocks a resume computed again got the keys of the sequence's blocks before
    its preemption, so they were never cached (no duplicates kept) and a fork found none of them.
    B = 1, 4 pages: 1 token, preempted (cached), resumed into a new page (its token ids are
    new to the cache), freed: 2 pages cached; forked instead: the fork shares the resumed page
    (the capped hit's page computed again, then shared), 1 page in use."""
    require_sglang()
    head = [Prefill(0, 0, "a", 1, ()), Preempt(1, 0, "recompute"), Resume(2, 0)]
    for last, quantity, value in ((Free(3, 0), "cached_blocks", 2), (Fork(3, 1, 0), "blocks_used", 1)):
        trace = validate(Trace(Header("fuzz-finding", settings={"block_size": 1, "num_blocks": 4,
                                                               "prefix_caching": True}),
                               head + [last], name="resume"))
        v = _engine_check("sglang-radix", trace)
        assert v.valid is True and v.final_ledger[quantity] == value, str(v.divergence)


CAMPAIGN_SGLANG = [f"{backend}/{name}" for backend in ("sglang", "sglang-radix") for name in (
    "01-cached-blocks-append", "02-cached-blocks-prefill", "03-cached-blocks-fork",
    "04-cached-blocks-free", "05-outcome-success-expected-out-of-memory-a-fork",
    "06-blocks-used-fork", "07-cached-blocks-resume",
    "08-outcome-success-expected-out-of-memory-a-prefill")]


@pytest.mark.parametrize("finding", CAMPAIGN_SGLANG)
def test_sglang_campaign_findings_pass_under_its_declared_rules(finding):
    """The last campaigns' SGLang findings, found before its rules were modelled (over-eviction
    by a page per request and by whole leaves, the capped hit's page, the resume's blocks):
    held to the rules its adapter declares, each minimal trace passes to its last operation."""
    require_sglang()
    trace = load(str(CAMPAIGNS / f"{finding}.min.jsonl"))
    v = _engine_check(finding.split("/")[0], trace)
    assert v.valid is True and v.ops == len(trace.ops), str(v.divergence)


def test_vllm_a_fork_of_a_chunked_prompt_is_a_request_of_its_computed_tokens():
    """Seed 4242's campaign with --model-shapes (history 6676, shrunk to 5 operations): the
    chunk that would complete sequence 0's 5-token prompt is refused (the batch needs 5 blocks of
    4), so the fork finds it 4 tokens in. The adapter made the child a request of all the
    parent's token ids (its whole prompt): 5 tokens where the parent had computed 4."""
    pytest.importorskip("vllm", reason="vLLM is not installed (opt-in): see docs/engines.md for its recipe")
    from kvbench.contract import registry
    config = CacheConfig(model=with_group_kinds(get_model("tiny-hybrid"), ["full"]), block_size=2,
                         num_blocks=4, max_context=8, prefix_caching=True)
    ops = [Prefill(0, 0, "a", 2, ("p1.0", "r6.1"), salt="s1", adapter="a1", prompt_tokens=5),
           Prefill(1, 1, "b", 2, ("p1.0",), salt="s1", adapter="a1"),
           Append(2, (0, 1), (1, 3)),  # refused: ceil(3 / 2) + ceil(5 / 2) = 5 blocks > 4
           Append(3, (0,), (2,)),  # 2 + 2 = 4 of the prompt's 5 tokens
           Fork(4, 2, 0)]
    trace = validate(Trace(Header("fuzz-finding", groups=("full",)), ops, name="fork_of_a_chunked_prompt"))
    v = check(trace, registry.create("vllm-kvmanager", config))
    assert v.valid is True and v.ops == 5, str(v.divergence)  # tokens {..., 2: 4} checked at the fork


def test_vllm_kept_drafts_stay_uncached_through_an_append_of_no_token():
    """The Mamba campaign (seed 48, tests/engines/findings/campaigns/vllm-kvmanager-mamba; a
    kvbench oracle bug, fixed): B = 1, a 1-token prompt, 5 drafts all kept (blocks 1-5 full of
    kept drafts, cached at the request's next allocate_slots), an append of 0 tokens, the free.
    vLLM's scheduler schedules no step of 0 tokens, so nothing caches them: 1 block cached (the
    prompt's) at the free. The oracle took the empty append for the next allocation: 1 + 5 = 6."""
    pytest.importorskip("vllm", reason="vLLM is not installed (opt-in): see docs/engines.md for its recipe")
    trace = load(str(CAMPAIGNS / "vllm-kvmanager-mamba" / "01-cached-blocks-free.min.jsonl"))
    v = _engine_check("vllm-kvmanager", trace)
    assert v.valid is True and v.final_ledger["cached_blocks"] == 1, str(v.divergence)
