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

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
