"""The "linear" benchmark: attnlab.linear_attention's backends beside transformers' chunked rule.

Two tables, every figure measured side by side in one interleaved run:

* **gated delta rule** (Qwen3-Next's and Qwen3.5's linear layer): B=1, H=4, Dk=Dv=128, fp32,
  T in (1024, 4096) (quick: 256), forward and forward+backward (the gradients of q, k, v, the
  decay and beta). Each backend of :data:`attnlab.linear.BACKENDS` but the fp64 oracle (the
  step-at-a-time ``recurrent`` one only up to :data:`RECURRENT_MAX` tokens: it is slow), beside
  transformers' ``torch_chunk_gated_delta_rule`` (what Qwen3-Next runs without
  flash-linear-attention), fed the same memory: q, k, v ``(B, T, H, D)`` as a model holds them
  (attnlab reads ``(B, H, T, D)`` views of it), l2-normalised q and k given to both
  (``use_qk_l2norm_in_kernel=False``). ``ratio`` is the row's time over transformers' in the same
  case (below 1: faster), and each row's note has its largest difference from transformers'
  output. GFLOP/s follow :func:`attnlab._flops.linear_attention_flops` (the chunked form's
  matmuls at C=64, the same count for every row); ``% of matmul`` is over a batched fp32 matmul
  of the chunked form's state shape, ``(B*H, T, Dk) @ (B*H, Dk, Dv)``, timed in the same rounds.
* **decode**: one token (T=1) with the state of a 1k- and a 16k-token context, through each
  backend and ``auto``, as tokens/s on one thread, beside softmax attention over a KV cache of the same context:
  the state does not grow with the context, so the linear rows stay flat where the cache's cost grows.

Example:
    >>> rows = linear_suite(lengths=(64,), contexts=(128,), rounds=1)   # doctest: +SKIP
    >>> rows[0].suite                                                   # doctest: +SKIP
    'linear'
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab import linear
from attnlab._flops import linear_attention_flops
from attnlab.functional import attention
from attnlab.lab.bench.timing import BenchRow, compare

__all__ = ["linear_suite", "gated_delta_rows", "decode_rows", "transformers_rule", "GatedDeltaInputs",
           "RECURRENT_MAX", "TRANSFORMERS"]

BATCH, HEADS, DIM = 1, 4, 128
RECURRENT_MAX = {"fwd": 1024, "fwd+bwd": 128}  # the longest T the step-at-a-time backend is timed at
TRANSFORMERS = "transformers torch_chunk_gated_delta_rule"
_MATMUL = "matmul (B*H, T, Dk) @ (Dk, Dv)"


def transformers_rule() -> tuple[Callable | None, str]:
    """transformers' ``torch_chunk_gated_delta_rule`` and ``""``, or None and why it is missing.

    Example:
        >>> rule, why = transformers_rule()
        >>> rule is not None or "transformers" in why
        True
    """
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    except ImportError as error:
        return None, f"transformers' Qwen3-Next is not installed ({error}): no row to compare with"
    return torch_chunk_gated_delta_rule, ""


class GatedDeltaInputs:
    """One gated-delta problem held as a model holds it: q, k, v ``(B, T, H, D)`` (q and k
    l2-normalised), the log-decay and beta ``(B, T, H)``, and the output's gradient.

    ``ours()`` are attnlab's ``(B, H, T, D)`` / ``(B, H, T)`` views of the same memory.

    Example:
        >>> problem = GatedDeltaInputs(8, heads=2, dim=4)
        >>> problem.q.shape, problem.ours()["q"].shape
        (torch.Size([1, 8, 2, 4]), torch.Size([1, 2, 8, 4]))
    """

    def __init__(self, t: int, *, batch: int = BATCH, heads: int = HEADS, dim: int = DIM, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        shape = (batch, t, heads, dim)
        self.q = F.normalize(torch.randn(shape, generator=gen), dim=-1)
        self.k = F.normalize(torch.randn(shape, generator=gen), dim=-1)
        self.v = torch.randn(shape, generator=gen)
        self.g = -(0.01 + 0.5 * torch.rand(batch, t, heads, generator=gen))  # log-decay per step, (B, T, H)
        self.beta = torch.rand(batch, t, heads, generator=gen)
        self.d_out = torch.randn(shape, generator=gen)  # (B, T, H, Dv)
        for x in (self.q, self.k, self.v, self.g, self.beta):
            x.requires_grad_(True)

    def ours(self) -> dict[str, Tensor]:
        """attnlab's arguments: ``(B, H, T, D)`` views of q, k, v, ``(B, H, T)`` of decay and beta."""
        q, k, v = (x.transpose(1, 2) for x in (self.q, self.k, self.v))  # (B, H, T, D)
        return dict(q=q, k=k, v=v, decay=self.g.transpose(1, 2), beta=self.beta.transpose(1, 2))

    def leaves(self) -> list[Tensor]:
        return [self.q, self.k, self.v, self.g, self.beta]


