"""Issue 24's three targets side by side: MLA absorbed decoding, the windowed cache, the paged batch.

1. **MLA** (one ``LatentAttention`` layer, d_model 256, 8 heads, latent 48 + rope key 16, fp32,
   batch 1): decoding steps over a 2048-token cache in the absorbed form (the default with a
   cache) against the expanded form, interleaved; the cache's bytes per token against a
   grouped-query ``MultiHeadAttention`` with 4 KV heads at the same d_model. Targets: cache >= 4x
   smaller, absorbed >= 1.0x the expanded tokens/s.
2. **Windowed cache** (a 4-layer GPT, d_model 128, 8 heads, every layer a sliding window of 256,
   RoPE): greedy generation of ``--window-tokens`` tokens after a 256-token prompt with the
   ring-buffer ``WindowedKVCache`` against a contiguous ``KVCache`` per layer (the same window
   mask), one whole generation each per round, interleaved; their tokens compared; the caches'
   bytes at a quarter, half and all of the generated length, and the peak of one more step's
   tensors at the end. Targets: memory flat in the generated length, tokens/s >= 0.95x contiguous,
   exact tokens, at the issue's 8192 tokens by default.
3. **Paged batch** (the same GPT with global layers): 8 prompts of lengths 16..1024 (evenly
   spaced) generating ``--paged-tokens`` tokens each with ``GPT.generate(prompts, n)`` (paged
   caches, each prompt prefilled alone, one attention call per layer and step) against the
   padded contiguous batch: the prompts left-padded to 1024 as one ``(8, 1024)`` tensor with a
   ``KVCache`` (what the padded batch computes; GPT has no padding mask, so its tokens stand for
   the cost only). Tokens/s count every row's new tokens, prefill included, interleaved
   (``attnlab.lab.bench.timing.compare``); the paged tokens are checked against each prompt
   generated alone. Target: >= 1.5x, same tokens per prompt.

Every figure comes from this run on the machine printed first; only an idle machine's figures
mean anything (BENCHMARKS.md). The default run takes about 3 minutes on 2 cores.

    python benchmarks/bench_variant_targets.py
    python benchmarks/bench_variant_targets.py --window-tokens 2048     # a quicker look
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from attnlab._memory import PeakMemory
from attnlab.lab.bench.timing import compare, machine_line
from attnlab.models import GPT
from attnlab.nn import QKV, LatentAttention, MultiHeadAttention

VOCAB = 256


def mla_target(context: int = 2048, *, rounds: int = 3) -> None:
    torch.manual_seed(0)
    mla = LatentAttention(256, 8, latent_dim=48, rope_dim=16).eval()
    gqa = MultiHeadAttention(256, 256, num_heads=8, positions="rope", qkv=QKV(num_kv_heads=4)).eval()
    cache = mla.new_cache(1, context + 1)
    token = torch.randn(1, 1, 256)
    with torch.no_grad():
        mla(torch.randn(1, context, 256), cache=cache)

        def step(absorb: bool):
            def run():
                out = mla(token, cache=cache, absorb=absorb)
                cache.length = context  # the step's slot is written again next time
                return out
            return run

        absorbed, expanded = step(True)(), step(False)()
        seconds = compare({"absorbed": step(True), "expanded": step(False)}, rounds=rounds)
    mla_bytes = cache.nbytes / (context + 1)
    gqa_bytes = gqa.new_cache(1, context + 1).nbytes / (context + 1)
    same = torch.allclose(absorbed, expanded, rtol=1e-4, atol=1e-5)
    print(f"\n1. MLA decoding at {context} context (d_model 256, 8 heads, latent 48 + rope 16, fp32, batch 1)")
    for name, s in seconds.items():
        print(f"   {name:9s} {1 / s:8.0f} tokens/s  ({s * 1e6:.0f} us/step)")
    print(f"   absorbed / expanded: {seconds['expanded'] / seconds['absorbed']:.2f}x (target >= 1.0x); "
          f"outputs agree: {same}")
    print(f"   cache bytes/token: MLA {mla_bytes:.0f}, GQA with 4 KV heads {gqa_bytes:.0f}: "
          f"{gqa_bytes / mla_bytes:.1f}x smaller (target >= 4x)")


def _gpt(**options) -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, max_len=options.pop("max_len"), d_model=128, num_layers=4, num_heads=8, positions="rope",
               **options).eval()


def _contiguous_caches(model: GPT, length: int) -> list:
    weight = model.tok_emb.weight
    return [block.attn.new_cache(1, length, windowed=False, dtype=weight.dtype, device=weight.device)
            for block in model.blocks]


def _generate(model: GPT, prompt: torch.Tensor, new_tokens: int, caches: list) -> torch.Tensor:
    """Greedy tokens ``(new_tokens,)`` of ``prompt`` ``(1, T)`` over the given caches."""
    tokens = []
    with torch.no_grad():
        logits = model(prompt, caches=caches)[:, -1]
        for _ in range(new_tokens):
            token = logits.argmax(-1, keepdim=True)  # (1, 1)
            tokens.append(token)
            if len(tokens) < new_tokens:
                logits = model(token, caches=caches)[:, -1]
    return torch.cat(tokens, 1)[0]


def window_target(new_tokens: int, *, window: int = 256, prompt_len: int = 256, rounds: int = 2) -> None:
    total = prompt_len + new_tokens
    model = _gpt(max_len=total, layer_pattern="L", window=window)
    prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    kinds = {"windowed": lambda length: model.new_cache(1, length), "contiguous": lambda length: _contiguous_caches(model, length)}
    _generate(model, prompt[:, :16], 8, kinds["windowed"](24))  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in kinds}
    tokens, last = {}, {}
    for _ in range(rounds):  # one whole generation per candidate per round, interleaved
        for name, make in kinds.items():
            last[name] = make(total)
            start = time.perf_counter()
            tokens[name] = _generate(model, prompt, new_tokens, last[name])
            seconds[name].append(time.perf_counter() - start)
    rate = {name: new_tokens / sorted(values)[len(values) // 2] for name, values in seconds.items()}
    print(f"\n2. windowed cache, W={window}: {new_tokens} tokens after {prompt_len} (GPT 4 layers, d_model 128, "
          f"8 heads, all sliding-window, fp32, batch 1; {rounds} interleaved rounds)")
    for name in kinds:
        print(f"   {name:10s} {rate[name]:8.0f} tokens/s")
    same = torch.equal(tokens["windowed"], tokens["contiguous"])
    first = "" if same else f" (first difference at token {int((tokens['windowed'] != tokens['contiguous']).nonzero()[0])})"
    print(f"   windowed / contiguous: {rate['windowed'] / rate['contiguous']:.2f}x (target >= 0.95x); "
          f"same tokens: {same}{first}")
    print("   cache MiB after generating n tokens (contiguous: allocated for the whole length):")
    for n in (new_tokens // 4, new_tokens // 2, new_tokens):
        sizes = {name: sum(c.nbytes for c in make(prompt_len + n)) / 2**20 for name, make in kinds.items()}
        print(f"     n={n:6d}  " + "  ".join(f"{name} {size:7.2f}" for name, size in sizes.items()))
    for name, caches in last.items():  # the tensors the run's last step allocates, beside its caches
        with torch.no_grad(), PeakMemory() as meter:
            model(tokens[name][-1:][None], caches=caches)  # the one position the run left free
        held = sum(c.nbytes for c in caches)
        print(f"   {name:10s} peak while generating: caches {held / 2**20:.2f} MiB + one step's tensors "
              f"{meter.peak_bytes / 2**20:.2f} MiB")


def paged_target(new_tokens: int, *, rounds: int = 3) -> None:
    lengths = torch.linspace(16, 1024, 8).round().long().tolist()
    longest = max(lengths)
    model = _gpt(max_len=longest + new_tokens)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]
    padded = torch.stack([torch.cat([torch.zeros(longest - len(p), dtype=torch.long), p]) for p in prompts])  # (8, L)
    results = {}

    def paged():
        results["paged"] = model.generate(prompts, new_tokens, page_size=16)

    def contiguous():
        results["padded"] = model.generate(padded, new_tokens)

    seconds = compare({"paged": paged, "padded contiguous": contiguous}, rounds=rounds, min_run_time=0.1)
    alone = [model.generate(prompt[None], new_tokens)[0] for prompt in prompts]
    same = all(torch.equal(a, b) for a, b in zip(results["paged"], alone))
    print(f"\n3. paged batch: 8 prompts of lengths {lengths}, {new_tokens} new tokens each (GPT 4 layers, "
          f"d_model 128, 8 heads, global, fp32; prefill included)")
    for name, s in seconds.items():
        print(f"   {name:18s} {8 * new_tokens / s:8.0f} tokens/s  ({s:.2f} s)")
    print(f"   paged / padded: {seconds['padded contiguous'] / seconds['paged']:.2f}x (target >= 1.5x); "
          f"paged tokens equal each prompt generated alone: {same}")
    slots = 8 * (longest + new_tokens)
    contiguous_bytes = sum(c.nbytes for c in model.new_cache(8, longest + new_tokens))
    pages = sum(-(-(n + new_tokens) // 16) for n in lengths)  # what the rows' block tables hold at the end
    print(f"   cache MiB at the end: padded contiguous {contiguous_bytes / 2**20:.1f}, paged "
          f"{contiguous_bytes * pages * 16 / slots / 2**20:.1f} ({pages} pages of 16)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window-tokens", type=int, default=8192, help="tokens generated for target 2")
    parser.add_argument("--paged-tokens", type=int, default=32, help="tokens generated per prompt for target 3")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    print(f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    start = time.perf_counter()
    mla_target()
    window_target(args.window_tokens)
    paged_target(args.paged_tokens)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
