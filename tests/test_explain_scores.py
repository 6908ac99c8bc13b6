"""``attnlab explain`` with a score mod and sinks: the trace's new steps, its views and the options.

References: fp64 formulas written here from the trace's recorded projections (Gemma 2's
``cap * tanh(s / cap)``, ALiBi's ``-slope * (i - j)``, gpt-oss's sink column), and
``attnlab.attention`` on the reference backend for the trace's output.
"""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

import attnlab
from attnlab import scores
from attnlab.lab.cli import app
from attnlab.lab.explain import trace
from attnlab.lab.viz.html import Weights, build_report, heads_view, walk_view

runner = CliRunner()
SENTENCE = "The sun rises in the east"


def _projections(t, h):
    return [t.step(name, h).tensor.double() for name in ("queries", "keys", "values")]


@pytest.mark.parametrize("mode, causal", [("multihead", True), ("multihead", False), ("cross", False)])
def test_trace_with_softcap_alibi_and_sinks_matches_fp64_formulas(mode, causal):
    heads = 2 if mode == "multihead" else 1
    slopes, sinks, cap = torch.tensor([0.5, 0.125][:heads]), torch.tensor([0.3, -1.0][:heads]), 0.4
    t = trace(SENTENCE, mode=mode, heads=heads if mode == "multihead" else None, causal=causal, seed=5,
              score_mod=scores.softcap(cap) + scores.alibi(slopes), sinks=sinks)
    tq, tk = len(t.tokens), len(t.context_tokens)
    i, j = torch.arange(tq).view(-1, 1), torch.arange(tk).view(1, -1)
    for h in range(heads):
        q, k, v = _projections(t, h)
        plain = q @ k.T / q.shape[-1] ** 0.5
        modded = cap * torch.tanh(plain / cap) - float(slopes[h]) * (i - j)  # (Tq, Tk)
        if causal:
            plain, modded = (s.masked_fill(j > i, float("-inf")) for s in (plain, modded))
        sink = torch.full((tq, 1), float(sinks[h]), dtype=torch.float64)
        with_sink = torch.softmax(torch.cat([modded, sink], -1), -1)  # (Tq, Tk + 1)
        plain_weights = torch.softmax(torch.cat([plain, sink], -1), -1)[:, :-1]
        step = lambda name: t.step(name, h).tensor.double()  # noqa: E731
        torch.testing.assert_close(step("modded_scores").masked_fill(torch.isinf(modded), float("-inf")),
                                   modded, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(step("plain_weights"), plain_weights, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(step("weights"), with_sink[:, :-1], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(step("weight_change"), with_sink[:, :-1] - plain_weights, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(step("sink_weights"), with_sink, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(t.sink_shares()[h].double(), with_sink[:, -1], atol=1e-6, rtol=1e-6)
        assert t.step("sink_weights", h).cols == (*t.context_tokens, "sink")
        assert float(t.sink_shares()[h].min()) > 0.01  # the sink really takes mass here


@pytest.mark.parametrize("score_mod", [scores.softcap(0.3), lambda s, b, h, i, j: s * (1 + h) - 0.1 * (i - j)])
def test_trace_output_equals_attnlab_attention_on_the_reference(score_mod):
    sinks = torch.tensor([0.5, -0.5, 2.0])
    t = trace(mode="multihead", heads=3, causal=True, seed=2, score_mod=score_mod, sinks=sinks)
    q, k, v = (torch.stack([_projections(t, h)[n] for h in range(3)])[None] for n in range(3))  # (1, H, T, D)
    expected = attnlab.attention(q, k, v, causal=True, score_mod=score_mod, sinks=sinks.double(),
                                 backend="reference")  # (1, H, T, Dv)
    out = torch.cat(list(expected[0]), dim=-1)  # (T, H * Dv), heads side by side
    torch.testing.assert_close(t.output.double(), out, atol=1e-6, rtol=1e-6)
    weights = attnlab.attention_weights(q, k, causal=True, score_mod=score_mod, sinks=sinks.double())
    torch.testing.assert_close(t.weights().double(), weights[0], atol=1e-6, rtol=1e-6)


def test_without_options_the_trace_keeps_its_steps():
    names = [s.name for s in trace(mode="causal").steps]
    assert not {"modded_scores", "plain_weights", "weight_change", "sink_weights"} & set(names)
    assert trace(mode="causal").sink_shares() is None


def test_a_number_for_sinks_gives_every_head_that_logit():
    t = trace(mode="multihead", heads=2, sinks=-1.5)
    assert t.sinks.tolist() == [-1.5, -1.5]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(sinks=torch.zeros(3)), ValueError, r"sinks must have shape \(Hq,\) = \(1,\)"),
    (dict(sinks=torch.zeros(1, dtype=torch.long)), TypeError, "sinks must have a floating-point dtype"),
    (dict(sinks=float("nan")), ValueError, "sinks must be a finite number"),
    (dict(sinks=torch.tensor([float("inf")])), ValueError, "sinks must be finite logits"),
    (dict(sinks="0"), TypeError, "sinks must be a finite number"),
    (dict(score_mod=scores.alibi(4)), ValueError, "score_mod: alibi slopes of shape"),
    (dict(score_mod=lambda s, b, h, i, j: s.sum()), ValueError, "score_mod: .* one score per position"),
    (dict(score_mod=3), TypeError, "score_mod must be a score mod"),
])
def test_trace_refuses_a_bad_score_mod_or_sinks_by_name(kwargs, error, message):
    with pytest.raises(error, match=message):
        trace(SENTENCE, **kwargs)


# --- the views ------------------------------------------------------------------------------------

_SHARE_ROW = re.compile(r'<tr data-row="(\d+)"[^>]*><th>[^<]*</th>((?:<td[^>]*>[^<]*</td>)+)</tr>')


def _sink_table(page: str) -> list[list[float]]:
    table = page.split('class="values sink-shares"', 1)[1].split("</table>", 1)[0]
    return [[float(v) for v in re.findall(r">([-0-9.]+)</td>", cells)] for _, cells in _SHARE_ROW.findall(table)]


def test_report_and_inline_view_show_each_querys_sink_share_per_head():
    t = trace(SENTENCE, mode="multihead", heads=2, seed=4, sinks=torch.tensor([0.0, 1.0]),
              score_mod=scores.softcap(1.0))
    for page in (build_report(t), walk_view(t)):
        assert "Where the mass goes: the sink" in page
        shown = torch.tensor(_sink_table(page))  # (Tq, H)
        torch.testing.assert_close(shown, t.sink_shares().T, atol=5e-5, rtol=0)
        assert 'data-step="sink_weights"' in page and 'data-step="plain_weights"' in page
        assert "1 minus the sink" in page
    assert "score mod softcap(1)" in build_report(t) and "sinks, logit 0, 1" in build_report(t)
    assert "Where the mass goes" not in build_report(trace(SENTENCE))


def test_heads_view_takes_sink_shares_and_checks_their_shape():
    weights = torch.full((2, 3, 3), 0.25)
    view = heads_view(Weights.of(weights, ["a", "b", "c"], sink_shares=torch.full((3,), 0.25)))
    assert torch.tensor(_sink_table(view)).eq(0.25).all() and len(_sink_table(view)) == 3
    with pytest.raises(ValueError, match=r"sink_shares must be \(Tq,\) or \(H, Tq\) = \(2, 3\)"):
        Weights.of(weights, ["a", "b", "c"], sink_shares=torch.zeros(4))
    with pytest.raises(TypeError, match="sink_shares must be a torch.Tensor"):
        Weights.of(weights, ["a", "b", "c"], sink_shares=[0.1, 0.2, 0.3])


# --- the command ----------------------------------------------------------------------------------

def _run(*args):
    return runner.invoke(app, ["explain", *args])


def test_command_shows_the_softcap_and_the_sinks(tmp_path):
    result = _run(SENTENCE, "--mode", "multihead", "--heads", "2", "--softcap", "0.5", "--alibi", "--sinks",
                  "--sink-logit", "0.25", "--out", str(tmp_path), "--format", "html", "--no-color")
    assert result.exit_code == 0, result.output
    assert "Score mod" in result.output and "Weights without the score mod" in result.output
    t = trace(SENTENCE, mode="multihead", heads=2, score_mod=scores.softcap(0.5) + scores.alibi(2), sinks=0.25)
    shares = t.sink_shares()[:, t.query_index()]
    match = re.search(r"The sink takes ([0-9.]+) \(head 0\), ([0-9.]+) \(head 1\) of the attention of 'east'",
                      result.output)
    assert match, result.output
    assert [float(match[1]), float(match[2])] == pytest.approx(shares.tolist(), abs=5e-5)
    page = (tmp_path / "report.html").read_text()
    torch.testing.assert_close(torch.tensor(_sink_table(page)), t.sink_shares().T, atol=5e-5, rtol=0)


@pytest.mark.parametrize("args, message", [
    (("--softcap", "0"), "--softcap must be a positive finite number"),
    (("--softcap", "-2"), "--softcap must be a positive finite number"),
    (("--softcap", "nan"), "--softcap must be a finite number"),
    (("--softcap", "inf"), "--softcap must be a finite number"),
    (("--softcap", "x"), "--softcap"),
    (("--sink-logit", "1"), "--sink-logit needs --sinks"),
    (("--sinks", "--sink-logit", "nan"), "--sink-logit must be a finite number"),
])
def test_bad_score_options_are_one_error_line(args, message, tmp_path):
    result = _run(*args, "--out", str(tmp_path))
    text = result.output.strip()
    assert result.exit_code == 2 and "Traceback" not in text and "\n" not in text, text
    assert text.startswith("error:") and message in text
