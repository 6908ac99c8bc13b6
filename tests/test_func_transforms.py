"""torch.func and torch.export on attnlab, as they work on ``F.scaled_dot_product_attention``.

Every backend with a backward pass on CPU (reference, sdpa, chunked, blocks) is taken through
``torch.func.vmap`` over an extra leading dim, ``torch.func.grad``, ``vmap`` of ``grad``
(per-sample gradients) and ``torch.autograd.gradcheck(check_batched_grad=True)`` (fast mode:
the gradients themselves are checked against the oracle), unmasked, causal, with a bool mask,
a mask mod and a plain-function mod, where the backend serves them. The oracle is PyTorch's
own ``F.scaled_dot_product_attention`` in fp64, on the whole stacked batch, without any
transform. The backend-level tests call a backend's kernel on a validated call (``chunked`` and
``blocks`` with tiny tiles, so that every path crosses several tiles); the ``attnlab.attention``
tests go through dispatch, and ``torch.export`` traces it with a dynamic sequence length.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

import attnlab
from attnlab import masks
from attnlab.backends import available, build_call, get, reasons
from attnlab.backends.blocks import blocks_attention
from attnlab.backends.chunked import chunked_attention

B, H, T, D, DV = 2, 2, 5, 3, 4  # Dv != D: blocks pads to one width, forward and backward
N = 3  # the vmapped dim

KERNELS = {
    "reference": lambda call: get("reference").forward(call).out,
    "sdpa": lambda call: get("sdpa").forward(call).out,
    "chunked": lambda call: chunked_attention(call, q_block=2, kv_block=3).out,
    "blocks": lambda call: blocks_attention(call, block=2).out,
}


def _bool_mask() -> torch.Tensor:
    allowed = torch.rand(T, T, generator=torch.Generator().manual_seed(1)) > 0.4
    allowed[1] = False  # a query with nothing to attend: a zero row
    return allowed


# The padding lengths leave batch row 1's last queries with no key in their window: zero rows,
# and a mod whose value depends on b (a vmapped slice must keep its own b).
MASKS = {
    "none": {},
    "causal": {"causal": True},
    "bool": {"mask": _bool_mask()},
    "mod": {"mask": masks.and_masks(masks.sliding_window_mod(T, T, 2),
                                    masks.padding_mod(torch.tensor([5, 3])))},
    "function": {"mask": lambda b, h, i, j: (i - j).abs() <= 1, "causal": True},
}
SERVED = [(kernel, kind) for kernel in KERNELS for kind in MASKS
          if kernel != "blocks" or kind in ("causal", "mod", "function")]  # blocks: mods with bounds


def _ids(pairs):
    return [pytest.param(*pair, id="-".join(pair)) for pair in pairs]


def _inputs(seed: int = 0, *, lead: tuple = (), requires_grad: bool = False):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((*lead, B, H, T, D), (*lead, B, H, T, D), (*lead, B, H, T, DV))
    return tuple(torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=requires_grad)
                 for shape in shapes)


def _oracle(q, k, v, kind: str) -> torch.Tensor:
    """F.scaled_dot_product_attention in fp64 (any leading dims), the mask made dense."""
    options = MASKS[kind]
    mask = options.get("mask")
    if callable(mask):
        mask = masks.materialize(mask, tq=T, tk=T, batch=B)  # (B, 1, T, T)
        if options.get("causal"):
            mask = mask & masks.causal_mask(T)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=options.get("causal", False))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _kernel_fn(kernel: str, kind: str):
    """``(q, k, v) -> out`` through one backend's kernel on a validated call."""
    run = KERNELS[kernel]
    return lambda q, k, v: run(build_call(q, k, v, **MASKS[kind]))


def _close(have, want, atol=1e-10):
    torch.testing.assert_close(have, want, rtol=0, atol=atol)


# ----------------------------------------------------------------------------- backends
@pytest.mark.parametrize("kernel, kind", _ids(SERVED))
def test_gradcheck_with_batched_grads(kernel, kind):
    """PyTorch's test_sdp_math_gradcheck check: before, chunked failed on 'Batching rule not
    implemented for aten::alias' (indexing a whole dim in its backward) and blocks on a copy of
    a batched gradient into an unbatched buffer."""
    assert torch.autograd.gradcheck(_kernel_fn(kernel, kind), _inputs(requires_grad=True),
                                    check_batched_grad=True, fast_mode=True)


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (0, None, None)], ids=["qkv", "q-only"])
@pytest.mark.parametrize("kernel, kind", _ids(SERVED))
def test_vmap_over_a_leading_dim(kernel, kind, in_dims):
    stacked, single = _inputs(1, lead=(N,)), _inputs(2)
    q, k, v = (many if dim == 0 else one for many, one, dim in zip(stacked, single, in_dims))
    out = vmap(_kernel_fn(kernel, kind), in_dims=in_dims)(q, k, v)  # (N, B, H, T, Dv)
    _close(out, _oracle(q, k, v, kind))


