"""attnlab vs compiled FlexAttention with its own block mask, forward, on a causal sliding window.

One case of ``attnlab bench --suite sparse --with-flex``, with its sizes as options: B=1 H=8 D=64
fp32, a causal sliding window (default 256 keys) at T=8192 (default), forward under
``torch.no_grad()``. Candidates, timed in interleaved rounds (median; each runs once untimed
first, so compilation and block-mask building are excluded):

* ``auto`` -- ``attnlab.attention(q, k, v, mask=sliding_window_mod(T, T, W), causal=True)``;
* ``flex`` -- the same call with ``backend="flex"`` (its block mask built from the mod, O(T));
* ``flex compiled (own block mask)`` -- ``torch.compile(flex_attention)`` with
  ``create_block_mask`` on a plain window function, as FlexAttention's documentation writes it;
* the backend ``auto`` picked, named explicitly, and the matmul rate in the same rounds.

One thread count per process: Inductor's CPU code keeps the thread count it was compiled at.

Usage:
    python benchmarks/bench_flex_sparse.py --threads 1           # T=8192
    python benchmarks/bench_flex_sparse.py --threads 2
    python benchmarks/bench_flex_sparse.py --t 2048 --rounds 3   # a quicker look
"""

from __future__ import annotations

import argparse
import os

import torch

from attnlab import backends, masks
from attnlab._flops import attention_flops
from attnlab.lab.bench.competitors import CompiledFlex
from attnlab.lab.bench.suites import FLEX_OWN, _compare_with_peak, _no_grad
from attnlab.lab.bench.timing import BenchRow, fill_ratios, machine_line, print_rows
from attnlab.functional import attention


def window_candidates(t: int, window: int) -> tuple[dict, float, str]:
    """(candidates, forward FLOPs over the visible pairs, the backend auto picks)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, t, 64, generator=gen) for _ in range(3))
    mod = masks.sliding_window_mod(t, t, window)
    with torch.no_grad():
        chosen = backends.select(backends.build_call(q, k, v, mask=mod, causal=True)).name
    candidates = {name: _no_grad(attention, q, k, v, mask=mod, causal=True, backend=name)
                  for name in dict.fromkeys(("auto", chosen, "flex"))}
    own = CompiledFlex(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < window), t, t)
    candidates[FLEX_OWN] = _no_grad(own, q, k, v)
    visible = int(masks.materialize(mod, tq=t, tk=t).sum())
    return candidates, attention_flops(1, 8, 1, visible, 64), chosen  # the visible pairs as Tq x Tk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--t", type=int, default=8192)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # before anything compiles
    print(machine_line())
    candidates, flops, chosen = window_candidates(args.t, args.window)
    start = os.getloadavg()
    seconds, peak = _compare_with_peak(candidates, rounds=args.rounds, min_run_time=0.5)
    end = os.getloadavg()
    case = f"window {args.window} causal fwd T={args.t}, {args.threads} thread(s)"
    rows = fill_ratios([BenchRow("sparse", case, name, sec, flops, peak,
                                 note=f"auto -> {chosen}" if name == "auto" else "", t=args.t)
                        for name, sec in seconds.items()])
    print_rows(rows, title=f"{case}; load average (1 min) {start[0]:.2f} at start, {end[0]:.2f} at end")
    print(f"auto vs {FLEX_OWN}: {seconds[FLEX_OWN] / seconds['auto']:.2f}x (>1: auto faster); "
          f"flex backend vs it: {seconds[FLEX_OWN] / seconds['flex']:.2f}x")


if __name__ == "__main__":
    main()
