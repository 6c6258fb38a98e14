"""`kvbench fuzz` by default (issue 47): every model shape and declared KV format drawn, an edge
condition counted only where it acted, operations of zero tokens written, and each planted edge
bug of impls/faults_fuzz.py found within 200 histories."""
from __future__ import annotations

import pytest
from conftest import make_config

from impls import faults_fuzz
from impls.numpy_paged import NumpyPaged
from kvbench.checking.checker import check, oracle_for
from kvbench.cli import main
from kvbench.contract import registry
from kvbench.search import watch as F
from kvbench.search import histories as R
from kvbench.search.fuzz import Campaign, Watch
from kvbench.traces.format import Append, Free, Header, Prefill, Trace, loads, validate
from kvbench.traces.ops import Abort, Accept, Done, Fork, Load, Store
from kvbench.traces.tier_ops import TierSpec

NUMPY = NumpyPaged.capabilities
DEFAULT_HISTORIES = 200  # a campaign's histories in the measure


def test_the_default_draws_every_kind_the_backend_declares_and_every_format(tmp_path):
    drawn = [R.random_history(0, i, NUMPY, R.LIFECYCLES)[1] for i in range(60)]
    kinds = {k.split("(")[0] for s in drawn for k in s.kinds()}
    assert kinds == set(NUMPY.kinds)  # full, sliding, chunked, sinks, mla, state
    assert sum(bool(s.shape) for s in drawn) > 60 * R.SHAPE_RATE / 2
    assert not any(s.kv_format for s in drawn)  # the plain pool declares no format
    c = Campaign(registry.resolve("impls.faults_fuzz:MultiFormat"), tmp_path)
    c.capabilities()
    assert c.formats == R.KV_FORMATS
    formats = [R.random_history(0, i, c.capabilities(), c.lifecycles, True, c.formats)[1].kv_format
               for i in range(30)]
    assert set(formats) == set(R.KV_FORMATS)
    assert formats == [R.random_history(0, i, c.capabilities(), c.lifecycles, True, c.formats)[1].kv_format
                       for i in range(30)]  # the same under the seed
    # the format has a generator of its own: the history is the plain pool's, op for op
    assert R.random_history(0, 3, NUMPY, R.LIFECYCLES, True, c.formats)[0].ops == \
        R.random_history(0, 3, NUMPY, R.LIFECYCLES)[0].ops
    base = [R.random_history(0, i, NUMPY, R.LIFECYCLES, False)[1] for i in range(60)]
    assert {k.split("(")[0] for s in base for k in s.kinds()} == {"full", "sliding"}


def test_a_pool_of_one_format_declares_that_one_and_a_plain_pool_none(tmp_path):
    for name, formats in (("numpy", ()), ("numpy-int8", ("int8",)), ("numpy-nvfp4", ("nvfp4",)),
                          ("impls.numpy_quant_paged:NumpyQuantPaged", ("int8", "int4"))):
        c = Campaign(registry.resolve(name), tmp_path)
        c.capabilities()
        assert c.formats == formats, name


def _tiered_watch(ops):
    trace = validate(Trace(Header("t", tenants={"a": 1}, tiers=(TierSpec("host", 4),)), ops, name="t"))
    backend = NumpyPaged(make_config(4, 2, prefix_caching=True))
    watch = Watch(oracle_for(trace, backend), trace)
    check(trace, None, model=watch.o, progress=watch)
    return watch.reached


def test_an_abort_counts_only_where_the_load_read_tier_blocks():
    # 8 tokens in blocks of 4: 2 blocks, the device's whole budget. Stored to the host, then
    # pushed off the device by an unhashed prompt of 2 blocks, so a load of it reads 2 host blocks.
    stored = [Prefill(0, 0, "a", 8, ("h0", "h1")), Store(1, 0, 0, "host"), Done(2, 0, True),
              Free(3, 0), Prefill(4, 1, "a", 8), Free(5, 1)]
    moving = _tiered_watch(stored + [Load(6, 2, "a", 8, ("h0", "h1"), id=1), Abort(7, 2)])
    assert {"load served from a tier", F.ABORT_LOADING} <= moving
    # a prompt the tier does not hold: the load moves nothing, and its abort is not the edge
    idle = _tiered_watch(stored + [Load(6, 2, "a", 8, ("x0", "x1"), id=1), Abort(7, 2)])
    assert F.ABORT_LOADING not in idle and "load served from a tier" not in idle


