"""DeepSeek-V4 through ``attn_implementation="attnlab"`` (attnlab.integrations.deepseek_v4).

The reference is the same model with ``attn_implementation="eager"`` (transformers' own layers, its
dense sliding-window mask and dense compressed-block masks), fp32, same weights. Attention weights are
drawn at 0.3 (the default init leaves sinks and position biases at 0, where the indexer's scores tie and
transformers' ``topk`` breaks ties arbitrarily), and the indexer has 16 heads, so a score is exactly 0
only when all 16 ReLUs are.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from attnlab.integrations import deepseek_v4
from attnlab.integrations.transformers import register
from attnlab.nn import CompressedAttention, CompressedCache

transformers = pytest.importorskip("transformers", reason="pip install 'attnlab[hf]'")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DynamicCache  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402

NAME = register()
KINDS = ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"]
T = 300


def _config(**overrides) -> DeepseekV4Config:
    """Every kind of layer; rates 4 and 16 give 75 CSA and 18 HCA entries at T=300."""
    options = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                   head_dim=16, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4, max_position_embeddings=1024,
                   sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=16, index_head_dim=16, index_topk=4,
                   compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                   layer_types=KINDS, mlp_layer_types=["hash_moe", "moe", "moe"])
    options.update(overrides)
    return DeepseekV4Config(**options)


def _pair(**overrides):
    """(eager, attnlab) models with the same weights, each built from its own config."""
    torch.manual_seed(0)
    eager = DeepseekV4ForCausalLM._from_config(_config(**overrides), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if ".self_attn." in name:
                p.normal_(0.0, 0.3)
    ours = DeepseekV4ForCausalLM._from_config(_config(**overrides), attn_implementation=NAME).eval()
    ours.load_state_dict(eager.state_dict())
    return eager, ours


IDS = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1))


def _largest(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def pair():
    return _pair()


# ---------------------------------------------------------------------- equal to eager
def test_logits_equal_eager_and_every_layer_is_on_the_compressed_path(pair):
    eager, ours = pair
    with torch.no_grad():
        want, got = eager(IDS).logits, ours(IDS).logits
    assert _largest(want, got) <= 1e-4 * max(1.0, want.abs().max().item())
    assert deepseek_v4.served(ours.config) and not deepseek_v4.served(eager.config)
    assert all(isinstance(layer.self_attn, deepseek_v4.AttnlabDeepseekV4Attention) for layer in ours.model.layers)
    assert set(ours.state_dict()) == set(eager.state_dict())  # the adaptation adds no parameter or key


def test_gradients_equal_eager():
    eager, ours = _pair()
    for model in (eager, ours):
        model(IDS[:, :72]).logits.square().mean().backward()
    for (name, a), b in zip(eager.named_parameters(), ours.parameters()):
        if a.grad is not None:
            assert _largest(a.grad, b.grad) <= 1e-4 * max(1.0, a.grad.abs().max().item()), name


def test_greedy_generation_and_cached_steps_equal_eager(pair):
    eager, ours = pair
    prompt, mask = IDS[:, :21], torch.ones(2, 21, dtype=torch.long)
    with torch.no_grad():
        generated = [m.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False) for m in pair]
        assert torch.equal(*generated)
        caches = DynamicCache(config=eager.config), DynamicCache(config=ours.config)
        want, got = (m(prompt, cache=c, use_cache=True).logits for m, c in zip(pair, caches))
        assert _largest(want, got) <= 1e-4
        for t in range(21, 33):  # one token at a time: CSA entries close at 24, 28, 32, an HCA entry at 32
            want, got = (m(IDS[:, t:t + 1], cache=c, use_cache=True).logits for m, c in zip(pair, caches))
            assert _largest(want, got) <= 1e-4, t
    layers = [c.layers[0] for c in caches]
    assert layers[0].entry_count == layers[1].entry_count  # the same state, in transformers' own cache layers
    assert torch.allclose(layers[0].compressed_kv["indexer"], layers[1].compressed_kv["indexer"], atol=1e-5)


def test_a_cache_filled_by_eager_continues_on_attnlab(pair):
    eager, ours = pair
    prompt = IDS[:, :41]
    with torch.no_grad():
        cache = DynamicCache(config=eager.config)
        eager(prompt, cache=cache, use_cache=True)
        reference = copy.deepcopy(cache)
        got = ours(IDS[:, 41:50], cache=cache, use_cache=True).logits
        want = eager(IDS[:, 41:50], cache=reference, use_cache=True).logits
    assert _largest(want, got) <= 1e-4


# ---------------------------------------------------------------------- no dense mask
class _Shapes(TorchDispatchMode):
    """Every shape an operator returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


