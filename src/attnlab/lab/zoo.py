"""The transformers zoo: every model family of the installed transformers, on attnlab and on eager.

A family is one ``model_type`` of transformers' ``CONFIG_MAPPING``. Its modeling source is read
first: a family whose attention never goes through transformers' attention interface
(``ALL_ATTENTION_FUNCTIONS``) cannot run on attnlab and is *not applicable*. Every other family is
built tiny from its own config class (2 layers, width 64, 4 heads, vocabulary 128, 32-pixel
images; nothing is downloaded), twice with the same weights: once with ``attn_implementation=
"eager"`` and once with attnlab's registered name. Both see the same inputs, in float32, and each check
compares them:

* ``forward``: an unpadded batch; every output tensor (caches aside);
* ``right-padded`` / ``left-padded``: a text batch whose second row is padded; the outputs of
  real tokens only (a padded query has nothing it may attend: eager spreads it uniformly,
  attnlab returns a zero row, and neither is meaningful);
* ``generate``: greedy decoding of 4 tokens (causal and sequence-to-sequence LMs), through the
  model's cache: the tokens and each step's scores;
* ``gradients``: every parameter's gradient of a fixed random projection of the outputs;
* ``attentions``: ``output_attentions=True``, every layer's weights.

A check passes when its largest difference, divided by ``max(1, largest |eager value|)``
(gradients: by their largest value), is at most ``tolerance`` (1e-4). A family is then
``equal``; ``different`` when a check is over it; ``refused`` when the attnlab run raised a
``ValueError``/``TypeError``/``NotImplementedError`` from attnlab itself, or transformers would
not build the model with attnlab's implementation; ``crashed`` for any
other error of the attnlab run (or the time limit); ``not applicable`` when the family does not
route attention through the interface, cannot be built tiny, its eager model fails on the zoo's
inputs, or no attention call reached the interface. Each family runs on its own: an exception
never stops the sweep.

Example:
    >>> from attnlab.lab import zoo
    >>> result = zoo.run_family("bloom")
    >>> result.status, result.reason[:38]
    ('not applicable', 'modeling_bloom.py does not route atten')
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import re
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from torch import Tensor
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES, model_type_to_module_name

from attnlab.integrations.transformers import DEFAULT_NAME, register

__all__ = ["FamilyResult", "STATUSES", "families", "routes_attention", "tiny_config", "run_family",
           "counts", "markdown_table", "TOLERANCE"]

STATUSES = ("equal", "refused", "not applicable", "different", "crashed")
TOLERANCE = 1e-4
BATCH, TOKENS, DECODER_TOKENS, NEW_TOKENS = 2, 7, 5, 4
MAX_ELEMENTS = 20_000_000  # parameters and buffers of one tiny model, at most
PADS = 3  # the padded row has TOKENS - PADS real tokens
_LIBRARY = Path(__file__).resolve().parents[1]  # attnlab's own source (src/attnlab): where a refusal is raised
_MODELS_DIR = Path(transformers.__file__).parent / "models"
_ROUTES = ("ALL_ATTENTION_FUNCTIONS", "attention_interface(")

# Config fields made small, each to at most this value (ints only; a smaller default is kept).
_SMALL = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "word_embed_proj_dim"), 64),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("head_dim", "d_kv", "kv_channels", "attention_head_dim", "v_head_dim"), 16),
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,  # MLA: queries and keys wider than values (16)
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 32),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner",
                     "ffn_hidden_size"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
                     "num_decoder_layers", "num_encoder_layers"), 2),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token"), 2),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_target_positions"), 128),
    "vocab_size": 128, "image_size": 32, "patch_size": 8, "sliding_window": 4, "max_source_positions": 16,
    "first_k_dense_replace": 1, "topk_group": 1, **dict.fromkeys(("n_group", "num_expert_group"), 1),
    "attention_chunk_size": 4,  # Llama 4's chunked layers: a chunk shorter than the test's inputs
    "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16,  # Gemma 3n/4's per-layer embeddings
    "out_hidden_size": 64, "projection_intermediate_size": 128,  # a vision tower's projection into the text width
    **dict.fromkeys(("index_head_dim", "linear_head_dim"), 16), "linear_num_heads": 4,  # GLM-5-Next's indexer, KDA
}
# Per-layer lists cut as layer_types is (each distinct value first), so a cut model keeps every kind:
# Llama 4's no_rope_layers marks its NoPE layers, which must stay beside its chunked ones.
_PER_LAYER_KINDS = ("layer_types", "no_rope_layers")
_WIDE_OUTPUT = ("past_key_values", "cache")  # output fields never compared (they hold padded slots)


@dataclass
class FamilyResult:
    """One family's outcome: ``status`` (one of :data:`STATUSES`), why, and each check's difference.

    ``checks`` maps each check that ran to its scaled largest difference (``inf`` for tokens or
    structures that differ); ``reason`` is empty for ``equal``, else the refusal's text, the
    last line of a traceback, or why the family is not applicable. ``sdpa_checks`` holds, for a
    different family, the same checks run with transformers' own sdpa against eager.

    Example:
        >>> FamilyResult("llama", "equal", checks={"forward": 1e-15}).to_dict()["status"]
        'equal'
    """

    family: str
    status: str
    reason: str = ""
    checks: dict[str, float] = field(default_factory=dict)
    model_class: str = ""
    dtype: str = ""
    calls: int = 0
    seconds: float = 0.0
    sdpa_checks: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The result as plain JSON values (``inf`` as the string ``"inf"``)."""
        out = asdict(self)
        for key in ("checks", "sdpa_checks"):
            out[key] = {k: (v if math.isfinite(v) else str(v)) for k, v in out[key].items()}
        return out


