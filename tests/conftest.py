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


# flex compiles one kernel per shape, dtype, mask path and score mod, and a process may hold at
# most 64 of them (attnlab.backends.flex._MAX_VARIANTS, what Dynamo's recompile limit is raised
# to): the conformance sweep alone compiles about 27 per dtype. A pytest worker runs many flex
# tests, so once a test leaves more than half the budget used, the next starts afresh.
_FLEX_BUDGET_KEPT = 32


@pytest.fixture(autouse=True)
def _flex_budget():
    yield
    from attnlab import backends

    if "flex" in backends.names():
        flex = backends.get("flex")
        if flex.compiled_variants > _FLEX_BUDGET_KEPT:
            flex.reset_compiled()
