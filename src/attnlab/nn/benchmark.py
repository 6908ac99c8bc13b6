"""The "modules" benchmark: attnlab's MultiHeadAttention beside the modules people compare it to.

In one run, with the same weights in every module, causal self-attention on ``(B, T, C)``:

* ``attnlab`` -- :class:`attnlab.nn.MultiHeadAttention` with ``backend="auto"``;
* ``torch.nn.MultiheadAttention`` -- ``need_weights=False`` with a causal ``attn_mask`` and
  ``is_causal=True`` (its fastest causal call);
* ``seed document`` -- document 001's module as written: three projections, an explicit
  masked softmax over the full score matrix (:class:`SeedMultiHeadAttention`);
* ``nanoGPT-style`` -- one fused projection and ``F.scaled_dot_product_attention(is_causal=True)``
  (:class:`NanoGPTAttention`).

Each is timed forward (``torch.no_grad()``) and forward+backward (gradients of the input and
every weight) with :func:`attnlab.bench.compare`: rounds are interleaved across the modules so
that a change in machine load hits them alike, and the median is reported beside the fp32
matmul rate measured in the same run (:func:`attnlab.bench.matmul_peak`). FLOPs count the module: projections
``2*B*T*C*4C`` plus causal attention ``4*B*H*T*T*D / 2`` forward; forward+backward is 3x the
projections plus 3.5x the attention (DESIGN.md's convention for the attention part).

Example:
    >>> rows = run_modules_suite(quick=True, repeats=1, console=False)   # doctest: +SKIP
    >>> [row.name for row in rows][:1]                                    # doctest: +SKIP
    ['attnlab']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab import backends as _backends
from attnlab import bench
from attnlab.nn.multihead import MultiHeadAttention

__all__ = ["SeedMultiHeadAttention", "NanoGPTAttention", "ModulesConfig", "build_modules", "run_modules_suite"]


class SeedMultiHeadAttention(nn.Module):
    """Document 001's MultiHeadAttention as written: explicit masked softmax, O(T^2) scores.

    Shapes:
        x: ``(B, T, d_in)`` -> ``(B, T, d_out)``.

    Example:
        >>> SeedMultiHeadAttention(8, 8, 16, 0.0, 2)(torch.randn(1, 5, 8)).shape
        torch.Size([1, 5, 8])
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        mask = torch.triu(torch.ones(context_length, context_length), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, x: Tensor) -> Tensor:
        b, num_tokens, _ = x.shape
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        shape = (b, num_tokens, self.num_heads, self.head_dim)
        keys = keys.view(shape).transpose(1, 2)  # (b, H, T, hd)
        queries = queries.view(shape).transpose(1, 2)
        values = values.view(shape).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)  # (b, H, T, T)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = self.dropout(torch.softmax(attn_scores / self.head_dim**0.5, dim=-1))
        context_vec = (attn_weights @ values).transpose(1, 2).contiguous()  # (b, T, H, hd)
        return self.out_proj(context_vec.view(b, num_tokens, self.d_out))


class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: fused ``c_attn``, SDPA with ``is_causal=True``, ``c_proj``.

    Shapes:
        x: ``(B, T, C)`` -> ``(B, T, C)``.

    Example:
        >>> NanoGPTAttention(8, 2)(torch.randn(1, 5, 8)).shape
        torch.Size([1, 5, 8])
    """

    def __init__(self, n_embd: int, n_head: int, *, bias: bool = True):
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        heads = (B, T, self.n_head, C // self.n_head)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))  # (B, T, C)


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
    ours = MultiHeadAttention(C, C, T, 0.0, H, qkv_bias=True).to(config.dtype)
    theirs = ours.to_torch(batch_first=True)
    seed = SeedMultiHeadAttention(C, C, T, 0.0, H, qkv_bias=True).to(config.dtype)
    nano = NanoGPTAttention(C, H).to(config.dtype)
    with torch.no_grad():
        for part in ("W_query", "W_key", "W_value"):
            getattr(seed, part).weight.copy_(getattr(ours, part).weight)
            getattr(seed, part).bias.copy_(getattr(ours, part).bias)
        nano.c_attn.weight.copy_(ours.in_proj_weight)
        nano.c_attn.bias.copy_(ours.in_proj_bias)
        for target in (seed.out_proj, nano.c_proj):
            target.load_state_dict(ours.out_proj.state_dict())
    blocked = ~torch.ones(T, T, dtype=torch.bool).tril()  # torch: True = may NOT attend

    def torch_mha(x: Tensor) -> Tensor:
        return theirs(x, x, x, attn_mask=blocked, is_causal=True, need_weights=False)[0]

    contenders = {"attnlab": ours}
    if "sdpa" in _backends.available():  # the module on a named backend, to separate dispatch
        pinned = MultiHeadAttention(C, C, T, 0.0, H, qkv_bias=True, backend="sdpa").to(config.dtype)
        pinned.load_state_dict(ours.state_dict())
        contenders["attnlab backend=sdpa"] = pinned
    contenders.update({"torch.nn.MultiheadAttention": torch_mha, "seed document": seed,
                       "nanoGPT-style": nano})
    return contenders


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
          diffs: dict[str, float]) -> list[bench.BenchRow]:
    flops = config.flops(backward=mode == "fwd+bwd")
    fastest_other = min(t for name, t in medians.items() if not name.startswith("attnlab"))
    case = f"{mode} B={config.batch} T={config.seq_len} C={config.d_model} H={config.num_heads}"
    return [
        bench.BenchRow("modules", case, name, seconds, flops, peak, seconds / fastest_other,
                       note=f"max |out - attnlab| {diffs[name]:.1e}")
        for name, seconds in medians.items()
    ]


def run_modules_suite(*, quick: bool = False, console=None, repeats: int | None = None
                      ) -> list[bench.BenchRow]:
    """Time attnlab's module beside torch's, the seed document's and a nanoGPT-style one.

    Args:
        quick: a small configuration (B=2, T=256) instead of B=8, T=1024, d_model=768.
        console: a ``rich.console.Console`` to print the table to; ``None`` makes one, ``False``
            prints nothing.
        repeats: interleaved timing rounds (default 5, quick 3); the median is reported.

    Returns:
        :class:`attnlab.bench.BenchRow` s, one per module and mode (``case`` starts with
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
    peak = bench.matmul_peak(config.dtype, n=2048)  # the size bench_backends.py uses
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        grad_out = None if mode == "fwd" else torch.randn_like(x)
        x_in = x if grad_out is None else x.clone().requires_grad_(True)
        steps = {name: _step(module, x_in, grad_out) for name, module in modules.items()}
        medians = bench.compare(steps, rounds=repeats, min_run_time=0.2)
        rows += _rows(config, medians, mode, peak, diffs)
    if console is not False:
        _print(rows, config, peak, repeats, console)
    return rows


def _print(rows, config: ModulesConfig, peak: float, repeats: int, console) -> None:
    from rich.console import Console

    console = Console() if console is None else console
    dtype = str(config.dtype).replace("torch.", "")
    bench.print_rows(rows, title=f"causal self-attention modules, {dtype}, median of {repeats} "
                                 "interleaved rounds", console=console)
    console.print(
        f"machine: {bench.machine_line()}; fp32 matmul {peak / 1e9:.1f} GFLOP/s this run.\n"
        "FLOPs (module): projections 2*B*T*C*4C + causal attention 4*B*H*T*T*D/2 forward; "
        "fwd+bwd = 3x projections + 3.5x attention. ratio = median / fastest non-attnlab module "
        "(attnlab's target <= 1.00)."
    )
