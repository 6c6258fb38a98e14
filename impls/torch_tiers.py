"""Lower tiers for the torch paged pool (SPEC §11): a host tier of CPU tensors (pinned when the pool
is on CUDA, so that copies to and from the device are DMA transfers; else in NumPy's memory), and a disk tier (any tier
whose name starts with "disk") of real files, memory-mapped (np.memmap) and viewed as tensors.
The tier operations are impls/pool_tiers.py's; this module gives them tensors and copies.
"""
from __future__ import annotations

import numpy as np

from impls.numpy_tiers import PAGE, copy_rows, tier_arrays
from impls.pool_tiers import PoolTiers, run_count, slot_runs
from impls.prefix_keys import hit_plan, tagged_extra
from kvbench.contract import formulas as F


def copy_tensor_rows(src, rows, dst, into) -> None:
    """dst[into] = src[rows] for tensors. On the CPU through NumPy views of the same memory
    (numpy_tiers.copy_rows: torch's index_copy_ scatters at about half a plain copy's speed
    here, NumPy's fancy assignment at about a copy's). Across devices (the pool on CUDA, a
    tier on the CPU) a run of consecutive ``into`` rows (a store into a tier's free slots) is
    one gather on the pool's device and one copy across, else a run of consecutive ``rows`` is
    one copy across and one scatter on the pool's device."""
    if src.device.type == dst.device.type == "cpu":
        copy_rows(_bytes(src), rows, _bytes(dst), into)
        return
    torch_ = _torch()
    rows, into = np.asarray(rows, dtype=np.int64), np.asarray(into, dtype=np.int64)
    if 2 * run_count(into) <= len(into):
        index = torch_.from_numpy(rows).to(src.device)
        for a, b in slot_runs(into):
            j = int(into[a])
            dst[j:j + b - a].copy_(src.index_select(0, index[a:b]))
        return
    index = torch_.from_numpy(into).to(dst.device)
    for a, b in slot_runs(rows):
        i = int(rows[a])
        dst.index_copy_(0, index[a:b], src[i:i + b - a].to(dst.device))


def _bytes(tensor) -> np.ndarray:
    """A CPU tensor's memory as a NumPy array of bytes, [rows, bytes of a row] (bfloat16 has no
    NumPy dtype: the bytes do)."""
    if not tensor.is_contiguous():
        raise ValueError(f"tier copies need contiguous tensors, got strides {tensor.stride()}")
    return tensor.view(len(tensor), -1).view(_torch().uint8).numpy()


def _torch():
    import torch
    return torch


def torch_tier_arrays(spec, storage, folder) -> list:
    """A tier's slots, one tensor per pool storage tensor: a memory-mapped file in ``folder``
    (numpy's, viewed as a tensor) for a disk tier, else a CPU tensor, pinned when the pool is on
    CUDA."""
    torch = _torch()
    if spec.name.startswith("disk") and spec.capacity:
        like = [np.empty((0,) + tuple(a.shape[1:]), dtype=_numpy_dtype(a)) for a in storage]
        offsets = [a.data_ptr() % PAGE for a in storage]
        return [torch.from_numpy(m) for m in tier_arrays(spec, like, folder, offsets)]
    if any(a.device.type == "cuda" for a in storage):
        return [torch.zeros((spec.capacity,) + tuple(a.shape[1:]), dtype=a.dtype, pin_memory=True)
                for a in storage]
    return [_numpy_backed((spec.capacity,) + tuple(a.shape[1:]), a.dtype) for a in storage]


def _numpy_backed(shape, dtype):
    """A zeroed CPU tensor in memory NumPy allocates: NumPy asks for transparent huge pages for
    large arrays and torch's CPU allocator does not (unless THP_MEM_ALLOC_ENABLE=1), and a copy
    into 4 KiB pages took 8-11% longer here (a store of 32 MiB, 256 KiB to 1 MiB blocks). Bytes,
    viewed as ``dtype``: bfloat16 has no NumPy dtype."""
    torch = _torch()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if not np.prod(shape):  # a tier of no capacity: no bytes to view
        return torch.zeros(shape, dtype=dtype)
    raw = np.zeros(int(np.prod(shape)) * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def _numpy_dtype(tensor) -> np.dtype:
    return _torch().empty(0, dtype=tensor.dtype).numpy().dtype


class TorchTiers(PoolTiers):
    """The tier operations of a torch pool (a mixin of TorchPaged): PoolTiers' tensor hooks."""

    _copy_rows = staticmethod(copy_tensor_rows)

    def _storage(self) -> list:
        return [self.pool]

    def _tier_arrays(self, spec, storage) -> list:
        return torch_tier_arrays(spec, storage, self._tier_folder)

    def _lease(self, blocks) -> None:
        t = self._dev(blocks)
        self.refcount.index_add_(0, t, self.torch.ones_like(t))

    def _end_lease(self, blocks) -> None:
        self._release_blocks(self._dev(blocks))

    def _tokens_of(self, r) -> int:
        return int(self.tokens_host[r])

    def _row_blocks_at(self, r, lo, hi) -> np.ndarray:
        return self.tables[0][r, lo:hi].cpu().numpy()

    def _rewrite_block(self, block, kv) -> None:
        slots = self._dev(block * self.B + np.arange(self.B))
        self._flat_pool().index_copy_(0, slots, self._kv(kv, self.B))

    def _slot_kv(self, t, s) -> np.ndarray:
        return t.arrays[0][s].cpu().numpy().reshape((self.B,) + self.kv_shape)

    def _extra_keys(self, salt, adapter) -> bytes:
        return tagged_extra(salt, adapter)

    def _hit_plan(self, keys) -> tuple:
        return hit_plan(keys, self.by_hash, self.groups, self.B)

    def block_bytes(self) -> int:
        return F.block_bytes(self.B, self.config.model)

