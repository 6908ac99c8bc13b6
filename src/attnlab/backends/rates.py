"""The cost model's rates, in one table.

``backend="auto"`` compares estimated seconds only where no rule of the preference list
decides (the backends' :meth:`~attnlab.backends.base.Backend.claims`): mask mods, which blocks, chunked and
flex serve. An estimate is FLOPs (the convention of :mod:`attnlab._flops`) over a rate, plus
fixed per-call and per-tile overheads. The CPU rates were measured on a 2-core AVX2 machine
(BENCHMARKS.md, "Backends" and "Dispatch overhead"); the CUDA ones are unmeasured
order-of-magnitude guesses that only rank CUDA backends against each other. Only ratios matter,
so a faster or slower machine keeps its choices while the kernels keep their relative speeds.

Example:
    >>> RATES["sdpa"]["cpu_flash"]["none"] > RATES["reference"]["cpu"]
    True
"""

from __future__ import annotations

__all__ = ["RATES"]

RATES: dict = {
    "reference": {
        "cpu": 15e9,  # unfused matmul + softmax + matmul: every score, no causal saving
        "cuda": 5e12,
        "call_overhead_s": 50e-6,  # a guess: masking, softmax and two matmuls, a kernel each
    },
    "sdpa": {
        # The CPU flash kernel by how the mask reaches it (causal halves the FLOPs counted).
        "cpu_flash": {"none": 145e9, "is_causal": 65e9, "user": 75e9, "materialised": 60e9},
        "cpu_math": 15e9,
        "cuda": {"flash": 300e12, "efficient": 150e12, "cudnn": 300e12, "math": 20e12},
        "call_overhead_s": {"cpu": 30e-6, "cuda": 15e-6},
        "mask_build_s_per_element": 1.2e-9,  # a (B, 1, Tq, Tk) bool mask built per call
        # A padded batch runs as calls on each row's real keys from this many queries; below it
        # the kernel visits a causal band's every key (one 512-key block) and one dense call wins.
        "segments_min_queries": 512,
    },
    "chunked": {
        "forward_flops_per_s": 22e9,
        "forward_backward_factor": 2.7,  # forward+backward time over forward time
        "seconds_per_tile": 30e-6,
        # Per-tile extra work by call.mask_kind (causal: its diagonal tiles).
        "mask_factor": {"none": 1.0, "causal": 1.2, "float": 1.2, "bool": 1.75, "mod": 1.5, "prepared": 1.5},
        "dropout_factor": 1.85,  # hashing the dropout bits
    },
    "blocks": {
        # FLOPs are the visited (query block x key span) pairs; rates by queries per block.
        "flops_per_s": {32: 85e9, 64: 90e9, 128: 96e9, 256: 112e9},
        "short_span_keys": 1024,
        # Longer spans (causal, prefix-LM, long documents) are charged at this share of those
        # rates, so that auto keeps plain causal on sdpa's is_causal.
        "long_span_factor": 0.5,
        "forward_backward_factor": {32: 6.0, 64: 5.2, 128: 4.2, 256: 3.8},  # key gradients are per piece
        "seconds_per_block": 10e-6,  # a guess: views and the lse merge per block
        "call_overhead_s": 60e-6,  # a guess: planning is cached, Python per call remains
    },
    "flex": {
        "cpu": 60e9,  # the compiled CPU kernel, forward
        "cuda": 250e12,
        "call_overhead_s": 200e-6,  # Python and guard checks per call
        "compile_first_s": 20.0,  # the first torch.compile of flex_attention
        "compile_variant_s": 8.0,  # each further variant (shape, dtype, masked or not)
    },
}
