"""Backends side by side on this machine: memory at long T, and auto vs the fastest backend.

Run: ``.venv/bin/python benchmarks/bench_backends.py [--t 4096] [--rounds 3]``

1. Peak tensor memory of causal forward+backward, reference (O(T^2)) vs chunked and sdpa
   (O(T)), as T grows (measured with attnlab._memory.PeakMemory).
2. Forward time of every serving backend and of ``backend="auto"`` on a causal and a
   padding-masked call at T=4096, fp32, B=1 H=8 D=64, interleaved round by round; the script
   prints auto's time over the fastest single backend's (target: within 5%).

FLOPs follow docs/design.md: forward 4*B*H*Tq*Tk*D, halved for causal; GFLOP/s are divided by the
fp32 matmul rate measured in the same run.
"""

from __future__ import annotations

import argparse

import torch

from attnlab.lab import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=int, default=4096, help="sequence length of the timing part")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per candidate")
    parser.add_argument("--skip-memory", action="store_true", help="only the timing part")
    args = parser.parse_args()
    from rich.console import Console

    console = Console()
    console.print(f"machine: {bench.machine_line()}")
    if not args.skip_memory:
        rows = bench.memory_suite(quick=False)
        bench.print_rows(rows, title="peak memory, causal forward+backward, B=1 H=4 D=64 fp32",
                         console=console)
    rows = bench.backends_suite(t=args.t, rounds=args.rounds)
    bench.print_rows(rows, title=f"forward, B=1 H=8 T={args.t} D=64 fp32, median of {args.rounds} "
                     "interleaved rounds", console=console)
    for case in sorted({row.case for row in rows}):
        group = {row.name: row.seconds for row in rows if row.case == case}
        fastest = min((s, n) for n, s in group.items() if n != "auto")
        console.print(f"{case}: auto / fastest ({fastest[1]}) = {group['auto'] / fastest[0]:.3f}")


if __name__ == "__main__":
    torch.set_num_threads(torch.get_num_threads())
    main()
