"""KV-cache decoding vs recomputation: a 6-layer, d=384 GPT generating 256 tokens after 512.

Both runs decode greedily from the same random 512-token prompt with the same randomly
initialised model (fp32, CPU); the cached run feeds one token per step and reads earlier
keys/values from attnlab's KVCache, the other recomputes the whole sequence every step. The
script checks that both give the same tokens and prints tokens/s side by side (the prefill of
the prompt is included in both times, as a user waiting for the text would see it).

Usage:
    python benchmarks/bench_decode.py                 # 512 + 256, both ways
    python benchmarks/bench_decode.py --new 64        # a quicker look
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from attnlab.bench.timing import machine_line
from attnlab.models import GPT


def timed(model: GPT, prompt: torch.Tensor, new: int, use_cache: bool) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    tokens = model.generate(prompt, new, use_cache=use_cache)
    return tokens, time.perf_counter() - start


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
    torch.manual_seed(0)
    model = GPT(args.vocab, max_len=args.prompt + args.new, d_model=args.d_model, num_layers=args.layers,
                num_heads=args.heads).eval()
    prompt = torch.randint(0, args.vocab, (1, args.prompt))
    print(machine_line())
    print(f"threads {args.threads}; load average at start {os.getloadavg()[0]:.2f}; GPT {args.layers} layers, "
          f"d_model {args.d_model}, {args.heads} heads, vocab {args.vocab}; prompt {args.prompt}, "
          f"{args.new} new tokens, greedy, fp32")
    model.generate(prompt[:, :16], 4)  # warm-up
    cached, t_cached = timed(model, prompt, args.new, True)
    print(f"  KV cache     {args.new / t_cached:8.1f} tokens/s  ({t_cached:.2f} s)", flush=True)
    recomputed, t_recomputed = timed(model, prompt, args.new, False)
    print(f"  recompute    {args.new / t_recomputed:8.1f} tokens/s  ({t_recomputed:.2f} s)")
    print(f"  speed-up {t_recomputed / t_cached:.1f}x; identical tokens: {torch.equal(cached, recomputed)}; "
          f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
