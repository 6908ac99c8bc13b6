"""Packed training on attnlab: several documents in one row stay apart on every family.

A row packs documents of lengths 5, 3 and 6 with ``position_ids`` restarting at 0 per document,
alone (``use_cache`` left at its default, so transformers builds no mask that separates them) or
with ``cu_seq_lens_q/k`` and ``max_length_q/k`` as ``DataCollatorWithFlattening`` writes them.
The reference is each document run alone through the same model: logits and every parameter's
gradient of a fixed random projection of the logits must agree within 1e-4 (fp32). Families:
Llama, Qwen3 (sdpa masks), Mistral (every layer windowed), Gemma 2 (softcap, windowed layers),
gpt-oss (sinks, windowed layers). Tiny random models, nothing downloaded.
"""

from __future__ import annotations

import pytest
import torch
from test_integration_keywords import NAME, REFUSAL, Layer, _causal, _eager, _qkv

from attnlab.integrations.transformers import attention_forward

transformers = pytest.importorskip("transformers", reason="pip install 'attnlab[hf]'")

LENGTHS = (5, 3, 6)
COMMON = dict(vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
FAMILIES = {
    "llama": lambda: (transformers.LlamaForCausalLM, transformers.LlamaConfig(**COMMON)),
    "qwen3": lambda: (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**COMMON)),
    "mistral": lambda: (transformers.MistralForCausalLM, transformers.MistralConfig(**COMMON, sliding_window=4)),
    "gemma2": lambda: (transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        **COMMON, sliding_window=4, attn_logit_softcapping=5.0, query_pre_attn_scalar=8)),
    "gpt_oss": lambda: (transformers.GptOssForCausalLM, transformers.GptOssConfig(
        **COMMON, sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"])),
}


def _model(family: str, implementation: str = NAME):
    model_class, config = FAMILIES[family]()
    config._attn_implementation = implementation
    torch.manual_seed(0)
    return model_class(config).eval()


def _documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 100, (1, n), generator=g) for n in LENGTHS]


def _packed_inputs(how: str) -> dict:
    """The documents in one row, with restarting positions and, for ``cu_seq_lens``, flash's keywords."""
    documents = _documents()
    inputs = dict(input_ids=torch.cat(documents, dim=1),
                  position_ids=torch.cat([torch.arange(n) for n in LENGTHS])[None])
    if how == "cu_seq_lens":
        bounds = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        inputs.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=max(LENGTHS),
                      max_length_k=max(LENGTHS))
    return inputs


def _projection(vocab: int) -> torch.Tensor:
    return torch.randn(sum(LENGTHS), vocab, generator=torch.Generator().manual_seed(2))


def _logits_and_grads(model, runs) -> tuple[torch.Tensor, dict]:
    """Logits of ``runs`` (a list of input dicts) concatenated over tokens, and the gradients of
    their projection, summed over the runs."""
    model.zero_grad()
    logits = torch.cat([model(**inputs).logits[0] for inputs in runs])  # (T, vocab)
    (logits * _projection(logits.shape[-1])).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _alone(model):
    return _logits_and_grads(model, [dict(input_ids=d) for d in _documents()])


def _largest_gradient_gap(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[n] - want[n]).abs().max().item() / max(1.0, want[n].abs().max().item()) for n in want)


@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_documents_equal_each_document_alone(family, how):
    model = _model(family)
    want_logits, want_grads = _alone(model)
    logits, grads = _logits_and_grads(model, [_packed_inputs(how)])
    assert (logits - want_logits).abs().max().item() <= 1e-4
    assert _largest_gradient_gap(grads, want_grads) <= 1e-4


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_restarting_positions_with_a_cache_mix_documents_on_eager_not_on_attnlab(family):
    """transformers looks for packed positions only without a cache; with ``use_cache`` at its
    default its eager (and sdpa) path lets each document see the ones before it."""
    eager, ours = _model(family, "eager"), _model(family)
    with torch.no_grad():
        want = torch.cat([ours(input_ids=d).logits[0] for d in _documents()])
        mixed, kept = (m(**_packed_inputs("position_ids")).logits[0] for m in (eager, ours))
    assert (mixed - want).abs().max().item() > 1e-2
    assert (kept - want).abs().max().item() <= 1e-4


