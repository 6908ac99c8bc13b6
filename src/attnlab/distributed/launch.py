"""Run a function on ``P`` local processes joined in one process group, and collect the results.

What ``torchrun --nproc-per-node P`` does for a script, for a function: each process gets the
rendezvous environment, joins a ``gloo`` (or ``nccl``) group and calls ``fn(rank, world,
*args)``. Unlike ``torch.multiprocessing.spawn``, every rank's outcome comes back, the failures
too, so a test or the check command can see what each rank raised. A rank that neither returns
nor fails within ``timeout`` seconds is killed and reported.

Example:
    >>> outcomes = run_local(world_size_and_rank, world=2)
    >>> [o.value for o in outcomes]
    [(2, 0), (2, 1)]
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
import torch.multiprocessing as mp

from attnlab._checks import instance_of, positive_int, positive_number
from attnlab.distributed._args import number

__all__ = ["Outcome", "run_local", "world_size_and_rank"]


@dataclass
class Outcome:
    """One rank's result: ``value`` when it returned, else ``error`` (one line) and ``trace``.

    Example:
        >>> Outcome(rank=0, value=3).ok
        True
    """

    rank: int
    value: object = None
    error: str | None = None
    trace: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


def world_size_and_rank(rank: int, world: int) -> tuple[int, int]:
    """A trivial job: what the process group says about this process.

    Example:
        >>> world_size_and_rank.__name__
        'world_size_and_rank'
    """
    return dist.get_world_size(), dist.get_rank()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple,
            results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group(backend, rank=rank, world_size=world)
        value = fn(rank, world, *args)
        results.put(Outcome(rank, value=value))
    except BaseException as error:  # report everything, KeyboardInterrupt included
        line = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else type(error).__name__
        results.put(Outcome(rank, error=line, trace=traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_local(fn: Callable, *, world: int, args: tuple = (), backend: str = "gloo",
              timeout: float = 120.0, threads: int | None = None) -> list[Outcome]:
    """Start ``world`` processes, run ``fn(rank, world, *args)`` in each, return every outcome.

    Args:
        fn: a module-level function (processes are spawned, so it is imported by name).
        world: number of processes.
        args: extra arguments (picklable).
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        timeout: seconds to wait for all ranks; ranks still running then are killed and reported.
        threads: ``OMP_NUM_THREADS`` for each rank (default: the CPUs shared out among ranks).

    Returns:
        ``Outcome`` per rank, ordered by rank.

    Example:
        >>> run_local(world_size_and_rank, world=1)[0].value
        (1, 0)
    """
    if not callable(fn):
        raise TypeError(f"fn must be a module-level function, got {type(fn).__name__}")
    positive_int("world", world)
    instance_of("args", args, tuple, "a tuple")
    instance_of("backend", backend, str, "a str (\"gloo\", \"nccl\")")
    positive_number("timeout", number("timeout", timeout))
    if threads is not None:
        positive_int("threads", threads)
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by each child as torch starts
    try:
        processes = [context.Process(target=_worker, args=(r, world, port, backend, fn, args, results),
                                     daemon=True) for r in range(world)]
        for p in processes:
            p.start()
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = previous
    return _collect(processes, results, world, timeout)


def _collect(processes, results, world: int, timeout: float) -> list[Outcome]:
    outcomes: dict[int, Outcome] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < world and time.monotonic() < deadline:
        try:
            outcome = results.get(timeout=0.2)
            outcomes[outcome.rank] = outcome
        except queue.Empty:
            if all(not p.is_alive() for p in processes) and results.empty():
                break
    for rank, p in enumerate(processes):
        p.join(timeout=0.5 if rank in outcomes else 0.0)
        killed = p.is_alive()
        if killed:
            p.kill()
            p.join()
        if rank not in outcomes:
            why = (f"did not finish within {timeout:g} s (killed)" if killed
                   else f"exited with code {p.exitcode} without a result")
            outcomes[rank] = Outcome(rank, error=f"rank {rank} {why}")
    return [outcomes[r] for r in range(world)]
