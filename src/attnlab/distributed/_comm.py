"""Communication for context parallelism: the ring exchange and all-to-all (the agreement check
is in :mod:`attnlab.distributed._agreement`).

Every wait goes through :func:`_wait`, so a peer that raised, exited or stalled turns into one
``RuntimeError`` that names this rank, the step and the timeout, never a hang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from attnlab.distributed._args import timeout_seconds

DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for its peers before it gives up


@dataclass
class CommStats:
    """What one context-parallel call did on this rank (pass one in as ``stats=`` to fill it).

    Attributes:
        bytes_sent: bytes this rank sent (forward and, after ``backward()``, backward).
        messages: point-to-point sends and all-to-all calls.
        scores: query-key scores computed per pass, ``{"forward": n, "backward": m}`` (ring
            only; the work a rank does, with pairs a causal mask skips left out).
        wait_seconds: time spent waiting for data that had not arrived yet.
        sends_skipped: ring only: key/value shard sends this rank left out (forward and
            backward) because no rank further along the ring can reach that shard's keys.
        plan: ring only: the :class:`~attnlab.distributed.ring.RingPlan` of the last call (what
            every rank computes, sends and skips, step by step).

    Example:
        >>> CommStats().bytes_sent
        0
    """

    bytes_sent: int = 0
    messages: int = 0
    scores: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})
    wait_seconds: float = 0.0
    sends_skipped: int = 0
    plan: object = None


@dataclass(frozen=True)
class Peers:
    """This rank's place in a group: size, rank, and its ring neighbours as global ranks."""

    group: object
    world: int
    rank: int
    timeout: float

    @property
    def next_rank(self) -> int:
        return self._global((self.rank + 1) % self.world)

    @property
    def prev_rank(self) -> int:
        return self._global((self.rank - 1) % self.world)

    def global_rank(self, group_rank: int) -> int:
        return self._global(group_rank % self.world)

    def _global(self, group_rank: int) -> int:
        """Point-to-point ops address peers by their rank in the world."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)


def peers(group, timeout: float | None) -> Peers:
    """The group's size and this rank (RuntimeError when torch.distributed is not set up)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("attnlab.distributed needs torch.distributed initialised: call "
                           "torch.distributed.init_process_group (torchrun sets up the environment)")
    timeout_seconds(timeout)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed process group or None, got {type(group).__name__}")
    return Peers(group, dist.get_world_size(group), dist.get_rank(group),
                 DEFAULT_TIMEOUT if timeout is None else float(timeout))


def _wait(work, who: Peers, what: str, stats: CommStats | None) -> None:
    start = time.perf_counter()
    try:
        done = work.wait(timedelta(seconds=who.timeout))
    except Exception as error:  # gloo/NCCL raise RuntimeError or DistBackendError subclasses
        raise RuntimeError(
            f"context-parallel attention, rank {who.rank} of {who.world}: {what} failed; another "
            f"rank raised, exited or did not join within {who.timeout:g} s ({_first_line(error)})"
        ) from None
    if done is False:
        raise RuntimeError(f"context-parallel attention, rank {who.rank} of {who.world}: {what} "
                           f"timed out after {who.timeout:g} s")
    if stats is not None:
        stats.wait_seconds += time.perf_counter() - start


def _start(launch, who: Peers, what: str):
    """Run ``launch()`` (which posts an async collective or point-to-point batch); a failure to
    post becomes the same one-line RuntimeError as a failed wait."""
    try:
        return launch()
    except Exception as error:
        raise RuntimeError(f"context-parallel attention, rank {who.rank} of {who.world}: {what} "
                           f"could not start ({_first_line(error)})") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


class Pending:
    """Tensors on their way from the previous rank; :meth:`wait` hands them over."""

    def __init__(self, works, received: list[Tensor], keep: list[Tensor], who: Peers, what: str,
                 stats: CommStats | None):
        self._works, self._received, self._keep = works, received, keep
        self._who, self._what, self._stats = who, what, stats

    def wait(self) -> list[Tensor]:
        for work in self._works:
            _wait(work, self._who, self._what, self._stats)
        self._keep = []  # the sends are done: their buffers may go
        return self._received


