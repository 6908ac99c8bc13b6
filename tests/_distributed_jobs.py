"""Jobs the distributed tests run on every rank (spawned processes import them by name).

Each job builds the same global problem on every rank from one seed, runs the distributed code
on this rank's shards and, on rank 0, compares with single-process attention computed here,
independently of attnlab.distributed.
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist

import attnlab
from attnlab import masks, scores
from attnlab.distributed import CommStats, context_parallel_attention, sequence_layout, shard, unshard
from attnlab.distributed.balance import balanced_layout
from attnlab.nn.multihead import QKV, QKNorm, Window
from attnlab.nn.positional import QueryTemperature
from attnlab.lab.verify import allowed_error

CASES = {
    # name: (method, layout, causal, dtype, B, Hq, Hkv, T_per_rank, D, Dv, mask)
    "ring-zigzag-causal-gqa-fp64": ("ring", "zigzag", True, torch.float64, 2, 4, 2, 8, 8, 6, None),
    "ring-contiguous-causal-fp64": ("ring", "contiguous", True, torch.float64, 1, 2, 2, 6, 4, 4, None),
    "ring-zigzag-full-fp64": ("ring", "zigzag", False, torch.float64, 2, 2, 1, 4, 8, 8, None),
    "ring-contiguous-full-fp32": ("ring", "contiguous", False, torch.float32, 1, 2, 2, 10, 8, 8, None),
    "ring-zigzag-causal-bf16": ("ring", "zigzag", True, torch.bfloat16, 1, 2, 2, 8, 8, 8, None),
    "ulysses-zigzag-causal-gqa-fp64": ("ulysses", "zigzag", True, torch.float64, 2, 8, 4, 4, 8, 6, None),
    "ulysses-contiguous-window-fp64": ("ulysses", "contiguous", False, torch.float64, 1, 4, 4, 6, 4, 4, "window"),
    "ulysses-zigzag-dense-mask-fp32": ("ulysses", "zigzag", False, torch.float32, 2, 4, 4, 4, 8, 8, "dense"),
}

# The ring with mask mods (each step computes only the key blocks the mod reaches, and skips
# the sends no rank further along needs); run on 2, 3 and 4 ranks.
MASKED_CASES = {
    "ring-zigzag-documents-gqa-fp64": ("ring", "zigzag", False, torch.float64, 2, 4, 2, 8, 8, 6, "documents"),
    "ring-zigzag-documents-fp32": ("ring", "zigzag", False, torch.float32, 1, 2, 2, 8, 8, 8, "documents"),
    "ring-contiguous-window-narrow-fp64": ("ring", "contiguous", False, torch.float64, 1, 2, 2, 8, 8, 8,
                                           "window-narrow"),
    "ring-zigzag-window-narrow-fp64": ("ring", "zigzag", False, torch.float64, 1, 2, 1, 8, 8, 8, "window-narrow"),
    "ring-zigzag-window-wide-fp64": ("ring", "zigzag", False, torch.float64, 1, 2, 1, 8, 8, 8, "window-wide"),
    "ring-zigzag-prefix-fp64": ("ring", "zigzag", False, torch.float64, 1, 2, 2, 8, 4, 4, "prefix"),
    "ring-contiguous-varlen-fp64": ("ring", "contiguous", False, torch.float64, 2, 2, 2, 8, 8, 8, "varlen"),
    "ring-zigzag-documents-window-causal-fp64": ("ring", "zigzag", True, torch.float64, 1, 2, 2, 8, 8, 8,
                                                 "documents-window"),
    "ring-balanced-documents-fp64": ("ring", "balanced", False, torch.float64, 1, 2, 2, 8, 8, 8, "documents"),
    # a 12th entry: the score options (see _score_options); masked pieces, ALiBi at global positions, sinks
    "ring-contiguous-window-alibi-sinks-fp64": ("ring", "contiguous", True, torch.float64, 1, 2, 2, 8, 8, 8,
                                                "window-narrow", "alibi sinks"),
}
CASES.update(MASKED_CASES)

# Score mods and sinks over the global sequence (run on 2 and 4 ranks; the masked one above also on 3).
SCORE_CASES = {
    "ring-zigzag-causal-softcap-alibi-sinks-gqa-fp64": ("ring", "zigzag", True, torch.float64, 2, 4, 2, 8, 8, 6,
                                                        None, "softcap alibi sinks"),
    "ring-zigzag-causal-alibi-head-chunks-fp64": ("ring", "zigzag", True, torch.float64, 1, 4, 4, 4, 4, 4, None,
                                                  "alibi sinks chunks"),
    "ring-zigzag-prefix-bias-function-fp64": ("ring", "zigzag", False, torch.float64, 1, 2, 1, 8, 4, 4, "prefix",
                                              "bias function"),
    "ulysses-zigzag-causal-softcap-alibi-sinks-fp64": ("ulysses", "zigzag", True, torch.float64, 1, 8, 4, 4, 4, 4,
                                                       None, "softcap alibi sinks"),
    "ulysses-contiguous-window-alibi-sinks-fp32": ("ulysses", "contiguous", False, torch.float32, 1, 4, 4, 6, 4, 4,
                                                   "window", "alibi sinks"),
    "hybrid-zigzag-causal-softcap-alibi-sinks-fp64": ("hybrid", "zigzag", True, torch.float64, 1, 4, 2, 8, 8, 8,
                                                      None, "softcap alibi sinks"),
}
CASES.update(SCORE_CASES)

# Ulysses inside groups of 2 ranks, the ring across them (2x2 at world 4; a ring of one at world 2).
HYBRID_CASES = {
    "hybrid-zigzag-causal-gqa-fp64": ("hybrid", "zigzag", True, torch.float64, 2, 4, 2, 8, 8, 6, None),
    "hybrid-zigzag-documents-fp64": ("hybrid", "zigzag", False, torch.float64, 1, 4, 2, 8, 8, 8, "documents"),
    "hybrid-contiguous-window-narrow-fp32": ("hybrid", "contiguous", False, torch.float32, 1, 2, 2, 8, 8, 8,
                                             "window-narrow"),
}
CASES.update(HYBRID_CASES)


def document_ids(T: int) -> torch.Tensor:
    """Documents of lengths 1, 2, T - 6, 1, 2: two of length 1, and one that spans every rank."""
    lengths = [1, 2, T - 6, 1, 2]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _mask_of(name: str, B: int, Hq: int, T: int, g: torch.Generator):
    """The global mask a case names (every rank builds the same one)."""
    if name == "window":
        return masks.sliding_window_mod(T, T, window=3)
    if name == "window-narrow":  # narrower than a shard (T_local = 8)
        return masks.sliding_window_mod(T, T, window=3)
    if name == "window-wide":  # wider than the whole sequence
        return masks.sliding_window_mod(T, T, window=2 * T + 1)
    if name == "documents":
        return masks.document_mod(document_ids(T))
    if name == "documents-window":
        return masks.and_masks(masks.document_mod(document_ids(T)), masks.sliding_window_mod(T, T, window=5))
    if name == "prefix":
        return masks.prefix_lm_mod(T, T, prefix_len=T // 2 + 1)
    if name == "varlen":  # a padded batch: row 0 full, row 1 ends before the last rank
        return masks.varlen_causal_mod(torch.tensor([T, T // 2 + 1]), torch.tensor([T, T // 2 + 1]))
    if name == "dense":
        mask = torch.rand(B, Hq, T, T, generator=g) > 0.3
        mask[..., 0] = True  # every row keeps a key (fully masked rows are tested elsewhere)
        return mask
    return None


def _global_problem(case, world: int, seed: int = 0):
    method, layout, causal, dtype, B, Hq, Hkv, t, D, Dv, mask = case[:11]
    T = t * world
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, T, Dv, generator=g, dtype=torch.float64)
    d_out = torch.randn(B, Hq, T, Dv, generator=g, dtype=torch.float64)
    return (q, k, v, d_out), _mask_of(mask, B, Hq, T, g)


def _score_options(case, world: int, seed: int = 1) -> dict:
    """The score mod and sinks a case names (the same on every rank), and its head chunks.

    Words: softcap, alibi (causal, or symmetric when the case is not causal), bias (a global
    (1, Hq, T, T) tensor), function (a user's function of the positions, for 0-d indices),
    sinks (per-head logits), chunks (the ring in one run per key/value head)."""
    words = set(case[11].split()) if len(case) > 11 else set()
    causal, Hq, T = case[2], case[5], case[7] * world
    g = torch.Generator().manual_seed(seed)
    mods = []
    if "softcap" in words:
        mods.append(scores.softcap(2.0))
    if "alibi" in words:
        mods.append(scores.alibi(Hq, symmetric=not causal))
    if "bias" in words:
        mods.append(scores.bias(torch.randn(1, Hq, T, T, generator=g, dtype=torch.float64)))
    if "function" in words:
        mods.append(lambda s, b, h, i, j: s + 0.25 * torch.where(i % 3 == j % 3, 1.0, -1.0) * (h + 1))
    sinks = torch.randn(Hq, generator=g, dtype=torch.float64) if "sinks" in words else None
    return {"score_mod": scores.compose(*mods) if mods else None, "sinks": sinks,
            "head_chunks": case[6] if "chunks" in words else 1}


def _single_process(tensors, mask, causal, dtype, score_mod=None, sinks=None):
    q, k, v, d_out = (t.to(dtype) for t in tensors)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    sinks = None if sinks is None else sinks.to(dtype).clone().requires_grad_()
    if score_mod is not None and dtype != torch.float64:
        score_mod = score_mod.with_params([p.to(dtype) for p in score_mod.params()])
    out = attnlab.attention(q, k, v, mask=mask, causal=causal, backend="reference", score_mod=score_mod,
                            sinks=sinks)
    out.backward(d_out)
    return [out.detach(), q.grad, k.grad, v.grad] + ([] if sinks is None else [sinks.grad])


def conformance(rank: int, world: int, names: list[str], module_methods: tuple[str, ...] = ()) -> dict:
    """Run each named case; rank 0 returns errors and limits, every rank its scores counted; with
    ``module_methods``, also ``report["modules"]``: :func:`module_errors` on those methods."""
    report = {"modules": module_errors(rank, world, module_methods)} if module_methods else {}
    for name in names:
        case = CASES[name]
        method, layout, causal, dtype = case[:4]
        tensors, mask = _global_problem(case, world)
        options = _score_options(case, world)
        if layout == "balanced":  # chunks dealt by the documents' work (every rank computes the same)
            layout = balanced_layout(mask, length=tensors[0].shape[2], world=world, chunks_per_rank=2)
        ulysses = 2 if method == "hybrid" else None
        where = sequence_layout(layout, method=method, ulysses=ulysses, world=world)
        q, k, v, d_out = (shard(t.to(dtype), dim=2, layout=where) for t in tensors)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        sinks, mod = options["sinks"], options["score_mod"]
        if sinks is not None:
            sinks = sinks.to(dtype).clone().requires_grad_()
        if mod is not None and dtype != torch.float64:
            mod = mod.with_params([p.to(dtype) for p in mod.params()])
        stats = CommStats()
        out = context_parallel_attention(q, k, v, causal=causal, mask=mask, method=method,
                                         layout=layout, ulysses=ulysses, stats=stats, score_mod=mod, sinks=sinks,
                                         head_chunks=options["head_chunks"])
        out.backward(d_out)
        got = [unshard(t, dim=2, layout=where) for t in (out.detach(), q.grad, k.grad, v.grad)]
        if sinks is not None:  # each rank holds its queries' share of the sinks' gradient
            dist.all_reduce(sinks.grad)
            got.append(sinks.grad)
        entry = {"scores": dict(stats.scores), "bytes": stats.bytes_sent, "skipped": stats.sends_skipped}
        if rank == 0:
            exact = _single_process(tensors, mask, causal, torch.float64, options["score_mod"], options["sinks"])
            plain = _single_process(tensors, mask, causal, dtype, options["score_mod"], options["sinks"])
            entry["checks"] = [
                ((g.double() - e).abs().max().item(),
                 allowed_error((p.double() - e).abs().max().item(), dtype, e.abs().max().item(),
                               reduction=tensors[0].shape[2], gradient=i > 0))
                for i, (g, e, p) in enumerate(zip(got, exact, plain))
            ]
        report[name] = entry
    return report


def nan_semantics(rank: int, world: int) -> list[bool] | None:
    """A NaN key under a causal ring: the rows that see it are NaN, exactly as in one process."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4 * world, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k[0, 0, 2 * world + 1] = float("nan")
    ref = attnlab.attention(q, k, v, causal=True, backend="reference")
    out = context_parallel_attention(*(shard(t, dim=2) for t in (q, k, v)), causal=True)
    got = unshard(out, dim=2)
    return [bool(torch.equal(got.isnan(), ref.isnan())),
            bool(torch.allclose(got.nan_to_num(), ref.nan_to_num(), atol=1e-12)),
            bool(ref.isnan().any())] if rank == 0 else None


def _error_of(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def bad_calls(rank: int, world: int) -> list[str]:
    """Every refusal, then a good call on the same group (nothing left half-sent)."""
    x = torch.randn(1, 4, 6, 8)
    odd = torch.randn(1, 3, 4, 8)
    messages = [
        _error_of(lambda: context_parallel_attention(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8),
                                                     torch.randn(1, 2, 3, 8))),  # T = 3 * world
        _error_of(lambda: context_parallel_attention(odd, odd, odd, method="ulysses")),
        _error_of(lambda: context_parallel_attention(x, x, x, mask=lambda b, h, q, k: k <= q)),
        _error_of(lambda: context_parallel_attention(x, x, x, method="tree")),
        _error_of(lambda: context_parallel_attention(x, x, x, timeout=0)),
        _error_of(lambda: context_parallel_attention(x, x[:, :, :4], x[:, :, :4])),
    ]
    t_local = 4 if rank == 0 else 8  # shards that disagree across ranks
    y = torch.randn(1, 2, t_local, 8)
    messages.append(_error_of(lambda: context_parallel_attention(y, y, y, causal=True)))
    z = torch.randn(1, 2, 4, 8, dtype=torch.float64 if rank else torch.float32)
    messages.append(_error_of(lambda: context_parallel_attention(z, z, z)))
    good = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0))
    out = context_parallel_attention(good, good, good, causal=True)
    messages.append("finite" if bool(torch.isfinite(out).all()) else "not finite")
    messages.append(_error_of(lambda: context_parallel_attention(good, good, good, group=0)))
    per_query = torch.zeros(1, 2, 4)  # (B, H, Tq): sinks per query, which no shard holds whole
    messages.append(_error_of(lambda: context_parallel_attention(good, good, good, sinks=per_query)))
    learned = scores.alibi(torch.ones(2, requires_grad=True))
    messages.append(_error_of(lambda: context_parallel_attention(good, good, good, causal=True, score_mod=learned)))
    return messages


