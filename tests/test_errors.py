"""The error contract: bad input raises ValueError/TypeError naming the argument, and changes nothing.

Each test here is a regression test for an input that once escaped as a raw ZeroDivisionError,
RuntimeError, SafetensorError, OSError or AttributeError, or that left a cache or module
half-updated. State tests compare the state before and after bitwise.
"""

from __future__ import annotations

import re

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab._call import build_call
from attnlab.nn import (
    FeedForward,
    KVCache,
    MultiHeadAttention,
    RotaryEmbedding,
    TransformerBlock,
    TransformerDecoder,
    TransformerEncoder,
    positional,
)
from attnlab.nn import CallMask, QKV


def _qkv(q_shape, k_shape=None, v_shape=None):
    k_shape = q_shape if k_shape is None else k_shape
    v_shape = k_shape if v_shape is None else v_shape
    return torch.randn(*q_shape), torch.randn(*k_shape), torch.randn(*v_shape)


# --------------------------------------------------------------- attention: sizes of zero
@pytest.mark.parametrize(
    "shapes, pattern",
    [
        (((1, 2, 3, 0), (1, 2, 3, 0), (1, 2, 3, 4)), r"head dim D >= 1.*q \(1, 2, 3, 0\)"),
        (((3, 0), (3, 0), (3, 4)), r"head dim D >= 1.*q \(3, 0\)"),
        (((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 0)), r"value dim Dv >= 1.*v \(1, 2, 3, 0\)"),
        (((1, 2, 3, 4), (1, 0, 3, 4), (1, 0, 3, 4)), r"at least one head.*k \(1, 0, 3, 4\)"),
        (((1, 0, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4)), r"at least one head.*q \(1, 0, 3, 4\)"),
        (((1, 0, 3, 4), (1, 0, 3, 4), (1, 0, 3, 4)), r"at least one head"),
    ],
    ids=["D0", "D0_2d", "Dv0", "Hkv0", "Hq0", "H0"],
)
def test_zero_head_dim_or_heads_is_a_value_error(shapes, pattern):
    q, k, v = _qkv(*shapes)
    with pytest.raises(ValueError, match=pattern):
        attnlab.attention(q, k, v)
    with pytest.raises(ValueError, match=pattern):
        build_call(q, k, v)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "chunked"])
@pytest.mark.parametrize("rank", [3, 4])
def test_empty_batch_is_legal_and_gives_an_empty_output(backend, rank):
    shape = (0, 3, 4) if rank == 3 else (0, 2, 3, 4)
    q, k, v = _qkv(shape, v_shape=shape[:-1] + (5,))
    out = attnlab.attention(q, k, v, causal=True, backend=backend)
    assert out.shape == shape[:-1] + (5,)


# ----------------------------------------------------------------------------- generator
@pytest.mark.parametrize("generator", [3, "seed", torch.tensor(3)], ids=["int", "str", "tensor"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.5])
def test_generator_that_is_not_a_generator_is_a_type_error(generator, dropout_p):
    q, k, v = _qkv((1, 2, 3, 4))
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        attnlab.attention(q, k, v, dropout_p=dropout_p, generator=generator)


