"""Word pieces merged into words: checked against a direct loop over the definition."""

import pytest
import torch

from attnlab.trained import WordAttention, merge_pieces, piece_groups

PIECES = ["[CLS]", "the", "chef", "at", "##tend", "##s", "it", "[SEP]"]
WORD_IDS = [None, 0, 1, 2, 2, 2, 3, None]


def _weights(layers=2, heads=3, t=len(PIECES), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(layers, heads, t, t, generator=gen, dtype=torch.float64), dim=-1)


def test_merge_is_sum_over_key_pieces_and_mean_over_query_pieces():
    weights = _weights()
    groups = piece_groups(WORD_IDS)
    merged = merge_pieces(weights, groups)
    for a, qa in enumerate(groups):
        for b, kb in enumerate(groups):
            expected = sum(weights[..., i, j] for i in qa for j in kb) / len(qa)
            torch.testing.assert_close(merged[..., a, b], expected)
    torch.testing.assert_close(merged.sum(-1), torch.ones(2, 3, len(groups), dtype=torch.float64))


def test_words_specials_and_query_lookup():
    view = WordAttention.from_pieces(_weights().float(), PIECES, WORD_IDS)
    assert view.words == ["[CLS]", "the", "chef", "attends", "it", "[SEP]"]
    assert view.special == [True, False, False, False, False, True]
    assert view.index(None) == 4 and view.index("ATTENDS") == 3
    with pytest.raises(ValueError, match="'wine' is not in the sentence; its words are: the, chef, attends, it"):
        view.index("wine")


def test_tables_agree_with_a_brute_force_search():
    view = WordAttention.from_pieces(_weights().float(), PIECES, WORD_IDS)
    query = view.index("it")
    for hide in (False, True):
        keys = [j for j in range(6) if not (hide and view.special[j])]
        table = view.top_links(query, hide_special=hide)
        for layer in range(2):
            for head in range(3):
                best = max(keys, key=lambda j: float(view.weights[layer, head, query, j]))
                assert table[layer][head].word == view.words[best]
        for link in view.strongest_heads(query, hide_special=hide):
            key = view.words.index(link.word)
            assert key in keys and key != query
            assert link.weight == pytest.approx(float(view.weights[:, :, query, key].max()))
            assert float(view.weights[link.layer, link.head, query, key]) == pytest.approx(link.weight)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="piece_weights must be"):
        WordAttention.from_pieces(torch.ones(2, 2, 3, 3), PIECES, WORD_IDS)
    with pytest.raises(ValueError, match="groups must cover"):
        merge_pieces(torch.ones(3, 3), [[0], [1]])