def peer_fails(rank: int, world: int, how: str, timeout: float) -> tuple[str, float]:
    """Rank 1 exits, raises or stalls instead of joining; rank 0 must fail, fast and clearly."""
    dist.barrier()  # the group is up on both ranks before anything fails
    if rank == 1:
        if how == "exit":
            os._exit(3)
        if how == "raise":
            raise RuntimeError("rank 1 failed on purpose")
        time.sleep(timeout + 4)  # "stall": alive but never joins
        return "slept", 0.0
    x = torch.randn(1, 2, 8, 8)
    start = time.monotonic()
    message = _error_of(lambda: context_parallel_attention(x, x, x, causal=True, timeout=timeout))
    return message, time.monotonic() - start


def worker_world(rank: int, world: int) -> tuple[int, int, str]:
    """What the launcher set up: group size, rank, backend."""
    return dist.get_world_size(), dist.get_rank(), dist.get_backend()


def peer_fails_mid_ring(rank: int, world: int, timeout: float) -> tuple[str, float]:
    """Rank 1 passes the shape check, then crashes as its first ring step would send (before any
    key/value data leaves it, so rank 0 cannot finish on data already delivered)."""
    import attnlab.distributed.ring as ring

    dist.barrier()
    if rank == 1:
        def crash(*args, **kwargs):
            os._exit(4)
        ring.transfer = crash
    x = torch.randn(1, 2, 8, 8)
    start = time.monotonic()
    message = _error_of(lambda: context_parallel_attention(x, x, x, causal=True, timeout=timeout))
    return message, time.monotonic() - start