def _run(fn: Callable[[], Tensor], problem: GatedDeltaInputs, mode: str) -> Callable[[], None]:
    """One timed call: ``fn`` under no_grad (fwd), or with the gradients of every input (fwd+bwd)."""
    def forward() -> None:
        with torch.no_grad():
            fn()

    def forward_backward() -> None:
        torch.autograd.grad(fn(), problem.leaves(), problem.d_out)

    return forward if mode == "fwd" else forward_backward


def _candidates(problem: GatedDeltaInputs, t: int, mode: str, rule: Callable | None) -> tuple[dict, list]:
    """The functions to time, each returning ``(B, T, H, Dv)``, and ``(name, why)`` of those left out."""
    found: dict[str, Callable[[], Tensor]] = {}
    skipped = []
    for name in (n for n in linear.BACKENDS if n != "reference"):
        if name == "recurrent" and t > RECURRENT_MAX[mode]:
            skipped.append((f"attnlab {name}", f"not timed above T={RECURRENT_MAX[mode]} ({mode}): a step at a time"))
            continue
        found[f"attnlab {name}"] = (lambda name=name: linear.linear_attention(
            **problem.ours(), backend=name).transpose(1, 2))  # (B, T, H, Dv)
    if rule is not None:
        found[TRANSFORMERS] = lambda: rule(problem.q, problem.k, problem.v, g=problem.g, beta=problem.beta,
                                           use_qk_l2norm_in_kernel=False)[0]
    return found, skipped


