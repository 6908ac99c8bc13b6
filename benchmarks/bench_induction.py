"""Does attention learn the task on this CPU, how fast, and which heads do it?

Trains what ``attnlab train`` trains with its defaults (the same library code, one thread) and
prints, per run: held-out accuracy, training seconds and wall seconds, the strongest
previous-token head (layer 0), the strongest induction head (layer 1) and the accuracy with
that head ablated. Runs:

* ``induction``: the default (2 layers, attention-only): target >= 99 % in under 2 minutes,
  induction score >= 0.8, previous-token score >= 0.8, ablating the induction head < 30 %;
* ``induction --layers 1``: the one-layer control, which should stay far below;
* ``recall``: multi-query associative recall at its default size: target >= 95 % in 3 minutes.

Usage:
    python benchmarks/bench_induction.py                    # all three
    python benchmarks/bench_induction.py --runs induction --extra-heads 4
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from attnlab.bench.timing import machine_line
from attnlab.train import TrainConfig, Trainer, analyze

RUNS = {"induction": dict(task="induction"), "control": dict(task="induction", layers=1),
        "recall": dict(task="recall")}


def run(name: str, options: dict, seed: int) -> None:
    start = time.perf_counter()
    trainer = Trainer(TrainConfig(seed=seed, **options))
    result = trainer.train()
    wall = time.perf_counter() - start
    analysis = analyze(trainer)
    heads = analysis["heads"]
    m = result.metrics
    print(f"\n== {name}: {options} seed {seed}")
    print(f"   held-out accuracy {100 * m['accuracy']:.2f} % (loss {m['loss']:.4f}) after {m['steps']} steps; "
          f"{m['seconds']:.1f} s training, {wall:.1f} s wall incl. evaluation; {m['tokens_per_second']:,.0f} tokens/s")
    first = heads["previous_token"][0]
    best_prev = max(range(len(first)), key=first.__getitem__)
    print(f"   strongest previous-token head: L0H{best_prev} score {first[best_prev]:.3f}")
    if len(heads["induction"]) > 1:
        second = heads["induction"][1]
        best_ind = max(range(len(second)), key=second.__getitem__)
        print(f"   strongest induction head: L1H{best_ind} score {second[best_ind]:.3f}; ablated accuracy "
              f"{100 * heads['ablation_accuracy'][1][best_ind]:.2f} %")
    print(f"   per-head previous-token {heads['previous_token']}")
    print(f"   per-head induction      {heads['induction']}")
    print(f"   per-head ablated acc.   {heads['ablation_accuracy']}")
    print(f"   summary: {analysis['summary']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--extra-heads", type=int, default=None, help="also run induction with this many heads")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    print(f"threads {args.threads}; load average at start {os.getloadavg()[0]:.2f}")
    runs = [(name, RUNS[name]) for name in args.runs]
    if args.extra_heads:
        runs.append((f"induction --heads {args.extra_heads}", dict(task="induction", heads=args.extra_heads)))
    for seed in args.seeds:
        for name, options in runs:
            run(name, options, seed)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
