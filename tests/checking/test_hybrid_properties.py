"""Random histories on hybrid models (SPEC §8) with salted prefix caching (SPEC §9).

The state machine of test_properties, on models of one to three KV cache groups with small
sliding windows, and prefills that name token ids drawn from a few shared prompts, under a salt
and an adapter drawn from a small set in which a salt and an adapter share the name "x". Every
backend that runs hybrid models replays each history under the checker, which compares the
ledger, the per-group tables block by block, SPEC §10's identities and the K/V of every
sequence against the oracle after every operation.
"""
from __future__ import annotations

from hypothesis import strategies as st
from conftest import backends as registered
from hypothesis.stateful import initialize, rule
from test_properties import MAX_LEN, SETTINGS, TENANT_WEIGHTS, History

from kvbench.contract.formulas import ModelSpec, hybrid_groups
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Prefill

# Window patterns, layer i of kind pattern[i % len]: full only with one sliding group,
# sliding only (Mistral-like), and two or three groups mixing both.
PATTERNS = [(3, None), (8,), (20, None), (1, None), (5, 12, None)]
PROMPTS = [[7] * 48, [7] * 20 + [9] * 28, list(range(48))]  # shared and diverging prefixes
EXTRA = [None, "x"]


def hybrid_model(pattern) -> ModelSpec:
    layers = 2 * len(pattern)
    return ModelSpec("h", layers=layers, kv_heads=1, head_dim=4,
                     groups=hybrid_groups(layers, pattern, per_group=2))


class HybridHistory(History):
    backends = ("numpy", "numpy-int8", *registered("contiguous"))  # a plain and a quantized pool
    policies = (None, "lru", "fair")

    @initialize(block_size=st.sampled_from([1, 2, 4, 8]), pattern=st.sampled_from(PATTERNS),
                data=st.data())
    def configure(self, block_size, pattern, data):
        num_blocks = data.draw(st.integers(max(4, 48 // block_size), 480 // block_size), label="num_blocks")
        policy = data.draw(st.sampled_from(self.policies), label="policy")
        self.config = CacheConfig(model=hybrid_model(pattern), block_size=block_size,
                                  num_blocks=num_blocks, policy=policy, max_context=MAX_LEN,
                                  tenant_weights=TENANT_WEIGHTS, prefix_caching=True)
        self._new_sequence(data)

    @rule(tokens=st.integers(1, MAX_LEN), tenant=st.sampled_from(sorted(TENANT_WEIGHTS)),
          prompt=st.sampled_from(range(len(PROMPTS))), salt=st.sampled_from(EXTRA),
          adapter=st.sampled_from(EXTRA))
    def prefill(self, tokens, tenant, prompt=0, salt=None, adapter=None):
        seq = self.next_seq
        self.next_seq += 1
        self.ops.append(Prefill(len(self.ops), seq, tenant, tokens, salt=salt, adapter=adapter,
                                token_ids=tuple(PROMPTS[prompt][:tokens])))
        self.length[seq] = tokens


TestHybridHistories = HybridHistory.TestCase
TestHybridHistories.settings = SETTINGS
