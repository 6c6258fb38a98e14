"""The ledger: a backend's account of its memory after an operation, and what the harness does
with each of its quantities.

Every field carries its :class:`Quantity` (``dataclasses.fields(Ledger)[i].metadata``): whether
only a paged layout has it, whether it is per sequence, its tolerance, whether it is a count
that is never negative, whether a backend may leave it out, whether the checker's series keeps
it. The checker, the identities, the series and the reproducers read those flags, so a new
quantity is one field here, the oracle's value of it and the backends that report it
(docs/ledger-quantities.md).

A backend reports the facts only it knows; :meth:`Ledger.paged` and :meth:`Ledger.contiguous`
derive every other figure from them by the formulas, once, for the oracle and for every backend
alike (the fields marked ``derived``).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from kvbench.contract import formulas as F


@dataclass(frozen=True)
class Quantity:
    """What the harness does with one ledger field."""

    doc: str
    blocks: bool = False  # only a paged layout has it: compared only there
    per_sequence: bool = False  # a dict by sequence: compared for the sequences an op touched
    tolerance: float = 0.0  # |expected - actual| allowed; 0: compared with ==
    count: bool = False  # never negative (SPEC §10), each entry of a dict or tuple too
    optional: bool = False  # SPEC §10's self-reported figures: compared only when not None
    series: str = ""  # kept after every operation by the checker: "peak" or "mean" in a record
    shown: tuple = ()  # layouts whose reproducer comments show it ("paged", "contiguous")
    derived: bool = False  # derived from the facts by Ledger.paged / Ledger.contiguous
    category: bool = False  # one of the five memory categories that add up to the budget (SPEC §3)


def _quantity(doc: str, default=MISSING, **flags):
    return field(default=default, metadata={"quantity": Quantity(doc, **flags)})


BOTH = ("paged", "contiguous")


@dataclass
class Ledger:
    """A backend's own account of its memory after an operation.

    Slot counts are token slots. The five memory categories add up to the whole budget:
    token_states + reservation + internal_fragmentation + external_fragmentation + free.
    """

    blocks_used: int | None = _quantity(
        "physical blocks in use, each counted once (None: a layout without blocks)",
        blocks=True, count=True, series="peak", shown=("paged",))
    blocks_free: int | None = _quantity(
        "blocks not in use, cached ones included", blocks=True, count=True, shown=("paged",))
    tokens: dict = _quantity("live sequence -> tokens", per_sequence=True, count=True, shown=BOTH)
    seq_blocks: dict = _quantity(
        "live sequence -> blocks in its tables (contiguous: slots in its slabs)",
        per_sequence=True, count=True)
    capacity_slots: int = _quantity(
        "slots of the blocks (slabs) in use, each physical one counted once", count=True, derived=True)
    free_slots: int = _quantity("of those, slots not holding a token", count=True, derived=True)
    fragmentation: float = _quantity(
        "free_slots / capacity_slots (0.0 with nothing in use)", tolerance=1e-12, series="mean",
        derived=True)
    bytes_in_use: int = _quantity("blocks (slabs) in use times their bytes", count=True, derived=True)
    shared_blocks: int | None = _quantity(
        "blocks held by more than one table", blocks=True, count=True, shown=("paged",))
    token_states: int = _quantity("slots holding a token", count=True, series="mean",
                                  shown=("contiguous",), category=True)
    reservation: int = _quantity("slots that later tokens of the same sequence will fill",
                                 count=True, series="mean", shown=("contiguous",), category=True)
    internal_fragmentation: int = _quantity(
        "slots in use that no token will ever fill", count=True, series="mean", derived=True,
        category=True)
    external_fragmentation: int = _quantity(
        "free arena slots between slabs (0 for a paged layout)", count=True, series="mean",
        shown=("contiguous",), derived=True, category=True)
    free: int = _quantity("slots of the budget not in use", count=True, series="mean",
                          shown=("contiguous",), derived=True, category=True)
    cached_blocks: int = _quantity(
        "free blocks that still hold a cached prefix (counted in blocks_free)", 0, count=True)
    prefix_hit_blocks: int = _quantity(
        "prompt blocks found in the prefix cache so far (every group)", 0, count=True)
    group_blocks: tuple = _quantity(
        "blocks in use per KV cache group (SPEC §8; empty for a model of one group)", (),
        blocks=True, count=True)
    token_capacity: int | None = _quantity(
        "token slots one group can address: num_blocks * block_size (SPEC §10)", None,
        optional=True, derived=True)
    block_usage: float | None = _quantity(
        "usage by blocks: blocks_used / num_blocks (SPEC §10)", None, blocks=True,
        tolerance=1e-12, optional=True, derived=True)
    slot_usage: float | None = _quantity(
        "usage by slots: token_states / (num_blocks * block_size) (SPEC §10)", None,
        tolerance=1e-12, optional=True, derived=True)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def paged(cls, *, num_blocks: int, block_size: int, block_bytes: int, blocks_used: int,
              blocks_free: int, tokens: dict, seq_blocks: dict, token_states: int,
              reservation: int, shared_blocks: int, cached_blocks: int = 0,
              prefix_hit_blocks: int = 0, group_blocks: tuple = (),
              self_report: dict | None = None) -> "Ledger":
        """A paged pool's ledger from its facts: the blocks in use and free, the slots holding a
        token, the reserved slots of private tail blocks (:func:`formulas.tail_reservation`).

        ``self_report``: SPEC §10's figures as an engine reports them about itself (its own
        usage figure, say), the others left out; None (a pool whose own counts are the facts):
        derived from them."""
        N, B = num_blocks, block_size
        cap = blocks_used * B
        free_slots = cap - token_states
        if self_report is None:
            self_report = dict(token_capacity=N * B, block_usage=blocks_used / N if N else 0.0,
                               slot_usage=token_states / (N * B) if N else 0.0)
        return cls(
            blocks_used=blocks_used, blocks_free=blocks_free, tokens=tokens, seq_blocks=seq_blocks,
            capacity_slots=cap, free_slots=free_slots,
            fragmentation=F.fragmentation(free_slots, cap),
            bytes_in_use=blocks_used * block_bytes, shared_blocks=shared_blocks,
            token_states=token_states, reservation=reservation,
            internal_fragmentation=free_slots - reservation, external_fragmentation=0,
            free=blocks_free * B, cached_blocks=cached_blocks, prefix_hit_blocks=prefix_hit_blocks,
            group_blocks=tuple(group_blocks) if len(group_blocks) > 1 else (), **self_report)

    @classmethod
    def contiguous(cls, *, arena_slots: int, slot_bytes: int, tokens: dict, seq_blocks: dict,
                   capacity_slots: int, token_states: int, reservation: int,
                   high_water: int) -> "Ledger":
        """A contiguous arena's ledger from its facts: the slots of its slabs, the slots holding
        a token or reserved for the sequence's later tokens, and the arena's high-water mark
        (first-fit leaves free space between slabs below it)."""
        cap = capacity_slots
        return cls(
            blocks_used=None, blocks_free=None, tokens=tokens, seq_blocks=seq_blocks,
            capacity_slots=cap, free_slots=cap - token_states,
            fragmentation=F.fragmentation(cap - token_states, cap),
            bytes_in_use=cap * slot_bytes, shared_blocks=None,
            token_states=token_states, reservation=reservation,
            internal_fragmentation=cap - token_states - reservation,
            external_fragmentation=high_water - cap, free=arena_slots - high_water,
            token_capacity=arena_slots,
            slot_usage=token_states / arena_slots if arena_slots else 0.0)


QUANTITIES = {f.name: f.metadata["quantity"] for f in fields(Ledger)}


def named(**flags) -> tuple:
    """The ledger fields whose Quantity has every flag given, in the ledger's order:
    ``named(blocks=True)``, ``named(optional=True)``."""
    return tuple(name for name, q in QUANTITIES.items()
                 if all(getattr(q, k) == v for k, v in flags.items()))


def where(test) -> tuple:
    """The ledger fields whose Quantity passes ``test``, in the ledger's order."""
    return tuple(name for name, q in QUANTITIES.items() if test(q))


def markdown_table() -> str:
    """The quantities and their flags as the Markdown table of docs/ledger-quantities.md."""
    flags = ("blocks", "per_sequence", "count", "optional", "derived", "category")
    rows = ["| quantity | what it is | " + " | ".join(flags) + " | tolerance | series | shown in |",
            "|---" * (len(flags) + 5) + "|"]
    for name, q in QUANTITIES.items():
        marks = " | ".join("yes" if getattr(q, f) else "" for f in flags)
        rows.append(f"| `{name}` | {q.doc} | {marks} | {q.tolerance or ''} | {q.series} | "
                    f"{', '.join(q.shown)} |")
    return "\n".join(rows) + "\n"


LEDGER_FIELDS = tuple(QUANTITIES)
MEMORY_CATEGORIES = named(category=True)  # token states, reservation, fragmentation, free
REPORTED_FIELDS = named(optional=True)  # a backend may leave these out: compared when reported

__all__ = ["Ledger", "Quantity", "QUANTITIES", "LEDGER_FIELDS", "REPORTED_FIELDS", "named", "where",
           "markdown_table", "MEMORY_CATEGORIES"]
