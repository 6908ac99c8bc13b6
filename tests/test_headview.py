"""The head view and the layers x heads grid draw exactly the weights they are given."""

import math

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
import torch

from attnlab.lab.trained import pad_heads
from attnlab.lab.viz.headview import HEAD_COLORS, head_color, head_grid, head_view, line_alpha

TOKENS = ["[CLS]", "the", "cat", "sat", "[SEP]"]


def _weights(heads=3, t=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(heads, t, t, generator=gen), dim=-1)  # (H, T, T)


def _lines(fig):
    return {line.get_gid(): line for line in fig.axes[0].lines}


def test_each_line_has_the_opacity_of_its_weight_and_its_head_colour():
    weights = _weights()
    fig = head_view(weights, TOKENS, heads=[0, 2], focus=3)
    lines = _lines(fig)
    assert lines, "no line drawn"
    for gid, line in lines.items():
        h, i, j = (int(part[1:]) for part in gid.split("-"))
        assert i == 3 and h in (0, 2)
        assert math.isclose(line.get_alpha(), float(weights[h, i, j]) / math.sqrt(2), rel_tol=1e-6)
        assert line.get_color() == head_color(h)
        assert tuple(line.get_xdata()) == (0.0, 1.0) and tuple(line.get_ydata()) == (-i, -j)
    drawn = {(int(g.split("-")[0][1:]), int(g.split("-")[2][1:])) for g in lines}
    strong = {(h, j) for h in (0, 2) for j in range(5) if line_alpha(weights[h, 3, j], heads_shown=2) >= 0.02}
    assert drawn == strong  # every visible link is drawn, and only those


def test_hidden_positions_get_no_lines_but_keep_their_labels():
    fig = head_view(_weights(), TOKENS, hidden=[0, 4])
    for gid in _lines(fig):
        _, q, k = gid.split("-")
        assert int(q[1:]) not in (0, 4) and int(k[1:]) not in (0, 4)
    labels = [text.get_text() for text in fig.axes[0].texts]
    assert labels.count("[CLS]") == 2 and labels.count("[SEP]") == 2