class _Refused(Exception):
    """The attnlab run raised a clear refusal."""


class _TimedOut(BaseException):  # passes every `except Exception` on its way out
    """The family ran past its time limit."""


class _NotApplicable(Exception):
    """The family cannot be checked (the message says why)."""


# ------------------------------------------------------------------ discovery
def families() -> list[str]:
    """Every model family (``model_type``) of the installed transformers, sorted.

    Example:
        >>> {"llama", "bert", "t5"} <= set(families())
        True
    """
    return sorted(CONFIG_MAPPING_NAMES)


def routes_attention(family: str) -> str | None:
    """None when ``family``'s modeling code calls the attention interface, else why not.

    Example:
        >>> routes_attention("llama") is None, routes_attention("bloom")[:14]
        (True, 'modeling_bloom')
    """
    module = model_type_to_module_name(family)
    path = _MODELS_DIR / module / f"modeling_{module}.py"
    if not path.exists():
        return f"no modeling_{module}.py (a configuration-only or composite family)"
    if any(marker in path.read_text() for marker in _ROUTES):
        return None
    composite = bool(getattr(CONFIG_MAPPING[family], "sub_configs", None))
    return (f"modeling_{module}.py does not route attention through the attention interface"
            + (" (its sub-models are checked as their own families)" if composite else ""))


# ------------------------------------------------------------------ tiny configs
def tiny_config(family: str):
    """``family``'s config class with every size made small (see the module) and layer lists cut.

    Example:
        >>> config = tiny_config("llama")
        >>> config.hidden_size, config.num_hidden_layers, config.num_key_value_heads
        (64, 2, 2)
    """
    config_class = CONFIG_MAPPING[family]
    return config_class(**_small_fields(config_class()))


def model_config(cls, family: str):
    """The tiny config ``cls`` is built from: the family's own, or the part of a composite config
    the class takes (``Qwen3_5ForCausalLM`` takes ``Qwen3_5Config``'s ``text_config``).

    Example:
        >>> from transformers import Qwen3_5ForCausalLM
        >>> type(model_config(Qwen3_5ForCausalLM, "qwen3_5")).__name__
        'Qwen3_5TextConfig'
    """
    config = tiny_config(family)
    wanted = getattr(cls, "config_class", None)
    if not isinstance(wanted, type) or isinstance(config, wanted):
        return config
    parts = [getattr(config, key, None) for key in getattr(config, "sub_configs", {}) or {}]
    return next((part for part in parts if isinstance(part, wanted)), _text_config(config))


