"""Differential fuzzing: seeded random calls of ``attnlab.attention`` against fp64 math written here.

The oracle below shares no code with attnlab (not the reference backend, not ``attnlab.masks``):
it builds each mask from its definition with index arithmetic and takes the softmax by hand. Each
configuration crosses what users hand in and the sweep in ``attnlab.lab.verify`` does not draw on its
own: memory layouts (transposed from ``(B, T, H, D)``, sliced, stepped, expanded with stride 0,
storage offsets, permuted), batch-1 keys broadcast against a batch of queries, scales of 0 and
below, large logits, grad mode crossed with ``requires_grad`` on each input, and mask mods in the
style FlexAttention evaluates (scalar indices, table look-ups). A backend that declines a call
must say why (``ValueError``); one that serves must be within attnlab's tolerance rule.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab import backends, masks
from attnlab.lab.verify import allowed_error

N_CONFIGS = 240
# flex compiles per shape on CPU (seconds each): the sweep in verify covers it on fixed shapes.
FUZZED_BACKENDS = tuple(name for name in ("reference", "sdpa", "chunked", "blocks")
                        if name in backends.available())
LAYOUTS = ("contiguous", "bthd", "bthd", "offset", "last_sliced", "stepped_heads", "expanded_batch",
           "permuted")
MASKS = ("none", "causal", "bool", "float", "padding", "window", "document", "lambda", "lookup")
# blocks serves only mask mods that declare the keys each query block reaches: draw those for it.
BOUNDED = ("causal", "padding", "window", "document")
SCALES = (None, 0.0, -0.7, 2.5, 1e-3)
MAGNITUDES = (1.0, 1.0, 30.0, 300.0)


# ----------------------------------------------------------------------------- the oracle
def _oracle(q, k, v, allowed, bias, scale):
    """softmax(q k^T * scale + bias, over allowed keys) v in the inputs' dtype; rows with no
    allowed key are 0. q ``(B, Hq, Tq, D)``, k/v ``(B|1, Hkv, Tk, *)``, allowed/bias broadcast."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).expand(q.shape[0], -1, -1, -1)  # (B, Hq, Tk, D)
    v = v.repeat_interleave(group, dim=1).expand(q.shape[0], -1, -1, -1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~allowed, float("-inf"))
    top = s.detach().amax(dim=-1, keepdim=True)  # any shift gives the same softmax
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(s - top)
    total = e.sum(dim=-1, keepdim=True)
    w = e / torch.where(total > 0, total, torch.ones_like(total))  # rows with no key: 0
    return torch.einsum("bhqk,bhkd->bhqd", w, v)


def _allowed(spec: dict, B: int, H: int, tq: int, tk: int) -> torch.Tensor:
    """The (B, H, Tq, Tk) bool mask a spec means, from index arithmetic alone."""
    i = torch.arange(tq).view(1, 1, tq, 1)
    j = torch.arange(tk).view(1, 1, 1, tk)
    ok = torch.ones(B, H, tq, tk, dtype=torch.bool)
    off = (tk - tq) if spec.get("align") == "bottom_right" else 0
    if spec.get("causal"):
        ok = ok & (j <= i + off)
    kind = spec["kind"]
    if kind == "bool":
        ok = ok & spec["tensor"]
    elif kind == "padding":
        ok = ok & (j < spec["lengths"].view(B, 1, 1, 1))
    elif kind == "window":
        ok = ok & (j <= i + off) & (j > i + off - spec["window"])
    elif kind in ("document", "lookup"):
        doc = spec["ids"]  # (T,) one row for every batch row
        same = doc[:tq].view(1, 1, tq, 1) == doc[:tk].view(1, 1, 1, tk)
        ok = ok & same
    elif kind == "lambda":
        ok = ok & ((i - j).abs() < spec["width"])
    return ok


# ----------------------------------------------------------------------------- the draws
def _laid_out(values: torch.Tensor, layout: str, seed: int) -> torch.Tensor:
    """``values`` (B, H, T, D) in memory laid out as ``layout``, built with differentiable ops so
    that gradients flow back to ``values`` (stride 0 for "expanded_batch": batch row 0 is shared)."""
    B, H, T, D = values.shape
    junk = torch.Generator().manual_seed(seed)
    if layout == "bthd":  # projected to (B, T, H, D), then transposed: the common MQA layout
        return _fresh((B, T, H, D), values.transpose(1, 2)).transpose(1, 2)
    if layout == "offset":
        room = torch.randn(B, H, 17, D, generator=junk, dtype=values.dtype)
        return torch.cat([room, values], dim=2)[:, :, 17:]
    if layout == "last_sliced":
        room = torch.randn(B, H, T, 5, generator=junk, dtype=values.dtype)
        return torch.cat([values, room], dim=3)[..., :D]
    if layout == "stepped_heads":
        room = torch.randn(B, H, T, D, generator=junk, dtype=values.dtype)
        return torch.stack([values, room], dim=2).flatten(1, 2)[:, ::2]  # (B, 2H, T, D) stepped
    if layout == "expanded_batch":
        return values[:1].expand(B, H, T, D)
    if layout == "permuted":
        return _fresh((D, T, H, B), values.permute(3, 2, 1, 0)).permute(3, 2, 1, 0)
    return values.contiguous()