def gpt_training(rank: int, world: int, method: str, positions: str, steps: int) -> list[float]:
    """A few AdamW steps of a tiny fp64 GPT; world 1 is the single-process run.

    Each rank feeds its shard of the token ids; the loss is the global mean (local sums
    all-reduced) and parameter gradients are summed across ranks, as in data parallelism.
    """
    from attnlab.distributed import ContextParallel, context_parallel
    from attnlab.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=11, max_len=32, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2,
                positions=positions).double()
    if world > 1:
        context_parallel(model, ContextParallel(method=method, layout="zigzag"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 11, (2, 17), generator=data)
        inputs, targets = ids[:, :-1], ids[:, 1:]  # (B, 16)
        if world > 1:
            inputs, targets = (shard(t, dim=1) for t in (inputs, targets))
        logits = model(inputs)
        loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        (loss_sum / (2 * 16)).backward()
        total = loss_sum.detach().clone()
        if world > 1:
            dist.all_reduce(total)
            for p in model.parameters():
                dist.all_reduce(p.grad)
        losses.append(total.item() / (2 * 16))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def subgroups(rank: int, world: int) -> float:
    """Two rings of two inside a world of four ({0, 2} and {1, 3}): point-to-point peers are
    addressed by world rank, so a group's ranks must be translated (max error vs one process)."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both
    group = groups[rank % 2]
    g = torch.Generator().manual_seed(rank % 2)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ref = attnlab.attention(q, k, v, causal=True, backend="reference")
    local = [shard(t, dim=2, group=group) for t in (q, k, v)]
    out = context_parallel_attention(*local, causal=True, group=group, method="ring")
    uly = context_parallel_attention(*local, causal=True, group=group, method="ulysses")
    errors = [(unshard(o, dim=2, group=group) - ref).abs().max().item() for o in (out, uly)]
    return max(errors)


def _scaled_mod(limit: int):
    """A user's mask mod whose behaviour lives in its closure."""
    return lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < limit)


