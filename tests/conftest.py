"""Shared test settings: deterministic, CPU-sized, and quiet."""

import os

import matplotlib
import pytest
import torch
from hypothesis import settings

matplotlib.use("Agg")
os.environ.setdefault("ATTNLAB_NO_BROWSER_OPEN", "1")

# The suite must run in a few minutes on 2 CPU cores: keep hypothesis runs short and unthrottled.
settings.register_profile("attnlab", max_examples=60, deadline=None, derandomize=True)
settings.load_profile("attnlab")

# Under pytest-xdist each worker gets one thread (and Inductor one compile thread): two workers with
# two OpenMP threads each on a 2-core machine spin against each other, and a sweep that takes 4 s
# alone took 77 s beside a flex compilation.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER") is not None
torch.set_num_threads(1 if _WORKER else max(1, min(2, torch.get_num_threads())))
if _WORKER:
    import torch._inductor.config as _inductor_config

    _inductor_config.compile_threads = 1
