"""Packed against padded training of a tiny Llama on attnlab: one optimizer step each, tokens/s.

The same documents (lengths drawn uniformly from ``--min-length`` to ``--max-length`` until about
``--tokens`` tokens) are trained on three ways, each one forward, backward and AdamW step of a
``transformers`` Llama built with ``attn_implementation="attnlab"``:

* ``packed, cu_seq_lens`` -- one row of every document, ``position_ids`` restarting per document and
  ``cu_seq_lens_q/k``, ``max_length_q/k`` as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
  writes them (attnlab keeps the documents apart with its document mask);
* ``packed, position_ids`` -- the same row with ``position_ids`` alone (``use_cache`` at its default,
  so the documents are found from the restarting positions);
* ``padded`` -- a batch of one document per row, right-padded to the longest, with its attention mask.

Timed in interleaved rounds (median of each candidate's round medians; each runs once untimed
first). Tokens/s count real tokens only, the same for every candidate; the ratio is packed over
padded. Prints a markdown table headed by the machine (CPU model, avx2/avx512 flags, threads, torch).

Usage:
    python benchmarks/bench_packed.py                               # ~4k tokens, lengths 64..1024
    python benchmarks/bench_packed.py --tokens 256 --min-length 16 --max-length 64 --rounds 1  # smoke
"""

from __future__ import annotations

import argparse

import torch

from attnlab.lab.bench.timing import compare, machine_line
from attnlab.integrations.transformers import register


def cpu_flags() -> str:
    """Which of avx2 / avx512f this CPU reports (empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next(line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags"))
    except (OSError, StopIteration):
        return "flags unknown"
    return ", ".join(flag for flag in ("avx2", "avx512f") if flag in flags) or "no avx2"


def document_lengths(tokens: int, low: int, high: int, seed: int) -> list[int]:
    """Lengths drawn uniformly from ``[low, high]`` until their sum reaches ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(low, high + 1, (1,), generator=gen)))
    return lengths


def model(vocab: int, positions: int):
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=positions)
    config._attn_implementation = register()
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def batches(lengths: list[int], vocab: int) -> dict[str, dict]:
    """The three ways to feed the same documents (see the module)."""
    gen = torch.Generator().manual_seed(1)
    documents = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    row = torch.cat(documents)[None]  # (1, total)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    flash = dict(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=max(lengths), max_length_k=max(lengths))
    longest = max(lengths)
    padded = torch.zeros(len(lengths), longest, dtype=torch.long)  # (B, longest)
    mask = torch.zeros_like(padded)
    for i, doc in enumerate(documents):
        padded[i, :len(doc)], mask[i, :len(doc)] = doc, 1
    labels = padded.masked_fill(mask == 0, -100)
    return {
        "packed, cu_seq_lens": dict(input_ids=row, position_ids=positions, labels=row, **flash),
        "packed, position_ids": dict(input_ids=row, position_ids=positions, labels=row),
        "padded": dict(input_ids=padded, attention_mask=mask, labels=labels),
    }


def step(net, optimizer, inputs: dict):
    """One training step: forward, backward, AdamW."""
    def run():
        optimizer.zero_grad(set_to_none=True)
        net(**inputs).loss.backward()
        optimizer.step()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="about this many real tokens per step")
    parser.add_argument("--min-length", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--seed", type=int, default=0, help="draws the document lengths")
    args = parser.parse_args()
    if not 1 <= args.min_length <= args.max_length:
        parser.error(f"--min-length must be at least 1 and at most --max-length, got {args.min_length}")
    lengths = document_lengths(args.tokens, args.min_length, args.max_length, args.seed)
    vocab = 1000
    net = model(vocab, max(lengths) + 1)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    seconds = compare({name: step(net, optimizer, inputs) for name, inputs in batches(lengths, vocab).items()},
                      rounds=args.rounds, min_run_time=0.0)
    real = sum(lengths)
    print(f"machine: {machine_line()} ({cpu_flags()})")
    print(f"tiny Llama (2 layers, width 256, 4 heads, 2 kv heads) on attnlab, fp32; {len(lengths)} documents, "
          f"{real} tokens (lengths {min(lengths)}..{max(lengths)}); median of {args.rounds} interleaved rounds\n")
    print("| batch | seconds / step | tokens/s | padded / this |")
    print("|---|---|---|---|")
    for name, s in seconds.items():
        print(f"| {name} | {s:.4f} | {real / s:,.0f} | {seconds['padded'] / s:.2f}x |")


if __name__ == "__main__":
    main()