def test_packed_documents_without_a_cache_equal_eager():
    """Without a cache transformers builds the mask that separates them itself; attnlab ANDs its own
    rule with it and gives eager's logits."""
    eager, ours = _model("gemma2", "eager"), _model("gemma2")
    with torch.no_grad():
        want, got = (m(**_packed_inputs("position_ids"), use_cache=False).logits for m in (eager, ours))
    assert (got - want).abs().max().item() <= 1e-4


# ------------------------------------------------------------------ attention_forward alone
def _apart(lengths: list[int]) -> torch.Tensor:
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids[:, None] == ids[None, :]


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
def test_attention_forward_keeps_packed_documents_apart_against_fp64(how, mask_kind):
    """Documents of 2 and 3 tokens: the rule is ANDed with causality and with a padding mask the
    model passed (key 1 masked out), whatever its kind."""
    q, k, v = _qkv()
    keys = torch.ones(5, dtype=torch.bool)
    keys[1] = False
    allowed = _causal(5, 5) & (keys if mask_kind != "none" else True)
    mask = {"none": None, "bool": allowed[None, None],
            "float": torch.zeros(5, 5).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]}[mask_kind]
    if how == "position_ids":
        keywords = dict(position_ids=torch.tensor([[0, 1, 0, 1, 2]]))
    else:
        bounds = torch.tensor([0, 2, 5, 7, 10], dtype=torch.int32)  # two rows flattened, as flash takes them
        keywords = dict(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds)
    out, weights = attention_forward(Layer(), q, k, v, mask, scaling=0.3, output_attentions=True, **keywords)
    want, want_weights = _eager(q, k, v, allowed=allowed & _apart([2, 3]))
    assert (out.double() - want).abs().max().item() <= 1e-5
    assert (weights.double() - want_weights).abs().max().item() <= 1e-5


def test_increasing_positions_one_document_and_decoding_positions_change_nothing():
    """Positions that never restart (or skip ahead, as a grid of patches does), and positions of
    queries over a longer cache (documents of the cached keys unknown), leave the call as it was."""
    q, k, v = _qkv()
    plain = attention_forward(Layer(), q, k, v, None)[0]
    for positions in ([[0, 1, 2, 3, 4]], [[0, 1, 4, 5, 8]]):
        assert torch.equal(attention_forward(Layer(), q, k, v, None, position_ids=torch.tensor(positions))[0], plain)
    one = torch.tensor([0, 10], dtype=torch.int32)  # one document per row of the two
    out = attention_forward(Layer(), q, k, v, None, cu_seq_lens_q=one, cu_seq_lens_k=one)[0]
    assert (out - plain).abs().max().item() <= 1e-6
    q2, k2, v2 = _qkv(tq=2, tk=5)
    assert torch.equal(attention_forward(Layer(), q2, k2, v2, None, position_ids=torch.tensor([[1, 0]]))[0],
                       attention_forward(Layer(), q2, k2, v2, None)[0])


def test_packed_boundaries_that_cannot_keep_documents_apart_are_refused():
    q, k, v = _qkv()
    two, other = torch.tensor([0, 2, 5]), torch.tensor([0, 3, 5])
    with pytest.raises(ValueError, match=f"Layer {REFUSAL}: its packed documents cannot be kept apart"):
        attention_forward(Layer(), q, k, v, None, cu_seq_lens_q=two, cu_seq_lens_k=other)
    with pytest.raises(ValueError, match="cu_seq_lens_q must ascend from 0"):
        attention_forward(Layer(), q, k, v, None, cu_seq_lens_q=torch.tensor([0, 2, 11]),
                          cu_seq_lens_k=torch.tensor([0, 2, 11]))
    with pytest.raises(ValueError, match="cu_seq_lens_k must be a 1-D integer tensor"):
        attention_forward(Layer(), q, k, v, None, cu_seq_lens_q=two, cu_seq_lens_k=two.float())
