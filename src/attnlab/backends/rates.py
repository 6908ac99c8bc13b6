"""The cost model's measured rates, in one table.

``backend="auto"`` ranks the backends that serve a call by estimated seconds: FLOPs (the
convention of :mod:`attnlab._flops`) divided by a rate measured on a real machine, plus fixed
per-call and per-tile overheads. Every CPU figure below was measured on a 2-core AMD EPYC (AVX2),
fp32, B=1 H=8 D=64, T=256..4096, torch 2.13, in interleaved rounds on an idle machine (the
sections "Backends" and "Dispatch overhead" of ``git show 541b99b:BENCHMARKS.md``). Since
issue 21 the rates only rank backends among those no fixed rule decides: sdpa takes every call
whose mask reaches it as the caller holds it (``Backend.preferred``). The CUDA figures
are order-of-magnitude guesses for an H100-class GPU; they have not been measured (no GPU was
lent to the session that wrote them) and only rank CUDA backends against each other.

Only the ratios between rates matter for dispatch, so a faster or slower machine keeps its
choices as long as the kernels keep their relative speeds.

Example:
    >>> RATES["sdpa"]["cpu_flash"]["none"] > RATES["reference"]["cpu"]
    True
"""

from __future__ import annotations

__all__ = ["RATES"]

RATES: dict = {
    "reference": {
        # Unfused matmul + softmax + matmul: every score computed, no causal saving.
        "cpu": 15e9,
        "cuda": 5e12,
    },
    "sdpa": {
        # The CPU flash kernel by how the mask reaches it (causal halves the FLOPs counted).
        "cpu_flash": {"none": 145e9, "is_causal": 65e9, "user": 75e9, "materialised": 60e9},
        "cpu_math": 15e9,
        "cuda": {"flash": 300e12, "efficient": 150e12, "cudnn": 300e12, "math": 20e12},
        "call_overhead_s": {"cpu": 30e-6, "cuda": 15e-6},
    },
    "chunked": {
        # ~0.55x the flash rate forward; forward+backward 2.7x its forward time.
        "forward_flops_per_s": 22e9,
        "forward_backward_factor": 2.7,
        "seconds_per_tile": 30e-6,
        # Per-tile extra work at T=1024: a float bias, a dense bool mask, a mask mod.
        "mask_factor": {"none": 1.0, "float": 1.2, "bool": 1.75, "mod": 1.5},
        "causal_factor": 1.2,  # diagonal tiles
        "dropout_factor": 1.85,  # hashing the dropout bits
    },
    "blocks": {
        # The fused CPU flash kernel on same-shaped pieces of many query blocks per call; FLOPs
        # are the visited (block x span) pairs. Forward rates by queries per block, measured at
        # T=8192 B=1 H=8 D=64 fp32 on 2 threads (load 1.1-1.7, fp32 matmul 157-185 GFLOP/s in the
        # same runs), interleaved: a 256-key window (spans <= 319/383/511 keys) 58/67/78 ms,
        # 8 packed documents 104/-/93 ms, causal 771/-/602-654 ms = 88-92 / 96 / 108-118 GFLOP/s
        # visited for 64 / 128 / 256 queries per block.
        "flops_per_s": {64: 90e9, 128: 96e9, 256: 112e9},
        "short_span_keys": 1024,
        # Longer spans (causal, prefix-LM, long documents) are charged at this share of those
        # rates, pinned against sdpa's is_causal entry above (measured faster than that entry
        # says at T=8192): blocks on plain causal took 1.0x (T=2048) to 1.12x (T=8192) sdpa's
        # is_causal time in the same run, so auto keeps plain causal on sdpa.
        "long_span_factor": 0.5,
        # Forward+backward over forward time: window 5.0/4.1/3.7, documents 5.5/4.4/4.0, causal
        # -/-/3.75 (64/128/256 queries per block): the backward's key gradients are per piece.
        "forward_backward_factor": {64: 5.2, 128: 4.2, 256: 3.8},
        "seconds_per_block": 10e-6,  # a guess: views and the lse merge per block
        "call_overhead_s": 60e-6,  # a guess: planning is cached, Python per call remains
    },
    "flex": {
        "cpu": 60e9,  # compiled CPU kernel, forward (55-70 GFLOP/s)
        "cuda": 250e12,
        "call_overhead_s": 200e-6,  # Python and guard checks per call
        "compile_first_s": 20.0,  # first torch.compile of flex_attention
        "compile_variant_s": 8.0,  # each further variant (shape, dtype, masked or not)
    },
}
