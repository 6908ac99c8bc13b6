"""Inline views (attnlab.show, a trace's _repr_html_, the model and generation views) as HTML text.

What a browser does with them is tests/test_views_browser.py; here: which view each input gets,
that several views never share an id, that nothing names the network, that the weights a view
carries decode to the weights given, and that bad input is refused naming the argument.
"""

from __future__ import annotations

import base64
import html
import json
import re

import numpy as np
import pytest
import torch

import attnlab
from attnlab.lab.explain import trace
from attnlab.lab.trained import WordAttention, pad_heads
from attnlab.lab.viz.views import GRID, WALK_TOKENS, encode_weights, generation_view, model_view, show

GEN = torch.Generator().manual_seed(0)


def _softmax(*shape):
    return torch.softmax(torch.randn(*shape, generator=GEN), dim=-1)


def _ids(page: str) -> list[str]:
    return re.findall(r'\bid="([^"]+)"', page)


def _model_data(page: str) -> dict:
    return json.loads(re.search(r'<script id="[^"]*attnlab-model" type="application/json">(.*?)</script>',
                                page).group(1))


def _decode(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<u2").astype(np.float64) / 65535


def test_show_is_the_lab_behind_a_lazy_attribute():
    assert attnlab.show is show


@pytest.mark.parametrize("shape, role", [((4, 4), "walk"), ((3, 4, 4), "walk"), ((2, 3, 4, 4), "model"),
                                         ((1, WALK_TOKENS + 1, WALK_TOKENS + 1), "model")])
def test_show_picks_the_view_for_the_shape(shape, role):
    tokens = [f"w{i}" for i in range(shape[-1])]
    page = show(_softmax(*shape), tokens)._repr_html_()
    assert f"data-attnlab-{role}" in page and page.startswith('<div class="attnlab inline"')


def test_trace_word_attention_and_views_render_inline():
    t = trace(mode="multihead", heads=2)
    assert "data-attnlab-walk" in t._repr_html_() and "data-attnlab-walk" in show(t)._repr_html_()
    view = WordAttention.from_pieces(_softmax(2, 2, 4, 4), ["[CLS]", "a", "b", "[SEP]"], [None, 0, 1, None])
    assert "data-attnlab-heads" in show(view)._repr_html_()


def test_several_views_on_one_page_share_no_id():
    t = trace(mode="multihead", heads=3, causal=True)
    view = show(_softmax(2, 2, 5, 5), list("abcde"))
    pages = [t._repr_html_(), t._repr_html_(), view._repr_html_(), view._repr_html_(),
             show(_softmax(2, 5, 5), list("abcde"))._repr_html_()]
    ids = [i for page in pages for i in _ids(page)]
    assert len(ids) > 40 and len(ids) == len(set(ids))
    for page in pages:  # every id and every url(#...) reference of a view carries its own prefix
        prefix = re.search(r'data-prefix="([^"]+)"', page).group(1)
        assert all(i.startswith(prefix) for i in _ids(page))
        assert all(ref.startswith(prefix) for ref in re.findall(r"url\(#([^)]+)\)", page))


@pytest.mark.parametrize("make", [lambda: trace()._repr_html_(), lambda: show(_softmax(2, 2, 9, 9))._repr_html_(),
                                  lambda: generation_view(_softmax(1, 2, 6, 6), list("abcdef"),
                                                          prompt_length=4)._repr_html_()])
def test_views_are_self_contained(make):
    page = make()
    assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", page)  # no URL to load anything from
    assert "<link" not in page and " src=" not in page and "@import" not in page
    assert page.count("<style>") == 1 and "<script>" in page


def test_model_view_carries_the_weights():
    weights = pad_heads([_softmax(3, 7, 7), _softmax(2, 7, 7)])  # (L, H, T, T), layer 1 has 2 heads
    data = _model_data(model_view(weights, list("abcdefg"), layer=1, head=1)._repr_html_())
    assert data["heads"] == [3, 2] and data["n"] == 7 and data["block"] == 1 and (data["layer"], data["head"]) == (1, 1)
    real = torch.cat([weights[0].reshape(-1), weights[1, :2].reshape(-1)]).double().numpy()
    np.testing.assert_allclose(_decode(data["data"]), real, atol=1 / 65535)


def test_long_inputs_travel_in_blocks_that_keep_rows_summing_to_one():
    n_tokens = 2048
    weights = _softmax(1, 1, n_tokens, n_tokens)
    data = _model_data(show(weights[0], [str(i) for i in range(n_tokens)])._repr_html_())
    assert data["n"] == GRID and data["block"] == n_tokens // GRID and len(data["tokens"]) == n_tokens
    cells = _decode(data["data"]).reshape(GRID, GRID)
    expected = weights[0, 0].double().reshape(GRID, 8, GRID, 8).sum(dim=(1, 3)) / 8
    np.testing.assert_allclose(cells, expected.numpy(), atol=1 / 65535)
    np.testing.assert_allclose(cells.sum(axis=1), 1.0, atol=GRID / 65535)


def test_encode_weights_rounds_to_sixteen_bits():
    values = torch.tensor([0.0, 0.5, 1 / 3, 1.0])
    np.testing.assert_allclose(_decode(encode_weights(values)), values.double().numpy(), atol=0.5 / 65535)


HOSTILE = ["<!--", "<script>", "a</script>", "&amp;\u2028", "\u2029>"]


@pytest.mark.parametrize("make", [
    lambda: show(_softmax(5, 5), HOSTILE), lambda: show(_softmax(2, 2, 5, 5), HOSTILE),
    lambda: generation_view(_softmax(1, 2, 5, 5), HOSTILE, prompt_length=3),
    lambda: show(WordAttention.from_pieces(_softmax(2, 2, 7, 7), ["[CLS]", *HOSTILE, "[SEP]"],
                                           [None, 0, 1, 2, 3, 4, None])),
], ids=["walk", "model", "generation", "trained"])
def test_token_text_cannot_end_or_hide_the_script_payload(make):
    # Regression: "<!--" then "<script" in a token put the HTML parser in a state where "</script>"
    # no longer closed the JSON payload's element: the view showed nothing and raised nothing.
    page = make()._repr_html_()
    payloads = re.findall(r'<script id="[^"]*" type="application/json">(.*?)</script>', page, re.S)
    assert payloads
    for payload in payloads:
        assert not re.search("[<>&\u2028\u2029]", payload)  # nothing the HTML parser could read as markup
    texts = json.dumps([json.loads(payload) for payload in payloads], ensure_ascii=False)
    assert all(json.dumps(token, ensure_ascii=False)[1:-1] in texts for token in HOSTILE)  # read back unchanged


CONTROL = ["nul\x00", "esc\x1b", "del\x7f", "plain"]
PICTURED = ["nul\u2400", "esc\u241b", "del\u2421"]
RAW_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@pytest.mark.parametrize("make, labels", [
    (lambda: show(_softmax(4, 4), CONTROL), PICTURED), (lambda: show(_softmax(2, 2, 4, 4), CONTROL), PICTURED),
    (lambda: show(WordAttention.from_pieces(_softmax(2, 2, 6, 6), ["[CLS]", *CONTROL, "[SEP]"],
                                            [None, 0, 1, 2, 3, None])), PICTURED),
    (lambda: show(torch.ones(4, 4, dtype=torch.bool), title="mask\x00title"), ["mask\u2400title"]),
], ids=["walk", "model", "trained", "mask-title"])
def test_control_characters_in_token_text_are_shown_as_their_pictures(make, labels):
    # Regression: a NUL token went raw into the HTML (a parse error: the browser drops it) and into the
    # JSON payload as \u0000, which the script wrote into the page as an invisible character.
    page = make()._repr_html_()
    assert not RAW_CONTROL.search(page)
    assert not re.search(r"\\u00(0[0-8bcef]|1[0-9a-f])|\\u007f|\\[bf]", page)  # nor escaped in the JSON
    payloads = re.findall(r'<script id="[^"]*" type="application/json">(.*?)</script>', page, re.S)
    texts = html.unescape(page) + json.dumps([json.loads(p) for p in payloads], ensure_ascii=False)
    assert all(label in texts for label in labels), labels


def _trained_data(page: str) -> dict:
    return json.loads(re.search(r'attnlab-trained" type="application/json">(.*?)</script>', page, re.S).group(1))


def test_the_head_view_opens_on_the_head_whose_words_look_at_other_words():
    # Regression: show(word_attention) opened on layer 0, head 0 from the last unit, [SEP]: faint lines
    # of a head parked on the special tokens, whatever the model's heads did.
    words = ["[CLS]", "the", "chef", "made", "it", "[SEP]"]
    w = torch.zeros(2, 3, 6, 6)
    w[0, 0, :, 5] = 1.0  # parks on [SEP]
    w[0, 1] = torch.eye(6)  # each word on itself
    w[0, 2, :, 0] = 0.6
    w[0, 2, torch.arange(6), (torch.arange(6) + 1) % 6] = 0.4  # 0.4 to the next unit
    w[1, 0, :, 0] = 0.3
    w[1, 0, :, 2] = 0.7  # every word looks at "chef": the most word-to-word weight
    w[1, 1] = torch.full((6, 6), 1 / 6)
    w[1, 2, :, 5] = 1.0
    view = WordAttention.from_pieces(w, words, [None, 0, 1, 2, 3, None])
    shares = {}  # plain loops: over the words, their weight on the other words (not specials, not themselves)
    for layer in range(2):
        for head in range(3):
            per_word = [sum(float(w[layer, head, i, j]) for j in range(1, 5) if j != i) for i in range(1, 5)]
            shares[layer, head] = sum(per_word) / 4
    best = max(shares, key=shares.get)
    assert best == (1, 0) and view.informative_head() == best
    torch.testing.assert_close(view.word_shares(), torch.tensor([[shares[l, h] for h in range(3)] for l in range(2)]))
    data = _trained_data(show(view)._repr_html_())
    assert (data["layer"], data["focus"]) == (1, words.index("it"))
    page = show(view)._repr_html_()
    assert re.findall(r'class="hv-head" value="(\d)" checked', page) == ["0"]
    chosen = _trained_data(show(view, layer=0, head=2, row=2)._repr_html_())  # asked for: honoured
    assert (chosen["layer"], chosen["focus"]) == (0, 2)
    assert re.findall(r'value="(\d)" checked', show(view, layer=0)._repr_html_()) == ["2"]  # layer 0's best
    with pytest.raises(ValueError, match="tokens come with the WordAttention"):
        show(view, words)
    with pytest.raises(ValueError, match=r"head must be in \[0, 3\) for layer 1, got 3"):
        show(view, layer=1, head=3)


def test_the_model_view_reads_out_the_row_asked_for():
    page = model_view(_softmax(2, 3, 6, 6), list("abcdef"), layer=1, head=2, row=4)._repr_html_()
    data = json.loads(re.search(r'attnlab-model" type="application/json">(.*?)</script>', page, re.S).group(1))
    assert (data["layer"], data["head"], data["row"]) == (1, 2, 4)
    long = model_view(_softmax(1, 1, 600, 600), row=599)._repr_html_()  # 600 tokens in blocks of 3
    assert '"block":3' in long and '"row":199' in long
    with pytest.raises(ValueError, match=r"row must be a query position in \[0, 6\), got 6"):
        model_view(_softmax(1, 1, 6, 6), row=6)


@pytest.mark.parametrize("call, match", [
    (lambda: show([[0.5, 0.5]]), "weights must be a torch.Tensor"),
    (lambda: show(torch.rand(2, 3), ["a"]), "tokens must label"),
    (lambda: show(torch.rand(2, 2, 2, 2, 2)), "weights must be"),
    (lambda: model_view(_softmax(1, 2, 3, 3), list("ab")), "tokens must have one label"),
    (lambda: model_view(_softmax(1, 2, 3, 3), layer=0, head=2), "layer and head"),
    (lambda: generation_view(_softmax(1, 1, 3, 3), list("abc"), prompt_length=3), "prompt_length"),
    # Regression: empty and non-square weights raised a raw IndexError (or RuntimeError).
    (lambda: show(torch.zeros(0, 0)), r"weights must hold at least one head, query and key, got shape \(0, 0\)"),
    (lambda: show(torch.zeros(0, 3, 3)), r"weights must hold .* \(0, 3, 3\)"),
    (lambda: show(torch.zeros(2, 0, 0)), r"weights must hold .* \(2, 0, 0\)"),
    (lambda: show(torch.zeros(0, 2, 3, 3)), r"weights must hold .* \(0, 2, 3, 3\)"),
    (lambda: show(torch.zeros(1, 0, 3, 3)), r"weights must hold .* \(1, 0, 3, 3\)"),
    (lambda: model_view(torch.zeros(1, 1, 0, 0), []), r"weights must hold .* \(1, 1, 0, 0\)"),
    (lambda: show(torch.rand(3, 4)), r"weights of shape \(3, 4\) have 3 queries and 4 keys: give context_tokens"),
    (lambda: show(torch.rand(2, 3, 40), list("abc")), "give context_tokens"),
    (lambda: show(torch.full((3, 3), float("nan"))), "weights must be finite"),
    (lambda: show(torch.rand(3, 3), 5), "tokens must be a list of labels, got int"),
    (lambda: show(torch.rand(3, 4), list("abc"), context_tokens=4), "context_tokens must be a list"),
    (lambda: show(torch.rand(3, 4), list("abc"), context_tokens=list("xyz")),
     r"tokens and context_tokens must label the weights' rows and columns \(3, 4\), got 3 and 3"),
])
def test_bad_input_is_refused_naming_the_argument(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()