def _dense_rows(shapes) -> list:
    """Shapes with T query rows and at least T columns: a (T, T) mask or one with compressed columns."""
    return [s for s in shapes if len(s) >= 2 and s[-2] == T and s[-1] >= T]


def test_no_t_by_t_tensor_is_created(pair):
    eager, ours = pair
    with torch.no_grad():
        with _Shapes() as seen_ours:
            ours(IDS)
        with _Shapes() as seen_eager:
            eager(IDS)
    assert _dense_rows(seen_eager.shapes)  # eager's mask and scores: the check can fail
    assert not _dense_rows(seen_ours.shapes), _dense_rows(seen_ours.shapes)[:3]


def test_the_mask_builder_leaves_the_mask_out_only_when_it_is_plain(pair):
    eager, ours = pair
    embeds = torch.zeros(2, T, 32)
    positions = torch.arange(T)[None]

    def build(model, attention_mask):
        return create_sliding_window_causal_mask(config=model.config, inputs_embeds=embeds,
                                                 attention_mask=attention_mask, cache=None, position_ids=positions)

    assert build(ours, None) is None
    assert build(ours, torch.ones(2, T, dtype=torch.long)) is None
    padded = torch.ones(2, T, dtype=torch.long)
    padded[0, :5] = 0
    assert build(ours, padded).shape == (2, 1, T, T)  # padding: the dense path, as before
    assert build(eager, None).shape == (2, 1, T, T)


# ---------------------------------------------------------------------- what keeps the dense path
def test_padded_rows_take_the_dense_path_and_equal_eager(pair):
    eager, ours = pair
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[0, :6] = 0
    with torch.no_grad():
        want, got = (m(IDS[:, :40], attention_mask=mask).logits for m in pair)
    real = mask.bool()
    assert _largest(want[real], got[real]) <= 1e-4


def test_asked_weights_take_the_dense_path_and_equal_eager(pair):
    with torch.no_grad():
        want, got = (m(IDS[:, :40], output_attentions=True) for m in pair)
    assert _largest(want.logits, got.logits) <= 1e-4
    for a, b in zip(want.attentions, got.attentions):
        assert a.shape == b.shape and _largest(a, b) <= 1e-4


def test_a_layer_compressed_attention_cannot_reproduce_keeps_the_whole_model_dense():
    eager, ours = _pair(attention_dropout=0.1)  # eval: no dropout, but CompressedAttention has none at all
    with torch.no_grad():
        want, got = eager(IDS[:, :60]).logits, ours(IDS[:, :60]).logits
    assert not deepseek_v4.served(ours.config)
    assert _largest(want, got) <= 1e-4


def test_switching_to_eager_gives_transformers_own_layers_back():
    eager, ours = _pair()
    with torch.no_grad():
        ours(IDS[:, :20])
        ours.set_attn_implementation("eager")
        with _Shapes() as seen:
            got = ours(IDS[:, :40]).logits
        ours.set_attn_implementation(NAME)
        again = ours(IDS[:, :40]).logits
        want = eager(IDS[:, :40]).logits
    assert any(len(s) == 4 and s[-2:] == (40, 40) for s in seen.shapes)  # eager's dense mask is back
    assert _largest(want, got) <= 1e-4 and _largest(want, again) <= 1e-4


def test_a_deep_copy_equals_eager(pair):
    """A copy's config is another object, not known to be served: it takes the dense path, with eager's
    masks (a regression: a copied config got sdpa's bool mask, onto which V4 concatenates a float bias)."""
    eager, ours = pair
    clone = copy.deepcopy(ours)
    with torch.no_grad():
        assert _largest(eager(IDS[:, :50]).logits, clone(IDS[:, :50]).logits) <= 1e-4
    assert isinstance(clone.model.layers[0].self_attn, deepseek_v4.AttnlabDeepseekV4Attention)
    assert not deepseek_v4.served(clone.config)


