"""Every ledger quantity is checked from its definition alone (kvbench/contract/ledger.py): a
backend wrong in one quantity, and in that one only, FAILs at the operation where it is wrong,
naming it. A new quantity is parametrized here as soon as it is defined."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from conftest import A, K, P, X, counting_calls, make_config, make_trace

from impls.contiguous import Contiguous
from impls.numpy_paged import NumpyPaged
from kvbench.checking.checker import check
from kvbench.contract.ledger import LEDGER_FIELDS, QUANTITIES, Ledger, named

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ledger-quantities.md"

TRACE = make_trace(P(0, 40), K(1, 0), A((1, 3), (0, 2)), P(2, 20), X(0), A((2, 5),), X(1), X(2),
                   name="ledger-quantities")
WRONG_FROM = 2  # the operation from which the backends below misreport


def _wrong(value):
    """A value that differs from ``value``, of the same shape."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, dict):
        first = min(value)
        return {**value, first: value[first] + 1}
    if isinstance(value, tuple):
        return (value[0] + 1, *value[1:]) if value else (1,)
    if isinstance(value, float):
        return value + 0.25
    if value is None:
        return 1
    return value + 1


def misreporting(cls, field: str):
    class Misreports(counting_calls(cls)):
        name = f"misreports-{field}"

        def ledger(self, *a, **kw):
            led = super().ledger(*a, **kw)
            if self.calls > WRONG_FROM:
                setattr(led, field, _wrong(getattr(led, field)))
            return led

    return Misreports


def named_in(field, d) -> bool:
    """The divergence names the quantity: compared itself, or an identity that reads it."""
    return field in d.quantity or field in d.detail


PAGED = LEDGER_FIELDS
CONTIGUOUS = tuple(f for f in LEDGER_FIELDS if not QUANTITIES[f].blocks)


@pytest.mark.parametrize("field", PAGED)
def test_paged_backend_wrong_in_one_quantity_fails_there(field):
    backend = misreporting(NumpyPaged, field)(make_config(block_size=16, num_blocks=8))
    v = check(TRACE, backend, gather="none")
    assert v.valid is False
    assert v.divergence.step == WRONG_FROM, str(v.divergence)
    assert named_in(field, v.divergence), str(v.divergence)


@pytest.mark.parametrize("field", CONTIGUOUS)
def test_contiguous_backend_wrong_in_one_quantity_fails_there(field):
    backend = misreporting(Contiguous, field)(make_config(block_size=16, num_blocks=8, max_context=64))
    v = check(TRACE, backend, gather="none")
    assert v.valid is False
    assert v.divergence.step == WRONG_FROM, str(v.divergence)
    assert named_in(field, v.divergence), str(v.divergence)


def test_block_quantities_are_not_compared_for_a_contiguous_layout():
    # A contiguous arena has no blocks: a value there is not its fault (and not compared).
    for field in named(blocks=True):
        backend = misreporting(Contiguous, field)(make_config(block_size=16, num_blocks=8,
                                                              max_context=64))
        assert check(TRACE, backend, gather="none").valid is True, field


def test_paged_ledger_derives_every_figure_from_the_facts():
    # 3 blocks of 16 in use holding 40 tokens, 5 free of 8, 6 slots reserved in the tail.
    led = Ledger.paged(num_blocks=8, block_size=16, block_bytes=1024, blocks_used=3, blocks_free=5,
                       tokens={0: 40}, seq_blocks={0: 3}, token_states=40, reservation=6,
                       shared_blocks=0)
    assert led.capacity_slots == 48  # 3 * 16
    assert led.free_slots == 8  # 48 - 40
    assert led.fragmentation == 8 / 48
    assert led.internal_fragmentation == 2  # 8 free slots - 6 reserved
    assert led.free == 80  # 5 * 16
    assert led.bytes_in_use == 3072  # 3 * 1024
    assert (led.token_capacity, led.block_usage, led.slot_usage) == (128, 3 / 8, 40 / 128)
    # An engine that reports only its own usage figure: the others stay unreported.
    led = Ledger.paged(num_blocks=8, block_size=16, block_bytes=1024, blocks_used=3, blocks_free=5,
                       tokens={0: 40}, seq_blocks={0: 3}, token_states=40, reservation=6,
                       shared_blocks=0, self_report={"block_usage": 0.5})
    assert (led.token_capacity, led.block_usage, led.slot_usage) == (None, 0.5, None)


def test_contiguous_ledger_derives_every_figure_from_the_facts():
    # An arena of 128 slots; slabs of 64 and 32 slots, placed up to 112; 50 tokens, 20 reserved.
    led = Ledger.contiguous(arena_slots=128, slot_bytes=4, tokens={0: 30, 1: 20},
                            seq_blocks={0: 64, 1: 32}, capacity_slots=96, token_states=50,
                            reservation=20, high_water=112)
    assert led.internal_fragmentation == 26  # 96 - 50 - 20
    assert led.external_fragmentation == 16  # 112 - 96
    assert led.free == 16  # 128 - 112
    assert led.bytes_in_use == 384  # 96 * 4
    assert led.fragmentation == 46 / 96  # (96 - 50) / 96


def test_no_module_lists_ledger_fields_by_hand():
    """The lists of ledger fields (compared, per sequence, counted, in the series, shown) are
    derived from the definitions: a literal naming three or more of them elsewhere is a copy."""
    names = set(LEDGER_FIELDS)
    # The figures a hit across salts moves: a set chosen for its meaning, not a property list.
    meant = {"kvbench/checking/identities.py": {("blocks_used", "blocks_free", "free")}}
    found = []
    for path in sorted((ROOT / "kvbench").rglob("*.py")) + sorted((ROOT / "impls").rglob("*.py")):
        if path.name == "ledger.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                words = [e.value for e in node.elts if isinstance(e, ast.Constant)]
                if sum(w in names for w in words) >= 3 and \
                        tuple(words) not in meant.get(str(path.relative_to(ROOT)), ()):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"ledger fields listed by hand: {found}"


def test_the_docs_table_is_the_definitions():
    from kvbench.contract.ledger import markdown_table
    assert markdown_table() in DOC.read_text(), \
        "docs/ledger-quantities.md is stale: paste kvbench.contract.ledger.markdown_table()"


def test_every_quantity_has_a_doc_and_a_known_series_kind():
    for name, q in QUANTITIES.items():
        assert q.doc, name
        assert q.series in ("", "peak", "mean"), name
        assert set(q.shown) <= {"paged", "contiguous"}, name
    assert dataclasses.fields(Ledger)[0].name == "blocks_used"  # the comparison order is the fields'
