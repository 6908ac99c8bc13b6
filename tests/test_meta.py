"""Meta tensors: shape propagation without values (transformers builds models on ``meta``).

Every call that works on CPU must, on meta, give an output of the same shape and dtype (and
weights, when asked for) without reading a value; backends that run on particular devices
only decline by name. Modules built under ``torch.device("meta")`` return meta outputs; a
module with real weights given a meta input, and ``io.save`` of a meta module, are refused by
name.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import io, masks
from attnlab.models import GPT, BertEncoder
from attnlab.nn import MultiHeadAttention
from attnlab.nn import CallMask, QKV

B, HQ, HKV, TQ, TK, D = 2, 4, 2, 6, 9, 8


def _mask_options():
    return {
        "none": {},
        "causal": dict(causal=True),
        "bottom_right": dict(causal=True, align="bottom_right"),
        "window": dict(mask=masks.sliding_window_mod(TQ, TK, 3)),
        "padding": dict(mask=masks.padding_mod(torch.tensor([3, 9]))),
        "varlen": dict(mask=masks.varlen_causal_mod(torch.tensor([6, 2]), torch.tensor([4, 9]))),
        "documents": dict(mask=masks.document_mod(torch.tensor([0] * 4 + [1] * 5))),
        "lambda": dict(mask=lambda b, h, i, j: j <= i),
        "bool": dict(mask=torch.ones(TQ, TK, dtype=torch.bool).tril()),
        "float": dict(mask=torch.zeros(TQ, TK)),
    }


def _on(device, options):
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in options.items()}


@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "chunked", "blocks", "flex"])
@pytest.mark.parametrize("name", sorted(_mask_options()))
def test_attention_on_meta_gives_the_cpu_shapes(backend, name):
    options = _mask_options()[name]
    q, k = torch.randn(B, HQ, TQ, D), torch.randn(B, HKV, TK, D)
    v = torch.randn(B, HKV, TK, 5)
    try:
        cpu_out, cpu_weights = attnlab.attention(q, k, v, backend=backend, return_weights=True, **options)
    except ValueError as err:
        if "cannot serve" not in str(err):
            raise
        pytest.skip(f"{backend} declines this call on CPU")
    meta = [t.to("meta").requires_grad_() for t in (q, k, v)]
    try:
        out, weights = attnlab.attention(*meta, backend=backend, return_weights=True, **_on("meta", options))
    except ValueError as err:  # a backend for some devices only names the meta device
        assert backend in ("blocks", "flex") and "not meta" in str(err), err
        return
    for got, want in ((out, cpu_out), (weights, cpu_weights)):
        assert got.device.type == "meta" and got.shape == want.shape and got.dtype == want.dtype
    out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape and t.grad.is_meta for t in meta)


def test_meta_lengths_and_ids_build_mods_and_run():
    lengths = torch.tensor([3, 9], device="meta")
    q = torch.randn(B, HQ, TQ, D, device="meta")
    k = torch.randn(B, HKV, TK, D, device="meta")
    for mod in (masks.padding_mod(lengths), masks.varlen_causal_mod(torch.tensor([6, 2], device="meta"), lengths),
                masks.document_mod(torch.zeros(TK, dtype=torch.long, device="meta"))):
        assert "meta" in repr(mod) or "DocumentMod" in repr(mod)
        assert attnlab.attention(q, k, k, mask=mod).shape == (B, HQ, TQ, D)
    with pytest.raises(ValueError, match="cannot infer max_len from meta lengths"):
        masks.padding_mask(lengths)
    assert masks.padding_mask(lengths, 9).shape == (B, 1, 1, 9)


def _models():
    return {
        "mha": lambda: MultiHeadAttention(16, 16, num_heads=4, positions="rope", qkv=QKV(num_kv_heads=2)),
        "gpt": lambda: GPT(vocab_size=11, max_len=8, d_model=16, num_layers=2, num_heads=2),
        "gpt_rope": lambda: GPT(vocab_size=11, max_len=8, d_model=16, num_layers=2, num_heads=2, positions="rope"),
        "bert": lambda: BertEncoder(vocab_size=11, hidden_size=16, num_layers=2, num_heads=2,
                                    intermediate_size=32, max_position_embeddings=8),
    }


def _inputs(name, device):
    if name == "mha":
        return (torch.randn(2, 5, 16, device=device),), {"return_weights": True}
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], device=device)
    if name == "bert":
        return (ids, torch.tensor([[1, 1, 1, 0, 0], [1] * 5], device=device)), {"return_weights": True}
    return (ids,), {"return_weights": True}


@pytest.mark.parametrize("name", sorted(_models()))
def test_modules_built_on_meta_propagate_shapes(name):
    torch.manual_seed(0)
    cpu_out, cpu_weights = _models()[name]()(*_inputs(name, "cpu")[0], **_inputs(name, "cpu")[1])
    with torch.device("meta"):
        module = _models()[name]()
    args, kwargs = _inputs(name, "meta")
    out, weights = module(*args, **kwargs)
    assert out.is_meta and out.shape == cpu_out.shape and out.dtype == cpu_out.dtype
    weights = weights if isinstance(weights, tuple) else (weights,)
    cpu_weights = cpu_weights if isinstance(cpu_weights, tuple) else (cpu_weights,)
    assert [w.shape for w in weights] == [w.shape for w in cpu_weights] and all(w.is_meta for w in weights)


def test_mha_on_meta_with_document_ids_and_a_cache():
    with torch.device("meta"):
        mha = MultiHeadAttention(16, 16, num_heads=2, positions="rope")
    x = torch.randn(2, 5, 16, device="meta")
    assert mha(x, mask=CallMask(documents=torch.tensor([0, 0, 1, 1, 1]))).shape == (2, 5, 16)
    assert mha(x, cache=mha.new_cache(2, 8)).shape == (2, 5, 16)


@pytest.mark.parametrize("name", sorted(_models()))
def test_a_module_with_real_weights_refuses_a_meta_input_by_name(name):
    module = _models()[name]()
    args, kwargs = _inputs(name, "meta")
    first = "x" if name == "mha" else "input_ids"
    with pytest.raises(ValueError, match=f"{first} is on meta but the (module|model)'s weights are on cpu"):
        module(*args, **kwargs)


def test_saving_a_meta_module_names_the_parameter(tmp_path):
    with torch.device("meta"):
        model = GPT(vocab_size=11, max_len=8, d_model=16, num_layers=1, num_heads=2)
    path = tmp_path / "m.safetensors"
    with pytest.raises(ValueError, match=r"tok_emb\.weight is on the meta device; load or materialize weights first"):
        io.save(model, path)
    with pytest.raises(ValueError, match="w is on the meta device"):
        io.save_state_dict({"w": torch.ones(2, device="meta")}, path)
    assert not path.exists()