def test_without_focus_every_query_is_drawn_at_half_strength():
    weights = _weights(heads=1)
    lines = _lines(head_view(weights, TOKENS))
    assert {int(g.split("-")[1][1:]) for g in lines} == set(range(5))
    for gid, line in lines.items():
        _, q, k = gid.split("-")
        assert math.isclose(line.get_alpha(), 0.5 * float(weights[0, int(q[1:]), int(k[1:])]), rel_tol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(weights=torch.zeros(2, 3, 4)), "weights must be a \\(H, T, T\\)"),
    (dict(tokens=["a"]), "tokens must have one label per position"),
    (dict(heads=[3]), "heads must be in \\[0, 3\\)"),
    (dict(focus=9), "focus must be in \\[0, 5\\)"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    args = dict(weights=_weights(), tokens=TOKENS) | kwargs
    weights, tokens = args.pop("weights"), args.pop("tokens")
    with pytest.raises(ValueError, match=match):
        head_view(weights, tokens, **args)


def _panels(fig):
    """The heatmap panels of a head grid (its last axes is the colour bar)."""
    bar = fig.axes[-1]
    assert bar.get_label() == "colour bar" and bar.get_ylabel().startswith("attention weight"), \
        "the last axes must be the colour bar"
    assert (bar.get_ylim()[0], bar.get_ylim()[1]) == (0.0, 1.0)
    return fig.axes[:-1]


def test_grid_shows_every_layer_and_head_with_its_own_weights():
    weights = torch.stack([_weights(seed=s) for s in range(2)])  # (L=2, H=3, T, T)
    fig = head_grid(weights, TOKENS)
    assert len(_panels(fig)) == 6
    for index, ax in enumerate(_panels(fig)):
        layer, head = divmod(index, 3)
        shown = torch.as_tensor(ax.images[0].get_array())
        torch.testing.assert_close(shown, weights[layer, head], rtol=0, atol=0)
    with pytest.raises(ValueError, match="\\(L, H, T, T\\)"):
        head_grid(weights[0], TOKENS)


def test_grid_of_layers_with_different_head_counts_leaves_the_missing_heads_empty():
    per_layer = [_weights(heads=1, seed=0), _weights(heads=3, seed=1), _weights(heads=2, seed=2)]
    fig = head_grid(pad_heads(per_layer), TOKENS)  # (L=3, H=3, T, T), NaN where a layer has fewer heads
    cells = [(layer, head) for layer, w in enumerate(per_layer) for head in range(w.shape[0])]
    assert len(_panels(fig)) == len(cells) == 6  # no panel, not even an empty one, for a missing head
    for (layer, head), ax in zip(cells, _panels(fig)):
        assert ax.get_subplotspec().num1 == layer * 3 + head  # in its own row and column
        torch.testing.assert_close(torch.as_tensor(ax.images[0].get_array()), per_layer[layer][head], rtol=0, atol=0)
        assert ax.get_title() == f"head {head}"  # every panel says which head it is
    assert [ax.get_ylabel() for ax in _panels(fig) if ax.get_ylabel()] == [
        "layer 0\n(1 head)", "layer 1\n(3 heads)", "layer 2\n(2 heads)"]  # rows say why they are short


def test_grid_captions_each_real_head_and_refuses_captions_of_the_wrong_shape():
    per_layer = [_weights(heads=2, seed=0), _weights(heads=1, seed=1)]
    captions = [["previous-token 0.93", "no role"], ["induction 0.88\naccuracy if ablated: 12.0 %"]]
    fig = head_grid(pad_heads(per_layer), TOKENS, captions=captions, title="a title\non two lines")
    assert [ax.get_title() for ax in _panels(fig)] == [
        "head 0\nprevious-token 0.93", "head 1\nno role", "head 0\ninduction 0.88\naccuracy if ablated: 12.0 %"]
    with pytest.raises(ValueError, match=r"captions must give one text per head of each layer \[2, 1\], got \[2, 2\]"):
        head_grid(pad_heads(per_layer), TOKENS, captions=[["a", "b"], ["c", "d"]])


def test_grid_panels_titles_and_colour_bar_do_not_overlap():
    """The layout keeps every text and panel apart, for a few heads or many, with or without token labels."""
    for layers, heads, tokens in ((2, 2, 64), (6, 12, len(TOKENS)), (1, 1, len(TOKENS))):
        weights = torch.softmax(torch.randn(layers, heads, tokens, tokens, generator=torch.Generator().manual_seed(0)),
                                dim=-1)
        labels = TOKENS if tokens == len(TOKENS) else [str(i) for i in range(tokens)]
        captions = [["previous-token 0.93\naccuracy if ablated: 1.0 %"] * heads] * layers
        fig = head_grid(weights, labels, captions=captions, title="a title\nline two")
        renderer = FigureCanvasAgg(fig).get_renderer()
        boxes = [ax.get_window_extent(renderer) for ax in fig.axes]  # panels and the colour bar
        boxes += [ax.title.get_window_extent(renderer) for ax in _panels(fig)]
        boxes += [fig._suptitle.get_window_extent(renderer)]
        for i, a in enumerate(boxes):
            assert 0 <= a.x0 and a.x1 <= fig.bbox.width and 0 <= a.y0 and a.y1 <= fig.bbox.height, (layers, heads, i)
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), (layers, heads, a, b)
        assert min(fig.bbox.width, fig.bbox.height) >= 200


def test_colours_are_distinct_for_twelve_heads():
    assert len(set(HEAD_COLORS)) == 12 and head_color(12) == head_color(0)


def test_the_head_view_stores_the_links_it_draws_and_each_rows_strongest():
    from attnlab.lab.viz.headview import MIN_ALPHA
    from attnlab.lab.viz.html import drawn_links

    gen = torch.Generator().manual_seed(0)
    weights = torch.softmax(torch.randn(60, 60, generator=gen) * 3, dim=-1)
    hidden = torch.zeros(60, dtype=torch.bool)
    hidden[0] = True  # a special word, hidden: never the strongest link
    rows = drawn_links(weights, hidden)
    for q, row in enumerate(rows):
        stored = dict(zip(row[::2], row[1::2]))
        drawable = {k for k in range(60) if weights[q, k] >= MIN_ALPHA}
        others = weights[q].clone()
        others[q], others[0] = -1, -1
        strongest = int(others.argmax())
        assert set(stored) == drawable | {strongest}
        assert all(abs(w - float(weights[q, k])) <= 5e-5 for k, w in stored.items())
    assert sum(len(row) for row in rows) < 60 * 60  # far fewer than every weight
