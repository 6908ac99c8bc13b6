"""``attnlab kv-memory``: how many bytes of KV cache a model needs at a context length.

Prints one line per variant the options describe: multi-head attention (every head cached),
grouped-query attention (``--kv-heads``), each again with cross-layer KV sharing
(``--kv-layers``: only that many layers produce and cache keys/values), multi-head latent
attention (``--latent-dim`` [+ ``--latent-rope-dim``] numbers a token a layer), sliding-window
layers (``--window``, in the ``--layer-pattern`` of local ``L`` and global ``G`` layers), Llama 4's
chunked-local ``C`` and NoPE global ``N`` layers (``--chunk``), DSA (``--index-dim``: the lightning
indexer's fp8 keys beside the model's cache), NSA (``--nsa-block``: its three branches' keys and
values, sized in the paper's proportions) and hybrids of recurrent layers (``R`` Gated DeltaNet,
``K`` KDA, ``A`` plain linear attention in ``--layer-pattern``, sized by ``--linear-heads``): a state of constant size each,
beside the attention layers' caches, and DeepSeek-V4's compressed layers (``V`` CSA, ``H`` HCA in
``--layer-pattern``, with ``--compress-rate`` and ``--window``): the window's keys, one entry per
``--compress-rate`` tokens and the open window's tokens, plus CSA's indexer keys (``--index-dim``
numbers, default ``--head-dim``, in the model's dtype). ``--kv-shared-layers N`` is a GPT's
``num_kv_shared_layers`` (Gemma 3n, Gemma 4): the last ``N`` layers hold no cache, each reading
the last earlier layer of its letter, so the MHA, GQA and ``--layer-pattern`` rows count the
other layers once, and the report says how many layers hold a cache. GB are
10^9 bytes, as in rasbt/LLMs-from-scratch ch04's memory estimators, whose figures it reproduces
(docs/variants.md).
"""

from __future__ import annotations

import typer

from attnlab._checks import divisible, one_of, positive_int
from attnlab.lab.cli._errors import at_most, fail, option_errors
from attnlab.lab.cli._help import HelpCommand

# Sizes above these are typos, not models: refusing them keeps the arithmetic readable.
_MAX_SIZE = 2**31


