"""attnlab.io: safetensors round trips are bitwise, and nothing is ever unpickled."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from attnlab import io
from attnlab.nn import MultiHeadAttention, TransformerDecoder
from attnlab.nn import QKV


def _modules(seed=0):
    torch.manual_seed(seed)
    return [
        MultiHeadAttention(16, 16, num_heads=4, positions="rope", qkv=QKV(num_kv_heads=2, bias=True)),
        MultiHeadAttention(16, 12, num_heads=3, qkv=QKV(kdim=5, vdim=7, out_bias=False)),
        TransformerDecoder(2, 16, 2, cross_attention=True),
    ]


@pytest.mark.parametrize("index", range(3), ids=["gqa_rope", "cross_kdim_vdim", "decoder"])
def test_round_trip_is_bitwise(tmp_path, index):
    module = _modules()[index]
    path = tmp_path / "weights.safetensors"
    io.save(module, path, metadata={"note": "test"})
    fresh = _modules(seed=123)[index]  # a fresh module with different weights
    assert not all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), module.state_dict().values()))
    io.load(fresh, path)
    for name, tensor in module.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert io.read_metadata(path)["note"] == "test"


def test_tied_weights_are_stored_once_and_restored(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight

    module = Tied()
    io.save(module, tmp_path / "tied.safetensors")
    assert len(io.load_state_dict(tmp_path / "tied.safetensors")) == 3
    fresh = io.load(Tied(), tmp_path / "tied.safetensors")
    assert torch.equal(fresh.b.weight, module.a.weight) and fresh.b.weight is fresh.a.weight


def test_pickle_checkpoints_are_refused(tmp_path):
    module = MultiHeadAttention(8, 8, num_heads=2)
    path = tmp_path / "weights.pt"
    torch.save(module.state_dict(), path)
    with pytest.raises(ValueError, match="not a safetensors file.*never unpickles"):
        io.load(module, path)
    raw = tmp_path / "raw.pkl"
    raw.write_bytes(pickle.dumps({"w": 1}))
    with pytest.raises(ValueError, match="pickle"):
        io.load_state_dict(raw)


def test_loading_never_calls_pickle(tmp_path, monkeypatch):
    module = MultiHeadAttention(8, 8, num_heads=2)
    io.save(module, tmp_path / "w.safetensors")

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling attempted")

    for target, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(target, name, forbidden)
    fresh = io.load(MultiHeadAttention(8, 8, num_heads=2), tmp_path / "w.safetensors")
    x = torch.randn(1, 3, 8)
    assert torch.equal(fresh(x), module(x))


def _snapshot(module):
    return {name: tensor.clone() for name, tensor in module.state_dict().items()}


def _assert_unchanged(module, before):
    after = module.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


@pytest.mark.parametrize(
    "saved, target, pattern",
    [
        (dict(), dict(qkv=QKV(bias=True)), "missing from the file: in_proj_bias"),
        (dict(qkv=QKV(bias=True)), dict(), "unexpected in the file: in_proj_bias"),
        (dict(), dict(qkv=QKV(num_kv_heads=1)), r"in_proj_weight: file \(24, 8\) vs module \(16, 8\)"),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_mismatched_load_is_a_value_error_and_changes_nothing(tmp_path, saved, target, pattern):
    path = tmp_path / "w.safetensors"
    io.save(MultiHeadAttention(8, 8, num_heads=2, **saved), path)
    module = MultiHeadAttention(8, 8, num_heads=2, **target)  # out_proj fits, so it would load
    before = _snapshot(module)
    with pytest.raises(ValueError, match=f"w.safetensors.*does not fit MultiHeadAttention.*{pattern}"):
        io.load(module, path)
    _assert_unchanged(module, before)


def test_non_strict_load_still_refuses_wrong_shapes_and_changes_nothing(tmp_path):
    path = tmp_path / "w.safetensors"
    io.save(MultiHeadAttention(8, 8, num_heads=2), path)
    module = MultiHeadAttention(8, 8, num_heads=2, qkv=QKV(num_kv_heads=1))
    before = _snapshot(module)
    with pytest.raises(ValueError, match="in_proj_weight: file"):
        io.load(module, path, strict=False)
    _assert_unchanged(module, before)


def _saved_file(tmp_path):
    path = tmp_path / "w.safetensors"
    io.save(MultiHeadAttention(8, 8, num_heads=2), path)
    return path, path.read_bytes()


@pytest.mark.parametrize("cut", [5, 20, -10], ids=["length", "header", "data"])
def test_truncated_file_is_a_value_error_naming_it(tmp_path, cut):
    path, data = _saved_file(tmp_path)
    path.write_bytes(data[:cut])
    for read in (io.load_state_dict, io.read_metadata, io.read_header,
                 lambda p: io.load(MultiHeadAttention(8, 8, num_heads=2), p)):
        with pytest.raises(ValueError, match="w.safetensors' is truncated or corrupted"):
            read(path)


@pytest.mark.parametrize(
    "damage",
    [lambda d: d[:8] + b"[" + d[9:], lambda d: d.replace(b'"dtype"', b'"dtypo"', 1),
     lambda d: d.replace(b'"F32"', b'"Q99"', 1)],
    ids=["not_json", "missing_field", "bad_dtype"],
)
def test_corrupted_header_is_a_value_error_naming_it(tmp_path, damage):
    path, data = _saved_file(tmp_path)
    path.write_bytes(damage(data))
    module = MultiHeadAttention(8, 8, num_heads=2)
    before = _snapshot(module)
    for read in (io.load_state_dict, io.read_metadata, io.read_header, lambda p: io.load(module, p)):
        with pytest.raises(ValueError, match="w.safetensors' is truncated or corrupted"):
            read(path)
    _assert_unchanged(module, before)


def test_unreadable_path_is_an_os_error_naming_it(tmp_path):
    missing = tmp_path / "missing.safetensors"
    for read in (io.load_state_dict, io.read_metadata, io.check_safetensors):
        with pytest.raises(FileNotFoundError, match="could not read a safetensors file") as info:
            read(missing)
        assert info.value.filename == str(missing)
    with pytest.raises(IsADirectoryError) as info:
        io.load_state_dict(tmp_path)
    assert info.value.filename == str(tmp_path)


def test_unwritable_path_is_an_os_error_naming_it_and_leaves_nothing(tmp_path):
    target = tmp_path / "no_such_dir" / "w.safetensors"
    with pytest.raises(FileNotFoundError, match="could not write a safetensors file") as info:
        io.save(nn.Linear(2, 2), target)
    assert info.value.filename == str(target)
    with pytest.raises(IsADirectoryError, match="could not write") as info:
        io.save(nn.Linear(2, 2), tmp_path)  # the destination is a directory
    assert info.value.filename == str(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


def test_failed_save_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path, data = _saved_file(tmp_path)

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left.*could not write") as info:
        io.save(MultiHeadAttention(8, 8, num_heads=2), path)
    assert info.value.filename == str(path)
    assert path.read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def test_module_whose_buffer_views_a_parameter_round_trips(tmp_path):
    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(6))
            self.register_buffer("tail", self.weight.data[2:])  # shares memory, not an alias
            self.register_buffer("same", self.weight.data)  # an exact alias

    module = Views()
    io.save(module, tmp_path / "v.safetensors")
    fresh = io.load(Views(), tmp_path / "v.safetensors")
    assert torch.equal(fresh.weight, module.weight)
    assert fresh.tail.data_ptr() == fresh.weight.data_ptr() + 2 * 4  # still a view
    assert torch.equal(fresh.tail, module.weight[2:]) and torch.equal(fresh.same, module.weight)


def test_bad_arguments_are_type_errors_naming_them(tmp_path):
    path, _ = _saved_file(tmp_path)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got dict"):
        io.load({}, path)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        io.save(nn.Linear(2, 2).state_dict(), tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match="metadata must map str to str; got 'step': 3"):
        io.save(nn.Linear(2, 2), tmp_path / "x.safetensors", metadata={"step": 3})


@pytest.mark.parametrize("first_bytes", [b"\x80", b"PK"], ids=["0x80", "PK"])
def test_a_header_length_that_starts_like_a_pickle_still_loads(tmp_path, first_bytes):
    """A valid file whose header length's low bytes read 0x80 or 'PK' was refused as a pickle."""
    import struct

    import safetensors.torch

    module = nn.Linear(3, 2)
    path = tmp_path / "m.safetensors"
    target, modulus = int.from_bytes(first_bytes, "little"), 256 ** len(first_bytes)

    def header_len(pad: int) -> int:
        safetensors.torch.save_file(dict(module.state_dict()), str(path), metadata={"pad": "x" * pad})
        return struct.unpack("<Q", path.read_bytes()[:8])[0]

    start = (target - header_len(0)) % modulus  # the header grows one byte per padding character
    pad = next(p for p in range(max(0, start - 8), start + 9) if header_len(p) % modulus == target)
    header_len(pad)
    assert path.read_bytes().startswith(first_bytes)
    fresh = nn.Linear(3, 2)
    io.load(fresh, path)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), module.state_dict().values()))


