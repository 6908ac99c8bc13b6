"""``attnlab verify``, ``attnlab backends`` and ``attnlab bench`` through typer's CliRunner."""

import pytest
import torch
from typer.testing import CliRunner

from attnlab import backends
from attnlab.lab.cli import app

runner = CliRunner()


def test_verify_quick_passes_on_this_machine():
    result = runner.invoke(app, ["verify", "--quick"])
    assert result.exit_code == 0, result.output
    assert "all backends conform" in result.output
    for name in backends.available():
        assert name in result.output


def test_verify_fails_on_a_broken_backend():
    class Broken(backends.Backend):
        name = "broken-test"
        memory = "quadratic"

        def forward(self, call):
            result = backends.get("reference").forward(call)
            return backends.AttentionResult(out=result.out.flip(-2))  # rows swapped

    backends.register(Broken())
    try:
        result = runner.invoke(app, ["verify", "--quick", "--backend", "broken-test"])
    finally:
        backends.unregister("broken-test")
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.output


def test_backends_explains_a_causal_bf16_call():
    result = runner.invoke(app, ["backends", "--dtype", "bfloat16", "--causal", "--tq", "512"])
    assert result.exit_code == 0, result.output
    assert "bfloat16" in result.output and "causal (top_left)" in result.output
    q = torch.zeros(1, 8, 512, 64, dtype=torch.bfloat16)  # finite: torch.empty may hold NaN, which some backends decline
    chosen = backends.select(backends.build_call(q, q, q, causal=True)).name
    assert f"runs on {chosen!r}" in result.output
    for name in backends.registry():
        if name != chosen:
            assert f"  {name}: " in result.output


def test_backends_explains_a_padding_mask_call():
    result = runner.invoke(app, ["backends", "--padding", "--tq", "256", "--grad"])
    assert result.exit_code == 0, result.output
    assert "mask=bool (1, 1, 1, 256)" in result.output
    assert "no backward on CPU" in result.output  # flex's reason, for a training call


def test_backends_rejects_a_bad_dtype():
    result = runner.invoke(app, ["backends", "--dtype", "int8"])
    assert result.exit_code != 0
    assert "dtype" in result.output


def test_bench_rejects_an_unknown_suite():
    result = runner.invoke(app, ["bench", "--suite", "nope"])
    assert result.exit_code != 0


def test_a_backend_that_declined_everything_reads_not_checked_never_pass():
    """The summary must not call a backend that served no configuration a pass (flex in --quick did)."""
    from rich.console import Console

    from attnlab.lab.cli.verify_cmd import _print_summary
    from attnlab.lab.verify import CheckResult

    def declined(tk):
        return CheckResult("flex", "float32", f"cfg{tk}", False, False, (), (), True,
                           f"flex on CPU is exact only when Tk is a multiple of its 128-key block (Tk={tk})")

    served = CheckResult("sdpa", "float32", "cfg", True, True, (1e-7, 1e-7, 1e-7, 1e-7), (1e-6,) * 4, True, "")
    console = Console(record=True, width=200)
    failed = _print_summary(console, [declined(17), declined(23), served], ["sdpa", "flex"], [torch.float32])
    text = console.export_text()
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.startswith("│")}
    assert not failed
    assert "pass" in rows["sdpa"] and "not checked" in rows["flex"] and "pass" not in rows["flex"]
    assert text.count("multiple of its 128-key block") == 1  # one line per kind of reason
    assert "flex float32: nothing checked" in text


def test_verify_transformers_json_to_stdout_is_one_document(tmp_path, monkeypatch):
    """``--json -`` leaves stdout to the JSON alone (``| jq`` works): the tables go to stderr."""
    import json

    monkeypatch.chdir(tmp_path)  # '-' is stdout, not a file in the working folder
    result = runner.invoke(app, ["verify", "--transformers", "--family", "bloom", "--json", "-"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)  # nothing but the one document
    assert [(f["family"], f["status"]) for f in document["families"]] == [("bloom", "not applicable")]
    assert "no family differs or crashes" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_bench_json_to_stdout_is_one_document(monkeypatch):
    """``bench --json -``: stdout is the JSON document alone, the tables go to stderr."""
    import json

    from attnlab.lab.bench import suites
    from attnlab.lab.bench.timing import BenchRow

    monkeypatch.setattr(suites, "memory_suite", lambda quick: [BenchRow("memory", "T=8", "sdpa", None, note="peak 1 MB")])
    monkeypatch.setattr(suites, "deepseek_v4_memory", lambda quick: [])
    result = runner.invoke(app, ["bench", "--suite", "memory", "--json", "-"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert [row["implementation"] for row in document["rows"]] == ["sdpa"]
    assert "machine:" in result.stderr


@pytest.mark.parametrize("value", ["1e30", str(10**30), str(7 * 24 * 3600 + 1)])
def test_verify_transformers_refuses_a_time_limit_past_a_week(value):
    """A limit past what the family's alarm can hold crashed every family ("timestamp out of range")."""
    from test_cli_errors import assert_one_error_line

    assert_one_error_line(runner.invoke(app, ["verify", "--transformers", "--family", "vit", "--time-limit", value]),
                          "--time-limit must be at most 604800")