class _WindowedModel(torch.nn.Module):
    """A model whose mask mod is a bound method reading a plain attribute (and holding weights)."""

    def __init__(self, window: int):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.window = window

    def mask_mod(self, b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < self.window)


def _disagreeing_calls(rank: int) -> dict:
    """Calls where rank 0 and rank 1 differ in one option: name -> (call, option)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64)  # T = 8 over two ranks
    one = rank == 0  # True on rank 0, False on rank 1
    dense = torch.ones(1, 2, 8, 8, dtype=torch.bool)
    dense[0, 1, 5, 2] = one  # one entry differs
    cpa = context_parallel_attention
    return {
        "shapes": (lambda: cpa(x, x[:, :1] if one else x, x[:, :1] if one else x), "k, v"),
        "dtype": (lambda: cpa(*(x if one else x.float(),) * 3), "dtype"),
        "scale": (lambda: cpa(x, x, x, scale=0.125 if one else 0.5), "scale"),
        "causal": (lambda: cpa(x, x, x, causal=one), "causal"),
        "method": (lambda: cpa(x, x, x, method="ring" if one else "ulysses"), "method"),
        "layout": (lambda: cpa(x, x, x, layout="zigzag" if one else "contiguous"), "layout"),
        "mask-kind": (lambda: cpa(x, x, x, method="ulysses", mask=masks.causal_mod(8, 8) if one else None),
                      "mask"),
        "mask-mod-params": (lambda: cpa(x, x, x, method="ulysses",
                                        mask=masks.sliding_window_mod(8, 8, 3 if one else 4)), "mask"),
        "mask-mod-tensor": (lambda: cpa(x, x, x, method="ulysses",
                                        mask=masks.padding_mod(torch.tensor([7 if one else 6]))), "mask"),
        "mask-dense-values": (lambda: cpa(x, x, x, method="ulysses", mask=dense), "mask"),
        "mask-user-mod": (lambda: cpa(x, x, x, method="ulysses", mask=_scaled_mod(3 if one else 5)), "mask"),
        "mask-bound-method": (lambda: cpa(x, x, x, method="ulysses", mask=_WindowedModel(3 if one else 5).mask_mod),
                              "mask"),
        "grad": (lambda: cpa(x.clone().requires_grad_(one), x, x), "grad"),
    }


def disagreements(rank: int, world: int) -> dict:
    """Each disagreeing call's error on this rank, then calls that agree in different spellings
    (scale None and 1/sqrt(D); equal masks built separately) and their error against one process."""
    report = {name: _error_of(call) for name, (call, _) in _disagreeing_calls(rank).items()}
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
    window = masks.sliding_window_mod(8, 8, 3)
    ref = attnlab.attention(q, k, v, mask=window, backend="reference")
    out = context_parallel_attention(*(shard(t, dim=2) for t in (q, k, v)), method="ulysses",
                                     mask=masks.sliding_window_mod(8, 8, 3),
                                     scale=None if rank == 0 else 1 / math.sqrt(8))  # the default
    torch.manual_seed(rank)  # different weights on each rank: a bound mod agrees on its options
    bound = context_parallel_attention(*(shard(t, dim=2) for t in (q, k, v)), method="ulysses",
                                       mask=_WindowedModel(3).mask_mod)
    report["agreeing"] = max((unshard(o, dim=2) - ref).abs().max().item() for o in (out, bound))
    return report


DISAGREEMENT_OPTIONS = {name: option for name, (_, option) in _disagreeing_calls(0).items()}


def trainer_losses(rank: int, world: int, methods: list[str], steps: int) -> dict:
    """``attnlab.lab.train.Trainer`` in fp64 for a few steps, sharded over the world by each method
    (world 1: one process); the losses and accuracies it reports, per method."""
    from attnlab.distributed import ContextParallel
    from attnlab.lab.train import Trainer, TrainConfig

    report = {}
    for method in methods:
        setting = None
        if world > 1:
            setting = ContextParallel(method=method, ulysses=2 if method == "hybrid" else None)
        config = TrainConfig(task="induction", steps=steps, batch_size=2, d_model=16, heads=2, layers=2,
                             eval_sequences=4, warmup=2)
        trainer = Trainer(config, context_parallel=setting)
        trainer.model.double()
        report[method] = [trainer.train_step() for _ in range(steps)]
    return report


def ring_head_chunks(rank: int, world: int, chunks: list[int]) -> dict:
    """Per ``head_chunks``: this rank's peak tensor bytes over a causal ring forward + backward
    (fp32, B1 H8 T256 D16), and the fp64 error of out/dq/dk/dv against one process (GQA 4/2)."""
    from attnlab._memory import PeakMemory

    report = {}
    g = torch.Generator().manual_seed(0)
    q, k, v, d_out = (shard(torch.randn(1, 8, 256, 16, generator=g), dim=2) for _ in range(4))
    for c in chunks:
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        with PeakMemory() as meter:
            context_parallel_attention(*x, causal=True, head_chunks=c).backward(d_out)
        q64, k64, v64, d64 = (torch.randn(1, h, 8 * world, 4, generator=g, dtype=torch.float64)
                              for h in (4, 2, 2, 4))
        whole = [t.clone().requires_grad_() for t in (q64, k64, v64)]
        attnlab.attention(*whole, causal=True, backend="reference").backward(d64)
        parts = [shard(t, dim=2).requires_grad_() for t in (q64, k64, v64)]
        out = context_parallel_attention(*parts, causal=True, head_chunks=c)
        out.backward(shard(d64, dim=2))
        want = [attnlab.attention(q64, k64, v64, causal=True, backend="reference")] + [t.grad for t in whole]
        got = [unshard(t, dim=2) for t in [out.detach()] + [t.grad for t in parts]]
        report[c] = (meter.peak_bytes, max((a - b).abs().max().item() for a, b in zip(got, want)))
    return report


# Layers whose whole attention must survive sharding: (name, MultiHeadAttention options). Heads
# 8 and key/value heads 4 split over Ulysses groups of 2 and 4.
MODULES = {
    "window-rope-softcap-sinks-gqa": dict(num_heads=8, qkv=QKV(num_kv_heads=4), pattern=Window(3),
                                          positions="rope", softcap=5.0, sinks=True),
    "window-alibi-sinks": dict(num_heads=8, pattern=Window(5), positions="alibi", sinks=True),
    "bidirectional-alibi-softcap": dict(num_heads=8, pattern=None, positions="alibi", softcap=3.0),
    # Llama 4's NoPE temperature at global positions, heads wider than d_out / heads, OLMo-2's QK-norm
    "temperature-head-dim-qk-norm-all": dict(num_heads=8, qkv=QKV(num_kv_heads=4, head_dim=12,
                                                                  qk_norm=QKNorm(over="all")),
                                             positions=QueryTemperature(3, 0.5)),
}


def module_errors(rank: int, world: int, methods: tuple[str, ...]) -> dict | None:
    """Each :data:`MODULES` layer in fp64, sharded by each method, against the same layer on
    the whole sequence: the largest error of the output, the input's gradient and every
    parameter's gradient (summed over the ranks, as training does). Rank 0 returns them."""
    from attnlab.distributed import ContextParallel, context_parallel
    from attnlab.nn import MultiHeadAttention

    errors = {}
    for name, options in MODULES.items():
        torch.manual_seed(0)
        mha = MultiHeadAttention(32, 32, **options).double()
        with torch.no_grad():
            if mha.sinks is not None:
                mha.sinks.normal_()
        g = torch.Generator().manual_seed(1)
        x, d_y = (torch.randn(2, 6 * world, 32, generator=g, dtype=torch.float64) for _ in range(2))
        whole = x.clone().requires_grad_()
        mha(whole).backward(d_y)
        want = [whole.grad] + [p.grad.clone() for p in mha.parameters()]
        want_y = mha(x).detach()
        for method in methods:
            mha.zero_grad()
            setting = ContextParallel(method=method, ulysses=2 if method == "hybrid" else None)
            context_parallel(mha, setting)
            part = setting.shard(x, dim=1).requires_grad_()
            y = mha(part)
            y.backward(setting.shard(d_y, dim=1))
            context_parallel(mha, None)
            grads = [p.grad for p in mha.parameters()]
            for grad in grads:
                dist.all_reduce(grad)
            layout = setting.sequence_layout(world)
            got = [unshard(y.detach(), dim=1, layout=layout), unshard(part.grad, dim=1, layout=layout)] + grads
            errors[f"{method}-{name}"] = max((a - b).abs().max().item() for a, b in zip(got, [want_y] + want))
    return errors if rank == 0 else None


