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
    iteration); whole columns as arrays (:meth:`column`, :meth:`usage_matrix`).

    Usage is kept sparse, one (tenant, blocks) entry per tenant with a live sequence at each
    operation, so that its cost follows what is live, not every tenant ever seen."""

    def __init__(self, capacity: int = 1024):
        self.n = 0
        self.cols = {"step": np.zeros(capacity, np.int64),
                     **{f: np.zeros(capacity, np.float64 if QUANTITIES[f].tolerance else np.int64)
                        for f in FIELDS}}
        self.tenants: list = []
        self.tenant_index: dict = {}
        self.row_end = np.zeros(capacity, np.int64)  # entries of rows 0..i end at row_end[i]
        self.entry_tenant = np.zeros(capacity, np.int64)
        self.entry_blocks = np.zeros(capacity, np.int64)
        self.entries = 0

    def __len__(self) -> int:
        return self.n

    @staticmethod
    def _grown(a: np.ndarray, need: int) -> np.ndarray:
        if need <= len(a):
            return a
        return np.concatenate([a, np.zeros(max(need, 2 * len(a)) - len(a), a.dtype)])

    def append(self, step: int, ledger, usage: dict) -> None:
        i = self.n
        if i == len(self.cols["step"]):
            self.cols = {k: self._grown(a, i + 1) for k, a in self.cols.items()}
            self.row_end = self._grown(self.row_end, i + 1)
        self.cols["step"][i] = step
        for f in FIELDS:
            v = getattr(ledger, f)
            self.cols[f][i] = _ABSENT if v is None else v
        k = self.entries
        self.entry_tenant = self._grown(self.entry_tenant, k + len(usage))
        self.entry_blocks = self._grown(self.entry_blocks, k + len(usage))
        for t, u in usage.items():
            j = self.tenant_index.get(t)
            if j is None:
                j = self.tenant_index[t] = len(self.tenants)
                self.tenants.append(t)
            self.entry_tenant[k], self.entry_blocks[k] = j, u
            k += 1
        self.entries = self.row_end[i] = k
        self.n += 1

    def column(self, name: str) -> np.ndarray:
        """One figure over the operations (``blocks_used`` is -1 where the layout has no blocks)."""
        return self.cols[name][:self.n]

    def usage_matrix(self) -> np.ndarray:
        """[operations, tenants] blocks in use (-1: the tenant had no live sequence then), dense:
        built on demand."""
        out = np.full((self.n, len(self.tenants)), _ABSENT, np.int64)
        counts = np.diff(np.concatenate([[0], self.row_end[:self.n]]))
        rows = np.repeat(np.arange(self.n), counts)
        out[rows, self.entry_tenant[:self.entries]] = self.entry_blocks[:self.entries]
        return out

    def __getitem__(self, i: int) -> dict:
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(f"series row {i} of {self.n}")
        row = {"step": int(self.cols["step"][i])}
        for f in FIELDS:
            v = self.cols[f][i]
            row[f] = float(v) if QUANTITIES[f].tolerance else (None if v == _ABSENT else int(v))
        lo, hi = (self.row_end[i - 1] if i else 0), self.row_end[i]
        pairs = sorted(zip(self.entry_tenant[lo:hi].tolist(), self.entry_blocks[lo:hi].tolist()))
        row["usage"] = {self.tenants[j]: u for j, u in pairs}  # in the order tenants first came
        return row

    def __iter__(self):
        return (self[i] for i in range(self.n))

    def __bool__(self) -> bool:
        return self.n > 0

    def __eq__(self, other) -> bool:
        return list(self) == list(other)
