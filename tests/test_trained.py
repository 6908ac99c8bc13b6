"""Word pieces merged into words: checked against a direct loop over the definition."""

import pytest
import torch

from attnlab.lab.trained import WordAttention, best_head, count_heads, merge_pieces, pad_heads, piece_groups

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


def test_layers_with_fewer_heads_get_no_links_and_never_win():
    full = _weights(heads=3).float()
    ragged = pad_heads([full[0, :1], full[1]])  # layer 0 has 1 head, layer 1 has 3
    view = WordAttention.from_pieces(ragged, PIECES, WORD_IDS)
    assert view.heads_per_layer == (1, 3) and view.heads == 3
    query = view.index("it")
    table = view.top_links(query)
    assert [len(row) for row in table] == [1, 3]
    assert all(link.weight == link.weight for row in table for link in row)  # no NaN link
    for link in view.strongest_heads(query) + [view.link(query, 1)]:
        assert (link.layer, link.head) not in {(0, 1), (0, 2)}
        key = view.words.index(link.word)
        real = torch.cat([view.weights[0, :1, query, key], view.weights[1, :, query, key]])
        assert link.weight == pytest.approx(float(real.max()))


def test_padding_counting_and_the_best_head_of_ragged_tables():
    table = pad_heads([torch.tensor([0.2]), torch.tensor([0.1, 0.3])])
    assert count_heads(table) == (1, 2) and bool(table[0, 1].isnan())
    assert int(torch.argmax(table)) == 1  # torch's argmax takes the missing head for the best ...
    assert best_head(table) == (1, 1)  # ... best_head does not
    uniform = torch.rand(2, 3, 4, 4)
    assert torch.equal(pad_heads(list(uniform)), uniform) and count_heads(uniform) == (3, 3)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="piece_weights must be"):
        WordAttention.from_pieces(torch.ones(2, 2, 3, 3), PIECES, WORD_IDS)
    with pytest.raises(ValueError, match="groups must cover"):
        merge_pieces(torch.ones(3, 3), [[0], [1]])