# ------------------------------------------------------- the header is checked first (issue 18)
def _no_tensor_reads(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("read the tensors")

    monkeypatch.setattr(io.safetensors.torch, "load_file", forbidden)


def test_read_header_gives_every_dtype_and_shape_without_reading_tensors(tmp_path, monkeypatch):
    module = nn.Linear(3, 5).to(torch.float16)
    module.register_buffer("steps", torch.zeros(2, 7, dtype=torch.int64))
    path = tmp_path / "m.safetensors"
    io.save(module, path)
    _no_tensor_reads(monkeypatch)
    names = {torch.float16: "F16", torch.int64: "I64"}
    expected = {name: io.TensorInfo(names[t.dtype], tuple(t.shape)) for name, t in module.state_dict().items()}
    assert io.read_header(path) == expected
    assert [info.floating for info in expected.values()] == [True, True, False]


def test_a_file_that_does_not_fit_is_refused_before_any_tensor_is_read(tmp_path, monkeypatch):
    path = tmp_path / "big.safetensors"
    io.save(nn.Linear(64, 32), path)
    module = nn.Linear(2, 3)
    before = _snapshot(module)
    _no_tensor_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"big\.safetensors' does not fit Linear .*weight: file \(32, 64\) vs module \(3, 2\)"):
        io.load(module, path)
    _assert_unchanged(module, before)


def test_integer_data_for_a_float_tensor_is_refused_and_changes_nothing(tmp_path):
    path = tmp_path / "ints.safetensors"
    io.save_state_dict({"weight": torch.ones(3, 2, dtype=torch.int64), "bias": torch.zeros(3)}, path)
    module = nn.Linear(2, 3)
    before = _snapshot(module)
    with pytest.raises(ValueError, match=r"ints\.safetensors' does not fit Linear \(1 problem\(s\)\): "
                                         r"weight: file dtype I64 vs module torch\.float32"):
        io.load(module, path)
    _assert_unchanged(module, before)