def _small_fields(config) -> dict:
    """The fields of ``config`` to override (sub-configs as whole dicts), sizes made small."""
    values = config.to_dict()
    changed = {}
    for key, value in values.items():
        if key in _SMALL and isinstance(value, int) and not isinstance(value, bool) and value > _SMALL[key]:
            changed[key] = _SMALL[key]
        elif key in ("image_size", "patch_size") and isinstance(value, (list, tuple)) and value \
                and all(isinstance(v, int) for v in value) and max(value) > _SMALL[key]:
            changed[key] = type(value)(min(v, _SMALL[key]) for v in value)
    if isinstance(values.get("qk_rope_head_dim"), int) and "head_dim" in values:
        changed["head_dim"] = changed.get("qk_rope_head_dim", values["qk_rope_head_dim"])  # MLA: rope's width
    if "kv_lora_rank" in values and isinstance(values.get("num_key_value_heads"), int):
        changed["num_key_value_heads"] = changed.get("num_attention_heads", values.get("num_attention_heads"))  # MLA
    vocab = changed.get("vocab_size", values.get("vocab_size"))
    if isinstance(vocab, int):
        changed.update(_token_ids(values, vocab))
    layers = _layer_count(values, changed)
    if layers is not None:
        changed.update(_cut_layers(values, *layers))
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            changed[key] = {**sub.to_dict(), **_small_fields(sub)}
    return changed


_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _layer_count(values: dict, changed: dict) -> tuple[int, int] | None:
    for key in _LAYER_COUNTS:
        if key in changed and isinstance(values.get(key), int):
            return values[key], changed[key]
    return None


def _cut_layers(values: dict, old: int, new: int) -> dict:
    """The per-layer fields of a config cut from ``old`` layers to the layers :func:`_kept_layers` keeps."""
    kinds = next((values[key] for key in _PER_LAYER_KINDS
                  if isinstance(values.get(key), list) and len(values[key]) == old), None)
    kept, shared = _kept_layers(kinds, old, new, sharing=bool(values.get("num_kv_shared_layers")))
    changed = {key: [value[i] for i in kept] for key, value in values.items()
               if isinstance(value, list) and len(value) == old > len(kept)}
    if len(kept) != new:
        changed.update({key: len(kept) for key in _LAYER_COUNTS if isinstance(values.get(key), int)})
    if shared is not None:
        changed["num_kv_shared_layers"] = shared
    per_layer = values.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer:  # Gemma 4: {"05": {...}} by layer index, renumbered
        width = len(next(iter(per_layer)))
        changed["per_layer_config"] = {f"{i:0{width}d}": per_layer[f"{old_i:0{width}d}"]
                                       for i, old_i in enumerate(kept) if f"{old_i:0{width}d}" in per_layer}
    return changed


def _kept_layers(kinds: list | None, old: int, new: int, *, sharing: bool = False) -> tuple[list[int], int | None]:
    """The old indices of the layers a cut model keeps, and its count of KV-sharing layers (None: unchanged).

    Each distinct layer kind first (a cut Gemma 3 keeps a full layer; a cut LFM keeps its attention
    beside its convolutions, even past ``new`` layers), then the first layers. A model whose last
    layers read earlier layers' KV (Gemma 3n's ``num_kv_shared_layers``) keeps one layer of each kind
    and one more of each kind after them, the latter sharing.

    Example:
        >>> _kept_layers(["sliding", "sliding", "full", "sliding"], 4, 2)
        ([0, 2], None)
    """
    if kinds is None:
        return list(range(new)), None
    firsts = [kinds.index(kind) for kind in dict.fromkeys(kinds)]
    if sharing:
        seconds = [next((j for j in range(i + 1, old) if kinds[j] == kinds[i]), None) for i in firsts]
        if None not in seconds:
            return firsts + seconds, len(seconds)
    return firsts + list(range(max(0, new - len(firsts)))), None


