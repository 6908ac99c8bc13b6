"""attnlab.nn.CompressedAttention: DeepSeek-V4's CSA / HCA / sliding layers against transformers' own.

The reference is transformers' ``DeepseekV4Attention`` (eager, fp32, its dense sliding-window mask
and dense block masks); our module must give the same output from the same weights, decode from its
cache exactly as its full forward, and never allocate anything of ``T * T`` elements.
"""

from __future__ import annotations

import doctest

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import attnlab.nn.compressed as compressed
from attnlab.nn import CompressedAttention, CompressedCache

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (  # noqa: E402
    DeepseekV4Attention,
    DeepseekV4RotaryEmbedding,
)

LAYERS = {"csa": 0, "hca": 1, "sliding": 2}
WINDOW = 5


def _config(**overrides) -> DeepseekV4Config:
    """A tiny V4 config with one layer of each kind. 16 index heads: a score is exactly 0 only when
    every head's ReLU is, so ties at the top-k cut (which transformers' ``topk`` breaks arbitrarily)
    do not occur."""
    options = dict(hidden_size=32, num_attention_heads=4, head_dim=16, q_lora_rank=12, o_groups=2, o_lora_rank=8,
                   index_n_heads=16, index_head_dim=8, index_topk=3, sliding_window=WINDOW,
                   compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                   num_hidden_layers=3, partial_rotary_factor=0.5, vocab_size=10, n_routed_experts=4,
                   num_experts_per_tok=2, hc_mult=2,
                   layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"])
    options.update(overrides)
    config = DeepseekV4Config(**options)
    config._attn_implementation = "eager"
    return config


def _layer(kind: str, seed: int, config: DeepseekV4Config | None = None) -> DeepseekV4Attention:
    torch.manual_seed(seed)
    layer = DeepseekV4Attention(config or _config(), LAYERS[kind]).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


def _theirs(layer: DeepseekV4Attention, x: torch.Tensor) -> torch.Tensor:
    """transformers' forward with the model's dense sliding-window causal mask."""
    B, T, _ = x.shape
    rotary = DeepseekV4RotaryEmbedding(layer.config)
    positions = torch.arange(T)[None]
    embeddings = {name: rotary(x, positions, name) for name in ("main", "compress")}
    i = torch.arange(T)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - layer.config.sliding_window)
    mask = torch.zeros(T, T).masked_fill(~allowed, float("-inf"))[None, None].expand(B, 1, T, T)
    return layer(x, embeddings, positions, mask)[0]


# ---------------------------------------------------------------------- parity with transformers
@pytest.mark.parametrize("kind", ["csa", "hca", "sliding"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_transformers(kind, seed):
    layer = _layer(kind, seed)
    x = torch.randn(2, 23, 32)  # 23: not a multiple of either rate (4, 8); batch 2
    ours = CompressedAttention.from_transformers(layer)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), _theirs(layer, x), rtol=0, atol=1e-4)


@pytest.mark.parametrize("T", [1, 3, 4, 9, 40])
def test_equals_transformers_at_lengths(T):
    """No entry yet (T < rate), exactly one window, topk above and below the closed entries."""
    for kind in ("csa", "hca"):
        layer = _layer(kind, T)
        x = torch.randn(1, T, 32)
        with torch.no_grad():
            torch.testing.assert_close(CompressedAttention.from_transformers(layer)(x), _theirs(layer, x),
                                       rtol=0, atol=1e-4)


def test_gradients_equal_transformers():
    """The top-k kernel's backward: every parameter's gradient and the input's as transformers'."""
    layer = _layer("csa", 3)
    ours = CompressedAttention.from_transformers(layer)
    x = torch.randn(2, 14, 32)
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    weight = torch.randn(2, 14, 32)
    (_theirs(layer, x_theirs) * weight).sum().backward()
    (ours(x_ours) * weight).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=0, atol=1e-4)
    theirs = {compressed._our_name(name): p.grad for name, p in layer.named_parameters()}
    for name, p in ours.named_parameters():
        if name.startswith("indexer."):  # integer choices: no gradient reaches the indexer on either side
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, theirs[name], rtol=0, atol=1e-4, msg=name)


def test_rotary_from_yarn_config():
    """A YaRN compress rotary (V4's own setting): the layer's frequencies are taken, not recomputed."""
    config = _config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                     max_position_embeddings=64)
    layer = _layer("hca", 0, config)
    x = torch.randn(1, 19, 32)
    with torch.no_grad():
        torch.testing.assert_close(CompressedAttention.from_transformers(layer)(x), _theirs(layer, x),
                                   rtol=0, atol=1e-4)


