"""The checker's per-operation series: ledger figures after each operation, kept column by column
in NumPy arrays (a few dozen bytes per operation, not a dict of boxed numbers per operation)."""
from __future__ import annotations

import numpy as np

from kvbench.contract.ledger import QUANTITIES, where

FIELDS = where(lambda q: q.series)  # the ledger fields kept after every operation
MEANS = where(lambda q: q.series == "mean")  # ... that a record gives as their mean
_ABSENT = -1  # blocks_used of a layout without blocks; usage of a tenant with no live sequence


class Series:
    """Rows read as ``{"step", <FIELDS>, "usage": {tenant: blocks}}`` dicts (``series[i]``,
    iteration); whole columns as arrays (:meth:`column`, :meth:`usage_matrix`)."""

    def __init__(self, capacity: int = 1024):
        self.n = 0
        self.cols = {"step": np.zeros(capacity, np.int64),
                     **{f: np.zeros(capacity, np.float64 if QUANTITIES[f].tolerance else np.int64)
                        for f in FIELDS}}
        self.tenants: list = []
        self.tenant_index: dict = {}
        self.usage = np.full((capacity, 0), _ABSENT, np.int64)

    def __len__(self) -> int:
        return self.n

    def _grow(self) -> None:
        cap = 2 * max(1, len(self.cols["step"]))
        for k, a in self.cols.items():
            self.cols[k] = np.concatenate([a, np.zeros(cap - len(a), a.dtype)])
        self.usage = np.vstack([self.usage, np.full((cap - len(self.usage), self.usage.shape[1]),
                                                    _ABSENT, np.int64)])

    def append(self, step: int, ledger, usage: dict) -> None:
        if self.n == len(self.cols["step"]):
            self._grow()
        i = self.n
        self.cols["step"][i] = step
        for f in FIELDS:
            v = getattr(ledger, f)
            self.cols[f][i] = _ABSENT if v is None else v
        for t, u in usage.items():
            j = self.tenant_index.get(t)
            if j is None:
                j = self.tenant_index[t] = len(self.tenants)
                self.tenants.append(t)
                self.usage = np.hstack([self.usage, np.full((len(self.usage), 1), _ABSENT, np.int64)])
            self.usage[i, j] = u
        self.n += 1

    def column(self, name: str) -> np.ndarray:
        """One figure over the operations (``blocks_used`` is -1 where the layout has no blocks)."""
        return self.cols[name][:self.n]

    def usage_matrix(self) -> np.ndarray:
        """[operations, tenants] blocks in use (-1: the tenant had no live sequence then)."""
        return self.usage[:self.n]

    def __getitem__(self, i: int) -> dict:
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(f"series row {i} of {self.n}")
        row = {"step": int(self.cols["step"][i])}
        for f in FIELDS:
            v = self.cols[f][i]
            row[f] = float(v) if QUANTITIES[f].tolerance else (None if v == _ABSENT else int(v))
        row["usage"] = {t: int(u) for t, u in zip(self.tenants, self.usage[i].tolist()) if u != _ABSENT}
        return row

    def __iter__(self):
        return (self[i] for i in range(self.n))

    def __bool__(self) -> bool:
        return self.n > 0

    def __eq__(self, other) -> bool:
        return list(self) == list(other)