@pytest.mark.parametrize("kernel, kind", _ids(SERVED))
def test_grad_of_a_scalar_function(kernel, kind):
    q, k, v = _inputs(4)
    fn = _kernel_fn(kernel, kind)
    have = grad(lambda q, k, v: fn(q, k, v).square().sum(), argnums=(0, 1, 2))(q, k, v)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(_oracle(q, k, v, kind).square().sum(), (q, k, v))
    for h, w in zip(have, want):
        _close(h, w)


@pytest.mark.parametrize("kernel", ["reference", "chunked", "blocks"])
def test_per_sample_gradients_vmap_of_grad(kernel):
    """vmap over grad runs the backward pass under vmap: chunked's and blocks' backward is a
    Function of its own with the same slice-by-slice rule."""
    kind = "mod"
    q, k, v = _inputs(5, lead=(N,))
    fn = _kernel_fn(kernel, kind)
    loss = lambda q, k, v: fn(q, k, v).square().sum()  # noqa: E731
    have = vmap(grad(loss, argnums=(0, 1, 2)), in_dims=(0, 0, None))(q, k, v[0])
    for i in range(N):
        qi, ki, vi = (t.detach().requires_grad_() for t in (q[i], k[i], v[0]))
        want = torch.autograd.grad(_oracle(qi, ki, vi, kind).square().sum(), (qi, ki, vi))
        for h, w in zip(have, want):
            _close(h[i], w)


@pytest.mark.parametrize("kernel", ["reference", "chunked"])
def test_vmap_over_a_bool_mask(kernel):
    """One padding mask per vmapped sample: the mask is an input of chunked's Function, so its
    vmap rule cuts it with q, k and v."""
    q, k, v = _inputs(6)
    lengths = torch.tensor([1, 3, 5])
    allowed = torch.arange(T) < lengths[:, None, None]  # (N, 1, T): keys < length
    run = KERNELS[kernel]
    out = vmap(lambda m: run(build_call(q, k, v, mask=m)))(allowed)
    q, k, v = (t.expand(N, *t.shape) for t in (q, k, v))
    _close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None, None]))  # (N, 1, 1, 1, T)


@pytest.mark.parametrize("kernel", ["chunked", "blocks"])
def test_gradients_of_gradients_raise_a_clear_error(kernel):
    q, k, v = _inputs(7, requires_grad=True)
    out = _kernel_fn(kernel, "causal")(q, k, v)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(dq.sum(), q)


# ----------------------------------------------------------------------------- attnlab.attention
BACKENDS = ["auto", "reference", "sdpa", "chunked", "blocks"]