def _matmul(t: int) -> tuple[Callable[[], None], float]:
    """The chunked form's state-shaped matmul, ``(B*H, T, Dk) @ (B*H, Dk, Dv)`` in fp32, and its FLOPs."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(BATCH * HEADS, t, DIM, generator=gen)
    b = torch.randn(BATCH * HEADS, DIM, DIM, generator=gen)
    return (lambda: torch.bmm(a, b)), 2.0 * BATCH * HEADS * t * DIM * DIM


def gated_delta_rows(t: int, mode: str, *, rounds: int = 3, min_run_time: float = 0.2) -> list[BenchRow]:
    """One case: every backend and transformers' rule on the gated delta rule at ``t`` tokens.

    Args:
        t: tokens. mode: ``"fwd"`` or ``"fwd+bwd"``. rounds, min_run_time: as :func:`compare`.

    Example:
        >>> rows = gated_delta_rows(32, "fwd", rounds=1, min_run_time=0.001)   # doctest: +SKIP
    """
    if mode not in RECURRENT_MAX:
        raise ValueError(f"mode must be one of {sorted(RECURRENT_MAX)}, got {mode!r}")
    rule, missing = transformers_rule()
    problem = GatedDeltaInputs(t)
    functions, skipped = _candidates(problem, t, mode, rule)
    matmul, matmul_flops = _matmul(t)
    timed = {name: _run(fn, problem, mode) for name, fn in functions.items()}
    seconds = compare({**timed, _MATMUL: matmul}, rounds=rounds, min_run_time=min_run_time)
    peak = matmul_flops / seconds.pop(_MATMUL)
    with torch.no_grad():
        outputs = {name: fn() for name, fn in functions.items()}
    flops = linear_attention_flops(BATCH, HEADS, t, DIM, delta=True, mode=mode)
    case = f"gated delta {mode} T={t}"
    theirs = seconds.get(TRANSFORMERS)
    rows = []
    for name, sec in seconds.items():
        row = BenchRow("linear", case, name, sec, flops, peak, t=t)
        if theirs is not None:
            row.ratio = sec / theirs
            if name != TRANSFORMERS:
                diff = float((outputs[name] - outputs[TRANSFORMERS]).abs().max())
                row.note = f"{theirs / sec:.2f}x transformers' speed; max |out - transformers'| {diff:.1e}"
        rows.append(row)
    if rule is None:
        rows.append(BenchRow("linear", case, TRANSFORMERS, None, note=missing, t=t))
    rows += [BenchRow("linear", case, name, None, note=why, t=t) for name, why in skipped]
    return rows


def decode_rows(context: int, *, rounds: int = 3, min_run_time: float = 0.2) -> list[BenchRow]:
    """One decoding step (T=1 with the state of a ``context``-token prefix), tokens/s on one
    thread (as the decode suite), beside softmax attention over a ``context``-token KV cache.

    The state is ``(B, H, Dk, Dv)`` whatever the context (its values do not change the work):
    a random one stands in for the prefix's. Each row's ``values`` holds ``tokens/s`` and the
    bytes the layer keeps (``state bytes``).

    Example:
        >>> rows = decode_rows(64, rounds=1, min_run_time=0.001)   # doctest: +SKIP
    """
    gen = torch.Generator().manual_seed(2)
    step = GatedDeltaInputs(1, seed=3).ours()
    step = {name: x.detach() for name, x in step.items()}
    state = torch.randn(BATCH, HEADS, DIM, DIM, generator=gen) * 0.1  # (B, H, Dk, Dv)
    keys = torch.randn(BATCH, HEADS, context, DIM, generator=gen)  # the KV cache, (B, H, T, D)
    values = torch.randn(BATCH, HEADS, context, DIM, generator=gen)
    candidates: dict[str, Callable[[], object]] = {}
    for name in ["auto", *(n for n in linear.BACKENDS if n != "reference")]:
        candidates[f"attnlab {name}, one step"] = (lambda name=name: linear.linear_attention(
            **step, initial_state=state, return_state=True, backend=name))
    softmax = "softmax attention, KV cache"
    candidates[softmax] = lambda: attention(step["q"], keys, values)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one token's work is small: spinning threads on a shared machine only add noise
    try:
        with torch.no_grad():
            seconds = compare(candidates, rounds=rounds, min_run_time=min_run_time)
    finally:
        torch.set_num_threads(threads)
    cache_bytes = 2 * keys.numel() * keys.element_size()
    state_bytes = state.numel() * state.element_size()
    case = f"decode step, context {context}"
    rows = []
    for name, sec in seconds.items():
        kept = cache_bytes if name == softmax else state_bytes
        rows.append(BenchRow("linear", case, name, sec, t=context, note=f"{1 / sec:,.0f} tokens/s, keeps {kept / 2**20:.2f} MiB",
                             values={"tokens/s": 1 / sec, "state bytes": float(kept)}))
    return rows


def linear_suite(*, quick: bool = False, lengths: tuple[int, ...] | None = None,
                 contexts: tuple[int, ...] = (1024, 16384), rounds: int | None = None,
                 progress: Callable[[str], None] | None = None) -> list[BenchRow]:
    """The gated-delta rows at every length and mode, then the decode rows at every context.

    Args:
        quick: T=256 and one round (the default: T in (1024, 4096), 3 rounds).
        lengths, contexts, rounds: override the sizes and the rounds.
        progress: told what is timed next.

    Example:
        >>> rows = linear_suite(lengths=(32,), contexts=(64,), rounds=1)   # doctest: +SKIP
    """
    lengths = lengths or ((256,) if quick else (1024, 4096))
    rounds = rounds if rounds is not None else (1 if quick else 3)
    min_run_time = 0.05 if quick else 0.2
    rows: list[BenchRow] = []
    for t in lengths:
        for mode in ("fwd", "fwd+bwd"):
            if progress is not None:
                progress(f"linear: gated delta {mode}, T={t}")
            rows += gated_delta_rows(t, mode, rounds=rounds, min_run_time=min_run_time)
    for context in contexts:
        if progress is not None:
            progress(f"linear: one decoding step, context {context}")
        rows += decode_rows(context, rounds=rounds, min_run_time=min_run_time)
    return rows
