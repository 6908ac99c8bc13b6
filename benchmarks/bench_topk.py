"""Top-k sparse attention against SDPA given the equivalent dense bool mask.

B=1, H=8, D=64 fp32 (sizes as options); each query lists k keys drawn uniformly from its causal
prefix, one list for every head (DeepSeek-V3.2's indexer gives one per token), passed with
``causal=True``. Candidates, timed in interleaved rounds (median; each runs once untimed first):

* ``topk`` -- ``attnlab.attention(q, k, v, indices=..., causal=True)``;
* ``sdpa dense mask`` -- ``F.scaled_dot_product_attention`` with the (T, T) bool mask of the same
  pairs (built once, outside the timing).

Forward under ``torch.no_grad()``, and forward+backward. Peak tensor memory of one run of each
(``attnlab._memory.PeakMemory``; the dense mask the caller holds is not counted).

Usage:
    python benchmarks/bench_topk.py                      # T=8192, k=64, 2 threads
    python benchmarks/bench_topk.py --t 2048 --rounds 2  # a quicker look
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import attnlab
from attnlab._memory import PeakMemory
from attnlab.lab.bench.timing import compare, machine_line


def inputs(t: int, k: int, heads: int, d: int) -> tuple:
    gen = torch.Generator().manual_seed(0)
    q, key, v = (torch.randn(1, heads, t, d, generator=gen, requires_grad=True) for _ in range(3))
    prefix = torch.arange(1, t + 1)[:, None]  # query i may pick keys 0..i
    indices = (torch.rand(t, k, generator=gen) * prefix).long()  # (T, k), repeats where i < k
    dense = torch.zeros(t, t, dtype=torch.bool).scatter_(1, indices, True)  # (T, T)
    return q, key, v, indices, dense


def candidates(q, key, v, indices, dense, *, backward: bool) -> dict:
    def topk():
        out = attnlab.attention(q, key, v, indices=indices, causal=True)
        if backward:
            out.sum().backward()

    def sdpa():
        out = F.scaled_dot_product_attention(q, key, v, attn_mask=dense)
        if backward:
            out.sum().backward()

    if backward:
        return {"topk": topk, "sdpa dense mask": sdpa}
    return {name: _no_grad(fn) for name, fn in (("topk", topk), ("sdpa dense mask", sdpa))}


def _no_grad(fn):
    def run():
        with torch.no_grad():
            fn()
    return run


def peak_mib(fn) -> float:
    with PeakMemory() as meter:
        fn()
    return meter.peak_bytes / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=int, default=8192)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    q, key, v, indices, dense = inputs(args.t, args.k, args.heads, args.d)
    print(machine_line(), f"| {args.threads} threads | B=1 H={args.heads} T={args.t} k={args.k} D={args.d} fp32")
    print(f"{'case':<18}{'topk ms':>10}{'sdpa ms':>10}{'speedup':>9}{'topk MiB':>10}{'sdpa MiB':>10}")
    for label, backward in (("forward", False), ("forward+backward", True)):
        runs = candidates(q, key, v, indices, dense, backward=backward)
        seconds = compare(runs, rounds=args.rounds, min_run_time=0.2)
        memory = {name: peak_mib(fn) for name, fn in runs.items()}
        fast, slow = seconds["topk"], seconds["sdpa dense mask"]
        print(f"{label:<18}{fast * 1e3:>10.1f}{slow * 1e3:>10.1f}{slow / fast:>8.1f}x"
              f"{memory['topk']:>10.1f}{memory['sdpa dense mask']:>10.1f}")


if __name__ == "__main__":
    main()
