"""KV cache sizing, slot writes and block copies."""

from __future__ import annotations

import pytest
import torch

from executor_svc.kv_cache import KVCache, KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32, block_size=4)


def test_sizing_from_byte_budget():
    # 2 (K, V) x 2 layers x 3 heads x 4 dims x 4 bytes = 192 bytes/token, 768 bytes/block.
    assert SPEC.token_bytes == 192
    assert SPEC.block_bytes == 768
    assert SPEC.num_blocks(768 * 10 + 767) == 10
    smol = KVCacheSpec(30, 3, 64, torch.float32, 16)  # the bundled model
    assert smol.num_blocks(1 << 30) == (1 << 30) // (46080 * 16)


@pytest.mark.parametrize("path", ["native", "torch"])  # fp32 CPU: one native call, or torch
def test_write_goes_to_the_planned_slots(path):
    kv = KVCache(SPEC, num_blocks=5)
    if path == "torch":
        kv._native = None
    elif kv._native is None:
        pytest.skip("no native kernels here")
    k = torch.randn(3, 3, 4)
    v = torch.randn(3, 3, 4)
    slots = torch.tensor([4 * 2 + 1, 4 * 4 + 3, 0])  # block 2 offset 1, block 4 offset 3, 0/0
    kv.write(1, k, v, slots)
    torch.testing.assert_close(kv.key_cache(1)[2, 1], k[0])
    torch.testing.assert_close(kv.value_cache(1)[4, 3], v[1])
    torch.testing.assert_close(kv.key_cache(1)[0, 0], k[2])
    assert kv.key_cache(0).abs().sum() == 0  # other layers untouched
    assert float(kv.key_cache(1).abs().sum()) == pytest.approx(float(k.abs().sum()))


def test_write_outside_the_pool_raises_and_writes_nothing():
    kv = KVCache(SPEC, num_blocks=5)
    for bad in ([0, 20], [-1, 3]):  # 5 blocks x 4 = 20 slots
        with pytest.raises(IndexError):
            kv.write(0, torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.tensor(bad))
    assert kv.device_pool.abs().sum() == 0


def test_swap_round_trip_and_copy():
    kv = KVCache(SPEC, num_blocks=6, num_host_blocks=3)
    kv.device_pool.copy_(torch.randn(kv.device_pool.shape))
    original = kv.device_pool.clone()
    kv.swap([4, 1], [0, 2], [], [])
    kv.device_pool.zero_()
    kv.swap([], [], [2, 0], [3, 5])  # block 1 -> host 2 -> device 3; 4 -> host 0 -> device 5
    torch.testing.assert_close(kv.device_pool[:, :, 3], original[:, :, 1])
    torch.testing.assert_close(kv.device_pool[:, :, 5], original[:, :, 4])
    kv.copy([3], [0])
    torch.testing.assert_close(kv.device_pool[:, :, 0], original[:, :, 1])
    assert kv.measure_copy_bytes_per_s() > 0


def test_swap_reads_before_it_writes():
    # Device block 2 goes out while host block 1 comes into it; host block 1 is at the same
    # time the destination of device block 0. Both directions must see the old contents.
    kv = KVCache(SPEC, num_blocks=3, num_host_blocks=2)
    kv.device_pool.copy_(torch.randn(kv.device_pool.shape))
    kv.host_pool.copy_(torch.randn(kv.host_pool.shape))
    device, host = kv.device_pool.clone(), kv.host_pool.clone()
    kv.swap([2, 0], [0, 1], [1], [2])
    torch.testing.assert_close(kv.host_pool[:, :, 0], device[:, :, 2])
    torch.testing.assert_close(kv.host_pool[:, :, 1], device[:, :, 0])
    torch.testing.assert_close(kv.device_pool[:, :, 2], host[:, :, 1])