def _attention_fn(backend: str, kind: str):
    return lambda q, k, v: attnlab.attention(q, k, v, backend=backend, **MASKS[kind])


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "blocks"])
def test_sdp_math_gradcheck_pattern(backend):
    """PyTorch's test_sdp_math_gradcheck: q, k, v are non-contiguous views of one packed qkv
    tensor, transposed to (B, H, T, D); gradcheck with batched gradients."""
    qkv = torch.randn(4, 4, 2 * 16 * 3, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    qkv.requires_grad_()
    q, k, v = (t.view(4, -1, 2, 16).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (B, H, T, D)
    assert torch.autograd.gradcheck(lambda q, k, v: attnlab.attention(q, k, v, backend=backend),
                                    (q, k, v), check_batched_grad=True, fast_mode=True)


@pytest.mark.parametrize("backend, kind", _ids(
    [(b, kind) for b in BACKENDS for kind in ("none", "causal", "bool", "mod")
     if b != "blocks" or kind in ("causal", "mod")]))
def test_attention_under_vmap_grad_and_gradcheck(backend, kind):
    fn = _attention_fn(backend, kind)
    q, k, v = _inputs(9, lead=(N,))
    _close(vmap(fn, in_dims=(0, None, None))(q, k[0], v[0]), _oracle(q, k[0], v[0], kind))
    have = grad(lambda q: fn(q, k[0], v[0]).square().sum())(q[0])
    q0 = q[0].clone().requires_grad_()
    _close(have, torch.autograd.grad(_oracle(q0, k[0], v[0], kind).square().sum(), q0)[0])
    assert torch.autograd.gradcheck(fn, _inputs(10, requires_grad=True), check_batched_grad=True,
                                    fast_mode=True)


# ----------------------------------------------------------------------------- torch.export
EXPORTED = {
    "none": {},
    "causal": {"causal": True},
    "mod": {"mask": masks.sliding_window_mod(8, 8, window=3)},  # top-left: one mod for every length
}


class _Attention(torch.nn.Module):
    def __init__(self, options: dict):
        super().__init__()
        self.options = options

    def forward(self, q, k, v):
        return attnlab.attention(q, k, v, **self.options)


@pytest.mark.parametrize("kind", list(EXPORTED))
def test_export_with_a_dynamic_sequence_length(kind):
    seq = torch.export.Dim("seq", min=2, max=256)
    example = tuple(torch.randn(1, 2, 8, 4) for _ in range(3))
    program = torch.export.export(_Attention(EXPORTED[kind]), example,
                                  dynamic_shapes=({2: seq}, {2: seq}, {2: seq}))
    for length in (8, 19):
        q, k, v = (torch.randn(1, 2, length, 4, generator=torch.Generator().manual_seed(length + i))
                   for i in range(3))
        mask = EXPORTED[kind].get("mask")
        want = F.scaled_dot_product_attention(
            q, k, v, is_causal=kind == "causal",
            attn_mask=None if mask is None else masks.materialize(mask, tq=length, tk=length))
        torch.testing.assert_close(program.module()(q, k, v), want, rtol=0, atol=1e-5)


class _DataDependentBatch(torch.nn.Module):
    """Attention over the first ``n.item()`` sequences: a batch size known only from data."""

    def __init__(self, options: dict):
        super().__init__()
        self.options = options

    def forward(self, n, q, k, v):
        rows = n.item()
        torch._check_is_size(rows)
        torch._check(rows <= q.shape[0])
        return attnlab.attention(q[:rows], k[:rows], v[:rows], **self.options)


@pytest.mark.parametrize("kind", ["none", "causal"])
def test_export_with_a_data_dependent_batch_size(kind):
    # The broadcast check compared the batch size with 1 (Ne(u0, 1)): a guard on a size known
    # only at run time, which export refuses; F.scaled_dot_product_attention exports.
    example = (torch.tensor(3), *(torch.randn(4, 2, 8, 4) for _ in range(3)))
    program = torch.export.export(_DataDependentBatch(EXPORTED[kind]), example)
    q, k, v = (torch.randn(4, 2, 8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for rows in (1, 2, 4):
        want = F.scaled_dot_product_attention(q[:rows], k[:rows], v[:rows], is_causal=kind == "causal")
        torch.testing.assert_close(program.module()(torch.tensor(rows), q, k, v), want, rtol=0, atol=1e-5)


def test_tiled_backends_decline_while_exported_at_a_symbolic_length():
    """chunked and blocks loop over tiles of the sequence in Python and read the mask's values to
    skip them, flex compiles per static shape: traced at a symbolic length they would fix it, which
    export refuses ("Constraints violated"). They decline; the reference (one graph) serves."""
    seen = {}

    class Probe(torch.nn.Module):
        def forward(self, q):
            seen.update(reasons(build_call(q, q, q, mask=EXPORTED["mod"]["mask"])))
            return q

    seq = torch.export.Dim("seq", min=2, max=256)
    torch.export.export(Probe(), (torch.randn(1, 2, 8, 4),), dynamic_shapes=({2: seq},), strict=False)
    for name in {"chunked", "blocks", "flex"} & set(available()):
        assert seen[name], name
    assert seen["reference"] == []


class _Masks(torch.nn.Module):
    """Every attnlab mask mod made dense at the inputs' (symbolic) length."""

    MODS = (masks.causal_mod(8, 8), masks.sliding_window_mod(8, 8, 3), masks.prefix_lm_mod(8, 8, 2),
            masks.chunked_local_mod(8, 8, 3), masks.padding_mod(torch.tensor([3, 6])))

    def forward(self, x):
        t = x.shape[-2]
        return torch.stack([masks.materialize(mod, tq=t, tk=t, batch=2) for mod in self.MODS])


def test_mask_mods_export_with_a_dynamic_sequence_length():
    seq = torch.export.Dim("seq", min=2, max=256)
    program = torch.export.export(_Masks(), (torch.randn(8, 4),), dynamic_shapes=({0: seq},))
    for length in (8, 13):
        x = torch.randn(length, 4)
        assert torch.equal(program.module()(x), _Masks()(x))