def kv_memory(
    layers: int = typer.Option(..., "--layers", help="Transformer layers."),
    heads: int = typer.Option(..., "--heads", help="Query heads per layer (MHA caches this many)."),
    head_dim: int = typer.Option(..., "--head-dim", help="Features per head."),
    context: int = typer.Option(..., "--context", help="Tokens per sequence held in the cache."),
    kv_heads: int = typer.Option(None, "--kv-heads", help="Key/value heads of grouped-query attention "
                                                          "(must divide --heads)."),
    batch: int = typer.Option(1, "--batch", help="Sequences."),
    dtype: str = typer.Option("bf16", "--dtype", help="fp32, fp16, bf16, fp8 or int8."),
    kv_layers: int = typer.Option(None, "--kv-layers", help="Layers that produce and cache K/V when later "
                                                            "layers reuse them (cross-layer KV sharing)."),
    kv_shared_layers: int = typer.Option(None, "--kv-shared-layers", show_default=False,
                                         help="A GPT's num_kv_shared_layers (Gemma 3n/4): the last N layers hold "
                                              "no cache and read the last earlier layer of their letter (G, L, "
                                              "C, N); the MHA, GQA and --layer-pattern rows count each cache once."),
    latent_dim: int = typer.Option(None, "--latent-dim", help="MLA: latent numbers cached per token and layer."),
    latent_rope_dim: int = typer.Option(None, "--latent-rope-dim", show_default=False,
                                        help="MLA (with --latent-dim): decoupled RoPE key numbers cached beside "
                                             "the latent (default 0)."),
    window: int = typer.Option(None, "--window", help="Sliding window of the local layers (tokens)."),
    layer_pattern: str = typer.Option("L", "--layer-pattern", help="With --window: local (L) and global (G) "
                                                                   "layers; with --chunk: chunked-local (C) and "
                                                                   "NoPE global (N) layers (Llama 4); with "
                                                                   "--linear-heads: recurrent Gated DeltaNet (R), "
                                                                   "KDA (K) and linear (A) layers (RRRG: Qwen3.5's 3:1); "
                                                                   "with --compress-rate: DeepSeek-V4's CSA (V) "
                                                                   "and HCA (H) layers (VH), "
                                                                   "repeated over --layers."),
    chunk: int = typer.Option(None, "--chunk", help="Chunk of the chunked-local C layers (tokens)."),
    index_dim: int = typer.Option(None, "--index-dim", help="DSA: lightning-indexer key numbers cached per token "
                                                            "and layer, in fp8 (DeepSeek-V3.2: 128)."),
    linear_heads: int = typer.Option(None, "--linear-heads", help="R/K/A layers: value heads, each holding a "
                                                                  "--linear-head-dim square fp32 state."),
    linear_key_heads: int = typer.Option(None, "--linear-key-heads", show_default=False,
                                         help="R/K/A layers: query/key heads (default --linear-heads)."),
    linear_head_dim: int = typer.Option(None, "--linear-head-dim", show_default=False,
                                        help="R/K/A layers: key and value features per head (default --head-dim)."),
    nsa_block: int = typer.Option(None, "--nsa-block", help="NSA: the selection block (a multiple of 4; the "
                                                            "paper's 64): each branch's keys and values (every "
                                                            "token, a window of 8 blocks, compressed ones)."),
    compress_rate: int = typer.Option(None, "--compress-rate", help="V/H layers (DeepSeek-V4): tokens pooled into "
                                                                    "one compressed entry (V4: 4 for CSA, 128 for "
                                                                    "HCA)."),
) -> None:
    """Print the KV-cache size of MHA, GQA, KV sharing, MLA, sliding-window and chunked layers, DSA, NSA and recurrent hybrids at --context."""
    from attnlab.nn.kv_memory import DTYPE_BYTES, kv_cache_bytes
    from attnlab.nn.native_sparse import paper_sizes

    with option_errors():
        for option, value in (("--layers", layers), ("--heads", heads), ("--head-dim", head_dim),
                              ("--context", context), ("--batch", batch)):
            at_most(option, positive_int(option, value), _MAX_SIZE, "a size this large is a typo")
        one_of("--dtype", dtype, DTYPE_BYTES)
        if kv_heads is not None:
            divisible("--heads", heads, "--kv-heads", positive_int("--kv-heads", kv_heads))
        if kv_layers is not None:
            at_most("--kv-layers", positive_int("--kv-layers", kv_layers), layers, "at most every layer")
        if latent_dim is not None:
            at_most("--latent-dim", positive_int("--latent-dim", latent_dim), _MAX_SIZE, "a size this large is a typo")
        if latent_rope_dim is not None and latent_rope_dim < 0:
            fail(f"--latent-rope-dim must be >= 0, got {latent_rope_dim}")
        if latent_rope_dim is not None:
            at_most("--latent-rope-dim", latent_rope_dim, _MAX_SIZE, "a size this large is a typo")
        for option, value in (("--window", window), ("--chunk", chunk), ("--index-dim", index_dim),
                              ("--nsa-block", nsa_block), ("--linear-heads", linear_heads),
                              ("--linear-key-heads", linear_key_heads), ("--linear-head-dim", linear_head_dim),
                              ("--compress-rate", compress_rate)):
            if value is not None:
                at_most(option, positive_int(option, value), _MAX_SIZE, "a size this large is a typo")
        if nsa_block is not None:
            paper_sizes(nsa_block, name="--nsa-block")
        if kv_shared_layers is not None:
            at_most("--kv-shared-layers", positive_int("--kv-shared-layers", kv_shared_layers), layers - 1,
                    "--layers - 1: one layer at least computes keys and values")
    _check_shared(kv_shared_layers, kv_layers, latent_dim, index_dim, nsa_block)
    if latent_rope_dim is not None and latent_dim is None:
        fail(f"--latent-rope-dim {latent_rope_dim} is for MLA: give --latent-dim too")
    latent_rope_dim = latent_rope_dim or 0
    if not layer_pattern or set(layer_pattern) - set("LGCNRKAVH"):
        fail(f"--layer-pattern must be letters L (local), G (global), C (chunked-local), N (NoPE global), "
             f"R (Gated DeltaNet), K (KDA), A (linear), V (CSA) and H (HCA), got {layer_pattern!r}")
    compressed = set(layer_pattern) & {"V", "H"}
    if compressed and (compress_rate is None or window is None):
        fail(f"--layer-pattern {layer_pattern} has DeepSeek-V4's compressed (V/H) layers: give "
             f"{'--compress-rate' if compress_rate is None else '--window'}")
    if compress_rate is not None and not compressed:
        fail(f"--compress-rate {compress_rate} is for compressed layers: give --layer-pattern with V or H (e.g. VH)")
    linear_state = _linear_state(layer_pattern, linear_heads, linear_key_heads, linear_head_dim, head_dim, dtype)
    if "L" in layer_pattern and layer_pattern != "L" and window is None:
        fail("--layer-pattern has sliding-window L layers: give --window")
    if "C" in layer_pattern and chunk is None:
        fail("--layer-pattern has chunked-local C layers: give --chunk")
    if chunk is not None and "C" not in layer_pattern:
        fail(f"--chunk {chunk} is for chunked-local layers: give --layer-pattern with C (e.g. CCCN)")
    sizes = dict(context=context, layers=layers, head_dim=head_dim, dtype_bytes=DTYPE_BYTES[dtype], batch=batch)
    rows = [("MHA", kv_cache_bytes(kv_heads=heads, **sizes))]
    if kv_heads is not None:
        rows.append((f"GQA ({kv_heads} KV heads)", kv_cache_bytes(kv_heads=kv_heads, **sizes)))
    if kv_shared_layers:
        rows += [(f"{name} + {kv_shared_layers} shared layers", kv_cache_bytes(
            kv_heads=count, kv_shared_layers=kv_shared_layers, **sizes)) for name, count in
            (("MHA", heads), *([(f"GQA ({kv_heads} KV heads)", kv_heads)] if kv_heads is not None else []))]
    if kv_layers is not None:
        rows += [(f"{name} + KV sharing ({kv_layers} of {layers} layers)", kv_cache_bytes(
            kv_heads=count, kv_layers=kv_layers, **sizes)) for name, count in
            (("MHA", heads), *([(f"GQA ({kv_heads} KV heads)", kv_heads)] if kv_heads is not None else []))]
    if latent_dim is not None:
        rows.append((f"MLA (latent {latent_dim} + rope {latent_rope_dim})", kv_cache_bytes(
            pattern="M", latent_dim=latent_dim, rope_dim=latent_rope_dim, **sizes)))
    if window is not None or chunk is not None or linear_state is not None:
        spans = ", ".join(f"{name} {value}" for name, value in (("window", window), ("chunk", chunk),
                                                                 ("compress rate", compress_rate)) if value)
        linear = f"{linear_heads} linear heads of {linear_head_dim or head_dim}" if linear_state else ""
        rows.append((", ".join(part for part in (spans, f"pattern {layer_pattern}", linear) if part)
                     + (f", {kv_heads} KV heads" if kv_heads else "")
                     + (f", {kv_shared_layers} shared layers" if kv_shared_layers else ""),
                     _pattern_bytes(layer_pattern, dict(kv_heads=kv_heads or heads, window=window, chunk=chunk,
                                                        linear_state=linear_state, compress_rate=compress_rate),
                                    index_dim or head_dim, sizes, kv_shared_layers or 0)))
    if index_dim is not None:  # DSA: the model's own cache (MLA when given) plus fp8 index keys
        base = dict(pattern="M", latent_dim=latent_dim, rope_dim=latent_rope_dim) if latent_dim else \
            dict(kv_heads=kv_heads or heads)
        name = "MLA" if latent_dim else (f"GQA ({kv_heads} KV heads)" if kv_heads else "MHA")
        rows.append((f"DSA: {name} + {index_dim} fp8 index numbers", kv_cache_bytes(index_dim=index_dim, **base,
                                                                                     **sizes)))
    if nsa_block is not None:  # NSA: its three branches' keys and values
        rows.append((f"NSA (block {nsa_block}, {kv_heads or heads} KV heads)", kv_cache_bytes(
            kv_heads=kv_heads or heads, pattern="S", nsa_block=nsa_block, **sizes)))
    _print(rows, sizes, heads, dtype)
    if kv_shared_layers:
        typer.echo(f"  layers holding a cache: {layers - kv_shared_layers} of {layers} (the last {kv_shared_layers} "
                   "read an earlier layer's keys and values)")


