"""Tiny random transformers checkpoints saved to a directory (no hub): GPT-2, Llama, BERT, RoBERTa
(positions from padding_idx + 1), Gemma 2, BLOOM (which computes its attention in its own layers,
not through transformers' interface).

Each gets a word-level tokenizer over WORDS (tokenizer.json, through transformers' fast tokenizer),
so texts made of those words tokenize one token per word.
"""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["the", "chef", "made", "a", "meal", "and", "it", "was", "good", "wine", "with", "served"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SIZES = dict(hidden=32, layers=2, heads=4, positions=64)


def _tokenizer(directory: Path, *, bert: bool) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bert:
        tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                           special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(directory)


def _config(kind: str):
    h, n, heads, positions = SIZES["hidden"], SIZES["layers"], SIZES["heads"], SIZES["positions"]
    vocab = len(SPECIALS) + len(WORDS)
    if kind == "gpt2":
        return transformers.GPT2Config(vocab_size=vocab, n_embd=h, n_layer=n, n_head=heads, n_positions=positions)
    if kind == "roberta":  # positions start at pad_token_id + 1: 64 rows take 63 tokens
        return transformers.RobertaConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
                                          intermediate_size=2 * h, max_position_embeddings=positions, pad_token_id=0)
    if kind == "bert":
        return transformers.BertConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
                                       intermediate_size=2 * h, max_position_embeddings=positions)
    common = dict(vocab_size=vocab, hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=2,
                  intermediate_size=2 * h, max_position_embeddings=positions, head_dim=h // heads)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "gemma2":  # a logit soft-cap (attnlab.scores.softcap) and sliding-window layers
        return transformers.Gemma2Config(**common, attn_logit_softcapping=50.0, query_pre_attn_scalar=h // heads)
    if kind == "bloom":  # ALiBi inside BloomAttention: attn_implementation never reaches attnlab
        return transformers.BloomConfig(vocab_size=vocab, hidden_size=h, n_layer=n, n_head=heads)
    raise ValueError(kind)


MODEL_CLASSES = {"gpt2": "GPT2LMHeadModel", "bert": "BertModel", "roberta": "RobertaModel", "llama": "LlamaForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "bloom": "BloomForCausalLM"}


def save_tiny(kind: str, directory: Path) -> Path:
    """A tiny random ``kind`` model and its tokenizer, saved in ``directory``."""
    import torch

    torch.manual_seed(0)
    model = getattr(transformers, MODEL_CLASSES[kind])(_config(kind)).eval()
    model.save_pretrained(directory)
    _tokenizer(directory, bert=kind in ("bert", "roberta"))
    return directory
