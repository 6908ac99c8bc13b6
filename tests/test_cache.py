"""KVCache: incremental decoding equals one full causal pass, in place, never reading past length."""

from __future__ import annotations

import pytest
import torch

from attnlab.nn import KVCache, MultiHeadAttention
from attnlab.nn import CallMask, QKV

PREFILL, STEPS = 16, 64


def _module(num_kv_heads, rope, seed=0):
    torch.manual_seed(seed)
    return MultiHeadAttention(32, 32, num_heads=4, positions="rope" if rope else None, qkv=QKV(num_kv_heads=num_kv_heads, bias=True)).double().eval()


def _full_keys_values(module, x):
    """Keys/values a full pass computes for every position (RoPE at positions 0..T-1)."""
    _, k, v = module.project_qkv(x)
    if module.rope is not None:
        k = module.rope(k)
    return k, v


@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_prefill_then_single_steps_equals_full_pass(num_kv_heads, rope):
    module = _module(num_kv_heads, rope)
    x = torch.randn(2, PREFILL + STEPS, 32, dtype=torch.float64)
    with torch.no_grad():
        full = module(x)
        full_k, full_v = _full_keys_values(module, x)
        cache = module.new_cache(2, PREFILL + STEPS)
        cache.keys.fill_(float("nan"))  # a slot read before it is written would poison the output
        cache.values.fill_(float("nan"))
        outputs = [module(x[:, :PREFILL], cache=cache)]
        for t in range(PREFILL, PREFILL + STEPS):
            outputs.append(module(x[:, t : t + 1], cache=cache))
            assert cache.length == t + 1
            torch.testing.assert_close(cache.keys[:, :, : t + 1], full_k[:, :, : t + 1], rtol=0, atol=1e-12)
            torch.testing.assert_close(cache.values[:, :, : t + 1], full_v[:, :, : t + 1], rtol=0, atol=1e-12)
    incremental = torch.cat(outputs, dim=1)
    assert torch.isfinite(incremental).all()
    torch.testing.assert_close(incremental, full, rtol=0, atol=1e-12)


def test_chunked_prefill_with_fp32_and_padding():
    torch.manual_seed(1)
    module = MultiHeadAttention(16, 16, num_heads=2, positions="rope").eval()
    x = torch.randn(2, 12, 16)
    real = torch.ones(2, 12, dtype=torch.bool)
    real[1, :3] = False  # left padding in row 1
    with torch.no_grad():
        full = module(x, mask=CallMask(padding=real))
        cache = module.new_cache(2, 12)
        first = module(x[:, :5], cache=cache, mask=CallMask(padding=real[:, :5]))
        second = module(x[:, 5:], cache=cache, mask=CallMask(padding=real))
    torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-5, atol=1e-6)


def test_overflow_raises_and_writes_nothing():
    module = _module(2, True)
    cache = module.new_cache(1, 5)
    with torch.no_grad():
        module(torch.randn(1, 4, 32, dtype=torch.float64), cache=cache)
        keys_before = cache.keys.clone()
        with pytest.raises(ValueError, match="overflow.*max_len=5"):
            module(torch.randn(1, 2, 32, dtype=torch.float64), cache=cache)
    assert cache.length == 4 and torch.equal(cache.keys, keys_before)


def test_cache_mismatch_and_cross_attention_are_rejected():
    module = _module(2, False)
    with pytest.raises(ValueError, match="cache holds batch 1"):
        module(torch.randn(2, 1, 32, dtype=torch.float64), cache=module.new_cache(1, 4))
    with pytest.raises(ValueError, match="kv heads"):
        module(torch.randn(1, 1, 32, dtype=torch.float64),
               cache=KVCache(1, 4, 4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="self-attention"):
        module(torch.randn(1, 1, 32, dtype=torch.float64), context=torch.randn(1, 3, 32, dtype=torch.float64),
               cache=module.new_cache(1, 4))


def test_update_returns_filled_views_in_place():
    cache = KVCache(2, 3, 6, 4, value_dim=5)
    k, v = cache.update(torch.ones(2, 3, 2, 4), torch.full((2, 3, 2, 5), 2.0))
    assert k.shape == (2, 3, 2, 4) and v.shape == (2, 3, 2, 5)
    assert k.data_ptr() == cache.keys.data_ptr()  # a view of the preallocated buffer, no copy
    assert cache.keys[:, :, 2:].eq(0).all()
    with pytest.raises(ValueError, match="k_new/v_new"):
        cache.update(torch.ones(2, 3, 1, 5), torch.ones(2, 3, 1, 5))
