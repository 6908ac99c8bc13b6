"""``attnlab verify`` over linear_attention's backends: every rule, state, documents and gradient
against the fp64 recurrence, and wrong backends caught (registered here in attnlab.linear.BACKENDS)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from typer.testing import CliRunner

from attnlab import linear
from attnlab.lab import verify
from attnlab.lab.cli import app
from attnlab.linear.reference import run_reference

runner = CliRunner()


def _plain(call):
    return run_reference(call, dtype=call.state_dtype)


def _skewed(call):  # every output off by a relative 1e-4
    out, state = _plain(call)
    return out * (1 + 1e-4), state


def _state_detached(call):  # no gradient reaches initial_state
    if call.initial_state is not None:
        call = dataclasses.replace(call, initial_state=call.initial_state.detach())
    return _plain(call)


def _decay_detached(call):  # no gradient reaches decay
    if call.decay is not None:
        call = dataclasses.replace(call, decay=call.decay.detach())
    return _plain(call)


def _beta_detached(call):  # no gradient reaches beta
    if call.beta is not None:
        call = dataclasses.replace(call, beta=call.beta.detach())
    return _plain(call)


def _documents_ignored(call):  # the state runs across packed documents
    if call.cu_seqlens is not None and call.initial_state is None:
        call = dataclasses.replace(call, cu_seqlens=None, starts=())
    return _plain(call)


def _state_rounded(call):  # the final state kept in bf16
    out, state = _plain(call)
    return out, state.to(torch.bfloat16).to(state.dtype)


def _crashing(call):
    raise RuntimeError("kernel exploded")


BROKEN = {"skewed": _skewed, "state-detached": _state_detached, "decay-detached": _decay_detached,
          "beta-detached": _beta_detached, "documents-ignored": _documents_ignored,
          "state-rounded": _state_rounded, "crashing": _crashing}


def test_the_recurrent_backend_conforms_on_every_rule_in_every_dtype():
    results = verify.sweep_linear(["linear:recurrent"], n=36, seed=4, small=True)
    assert results and all(r.passed for r in results), [(r.config, r.note) for r in results if not r.passed][:5]
    assert {r.dtype for r in results} == {"float64", "float32", "bfloat16"}
    for config in verify.linear_configs(36, seed=4, small=True):
        gradients = 3 + len(config._gates().split()) + config.initial_state
        found = [r for r in results if r.config == config.label() and r.dtype == "float32"]
        assert found and len(found[0].errors) == 2 + gradients, config.label()  # out, state, every gradient


def test_the_configurations_cover_rules_states_documents_and_chunk_boundaries():
    configs = verify.linear_configs(72, seed=0)
    assert {c.rule for c in configs} == set(verify.LINEAR_RULES)
    for rule in verify.LINEAR_RULES:
        kinds = {(c.initial_state, bool(c.documents)) for c in configs if c.rule == rule}
        assert kinds == {(False, False), (True, False), (False, True), (True, True)}, rule
    lengths = {c.t for c in configs}
    assert {63, 64, 65} <= lengths and any(t < 40 for t in lengths) and max(lengths) > 128
    assert any(0 in c.documents for c in configs)  # an empty packed document
    assert any(c.value_heads > c.heads for c in configs) and any(c.transposed for c in configs)
    assert any(c.decay_scale > 1 for c in configs if c.rule in ("decay", "gated_delta", "channel", "kda"))
    assert all(c.batch == 1 for c in configs if c.documents)
    tiny = verify.linear_configs(20, seed=0, tiny=True)
    assert max(max(c.t, c.key_dim, c.value_dim) for c in tiny) <= 16
    assert verify.linear_configs(5, seed=3) == verify.linear_configs(5, seed=3)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_backend_is_caught(monkeypatch, name):
    monkeypatch.setitem(linear.BACKENDS, name, BROKEN[name])
    assert "linear:" + name in verify.linear_backends()  # a registered backend is swept
    results = verify.sweep_linear(["linear:" + name], [torch.float64, torch.float32], n=24, seed=1, small=True)
    failed = [r for r in results if not r.passed]
    assert failed, name
    if name == "crashing":
        assert "RuntimeError: kernel exploded" in failed[0].note
    else:
        assert " off by " in failed[0].note


def test_the_bar_is_not_the_backend_itself(monkeypatch):
    """The same-precision error a backend may double is the recurrence's, run directly: a broken
    ``recurrent`` backend must fail, not be compared with itself."""
    monkeypatch.setitem(linear.BACKENDS, "recurrent", _skewed)
    results = verify.sweep_linear(["linear:recurrent"], [torch.float32], n=6, seed=2, small=True)
    assert not any(r.passed for r in results)


def test_the_cli_sweeps_a_registered_linear_backend_and_fails_on_it(monkeypatch):
    monkeypatch.setitem(linear.BACKENDS, "skewed", _skewed)
    result = runner.invoke(app, ["verify", "--quick", "--backend", "linear:skewed"])
    assert result.exit_code == 1, result.output
    assert "linear:skewed" in result.output and "FAIL" in result.output and " off by " in result.output
    assert "sdpa" not in result.output  # --backend alone: no attention backend swept


def test_the_cli_reports_linear_rows_beside_the_attention_ones():
    result = runner.invoke(app, ["verify", "--quick", "--configs", "4", "--backend", "linear:recurrent",
                                 "--backend", "sdpa"])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["sdpa"] * 2 + ["linear:recurrent"] * 3
    assert [row.split("│")[2].strip() for row in rows[2:]] == ["float64", "float32", "bfloat16"]
    assert all("pass" in row for row in rows)


@pytest.mark.parametrize("name", ["linear:reference", "linear:nope", "linear:"])
def test_the_cli_refuses_a_linear_backend_it_does_not_sweep(name):
    from test_cli_errors import assert_one_error_line

    assert_one_error_line(runner.invoke(app, ["verify", "--quick", "--backend", name]),
                          f"--backend must be one of 'linear:recurrent'")


def test_sweep_linear_refuses_bad_arguments():
    with pytest.raises(ValueError, match="n must be"):
        verify.sweep_linear(["linear:recurrent"], n=0)
    with pytest.raises(ValueError, match="linear:reference is the oracle"):
        verify.sweep_linear(["linear:reference"], n=1)
    with pytest.raises(ValueError, match="got 'recurrent'"):
        verify.sweep_linear(["recurrent"], n=1)