def _token_ids(values: dict, vocab: int) -> dict:
    """Special token ids at or above a shrunk vocabulary, moved to its top (distinct ids)."""
    free = iter(range(vocab - 1, vocab // 2, -1))
    moved: dict[int, int] = {}
    out = {}
    for key, value in values.items():
        if not (key.endswith("_token_id") or key.endswith("_token_index") or key.endswith("_token_ids")):
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or all(i < vocab for i in ids):
            continue
        new = [i if i < vocab else moved.setdefault(i, next(free)) for i in ids]
        out[key] = new if isinstance(value, list) else new[0]
    return out


# ------------------------------------------------------------------ building
def _check_size(cls, family: str) -> None:
    """:class:`_NotApplicable` when the tiny model would still be large (sized on the meta device,
    before anything is allocated: the machine may be shared)."""
    with torch.device("meta"):
        probe = cls._from_config(model_config(cls, family), attn_implementation="eager")
    size = sum(t.numel() for t in itertools.chain(probe.parameters(), probe.buffers()))
    if size > MAX_ELEMENTS:
        raise _NotApplicable(f"{size / 1e6:.0f}M parameters and buffers after shrinking its config "
                             f"(sizes the zoo does not know how to shrink)")


def _model_class(family: str):
    """The class to build and whether it generates: a sequence-to-sequence LM, text or speech (encoder,
    decoder and cross-attention: BART's is built whole, not as BartForCausalLM), else a causal LM, else the base
    model, else the first class any auto mapping gives the family (a sub-model's family)."""
    preferred = ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
                 "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES")
    others = sorted(n for n in vars(modeling_auto) if n.endswith("_MAPPING_NAMES") and n not in preferred)
    for mapping in (*preferred, *others):
        table = getattr(modeling_auto, mapping)
        name = table.get(family) if isinstance(table, dict) else None
        if isinstance(name, (list, tuple)):
            name = name[0]
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls, mapping in preferred[:3]
    raise _NotApplicable("no model class in transformers' auto mappings")


def _build(cls, config, implementation: str, dtype: torch.dtype):
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation=implementation)
    return model.to(dtype).eval()


# ------------------------------------------------------------------ inputs
def _inputs(model, config, *, padding: str | None, dtype: torch.dtype,
            images: bool = False) -> tuple[dict, Tensor | None]:
    """The keyword inputs of one batch and the ``(B, T)`` bool mask of real tokens (None: all real);
    ``images`` adds ``pixel_values`` to a text model's inputs (a dual encoder such as CLIP)."""
    g = torch.Generator().manual_seed(1)
    name = model.main_input_name
    inputs: dict = {}
    real = None
    if name == "input_ids":
        text = _text_config(config)
        vocab = int(getattr(text, "vocab_size", 0) or 0)
        if vocab < 8:
            raise _NotApplicable(f"no usable vocab_size ({vocab})")
        inputs["input_ids"] = torch.randint(3, min(vocab, 100), (BATCH, TOKENS), generator=g)
        real = torch.ones(BATCH, TOKENS, dtype=torch.bool)
        if padding == "right":
            real[1, TOKENS - PADS:] = False
        elif padding == "left":
            real[1, :PADS] = False
        inputs["attention_mask"] = real.long()
        if padding is None:
            real = None
    elif name == "pixel_values":
        inputs["pixel_values"] = _pixels(config, dtype, g)
    elif name == "input_features":
        audio = _sub(config, "audio_config")
        if hasattr(audio, "num_mel_bins") and hasattr(audio, "max_source_positions"):
            shape = (BATCH, audio.num_mel_bins, 2 * audio.max_source_positions)
        elif hasattr(audio, "input_feat_per_channel"):
            shape = (BATCH, 32, audio.input_feat_per_channel * getattr(audio, "input_channels", 1))
        else:
            raise _NotApplicable("input_features of an unknown layout")
        inputs["input_features"] = torch.randn(*shape, generator=g, dtype=dtype)
    elif name == "input_values":
        inputs["input_values"] = torch.randn(BATCH, 1600, generator=g, dtype=dtype)
    else:
        raise _NotApplicable(f"main input {name!r} is not one the zoo makes")
    if images and name != "pixel_values":
        inputs["pixel_values"] = _pixels(config, dtype, g)
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.randint(3, 100, (BATCH, DECODER_TOKENS), generator=g)
    return inputs, real


def _pixels(config, dtype: torch.dtype, g: torch.Generator) -> Tensor:
    """A random image batch ``(B, C, S, S)`` of the (vision) config's size."""
    vision = _sub(config, "vision_config")
    size = getattr(vision, "image_size", 32)
    size = size[0] if isinstance(size, (list, tuple)) else size
    if isinstance(size, dict):
        size = size.get("height", 32)
    channels = getattr(vision, "num_channels", 3)
    return torch.randn(BATCH, channels, size, size, generator=g, dtype=dtype)