def test_equal_index_scores_keep_the_earlier_entry():
    """All index scores equal (zero weights): each query reads its earliest closed entries (a
    stable choice, so prefill and decoding agree), and the top-k attention matches the dense form."""
    ours = CompressedAttention.from_transformers(_layer("csa", 0))
    with torch.no_grad():
        ours.indexer.weights_proj.weight.zero_()
    x = torch.randn(1, 30, 32)
    chosen = []
    original = ours.indexer.select
    ours.indexer.select = lambda *args: chosen.append(original(*args)) or chosen[-1]
    with torch.no_grad():
        ours(x)
    picked = torch.cat(chosen, 1)[0]  # (T, k)
    closed = (torch.arange(30) + 1) // 4
    for t in range(30):
        expected = list(range(min(3, int(closed[t])))) + [-1] * (3 - min(3, int(closed[t])))
        assert picked[t].tolist() == expected, t


# ---------------------------------------------------------------------- the cache
def _split_run(module, x, splits):
    cache = module.new_cache(x.shape[0])
    outs, start = [], 0
    for n in splits:
        outs.append(module(x[:, start:start + n], cache=cache))
        start += n
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("kind", ["csa", "hca", "sliding"])
@pytest.mark.parametrize("splits", [[7] + [1] * 14, [1] * 21, [3, 1, 1, 9, 1, 1, 5]],
                         ids=["prefill-decode", "decode", "prefill-decode-prefill"])
