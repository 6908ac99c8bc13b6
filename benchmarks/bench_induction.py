"""Does attention learn the task on this CPU, how fast, and which heads do it?

Trains what ``attnlab train`` trains with its defaults (the same library code, one thread) and
prints, per run: held-out accuracy, training seconds and wall seconds, the previous-token head
and the induction head the summary names with their scores, the accuracy with the named
induction head ablated alone, and with every later-layer head of induction score >= 0.5
ablated together. Runs:

* ``induction``: the default (2 layers of 2 and 1 heads, attention-only): target >= 99 % in under
  2 minutes, induction score >= 0.8, previous-token score >= 0.8, ablating the named induction
  head < 30 %;
* ``control``: ``induction --layers 1`` (one layer of 2 heads), which should stay far below;
* ``recall``: multi-query associative recall at its default size: target >= 95 % in 3 minutes.

Each run ends with one line per target saying whether it was met.

Usage:
    python benchmarks/bench_induction.py                    # all three
    python benchmarks/bench_induction.py --runs induction --extra-heads 2,2 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from attnlab.lab.bench.timing import machine_line
from attnlab.lab.train import TrainConfig, Trainer, analyze

RUNS = {"induction": dict(task="induction"), "control": dict(task="induction", layers=1),
        "recall": dict(task="recall")}


def _best(rows: list[list[float]], layers: range) -> tuple[int, int, float]:
    """``(layer, head, score)`` of the highest score among ``layers`` (rows: each layer's heads)."""
    return max(((l, h, rows[l][h]) for l in layers for h in range(len(rows[l]))), key=lambda x: x[2])


def run(name: str, options: dict, seed: int) -> None:
    start = time.perf_counter()
    trainer = Trainer(TrainConfig(seed=seed, **options))
    result = trainer.train()
    wall = time.perf_counter() - start
    analysis = analyze(trainer)
    heads, m = analysis["heads"], result.metrics
    print(f"\n== {name}: {options} seed {seed}; heads per layer {trainer.model.heads_per_layer}")
    print(f"   held-out accuracy {100 * m['accuracy']:.2f} % (loss {m['loss']:.4f}) after {m['steps']} steps; "
          f"{m['seconds']:.1f} s training, {wall:.1f} s wall incl. evaluation and analysis; "
          f"{m['tokens_per_second']:,.0f} tokens/s")
    print(f"   per-head previous-token {heads['previous_token']}")
    print(f"   per-head induction      {heads['induction']}")
    print(f"   per-head ablated acc.   {heads['ablation_accuracy']}")
    print(f"   summary: {analysis['summary']}")
    checks = {}
    if name != "control" and len(heads["induction"]) > 1:
        layers = len(heads["induction"])
        li, hi, induction = _best(heads["induction"], range(1, layers))
        lp, hp, previous = _best(heads["previous_token"], range(li))
        single = heads["ablation_accuracy"][li][hi]
        print(f"   previous-token head L{lp}H{hp} {previous:.3f}; induction head L{li}H{hi} {induction:.3f}")
        print(f"   ablated: L{li}H{hi} alone {100 * single:.2f} %", end="")
        group = analysis.get("induction_heads_ablated")
        print(f"; the heads of induction score >= 0.5 ({group['heads']}) together {100 * group['accuracy']:.2f} %"
              if group else "; no head of induction score >= 0.5")
        if options["task"] == "induction":  # the circuit targets are the induction task's
            checks.update({"previous-token score >= 0.8": previous >= 0.8, "induction score >= 0.8": induction >= 0.8,
                           "ablating the named induction head < 30 %": single < 0.3})
    target, budget = (0.95, 180) if options["task"] == "recall" else (0.99, 120)
    if name != "control":
        checks[f"accuracy >= {100 * target:.0f} % in under {budget} s"] = m["accuracy"] >= target and m["seconds"] < budget
    for check, met in checks.items():
        print(f"   target {check}: {'met' if met else 'MISSED'}")


def _heads(text: str) -> int | tuple[int, ...]:
    counts = tuple(int(part) for part in text.split(","))
    return counts[0] if len(counts) == 1 else counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--extra-heads", type=_heads, default=None,
                        help="also run induction with these heads: one count (2) or one per layer (2,2)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    print(f"threads {args.threads}; load average at start {os.getloadavg()[0]:.2f}")
    runs = [(name, RUNS[name]) for name in args.runs]
    if args.extra_heads:
        shown = ",".join(map(str, args.extra_heads)) if isinstance(args.extra_heads, tuple) else args.extra_heads
        runs.append((f"induction --heads {shown}", dict(task="induction", heads=args.extra_heads)))
    for seed in args.seeds:
        for name, options in runs:
            run(name, options, seed)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
