"""Check and measure context-parallel attention as users run it: several processes, one group.

:func:`cp_job` runs on every rank: it builds the same global problem everywhere (one seed),
shards it, runs each method forward and backward, gathers the output and gradients back and,
on rank 0, compares them with single-process attention on the whole sequence in fp64. Per rank
it reports the time, the bytes it sent and its peak tensor memory.

:func:`run_check` launches it: inline when started by ``torchrun`` (the environment says so),
else on ``nproc`` local processes. ``python -m attnlab.lab.cli._cp_check`` and
``attnlab context-parallel`` are its command lines; :func:`scaling_rows` is the benchmark.

Example:
    >>> spec = CheckSpec(seq_len=16, heads=2, head_dim=4, methods=("ring",))
    >>> rows = run_check(spec, nproc=2)
    >>> rows[0]["method"], rows[0]["ok"]
    ('ring', True)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import attnlab
from attnlab._memory import PeakMemory
from attnlab.distributed import CommStats, context_parallel_attention, shard, unshard
from attnlab.distributed.launch import run_local
from attnlab.lab.verify import allowed_error

__all__ = ["DTYPES", "CheckSpec", "cp_job", "run_check", "under_torchrun", "expected_bytes", "scaling_rows"]

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class CheckSpec:
    """One problem: global sizes, dtype, mask and which methods and layout to run.

    Example:
        >>> CheckSpec().seq_len
        1024
    """

    seq_len: int = 1024
    batch: int = 1
    heads: int = 4
    kv_heads: int | None = None
    head_dim: int = 64
    dtype: str = "fp32"
    causal: bool = True
    layout: str = "zigzag"
    methods: tuple[str, ...] = ("ring", "ulysses")
    backward: bool = True
    seed: int = 0
    check: bool = True  # compare with one process in fp64 (rank 0 runs that whole attention twice)


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another launcher that sets RANK).

    Example:
        >>> isinstance(under_torchrun(), bool)
        True
    """
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _problem(spec: CheckSpec, device: torch.device):
    g = torch.Generator().manual_seed(spec.seed)
    kv = spec.kv_heads or spec.heads
    dtype = DTYPES[spec.dtype]
    shapes = [(spec.batch, spec.heads, spec.seq_len, spec.head_dim),
              (spec.batch, kv, spec.seq_len, spec.head_dim), (spec.batch, kv, spec.seq_len, spec.head_dim),
              (spec.batch, spec.heads, spec.seq_len, spec.head_dim)]
    q, k, v, d_out = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    return [t.to(device) for t in (q, k, v, d_out)], dtype


def _reference(tensors, spec: CheckSpec, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """out, dq, dk, dv of single-process attention on the whole sequence (fp64 unless ``dtype``)."""
    q, k, v, d_out = (t if dtype is None else t.to(dtype) for t in tensors)
    q, k, v = (t.clone().requires_grad_(spec.backward) for t in (q, k, v))
    out = attnlab.attention(q, k, v, causal=spec.causal, backend="reference" if dtype else "auto")
    if not spec.backward:
        return [out.detach()]
    out.backward(d_out)
    return [out.detach(), q.grad, k.grad, v.grad]


def cp_job(rank: int, world: int, spec: CheckSpec) -> list[dict]:
    """Run every method of ``spec`` on this rank; rank 0's rows carry the errors.

    Example (what :func:`run_check` runs on each process)::

        rows = cp_job(dist.get_rank(), dist.get_world_size(), CheckSpec(seq_len=4096))
    """
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensors, dtype = _problem(spec, device)
    for method in spec.methods:  # untimed: the first message between two ranks opens the connection
        _run_method(method, tensors, dtype, spec, rank, world, check=False)
    return [_run_method(method, tensors, dtype, spec, rank, world, check=spec.check) for method in spec.methods]


def _run_method(method: str, tensors, dtype, spec: CheckSpec, rank: int, world: int, *,
                check: bool = True) -> dict:
    q, k, v, d_out = (shard(t.to(dtype), dim=2, layout=spec.layout) for t in tensors)
    q, k, v = (t.requires_grad_(spec.backward) for t in (q, k, v))
    stats = CommStats()
    dist.barrier()
    out, timing = _measured(lambda: context_parallel_attention(q, k, v, causal=spec.causal, method=method,
                                                               layout=spec.layout, stats=stats),
                            d_out if spec.backward else None)
    row = {"method": method, "rank": rank, "world": world, **timing, "bytes_sent": stats.bytes_sent,
           "scores": dict(stats.scores), "ok": True}
    if not check:
        row["ok"] = None  # not compared
        return row
    got = [out.detach()] + ([q.grad, k.grad, v.grad] if spec.backward else [])
    gathered = [unshard(t, dim=2, layout=spec.layout) for t in got]
    if rank == 0:
        row.update(_errors(gathered, tensors, dtype, spec))
    return row


def _errors(gathered, tensors, dtype, spec: CheckSpec) -> dict:
    """Error of each of out, dq, dk, dv vs fp64, and whether it is within attnlab's rule."""
    exact = _reference(tensors, spec)
    plain = _reference(tensors, spec, dtype)  # the same math, single process, at the dtype
    names, errors, ok = ("out", "dq", "dk", "dv"), {}, True
    for i, (got, want, base) in enumerate(zip(gathered, exact, plain)):
        got, want, base = got.double().cpu(), want.double().cpu(), base.double().cpu()
        error = (got - want).abs().max().item()
        limit = allowed_error((base - want).abs().max().item(), dtype, want.abs().max().item(),
                              reduction=spec.seq_len, gradient=i > 0)
        errors[f"error_{names[i]}"] = error
        ok = ok and error <= limit
    return {**errors, "ok": ok}


def run_check(spec: CheckSpec, *, nproc: int = 2, timeout: float = 600.0) -> list[dict]:
    """Run :func:`cp_job` on ``nproc`` ranks (or on the torchrun ranks) and return rank 0's view.

    Returns one row per (method, rank); rank 0's rows hold ``error_out``/``error_dq``/... and
    ``ok`` (all within :func:`attnlab.lab.verify.allowed_error`). Raises ``RuntimeError`` naming
    the rank when a rank failed.

    Example (the module example runs it; this one would start two more processes)::

        rows = run_check(CheckSpec(seq_len=4096, methods=("ulysses",)), nproc=2)
        [r["rank"] for r in rows]   # [0, 1]
    """
    if under_torchrun():
        return _inline(spec)
    outcomes = run_local(cp_job, world=nproc, args=(spec,), timeout=timeout)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise RuntimeError("; ".join(f"rank {o.rank}: {o.error}" for o in failed))
    return _by_method([row for o in outcomes for row in o.value])


def _inline(spec: CheckSpec) -> list[dict]:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    rows = cp_job(dist.get_rank(), dist.get_world_size(), spec)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    return _by_method([row for ranks in everyone for row in ranks])


def _by_method(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r["method"], r["rank"]))