def test_cached_decoding_equals_full_forward(kind, splits):
    module = CompressedAttention.from_transformers(_layer(kind, 5))
    x = torch.randn(2, 21, 32)
    with torch.no_grad():
        steps, cache = _split_run(module, x, splits)
        torch.testing.assert_close(steps, module(x), rtol=0, atol=1e-5)
    assert cache.length == 21 and cache.row_lengths == (21, 21)
    if kind != "sliding":
        rate = module.compress_rate
        assert cache.entries.shape == (2, 21 // rate, 16)


@pytest.mark.parametrize("kind", ["csa", "hca", "sliding"])
def test_cached_decoding_equals_transformers_cached_decoding(kind):
    """Prefill, decode, prefill, decode: our cache's steps equal transformers' with its own cache
    (``DeepseekV4CSACache`` / ``DeepseekV4HCACache``), step by step."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_sliding_window_causal_mask

    layer_type = {v: k for k, v in compressed._LAYER_KINDS.items()}[kind]
    config = _config(num_hidden_layers=1, layer_types=[layer_type])
    torch.manual_seed(4)
    layer = DeepseekV4Attention(config, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    ours = CompressedAttention.from_transformers(layer)
    theirs_cache, ours_cache = DynamicCache(config=config), ours.new_cache(2)
    rotary = DeepseekV4RotaryEmbedding(config)
    x = torch.randn(2, 29, 32)
    start = 0
    with torch.no_grad():
        for n in [7, 1, 1, 1, 9, 1, 1, 8]:
            part, positions = x[:, start:start + n], torch.arange(start, start + n)[None]
            mask = create_sliding_window_causal_mask(config=config, inputs_embeds=part, attention_mask=None,
                                                     cache=theirs_cache, position_ids=positions)
            embeddings = {name: rotary(part, positions, name) for name in ("main", "compress")}
            theirs = layer(part, embeddings, positions, mask, cache=theirs_cache)[0]
            torch.testing.assert_close(ours(part, cache=ours_cache), theirs, rtol=0, atol=1e-5)
            start += n


def test_query_blocks_equal_one_call(monkeypatch):
    """Long prefills run in blocks of queries: the same output as one call (blocks of 1 query here)."""
    module = CompressedAttention.from_transformers(_layer("csa", 6))
    x = torch.randn(2, 21, 32)
    with torch.no_grad():
        whole = module(x)
        monkeypatch.setattr(compressed, "BLOCK_SCORES", 1)
        torch.testing.assert_close(module(x), whole, rtol=0, atol=1e-6)


def _expected_nbytes(kind, B, length, *, D=16, Di=8, rate, window=WINDOW):
    """Bytes the cache must hold, counted from the definition (fp32)."""
    held = min(length, window - 1) * D
    if kind == "sliding":
        return 4 * B * held
    series = 2 if kind == "csa" else 1
    entries, pending = length // rate, length % rate
    main = entries * D + pending * 2 * series * D + (2 * rate * D if kind == "csa" and entries else 0)
    index = (entries * Di + pending * 2 * 2 * Di + (2 * rate * Di if entries else 0)) if kind == "csa" else 0
    return 4 * B * (held + main + index)


@pytest.mark.parametrize("kind", ["csa", "hca", "sliding"])
def test_nbytes_counts_what_the_cache_holds(kind):
    module = CompressedAttention.from_transformers(_layer(kind, 0))
    rate = module.compress_rate or 1
    cache = module.new_cache(2)
    assert cache.nbytes == 0
    with torch.no_grad():
        for length, n in ((3, 3), (9, 6), (10, 1), (17, 7)):
            module(torch.randn(2, n, 32), cache=cache)
            assert cache.nbytes == _expected_nbytes(kind, 2, length, rate=rate), length
    cache.reset()
    assert cache.nbytes == 0 and cache.length == 0


@pytest.mark.parametrize("kind", ["csa", "hca", "sliding"])
def test_cache_pins_no_larger_storage(kind):
    """Regression: the open window's tokens, the overlap and the window keys were views of the whole
    prefill's projections, so the cache kept all of them alive while nbytes counted the views. The
    storages it holds now add up to nbytes."""
    module = CompressedAttention.from_transformers(_layer(kind, 0))
    cache = module.new_cache(2)
    with torch.no_grad():
        module(torch.randn(2, 27, 32), cache=cache)
    state = cache._state
    streams = [state.main] + ([state.index] if state.index is not None else [])
    tensors = [state.window] + [getattr(stream, name) for stream in streams
                                for name in ("pending_kv", "pending_gate", "carry_kv", "carry_gate", "entries")]
    held = sum(t.untyped_storage().nbytes() for t in tensors if t is not None)
    assert held == cache.nbytes > 0


def _state(cache: CompressedCache):
    return cache._state


def test_a_failed_step_leaves_the_cache_unchanged(monkeypatch):
    module = CompressedAttention.from_transformers(_layer("csa", 7))
    x = torch.randn(1, 16, 32)
    cache = module.new_cache(1)
    with torch.no_grad():
        module(x[:, :9], cache=cache)
        before = _state(cache)
        with pytest.raises(TypeError, match="dtype"):
            module(x[:, 9:10].double(), cache=cache)
        with pytest.raises(ValueError, match="x must be"):
            module(x[:, 9:10, :7], cache=cache)

        def broken(*args, **kwargs):
            raise RuntimeError("kernel failed")
        with monkeypatch.context() as patch:
            patch.setattr(compressed, "attention", broken)
            with pytest.raises(RuntimeError, match="kernel failed"):
                module(x[:, 9:12], cache=cache)
        assert _state(cache) is before and cache.length == 9
        rest = torch.cat([module(x[:, t:t + 1], cache=cache) for t in range(9, 16)], 1)
        torch.testing.assert_close(rest, module(x)[:, 9:], rtol=0, atol=1e-5)


def test_no_tokens():
    module = CompressedAttention.from_transformers(_layer("hca", 0))
    cache = module.new_cache(2)
    with torch.no_grad():
        module(torch.randn(2, 3, 32), cache=cache)
        before = _state(cache)
        out = module(torch.randn(2, 0, 32), cache=cache)
    assert out.shape == (2, 0, 32) and _state(cache) is before


@pytest.mark.parametrize("kind", ["csa", "hca", "sliding"])
def test_nan_token_reaches_only_later_queries(kind):
    """A NaN token is read only by the queries after it (transformers' eager adds its -inf mask to
    the NaN scores and spreads NaN to every query, so the reference here is causality itself)."""
    module = CompressedAttention.from_transformers(_layer(kind, 0))
    x = torch.randn(2, 20, 32)
    x[1, 11] = float("nan")
    with torch.no_grad():
        out = module(x)
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, :11]).all()
    assert out[1, 11].isnan().all()


def test_bfloat16_close_to_float32():
    module = CompressedAttention.from_transformers(_layer("hca", 0))
    x = torch.randn(1, 19, 32)
    with torch.no_grad():
        exact = module(x)
        low = module.to(torch.bfloat16)(x.bfloat16())
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), exact, rtol=0.05, atol=0.1)


# ---------------------------------------------------------------------- memory: never T * T
class _Largest(TorchDispatchMode):
    """The largest dense tensor any operator returns (elements). A sparse tensor (the top-k kernel's
    sampled scores) reports its dense shape but holds only its values, which are counted."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                held = t.numel() if t.layout == torch.strided else t.values().numel()
                self.largest = max(self.largest, held)
        return out


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_no_tensor_of_t_squared_elements(kind):
    """At T=2048 no operator of ours returns an eighth of T*T elements (the largest are a block of
    index scores, at most ``BLOCK_SCORES``, and the scores over the listed keys, H*T*(window + n + 1));
    transformers' eager returns T*T and more (so the check can fail)."""
    T = 2048
    config = _config(hidden_size=16, num_attention_heads=2, head_dim=8, index_n_heads=2, index_head_dim=8,
                     index_topk=8, q_lora_rank=8, o_lora_rank=4, sliding_window=16,
                     compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32})
    layer = _layer(kind, 0, config)
    ours = CompressedAttention.from_transformers(layer)
    x = torch.randn(1, T, 16)
    with torch.no_grad():
        with _Largest() as ours_seen:
            ours(x)
        with _Largest() as theirs_seen:
            _theirs(layer, x)
    assert theirs_seen.largest >= T * T
    assert ours_seen.largest < T * T // 8, ours_seen.largest


