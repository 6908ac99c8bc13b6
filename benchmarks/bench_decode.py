"""KV-cache decoding vs recomputation: a 6-layer, d=384 GPT generating 256 tokens after 512.

The ``decode-model`` suite of ``attnlab bench`` (:func:`attnlab.lab.bench.suites.decode_model_suite`)
with its sizes as options: both runs decode greedily from the same random 512-token prompt with
the same randomly initialised model (fp32, CPU); the cached run feeds one token per step and
reads earlier keys/values from attnlab's KVCache, the other recomputes the whole sequence every
step. It prints tokens/s side by side, their ratio, and whether both gave the same tokens (a
mismatch is an error). The prefill of the prompt is inside both times.

Usage:
    python benchmarks/bench_decode.py                 # 512 + 256, both ways
    python benchmarks/bench_decode.py --new 64        # a quicker look
"""

from __future__ import annotations

import argparse
import os

import torch

from attnlab.lab.bench.suites import decode_model_suite, report_generation
from attnlab.lab.bench.timing import machine_line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    print(f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    timing = decode_model_suite(layers=args.layers, d_model=args.d_model, heads=args.heads, vocab_size=args.vocab,
                                prompt_len=args.prompt, new_tokens=args.new)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    report_generation(timing)


if __name__ == "__main__":
    main()
