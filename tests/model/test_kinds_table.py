"""The kinds table (kvbench/model/kinds.py): a group's kind is one class picked by its family, so
a new kind is one class and one entry in ``KINDS``; the oracle asks the kind, never its name."""
from __future__ import annotations

import dataclasses

import pytest

from kvbench.contract import formulas as F
from kvbench.contract.protocol import CacheConfig
from kvbench.model import kinds
from kvbench.model.oracle import Oracle

B = 16


@dataclasses.dataclass(frozen=True)
class TwoBlocksGroup(F.KVGroup):
    """A toy kind's group: attention to the tokens of the last two blocks only."""

    @property
    def family(self) -> str:
        return "two-blocks"

    @property
    def kind(self) -> str:
        return "two-blocks"


class TwoBlocksKind(kinds.Kind):
    releases = True

    def released(self, tokens: int) -> range:
        return range(0, max(0, F.blocks_needed(tokens, self.B) - 2))


def toy_model() -> F.ModelSpec:
    tiny = F.get_model("tiny")  # 2 layers: layer 0 full, layer 1 the toy kind
    return dataclasses.replace(tiny, name="tiny-two-blocks",
                               groups=(F.KVGroup((0,)), TwoBlocksGroup((1,))))


def test_a_toy_kind_is_one_class_in_the_table(monkeypatch):
    monkeypatch.setitem(kinds.KINDS, "two-blocks", TwoBlocksKind)
    o = Oracle(CacheConfig(model=toy_model(), block_size=B, num_blocks=32))
    o.prefill(0, 40, "t", 100, step=0)
    # 5 = 3 + 2: the full group holds ceil(40/16) = 3 blocks, the toy one its last 2
    assert o.blocks_used == 5
    o.append([0], [30], step=1)
    # 7 = 5 + 2: 70 tokens are ceil(70/16) = 5 blocks; the toy group gave back blocks 0..2
    assert o.blocks_used == 7
    assert o.expected_ledger().group_blocks == (5, 2)
    # the toy group's blocks 0..2 are gone: positions 0 .. 3 * 16 = 48 read 0
    assert o.released_spans(0) == ((0, 0), (0, 48))


def test_a_kind_missing_from_the_table_is_named():
    with pytest.raises(ValueError, match="no model of 'two-blocks' groups"):
        Oracle(CacheConfig(model=toy_model(), block_size=B, num_blocks=32))


@pytest.mark.parametrize("family", F.KIND_FAMILIES)
def test_every_kind_of_the_formulas_has_a_class(family):
    assert family in kinds.KINDS