# ---------------------------------------------------------------------- refusals
def test_refusals_are_named():
    with pytest.raises(TypeError, match="DeepseekV4Attention, got Linear"):
        CompressedAttention.from_transformers(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        CompressedAttention.from_transformers(_layer("hca", 0, _config(attention_dropout=0.1)))
    options = dict(head_dim=8, rope_dim=4, q_rank=8, o_groups=1, o_rank=8, window=3)
    with pytest.raises(ValueError, match="kind"):
        CompressedAttention(16, 2, kind="dense", **options)
    with pytest.raises(ValueError, match="rope_dim must be even"):
        CompressedAttention(16, 2, **{**options, "rope_dim": 3})
    with pytest.raises(ValueError, match="rope_dim must be even and at most head_dim and index_dim = 2"):
        CompressedAttention(16, 2, kind="csa", index_dim=2, **options)
    with pytest.raises(ValueError, match="topk=4 has no meaning for kind='hca'"):
        CompressedAttention(16, 2, kind="hca", topk=4, **options)
    with pytest.raises(ValueError, match="compress_rate=4 has no meaning for kind='sliding'"):
        CompressedAttention(16, 2, kind="sliding", compress_rate=4, **options)
    with pytest.raises(ValueError, match="compress_rate"):
        CompressedAttention(16, 2, kind="hca", compress_rate=0, **options)
    with pytest.raises(ValueError, match="rope_base"):
        CompressedAttention(16, 2, kind="hca", rope_base=0.0, **options)
    assert CompressedAttention(16, 2, kind="hca", **options).compress_rate == 128  # V4's default
    with pytest.raises(ValueError, match="o_groups=3"):
        CompressedAttention(16, 2, **{**options, "o_groups": 3})
    with pytest.raises(ValueError, match="window"):
        CompressedAttention(16, 2, **{**options, "window": 0})
    hca = CompressedAttention(16, 2, kind="hca", compress_rate=2, **options)
    csa = CompressedAttention(16, 2, kind="csa", compress_rate=2, topk=2, index_heads=1, index_dim=4, **options)
    x = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="kind, head_dim, window, index_dim"):
        hca(x, cache=csa.new_cache(1))
    with pytest.raises(ValueError, match="batch 2"):
        hca(x, cache=hca.new_cache(2))
    with pytest.raises(TypeError, match="cache holds torch.float64"):
        hca(x, cache=hca.new_cache(1, dtype=torch.float64))
    with pytest.raises(TypeError, match="CompressedCache"):
        hca(x, cache=object())
    with pytest.raises(TypeError, match="written by its CompressedAttention"):
        hca.new_cache(1).extend(x, x)
    with pytest.raises(TypeError, match="floating-point"):
        hca(torch.ones(1, 2, 16, dtype=torch.long))


def test_dynamic_rotary_is_refused():
    layer = _layer("hca", 0)
    layer.config.rope_parameters["compress"]["rope_type"] = "dynamic"
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        CompressedAttention.from_transformers(layer)


def test_doctests():
    result = doctest.testmod(compressed, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
