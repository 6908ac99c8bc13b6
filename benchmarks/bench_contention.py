"""blocks (auto) vs SDPA with the dense mask, sliding window 256, T=8192: idle vs one busy core.

Times both interleaved while idle, then with a busy-loop process beside them, then idle again,
and prints each one's slowdown (issue 11's contention target; figures in BENCHMARKS.md).

    python benchmarks/bench_contention.py
"""
import subprocess, sys, time, torch, attnlab
from attnlab import masks
from attnlab.bench.timing import compare
torch.manual_seed(0)
T = 8192
q, k, v = (torch.randn(1, 8, T, 64) for _ in range(3))
mod = masks.sliding_window_mod(T, T, window=256)
dense = masks.materialize(mod, tq=T, tk=T)
cands = {"auto (blocks)": lambda: attnlab.attention(q, k, v, mask=mod),
         "sdpa dense mask": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)}
with torch.no_grad():
    print("threads", torch.get_num_threads(), "backend", attnlab.backends.select(attnlab.backends.build_call(q,k,v,mask=mod)).name)
    idle = compare(cands, rounds=5)
    busy_proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(1)
    try:
        busy = compare(cands, rounds=5)
    finally:
        busy_proc.kill()
    idle2 = compare(cands, rounds=5)
for name in cands:
    i = (idle[name] + idle2[name]) / 2
    print(f"{name}: idle {i*1e3:.1f} ms (runs {idle[name]*1e3:.1f}/{idle2[name]*1e3:.1f}), busy core {busy[name]*1e3:.1f} ms, slowdown {busy[name]/i:.2f}x")
print("auto vs sdpa: idle %.1fx, busy %.1fx" % ((idle['sdpa dense mask']+idle2['sdpa dense mask'])/(idle['auto (blocks)']+idle2['auto (blocks)']), busy['sdpa dense mask']/busy['auto (blocks)']))