def exchange(tensors: list[Tensor], who: Peers, *, tag: int, what: str,
             stats: CommStats | None) -> Pending:
    """Send ``tensors`` to the next rank and receive the same shapes from the previous one.

    Returns at once; the transfer overlaps whatever runs before :meth:`Pending.wait`. With one
    rank, the tensors come straight back.
    """
    if who.world == 1:
        return Pending([], tensors, [], who, what, stats)
    return transfer(tensors, to=who.rank + 1, receive=[(t.shape, t.dtype) for t in tensors],
                    source=who.rank - 1, who=who, tag=tag, what=what, stats=stats, device=tensors[0].device)


def transfer(send: list[Tensor] | None, *, to: int, receive: list[tuple] | None, source: int,
             who: Peers, tag: int, what: str, stats: CommStats | None, device=None) -> Pending:
    """Send ``send`` to group rank ``to`` and receive tensors of the ``(shape, dtype)`` pairs in
    ``receive`` (on ``device``) from group rank ``source``; either may be None: a one-sided
    step of a ring that skips a shard. Ranks are taken modulo the group's size.

    Returns at once; :meth:`Pending.wait` hands over the received tensors (``[]`` when none).
    """
    sends = [t.contiguous() for t in send or ()]
    received = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in receive or ()]
    ops = [dist.P2POp(dist.isend, t, who.global_rank(to), who.group, tag + i) for i, t in enumerate(sends)]
    ops += [dist.P2POp(dist.irecv, t, who.global_rank(source), who.group, tag + i)
            for i, t in enumerate(received)]
    works = _start(lambda: dist.batch_isend_irecv(ops), who, what) if ops else []
    if stats is not None:
        stats.bytes_sent += sum(t.numel() * t.element_size() for t in sends)
        stats.messages += len(sends)
    return Pending(works, received, sends, who, what, stats)


def all_to_all(x: Tensor, who: Peers, *, what: str, stats: CommStats | None) -> Tensor:
    """``all_to_all_single`` over dim 0 of ``x`` ``(P, ...)``: slice ``i`` goes to rank ``i``."""
    if who.world == 1:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    work = _start(lambda: dist.all_to_all_single(out, x, group=who.group, async_op=True), who, what)
    _wait(work, who, what, stats)
    if stats is not None:
        stats.bytes_sent += x.numel() * x.element_size() * (who.world - 1) // who.world
        stats.messages += 1
    return out


def all_gather(x: Tensor, who: Peers, *, what: str, stats: CommStats | None) -> Tensor:
    """Every rank's ``x`` stacked ``(P, ...)``, differentiable: the gradient of rank ``r``'s ``x``
    is the sum over ranks of their gradients for row ``r`` (one all-reduce in the backward)."""
    return _AllGather.apply(x, who, what, stats)


def _gather(x: Tensor, who: Peers, what: str, stats: CommStats | None) -> Tensor:
    if who.world == 1:
        return x[None]
    x = x.contiguous()
    table = [torch.empty_like(x) for _ in range(who.world)]
    work = _start(lambda: dist.all_gather(table, x, group=who.group, async_op=True), who, what)
    _wait(work, who, what, stats)
    if stats is not None:
        stats.bytes_sent += x.numel() * x.element_size() * (who.world - 1)
        stats.messages += 1
    return torch.stack(table)  # (P, ...)


def _sum(x: Tensor, who: Peers, what: str, stats: CommStats | None) -> Tensor:
    if who.world == 1:
        return x
    x = x.contiguous().clone()
    work = _start(lambda: dist.all_reduce(x, group=who.group, async_op=True), who, what)
    _wait(work, who, what, stats)
    if stats is not None:
        stats.bytes_sent += x.numel() * x.element_size()
        stats.messages += 1
    return x


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, who, what, stats):
        ctx.who, ctx.what, ctx.stats = who, what, stats
        return _gather(x, who, what, stats)

    @staticmethod
    def backward(ctx, grad):
        total = _sum(grad, ctx.who, f"{ctx.what}, backward (all-reduce)", ctx.stats)  # (P, ...)
        return total[ctx.who.rank], None, None, None
