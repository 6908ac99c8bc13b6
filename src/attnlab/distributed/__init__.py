"""Exact context-parallel attention over ``torch.distributed``: ring (zigzag) and Ulysses.

When one sequence is too long for one device, each rank of a process group holds a shard of it
(:mod:`attnlab.distributed.layout`) and :func:`context_parallel_attention` returns that rank's
shard of the output, equal to single-process :func:`attnlab.attention` on the whole sequence:

* ``method="ring"`` (:mod:`~attnlab.distributed.ring`): key/value shards travel round the ring
  while each rank keeps its queries; memory per rank falls as ``1/P``; causal work is balanced
  by the zigzag layout.
* ``method="ulysses"`` (:mod:`~attnlab.distributed.ulysses`): all-to-all from sequence shards
  to head shards, ordinary attention with any attnlab mask, all-to-all back; needs the heads
  divisible by ``P``.

It runs on any backend of ``torch.distributed`` (gloo on CPU, NCCL on GPU), launched with
``torchrun``. ``python -m attnlab.lab.cli._cp_check`` checks both methods against one process
(see ``docs/distributed.md`` for when each wins). :func:`context_parallel` makes a layer, a
block or a GPT run its attention over shards: it swaps each ``MultiHeadAttention``'s attention
function part for a :class:`ShardedAttention`.

Example (run under ``torchrun --nproc-per-node 2``)::

    import torch, torch.distributed as dist
    from attnlab.distributed import context_parallel_attention, shard, unshard
    dist.init_process_group("gloo")
    torch.manual_seed(0)                                  # the same global tensors everywhere
    q, k, v = (torch.randn(1, 4, 1024, 64) for _ in range(3))
    q_l, k_l, v_l = (shard(t, dim=2) for t in (q, k, v))  # zigzag shards
    out_l = context_parallel_attention(q_l, k_l, v_l, causal=True)
    out = unshard(out_l, dim=2)                           # == attnlab.attention(q, k, v, causal=True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab._call import build_call
from attnlab._checks import divisible, instance_of, int_value, one_of, positive_int
from attnlab.distributed._agreement import check_agreement
from attnlab.distributed._global import check_score_options
from attnlab.distributed._args import timeout_seconds
from attnlab.distributed._comm import DEFAULT_TIMEOUT, CommStats, Peers, peers
from attnlab import masks as _masks
from attnlab.distributed.hybrid import hybrid_attention
from attnlab.distributed.linear import context_parallel_linear_attention
from attnlab.distributed.layout import (LAYOUTS, ChunkLayout, check_layout, check_length, hybrid_layout, positions,
                                        shard, unshard)
from attnlab.distributed.ring import RingPlan, ring_attention, ring_plan
from attnlab.distributed.ulysses import ulysses_attention
from attnlab.nn.gated import _ProjectedAttention
from attnlab.nn.compressed import CompressedAttention
from attnlab.nn.latent import LatentAttention
from attnlab.nn.multihead import MultiHeadAttention
from attnlab.nn.native_sparse import NativeSparseAttention
from attnlab.nn.recurrent import _DeltaLayer

# Attention modules that hold their own attention path, not a MultiHeadAttention's part: left
# alone, each rank would attend over its own shard only (differential, gated, top-k come from
# _ProjectedAttention), and a recurrent layer would start each shard from a zero state with its
# convolution blind to the previous rank's tokens (context_parallel_linear_attention is the
# functional form for these; the layers' own path over shards is not built).
_NOT_SHARDED = (LatentAttention, _ProjectedAttention, NativeSparseAttention, _DeltaLayer,
                CompressedAttention)

__all__ = ["context_parallel_attention", "context_parallel_linear_attention", "context_parallel", "ContextParallel", "ShardedAttention", "CommStats", "METHODS", "LAYOUTS",
           "ChunkLayout", "RingPlan", "ring_plan", "hybrid_layout", "shard", "unshard", "positions", "DEFAULT_TIMEOUT"]

METHODS = ("ring", "ulysses", "hybrid")


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    mask: Tensor | Callable | None = None,
    scale: float | None = None,
    score_mod=None,
    sinks: Tensor | None = None,
    method: str = "ring",
    layout: str | ChunkLayout = "zigzag",
    ulysses: int | None = None,
    head_chunks: int = 1,
    group=None,
    timeout: float | None = None,
    stats: CommStats | None = None,
) -> Tensor:
    """This rank's shard of ``attention(q, k, v)`` over a sequence split across ``group``.

    Shapes (this rank's shards, ``T_local = T / P``, in the positions ``layout`` assigns):
        q ``(B, Hq, T_local, D)``, k ``(B, Hkv, T_local, D)``, v ``(B, Hkv, T_local, Dv)``
        -> out ``(B, Hq, T_local, Dv)``. ``Hq`` a multiple of ``Hkv`` (grouped-query attention:
        the ring passes only the ``Hkv`` heads around).

    Args:
        q, k, v: this rank's shards; every rank passes the same shapes, dtype and options
            (``causal``, ``mask`` with the values it holds, ``scale``, ``method``, ``layout``, grad
            mode), checked with one small all-gather before any work: a mismatch raises
            ``ValueError`` on every rank, naming what differs.
        causal: causal mask over global positions.
        mask: a mask over the global sequence (global query/key indices). ``method="ulysses"``
            takes any attnlab mask: a mask mod (global head numbers too) or a tensor
            broadcasting to ``(B, Hq, T, T)``. ``method="ring"`` takes attnlab's mask mods and
            ANDs of them (documents, sliding windows, prefix-LM, varlen, chunked local): each
            ring step computes only the key blocks the mod reaches, and a key/value shard no
            rank further along the ring can reach is not sent (``stats.plan`` says which).
        scale: score multiplier; defaults to ``1 / sqrt(D)``.
        score_mod: a score mod over the global sequence (:mod:`attnlab.scores`: softcap, ALiBi,
            T5's relative bias, a bias tensor ``(B|1, Hq|1, T, T)``, compositions, a function of
            your own), evaluated at global query/key positions and global head numbers on
            every method; the ring then computes its pieces with the tiled kernel. Its tensors
            may not require grad (``ValueError``): the scores are differentiated, not the mod.
        sinks: ``(Hq,)`` per-head sink logits (a key of value 0 in every row's softmax), as in
            :func:`attnlab.attention`; their gradient on each rank is that rank's queries' share
            (sum it across ranks, as for the module weights every rank holds). Per-query sinks
            are refused (``ValueError``).
        method: ``"ring"``, ``"ulysses"`` or ``"hybrid"`` (Ulysses inside groups of ``ulysses``
            consecutive ranks, the ring across the groups: :mod:`~attnlab.distributed.hybrid`;
            the shards are then in :func:`~attnlab.distributed.layout.hybrid_layout`'s
            positions, ``layout`` being the ring's layout over the ``P / ulysses`` groups).
        layout: ``"zigzag"`` (rank ``r`` holds chunks ``r`` and ``2P-1-r`` of ``2P``; balanced
            causal work), ``"contiguous"`` (chunk ``r`` of ``P``) or a
            :class:`~attnlab.distributed.layout.ChunkLayout` (e.g. one balancing a document
            mask: :func:`attnlab.distributed.balance.balanced_layout`); the global length must
            be a multiple of the chunk count (``ValueError`` otherwise; attnlab does not pad).
        ulysses: ``method="hybrid"`` only: ranks per Ulysses group (divides ``P``, and the query
            and key/value heads).
        head_chunks: ring and hybrid: run the ring once per chunk of key/value heads (at most
            one per head), so what is in flight (the shard being sent and the one arriving,
            the gradient accumulators) and the per-step temporaries shrink by that factor;
            only the whole-size output, log-sum-exp and gradients stay. Costs ``head_chunks``
            times the messages (the bytes are the same). 1 (default): one ring for all heads.
        group: process group (default: the world).
        timeout: seconds to wait for a peer before raising ``RuntimeError`` (default 300): a rank
            that raised, exited or stalled fails the others instead of hanging them.
        stats: a :class:`CommStats` to add this call's bytes sent, messages and scores computed to.

    Returns:
        This rank's output shard, differentiable in ``q``, ``k``, ``v`` (every rank must run
        backward, as the ring's backward passes gradients between ranks).

    Raises:
        TypeError: an option of the wrong kind (``method=1``, ``scale="0.5"``, ...).
        ValueError: bad shapes or options, ``T`` not divisible, heads not divisible by ``P``
            (Ulysses), ranks that disagree.
        RuntimeError: torch.distributed not initialised; a peer failed or timed out.

    Example (under ``torchrun --nproc-per-node 2``; see the module docstring)::

        out_l = context_parallel_attention(q_l, k_l, v_l, causal=True, method="ulysses")
    """
    _check_kinds(method=method, layout=layout, causal=causal, mask=mask, scale=scale, stats=stats)
    positive_int("head_chunks", head_chunks)
    who = peers(group, timeout)
    call = build_call(q, k, v, causal=causal, scale=scale)  # checks dtypes, ranks, heads, sizes
    _check_shards(q, k, v, mask, method, ulysses, who)
    global_len = q.shape[2] * who.world
    check_length(global_len, layout=sequence_layout(layout, method=method, ulysses=ulysses, world=who.world),
                 world=who.world, name="global sequence length (T_local * world)")
    score_mod, sinks = check_score_options(score_mod, sinks, batch=q.shape[0], heads=q.shape[1], length=global_len,
                                           device=q.device, dtype=q.dtype)
    # Everything that changes the result, so that ranks never silently compute different things.
    check_agreement({"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape), "dtype": q.dtype,
                     "causal": causal, "scale": call.scale, "mask": mask, "score_mod": score_mod, "sinks": sinks,
                     "method": method, "layout": layout, "ulysses": ulysses, "head_chunks": head_chunks,
                     "grad": torch.is_grad_enabled() and call.requires_grad}, who, q.device)
    options = dict(who=who, layout=layout, causal=causal, scale=call.scale, mask=mask, stats=stats,
                   score_mod=score_mod, sinks=sinks)
    if method == "ring":
        return ring_attention(q, k, v, head_chunks=head_chunks, **options)
    if method == "hybrid":
        return hybrid_attention(q, k, v, ulysses=ulysses, head_chunks=head_chunks, **options)
    return ulysses_attention(q, k, v, **options)


def _check_kinds(*, method, layout, causal, mask, scale, stats) -> None:
    """``TypeError`` for an option of the wrong kind, ``ValueError`` for a bad choice."""
    one_of("method", method, METHODS)
    check_layout(layout)
    instance_of("causal", causal, bool, "a bool")
    if mask is not None and not (isinstance(mask, torch.Tensor) or callable(mask)):
        raise TypeError(f"mask must be a tensor, a mask mod or None, got {type(mask).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if stats is not None:
        instance_of("stats", stats, CommStats, "a CommStats or None")


def sequence_layout(layout, *, method: str, ulysses: int | None, world: int):
    """Where each rank's tokens lie: ``layout`` itself, or for ``method="hybrid"`` the
    :func:`~attnlab.distributed.layout.hybrid_layout` of ``layout`` over the ring groups.

    Example:
        >>> sequence_layout("zigzag", method="hybrid", ulysses=2, world=4).chunks
        ((0, 1), (6, 7), (2, 3), (4, 5))
    """
    if method != "hybrid":
        return layout
    return hybrid_layout(layout, ring=world // ulysses, ulysses=ulysses)


def _check_shards(q: Tensor, k: Tensor, v: Tensor, mask, method: str, ulysses, who: Peers) -> None:
    if q.ndim != 4:
        raise ValueError(f"q, k, v must be (B, H, T_local, D) shards; got q of shape {tuple(q.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k must hold the same positions as q (self-attention over one sharded "
                         f"sequence): q has T_local={q.shape[2]}, k has {k.shape[2]}")
    if method == "hybrid":
        if ulysses is None:
            raise ValueError("method='hybrid' needs ulysses=U, the ranks of each Ulysses group")
        positive_int("ulysses", ulysses)
        divisible("world size", who.world, "ulysses", ulysses)
        divisible("q heads", q.shape[1], "ulysses", ulysses)
        divisible("k/v heads", k.shape[1], "ulysses", ulysses)
    elif ulysses is not None:
        raise ValueError(f"ulysses={ulysses!r} is the Ulysses group size of method='hybrid'; "
                         f"method={method!r} takes none")
    if mask is not None and method != "ulysses" and not _masks.has_row_ranges(mask):
        raise ValueError(f"mask: the ring takes attnlab's mask mods (documents, windows, prefix-LM, varlen, "
                         f"ANDs of them: one key interval per query) over the global sequence; got "
                         f"{_masks_kind(mask)}: use method='ulysses' for any other mask")
    if method == "ulysses":
        divisible("q heads", q.shape[1], "world size", who.world)
        divisible("k/v heads", k.shape[1], "world size", who.world)


def _masks_kind(mask) -> str:
    if isinstance(mask, Tensor):
        return f"a dense {mask.dtype} mask"
    return f"{mask!r}"


@dataclass(frozen=True)
class ContextParallel:
    """How a module shards its sequence: apply it with :func:`context_parallel`.

    Attributes:
        group: process group (None: the world).
        method: ``"ring"``, ``"ulysses"`` or ``"hybrid"`` (Ulysses inside groups of ``ulysses``
            consecutive ranks, the ring across the groups: :mod:`~attnlab.distributed.hybrid`;
            the shards are then in :func:`~attnlab.distributed.layout.hybrid_layout`'s
            positions, ``layout`` being the ring's layout over the ``P / ulysses`` groups).
        layout: ``"zigzag"``, ``"contiguous"`` or a :class:`ChunkLayout`.
        timeout: seconds to wait for a peer (None: 300).
        ulysses: ``method="hybrid"`` only: ranks per Ulysses group.
        head_chunks: ring and hybrid: run the ring once per chunk of key/value heads, for
            smaller buffers in flight (see :func:`context_parallel_attention`).

    Example:
        >>> ContextParallel(method="ulysses", layout="contiguous").method
        'ulysses'
        >>> ContextParallel(method="hybrid", ulysses=2).sequence_layout(4).chunks
        ((0, 1), (6, 7), (2, 3), (4, 5))
    """

    group: object = None
    method: str = "ring"
    layout: str | ChunkLayout = "zigzag"
    timeout: float | None = None
    ulysses: int | None = None
    head_chunks: int = 1

    def __post_init__(self):
        one_of("method", self.method, METHODS)
        positive_int("head_chunks", self.head_chunks)
        check_layout(self.layout)
        timeout_seconds(self.timeout)
        if self.ulysses is not None:
            positive_int("ulysses", self.ulysses)
        if (self.method == "hybrid") != (self.ulysses is not None):
            raise ValueError(f"ulysses: method='hybrid' needs ulysses=U and the other methods take none; "
                             f"got method={self.method!r}, ulysses={self.ulysses!r}")

    def sequence_layout(self, world: int):
        """Where each rank's tokens lie over ``world`` ranks (what to ``shard`` with).

        Example:
            >>> ContextParallel().sequence_layout(2)
            'zigzag'
        """
        return sequence_layout(self.layout, method=self.method, ulysses=self.ulysses, world=world)

    def shard(self, x: Tensor, *, dim: int) -> Tensor:
        """This rank's shard of the global ``x`` along ``dim``, in this setting's layout.

        Example (under torchrun with 2 processes)::

            ContextParallel().shard(torch.arange(8).view(1, 8), dim=1)   # rank 0: [[0, 1, 6, 7]]
        """
        world, _ = self.world_and_rank()
        return shard(x, dim=dim, layout=self.sequence_layout(world), group=self.group)

    def world_and_rank(self) -> tuple[int, int]:
        """``(P, r)``: the group's size and this rank (needs torch.distributed initialised).

        Example (under torchrun with 2 processes)::

            ContextParallel().world_and_rank()   # (2, 0) on rank 0
        """
        who = peers(self.group, self.timeout)
        return who.world, who.rank

    def positions(self, local_len: int, *, device=None) -> Tensor:
        """Global positions ``(local_len,)`` of this rank's tokens (for RoPE and learned positions).

        Example (under torchrun with 2 processes, zigzag)::

            ContextParallel().positions(4)   # rank 0: tensor([0, 1, 6, 7])
        """
        int_value("local_len", local_len)
        world, rank = self.world_and_rank()
        return positions(local_len * world, layout=self.sequence_layout(world), rank=rank, world=world,
                         device=device)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, mask=None,
                  scale: float | None = None, score_mod=None, sinks: Tensor | None = None) -> Tensor:
        """:func:`context_parallel_attention` with this setting.

        Example (under torchrun)::

            out_l = ContextParallel(method="ring").attention(q_l, k_l, v_l, causal=True)
        """
        return context_parallel_attention(q, k, v, causal=causal, mask=mask, scale=scale, score_mod=score_mod,
                                          sinks=sinks, method=self.method, layout=self.layout, ulysses=self.ulysses,
                                          head_chunks=self.head_chunks, group=self.group, timeout=self.timeout)


class ShardedAttention:
    """A layer's attention function part that runs over this rank's shard of the sequence.

    :func:`context_parallel` puts it into each ``MultiHeadAttention`` (its ``attention``
    part); the layer then projects its shard, rotates at :meth:`positions` and calls it with
    its whole rule (causal, window mod, score mods, sinks). ``inner`` is the part it replaced,
    put back by ``context_parallel(module, None)``.

    Shapes:
        q ``(B, H, T_local, D)``, k and v ``(B, Hkv, T_local, D)`` -> ``(B, H, T_local, D)``.

    Example:
        >>> from attnlab.nn import MultiHeadAttention
        >>> mha = context_parallel(MultiHeadAttention(8, 8, num_heads=2), ContextParallel(method="ulysses"))
        >>> mha.attention
        ShardedAttention(ContextParallel(group=None, method='ulysses', layout='zigzag', timeout=None, ulysses=None, head_chunks=1))
        >>> context_parallel(mha, None).attention.__name__   # the part it replaced
        'attention'
    """

    shards = True  # the layer gives it shards: no cache, dense mask, context or weights

    def __init__(self, setting: ContextParallel, inner: Callable):
        self.setting, self.inner = setting, inner

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, mask=None,
                 scale: float | None = None, score_mod=None, sinks: Tensor | None = None) -> Tensor:
        return self.setting.attention(q, k, v, causal=causal, mask=mask, scale=scale, score_mod=score_mod,
                                      sinks=sinks)

    def positions(self, local_len: int, *, device=None) -> Tensor:
        """Global positions ``(local_len,)`` of this rank's tokens."""
        return self.setting.positions(local_len, device=device)

    def __repr__(self) -> str:
        return f"ShardedAttention({self.setting!r})"


def context_parallel(module: torch.nn.Module, setting: ContextParallel | None) -> torch.nn.Module:
    """Make ``module`` run its self-attention over shards of its sequence (None: undo).

    Every ``MultiHeadAttention`` in ``module`` (itself, a ``TransformerBlock``'s, a ``GPT``'s;
    cross-attention excepted) gets a :class:`ShardedAttention` as its attention part. Feed each
    rank its shard (``setting.shard(x, dim=1)``): the layers' causal rule, window, softcap,
    ALiBi, rotary and learned positions then hold at global positions, and the output is this
    rank's shard. Sum each parameter's gradient over the ranks, as in data parallelism.

    Returns:
        ``module`` itself, changed in place.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or ``setting`` not a ContextParallel/None.
        ValueError: ``module`` holds an attention module that does not run context-parallel
            (latent, differential, gated, top-k or native sparse attention) or no ``MultiHeadAttention``.

    Example (under torchrun)::

        model = context_parallel(GPT(vocab_size=11, num_heads=4), ContextParallel(method="ring"))
        logits_l = model(ContextParallel().shard(ids, dim=1))   # this rank's shard of the logits
        context_parallel(model, None)                           # whole sequences again
    """
    instance_of("module", module, torch.nn.Module, "a torch.nn.Module")
    if setting is not None:
        instance_of("setting", setting, ContextParallel, "a ContextParallel or None")
    layers = [m for name, m in module.named_modules()
              if isinstance(m, MultiHeadAttention) and not name.endswith("cross_attn")]
    unsharded = sorted({type(m).__name__ for m in module.modules() if isinstance(m, _NOT_SHARDED)})
    if setting is not None and unsharded:
        raise ValueError(f"{', '.join(unsharded)} does not run context-parallel (each rank would attend over its own "
                         "shard only); use MultiHeadAttention layers (GPT layer_pattern letters G, L, C, N)")
    if setting is not None and not layers:
        raise ValueError(f"module ({type(module).__name__}) holds no MultiHeadAttention to run over shards")
    for layer in layers:
        part = layer.attention
        inner = part.inner if isinstance(part, ShardedAttention) else part
        layer.attention = inner if setting is None else ShardedAttention(setting, inner)
    return module
