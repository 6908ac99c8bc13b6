"""Score mods and sinks: attnlab against the eager computation that materialises the scores.

Issue 22's targets, B=1 H=8 D=64 fp32, timed in interleaved rounds (median; each candidate runs
once untimed first), peak tensor memory of one run beside each (attnlab._memory.PeakMemory:
storages created during the call, inputs and a prebuilt mask excluded):

1. softcap and sinks, causal, T=4096 (``--t``), forward and forward+backward: ``attnlab``
   (``backend="auto"``) against ``eager``, the computation transformers' eager attention does
   (Gemma 2: scores, ``cap * tanh(s / cap)``, the additive causal mask, softmax, ``@ v``;
   gpt-oss: scores plus mask, the sink column appended, the row maximum subtracted, softmax, the
   column dropped, ``@ v``), with its causal float mask built once outside the timing, as a
   model builds it once for all layers. Target: eager / attnlab >= 3 with O(T) memory. The
   softcap forward also times ``backend="flex"`` (FlexAttention compiled with the cap as its
   score_mod; compiled in the untimed first run), for comparison.
2. what sinks cost: the sinks call against the same call without sinks, both ``auto`` and both
   on the backend ``auto`` picked for the sinks. Target: <= 1.10x.
3. ALiBi with a causal 256-key window (``--window``) at T=8192 (``--t-window``), forward:
   ``auto`` (blocks) against SDPA with the dense float mask (ALiBi's bias, -inf outside the
   window: (1, H, T, T), built outside the timing). Target: >= 10x.
4. sinks on the calls a model with sinks (gpt-oss) makes, forward under no_grad, each against
   ``F.scaled_dot_product_attention`` with the same mask and no sinks: a right-padded prefill,
   B=4 T=1024 (lengths 1024/900/600/300), with transformers' ``(B, 1, T, T)`` bool mask; one
   decoding step over that padded cache (``(B, 1, 1, Tk)`` bool mask); and causal T=2048 under
   ``torch.compile(fullgraph=True)`` (compiled against eager attnlab with sinks).

FLOPs follow docs/design.md (causal halves them; the window case counts its visible pairs).

Usage:
    python benchmarks/bench_scores.py                 # each candidate runs 1 + 2 x rounds times
    python benchmarks/bench_scores.py --t 2048 --t-window 4096 --rounds 2   # a quicker look
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import attnlab
from attnlab import backends, masks, scores
from attnlab._flops import attention_flops
from attnlab._memory import PeakMemory
from attnlab.lab.bench.timing import BenchRow, compare, fill_ratios, machine_line, matmul_candidate, print_rows

H, D = 8, 64
SOFTCAP = 50.0  # Gemma 2's attention logit cap


def _inputs(t: int, grad: bool) -> tuple:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, t, D, generator=gen).requires_grad_(grad) for _ in range(3))
    sinks = torch.randn(H, generator=gen).requires_grad_(grad)
    return q, k, v, sinks


def _causal_float_mask(t: int) -> torch.Tensor:
    """transformers' eager causal mask: 0 where seen, the dtype's minimum elsewhere, (1, 1, T, T)."""
    seen = torch.ones(t, t, dtype=torch.bool).tril()
    return torch.zeros(1, 1, t, t).masked_fill_(~seen, torch.finfo(torch.float32).min)


def eager_softcap(q, k, v, mask, cap=SOFTCAP):
    """Gemma 2's eager attention: the scores materialised, capped, masked, softmaxed."""
    weights = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]))  # (B, H, T, T)
    weights = torch.tanh(weights / cap) * cap
    weights = torch.softmax(weights + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return weights @ v


def eager_sinks(q, k, v, mask, sinks):
    """gpt-oss's eager attention: a sink column appended to the masked scores, dropped after the softmax."""
    weights = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1])) + mask  # (B, H, T, T)
    column = sinks.reshape(1, -1, 1, 1).expand(*weights.shape[:-1], 1)
    combined = torch.cat([weights, column], dim=-1)  # (B, H, T, T + 1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)
    return probs[..., :-1] @ v


def _runner(fn, inputs: tuple, grad: bool):
    """One forward (under no_grad) or forward+backward of ``fn()`` w.r.t. ``inputs``."""
    def forward():
        with torch.no_grad():
            return fn()

    def forward_backward():
        out = fn()
        return torch.autograd.grad(out, inputs, torch.ones_like(out))

    return forward_backward if grad else forward


class _Measured:
    """A candidate whose first call -- compare's untimed warm-up -- runs under PeakMemory, so
    that measuring memory costs no extra run (the slow candidates take seconds each)."""

    def __init__(self, run, *, measure: bool = True):
        self.run, self.peak_mib, self.measure = run, None, measure

    def __call__(self):
        # measure=False (compiled code): the meter, a dispatch mode, cannot enter it.
        if self.peak_mib is not None or not self.measure:
            return self.run()
        with PeakMemory() as meter:
            self.run()
        self.peak_mib = meter.peak_bytes / 2**20
        return None


