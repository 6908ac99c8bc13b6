"""The ``backends`` and ``memory`` suites behind ``attnlab bench``, and :func:`run_suite`.

* ``backends`` -- each backend and ``auto`` on causal / padding-masked / unmasked calls;
* ``memory`` -- peak memory of the reference vs the O(T) backends as T grows, via
  :class:`attnlab._memory.PeakMemory`;
* ``modules`` -- :func:`attnlab.lab.bench.modules.run_modules_suite`;
* ``sparse`` -- masks with structure (sliding window, packed documents, prefix-LM, chunked
  local): ``auto``, every serving backend and SDPA given the equivalent dense mask, forward and
  forward+backward; FLOPs count only the visible (query, key) pairs; ``with_flex`` adds the flex
  backend and compiled FlexAttention with its own block mask (forward; compiles for minutes);
* ``decode`` -- one decoding step (1 query over a KV cache) through ``auto`` vs raw SDPA;
* ``overhead`` -- attnlab beside plain PyTorch on the calls real models make (decode, prefill
  with transformers' mask, a tiny Llama, MultiHeadAttention, torch.compile):
  :func:`attnlab.lab.bench.overhead.overhead_suite`;
* ``decode-model`` -- a 6-layer, d_model=384 GPT generating 256 tokens after a 512-token
  prompt with the KV cache and by recomputing every step: tokens/s of each, their ratio, and
  whether the two greedy outputs are the same tokens, and a plain PyTorch decoding loop over the
  same weights: its row, ``GPT.generate``'s per-token ratio to it and its tokens checked
  (:func:`decode_model_suite`, :func:`plain_generate`);
* ``variants`` -- MHA, GQA, MQA, MLA, sliding window, local/global, ..., Gated DeltaNet and hybrids at one size: KV
  bytes per token, peak memory, decoding tokens/s, held-out loss
  (:func:`attnlab.lab.bench.variants.variants_suite`), and decoding tokens/s after 1k and 16k
  cached tokens (:func:`attnlab.lab.bench.variants.context_rates`);
* ``linear`` -- ``linear_attention``'s backends on the gated delta rule beside transformers'
  ``torch_chunk_gated_delta_rule``, forward and forward+backward, and one decoding step at 1k and
  16k context (:func:`attnlab.lab.bench.linear.linear_suite`).

Example:
    >>> sorted(backend_cases(64))
    ['causal', 'none', 'padding']
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab import backends, masks
from attnlab._checks import positive_int
from attnlab._flops import attention_flops
from attnlab._memory import PeakMemory
from attnlab.lab.bench.competitors import CompiledFlex, flex_mask_mods, sparse_cases
from attnlab.lab.bench.modules import run_modules_suite
from attnlab.lab.bench import linear, overhead, padded, variants
from attnlab.lab.bench.timing import BenchRow, fill_ratios, compare, machine_line, matmul_candidate, print_rows
from attnlab.functional import attention
from attnlab.integrations.transformers import register
from attnlab.models import GPT

__all__ = ["SUITES", "backend_cases", "backends_suite", "memory_suite", "run_suite",
           "sparse_cases", "sparse_suite", "decode_suite", "GenerationTiming", "decode_model_suite",
           "plain_generate", "deepseek_v4_config", "deepseek_v4_memory"]

SUITES = ("backends", "memory", "modules", "sparse", "decode", "decode-model", "overhead", "variants", "padded",
          "linear")


def _attention_inputs(b, h, t, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, d, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]


def backend_cases(t: int, *, batch: int = 1) -> dict[str, dict]:
    """The calls the backends suite times: causal, padding-masked (3/4 real keys), unmasked.

    Example:
        >>> sorted(backend_cases(8))
        ['causal', 'none', 'padding']
    """

    lengths = torch.full((batch,), (3 * t) // 4)
    return {
        "causal": dict(causal=True),
        "padding": dict(mask=masks.padding_mask(lengths, t)),
        "none": dict(),
    }


def backends_suite(*, quick: bool = False, t: int | None = None, dtype: torch.dtype = torch.float32,
                   device: str = "cpu", rounds: int | None = None) -> list[BenchRow]:
    """Time every available backend and ``auto`` side by side on causal/padding/unmasked calls.

    Forward only, under ``torch.no_grad()`` (flex's CPU kernel is inference only). B=1, H=8,
    D=64; T=4096 (quick: 512). The note says which backend ``auto`` picked. The matmul peak
    is timed as one more candidate in the same interleaved rounds, so that load from other
    jobs on a shared machine depresses the peak and the candidates alike.

    Example:
        >>> rows = backends_suite(quick=True, t=32, rounds=1)  # doctest: +SKIP
    """

    t = t if t is not None else (512 if quick else 4096)
    rounds = rounds if rounds is not None else (1 if quick else 3)
    min_run = 0.05 if quick else 0.3
    b, h, d = 1, 8, 64
    q, k, v = _attention_inputs(b, h, t, d, dtype, device)
    rows: list[BenchRow] = []
    for case, options in backend_cases(t, batch=b).items():
        options = {key: (val.to(device) if isinstance(val, torch.Tensor) else val) for key, val in options.items()}
        with torch.no_grad():
            call = backends.build_call(q, k, v, **options)
            chosen = backends.select(call).name
            names = [n for n, why in backends.reasons(call).items() if not why]
        candidates = {n: _no_grad(attention, q, k, v, backend=n, **options) for n in names}
        candidates["auto"] = _no_grad(attention, q, k, v, backend="auto", **options)
        if not quick and t >= 4096:
            candidates.pop("reference", None)  # O(T^2): minutes at T=4096 on 2 cores
        seconds, peak = _compare_with_peak(candidates, dtype=dtype, device=device, rounds=rounds,
                                           min_run_time=min_run)
        flops = attention_flops(b, h, t, t, d, causal=case == "causal")
        for name, sec in seconds.items():
            note = f"auto -> {chosen}" if name == "auto" else ""
            rows.append(BenchRow("backends", f"{case} T={t}", name, sec, flops, peak, note=note, t=t))
    return fill_ratios(rows)


_PEAK = "matmul (peak)"


def _compare_with_peak(candidates: dict[str, Callable[[], object]], *, dtype: torch.dtype = torch.float32,
                       device: str = "cpu", rounds: int, min_run_time: float) -> tuple[dict[str, float], float]:
    """:func:`compare` with the matmul as one more candidate: (seconds per candidate, peak FLOP/s).

    The peak is timed in the same interleaved rounds, so that load from other jobs on a shared
    machine depresses the peak and the candidates alike.
    """
    matmul, matmul_flops = matmul_candidate(dtype, device)
    seconds = compare({**candidates, _PEAK: matmul}, rounds=rounds, min_run_time=min_run_time)
    return seconds, matmul_flops / seconds.pop(_PEAK)


def _no_grad(fn, *args, **kwargs):
    def run():
        with torch.no_grad():
            return fn(*args, **kwargs)
    return run


def memory_suite(*, quick: bool = False) -> list[BenchRow]:
    """Peak tensor memory (forward+backward, causal) of the reference vs the O(T) backends.

    Measured with :class:`attnlab._memory.PeakMemory` (storages created during the call).

    Example:
        >>> rows = memory_suite(quick=True)  # doctest: +SKIP
    """

    lengths = (256, 1024) if quick else (1024, 2048, 4096)
    names = [n for n in ("reference", "chunked", "sdpa") if n in backends.available()]
    rows = []
    for t in lengths:
        for name in names:
            q, k, v = (x.requires_grad_() for x in _attention_inputs(1, 4, t, 64, torch.float32, "cpu"))
            with PeakMemory() as meter:
                attention(q, k, v, causal=True, backend=name).sum().backward()
            rows.append(BenchRow("memory", f"causal fwd+bwd T={t}", name, None,
                                 note=f"peak {meter.peak_bytes / 2**20:.1f} MiB", t=t))
    return rows


def deepseek_v4_config(t: int, *, index_heads: int = 16):
    """A tiny-width DeepSeek-V4 config of real structure for ``t`` tokens: a CSA and an HCA layer at V4's
    rates (4 and 128), window (128) and top-k (512); width 64, 2 heads of 32, 16 index heads (so index
    scores do not tie: transformers' ``topk`` breaks ties its own way), vocabulary 256.

    Example:
        >>> config = deepseek_v4_config(8192)
        >>> config.compress_rates, config.sliding_window, config.index_topk
        ({'compressed_sparse_attention': 4, 'heavily_compressed_attention': 128}, 128, 512)
    """
    from transformers import DeepseekV4Config

    return DeepseekV4Config(vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, head_dim=32, q_lora_rank=32, num_experts_per_tok=2,
                            n_routed_experts=4, max_position_embeddings=2 * t, o_groups=2, o_lora_rank=16,
                            index_n_heads=index_heads, index_head_dim=32, mlp_layer_types=["hash_moe", "moe"],
                            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"])


def deepseek_v4_memory(*, quick: bool = False) -> list[BenchRow]:
    """Peak tensor memory of a DeepSeek-V4 model's forward (:func:`deepseek_v4_config`, B=1, fp32, no
    grad) with ``attn_implementation="eager"`` and ``"attnlab"`` (CompressedAttention's path, no dense
    mask), at T=8192 (quick: 1024); the attnlab row's note adds the largest logit difference. Empty
    without transformers.

    Example:
        >>> rows = deepseek_v4_memory(quick=True)  # doctest: +SKIP
    """
    try:
        from transformers import DeepseekV4ForCausalLM
    except ImportError:
        return []
    t, name = (1024 if quick else 8192), register()
    ids = torch.randint(0, 256, (1, t), generator=torch.Generator().manual_seed(1))
    rows, logits = [], {}
    for implementation in ("eager", name):
        torch.manual_seed(0)
        model = DeepseekV4ForCausalLM._from_config(deepseek_v4_config(t), attn_implementation=implementation).eval()
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if ".self_attn." in param_name:
                    p.normal_(0.0, 0.3)  # not the zero init of sinks and biases
            model(ids[:, :64])  # the first forward adapts attnlab's layers
            with PeakMemory() as meter:
                logits[implementation] = model(ids).logits
        values = {"peak_mib": meter.peak_bytes / 2**20}
        note = f"peak {values['peak_mib']:.1f} MiB"
        if implementation == name:
            values["logits_max_abs_diff"] = (logits[name] - logits["eager"]).abs().max().item()
            note += (f", {values['peak_mib'] / rows[0].values['peak_mib']:.1%} of eager's; logits max abs diff "
                     f"{values['logits_max_abs_diff']:.1e}")
        rows.append(BenchRow("memory", f"DeepSeek-V4 forward T={t}", implementation, None, note=note, t=t,
                             values=values))
        del model
    return rows


def _run_once(mask, q, k, v, backend: str, grad: bool) -> Callable[[], None]:
    """One forward (no_grad) or forward+backward of ``attention`` as a candidate."""
    def run():
        with torch.set_grad_enabled(grad):
            out = attention(q, k, v, mask=mask, backend=backend)
            if grad:
                out.sum().backward()
    return run


def _sparse_backends(call, *, t: int, quick: bool, with_flex: bool = False) -> list[str]:
    """The backends the sparse suite times: every one that serves ``call``, less flex unless
    ``with_flex`` (its CPU compile takes seconds to minutes per shape), the O(T^2) reference from
    T=4096, and with ``quick`` the reference and chunked (seconds per call at T=2048 on 2 cores;
    ``--quick`` checks the harness)."""
    left_out = (set() if with_flex else {"flex"}) | ({"reference"} if t >= 4096 else set()) | (
        {"reference", "chunked"} if quick else set())
    return [n for n, why in backends.reasons(call).items() if not why and n not in left_out]


FLEX_OWN = "flex compiled (own block mask)"


def _flex_own(case: str, t: int, q, k, v) -> Callable[[], None]:
    """Compiled FlexAttention given the case's mask as a plain function and its own block mask
    (:class:`attnlab.lab.bench.competitors.CompiledFlex`), forward."""
    flex = CompiledFlex(flex_mask_mods(t)[case], t, t)
    return _no_grad(flex, q, k, v)


def sparse_suite(*, quick: bool = False, lengths: tuple[int, ...] | None = None,
                 rounds: int | None = None, with_flex: bool = False,
                 cases: tuple[str, ...] | None = None) -> list[BenchRow]:
    """Structured masks at ``T`` in (2048, 8192) (quick: 1024), B=1 H=8 D=64 fp32.

    Candidates: ``auto``, the backends of :func:`_sparse_backends`, and
    ``sdpa dense mask``: SDPA handed the same mask materialised as a dense bool tensor. With
    ``with_flex``, forward rows also time the flex backend and :data:`FLEX_OWN`: compiled
    ``flex_attention`` with the block mask ``create_block_mask`` builds from the same mask written
    as a plain function (what a FlexAttention user writes; block mask and compilation untimed).
    FLOPs count only the visible pairs: ``2*B*H*visible*(D+Dv)`` forward, 3.5x with backward.

    Args:
        quick, lengths, rounds: sizes and rounds (see above).
        with_flex: add the flex rows (compiling takes seconds to minutes per shape and mask).
        cases: the names of :func:`sparse_cases` to time (default: all).

    Example:
        >>> rows = sparse_suite(quick=True, lengths=(256,), rounds=1)  # doctest: +SKIP
    """
    lengths = lengths or ((1024,) if quick else (2048, 8192))
    rounds = rounds if rounds is not None else (1 if quick else 3)
    b, h, d = 1, 8, 64
    rows: list[BenchRow] = []
    for t in lengths:
        q, k, v = _attention_inputs(b, h, t, d, torch.float32, "cpu")
        for case, mod in sparse_cases(t).items():
            if cases is not None and case not in cases:
                continue
            dense = masks.materialize(mod, tq=t, tk=t)  # (1, 1, T, T) bool
            visible = int(dense.sum())
            for grad in (False, True):
                x = [t_.detach().requires_grad_(grad) for t_ in (q, k, v)]
                with torch.set_grad_enabled(grad):
                    call = backends.build_call(*x, mask=mod)
                    chosen = backends.select(call).name
                    names = _sparse_backends(call, t=t, quick=quick, with_flex=with_flex)
                candidates = {n: _run_once(mod, *x, n, grad) for n in names}
                candidates["auto"] = _run_once(mod, *x, "auto", grad)
                candidates["sdpa dense mask"] = _run_once(dense, *x, "sdpa", grad)
                if with_flex and not grad:
                    candidates[FLEX_OWN] = _flex_own(case, t, *x)
                seconds, peak = _compare_with_peak(candidates, rounds=rounds,
                                                   min_run_time=0.05 if quick else 0.2)
                mode = "fwd+bwd" if grad else "fwd"
                flops = attention_flops(b, h, 1, visible, d, mode=mode)  # the visible pairs as Tq x Tk
                for name, sec in seconds.items():
                    note = f"auto -> {chosen}" if name == "auto" else ""
                    rows.append(BenchRow("sparse", f"{case} {mode} T={t}", name, sec, flops, peak, note=note, t=t))
    return fill_ratios(rows)


def decode_suite(*, quick: bool = False, lengths: tuple[int, ...] | None = None,
                 rounds: int | None = None) -> list[BenchRow]:
    """One decoding step, B=1 H=12 D=64, 1 query over ``Tk`` cached keys, one thread:
    ``attnlab.attention(backend="auto")`` vs raw ``scaled_dot_product_attention``.

    ``Tk`` in (64, 1024, 4096), 3 rounds (quick: (64, 1024), 1 round). The fp32 matmul rate is
    measured on the same one thread, in the same rounds.

    Example:
        >>> rows = decode_suite(lengths=(16,), rounds=1)  # doctest: +SKIP
    """
    lengths = lengths or ((64, 1024) if quick else (64, 1024, 4096))
    rounds = rounds if rounds is not None else (1 if quick else 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows: list[BenchRow] = []
    try:
        for tk in lengths:
            q = torch.randn(1, 12, 1, 64)
            k, v = torch.randn(1, 12, tk, 64), torch.randn(1, 12, tk, 64)
            candidates = {
                "raw sdpa": _no_grad(torch.nn.functional.scaled_dot_product_attention, q, k, v),
                "auto": _no_grad(attention, q, k, v),
            }
            seconds, peak = _compare_with_peak(candidates, rounds=rounds, min_run_time=0.05 if quick else 0.2)
            flops = attention_flops(1, 12, 1, tk, 64)
            for name, sec in seconds.items():
                rows.append(BenchRow("decode", f"decode Tk={tk}", name, sec, flops, peak, t=tk))
    finally:
        torch.set_num_threads(threads)
    return fill_ratios(rows)


@dataclass
class GenerationTiming:
    """Greedy generation of one prompt with the KV cache, by recomputing every step, and by a plain
    PyTorch decoding loop over the same weights (:func:`plain_generate`).

    Attributes:
        new_tokens: tokens generated by each run.
        cached_seconds, recompute_seconds: wall seconds of each run (the prompt's prefill included).
        identical: whether the KV-cache and recomputing runs produced the same tokens.
        setup: what was generated, for titles.
        plain_seconds: wall seconds of the plain loop's run, or None when it was not run.
        plain_identical: whether the plain loop produced the KV-cache run's tokens (None: not run).
        per_token_ratio: ``GPT.generate``'s seconds per generated token over the plain loop's, the
            prefill left out (median over interleaved rounds), or None.

    Example:
        >>> timing = GenerationTiming(new_tokens=100, cached_seconds=1.0, recompute_seconds=4.0, identical=True)
        >>> timing.cached_rate, timing.recompute_rate, timing.speedup
        (100.0, 25.0, 4.0)
    """

    new_tokens: int
    cached_seconds: float
    recompute_seconds: float
    identical: bool
    setup: str = ""
    plain_seconds: float | None = None
    plain_identical: bool | None = None
    per_token_ratio: float | None = None

    @property
    def cached_rate(self) -> float:
        """Tokens per second with the KV cache."""
        return self.new_tokens / self.cached_seconds

    @property
    def recompute_rate(self) -> float:
        """Tokens per second recomputing the whole sequence every step."""
        return self.new_tokens / self.recompute_seconds

    @property
    def speedup(self) -> float:
        """The cached rate over the recompute rate."""
        return self.cached_rate / self.recompute_rate

    def rows(self, case: str) -> list[BenchRow]:
        """The runs as :class:`BenchRow` s of ``case``; ratio = cached rate / this run's rate.

        Example:
            >>> timing = GenerationTiming(new_tokens=8, cached_seconds=0.5, recompute_seconds=2.0, identical=True)
            >>> [(row.name, row.ratio) for row in timing.rows("c")]
            [('KV cache', 1.0), ('recompute', 4.0)]
            >>> plain = GenerationTiming(8, 0.5, 2.0, True, plain_seconds=0.4, plain_identical=True, per_token_ratio=1.05)
            >>> [(row.name, row.ratio) for row in plain.rows("c")][2]
            ('plain PyTorch loop', 0.8)
        """
        runs = [("KV cache", self.cached_seconds, ""), ("recompute", self.recompute_seconds, "")]
        if self.plain_seconds is not None:
            runs.append(("plain PyTorch loop", self.plain_seconds,
                         f"; GPT.generate per token {self.per_token_ratio:.2f}x this loop's, tokens "
                         f"{'match' if self.plain_identical else 'DIFFER'}"))
        return [BenchRow("decode-model", case, name, seconds, ratio=self.cached_rate / (self.new_tokens / seconds),
                         note=f"{self.new_tokens / seconds:.1f} tokens/s{extra}")
                for name, seconds, extra in runs]


def plain_generate(model: GPT, prompt: Tensor, new_tokens: int) -> Tensor:
    """Greedy tokens ``(B, new_tokens)`` of ``model`` by a nanoGPT-style PyTorch loop: the GPT's
    own parameters read directly, ``F.scaled_dot_product_attention`` over preallocated keys and
    values, no attnlab call. The reference :func:`decode_model_suite` times ``GPT.generate`` against.

    Serves pre-norm GPTs of ``G`` layers (multi-head or grouped-query attention without score
    mods) with learned or rotary positions; anything else is refused.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> gpt = GPT(vocab_size=11, max_len=12, d_model=8, num_layers=2, num_heads=2, positions="rope").eval()
        >>> prompt = torch.randint(0, 11, (1, 5))
        >>> torch.equal(plain_generate(gpt, prompt, 4), gpt.generate(prompt, 4)[:, -4:])
        True
    """
    kinds, config = set(model.layer_kinds), model.config
    if kinds != {"G"} or config["positions"] not in ("learned", "rope") or config.get("softcap") or config.get("sinks"):
        raise ValueError(f"plain_generate serves G layers with learned or rope positions and no score mods; got "
                         f"layers {sorted(kinds)}, positions={config['positions']!r}")
    (B, T0), L = prompt.shape, prompt.shape[1] + new_tokens
    attns = [block.attn for block in model.blocks]
    caches = [(torch.empty(B, a.num_kv_heads, L, a.head_dim), torch.empty(B, a.num_kv_heads, L, a.head_dim))
              for a in attns]  # (B, Hkv, L, hd) keys and values per layer
    rope = None
    if config["positions"] == "rope":
        hd = attns[0].head_dim
        angles = torch.arange(L, dtype=torch.float64)[:, None] * 10000.0 ** (
            -torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (L, hd/2)
        rope = angles.cos().to(prompt.device, model.lm_head.weight.dtype), angles.sin().to(
            prompt.device, model.lm_head.weight.dtype)
    tokens = []
    with torch.no_grad():
        logits = _plain_step(model, attns, caches, rope, prompt, 0)
        for step in range(new_tokens):
            tokens.append(logits.argmax(dim=-1, keepdim=True))  # (B, 1)
            if step + 1 < new_tokens:
                logits = _plain_step(model, attns, caches, rope, tokens[-1], T0 + step)
    return torch.cat(tokens, dim=1)


def _plain_step(model: GPT, attns, caches, rope, ids: Tensor, pos: int) -> Tensor:
    """Last-position logits ``(B, vocab)`` of ``ids`` ``(B, T)`` at positions ``pos ..``."""
    import torch.nn.functional as F

    B, T = ids.shape
    x = F.embedding(ids, model.tok_emb.weight)  # (B, T, d)
    if model.pos_emb is not None:
        x = x + model.pos_emb.embedding.weight[pos:pos + T]
    for block, a, (keys, values) in zip(model.blocks, attns, caches):
        n = block.norm_attn
        h = F.layer_norm(x, n.normalized_shape, n.weight, n.bias, n.eps)
        q, k, v = F.linear(h, a.in_proj_weight, a.in_proj_bias).split((a.d_out, a.d_kv, a.d_kv), dim=-1)
        q = q.view(B, T, a.num_heads, a.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = v.view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope[0][pos:pos + T], rope[1][pos:pos + T]  # (T, hd/2)
            q, k = (torch.cat((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1)
                    for t1, t2 in (q.chunk(2, dim=-1), k.chunk(2, dim=-1)))
        keys[:, :, pos:pos + T], values[:, :, pos:pos + T] = k, v
        y = F.scaled_dot_product_attention(q, keys[:, :, :pos + T], values[:, :, :pos + T], is_causal=T > 1,
                                           enable_gqa=a.num_kv_heads != a.num_heads)  # (B, H, T, hd)
        x = x + F.linear(y.transpose(1, 2).reshape(B, T, a.d_out), a.out_proj.weight, a.out_proj.bias)
        if block.mlp is not None:
            m, n = block.mlp, block.norm_mlp
            h = F.layer_norm(x, n.normalized_shape, n.weight, n.bias, n.eps)
            x = x + F.linear(m.act(F.linear(h, m.fc_in.weight, m.fc_in.bias)), m.fc_out.weight, m.fc_out.bias)
    n = model.norm
    x = F.layer_norm(x[:, -1], n.normalized_shape, n.weight, n.bias, n.eps)  # (B, d)
    return F.linear(x, model.lm_head.weight, model.lm_head.bias)  # (B, vocab)


def _per_token_ratio(model: GPT, prompt: Tensor, new_tokens: int, rounds: int) -> float:
    """Median over interleaved rounds of ``GPT.generate``'s seconds per generated token (a run of
    ``new_tokens`` less a run of 1, the prefill, over ``new_tokens - 1``) over the plain loop's."""
    runs = {"attnlab": lambda n: model.generate(prompt, n), "plain": lambda n: plain_generate(model, prompt, n)}
    ratios = []
    for _ in range(rounds):
        per_token = {}
        for name, run in runs.items():
            seconds = []
            for n in (1, new_tokens):
                start = time.perf_counter()
                run(n)
                seconds.append(time.perf_counter() - start)
            per_token[name] = (seconds[1] - seconds[0]) / max(new_tokens - 1, 1)
        ratios.append(per_token["attnlab"] / per_token["plain"])
    return sorted(ratios)[len(ratios) // 2]


def decode_model_suite(*, layers: int = 6, d_model: int = 384, heads: int = 6, vocab_size: int = 512,
                       prompt_len: int = 512, new_tokens: int = 256, seed: int = 0, rounds: int = 3,
                       positions: str = "learned") -> GenerationTiming:
    """A randomly initialised GPT (fp32) generating greedily after a random prompt, timed three ways.

    All runs decode the same prompt with the same model: one feeds a token per step and reads
    earlier keys/values from the KV cache, one recomputes the whole sequence every step, and a
    plain PyTorch loop (:func:`plain_generate`) does the first with F.sdpa over preallocated
    buffers. The prefill of the prompt is inside the three times, as a user waiting for the text
    sees it; the per-token ratio to the plain loop leaves it out (``rounds`` interleaved rounds).

    Args:
        layers, d_model, heads, vocab_size: the model's size.
        prompt_len, new_tokens: the prompt's length and the tokens to generate.
        seed: seed of the weights and the prompt.
        rounds: interleaved rounds of the per-token ratio (its median is reported).
        positions: the GPT's positions, ``"learned"`` or ``"rope"``.

    Example:
        >>> timing = decode_model_suite(layers=1, d_model=16, heads=2, vocab_size=32, prompt_len=8,
        ...                             new_tokens=4, rounds=1)
        >>> timing.identical, timing.plain_identical, timing.new_tokens
        (True, True, 4)
    """
    for name, value in (("layers", layers), ("d_model", d_model), ("heads", heads), ("vocab_size", vocab_size),
                        ("prompt_len", prompt_len), ("new_tokens", new_tokens), ("rounds", rounds)):
        positive_int(name, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(vocab_size, max_len=prompt_len + new_tokens, d_model=d_model, num_layers=layers,
                    num_heads=heads, positions=positions).eval()
        prompt = torch.randint(0, vocab_size, (1, prompt_len))
    model.generate(prompt[:, :16], 2)  # warm-up
    plain_generate(model, prompt[:, :16], 2)
    seconds, tokens = {}, {}
    for use_cache in (True, False):
        start = time.perf_counter()
        tokens[use_cache] = model.generate(prompt, new_tokens, use_cache=use_cache)
        seconds[use_cache] = time.perf_counter() - start
    start = time.perf_counter()
    plain = plain_generate(model, prompt, new_tokens)
    plain_seconds = time.perf_counter() - start
    setup = (f"GPT {layers} layers, d_model {d_model}, {heads} heads, vocab {vocab_size}, {positions} positions: "
             f"{new_tokens} greedy tokens after {prompt_len}, fp32, {torch.get_num_threads()} threads")
    return GenerationTiming(new_tokens, seconds[True], seconds[False], torch.equal(tokens[True], tokens[False]),
                            setup, plain_seconds=plain_seconds,
                            plain_identical=torch.equal(tokens[True][:, prompt_len:], plain),
                            per_token_ratio=_per_token_ratio(model, prompt, new_tokens, rounds))


def report_generation(timing: GenerationTiming, *, console=None) -> None:
    """Print ``timing`` as a table and its ratio; a token mismatch raises ``RuntimeError`` after printing.

    Example:
        >>> report_generation(GenerationTiming(8, 0.5, 2.0, identical=False))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: the KV-cache and the recomputing runs generated different greedy tokens
    """
    from rich.console import Console

    console = Console() if console is None else console
    title = f"{timing.setup} (ratio: KV-cache rate / the row's rate)"
    print_rows(timing.rows(f"{timing.new_tokens} new tokens"), title=title, console=console)
    console.print(f"KV cache {timing.cached_rate:.1f} tokens/s, recompute {timing.recompute_rate:.1f} tokens/s: "
                  f"{timing.speedup:.1f}x; identical greedy tokens: {'yes' if timing.identical else 'NO'}",
                  markup=False, soft_wrap=True)
    if timing.plain_seconds is not None:
        console.print(f"GPT.generate per generated token: {timing.per_token_ratio:.2f}x the plain PyTorch loop "
                      f"(median of interleaved rounds, prefill left out); plain loop's tokens identical: "
                      f"{'yes' if timing.plain_identical else 'NO'}", markup=False, soft_wrap=True)
    if not timing.identical:
        raise RuntimeError("the KV-cache and the recomputing runs generated different greedy tokens")
    if timing.plain_identical is False:
        raise RuntimeError("GPT.generate and the plain PyTorch loop generated different greedy tokens")


def run_suite(name: str, *, quick: bool = False, console=None, with_flex: bool = False) -> list[BenchRow]:
    """Run one suite (``backends``, ``memory``, ``modules``, ``sparse``, ``decode``, ``decode-model``,
    ``overhead``, ``variants``, ``padded``, ``linear``) or ``all``.

    ``with_flex`` adds FlexAttention's rows to the sparse suite (see :func:`sparse_suite`).

    Example:
        >>> run_suite("nope")
        Traceback (most recent call last):
        ...
        ValueError: suite must be one of ('backends', 'memory', 'modules', 'sparse', 'decode', 'decode-model', 'overhead', 'variants', 'padded', 'linear', 'all'), got 'nope'
    """
    if name not in SUITES + ("all",):
        raise ValueError(f"suite must be one of {SUITES + ('all',)}, got {name!r}")
    from rich.console import Console

    console = Console() if console is None else console
    console.print(f"machine: {machine_line()}")
    if name not in ("overhead", "linear"):  # overhead: ratios to plain PyTorch, no FLOPs; linear: its own
        console.print("FLOPs: forward 2*B*H*Tq*Tk*(D+Dv), halved for causal (docs/contract.md); "
                      "% of matmul = GFLOP/s over the same-dtype matmul rate measured in this run")
    rows: list[BenchRow] = []
    for suite in (SUITES if name == "all" else (name,)):
        if suite == "backends":
            rows += (found := backends_suite(quick=quick))
            print_rows(found, title="backends, forward, B=1 H=8 D=64 fp32", console=console)
        elif suite == "memory":
            rows += (found := memory_suite(quick=quick))
            print_rows(found, title="peak memory, causal forward+backward, B=1 H=4 D=64", console=console)
            rows += (found := deepseek_v4_memory(quick=quick))
            if found:
                print_rows(found, title="DeepSeek-V4 model forward (tiny width, CSA + HCA), B=1 fp32: eager vs "
                                        "attn_implementation='attnlab'", console=console)
        elif suite == "sparse":
            rows += (found := sparse_suite(quick=quick, with_flex=with_flex))
            print_rows(found, title="structured masks, B=1 H=8 D=64 fp32 (FLOPs: visible pairs only)",
                       console=console)
        elif suite == "decode":
            rows += (found := decode_suite(quick=quick))
            print_rows(found, title="one decoding step, B=1 H=12 D=64, 1 thread", console=console)
        elif suite == "decode-model":
            sizes = dict(prompt_len=128, new_tokens=32) if quick else {}
            timing = decode_model_suite(**sizes)
            rows += timing.rows(f"{timing.new_tokens} new tokens")
            report_generation(timing, console=console)
        elif suite == "overhead":
            found = overhead.overhead_suite(sizes=(sizes := overhead.sizes_for(quick=quick)))
            rows += [row for case in found for row in case.bench_rows()]
            overhead.print_overhead(found, title="overhead: attnlab vs plain PyTorch (ratio = attnlab / plain; "
                                        "compile: compiled / eager)", sizes=sizes, console=console)
        elif suite == "padded":
            with console.status("padded suite") as status:
                found = padded.padded_suite(quick=quick, progress=status.update)
            rows += found
            print_rows(found, title="padded batches and structured masks, B=4 H=8 D=64 fp32 (ratio = time over the "
                       "case's baseline: SDPA + combined mask / nanoGPT-style / compiled flex / SDPA + dense mask)",
                       console=console)
        elif suite == "linear":
            with console.status("linear suite") as status:
                found = linear.linear_suite(quick=quick, progress=status.update)
            rows += found
            console.print("FLOPs (linear): the chunked form's matmuls at C=64, per token and head 2C(Dk+Dv) + "
                          "4DkDv, delta rules + 2C(2Dk+Dv) + 2DkDv + 2C²/3 (attnlab._flops); backward 2.5x; "
                          "% of matmul: over a (B*H, T, Dk) @ (Dk, Dv) fp32 matmul timed in the same rounds")
            print_rows(found, title="linear attention: gated delta rule, B=1 H=4 Dk=Dv=128 fp32 (ratio = time over "
                       "transformers' torch_chunk_gated_delta_rule), and one decoding step (1 thread)", console=console)
        elif suite == "variants":
            found = variants.variants_suite(sizes=(sizes := variants.VariantSizes.for_run(quick=quick)))
            rows += [row.bench_row() for row in found]
            variants.print_variants(found, sizes, console=console)
            contexts = variants.context_rates(sizes)
            rows += [row.bench_row() for row in contexts]
            variants.print_context_rates(contexts, sizes, console=console)
        else:
            rows += run_modules_suite(quick=quick, console=console)
    return rows