class _CudaLookingGenerator(torch.Generator):
    """A CPU generator that reports a CUDA device: a wrong-device generator on any machine."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_generator_on_another_device_type_is_a_value_error():
    q, k, v = _qkv((1, 2, 3, 4))
    with pytest.raises(ValueError, match="generator must be on q's device type 'cpu'.*cuda:0"):
        attnlab.attention(q, k, v, dropout_p=0.5, generator=_CudaLookingGenerator())


# ------------------------------------------------------------------------------- masks
@pytest.mark.parametrize(
    "build, pattern",
    [
        (lambda: masks.causal_mask(-1), "tq must be a non-negative int, got -1"),
        (lambda: masks.causal_mask(2.5), "tq must be a non-negative int, got 2.5"),
        (lambda: masks.causal_mask(3, -1), "tk must be a non-negative int, got -1"),
        (lambda: masks.causal_mask(3, 2.0), "tk must be a non-negative int, got 2.0"),
        (lambda: masks.sliding_window_mask(-1, 3, 2), "tq must be a non-negative int, got -1"),
        (lambda: masks.sliding_window_mask(3, 3, 0), "window must be a positive int, got 0"),
        (lambda: masks.causal_mod(1.5, 2), "tq must be a non-negative int, got 1.5"),
        (lambda: masks.CausalMod(1.5), "offset must be an int, got 1.5"),
        (lambda: masks.SlidingWindowMod(2, offset=0.5), "offset must be an int, got 0.5"),
        (lambda: masks.materialize(masks.causal_mod(2, 2), tq=-1, tk=2), "tq must be a non-negative int"),
        (lambda: masks.materialize(masks.causal_mod(2, 2), tq=2, tk=2, heads=-1), "heads must be"),
        (lambda: masks.padding_mask(torch.tensor([-1, 2])), r"lengths must be non-negative, got \[-1, 2\]"),
        (lambda: masks.padding_mask(torch.tensor([1, 2]), 1.5), "max_len must be a non-negative int, got 1.5"),
        (lambda: masks.padding_mask(torch.tensor([1, 2]), -1), "max_len must be a non-negative int"),
    ],
    ids=["causal_neg", "causal_float", "causal_tk_neg", "causal_tk_float", "sliding_neg",
         "window0", "causal_mod_float", "CausalMod_float", "SlidingWindowMod_float",
         "materialize_neg", "materialize_heads", "padding_neg_length", "padding_float_max_len",
         "padding_neg_max_len"],
)
def test_mask_constructors_refuse_bad_sizes(build, pattern):
    # A size of the wrong kind (2.5) is a TypeError, a negative one a ValueError; both name it.
    error = TypeError if re.search(r"got -?\d+\.\d", pattern) else ValueError
    with pytest.raises(error, match=pattern):
        build()


def test_padding_mask_of_empty_lengths_names_it_and_the_shape():
    with pytest.raises(ValueError, match=r"padding_mask.*empty lengths of shape \(0,\).*max_len"):
        masks.padding_mask(torch.zeros(0, dtype=torch.long))
    # With max_len an empty batch has an empty mask, as attention with B=0 is legal.
    assert masks.padding_mask(torch.zeros(0, dtype=torch.long), 3).shape == (0, 1, 1, 3)


def test_zero_size_masks_are_legal_like_empty_sequences():
    assert masks.causal_mask(0).shape == (0, 0)
    assert masks.causal_mask(0, 3, align="bottom_right").shape == (0, 3)


# -------------------------------------------------------------------- positional encodings
@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: RotaryEmbedding(4)(torch.randn(1, 1, 2, 4), offset=1.5), "offset must be a non-negative int, got 1.5"),
        (lambda: RotaryEmbedding(4)(torch.randn(1, 1, 2, 4), offset=-1), "offset must be a non-negative int, got -1"),
        (lambda: RotaryEmbedding(4).cos_sin(2, offset=0.5), "offset must be a non-negative int"),
        (lambda: RotaryEmbedding(4).cos_sin(-1), "num_positions must be a non-negative int, got -1"),
        (lambda: RotaryEmbedding(4, base=0), "base must be a positive finite number, got 0"),
        (lambda: RotaryEmbedding(4)([1.0] * 4), "x must be a torch.Tensor, got list"),
        (lambda: positional.sinusoidal_table(-1, 4), "num_positions must be a non-negative int"),
        (lambda: positional.sinusoidal_table(2, 4, offset=1.5), "offset must be a non-negative int"),
        (lambda: positional.SinusoidalPositionalEmbedding(4)(torch.zeros(2, 4), offset=-1), "offset must be"),
        (lambda: positional.LearnedPositionalEmbedding(8, 4)(torch.zeros(2, 4), offset=1.5), "offset must be"),
        (lambda: positional.apply_rotary(torch.zeros(2, 3), torch.zeros(2, 1), torch.zeros(2, 1)), "D even"),
        (lambda: positional.alibi_bias(2, -1), "tq must be a non-negative int, got -1"),
    ],
    ids=["rope_float", "rope_negative", "cos_sin_offset", "cos_sin_positions", "rope_base",
         "rope_list", "table_negative", "table_offset", "sinusoidal_offset", "learned_offset",
         "apply_rotary_odd", "alibi_negative"],
)
def test_positional_encodings_refuse_bad_positions(call, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        call()


# ------------------------------------------------------------- KV caches survive errors
def _state(cache):
    return cache.keys.clone(), cache.values.clone(), cache.length


def _assert_unchanged(cache, before):
    keys, values, length = before
    assert cache.length == length
    assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)


def _filled_cache(module, batch=1, max_len=8, prefill=3):
    """A cache after a prefill, with random bits in the free slots so any write shows."""
    torch.manual_seed(0)
    cache = module.new_cache(batch, max_len)
    with torch.no_grad():
        module(torch.randn(batch, prefill, module.d_in), cache=cache)
    cache.keys[:, :, prefill:] = torch.randn_like(cache.keys[:, :, prefill:])
    cache.values[:, :, prefill:] = torch.randn_like(cache.values[:, :, prefill:])
    return cache


@pytest.mark.parametrize(
    "k_new, v_new, error, pattern",
    [
        (torch.ones(1, 2, 6, 4), torch.ones(1, 2, 6, 4), ValueError, "overflow"),
        (torch.ones(1, 2, 1, 4, dtype=torch.float64), torch.ones(1, 2, 1, 4, dtype=torch.float64),
         TypeError, "k_new has dtype torch.float64 but the cache holds torch.float32"),
        (torch.ones(1, 2, 1, 4, dtype=torch.long), torch.ones(1, 2, 1, 4), TypeError, "k_new has dtype"),
        (torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4, device="meta"), ValueError, "v_new is on meta"),
        ({"k": 1}, torch.ones(1, 2, 1, 4), TypeError, "k_new must be a torch.Tensor, got dict"),
        (torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 5), ValueError, r"v_new \(1, 2, 1, 5\)"),
    ],
    ids=["overflow", "float64", "int", "device", "dict", "shape"],
)
def test_failed_cache_update_leaves_the_cache_unchanged(k_new, v_new, error, pattern):
    cache = KVCache(1, 2, 8, 4)
    cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    cache.keys[:, :, 3:] = torch.randn(1, 2, 5, 4)
    before = _state(cache)
    with pytest.raises(error, match=pattern):
        cache.update(k_new, v_new)
    _assert_unchanged(cache, before)


def _raising_mod(b, h, q_idx, kv_idx):
    raise RuntimeError("mask mod failed inside attention")


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda m, c: m(torch.randn(1, 6, 8), cache=c), ValueError, "overflow"),
        (lambda m, c: m(torch.randn(1, 3, 8), cache=c), ValueError, "exceed context_length=5"),
        (lambda m, c: m(torch.randn(1, 1, 8), cache=c, mask=CallMask(padding=torch.zeros(0, dtype=torch.bool))),
         ValueError, r"padding must be \(B, Tk\) = \(1, 4\), got \(0,\)"),
        (lambda m, c: m(torch.randn(1, 1, 8), cache=c, mask=torch.ones(3, 3, dtype=torch.bool)),
         ValueError, r"mask of shape \(3, 3\)"),
        (lambda m, c: m(torch.randn(1, 1, 8), cache=c, mask=_raising_mod), RuntimeError, "mask mod failed"),
        (lambda m, c: m(torch.randn(1, 1, 8, dtype=torch.float64), cache=c), TypeError, "x has dtype"),
        (lambda m, c: m(torch.randn(2, 1, 8), cache=c), ValueError, "cache holds batch 1"),
    ],
    ids=["overflow", "context_length", "empty_padding_mask", "bad_mask", "attention_fails",
         "dtype", "batch"],
)
def test_failed_module_call_leaves_the_cache_unchanged(call, error, pattern):
    module = MultiHeadAttention(8, 8, context_length=5, num_heads=2, positions="rope").eval()
    cache = _filled_cache(module, max_len=8, prefill=3)
    before = _state(cache)
    with torch.no_grad(), pytest.raises(error, match=pattern):
        call(module, cache)
    _assert_unchanged(cache, before)


def test_cache_of_the_wrong_dtype_or_kind_is_refused_before_writing():
    module = MultiHeadAttention(8, 8, num_heads=2).eval()
    cache = module.new_cache(1, 8, dtype=torch.float64)
    before = _state(cache)
    with torch.no_grad(), pytest.raises(TypeError, match="k_new has dtype torch.float32.*float64"):
        module(torch.randn(1, 2, 8), cache=cache)
    _assert_unchanged(cache, before)
    with pytest.raises(TypeError, match="cache must be a KVCache.*got dict"):
        module(torch.randn(1, 2, 8), cache={})


def test_block_whose_cross_attention_fails_puts_its_cache_back():
    block = TransformerBlock(8, 2, cross_attention=True).eval()
    cache = block.attn.new_cache(1, 8)
    before = _state(cache)
    with torch.no_grad(), pytest.raises(ValueError, match="context"):
        block(torch.randn(1, 2, 8), context=torch.randn(1, 3, 5), cache=cache)  # context too narrow
    _assert_unchanged(cache, before)


def test_decoder_whose_later_layer_fails_puts_every_cache_back():
    decoder = TransformerDecoder(2, 8, 2).eval()
    caches = [decoder.layers[0].attn.new_cache(1, 8), decoder.layers[1].attn.new_cache(1, 2)]
    before = [_state(cache) for cache in caches]
    with torch.no_grad(), pytest.raises(ValueError, match="overflow"):
        decoder(torch.randn(1, 3, 8), caches=caches)  # layer 0 fits, layer 1 overflows
    for cache, state in zip(caches, before):
        _assert_unchanged(cache, state)
    with pytest.raises(TypeError, match="caches must be a list"):
        decoder(torch.randn(1, 3, 8), caches=caches[0])


# ---------------------------------------------------------------- module construction
@pytest.mark.parametrize(
    "build, error, pattern",
    [
        (lambda: MultiHeadAttention(8, 8, num_heads=0), ValueError, "num_heads must be a positive int"),
        (lambda: MultiHeadAttention(8, 8, num_heads=3), ValueError, r"d_out \(8\) must be a multiple of num_heads \(3\)"),
        (lambda: MultiHeadAttention(8, 8, dropout_p=1.5), ValueError, r"dropout_p must be in \[0, 1\)"),
        (lambda: MultiHeadAttention(8, 8, pattern="yes"), ValueError, "pattern must be 'causal', None"),
        (lambda: KVCache(1, 1, -1, 4), ValueError, "max_len must be a positive int, got -1"),
        (lambda: KVCache(1, 1, 4, 4, value_dim=-1), ValueError, "value_dim must be a non-negative int"),
        (lambda: KVCache(1, 1, 4, 4, dtype=torch.long), TypeError, "dtype must be a floating-point"),
        (lambda: FeedForward(8, d_ff=-1), ValueError, "d_ff must be a positive int"),
        (lambda: TransformerDecoder(0, 8, 2), ValueError, "num_layers must be a positive int"),
    ],
    ids=["heads0", "not_divisible", "dropout", "causal", "cache_max_len", "cache_value_dim",
         "cache_dtype", "ffn_d_ff", "num_layers"],
)
def test_module_constructors_refuse_bad_arguments(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda m: m([[1.0] * 8]), TypeError, "x must be a torch.Tensor, got list"),
        (lambda m: m(torch.ones(1, 2, 8, dtype=torch.long)), TypeError, "x must have a floating-point dtype"),
        (lambda m: m(torch.randn(1, 2, 8, dtype=torch.float64)), TypeError, "x has dtype torch.float64"),
        (lambda m: m(torch.randn(1, 2, 8), context=3), TypeError, "context must be a torch.Tensor"),
        (lambda m: m(torch.randn(2, 8), mask=CallMask(padding=[True, False])), TypeError, r"padding \(CallMask\(padding=...\)\) must be a bool tensor"),
        (lambda m: m(torch.randn(2, 3, 8), mask=CallMask(padding=torch.zeros(0, dtype=torch.bool))),
         ValueError, r"padding must be \(B, Tk\) = \(2, 3\), got \(0,\)"),
    ],
    ids=["list", "int_dtype", "float64", "context_int", "padding_list", "padding_empty"],
)
def test_module_calls_refuse_bad_inputs(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call(MultiHeadAttention(8, 8, num_heads=2))


# ------------------------------------------------------- other raw errors in these layers
@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda: attnlab.attention(*_qkv((2, 2, 3, 4)), mask=masks.padding_mod(torch.tensor([3]))),
         ValueError, "mask: PaddingMod has 1 lengths but the batch has 2 rows"),
        (lambda: attnlab.attention(*_qkv((2, 3, 4)),
                                   mask=masks.causal_mod(3, 3) & masks.padding_mod(torch.tensor([3]))),
         ValueError, "mask: PaddingMod has 1 lengths"),
        (lambda: masks.and_masks(masks.causal_mask(2), masks.causal_mask(3)), ValueError,
         r"must broadcast together; got shapes \(2, 2\), \(3, 3\)"),
        (lambda: masks.padding_mask("ab"), TypeError, "lengths must be a 1-D integer tensor, got 'ab'"),
        (lambda: masks.materialize(3, tq=2, tk=2), TypeError, "mod must be a mask mod"),
        (lambda: MultiHeadAttention(8, 8, num_heads=2, qkv=QKV(kdim=4, vdim=5))(
            torch.randn(2, 3, 8), context=torch.randn(2, 3, 4), value_input=torch.randn(2, 3, 4)),
         ValueError, r"value_input must be \(B, Tk, vdim\) = \(2, 3, 5\)"),
        (lambda: MultiHeadAttention(8, 8, num_heads=2)(
            torch.randn(2, 3, 8), mask=CallMask(torch.ones(2, 2, dtype=torch.bool),
                                                padding=torch.ones(2, 3, dtype=torch.bool))),
         ValueError, r"mask of shape \(2, 2\) does not broadcast with the padding"),
        (lambda: KVCache(1, 1, 4, 4, device="nope"), ValueError, "device must name a torch device, got 'nope'"),
        (lambda: TransformerEncoder(1, 8, 2)(torch.randn(1, 2, 7)), ValueError, r"x must be \(B, T, 8\)"),
        (lambda: TransformerBlock(8, 2, norm_eps=-1), ValueError, "norm_eps must be a positive"),
    ],
    ids=["padding_mod_batch", "combined_padding_mod", "and_masks_shapes", "padding_mask_str",
         "materialize_int", "value_input_width", "mask_with_padding", "cache_device",
         "encoder_width", "norm_eps"],
)
def test_other_raw_errors_name_their_argument(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize("options, error, pattern", [
    ({"scale": "0.5"}, TypeError, "scale must be a finite number, got '0.5'"),
    ({"scale": float("nan")}, ValueError, "scale must be a finite number, got nan"),
    ({"align": 1}, TypeError, "align must be one of"),
    ({"align": "left"}, ValueError, "align must be one of"),
])
def test_a_wrong_kind_is_a_type_error_and_a_bad_value_a_value_error(options, error, pattern):
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(error, match=pattern):
        attnlab.attention(q, q, q, causal=True, **options)


@pytest.mark.parametrize("build", [
    lambda: masks.sliding_window_mod(5, 5, 2**64),
    lambda: masks.prefix_lm_mod(5, 5, 2**64),
    lambda: masks.chunked_local_mod(5, 5, 2**64),
    lambda: masks.CausalMod(-(2**64)),
    lambda: masks.varlen_causal_mod(torch.tensor([5]), torch.tensor([5]), window=2**64),
    lambda: masks.sliding_window_mask(5, 5, 2**64),
], ids=["window", "prefix", "chunk", "offset", "varlen_window", "window_mask"])
def test_sizes_past_int64_index_arithmetic_are_refused_by_name(build):
    """They passed the checks and then raised OverflowError inside attention (or, near 2**63,
    would wrap around in int64 index arithmetic)."""
    q = torch.randn(1, 1, 5, 4)
    with pytest.raises(ValueError, match=r"must be at most 2\*\*62 in magnitude"):
        mask = build()
        attnlab.attention(q, q, q, mask=mask)
