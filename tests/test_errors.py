"""The error contract: bad input raises ValueError/TypeError naming the argument, and changes nothing.

Each test here is a regression test for an input that once escaped as a raw ZeroDivisionError,
RuntimeError, SafetensorError, OSError or AttributeError, or that left a cache or module
half-updated. State tests compare the state before and after bitwise.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab._call import build_call
from attnlab.nn import RotaryEmbedding, positional


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
        (lambda: masks.materialize(masks.CausalMod(), tq=-1, tk=2), "tq must be a non-negative int"),
        (lambda: masks.materialize(masks.CausalMod(), tq=2, tk=2, heads=-1), "heads must be"),
        (lambda: masks.padding_mask(torch.tensor([-1, 2])), r"lengths must be non-negative, got \[-1, 2\]"),
        (lambda: masks.padding_mask(torch.tensor([1, 2]), 1.5), "max_len must be a non-negative int"),
        (lambda: masks.padding_mask(torch.tensor([1, 2]), -1), "max_len must be a non-negative int"),
    ],
    ids=["causal_neg", "causal_float", "causal_tk_neg", "causal_tk_float", "sliding_neg",
         "window0", "causal_mod_float", "CausalMod_float", "SlidingWindowMod_float",
         "materialize_neg", "materialize_heads", "padding_neg_length", "padding_float_max_len",
         "padding_neg_max_len"],
)
def test_mask_constructors_refuse_bad_sizes(build, pattern):
    with pytest.raises(ValueError, match=pattern):
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
