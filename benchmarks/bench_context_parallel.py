"""Context-parallel scaling on this machine: per-rank peak memory, bytes sent, time, P = 1, 2, 4.

Every rank is a local process with its own share of the CPU cores, so times on a 2-core machine
say nothing about a cluster; memory and bytes sent are the figures that carry over (see
docs/distributed.md for the model of when each method wins).

    python benchmarks/bench_context_parallel.py [--seq-len 8192] [--dtype fp32]
"""

from __future__ import annotations

import argparse

from attnlab.lab.bench.context_parallel import CheckSpec, scaling_rows
from attnlab.lab.bench.timing import machine_line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--worlds", default="1,2,4")
    args = parser.parse_args()
    # No fp64 comparison here (tests and `attnlab context-parallel` do it): at T=8192 it would
    # dominate the run. The figures are time, bytes and memory.
    spec = CheckSpec(seq_len=args.seq_len, heads=args.heads, head_dim=args.head_dim, dtype=args.dtype,
                     check=False)
    worlds = tuple(int(w) for w in args.worlds.split(","))
    rows = scaling_rows(spec, worlds=worlds)
    print(f"machine: {machine_line()}")
    print(f"T={spec.seq_len} B={spec.batch} H={spec.heads} D={spec.head_dim} {spec.dtype} causal zigzag, fwd+bwd")
    print("| method | P | rank | peak MiB | MiB sent | expected MiB | fwd ms | bwd ms | ok |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['world']} | {r['rank']} | {r['peak_bytes'] / 2**20:.1f} | "
              f"{r['bytes_sent'] / 2**20:.2f} | {r['expected_bytes'] / 2**20:.2f} | "
              f"{r['forward_s'] * 1e3:.0f} | {r['backward_s'] * 1e3:.0f} | {'-' if r.get('ok') is None else r['ok']} |")


if __name__ == "__main__":
    main()
