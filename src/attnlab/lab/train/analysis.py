"""What a trained model's heads do: previous-token and induction scores (:func:`head_scores`),
single-head ablation (:func:`ablate_heads`), and the paragraph naming the heads that do the task
(:func:`summarize`); :func:`analyze` runs them all on a :class:`~attnlab.lab.train.loop.Trainer`.

Example:
    >>> from attnlab.models import GPT
    >>> model = GPT(vocab_size=5, max_len=6, d_model=8, num_layers=2, num_heads=2)
    >>> head_scores(model, torch.tensor([[1, 2, 3, 1, 2, 3]]))["induction"].shape
    torch.Size([2, 2])
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.lab.trained import best_head, count_heads, pad_heads, ROLE_THRESHOLD, sink_shares, unpad_heads
from attnlab.models import GPT
from attnlab.models.gpt import LAYER_KINDS, LAYER_TABLE
from attnlab.lab.train.evaluation import evaluate
from attnlab.lab.train.loop import Trainer


def head_scores(model: GPT, inputs: Tensor) -> dict[str, Tensor]:
    """Per-head ``previous_token``, ``current_token`` and ``induction`` scores ``(L, H)`` on ``inputs`` ``(B, T)``.

    * previous-token: the mean weight a query at ``t >= 1`` puts on position ``t - 1``;
    * current-token: the mean weight a query puts on its own position;
    * induction: over queries ``t`` whose token occurred before at some ``j < t - 1`` (the
      latest such ``j``), the mean weight on ``j + 1`` -- the token that followed it then.

    Also returns ``sink_share`` ``(L, H)``, the mean share of a query's mass that went to no key
    (the sink's, for a model with sinks; 0 within rounding otherwise: :func:`attnlab.lab.trained.sink_shares`),
    and ``weights`` ``(L, H, T, T)``, the attention of the first sequence. When layers
    have different numbers of heads, ``H`` is the largest and the heads a layer lacks are NaN
    (:func:`attnlab.lab.trained.pad_heads`).

    Example:
        >>> model = GPT(vocab_size=5, max_len=6, d_model=8, num_layers=2, num_heads=(2, 1))
        >>> scores = head_scores(model, torch.tensor([[1, 2, 3, 1, 2, 3]]))
        >>> scores["induction"].shape, bool(scores["induction"][1, 1].isnan())
        (torch.Size([2, 2]), True)
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _, weights = model(inputs, return_weights=True)
    finally:
        model.train(was_training)
    target, has = _induction_targets(inputs)  # (B, T)
    per_layer = [_layer_scores(w.float(), target, has) for w in weights]  # L x ((H_l,), (H_l,))
    return {"previous_token": pad_heads([previous for previous, _ in per_layer]),
            "current_token": pad_heads([w.float().diagonal(dim1=-2, dim2=-1).mean(dim=(0, 2)) for w in weights]),
            "induction": pad_heads([induction for _, induction in per_layer]),
            "sink_share": pad_heads([sink_shares(w.float()).mean(dim=(0, 2)) for w in weights]),  # (B, H, T) -> (H,)
            "weights": pad_heads([w[0].float() for w in weights])}


def _layer_scores(weights: Tensor, target: Tensor, has: Tensor) -> tuple[Tensor, Tensor]:
    """Previous-token and induction scores ``(H,)`` of one layer's weights ``(B, H, T, T)``."""
    T = weights.shape[-1]
    t = torch.arange(1, T)
    previous = weights[..., t, t - 1].mean(dim=(0, 2))  # (H,)
    index = target.clamp(min=0)[:, None, :, None].expand(*weights.shape[:-1], 1)  # (B, H, T, 1)
    picked = weights.gather(-1, index)[..., 0]  # (B, H, T): weight on the induction target of each query
    mask = has[:, None, :].float()
    induction = (picked * mask).sum(dim=(0, 2)) / mask.sum().clamp(min=1)  # mask sums over (b, t) only
    return previous, induction


def _induction_targets(inputs: Tensor) -> tuple[Tensor, Tensor]:
    """For each query ``t``: ``j + 1`` for the latest ``j < t - 1`` with the same token; and whether one exists."""
    B, T = inputs.shape
    same = inputs[:, :, None] == inputs[:, None, :]  # (B, Tq, Tk)
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    earlier = same & (k < q - 1)
    latest = torch.where(earlier, k.expand(T, T), torch.full((T, T), -1)).amax(dim=-1)  # (B, T)
    return latest + 1, latest >= 0


def ablate_heads(model: GPT, inputs: Tensor, targets: Tensor) -> Tensor:
    """Held-out accuracy ``(L, H)`` with each head's output zeroed in turn (one at a time).

    A head's context vector occupies features ``[h * head_dim, (h + 1) * head_dim)`` of the
    input of its layer's ``out_proj``; a forward pre-hook zeroes that slice. When layers have
    different numbers of heads, the heads a layer lacks are NaN.

    Example:
        >>> model = GPT(vocab_size=4, max_len=3, d_model=8, num_layers=2, num_heads=(2, 1))
        >>> ablate_heads(model, torch.tensor([[0, 1, 2]]), torch.tensor([[1, 2, -100]])).isnan().tolist()
        [[False, False], [False, True]]
    """
    return pad_heads([torch.tensor([_ablate_group(model, inputs, targets, [(layer, head)]) for head in range(count)])
                      for layer, count in enumerate(model.heads_per_layer)])


def summarize(task: str, accuracy: float, scores: dict[str, Tensor], ablated: Tensor) -> str:
    """One paragraph naming the heads that do the task, with their scores and ablation figures.

    ``ablated`` holds the held-out accuracy *left* when one head's output is zeroed; the paragraph
    says so, beside the full model's accuracy, and says what each head that costs more than 5
    points does, from its scores (``current_token`` is optional: :func:`head_scores` gives it).

    Example:
        >>> scores = {"previous_token": torch.tensor([[0.9, 0.1], [0.2, 0.1]]),
        ...           "induction": torch.tensor([[0.0, 0.1], [0.1, 0.95]])}
        >>> print(summarize("induction", 0.99, scores, torch.tensor([[0.2, 0.98], [0.97, 0.1]])))
        ... # doctest: +NORMALIZE_WHITESPACE
        Held-out accuracy 99.0 %. Layer 1 head 1 is an induction head (induction score 0.95; accuracy
        left without it: 10.0 %). Layer 0 head 0 is a previous-token head (previous-token score 0.90;
        accuracy left without it: 20.0 %). Ablating one head at a time (its output zeroed) and measuring
        the accuracy left, against the full model's 99.0 %: without L0H0 it is 20.0 % (L0H0 is a
        previous-token head, score 0.90: it writes each position's previous token, which the induction
        head's keys are matched on); without L1H1 it is 10.0 % (L1H1 is an induction head, score 0.95: it
        finds the earlier copy of the current token and copies the token that followed it). Every other
        head costs at most 5 points.
    """
    parts = [f"Held-out accuracy {100 * accuracy:.1f} %."]
    induction, previous = scores["induction"], scores["previous_token"]
    layers = induction.shape[0]
    if task in ("induction", "recall") and layers > 1:
        l_ind, h_ind = best_head(induction[1:])
        l_ind += 1  # the induction head is looked for after the first layer
        l_prev, h_prev = best_head(previous[:l_ind])
        parts.append(_named(l_ind, h_ind, "an induction head", "induction", float(induction[l_ind, h_ind]),
                            float(ablated[l_ind, h_ind])))
        parts.append(_named(l_prev, h_prev, "a previous-token head", "previous-token",
                            float(previous[l_prev, h_prev]), float(ablated[l_prev, h_prev])))
    costly = [(l, h) for l, count in enumerate(count_heads(ablated)) for h in range(count)
              if accuracy - float(ablated[l, h]) > 0.05]
    if costly:
        parts.append(f"Ablating one head at a time (its output zeroed) and measuring the accuracy left, against "
                     f"the full model's {100 * accuracy:.1f} %: " + "; ".join(
                         f"without L{l}H{h} it is {100 * float(ablated[l, h]):.1f} % (L{l}H{h} is "
                         f"{_role(l, h, scores)})" for l, h in costly) + "."
                     + (" Every other head costs at most 5 points." if len(costly) < sum(count_heads(ablated)) else ""))
    else:
        parts.append(f"No single head's ablation costs more than 5 points of the full model's {100 * accuracy:.1f} %: "
                     "the task is spread over heads.")
    return " ".join(parts)


def _role(layer: int, head: int, scores: dict[str, Tensor]) -> str:
    """What a head does, read from its scores: induction (after the first layer), previous-token,
    current-token (when ``scores`` has it), or none of them (its scores named)."""
    named = {name: float(scores[name][layer, head]) for name in ("previous_token", "induction", "current_token")
             if name in scores}
    if layer > 0 and named["induction"] >= ROLE_THRESHOLD:
        return (f"an induction head, score {named['induction']:.2f}: it finds the earlier copy of the current token "
                "and copies the token that followed it")
    if named["previous_token"] >= ROLE_THRESHOLD:
        return (f"a previous-token head, score {named['previous_token']:.2f}: it writes each position's previous "
                "token, which the induction head's keys are matched on")
    if named.get("current_token", 0.0) >= ROLE_THRESHOLD:
        return (f"a current-token head, score {named['current_token']:.2f}: it attends to the token itself and "
                "writes it once more into the next layer's input, a copy the later heads evidently read")
    return "none of these roles: " + ", ".join(f"{name.replace('_', '-')} score {value:.2f}"
                                               for name, value in named.items())


def _named(layer: int, head: int, role: str, score_name: str, score: float, ablated: float) -> str:
    """``Layer l head h is <role> (...)`` when its score reaches the role threshold, else that no head is one yet."""
    figures = f"{score_name} score {score:.2f}; accuracy left without it: {100 * ablated:.1f} %"
    if score >= ROLE_THRESHOLD:
        return f"Layer {layer} head {head} is {role} ({figures})."
    return f"No head is {role} yet (the closest, layer {layer} head {head}: {figures})."


def analyze(trainer: Trainer, *, sequences: int = 64) -> dict:
    """Head scores, single-head ablation and the summary of a trained run, as JSON-ready lists.

    ``sequences`` held-out rows give the scores; ablation uses the whole held-out set. The
    heads after the first layer whose induction score is at least 0.5 are also ablated together
    (``induction_heads_ablated``): several heads can share one job, and then zeroing any single
    one of them costs little; the summary then says so, with both figures. A model trained with
    sinks also gets ``heads["sink_share"]``, each head's mean sink share, and a sentence on it.
    A model with differential, gated or sparse layers (they return no weights) gets empty ``heads`` and a
    summary saying why (and :func:`write_figures` draws its curves only).

    Example:
        >>> from attnlab.lab.train import TrainConfig
        >>> run = Trainer(TrainConfig(d_model=8, heads=2, eval_sequences=4))
        >>> sorted(analyze(run)["heads"])
        ['ablation_accuracy', 'induction', 'previous_token']
    """
    inputs, targets = trainer.eval_set()
    silent = [name for name in trainer.model.layer_kinds if not LAYER_TABLE[name].weights]
    if silent:  # differential, gated and sparse layers return no weight matrix to score
        accuracy = trainer.history["eval_accuracy"][-1] if trainer.history["eval_accuracy"] else trainer.evaluate()[1]
        return {"heads": {}, "example": inputs[0], "summary": (
            f"Held-out accuracy {100 * accuracy:.1f} %. No head scores or ablation: the layer_pattern's "
            f"{', '.join(sorted(set(silent)))} layers ({', '.join(LAYER_KINDS[k] for k in sorted(set(silent)))}) "
            "return no single weight matrix.")}
    scores = head_scores(trainer.model, inputs[:sequences])
    ablated = ablate_heads(trainer.model, inputs, targets)
    accuracy = trainer.history["eval_accuracy"][-1] if trainer.history["eval_accuracy"] else trainer.evaluate()[1]
    text = summarize(trainer.config.task, accuracy, scores, ablated)
    result = {"heads": {"previous_token": _rounded(scores["previous_token"]),
                        "induction": _rounded(scores["induction"]), "ablation_accuracy": _rounded(ablated)},
              "summary": text, "weights": scores["weights"], "example": inputs[0]}
    if trainer.config.sinks:
        result["heads"]["sink_share"] = _rounded(scores["sink_share"])
        result["summary"] += " " + _sink_sentence(scores["sink_share"])
    later = torch.nonzero(scores["induction"][1:] >= ROLE_THRESHOLD).tolist()  # (layer - 1, head) rows
    group = [(layer + 1, head) for layer, head in later]
    if group:
        together = _ablate_group(trainer.model, inputs, targets, group)
        names = ", ".join(f"L{l}H{h}" for l, h in group)
        result["induction_heads_ablated"] = {"heads": names, "accuracy": round(together, 4)}
        if len(group) > 1:
            alone = [100 * float(ablated[l, h]) for l, h in group]
            result["summary"] += (f" The {len(group)} heads with induction score >= {ROLE_THRESHOLD} ({names}) share the job: "
                                  f"ablating one alone leaves {min(alone):.1f}-{max(alone):.1f} %, ablating them "
                                  f"together drops accuracy to {100 * together:.1f} %.")
    return result


def _sink_sentence(share: Tensor) -> str:
    """Where the sinks took the most and the least of the mass, from the ``(L, H)`` mean shares.

    Example:
        >>> print(_sink_sentence(torch.tensor([[0.1, 0.6], [0.3, float("nan")]])))
        The sink takes on average 0.60 of a query's attention in layer 0 head 1 (the most) and 0.10 in layer 0 head 0 (the least).
    """
    (lm, hm), (ll, hl) = best_head(share), best_head(-share)
    return (f"The sink takes on average {float(share[lm, hm]):.2f} of a query's attention in layer {lm} head {hm} "
            f"(the most) and {float(share[ll, hl]):.2f} in layer {ll} head {hl} (the least).")


def _rounded(t: Tensor) -> list:
    """An ``(L, H)`` table as JSON-ready lists, one per layer with that layer's heads (never NaN)."""
    return [[round(float(v), 4) for v in row] for row in unpad_heads(t)]


def _ablate_group(model: GPT, inputs: Tensor, targets: Tensor, heads: list[tuple[int, int]]) -> float:
    """Held-out accuracy with all ``heads`` ``(layer, head)`` zeroed at once."""
    handles = []
    for layer, head in heads:
        attn = model.blocks[layer].attn  # a latent layer's heads give value_dim features each, not head_dim
        head_dim = attn.out_proj.in_features // attn.num_heads

        def zero_head(module, args, lo=head * head_dim, hi=(head + 1) * head_dim):
            x = args[0].clone()
            x[..., lo:hi] = 0
            return (x,)

        handles.append(model.blocks[layer].attn.out_proj.register_forward_pre_hook(zero_head))
    try:
        return evaluate(model, inputs, targets)[1]
    finally:
        for handle in handles:
            handle.remove()