# ---------------------------------------------------------------------- the view shares the parameters
def test_view_shares_the_layers_parameters(pair):
    _, ours = pair
    layer = ours.model.layers[0].self_attn
    view = deepseek_v4.view(layer)
    assert view is deepseek_v4.view(layer)  # kept
    ours_params = {id(p) for p in layer.parameters()}
    assert {id(p) for p in view.parameters()} == ours_params
    with torch.no_grad():
        layer.sinks += 0.0  # in place: still the same objects
    assert deepseek_v4.view(layer) is view
    with pytest.raises(TypeError, match="share must be a bool"):
        CompressedAttention.from_transformers(layer, share=1)


def test_cache_layer_conversion_refusals(pair):
    _, ours = pair
    view = deepseek_v4.view(ours.model.layers[1].self_attn)  # HCA
    cache = DynamicCache(config=ours.config)
    with pytest.raises(ValueError, match="DeepseekV4HCACache for a hca layer, got DeepseekV4CSACache"):
        CompressedCache.from_transformers(cache.layers[0], view, batch_size=1, dtype=torch.float32, device="cpu")
    cache.layers[1].record_past = True
    with pytest.raises(ValueError, match="records its past"):
        CompressedCache.from_transformers(cache.layers[1], view, batch_size=1, dtype=torch.float32, device="cpu")


# ---------------------------------------------------------------------- refusals
def test_hand_given_positions_are_refused(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="position_ids do not run from the cache length 0"):
        ours(IDS[:, :20], position_ids=torch.arange(5, 25)[None])


def test_a_cache_without_v4_layers_is_refused(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="cache has no layer 0: give DeepSeek-V4 a DynamicCache"):
        ours(IDS[:, :8], cache=DynamicCache(), use_cache=True)


def test_an_unknown_keyword_is_refused(pair):
    _, ours = pair
    layer = ours.model.layers[0].self_attn
    x = torch.randn(1, 6, 32)
    with pytest.raises(ValueError, match="cannot run on attnlab: it passes the keyword band_mask"):
        layer(x, None, torch.arange(6)[None], None, band_mask=torch.ones(1))


def test_a_model_sharing_a_served_config_is_refused_not_wrong():
    """transformers' from_config keeps the config object: a model built with eager, then one with
    attnlab on the same config, leaves the first one's layers unadapted under attnlab's name."""
    config = _config()
    plain = DeepseekV4ForCausalLM._from_config(config, attn_implementation="eager").eval()
    served = DeepseekV4ForCausalLM._from_config(config, attn_implementation=NAME).eval()
    assert plain.config is served.config
    served(IDS[:, :10])
    with pytest.raises(ValueError, match="give each model its own config"):
        plain(IDS[:, :10])


# ---------------------------------------------------------------------- the bench rows
def test_bench_rows_measure_a_fraction_of_eagers_peak_with_equal_logits():
    from attnlab.lab.bench.suites import deepseek_v4_memory

    eager, ours = deepseek_v4_memory(quick=True)  # T=1024
    assert (eager.name, ours.name, eager.t) == ("eager", NAME, 1024)
    assert ours.values["peak_mib"] < eager.values["peak_mib"] / 4
    assert ours.values["logits_max_abs_diff"] <= 1e-4


def test_a_copied_config_gets_eager_masks_only_if_every_model_of_its_class_did():
    """The regression behind test_a_deep_copy_equals_eager, on the convention tables themselves."""
    from attnlab.integrations import transformers as integration

    class AllEager:
        pass

    class Mixed:
        pass

    kept = [AllEager(), Mixed(), Mixed()]
    integration._remember_masks(kept[0], eager=True)
    integration._remember_masks(kept[1], eager=True)
    integration._remember_masks(kept[2], eager=False)
    assert integration._eager_masks(AllEager()) and not integration._eager_masks(Mixed())  # configs no model saw
    assert integration._eager_masks(kept[1]) and not integration._eager_masks(kept[2])  # each seen config its own
