"""Benchmark attnlab.nn.MultiHeadAttention against torch's, the tutorial's and nanoGPT's.

Usage:
    python benchmarks/bench_modules.py            # B=8, T=1024, d_model=768, 12 heads, fp32
    python benchmarks/bench_modules.py --quick    # B=2, T=256
    python benchmarks/bench_modules.py --repeats 7

The same suite runs as ``attnlab bench --suite modules``.
"""

from __future__ import annotations

import argparse

from attnlab.lab.bench.modules import run_modules_suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (B=2, T=256)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per module and mode")
    args = parser.parse_args()
    run_modules_suite(quick=args.quick, repeats=args.repeats)


if __name__ == "__main__":
    main()