def _fresh(shape: tuple, values: torch.Tensor) -> torch.Tensor:
    """``values`` copied into new memory of ``shape`` with row-major strides. ``.contiguous()``
    would keep a view whose only odd stride sits at a size-1 dim, the very layout to draw."""
    return torch.empty(shape, dtype=values.dtype).copy_(values)


def _pick(gen: torch.Generator, options):
    return options[int(torch.randint(len(options), (), generator=gen))]


def _draw(index: int) -> dict:
    gen = torch.Generator().manual_seed(9000 + index)
    B = _pick(gen, (1, 2, 3))
    hkv = _pick(gen, (1, 1, 1, 2))
    hq = hkv * _pick(gen, (1, 2, 3))
    tq, tk = (_pick(gen, (1, 2, 5, 17, 40, 70, 140)) for _ in range(2))
    if _pick(gen, (True, False)):
        tk = tq  # square calls are the common case and the ones document masks need
    d, dv = _pick(gen, (1, 8, 16)), _pick(gen, (1, 8, 16, 16))
    cfg = dict(index=index, B=B, hq=hq, hkv=hkv, tq=tq, tk=tk, d=d, dv=dv,
               layouts=tuple(_pick(gen, LAYOUTS) for _ in range(3)),
               broadcast_kv=bool(B > 1 and torch.rand((), generator=gen) < 0.15),
               scale=_pick(gen, SCALES), magnitude=_pick(gen, MAGNITUDES),
               mask=MASKS[index % len(MASKS)],
               causal=bool(torch.rand((), generator=gen) < 0.5),
               align=_pick(gen, ("top_left", "bottom_right")),
               grad_enabled=bool(torch.rand((), generator=gen) < 0.7),
               requires=tuple(bool(torch.rand((), generator=gen) < 0.7) for _ in range(3)),
               backend=FUZZED_BACKENDS[(index // len(MASKS)) % len(FUZZED_BACKENDS)],
               seed=index)
    if cfg["backend"] == "blocks":
        cfg["mask"] = BOUNDED[index % len(BOUNDED)]
    return cfg


def _mask_spec(cfg: dict, gen: torch.Generator) -> tuple[dict, object]:
    """(the oracle's description of the mask, the argument handed to attnlab)."""
    B, tq, tk, kind = cfg["B"], cfg["tq"], cfg["tk"], cfg["mask"]
    spec = dict(kind=kind, causal=cfg["causal"], align=cfg["align"])
    if kind in ("none", "causal"):
        spec["causal"] = spec["causal"] or kind == "causal"
        return spec, None
    if kind == "bool":
        spec["tensor"] = torch.rand(B, 1, tq, tk, generator=gen) < 0.7
        return spec, spec["tensor"]
    if kind == "float":
        bias = torch.randn(1, cfg["hq"], tq, tk, generator=gen, dtype=torch.float64)
        spec["bias"] = bias.masked_fill(torch.rand(bias.shape, generator=gen) < 0.2, float("-inf"))
        return spec, spec["bias"]
    if kind == "padding":
        spec["lengths"] = torch.randint(0, tk + 1, (B,), generator=gen)
        return spec, masks.padding_mod(spec["lengths"])
    if kind == "window":
        spec["window"] = int(torch.randint(1, tk + 3, (), generator=gen))
        spec["causal"] = False  # the window mod carries its own causal part
        return spec, masks.sliding_window_mod(tq, tk, spec["window"], align=cfg["align"])
    if kind == "document":
        spec["causal"] = False
        spec["ids"] = torch.randint(0, 3, (max(tq, tk),), generator=gen).sort().values
        return spec, masks.document_mod(spec["ids"], causal=False)
    if kind == "lambda":
        spec["width"] = int(torch.randint(1, 6, (), generator=gen))
        width = spec["width"]
        return spec, lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < width
    # "lookup": written as FlexAttention evaluates mods, on scalar indices through a table
    ids = torch.randint(0, 3, (max(tq, tk),), generator=gen).sort().values
    spec["ids"] = ids
    return spec, lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx]


def _inputs(cfg: dict, gen: torch.Generator):
    B, hq, hkv, tq, tk, d, dv = (cfg[n] for n in ("B", "hq", "hkv", "tq", "tk", "d", "dv"))
    kv_batch = 1 if cfg["broadcast_kv"] else B
    q = torch.randn(B, hq, tq, d, generator=gen, dtype=torch.float64) * cfg["magnitude"]
    k = torch.randn(kv_batch, hkv, tk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(kv_batch, hkv, tk, dv, generator=gen, dtype=torch.float64)
    return q, k, v


# ----------------------------------------------------------------------------- the test
def _forward(cfg: dict, leaves: list, attend) -> torch.Tensor:
    laid = [_laid_out(t, layout, cfg["seed"] + n) for n, (t, layout) in enumerate(zip(leaves, cfg["layouts"]))]
    return attend(*laid)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    if not bool(torch.isfinite(a).all()):
        return math.inf
    return float((a.double() - b.double()).abs().max())


def _within(got: torch.Tensor, exact: torch.Tensor, plain: torch.Tensor, cfg: dict, gradient: bool,
            magnitude: float):
    reduction = max(cfg["d"], cfg["dv"], cfg["tk"])
    tol = allowed_error(_max_err(plain, exact), torch.float32, magnitude, reduction=reduction,
                        gradient=gradient)
    err = _max_err(got, exact)
    return err <= tol, err, tol


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    return torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(group, dim=1)) * scale


def _largest(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


@pytest.mark.parametrize("chunk", range(8))
def test_fuzz_against_independent_fp64(chunk):
    outcomes = [_check_one(_draw(i)) for i in range(chunk, N_CONFIGS, 8)]
    failures = [o for o in outcomes if o not in (None, "declined")]
    assert not failures, "\n".join(failures[:10])
    # A fuzz that every backend declines proves nothing.
    assert outcomes.count(None) >= 0.6 * len(outcomes), f"{outcomes.count('declined')} declined"


def _check_one(cfg: dict) -> str | None:
    """None when attnlab agrees with the oracle on ``cfg``, "declined" when the backend refused it
    with a reason, else what went wrong."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    q, k, v = _inputs(cfg, gen)
    spec, mask_arg = _mask_spec(cfg, gen)
    allowed = _allowed(spec, cfg["B"], cfg["hq"], cfg["tq"], cfg["tk"])
    bias = spec.get("bias")
    scale = 1 / math.sqrt(cfg["d"]) if cfg["scale"] is None else cfg["scale"]
    label = f"#{cfg['index']} {cfg['backend']} {cfg}"
    if isinstance(mask_arg, torch.Tensor) and mask_arg.dtype.is_floating_point:
        mask_arg = mask_arg.float()

    def attend(*qkv):
        return attnlab.attention(*qkv, mask=mask_arg, causal=spec["causal"], align=cfg["align"],
                                 scale=cfg["scale"], backend=cfg["backend"])

    leaves = [t.float().requires_grad_(r) for t, r in zip((q, k, v), cfg["requires"])]
    try:
        with torch.set_grad_enabled(cfg["grad_enabled"]):
            out = _forward(cfg, leaves, attend)
    except ValueError as error:  # a decline must name its reason
        return "declined" if str(error).strip() else f"{label}: empty ValueError"
    except Exception as error:  # noqa: BLE001 - any other exception is a finding
        return f"{label}: {type(error).__name__}: {error}"

    def oracle_in(dtype):
        ins = [t.to(dtype).detach().requires_grad_(True) for t in (q, k, v)]
        b = None if bias is None else bias.to(dtype)
        return ins, _forward(cfg, ins, lambda *qkv: _oracle(*qkv, allowed, b, scale))

    exact_in, exact = oracle_in(torch.float64)
    plain_in, plain = oracle_in(torch.float32)
    # The floor scales with the largest quantity the computation passes through, as in
    # attnlab.lab.verify; at large logits that is the scores (fp32 rounds them to |s| * 2**-24).
    magnitude = max(_largest(exact.detach()), _largest(_scores(q, k, scale)))
    ok, err, tol = _within(out.detach(), exact.detach(), plain.detach(), cfg, False, magnitude)
    if not ok:
        return f"{label}: out error {err:.3g} > {tol:.3g}"
    if not (cfg["grad_enabled"] and any(cfg["requires"])):
        return None if not out.requires_grad else f"{label}: output requires grad under no_grad"
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out * g.float()).sum().backward()
    exact_grads = torch.autograd.grad((exact * g).sum(), exact_in)
    plain_grads = torch.autograd.grad((plain * g.float()).sum(), plain_in)
    # As in attnlab.lab.verify: gradient noise scales with the problem's largest quantities.
    magnitude = max(magnitude, *(_largest(t) for t in exact_grads))
    for name, leaf, want, base in zip("qkv", leaves, exact_grads, plain_grads):
        if not leaf.requires_grad:
            continue
        got = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        ok, err, tol = _within(got, want, base, cfg, True, magnitude)
        if not ok:
            return f"{label}: d{name} error {err:.3g} > {tol:.3g}"
    return None