# ----------------------------------------------------------------------------- linear attention
# name: (rule, B, H, Hv, T_local, Dk, Dv, with an initial state, return the final state)
LINEAR_CASES = {
    "additive": ("additive", 1, 2, 2, 5, 4, 3, False, False),
    "decay-gqa-state": ("decay", 2, 1, 2, 5, 4, 3, True, True),
    "channel": ("channel", 1, 2, 2, 5, 3, 4, True, False),
    "delta": ("delta", 1, 2, 2, 5, 4, 4, False, True),
    "gated-delta-gqa": ("gated_delta", 1, 1, 2, 20, 4, 3, True, True),
    "kda": ("kda", 2, 2, 2, 5, 4, 3, True, True),
}


def _linear_problem(case, world: int, seed: int = 0) -> dict:
    """The global fp64 tensors of one linear-attention case (the same on every rank)."""
    rule, B, H, Hv, T_local, Dk, Dv, with_state, _ = case
    g = torch.Generator().manual_seed(seed)
    T = T_local * world
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    problem = {"q": rand(B, H, T, Dk), "k": torch.nn.functional.normalize(rand(B, H, T, Dk), dim=-1),
               "v": rand(B, Hv, T, Dv)}
    if rule in ("decay", "gated_delta"):
        problem["decay"] = -torch.rand(B, Hv, T, generator=g, dtype=torch.float64)
    if rule in ("channel", "kda"):
        problem["decay"] = -torch.rand(B, Hv, T, Dk, generator=g, dtype=torch.float64)
    if rule in ("delta", "gated_delta", "kda"):
        problem["beta"] = torch.rand(B, Hv, T, generator=g, dtype=torch.float64)
    if with_state:
        problem["initial_state"] = rand(B, Hv, Dk, Dv)
    problem["d_out"] = rand(B, Hv, T, Dv)
    problem["d_state"] = rand(B, Hv, Dk, Dv)
    return problem


