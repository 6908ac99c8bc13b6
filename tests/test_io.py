"""attnlab.io: safetensors round trips are bitwise, and nothing is ever unpickled."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from attnlab import io
from attnlab.nn import MultiHeadAttention, TransformerDecoder


def _modules(seed=0):
    torch.manual_seed(seed)
    return [
        MultiHeadAttention(16, 16, num_heads=4, num_kv_heads=2, rope=True, qkv_bias=True),
        MultiHeadAttention(16, 12, num_heads=3, kdim=5, vdim=7, out_bias=False),
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


def test_strict_mismatch_raises(tmp_path):
    io.save(MultiHeadAttention(8, 8, num_heads=2), tmp_path / "w.safetensors")
    with pytest.raises(RuntimeError):
        io.load(MultiHeadAttention(8, 8, num_heads=2, qkv_bias=True), tmp_path / "w.safetensors")
