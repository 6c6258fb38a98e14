"""The rule sets (kvbench/model/rules/): a backend names one and its parameters; an old-form
plug-in's engine flags still load; a new rule set is one class, registered by name."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import make_config

from kvbench.contract.protocol import Capabilities
from kvbench.model.oracle import Oracle
from kvbench.model.rules import RULE_SETS, rule_set
from kvbench.model.rules.spec import SpecRules

B = 16


def oracle(caps: Capabilities) -> Oracle:
    return Oracle(make_config(B, 16, prefix_caching=True), layout="paged", capabilities=caps)


def hit_blocks_of_a_whole_hit(caps: Capabilities) -> int:
    """Prefix hit blocks of a 64-token prompt whose 4 blocks are all cached."""
    o = oracle(caps)
    o.prefill(0, 64, "a", 64, step=0, hashes=(1, 2, 3, 4))
    o.free(0)
    o.prefill(1, 64, "a", 64, step=1, hashes=(1, 2, 3, 4))
    return o.expected_ledger().prefix_hit_blocks


def test_capabilities_have_at_most_17_fields():
    assert len(dataclasses.fields(Capabilities)) <= 17


def test_a_backend_declares_a_rule_set_by_name_with_its_defaults_and_parameters():
    assert hit_blocks_of_a_whole_hit(Capabilities()) == 4  # SPEC: every cached block is hit
    assert hit_blocks_of_a_whole_hit(Capabilities(rules="vllm")) == 3  # (64 - 1) // 16
    assert hit_blocks_of_a_whole_hit(Capabilities(
        rules="vllm", rule_params={"hit_leaves_last_token": False})) == 4
    assert rule_set(Capabilities(rules="sglang")).eviction_demand == "page_per_request"


def test_an_unknown_rule_set_or_parameter_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown rule set 'trt': one of spec, vllm, sglang"):
        rule_set(Capabilities(rules="trt"))
    # leaf_order is SGLang's, not vLLM's: the error names the set and every parameter it has
    with pytest.raises(ValueError, match=r"rule set 'vllm' has no parameter leaf_order; its "
                                         r"parameters: fork_via, hit_leaves_last_token, .*"
                                         r"chunk_start_hit, state_checkpoints, cached_queue_order$"):
        oracle(Capabilities(rules="vllm", rule_params={"leaf_order": "lfu"}))
    with pytest.raises(ValueError, match="rule set 'sglang': eviction_demand must be one of"):
        rule_set(Capabilities(rules="sglang", rule_params={"eviction_demand": "all"}))


def test_an_old_form_plug_in_setting_engine_flags_still_loads_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"Capabilities\(hit_leaves_last_token=\.\.\.\) "
                                                "is the old form"):
        caps = Capabilities(prefix_caching=True, hit_leaves_last_token=True)
    assert (caps.rules, caps.rule_params) == ("spec", {"hit_leaves_last_token": True})
    assert hit_blocks_of_a_whole_hit(caps) == 3  # (64 - 1) // 16, as the flag did
    # An old flag given to dataclasses.replace lands on the set the backend declares.
    with pytest.warns(DeprecationWarning):
        vllm = dataclasses.replace(Capabilities(rules="vllm"), hit_leaves_last_token=False)
    assert vllm.rules == "vllm" and hit_blocks_of_a_whole_hit(vllm) == 4
    with pytest.warns(DeprecationWarning, match="devices"):
        Capabilities(devices=("cpu",))


class HalfPromptRules(SpecRules):
    """A toy engine whose prefix hit covers at most half of the prompt's tokens."""

    name = "half-prompt"

    def most_hit_tokens(self, tokens: int) -> int:
        return tokens // 2


def test_a_new_rule_set_is_one_class_registered_by_name(monkeypatch):
    monkeypatch.setitem(RULE_SETS, HalfPromptRules.name, HalfPromptRules)
    caps = Capabilities(prefix_caching=True, rules="half-prompt")
    assert hit_blocks_of_a_whole_hit(caps) == 2  # 64 // 2 // 16
    assert hit_blocks_of_a_whole_hit(dataclasses.replace(caps, rules="spec")) == 4
