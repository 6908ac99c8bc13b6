"""The error contract: bad input raises ValueError/TypeError naming the argument, and changes nothing.

Each test here is a regression test for an input that once escaped as a raw ZeroDivisionError,
RuntimeError, SafetensorError, OSError or AttributeError, or that left a cache or module
half-updated. State tests compare the state before and after bitwise.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab._call import build_call


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