def _images_variant(eager, dtype: torch.dtype) -> bool:
    """Whether the inputs carry images besides text: with, when the eager model takes
    ``pixel_values`` and runs with them, else without; :class:`_NotApplicable` when neither runs."""
    variants = [False]
    if eager.main_input_name != "pixel_values" and "pixel_values" in inspect.signature(eager.forward).parameters \
            and getattr(eager.config, "vision_config", None) is not None:
        variants.insert(0, True)
    failure: Exception | None = None
    for images in variants:
        try:
            with torch.no_grad():
                _tensors(eager(**_inputs(eager, eager.config, padding=None, dtype=dtype, images=images)[0]))
            return images
        except _NotApplicable:
            raise
        except Exception as exc:  # noqa: BLE001
            failure = failure or exc
    raise _NotApplicable(f"eager fails on the zoo's inputs: {_last_line(failure)}")


def _sub(config, key: str):
    return getattr(config, key, None) or config


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


# ------------------------------------------------------------------ comparing
def _tensors(output, prefix: str = "") -> dict[str, Tensor]:
    """Every floating tensor of a model output, by dotted field name (caches left out)."""
    found: dict[str, Tensor] = {}
    if isinstance(output, Tensor):
        if output.is_floating_point():
            found[prefix or "output"] = output
    elif isinstance(output, dict):
        for key, value in output.items():
            if not any(word in str(key) for word in _WIDE_OUTPUT):
                found.update(_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(output, (list, tuple)):
        for i, value in enumerate(output):
            found.update(_tensors(value, f"{prefix}.{i}"))
    return found


def _difference(ref: dict[str, Tensor], got: dict[str, Tensor], real: Tensor | None, *,
                relative: bool = False, decoder: bool = False) -> float:
    """Largest scaled difference over matching fields; ``inf`` when names or shapes differ.

    With ``real`` (B, T), only tensors of shape ``(B, T, ...)`` are compared, at real tokens,
    and with ``decoder`` those of shape ``(B, DECODER_TOKENS, ...)`` too, whole (an unpadded
    decoder reading a padded encoder).
    """
    if ref.keys() != got.keys():
        return math.inf
    worst, scale = 0.0, 0.0
    for key, a in ref.items():
        b = got[key]
        if a.shape != b.shape:
            return math.inf
        if real is not None:
            if tuple(a.shape[:2]) == tuple(real.shape):
                a, b = a[real], b[real]  # (real tokens, ...)
            elif not (decoder and tuple(a.shape[:2]) == (BATCH, DECODER_TOKENS)):
                continue
        if a.numel() == 0:
            continue
        a, b = a.double(), b.double()
        same = (a == b) | (a.isnan() & b.isnan())  # equal infinities (a blocked token's score) too
        diff = torch.where(same, 0.0, (a - b).abs())
        worst = max(worst, diff.nan_to_num(math.inf).max().item())
        finite = a[a.isfinite()]
        scale = max(scale, finite.abs().max().item() if finite.numel() else 0.0)
    return worst / (max(scale, 1e-30) if relative else max(1.0, scale))


# ------------------------------------------------------------------ one family
@contextlib.contextmanager
def _counting(implementation: str) -> Iterator[list[int]]:
    """Count the calls of ``implementation``'s attention function while the block runs."""
    mapping = transformers.AttentionInterface._global_mapping
    inner = mapping[implementation]
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    mapping[implementation] = counted
    try:
        yield calls
    finally:
        mapping[implementation] = inner


@contextlib.contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`_TimedOut` after ``seconds`` (main thread on Unix only; elsewhere no limit)."""
    usable = seconds and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def stop(signum, frame):
        raise _TimedOut(f"timed out after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_family(family: str, *, implementation: str = DEFAULT_NAME, tolerance: float = TOLERANCE,
               time_limit: float | None = 300.0) -> FamilyResult:
    """Check one family on ``implementation`` against eager (see the module); never raises for the
    family's own failures.

    Args:
        family: a ``model_type`` of :func:`families`.
        implementation: a registered attention implementation; attnlab's default name is
            registered here first.
        tolerance: the largest scaled difference a check may show.
        time_limit: seconds before the family counts as crashed (None: no limit).

    Example:
        >>> result = run_family("llama")
        >>> result.status, sorted(result.checks)[:3]
        ('equal', ['attentions', 'forward', 'generate'])
    """
    if implementation == DEFAULT_NAME:
        register(DEFAULT_NAME)
    start = time.perf_counter()
    result = FamilyResult(family, "equal")
    try:
        why = routes_attention(family)
        if why is not None:
            raise _NotApplicable(why)
        with _time_limit(time_limit), warnings.catch_warnings(), _quiet():
            warnings.simplefilter("ignore")
            _check_family(result, implementation, tolerance)
    except _NotApplicable as exc:
        result.status, result.reason = "not applicable", str(exc)
    except _Refused as exc:
        result.status, result.reason = "refused", str(exc)
    except _TimedOut as exc:  # before eager finished (``dtype`` unset), the limit is the zoo's, not attnlab's
        result.status = "crashed" if result.dtype else "not applicable"
        result.reason = str(exc) if result.dtype else f"the eager model alone {exc}"
    except Exception as exc:  # noqa: BLE001 - one family's failure must never stop the sweep
        result.status, result.reason = "crashed", _last_line(exc)
    result.seconds = round(time.perf_counter() - start, 3)
    return result


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)


def _check_family(result: FamilyResult, implementation: str, tolerance: float) -> None:
    dtype = torch.float32  # eager's float64 path is no oracle: several families mask with float64's
    # minimum and take the softmax in float32, where it is -inf, and padded rows turn to NaN
    try:
        cls, generates = _model_class(result.family)
        result.model_class = cls.__name__
        _check_size(cls, result.family)
        eager = _build(cls, model_config(cls, result.family), "eager", dtype)
        images = _images_variant(eager, dtype)
    except _NotApplicable:
        raise
    except _TimedOut as exc:
        raise _NotApplicable(f"the eager model alone {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the eager side failing is the zoo's limit, not a bug
        raise _NotApplicable(f"cannot be built tiny from its config: {_last_line(exc)}") from None
    result.dtype = str(dtype).replace("torch.", "")
    try:
        ours = _build(cls, model_config(cls, result.family), implementation, dtype)
    except Exception as exc:  # noqa: BLE001
        raise _Refused(f"transformers refused the implementation: {_last_line(exc)}") from None
    ours.load_state_dict(eager.state_dict())
    with _counting(implementation) as calls:
        for check in _CHECKS:
            diff = _run_check(check, eager, ours, generates=generates, dtype=dtype, images=images)
            if diff is not None:
                result.checks[check] = diff
    result.calls = calls[0]
    if calls[0] == 0:
        raise _NotApplicable("no attention call reached the attention interface")
    over = {k: v for k, v in result.checks.items() if not v <= tolerance}
    if over:
        result.status = "different"
        result.reason = "; ".join(f"{k} {v:.1e}" for k, v in over.items())
        result.sdpa_checks = _same_checks_on_sdpa(cls, result.family, eager, list(over), generates, dtype, images)
        if result.sdpa_checks and all(not v <= tolerance for v in result.sdpa_checks.values()):
            result.reason += " (transformers' sdpa differs from eager as well)"


def _same_checks_on_sdpa(cls, family: str, eager, checks: list[str], generates: bool, dtype: torch.dtype,
                         images: bool) -> dict[str, float]:
    """``checks`` rerun with transformers' own sdpa against eager: a difference sdpa shares comes
    from transformers' path (a dropped mask, ``is_causal``), not from attnlab's kernels."""
    try:
        sdpa = _build(cls, model_config(cls, family), "sdpa", dtype)
        sdpa.load_state_dict(eager.state_dict())
        found = {c: _run_check(c, eager, sdpa, generates=generates, dtype=dtype, images=images)
                 for c in checks if c != "attentions"}  # sdpa returns no weights
    except Exception:  # noqa: BLE001 - sdpa not offered for this family: nothing to say
        return {}
    return {c: d for c, d in found.items() if d is not None}


_CHECKS = ("forward", "right-padded", "left-padded", "generate", "gradients", "attentions")


def _run_check(check: str, eager, ours, *, generates: bool, dtype: torch.dtype, images: bool) -> float | None:
    """``check``'s scaled difference, or None when it does not apply or eager itself fails."""
    padding = {"right-padded": "right", "left-padded": "left"}.get(check)
    try:
        inputs, real = _inputs(eager, eager.config, padding=padding, dtype=dtype, images=images)
    except _NotApplicable:
        return None
    if padding is not None and real is None:
        return None  # not a text model: nothing to pad
    if check == "generate" and not generates:
        return None
    step = {"generate": _generate, "gradients": _gradients, "attentions": _attentions}.get(check, _forward)
    try:
        with torch.no_grad() if check != "gradients" else contextlib.nullcontext():
            torch.manual_seed(3)  # models that draw in eval (ViTMAE's masking noise) draw alike
            reference = step(eager, inputs)
    except Exception:  # noqa: BLE001 - eager cannot do this check on these inputs
        return None
    try:
        with torch.no_grad() if check != "gradients" else contextlib.nullcontext():
            torch.manual_seed(3)
            mine = step(ours, inputs)
    except (_TimedOut, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, (ValueError, TypeError, NotImplementedError)) and _raised_by_attnlab(exc):
            raise _Refused(f"{check}: {type(exc).__name__}: {_one_line(str(exc))}") from None
        raise RuntimeError(f"{check}: {_last_line(exc)}") from None
    if check == "generate":
        (ref_tokens, ref_scores), (my_tokens, my_scores) = reference, mine
        if not torch.equal(ref_tokens, my_tokens):
            return math.inf
        return _difference(ref_scores, my_scores, None)
    if not reference:
        return None  # eager returned nothing to compare (no weights)
    return _difference(reference, mine, real if padding else None, relative=check == "gradients",
                       decoder=bool(getattr(eager.config, "is_encoder_decoder", False)))


def _forward(model, inputs: dict) -> dict[str, Tensor]:
    return _tensors(model(**inputs))


def _attentions(model, inputs: dict) -> dict[str, Tensor]:
    return {k: v for k, v in _tensors(model(**inputs, output_attentions=True)).items() if "attentions" in k}


def _gradients(model, inputs: dict) -> dict[str, Tensor]:
    model.zero_grad(set_to_none=True)
    outputs = _tensors(model(**inputs))
    g = torch.Generator().manual_seed(2)
    loss = sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum() for t in outputs.values())
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _generate(model, inputs: dict) -> tuple[Tensor, dict[str, Tensor]]:
    inputs = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
    if "attention_mask" in inputs and not model.config.is_encoder_decoder:  # decoders pad on the left
        mask = torch.ones_like(inputs["attention_mask"])
        mask[1, :PADS] = 0
        inputs["attention_mask"] = mask
    if model.config.is_encoder_decoder:  # a random config may name no start token
        start = model.generation_config.decoder_start_token_id
        inputs["decoder_start_token_id"] = 0 if start is None else start
    out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1, pad_token_id=0,
                         return_dict_in_generate=True, output_scores=True, min_new_tokens=NEW_TOKENS)
    return out.sequences, {f"score.{i}": s for i, s in enumerate(out.scores)}


