"""DiffLlama, Qwen3-Next and Llama 4 (text) on attnlab equal eager (issue 34), tiny random models, nothing downloaded.

Each family runs ``attn_implementation="attnlab"`` against ``"eager"`` with the same weights: logits of
un-, right- and left-padded batches at the real tokens, gradients, greedy generation from a left-padded
prompt with each step's logits, all within 1e-4. Each attention call a model makes is also checked against
plain fp64 attention written here (eager itself is no fp64 reference: DiffLlama's takes its softmax in
fp32, so a double model's fully masked rows become NaN, and Qwen3-Next's experts refuse fp64). The
attention each family asks of attnlab:

- DiffLlama: two calls per layer sharing q and k, one per half of the value heads (the difference of
  the two softmaxes is taken by the model).
- Qwen3-Next: only its full-attention layers call the attention interface (with a sigmoid gate applied
  by the model afterwards); its gated-delta-net layers run transformers' own code, on its PyTorch
  fallback when ``flash-linear-attention`` and ``causal_conv1d`` are absent.
- Llama 4: chunked-local layers (``attention_chunk_size`` 4 over 9 tokens, chunks counted from a row's
  first real token) and NoPE full-causal layers; both are checked against plain fp64 attention here.

Query rows with no key to attend (left padding; a right-padded row's last chunk holding padding only)
are zero on attnlab, as on transformers' sdpa path; eager spreads them over every key. Those rows are
padding: the real tokens agree.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_integration_families import _gradients_agree, _largest
from test_integration_keywords import IDS, NAME, _pair, _padding

from attnlab import attention
from attnlab.integrations.transformers import recording

transformers = pytest.importorskip("transformers", reason="pip install 'attnlab[hf]'")

SIDES = ["none", "right", "left"]
CHUNK = 4  # Llama 4's attention_chunk_size: 9 tokens make chunks [0, 4), [4, 8), [8, 9)


def _diffllama(**extra):
    config = transformers.DiffLlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, **extra)
    return transformers.DiffLlamaForCausalLM, config


def _qwen3_next(**extra):
    config = transformers.Qwen3NextConfig(
        vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"], **extra)
    return transformers.Qwen3NextForCausalLM, config


def _llama4(**extra):
    """Layer 0 chunked-local with rope, layer 1 NoPE full-causal (with its temperature tuning)."""
    options = dict(attention_chunk_size=CHUNK, no_rope_layers=[1, 0], floor_scale=4, **extra)
    config = transformers.Llama4TextConfig(
        vocab_size=100, hidden_size=32, intermediate_size=32, intermediate_size_mlp=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        num_local_experts=2, num_experts_per_tok=1, **options)
    return transformers.Llama4ForCausalLM, config


FAMILIES = {"diffllama": _diffllama, "qwen3_next": _qwen3_next, "llama4": _llama4}
# The attention-interface calls of one forward: (layer index, calls); Qwen3-Next's layer 0 is linear.
CALLS = {"diffllama": [(0, 2), (1, 2)], "qwen3_next": [(1, 1)], "llama4": [(0, 1), (1, 1)]}


def _models(family: str, implementation: str = "sdpa"):
    """eager and attnlab with the same weights, and a third copy on ``implementation``."""
    model_class, config = FAMILIES[family]()
    eager, ours = _pair(model_class, config)
    other = copy.deepcopy(config)
    other._attn_implementation = implementation
    third = model_class(other).eval()
    third.load_state_dict(eager.state_dict())
    return eager, ours, third


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_logits_equal_eager_at_the_real_tokens(family):
    eager, ours, _ = _models(family)
    for side in SIDES:
        mask = _padding(side)
        with torch.no_grad():
            want, got = (m(IDS, attention_mask=mask).logits for m in (eager, ours))
        assert _largest(want, got, mask.bool()) <= 1e-4, side


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_rows_follow_transformers_sdpa(family):
    """Every position, padded ones included, as transformers' sdpa path computes it."""
    _, ours, sdpa = _models(family)
    for side in ("right", "left"):
        with torch.no_grad():
            got, want = (m(IDS, attention_mask=_padding(side)).logits for m in (ours, sdpa))
        assert _largest(want, got) <= 1e-5, side


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_equal_eager(family):
    eager, ours, _ = _models(family)
    mask = _padding("left")
    real = mask.bool()
    for model in (eager, ours):
        model(IDS, attention_mask=mask).logits[real].square().mean().backward()
    assert all(p.grad is not None for p in ours.model.layers[-1].self_attn.parameters())
    _gradients_agree(eager, ours)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_eager(family):
    """Eight new tokens after a left-padded prompt: 17 positions, past several of Llama 4's chunks;
    each decoding step's logits (on the caches) within 1e-4."""
    eager, ours, _ = _models(family)
    want, got = (m.generate(IDS, attention_mask=_padding("left"), max_new_tokens=8, do_sample=False,
                            return_dict_in_generate=True, output_logits=True) for m in (eager, ours))
    assert torch.equal(want.sequences, got.sequences)
    assert max(_largest(a, b) for a, b in zip(want.logits, got.logits)) <= 1e-4


# ------------------------------------------------------------------ each call against plain fp64
def _plain_attention(q, k, v, *, scale: float, pads: torch.Tensor, chunk: int | None):
    """fp64 softmax attention written out: key j is seen from query i when it is a real token, j <= i,
    and (chunked) both lie in the same chunk of ``chunk`` tokens counted from the row's first real one."""
    q, k, v = q.double(), k.double(), v.double()
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))  # (B, H, T, D)
    i = torch.arange(q.shape[2])[:, None]
    j = torch.arange(k.shape[2])[None, :]
    allowed = []
    for pad in pads.tolist():
        rule = (j <= i) & (j >= pad)
        if chunk is not None:
            rule &= (j - pad) // chunk == (i - pad) // chunk
        allowed.append(rule)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~torch.stack(allowed)[:, None], float("-inf"))
    return scores.softmax(-1) @ v  # (B, H, T, D)


def _chunk(model, module) -> int | None:
    kind = getattr(model.config, "layer_types", None)
    return CHUNK if kind is not None and kind[module.layer_idx] == "chunked_attention" else None


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_attention_call_equals_plain_fp64(family, side):
    """Every softmax-attention layer calls attnlab (Qwen3-Next's linear layer does not), and what attnlab
    computes from each call's options is plain causal attention over the real keys; Llama 4's chunked
    layer attends within its chunk, which changes its result here."""
    _, ours, _ = _models(family)
    calls = []
    with recording(lambda module, q, k, v, **options: calls.append((module, q, k, v, options))), torch.no_grad():
        ours(IDS, attention_mask=(mask := _padding(side)))
    seen = [module.layer_idx for module, *_ in calls]
    assert [(i, seen.count(i)) for i in dict.fromkeys(seen)] == CALLS[family]
    real = mask.bool()[:, None, :, None]  # (B, 1, T, 1): the real queries
    pads = (~mask.bool()).cumprod(-1).sum(-1)  # left padding per row
    for module, q, k, v, options in calls:
        chunk = _chunk(ours, module)
        got = attention(q, k, v, **options).double()
        want = _plain_attention(q, k, v, scale=options["scale"], pads=pads, chunk=chunk)
        assert torch.where(real, got - want, 0).abs().max().item() <= 1e-5, module.layer_idx
        if chunk is not None:
            causal = _plain_attention(q, k, v, scale=options["scale"], pads=pads, chunk=None)
            assert torch.where(real, causal - want, 0).abs().max().item() > 1e-2
    assert family != "llama4" or [_chunk(ours, m) for m, *_ in calls] == [CHUNK, None]
