"""The "modules" benchmark: attnlab's MultiHeadAttention beside the modules people compare it to.

In one run, with the same weights in every module, causal self-attention on ``(B, T, C)``:

* ``attnlab`` -- :class:`attnlab.nn.MultiHeadAttention` with ``backend="auto"``;
* ``torch.nn.MultiheadAttention`` -- ``need_weights=False`` with a causal ``attn_mask`` and
  ``is_causal=True`` (its fastest causal call);
* ``seed document`` -- the tutorial "Attention for your Transformers"'s module as written: three
  projections, an explicit masked softmax over the full score matrix (:class:`SeedMultiHeadAttention`);
* ``nanoGPT-style`` -- one fused projection and ``F.scaled_dot_product_attention(is_causal=True)``
  (:class:`NanoGPTAttention`).

Each is timed forward (``torch.no_grad()``) and forward+backward (gradients of the input and
every weight) with :func:`~attnlab.lab.bench.timing.compare`: rounds are interleaved across the modules so
that a change in machine load hits them alike, and the median is reported beside the fp32
matmul rate measured in the same run (:func:`attnlab.lab.bench.timing.matmul_peak`). FLOPs count the module: projections
``2*B*T*C*4C`` plus causal attention ``4*B*H*T*T*D / 2`` forward; forward+backward is 3x the
projections plus 3.5x the attention (attnlab's FLOP convention for the attention part, :mod:`attnlab._flops`).

Example:
    >>> rows = run_modules_suite(quick=True, repeats=1, console=False)   # doctest: +SKIP
    >>> [row.name for row in rows][:1]                                    # doctest: +SKIP
    ['attnlab']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab.backends import available
from attnlab.lab.bench.competitors import NanoGPTAttention, SeedMultiHeadAttention
from attnlab.lab.bench.timing import BenchRow, compare, machine_line, matmul_peak, print_rows
from attnlab.nn.convert import to_torch
from attnlab.nn.multihead import MultiHeadAttention
from attnlab.nn.multihead import QKV

__all__ = ["ModulesConfig", "build_modules", "nanogpt_twin", "run_modules_suite"]


@dataclass(frozen=True)
class ModulesConfig:
    """Sizes of the modules benchmark (defaults: the issue's B=8, T=1024, d_model=768, 12 heads).

    Example:
        >>> ModulesConfig.for_run(quick=True).batch
        2
    """

    batch: int = 8
    seq_len: int = 1024
    d_model: int = 768
    num_heads: int = 12
    dtype: torch.dtype = torch.float32

    @classmethod
    def for_run(cls, *, quick: bool = False) -> "ModulesConfig":
        """The full configuration, or a small one (B=2, T=256) for a quick check."""
        return cls(batch=2, seq_len=256) if quick else cls()

    def flops(self, *, backward: bool) -> float:
        """Module FLOPs (projections + causal attention), forward or forward+backward."""
        B, T, C, H = self.batch, self.seq_len, self.d_model, self.num_heads
        projections = 2 * B * T * C * 4 * C
        attention = 4 * B * H * T * T * (C // H) / 2
        return 3 * projections + 3.5 * attention if backward else projections + attention


def build_modules(config: ModulesConfig) -> dict[str, Callable[[Tensor], Tensor]]:
    """The contenders with identical weights, as callables ``x -> out``.

    attnlab's module runs with ``backend="auto"`` and, when available, also pinned to
    ``backend="sdpa"`` (same weights), which separates the module's own cost from the backend
    that ``auto`` picks.

    Example:
        >>> sorted(build_modules(ModulesConfig(batch=1, seq_len=8, d_model=16, num_heads=2)))
        ['attnlab', 'attnlab backend=sdpa', 'nanoGPT-style', 'seed document', 'torch.nn.MultiheadAttention']
    """
    C, H, T = config.d_model, config.num_heads, config.seq_len
    ours = MultiHeadAttention(C, C, T, 0.0, H, qkv=QKV(bias=True)).to(config.dtype)
    theirs = to_torch(ours, batch_first=True)
    seed = SeedMultiHeadAttention(C, C, T, 0.0, H, qkv_bias=True).to(config.dtype)
    with torch.no_grad():
        for part in ("query", "key", "value"):
            weight, bias = ours.projection(part)
            getattr(seed, f"W_{part}").weight.copy_(weight)
            getattr(seed, f"W_{part}").bias.copy_(bias)
        seed.out_proj.load_state_dict(ours.out_proj.state_dict())
    nano = nanogpt_twin(ours, num_heads=H)
    blocked = ~torch.ones(T, T, dtype=torch.bool).tril()  # torch: True = may NOT attend

    def torch_mha(x: Tensor) -> Tensor:
        return theirs(x, x, x, attn_mask=blocked, is_causal=True, need_weights=False)[0]

    contenders = {"attnlab": ours}
    if "sdpa" in available():  # the module on a named backend, to separate dispatch
        pinned = MultiHeadAttention(C, C, T, 0.0, H, backend="sdpa", qkv=QKV(bias=True)).to(config.dtype)
        pinned.load_state_dict(ours.state_dict())
        contenders["attnlab backend=sdpa"] = pinned
    contenders.update({"torch.nn.MultiheadAttention": torch_mha, "seed document": seed,
                       "nanoGPT-style": nano})
    return contenders


def nanogpt_twin(ours: MultiHeadAttention, *, num_heads: int) -> NanoGPTAttention:
    """A :class:`NanoGPTAttention` computing the same function as ``ours`` (its fused input
    projection and output projection copied; ``ours`` must have biases).

    Example:
        >>> ours = MultiHeadAttention(16, 16, 8, 0.0, 2, qkv=QKV(bias=True))
        >>> x = torch.randn(1, 8, 16)
        >>> bool(torch.allclose(nanogpt_twin(ours, num_heads=2)(x), ours(x), atol=1e-5))
        True
    """
    weight = ours.in_proj_weight  # (3C, C): query, key, value rows, as nanoGPT's c_attn
    nano = NanoGPTAttention(weight.shape[1], num_heads).to(weight.dtype)
    with torch.no_grad():
        nano.c_attn.weight.copy_(weight)
        nano.c_attn.bias.copy_(ours.in_proj_bias)
        nano.c_proj.load_state_dict(ours.out_proj.state_dict())
    return nano


def _step(module: Callable, x: Tensor, grad_out: Tensor | None) -> Callable[[], object]:
    """One timed unit: a no-grad forward, or a forward and a backward to input and weights."""
    if grad_out is None:
        def forward():
            with torch.no_grad():
                return module(x)
        return forward

    def forward_backward():
        x.grad = None
        module(x).backward(grad_out)
    return forward_backward


def _max_differences(modules: dict[str, Callable], x: Tensor) -> dict[str, float]:
    """Largest |out - attnlab's out| per module: the contenders compute the same function."""
    with torch.no_grad():
        outs = {name: module(x) for name, module in modules.items()}
    return {name: (out - outs["attnlab"]).abs().max().item() for name, out in outs.items()}


def _rows(config: ModulesConfig, medians: dict[str, float], mode: str, peak: float,
          diffs: dict[str, float]) -> list[BenchRow]:
    flops = config.flops(backward=mode == "fwd+bwd")
    fastest_other = min(t for name, t in medians.items() if not name.startswith("attnlab"))
    case = f"{mode} B={config.batch} T={config.seq_len} C={config.d_model} H={config.num_heads}"
    return [
        BenchRow("modules", case, name, seconds, flops, peak, seconds / fastest_other,
                 note=f"max |out - attnlab| {diffs[name]:.1e}", t=config.seq_len)
        for name, seconds in medians.items()
    ]


def run_modules_suite(*, quick: bool = False, console=None, repeats: int | None = None
                      ) -> list[BenchRow]:
    """Time attnlab's module beside torch's, the tutorial's and a nanoGPT-style one.

    Args:
        quick: a small configuration (B=2, T=256) instead of B=8, T=1024, d_model=768.
        console: a ``rich.console.Console`` to print the table to; ``None`` makes one, ``False``
            prints nothing.
        repeats: interleaved timing rounds (default 5, quick 3); the median is reported.

    Returns:
        :class:`attnlab.BenchRow` s, one per module and mode (``case`` starts with
        ``"fwd"`` or ``"fwd+bwd"``). ``flops`` is the module's (see :meth:`ModulesConfig.flops`),
        ``peak`` the fp32 matmul rate measured in the same run, ``ratio`` the median time over
        the fastest non-attnlab module's (attnlab's target: <= 1.00), ``note`` the largest
        output difference from attnlab's module.

    Example:
        >>> rows = run_modules_suite(quick=True, repeats=1, console=False)  # doctest: +SKIP
        >>> rows[0].name, rows[0].ratio <= 1.2                              # doctest: +SKIP
        ('attnlab', True)
    """
    config = ModulesConfig.for_run(quick=quick)
    repeats = (3 if quick else 5) if repeats is None else repeats
    torch.manual_seed(0)
    modules = build_modules(config)
    x = torch.randn(config.batch, config.seq_len, config.d_model, dtype=config.dtype)
    diffs = _max_differences(modules, x)
    peak = matmul_peak(config.dtype, n=2048)  # the size bench_backends.py uses
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        grad_out = None if mode == "fwd" else torch.randn_like(x)
        x_in = x if grad_out is None else x.clone().requires_grad_(True)
        steps = {name: _step(module, x_in, grad_out) for name, module in modules.items()}
        medians = compare(steps, rounds=repeats, min_run_time=0.2)
        rows += _rows(config, medians, mode, peak, diffs)
    if console is not False:
        _print(rows, config, peak, repeats, console)
    return rows


def _print(rows, config: ModulesConfig, peak: float, repeats: int, console) -> None:
    from rich.console import Console

    console = Console() if console is None else console
    dtype = str(config.dtype).replace("torch.", "")
    print_rows(rows, title=f"causal self-attention modules, {dtype}, median of {repeats} "
                                 "interleaved rounds", console=console)
    console.print(
        f"machine: {machine_line()}; fp32 matmul {peak / 1e9:.1f} GFLOP/s this run.\n"
        "FLOPs (module): projections 2*B*T*C*4C + causal attention 4*B*H*T*T*D/2 forward; "
        "fwd+bwd = 3x projections + 3.5x attention. ratio = median / fastest non-attnlab module "
        "(attnlab's target <= 1.00)."
    )