def _raised_by_attnlab(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc``'s traceback is attnlab's library (not this module)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    where = Path(frames[-1].filename).resolve()
    return _LIBRARY in where.parents and where != Path(__file__).resolve()


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def _last_line(exc: BaseException) -> str:
    return _one_line(f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------ reporting
def counts(results: list[FamilyResult]) -> dict[str, int]:
    """How many results have each status, in :data:`STATUSES` order.

    Example:
        >>> counts([FamilyResult("a", "equal"), FamilyResult("b", "crashed")])["equal"]
        1
    """
    return {status: sum(r.status == status for r in results) for status in STATUSES}


def markdown_table(results: list[FamilyResult]) -> str:
    """A markdown table: one row per family with its status and, unless equal, the reason.

    Example:
        >>> print(markdown_table([FamilyResult("llama", "equal", model_class="LlamaForCausalLM")]))
        | family | status | model built | why |
        |---|---|---|---|
        | llama | equal | LlamaForCausalLM |  |
    """
    rows = ["| family | status | model built | why |", "|---|---|---|---|"]
    for r in results:
        why = "" if r.status == "equal" else re.sub(r"\|", "/", r.reason)
        rows.append(f"| {r.family} | {r.status} | {r.model_class} | {why} |")
    return "\n".join(rows)
