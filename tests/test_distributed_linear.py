"""Context-parallel linear attention equals one process (fp64, forward and backward, over gloo).

Each rank holds a contiguous shard; the chunk states pass as a prefix over the ranks
(:mod:`attnlab.distributed.linear`). Every rule (additive, decayed per step or per channel, delta,
gated delta, KDA), grouped value heads, an initial state and the final state, at 2, 3 and 4 ranks,
against the fp64 recurrence run on the whole sequence in one process.
"""

from __future__ import annotations

import pytest
import torch

import _distributed_jobs as jobs
from attnlab.distributed import context_parallel_linear_attention
from attnlab.distributed.launch import run_local

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


def _report(world: int) -> dict:
    outcomes = run_local(jobs.linear_conformance, world=world, timeout=120)
    for outcome in outcomes:
        assert outcome.error is None, outcome.error
    return outcomes[0].value


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"world{w}")
def report(request):
    return request.param, _report(request.param)


@pytest.mark.parametrize("name", list(jobs.LINEAR_CASES))
def test_ranks_match_one_process(report, name):
    world, errors = report
    assert {"out", "q", "k", "v"} <= set(errors[name])  # and the state, decay, beta, initial state when present
    assert max(errors[name].values()) <= 1e-10, f"world {world}, {name}: errors {errors[name]}"


def test_needs_an_initialised_process_group():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_linear_attention(q, q, q)


def test_refusals_name_what_is_wrong_on_every_rank():
    outcomes = run_local(jobs.linear_bad_calls, world=2, timeout=60)
    for outcome in outcomes:
        assert outcome.error is None, outcome.error
        disagree_state, disagree_beta, positive_decay, bad_stats = outcome.value
        assert "disagree" in disagree_state and "initial_state" in disagree_state
        assert "disagree" in disagree_beta and "beta" in disagree_beta
        assert "decay must be <= 0" in positive_decay
        assert "stats must be a CommStats" in bad_stats