def _check_shared(shared: int | None, kv_layers: int | None, latent_dim, index_dim, nsa_block) -> None:
    """``--kv-shared-layers`` goes with the multi-head rows only, and not with ``--kv-layers``."""
    if shared is None:
        return
    if kv_layers is not None:
        fail(f"--kv-shared-layers {shared} and --kv-layers {kv_layers} both say which layers hold a cache; give one")
    others = [name for name, value in (("--latent-dim", latent_dim), ("--index-dim", index_dim),
                                       ("--nsa-block", nsa_block)) if value is not None]
    if others:
        fail(f"--kv-shared-layers {shared} is for multi-head layers (G, L, C, N); {others[0]}'s layers make their "
             "keys their own way and share none")


def _pattern_bytes(pattern: str, options: dict, index_dim: int, sizes: dict, shared: int = 0) -> int:
    """The pattern's bytes layer by layer: CSA (V) layers with ``index_dim`` indexer keys, the others without;
    the last ``shared`` layers (cross-layer KV sharing) hold none."""
    from attnlab.nn.kv_memory import kv_cache_bytes
    from attnlab.nn.kv_sharing import kv_sharing_plan

    layers = sizes["layers"]
    kinds = [pattern[layer % len(pattern)] for layer in range(layers)]
    with option_errors():  # the GPT's refusals: letters that share nothing, no earlier layer of the letter
        kv_sharing_plan(kinds, shared, name="--kv-shared-layers")
    kinds = kinds[: layers - shared]
    return sum(kinds.count(letter) * kv_cache_bytes(**{**sizes, "layers": 1}, pattern=letter, **options,
                                                    index_dim=index_dim if letter == "V" else 0)
               for letter in set(kinds))


