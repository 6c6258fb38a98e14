"""SGLang's MLA and Mamba pools on a CPU against SPEC §12's formulas (opt-in: run with
/work/sglang-env/bin/python -m pytest tests/engines/test_sglang_pools.py). Their bytes per token and per
state are kvbench's; the Mamba pool zeroes a slot it clears and copies one as a fork does. No
adapter drives them through the checker yet (the radix adapter runs one full group)."""
from __future__ import annotations

import pytest

from kvbench.contract.formulas import get_model

SKIP_REASON = "SGLang is not installed (opt-in, not in CI): see docs/engines.md for its recipe"


@pytest.fixture(scope="module")
def torch():
    import importlib.util
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(SKIP_REASON)
    from impls.engines.sglang_radix import _torchvision_importable
    _torchvision_importable()  # before sglang imports torchvision on a CPU torch
    import torch
    return torch


def test_the_mla_pool_stores_one_latent_per_token_per_layer(torch):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    pool = MLATokenToKVPool(size=64, page_size=16, dtype=torch.bfloat16, kv_lora_rank=512,
                            qk_rope_head_dim=64, layer_num=2, device="cpu", enable_memory_saver=False)
    # 64 slots + one page of padding, one latent of 512 + 64 = 576 per token per layer
    assert [tuple(b.shape) for b in pool.kv_buffer] == [(80, 1, 576)] * 2
    per_layer = pool.kv_buffer[0][0].numel() * pool.kv_buffer[0].element_size()
    assert per_layer == 1152 == get_model("deepseek-v3").bytes_per_token // 61  # 70,272 / 61 layers


def _qwen3_next_state(torch, dtype=None):
    """Qwen3-Next's Gated DeltaNet layer as SGLang shapes it: conv (8192, 3), temporal (32, 128,
    128) (config: 16 key heads, 32 value heads of 128, conv kernel 4)."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=32 * 128, n_groups=16,
                                    num_heads=32, head_dim=128, state_size=128, conv_kernel=4)
    if dtype is None:
        return Mamba2CacheParams(shape=shape, layers=[0])
    return Mamba2CacheParams(shape=shape, layers=[0], dtype=Mamba2StateDType(conv=dtype, temporal=dtype))


def test_the_mamba_pools_state_is_the_presets_at_vllms_dtype_and_twice_that_at_sglangs(torch):
    state = get_model("qwen3-next-80b-a3b").kv_groups[0].state_bytes
    # bf16: (8192 * 3 + 32 * 128 * 128) * 2 = 1,097,728, the preset's (vLLM's default dtype)
    assert _qwen3_next_state(torch, torch.bfloat16).mamba_cache_per_req == state == 1_097_728
    # SGLang's default keeps the temporal state in float32: 8192 * 3 * 2 + 524,288 * 4
    assert _qwen3_next_state(torch).mamba_cache_per_req == 2_146_304


def test_the_mamba_pool_clears_a_slot_to_zeros_and_copies_one_for_a_fork(torch):
    from sglang.srt.mem_cache.memory_pool import MambaPool
    pool = MambaPool(size=4, spec_state_size=0, cache_params=_qwen3_next_state(torch, torch.bfloat16),
                     mamba_layer_ids=[0], device="cpu")
    cache = pool.mamba_cache
    # 4 slots + 1: per slot one layer's conv and temporal state
    assert [tuple(c.shape) for c in cache.conv] == [(1, 5, 8192, 3)]
    assert tuple(cache.temporal.shape) == (1, 5, 32, 128, 128)
    cache.temporal[:, 1] = 7
    cache.conv[0][:, 1] = 3
    pool.copy_from(torch.tensor([1]), torch.tensor([2]))  # a fork: the child's own copy
    assert torch.equal(cache.temporal[:, 2], cache.temporal[:, 1])
    assert torch.equal(cache.conv[0][:, 2], cache.conv[0][:, 1])
    pool.clear_slots(torch.tensor([1]))  # a slot handed to a new request: a fresh state
    assert not cache.temporal[:, 1].any() and not cache.conv[0][:, 1].any()
    assert cache.temporal[:, 2].eq(7).all()


def test_the_hicache_host_pool_pages_on_a_cpu_but_its_copies_need_cuda(torch):
    # SGLang HiCache's host pool (pool_host/mha.py): built from a CPU device pool, its page
    # allocator runs; its copies call sgl_kernel.kvcacheio's transfer_kv_* kernels, imported only
    # `if _is_cuda or _is_hip` (pool_host/mha.py:60), so on a CPU they are unbound names.
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    device = MHATokenToKVPool(size=64, page_size=16, dtype=torch.float16, head_num=2, head_dim=8,
                              layer_num=2, device="cpu", enable_memory_saver=False)
    host = MHATokenToKVPoolHost(device._mha_buffer_info(), 2.0, 0, 16, "layer_first", pin_memory=False,
                                device="cpu", device_capacity_tokens=64, start_layer=0, end_layer=2)
    # 64 device tokens * ratio 2 = 128, one page of padding more: 9 pages of 16
    assert (host.size, host.page_num, host.available_size()) == (144, 9, 144)
    pages = host.alloc(32)
    assert pages.tolist() == list(range(32)) and host.available_size() == 144 - 32
    for io in ("kernel", "direct"):
        with pytest.raises(NameError, match="transfer_kv_"):
            host.backup_from_device_all_layer(device, pages, torch.arange(16, 48), io)