def _timed(suite_case: str, candidates: dict, flops: float, rounds: int, notes: dict) -> list[BenchRow]:
    """Rows of ``candidates`` timed side by side with the matmul rate, peak memory in the note."""
    # Compiled code (flex's kernel, a torch.compile'd call) cannot run under the memory meter.
    measured = {name: _Measured(run, measure=not name.startswith(("flex", "compiled")))
                for name, run in candidates.items()}
    matmul, matmul_flops = matmul_candidate()
    seconds = compare({**measured, "matmul (peak)": matmul}, rounds=rounds, min_run_time=0.2)
    peak = matmul_flops / seconds.pop("matmul (peak)")
    rows = []
    for name, run in measured.items():
        memory = "peak not measured" if run.peak_mib is None else f"peak {run.peak_mib:.0f} MiB"
        note = memory + (f"; {notes[name]}" if name in notes else "")
        rows.append(BenchRow("scores", suite_case, name, seconds[name], flops, peak, note=note))
    return fill_ratios(rows)


def mods_vs_eager(t: int, rounds: int) -> list[BenchRow]:
    """Part 1 and 2: softcap and sinks, causal, forward and forward+backward."""
    rows = []
    mask = _causal_float_mask(t)
    for grad in (False, True):
        mode = "fwd+bwd" if grad else "fwd"
        q, k, v, sinks = _inputs(t, grad)
        flops = attention_flops(1, H, t, t, D, causal=True, mode=mode)
        with torch.set_grad_enabled(grad):
            cap_call = backends.build_call(q, k, v, causal=True, score_mod=scores.softcap(SOFTCAP))
            sink_call = backends.build_call(q, k, v, causal=True, sinks=sinks)
            cap_backend, sink_backend = backends.select(cap_call).name, backends.select(sink_call).name
        cap = {
            "attnlab": _runner(lambda: attnlab.attention(q, k, v, causal=True,
                                                         score_mod=scores.softcap(SOFTCAP)), (q, k, v), grad),
            "eager": _runner(lambda: eager_softcap(q, k, v, mask), (q, k, v), grad),
        }
        if not grad and "flex" in backends.available():  # flex on CPU: forward only (compiled in the warm-up)
            cap["flex"] = _runner(lambda: attnlab.attention(q, k, v, causal=True, score_mod=scores.softcap(SOFTCAP),
                                                            backend="flex"), (q, k, v), grad)
        rows += _timed(f"softcap causal {mode} T={t}", cap, flops, rounds, {"attnlab": f"auto -> {cap_backend}"})
        learned = (q, k, v, sinks)
        sink = {
            "attnlab": _runner(lambda: attnlab.attention(q, k, v, causal=True, sinks=sinks), learned, grad),
            "eager": _runner(lambda: eager_sinks(q, k, v, mask, sinks), learned, grad),
            "attnlab, no sinks": _runner(lambda: attnlab.attention(q, k, v, causal=True), (q, k, v), grad),
            f"{sink_backend}, no sinks": _runner(
                lambda: attnlab.attention(q, k, v, causal=True, backend=sink_backend), (q, k, v), grad),
        }
        rows += _timed(f"sinks causal {mode} T={t}", sink, flops, rounds, {"attnlab": f"auto -> {sink_backend}"})
    return rows


def alibi_window(t: int, window: int, rounds: int) -> list[BenchRow]:
    """Part 3: ALiBi on a causal sliding window, forward, auto against SDPA's dense float mask."""
    q, k, v, _ = _inputs(t, False)
    mod = masks.sliding_window_mod(t, t, window)
    alibi = scores.alibi(H)
    with torch.no_grad():
        chosen = backends.select(backends.build_call(q, k, v, mask=mod, causal=True, score_mod=alibi)).name
    i, j = torch.arange(t).view(-1, 1), torch.arange(t).view(1, -1)
    seen = (j <= i) & (i - j < window)
    dense = (-alibi.slopes.view(1, H, 1, 1) * (i - j).float()).masked_fill_(~seen, float("-inf"))  # (1, H, T, T)
    candidates = {
        "attnlab": _runner(lambda: attnlab.attention(q, k, v, mask=mod, causal=True, score_mod=alibi), (), False),
        "sdpa, dense float mask": _runner(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), (), False),
    }
    visible = int(seen.sum())
    flops = attention_flops(1, H, 1, visible, D)  # the visible pairs as Tq x Tk
    rows = _timed(f"alibi window {window} causal fwd T={t}", candidates, flops, rounds,
                  {"attnlab": f"auto -> {chosen}"})
    del dense
    return rows