def _linear_state(pattern: str, heads: int | None, key_heads: int | None, head_dim: int | None, default_dim: int,
                  dtype: str) -> int | None:
    """Bytes one R/K/A layer holds per sequence (None: the pattern has none); refusals on one line."""
    from attnlab.nn.kv_memory import DTYPE_BYTES, RECURRENT, recurrent_state_bytes

    recurrent = set(pattern) & set(RECURRENT)
    given = [name for name, value in (("--linear-heads", heads), ("--linear-key-heads", key_heads),
                                      ("--linear-head-dim", head_dim)) if value is not None]
    if not recurrent:
        if given:
            fail(f"{given[0]} is for recurrent layers: give --layer-pattern with R, K or A (e.g. RRRG)")
        return None
    if heads is None:
        fail(f"--layer-pattern {pattern} has recurrent (R/K/A) layers: give --linear-heads")
    if key_heads is not None and heads % key_heads:
        fail(f"--linear-key-heads {key_heads} must divide --linear-heads {heads} (each query/key head serves "
             f"whole value heads)")
    return recurrent_state_bytes(value_heads=heads, key_heads=key_heads or heads, head_dim=head_dim or default_dim,
                                 dtype_bytes=DTYPE_BYTES[dtype])


def _print(rows: list[tuple[str, int]], sizes: dict, heads: int, dtype: str) -> None:
    mha = rows[0][1]
    typer.echo(f"KV cache at context {sizes['context']:,}, batch {sizes['batch']}, {sizes['layers']} layers, "
               f"{heads} heads of {sizes['head_dim']}, {dtype} ({sizes['dtype_bytes']} bytes):")
    width = max(len(name) for name, _ in rows)
    for name, total in rows:
        per_token = total / (sizes["batch"] * sizes["context"])
        typer.echo(f"  {name:<{width}}  {total / 1e9:10,.2f} GB  {per_token:12,.0f} B/token  "
                   f"{mha / total:6.2f}x smaller than MHA")


def register(app: typer.Typer) -> None:
    """Add the ``kv-memory`` command to ``app``."""
    app.command("kv-memory", cls=HelpCommand)(kv_memory)
