"""GPT's differential (D), gated (Q), sparse top-k (T) and native sparse (S) layers: built with
nn.DifferentialAttention / nn.GatedAttention / nn.TopkAttention / nn.NativeSparseAttention, decoding
with their caches equals the full forward, options they cannot honour are refused, and
`attnlab train` trains and resumes such a model."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attnlab.lab.cli import app
from attnlab.models import GPT
from attnlab.models.gpt import INDEX_LOSS_WEIGHT
from attnlab.nn import BranchCache, DifferentialAttention, GatedAttention, NativeSparseAttention, TopkAttention
from attnlab.nn.differential import lambda_init_for


def _gpt(pattern: str, **options) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=23, max_len=40, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, positions="rope",
               layer_pattern=pattern, **options).eval()


def test_layers_are_the_differential_and_gated_modules_with_the_layers_lambda():
    model = _gpt("DQGN")
    assert [type(block.attn) for block in model.blocks[:2]] == [DifferentialAttention, GatedAttention]
    layer = model.blocks[0].attn
    expected = lambda_init_for(0)  # DiffLlama's lambda_init of layer 0 (0-based, as transformers)
    assert abs(float(getattr(layer, "lambda_init")) - expected) < 1e-12


def test_sparse_layers_are_topk_and_native_sparse_modules_in_the_papers_proportions():
    model = _gpt("TSGN", topk=3, nsa_block=8)
    topk, nsa = model.blocks[0].attn, model.blocks[1].attn
    assert type(topk) is TopkAttention and type(nsa) is NativeSparseAttention
    assert topk.indexer.topk == 3 and topk.index_loss_weight == INDEX_LOSS_WEIGHT > 0
    sizes = (nsa.compress_block, nsa.compress_stride, nsa.select_block, nsa.select_count, nsa.select_local, nsa.window)
    assert sizes == (4, 2, 8, 16, 2, 64)  # nsa_block=64 would give the paper's 32, 16, 64, 16, 2, 512
    assert all(isinstance(c, BranchCache) for c in model.new_cache(1)[:2])


def _sizes(pattern: str) -> dict:
    return {name: value for name, letter, value in (("chunk", "C", 4), ("topk", "T", 3), ("nsa_block", "S", 4))
            if letter in pattern}


@pytest.mark.parametrize("pattern", ["DG", "QN", "DQCN", "TG", "SN", "TSCN"])
def test_cached_decoding_equals_the_full_forward(pattern):
    model = _gpt(pattern, **_sizes(pattern))
    x = torch.randint(0, 23, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x)
        caches = model.new_cache(2, 40)
        parts = [model(x[:, :6], caches=caches)] + [model(x[:, i:i + 1], caches=caches) for i in range(6, 13)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    assert model.generate(x[:1, :5], 5).tolist() == model.generate(x[:1, :5], 5, use_cache=False).tolist()


def test_options_these_layers_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="dropout_p=0.1: differential"):
        _gpt("D", dropout_p=0.1)
    with pytest.raises(ValueError, match="softcap: not available on gated"):
        _gpt("Q", softcap=5.0)
    with pytest.raises(ValueError, match="sinks: not available on differential"):
        _gpt("DG", sinks=True)
    with pytest.raises(ValueError, match="^return_weights: differential"):
        _gpt("DG")(torch.tensor([[1, 2, 3]]), return_weights=True)
    with pytest.raises(ValueError, match="dropout_p=0.1: native sparse .NSA., sparse top-k"):
        _gpt("TS", topk=2, nsa_block=4, dropout_p=0.1)
    with pytest.raises(ValueError, match="positions='alibi': not available on sparse top-k"):
        GPT(vocab_size=5, max_len=8, d_model=8, num_layers=1, num_heads=2, positions="alibi", layer_pattern="T",
            topk=2)
    with pytest.raises(ValueError, match="^return_weights: native sparse"):
        _gpt("S", nsa_block=4)(torch.tensor([[1, 2, 3]]), return_weights=True)
    with pytest.raises(ValueError, match="nsa_block must be a multiple of 4"):
        _gpt("S", nsa_block=6)
    with pytest.raises(ValueError, match="give topk"):
        _gpt("T")
    with pytest.raises(ValueError, match="topk=3 is for T layers"):
        _gpt("G", topk=3)
    with pytest.raises(ValueError, match="page_size"):
        _gpt("T", topk=2).new_cache(1, page_size=4)
    ragged = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    with pytest.raises(ValueError, match="page_size"):  # prompts of different lengths need paged caches
        _gpt("S", nsa_block=4).generate(ragged, 2)


def test_training_a_topk_layer_teaches_its_indexer():
    """The language-model loss cannot reach the T layers' indexer (its indices are integers): in
    training, its gradient is exactly INDEX_LOSS_WEIGHT times that of its KL loss on the layer's
    input, the other weights get the language-model gradient alone, and the logits are unchanged."""
    model = _gpt("TG", topk=3)
    ids = torch.randint(0, 23, (2, 16), generator=torch.Generator().manual_seed(2))
    layer = model.blocks[0].attn
    indexer = list(layer.indexer.parameters())

    def lm_loss() -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    model.eval()
    eval_logits = model(ids).detach()
    lm_loss().backward()
    lm_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert all(p.grad is None for p in indexer)
    model.zero_grad(set_to_none=True)
    layer.indexer_loss(model.blocks[0].norm_attn(model.tok_emb(ids))).backward()
    kl_grads = [p.grad.clone() for p in indexer]
    model.zero_grad(set_to_none=True)
    assert layer.index_loss_weight == INDEX_LOSS_WEIGHT > 0
    layer.index_loss_weight = 0.25  # any weight scales the indexer's gradient, and nothing else
    model.train()
    torch.testing.assert_close(model(ids), eval_logits, rtol=0, atol=0)
    lm_loss().backward()
    for p, kl in zip(indexer, kl_grads):
        torch.testing.assert_close(p.grad, 0.25 * kl)
    for name, grad in lm_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad)


def test_config_round_trips(tmp_path):
    model = _gpt("DQTS", topk=2, nsa_block=4)
    model.save_pretrained(tmp_path / "m")
    loaded = GPT.from_pretrained(tmp_path / "m").eval()
    x = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9]])
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["layer_pattern"], config["topk"], config["nsa_block"]) == ("DQTS", 2, 4)
    torch.testing.assert_close(loaded(x), model(x))


@pytest.mark.parametrize("pattern", [["DQ"], ["TS", "--topk", "4", "--nsa-block", "4"]])
def test_train_cli_trains_the_2026_layers(tmp_path, pattern):
    from attnlab.lab.bench.variants import tiny_corpus

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(tiny_corpus(200), encoding="utf-8")
    args = ["train", "--task", "text", "--text", str(corpus), "--steps", "4", "--layers", "2", "--d-model", "16",
            "--heads", "2", "--positions", "rope", "--layer-pattern", *pattern, "--out", str(tmp_path / "run")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "No head scores or ablation" in result.output and (tmp_path / "run" / "curves.png").is_file()
    generated = CliRunner().invoke(app, ["generate", "--model", str(tmp_path / "run"), "--prompt", "sam gave",
                                         "--max-new-tokens", "3"])
    assert generated.exit_code == 0, generated.output


@pytest.mark.parametrize("pattern", ["D", "Q", "T", "S"])
def test_an_empty_input_gives_empty_logits(pattern):
    """No token in: (B, 0, vocab) out, with and without a cache (D, Q and T reshaped with -1 and failed)."""
    model = _gpt(pattern, **_sizes(pattern))
    empty = torch.zeros(2, 0, dtype=torch.long)
    assert model(empty).shape == (2, 0, 23)
    caches = model.new_cache(2)
    assert model(empty, caches=caches).shape == (2, 0, 23) and caches[0].length == 0