def sinks_in_models(rounds: int) -> list[BenchRow]:
    """Part 4: sinks on a padded prefill, a padded decoding step and a compiled causal call."""
    gen = torch.Generator().manual_seed(1)
    sinks = torch.randn(H, generator=gen)
    batch, t = 4, 1024
    lengths = torch.tensor([1024, 900, 600, 300])
    keep = torch.arange(t)[None, :] < lengths[:, None]  # (B, T): right padding
    prefill_mask = (torch.ones(t, t, dtype=torch.bool).tril()[None] & keep[:, None, :])[:, None]  # (B, 1, T, T)
    q, k, v = (torch.randn(batch, H, t, D, generator=gen) for _ in range(3))
    step = torch.randn(batch, H, 1, D, generator=gen)
    step_mask = keep[:, None, None, :]  # (B, 1, 1, Tk)
    qc, kc, vc = (torch.randn(1, H, 2048, D, generator=gen) for _ in range(3))
    compiled = torch.compile(lambda q, k, v, s: attnlab.attention(q, k, v, causal=True, sinks=s), fullgraph=True)
    cases = {
        f"sinks padded prefill B={batch} T={t}, (B,1,T,T) bool mask": (
            {"attnlab, sinks": lambda: attnlab.attention(q, k, v, mask=prefill_mask, sinks=sinks),
             "F.sdpa, no sinks": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=prefill_mask)},
            attention_flops(batch, H, t, t, D)),
        f"sinks decode step B={batch} Tk={t}, padded bool mask": (
            {"attnlab, sinks": lambda: attnlab.attention(step, q, v, mask=step_mask, sinks=sinks),
             "F.sdpa, no sinks": lambda: F.scaled_dot_product_attention(step, q, v, attn_mask=step_mask)},
            attention_flops(batch, H, 1, t, D)),
        "sinks causal T=2048, torch.compile(fullgraph=True)": (
            {"compiled attnlab, sinks": lambda: compiled(qc, kc, vc, sinks),
             "attnlab, sinks": lambda: attnlab.attention(qc, kc, vc, causal=True, sinks=sinks),
             "F.sdpa, no sinks": lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)},
            attention_flops(1, H, 2048, 2048, D, causal=True)),
    }
    rows = []
    with torch.no_grad():
        for case, (candidates, flops) in cases.items():
            rows += _timed(case, {name: _runner(run, (), False) for name, run in candidates.items()}, flops,
                           rounds, {})
    return rows


def _ratio(rows: list[BenchRow], case: str, slow: str, fast: str) -> float:
    found = {row.name: row.seconds for row in rows if row.case == case}
    return found[slow] / found[fast]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=int, default=4096, help="sequence length of the softcap and sinks cases")
    parser.add_argument("--t-window", type=int, default=8192, help="sequence length of the ALiBi window case")
    parser.add_argument("--window", type=int, default=256, help="keys in the ALiBi case's causal window")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per candidate")
    args = parser.parse_args()
    print(f"machine: {machine_line()}")
    rows = mods_vs_eager(args.t, args.rounds)
    rows += alibi_window(args.t_window, args.window, args.rounds)
    rows += sinks_in_models(args.rounds)
    print_rows(rows, title=f"score mods and sinks, B=1 H={H} D={D} fp32, median of {args.rounds} interleaved rounds")
    for mode in ("fwd", "fwd+bwd"):
        for kind in ("softcap", "sinks"):
            case = f"{kind} causal {mode} T={args.t}"
            print(f"{case}: eager / attnlab = {_ratio(rows, case, 'eager', 'attnlab'):.2f} (target >= 3)")
        case = f"sinks causal {mode} T={args.t}"
        backend = next(row.note.split("auto -> ")[1] for row in rows if row.case == case and row.name == "attnlab")
        print(f"{case}: sinks / no sinks = {_ratio(rows, case, 'attnlab', 'attnlab, no sinks'):.2f} (auto), "
              f"{_ratio(rows, case, 'attnlab', f'{backend}, no sinks'):.2f} (both on {backend}; target <= 1.10)")
    case = f"alibi window {args.window} causal fwd T={args.t_window}"
    print(f"{case}: sdpa dense float mask / attnlab = "
          f"{_ratio(rows, case, 'sdpa, dense float mask', 'attnlab'):.2f} (target >= 10)")
    for case in sorted({row.case for row in rows if row.case.startswith("sinks ") and "eager" not in
                        {r.name for r in rows if r.case == row.case}}):
        print(f"{case}: attnlab with sinks / F.sdpa without = {_ratio(rows, case, 'attnlab, sinks', 'F.sdpa, no sinks'):.2f}"
              + (f", compiled / eager = {_ratio(rows, case, 'compiled attnlab, sinks', 'attnlab, sinks'):.2f}"
                 if "compile" in case else ""))


if __name__ == "__main__":
    main()
