"""RunSettings: a run's settings, typed, resolved over a trace's header and the defaults."""
from __future__ import annotations

import argparse
import dataclasses

import pytest
from conftest import P, make_trace

from kvbench.analyses import breakdown
from kvbench.analyses.settings import RunSettings
from kvbench.cli import run as cli_run
from kvbench.traces.format import Trace


def with_settings(trace: Trace, **settings) -> Trace:
    return dataclasses.replace(trace, header=dataclasses.replace(trace.header, settings=settings))


TRACE = make_trace(P(0, 40), P(1, 20))


def test_a_wrong_value_names_its_option():
    with pytest.raises(ValueError, match=r"^--block-size: must be a positive integer"):
        RunSettings(block_size=0)
    with pytest.raises(ValueError, match=r"^--prefix-caching: must be true or false, got 'yes'"):
        RunSettings(prefix_caching="yes")


def test_budget_in_blocks_is_a_plain_number_in_bytes_it_names_its_unit():
    # The tiny model: 2 layers * 2 heads * 8 dims * 2 (K, V) * 2 bytes = 128 B a token, 2,048 a block.
    assert RunSettings(budget="40").config(TRACE).num_blocks == 40
    assert RunSettings(budget="40 blocks").config(TRACE).num_blocks == 40
    assert RunSettings(budget="8KiB").config(TRACE).num_blocks == 4  # 4 = 8192 // 2048
    with pytest.raises(ValueError, match=r"^--budget: not a byte size: '8192x'"):
        RunSettings(budget="8192x").config(TRACE)


def test_the_settings_come_first_then_the_header_then_the_defaults():
    suggested = with_settings(TRACE, num_blocks=32, block_size=8, store_kv=False)
    cfg = RunSettings().config(suggested, "lru")
    assert (cfg.num_blocks, cfg.block_size, cfg.store_kv, cfg.policy) == (32, 8, False, "lru")
    cfg = RunSettings(budget="12", block_size=4, store_kv=True).config(suggested)
    assert (cfg.num_blocks, cfg.block_size, cfg.store_kv, cfg.policy) == (12, 4, True, None)
    cfg = RunSettings().config(TRACE)  # nothing said: 256 blocks of 16, max_context the next
    assert (cfg.num_blocks, cfg.block_size, cfg.max_context) == (256, 16, 64)  # pow2 above 40


def test_the_serving_defaults_resolve_through_the_same_settings():
    # OPT-13B: 40 layers * 40 heads * 128 dims * 2 * 2 B = 819,200 B a token;
    # floor(12 GiB / (16 * 819,200)) = 983 blocks.
    cfg = breakdown.opt13b_config()
    assert (cfg.model.name, cfg.num_blocks, cfg.block_size, cfg.store_kv) == ("opt-13b", 983, 16, False)


def test_a_run_resolves_its_settings_once():
    args = argparse.Namespace(model=None, block_size=8, budget="20", max_context=None,
                              device="cpu", prefix_caching=None)
    first = cli_run.settings(args)
    assert cli_run.settings(args) is first and first.config(TRACE).num_blocks == 20