SHARDED = ("out", "q", "k", "v", "decay", "beta", "d_out")  # split along T; the states are whole on every rank


def _linear_grads(problem: dict, run, shard_of, return_state: bool, state_in_loss: bool = True) -> dict:
    """The output, the final state (with return_state) and the gradient of every input, by name.
    The final state is the same on every rank: one rank puts it in its loss (``state_in_loss``)."""
    names = [n for n in ("q", "k", "v", "decay", "beta", "initial_state") if n in problem]
    inputs = {n: shard_of(n, problem[n]).clone().requires_grad_() for n in names}
    result = run(**inputs, return_state=return_state)
    out, state = result if return_state else (result, None)
    loss = (out * shard_of("d_out", problem["d_out"])).sum()
    if state is not None and state_in_loss:
        loss = loss + (state * problem["d_state"]).sum()
    loss.backward()
    return {"out": out.detach(), **({"state": state.detach()} if state is not None else {}),
            **{n: inputs[n].grad for n in names}}


def linear_conformance(rank: int, world: int) -> dict | None:
    """Context-parallel linear attention on contiguous shards against one fp64 process: the
    largest error of the output, final state and every gradient, per case (rank 0 reports)."""
    from attnlab.distributed import context_parallel_linear_attention

    local = lambda n, t: shard(t, dim=2, layout="contiguous") if n in SHARDED else t  # noqa: E731
    report = {}
    for name, case in LINEAR_CASES.items():
        problem = _linear_problem(case, world)
        got = _linear_grads(problem, context_parallel_linear_attention, local, case[-1], state_in_loss=rank == 0)
        if "initial_state" in got:  # each rank holds its share of the initial state's gradient
            dist.all_reduce(got["initial_state"])
        got = {n: unshard(t, dim=2, layout="contiguous") if n in SHARDED else t for n, t in got.items()}
        want = _linear_grads(problem, lambda **kw: attnlab.linear_attention(**kw, backend="reference"),
                             lambda n, t: t, case[-1])
        report[name] = {n: float((got[n] - want[n]).abs().max()) for n in want}
    return report if rank == 0 else None


def linear_bad_calls(rank: int, world: int) -> list[str]:
    """What each rank raises for calls that must be refused before any work: ranks that disagree
    (the initial state, the presence of beta) and a bad value on every rank."""
    from attnlab.distributed import context_parallel_linear_attention as cp

    q = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    beta = torch.rand(1, 2, 4, dtype=torch.float64)
    calls = [lambda: cp(q, q, q, initial_state=torch.full((1, 2, 3, 3), float(rank), dtype=torch.float64)),
             lambda: cp(q, q, q, beta=beta if rank == 0 else None),
             lambda: cp(q, q, q, decay=torch.ones(1, 2, 4, dtype=torch.float64)),
             lambda: cp(q, q, q, stats="many")]
    return [_error_of(call) for call in calls]
