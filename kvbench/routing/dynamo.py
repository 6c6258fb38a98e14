"""NVIDIA Dynamo's KV router index (``from dynamo.llm import RadixTree``, PyPI ``ai-dynamo-runtime``),
fed a routed run's events and asked the same questions as the reference index.

Opt-in: the wheel lives in its own environment (``scripts/engine_env.sh dynamo``). Dynamo's events
are its JSON (``{"event_id", "data": {"stored": {"parent_hash", "blocks": [{"block_hash",
"tokens_hash"}]}}}``, ``{"removed": {"block_hashes"}}``, ``"cleared"``) with 64-bit hashes; a
kvbench key (which names its block with its whole prefix) gets one number, used as both hashes.
The tree indexes one KV cache group: only group 0's events reach it.
"""
from __future__ import annotations

import json

from kvbench.contract.events import CLEARED, STORED


def available() -> str:
    """'' when Dynamo's RadixTree imports here, else why not."""
    try:
        from dynamo.llm import RadixTree  # noqa: F401
    except Exception as e:  # an absent wheel, or one whose native library does not load
        return f"{type(e).__name__}: {e}"
    return ""


class DynamoIndex:
    def __init__(self):
        try:
            from dynamo.llm import RadixTree
        except ImportError as e:
            raise ValueError(f"--dynamo: Dynamo's RadixTree does not import ({e}); make its "
                             f"environment with scripts/engine_env.sh dynamo") from None
        self.tree = RadixTree()
        self.ids: dict = {}  # kvbench key -> its 64-bit number (from 1; 0 is never stored)
        self.count = 0

    def _id(self, key) -> int:
        return self.ids.setdefault(key, len(self.ids) + 1)

    def apply(self, replica: int, event) -> None:
        if event.group != 0 or event.tier != 0:
            return
        self.count += 1
        if event.kind == CLEARED:
            data = "cleared"
        elif event.kind == STORED:
            h = self._id(event.key)
            parent = None if event.parent is None else self._id(event.parent)
            data = {"stored": {"parent_hash": parent,
                               "blocks": [{"block_hash": h, "tokens_hash": h}]}}
        else:
            data = {"removed": {"block_hashes": [self._id(event.key)]}}
        self.tree.apply_event(replica, json.dumps({"event_id": self.count, "data": data}).encode())

    def extend(self, replica: int, events) -> None:
        for e in events:
            self.apply(replica, e)

    def overlaps(self, keys, replicas: int) -> list:
        scores = self.tree.find_matches([self.ids.get(k, 0) for k in keys]).scores
        return [scores.get((r, 0), 0) for r in range(replicas)]