@pytest.mark.parametrize("failed_load, second_load, reached", [
    ("drop", True, True),    # load 1 still reads h0 when load 2's failure drops it
    ("drop", False, False),  # the failed load its only reader
    ("keep", True, False),   # nothing dropped
])
def test_a_failed_load_sharing_a_dropped_block_counts_only_where_another_load_reads_it(
        failed_load, second_load, reached):
    # h0 stored to the host, pushed off the device (4 blocks of 4) by an unhashed prompt; a load
    # does not put it in the prefix cache before it completes, so both loads read the host's h0
    ops = [Prefill(0, 0, "a", 4, ("h0",)), Store(1, 0, 0, "host"), Done(2, 0, True), Free(3, 0),
           Prefill(4, 1, "a", 16), Free(5, 1), Load(6, 2, "a", 4, ("h0",), id=1),
           *[Load(7, 3, "a", 4, ("h0",), id=2)] * second_load, Done(8, 2 if second_load else 1, False)]
    trace = validate(Trace(Header("t", tenants={"a": 1}, tiers=(TierSpec("host", 4, failed_load=failed_load),)),
                           ops, name="t"))
    watch = Watch(oracle_for(trace, NumpyPaged(make_config(4, 4, prefix_caching=True))), trace)
    check(trace, None, model=watch.o, progress=watch)
    assert (F.SHARED_DROP in watch.reached) is reached and "failed transfer" in watch.reached


def _watched(ops, num_blocks=8, block_size=4):
    trace = validate(Trace(Header("t", tenants={"a": 1}), ops, name="t"))
    watch = Watch(oracle_for(trace, NumpyPaged(make_config(block_size, num_blocks))), trace)
    check(trace, None, model=watch.o, progress=watch)
    return watch.reached


def test_a_rollback_counts_where_it_released_a_block_and_says_where_it_ended():
    # 4 tokens: one full block; the fork shares it; 3 drafts alone go into a second block;
    # none accepted: back to 4 tokens, on the edge of the block the fork shares.
    shared = _watched([Prefill(0, 0, "a", 4), Fork(1, 1, 0), Append(2, (0,), (3,), (3,)), Accept(3, 0, 0)])
    assert {F.ROLLBACK, "rollback ending on a block edge", F.SHARED_ROLLBACK} <= shared
    # 5 tokens, 2 drafts into the second block's free slots, one kept: no block released
    kept = _watched([Prefill(0, 0, "a", 5), Append(1, (0,), (2,), (2,)), Accept(2, 0, 1)])
    assert not kept & {F.ROLLBACK, "rollback ending on a block edge", F.SHARED_ROLLBACK}


def test_operations_of_zero_tokens_are_drawn_and_load_and_check():
    traces = [R.random_history(0, i, NUMPY, R.LIFECYCLES)[0] for i in range(40)]
    empty = [op for t in traces for op in t.ops if isinstance(op, Prefill) and op.tokens == 0]
    none = [op for t in traces for op in t.ops if isinstance(op, Append) and 0 in op.tokens]
    assert empty and none
    t = next(t for t in traces if any(isinstance(op, Prefill) and op.tokens == 0 for op in t.ops))
    back = loads(t.to_jsonl())  # the loader takes them: SPEC §13's operation of zero tokens
    assert back.ops == t.ops
    ops = [Prefill(0, 0, "a", 0), Prefill(1, 1, "a", 3), Append(2, (0, 1), (2, 0)), Append(3, (0,), (0,))]
    assert check(validate(Trace(Header("t"), ops, name="z")), NumpyPaged(make_config(4, 4))).valid


# Found past history 50 (10-20 s each on a loaded 2-core machine): marked slow.
LATE = (faults_fuzz.RollbackKeepsBlockZero, faults_fuzz.ChunkAppendCachesPartial,
        faults_fuzz.TierEvictsLoading, faults_fuzz.TokenIdKeysUnchained)


@pytest.mark.parametrize("name, fault", [pytest.param(n, f, marks=[pytest.mark.slow] if f in LATE else [])
                                         for n, f in faults_fuzz.FUZZ_BUGS],
                         ids=[f.__name__ for _, f in faults_fuzz.FUZZ_BUGS])
def test_each_planted_edge_bug_is_found_within_200_histories_by_default(name, fault, tmp_path):
    c = Campaign(registry.resolve(f"{fault.__module__}:{fault.__name__}"), tmp_path, seed=0,
                 max_histories=DEFAULT_HISTORIES, shrink_attempts=1, first=True).run()
    assert c.stopped == "first finding", f"{name}: not found in {DEFAULT_HISTORIES} histories"
    assert not c.errors


def test_a_finding_in_a_drawn_format_replays_in_that_format(tmp_path):
    c = Campaign(registry.resolve("impls.faults_fuzz:Fp8Truncates"), tmp_path, seed=0,
                 max_histories=DEFAULT_HISTORIES, shrink_attempts=200, first=True).run()
    (f,) = c.findings.values()
    assert f.settings["kv_format"] == "fp8-tensor"  # its default, int8, is right
    mini = tmp_path / f"{f.name}.min.jsonl"
    assert loads(mini.read_text()).header.settings["kv_format"] == "fp8-tensor"
    assert main(["check", str(mini), "--backend", "impls.faults_fuzz:Fp8Truncates"]) == 1