def expected_bytes(spec: CheckSpec, *, method: str, world: int) -> int:
    """Bytes each rank sends in one forward (+ backward) call, by the formulas of docs/distributed.md.

    Ring: ``P-1`` key/value shards forward; backward ``P-1`` shards again plus ``P`` gradient
    accumulators (fp32 for bf16). Ulysses: an all-to-all keeps ``1/P`` of its input, so each
    of q, k, v, out (and their gradients) costs ``(P-1)/P`` of a shard.

    Example:
        >>> expected_bytes(CheckSpec(seq_len=8, heads=1, head_dim=2, dtype="fp64", backward=False),
        ...                method="ring", world=2)     # one k + v shard: 2 * 4 tokens * 2 * 8 bytes
        128
    """
    size = DTYPES[spec.dtype].itemsize
    acc = 8 if spec.dtype == "fp64" else 4
    local = spec.seq_len // world
    kv = spec.kv_heads or spec.heads
    kv_shard = spec.batch * kv * local * spec.head_dim  # elements of one of k, v
    q_shard = spec.batch * spec.heads * local * spec.head_dim
    if method == "ring":
        forward = (world - 1) * 2 * kv_shard * size
        backward = (world - 1) * 2 * kv_shard * size + world * 2 * kv_shard * acc if world > 1 else 0
    else:
        keep = (world - 1) / world
        forward = int(keep * (2 * q_shard + 2 * kv_shard) * size)
        backward = int(keep * (2 * q_shard + 2 * kv_shard) * size)
    return forward + (backward if spec.backward else 0)


def scaling_rows(spec: CheckSpec, *, worlds: tuple[int, ...] = (1, 2, 4)) -> list[dict]:
    """Per-rank peak memory, bytes sent (measured and by formula) and time for each world size.

    Example (the benchmark; seconds per world size)::

        for row in scaling_rows(CheckSpec(seq_len=8192)): print(row)
    """
    table = [_one_process_row(spec)]
    for world in worlds:
        for row in run_check(spec, nproc=world):
            row["expected_bytes"] = expected_bytes(spec, method=row["method"], world=world)
            table.append(row)
    return table


def _one_process_row(spec: CheckSpec) -> dict:
    """Plain :func:`attnlab.attention` (auto backend) on the whole sequence, in this process."""
    tensors, dtype = _problem(spec, torch.device("cpu"))
    q, k, v, d_out = (t.to(dtype) for t in tensors)
    q, k, v = (t.requires_grad_(spec.backward) for t in (q, k, v))
    _, timing = _measured(lambda: attnlab.attention(q, k, v, causal=spec.causal),
                          d_out if spec.backward else None)
    return {"method": "one process", "rank": 0, "world": 1, **timing, "bytes_sent": 0,
            "expected_bytes": 0, "ok": True}


def _measured(forward, d_out):
    """Run ``forward()`` (then backward from ``d_out`` unless None) under a peak-memory meter.

    Returns the output and ``forward_s``, ``backward_s``, ``peak_bytes`` and ``threads``."""
    with PeakMemory() as meter:
        start = time.perf_counter()
        out = forward()
        forward_s = time.perf_counter() - start
        start = time.perf_counter()
        if d_out is not None:
            out.backward(d_out)
        backward_s = time.perf_counter() - start
    return out, {"forward_s": forward_s, "backward_s": backward_s, "peak_bytes": meter.peak_bytes,
                 "threads": torch.get_num_threads()}
