"""Transformer blocks: decoder causality, encoder padding invariance, cached decoding."""

from __future__ import annotations

import pytest
import torch

from attnlab.nn import TransformerBlock, TransformerDecoder, TransformerEncoder

D, H = 32, 4


def test_decoder_is_causal():
    torch.manual_seed(0)
    dec = TransformerDecoder(2, D, H, num_kv_heads=2, positions="rope").double().eval()
    x = torch.randn(2, 12, D, dtype=torch.float64)
    changed = x.clone()
    changed[:, 7:] = torch.randn(2, 5, D, dtype=torch.float64)
    out, out_changed = dec(x), dec(changed)
    torch.testing.assert_close(out[:, :7], out_changed[:, :7], rtol=0, atol=1e-12)
    assert not torch.allclose(out[:, 7:], out_changed[:, 7:])


def test_encoder_padding_does_not_change_real_outputs():
    torch.manual_seed(1)
    enc = TransformerEncoder(2, D, H, d_ff=64).double().eval()
    x = torch.randn(2, 10, D, dtype=torch.float64)
    real = torch.ones(2, 10, dtype=torch.bool)
    real[1, 6:] = False
    out = enc(x, padding_mask=real)
    noisy = x.clone()
    noisy[1, 6:] = 1e3 * torch.randn(4, D, dtype=torch.float64)
    torch.testing.assert_close(enc(noisy, padding_mask=real)[1, :6], out[1, :6], rtol=0, atol=1e-12)
    # ... and equal the unpadded sequence run on its own.
    torch.testing.assert_close(enc(x[1:2, :6])[0], out[1, :6], rtol=0, atol=1e-12)
    assert not torch.allclose(enc(x)[0], enc(x, padding_mask=real)[1])  # the mask does act


def test_decoder_cross_attention_ignores_padded_memory():
    torch.manual_seed(2)
    dec = TransformerDecoder(2, D, H, cross_attention=True, d_context=20).double().eval()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    context = torch.randn(2, 8, 20, dtype=torch.float64)
    real = torch.ones(2, 8, dtype=torch.bool)
    real[0, 3:] = False
    out = dec(x, context=context, context_padding_mask=real)
    torch.testing.assert_close(dec(x[:1], context=context[:1, :3]), out[:1], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="context"):
        dec(x)


def test_decoder_with_caches_equals_full_pass():
    torch.manual_seed(3)
    dec = TransformerDecoder(2, D, H, num_kv_heads=1, positions="rope").double().eval()
    x = torch.randn(1, 9, D, dtype=torch.float64)
    with torch.no_grad():
        full = dec(x)
        caches = dec.new_cache(1, 9)
        steps = [dec(x[:, :4], caches=caches)] + [dec(x[:, t : t + 1], caches=caches) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-12)


def test_block_is_pre_norm_residual():
    torch.manual_seed(4)
    block = TransformerBlock(D, H, causal=False).double().eval()
    x = torch.randn(2, 6, D, dtype=torch.float64)
    h = x + block.attn(block.norm_attn(x))
    expected = h + block.mlp.fc_out(torch.nn.functional.gelu(block.mlp.fc_in(block.norm_mlp(h))))
    torch.testing.assert_close(block(x), expected, rtol=0, atol=1e-12)
