"""DeepSeek-V3.2 and GLM-MoE-DSA (DSA sparse attention) through ``attn_implementation="attnlab"`` vs eager.

Eager folds the indexer's top-k keys into its mask; attnlab receives them as ``indices (B, Tq, k)``
and runs the top-k kernel on them, intersected with the causal/padding mask. Tiny random models
(nothing downloaded), 4 of up to 9 keys per query so the selection bites: logits at the real tokens
of un-, right- and left-padded batches, greedy generation (the cache grows past k), gradients.
GLM-MoE-DSA's second layer reuses the first one's top-k (``indexer_types`` "shared").
"""

from __future__ import annotations

import pytest
import torch
from test_integration_keywords import IDS, _pair, _padding

from attnlab.integrations.transformers import recording

transformers = pytest.importorskip("transformers", reason="pip install 'attnlab[hf]'")

SMALL = dict(vocab_size=100, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
             num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
             v_head_dim=8, qk_nope_head_dim=8, index_topk=4, index_head_dim=16, index_n_heads=2,
             max_position_embeddings=64)


def _family(name, **changes):
    changes = {**SMALL, **changes}
    if name == "deepseek_v32":
        config = transformers.DeepseekV32Config(**changes, first_k_dense_replace=1)
        return _pair(transformers.DeepseekV32ForCausalLM, config)
    config = transformers.GlmMoeDsaConfig(**changes, head_dim=8, indexer_types=["full", "shared"],
                                          mlp_layer_types=["dense", "sparse"])
    return _pair(transformers.GlmMoeDsaForCausalLM, config)


FAMILIES = ["deepseek_v32", "glm_moe_dsa"]


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_logits_equal_eager_and_the_top_k_reaches_attnlab(family):
    eager, ours = _family(family)
    seen = []
    for side in ("none", "right", "left"):
        mask = _padding(side)
        real = mask.bool()
        with torch.no_grad(), recording(lambda module, q, k, v, **options: seen.append(options["indices"])):
            want, got = (m(IDS, attention_mask=mask).logits for m in (eager, ours))
        assert (want - got)[real].abs().max() <= 1e-4, side
    assert len(seen) == 6 and all(i is not None and i.shape == (2, 1, 9, 4) for i in seen)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_selection_matters_here(family):
    """Guard for the test above: with every key selected the logits change (k = 4 < T = 9 bites)."""
    sparse, _ = _family(family)
    dense, _ = _family(family, index_topk=64)  # clamped to Tk, as transformers does
    with torch.no_grad():
        assert (sparse(IDS).logits - dense(IDS).logits).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_eager(family):
    eager, ours = _family(family)
    mask = _padding("left")
    generated = [m.generate(IDS, attention_mask=mask, max_new_tokens=6, do_sample=False) for m in (eager, ours)]
    assert torch.equal(*generated)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_equal_eager(family):
    eager, ours = _family(family)
    mask = _padding("right")
    for model in (eager, ours):
        model.train()
        logits = model(IDS, attention_mask=mask).logits
        logits[mask.bool()].square().sum().backward()
    count = 0
    for (name, a), b in zip(eager.named_parameters(), ours.parameters()):
        if a.grad is not None:
            count += 1
            assert (a.grad - b.grad).abs().max() <= 1e-4 * max(1.0, a.grad.abs().max().item()), name
    assert count > 20
