"""The wording of what the transformers integration refuses, shared by its modules.

Example:
    >>> str(refusal("BloomForCausalLM", "it computes attention in its own layers"))
    'BloomForCausalLM cannot run on attnlab: it computes attention in its own layers'
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["REFUSAL", "IGNORED_KEYWORDS", "refusal", "describe"]

# The phrase every refusal of a model or a keyword carries (attnlab.lab.lens matches it).
REFUSAL = "cannot run on attnlab"

# Keywords that change nothing in transformers' eager and sdpa attention: positions (already
# rotated into q and k), cache bookkeeping, what the model returns, flash/flex-only kernel options.
IGNORED_KEYWORDS = (
    "cache_position", "use_cache", "past_key_values", "past_key_value", "cache",
    "output_hidden_states", "output_router_logits", "return_dict", "num_items_in_batch",
    "max_length_q", "max_length_k", "seq_idx", "deterministic", "kernel_options",
    "do_sample", "input_ids",  # a generation option (DiffusionGemma), token ids (GLM-5-Next) let through to layers
    "logits_to_keep", "decoder_input_ids",  # what to return (LLaVA-OneVision), token ids (Whisper's decoder)
)


def refusal(subject: str, reason: str) -> ValueError:
    """The one wording of a refused model or keyword."""
    return ValueError(f"{subject} {REFUSAL}: {reason}")


def describe(value: object) -> str:
    """A short description of a keyword's value for a message (a tensor's shape, never its data)."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value) if isinstance(value, (bool, int, float, str)) else type(value).__name__
