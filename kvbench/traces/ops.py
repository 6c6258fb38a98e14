"""The four trace operations (SPEC section 6), as immutable values. kvbench.traces.format
re-exports them; they live apart so that the columnar form (columns.py) can make them too."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Prefill:
    step: int
    seq: int
    tenant: str
    tokens: int
    block_hashes: tuple | None = None
    salt: str | None = None  # the tenant's cache salt (SPEC §9)
    adapter: str | None = None  # the LoRA adapter the prompt runs under
    token_ids: tuple | None = None  # the prompt's token ids (instead of block_hashes)
    kind = "prefill"


@dataclass(frozen=True)
class Append:
    """One decode step over a batch: seqs[i] gains tokens[i] tokens."""

    step: int
    seqs: tuple
    tokens: tuple
    kind = "append"


@dataclass(frozen=True)
class Fork:
    step: int
    seq: int
    src: int
    kind = "fork"


@dataclass(frozen=True)
class Free:
    step: int
    seq: int
    kind = "free"


Op = Union[Prefill, Append, Fork, Free]
