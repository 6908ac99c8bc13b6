"""auto (blocks) vs compiled FlexAttention and SDPA with the dense mask: idle vs one busy core.

Sliding window 256 and 8 packed documents, B=1 H=8 D=64 fp32, forward, at each T given (default
8192). Each case times its candidates interleaved while idle, then with a busy-loop process
beside them, and prints the times and auto's speed relative to compiled FlexAttention (issue
32's targets: >= 1.2x idle, >= 1.0x busy, T = 2k to 32k). SDPA with the dense mask is left out
above T=8192 (a (T, T) mask). Figures in BENCHMARKS.md, "Masked attention that skips work".

    python benchmarks/bench_contention.py [T ...]
"""
import subprocess
import sys
import time

import torch

import attnlab
from attnlab import masks
from attnlab.lab.bench.competitors import CompiledFlex, flex_mask_mods
from attnlab.lab.bench.timing import compare, machine_line


def busy_core():
    """A process spinning on one core until killed."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(1)
    return proc


def cases(t):
    return {"window 256": masks.sliding_window_mod(t, t, 256),
            "packed 8 docs": masks.prepare(masks.document_mod(torch.arange(t) // (t // 8)), tq=t, tk=t)}


def bench(t):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, t, 64) for _ in range(3))
    with torch.no_grad():
        for name, mod in cases(t).items():
            flex = CompiledFlex(flex_mask_mods(t)[name], t, t)
            cands = {"auto": lambda: attnlab.attention(q, k, v, mask=mod), "compiled flex": lambda: flex(q, k, v)}
            if t <= 8192:
                dense = masks.materialize(mod, tq=t, tk=t)
                cands["sdpa dense mask"] = lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=dense)
            for run in cands.values():
                run()  # compile and plan outside the timing
            idle = compare(cands, rounds=5)
            proc = busy_core()
            try:
                busy = compare(cands, rounds=5)
            finally:
                proc.kill()
            chosen = attnlab.backends.select(attnlab.backends.build_call(q, k, v, mask=mod)).name
            print(f"{name} T={t} (auto -> {chosen}):")
            for label, times in (("idle", idle), ("busy core", busy)):
                cells = ", ".join(f"{c} {times[c] * 1e3:.1f} ms" for c in cands)
                speed = times["compiled flex"] / times["auto"]
                print(f"  {label}: {cells}; auto's speed vs compiled flex {speed:.2f}x")


print(machine_line())
for t in [int(arg) for arg in sys.argv[1:]] or [8192]:
    bench(t)
