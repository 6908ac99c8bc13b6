"""Process state: no user tensor outlives the call that brought it, and every store that remains
is on one documented list (bounded, tensor-free, cleared by the one reset)."""

import ast
import gc
import importlib
import pathlib
import pkgutil
import weakref

import pytest
import torch
import torch.distributed as dist

import attnlab
from attnlab import backends, masks, scores
from attnlab.lab import verify
from attnlab.backends import build_call
from attnlab.distributed import hybrid
from attnlab.distributed._comm import peers

CALLS = 200  # per-batch objects built, used once and dropped


def _all_dead(refs: list) -> list:
    gc.collect()
    return [ref for ref in refs if ref() is not None]


# ----------------------------------------------------------------------------- retention
def test_a_sweep_keeps_none_of_its_tensors(monkeypatch):
    """verify cached every configuration's inputs and reference results for the process's life
    (two functools.lru_cache); they now live as long as one sweep."""
    made = []
    drawn = verify._inputs

    def recorded(config):
        tensors = drawn(config)
        made.extend(weakref.ref(t) for t in tensors[:4])
        return tensors

    monkeypatch.setattr(verify, "_inputs", recorded)
    results = verify.sweep(["sdpa", "chunked"], [torch.float32], n=6, small=True)
    results += [verify.check("sdpa", config, torch.float32) for config in verify.configs(3, seed=1, small=True)]
    assert all(r.passed for r in results) and len(made) >= 4 * 9
    assert _all_dead(made) == []


def test_a_sweep_computes_each_configurations_inputs_once(monkeypatch):
    """Scoped to the sweep, the inputs are still shared by every backend and check of it."""
    seen = []
    drawn = verify._inputs
    monkeypatch.setattr(verify, "_inputs", lambda config: seen.append(config) or drawn(config))
    verify.sweep(["sdpa", "chunked"], [torch.float32], n=4, small=True)
    assert len(seen) == len(set(seen)) == 4


@pytest.mark.skipif("flex" not in backends.available(), reason="no FlexAttention")
def test_flex_keeps_no_document_mask_of_a_batch_nor_a_users_function():
    """A new document mask per batch (one compiled shape), and a user's score function per call:
    flex's bookkeeping (variants, failures) keys them without keeping them alive."""
    flex = backends.get("flex")
    q = torch.randn(1, 1, 128, 8)
    refs = []
    with torch.no_grad():
        for step in range(CALLS):
            ids = torch.randint(0, 4, (128,), generator=torch.Generator().manual_seed(step)).sort().values
            mod = masks.document_mod(ids)
            call = build_call(q, q, q, mask=mod)
            out = flex.forward(call).out
            refs += [weakref.ref(ids), weakref.ref(mod)]
        table = torch.randn(2)
        fn = scores.function(lambda s, b, h, i, j: s + table[h])  # two heads: one user tensor
        flex.forward(build_call(q.expand(1, 2, 128, 8), q, q, score_mod=fn))
        refs += [weakref.ref(table), weakref.ref(fn)]
        assert flex.compiled(build_call(q.expand(1, 2, 128, 8), q, q, score_mod=fn))
        del ids, mod, call, fn, table
    want = attnlab.attention(q, q, q, backend="reference", mask=masks.document_mod(
        torch.randint(0, 4, (128,), generator=torch.Generator().manual_seed(CALLS - 1)).sort().values))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert _all_dead(refs) == []


def test_attention_weights_keep_no_mask_of_a_batch():
    q = torch.randn(2, 2, 16, 8)
    refs = []
    for step in range(CALLS):
        ids = torch.arange(16).div(4 + step % 3, rounding_mode="floor")
        lengths = torch.tensor([16, 9 + step % 5])
        for mask in (masks.document_mod(ids), masks.padding_mod(lengths)):
            weights = attnlab.attention_weights(q, q, mask=mask)
            refs += [weakref.ref(mask)]
        refs += [weakref.ref(ids), weakref.ref(lengths)]
    assert torch.allclose(weights.sum(-1), torch.ones(2, 2, 16))
    del ids, lengths, mask
    assert _all_dead(refs) == []


# ------------------------------------------------------------ context parallelism's subgroups
@pytest.fixture
def one_rank(tmp_path):
    """A process group of one (gloo), destroyed after the test."""
    if dist.is_initialized():
        pytest.skip("a process group is already set up")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_subgroups_go_with_their_process_group(one_rank, tmp_path):
    """Kept by (group, world, ulysses) without bound, a destroyed world's subgroups were handed to
    the next world set up in the process; they are now kept with their parent group, one entry per
    Ulysses size, and go when it is destroyed."""
    who = peers(None, None)
    first = hybrid.subgroups(who, 1)
    assert hybrid.subgroups(who, 1)[0].group is first[0].group  # made once
    assert len(hybrid._SUBGROUPS) == 1 and len(hybrid._SUBGROUPS[dist.group.WORLD]) == 1
    dead = weakref.ref(first[0].group)
    del first
    dist.destroy_process_group()
    assert _all_dead([dead]) == [] and len(hybrid._SUBGROUPS) == 0
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store2'}", rank=0, world_size=1)
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    out = attnlab.distributed.context_parallel_attention(q, q, q, causal=True, method="hybrid", ulysses=1)
    torch.testing.assert_close(out, attnlab.attention(q, q, q, causal=True, backend="reference"))


# ---------------------------------------------------------------- the stores that remain
# Every module-level container that attnlab mutates, and every container a registered backend
# holds: what bounds it, that it holds no user tensor, and what clears it (dispatch.clear_plans,
# the one reset, unless said otherwise).
ALLOWED = {
    "attnlab.backends.registry._REGISTRY": "the registered backends, by name; changed by register()",
    "attnlab.backends.registry._GENERATION": "one int, bumped by each registry change",
    "attnlab.backends.registry._CLAIMERS": "the backends that claim calls, in claim_order, for the "
                                           "current generation only (one entry, rebuilt after a change)",
    "attnlab.backends.dispatch._ROUTES": "remembered routes, at most PLAN_CACHE_SIZE; clear_plans()",
    "attnlab.backends.dispatch._BUDGET": "the memory budget a user set (one int or None): a setting, "
                                         "not a cache; set_memory_budget(None) restores the default",
    "attnlab.distributed.hybrid._SUBGROUPS": "process groups, one per Ulysses size per parent group, "
                                             "weakly keyed: destroying the parent clears them",
    "attnlab.integrations.transformers._EAGER_CONFIGS": "one weak reference per live config of a model "
                                                        "built on attnlab with eager's masks, by id; an "
                                                        "entry goes with its config",
    "attnlab.integrations.transformers._SDPA_CONFIGS": "the same for configs given sdpa's masks",
    "attnlab.integrations.transformers._EAGER_CLASSES": "one bool per config class a model was built "
                                                        "with: all got eager's (what a copied config gets)",
    "attnlab.integrations.deepseek_v4._NAMES": "the implementation names register() registered",
    "attnlab.integrations.deepseek_v4._SERVED": "one weak reference per live config whose DeepSeek-V4 "
                                                "layers are all on the compressed path, by id",
    "attnlab.integrations.deepseek_v4._VIEWS": "each live adapted layer's CompressedAttention view "
                                               "(its own parameters, no copy), weak keys",
    "attnlab.integrations.deepseek_v4._ADAPTED_CLASSES": "one subclass per DeepseekV4Attention class",
    "backend flex._compile_error": "a reason per device type; clear_plans()",
    "backend flex._mod_errors": "at most _RECOMPILE_LIMIT reasons, weak keys; clear_plans()",
    "backend flex._variants": "at most _RECOMPILE_LIMIT keys, weak keys; clear_plans()",
}
_CONTAINERS = (dict, list, set, weakref.WeakKeyDictionary, weakref.WeakValueDictionary, weakref.WeakSet)
_MUTATORS = {"append", "add", "pop", "popitem", "clear", "update", "setdefault", "extend", "insert",
             "remove", "discard", "move_to_end"}


def _mutated_names(source: str) -> set[str]:
    """Names the source mutates in place: ``n[i] = ...``, ``del n[i]``, ``n += ...``, ``n.append(...)``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            for target in getattr(node, "targets", None) or [node.target]:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                    found.add(target.value.id)
                elif isinstance(node, ast.AugAssign) and isinstance(target, ast.Name):
                    found.add(target.id)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Name)):
            found.add(node.func.value.id)
    return found


def _stores() -> set[str]:
    found = set()
    for info in pkgutil.walk_packages(attnlab.__path__, "attnlab."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        mutated = _mutated_names(pathlib.Path(module.__file__).read_text())
        for name, value in vars(module).items():
            if name.startswith("_") and (hasattr(value, "cache_info")  # an lru_cache is a store
                                         or (isinstance(value, _CONTAINERS) and name in mutated)):
                found.add(f"{info.name}.{name}")
    for backend in backends.registry().values():
        found |= {f"backend {backend.name}.{name}" for name, value in vars(backend).items()
                  if isinstance(value, _CONTAINERS)}
    return found


def test_every_store_is_on_the_documented_list():
    assert _stores() == set(ALLOWED)


def test_the_one_reset_clears_the_backends_stores():
    flex = backends.get("flex")
    flex._compile_error["meta"] = "stand-in"
    flex._variants.add(("stand-in",))
    backends.dispatch.clear_plans()
    assert not any(vars(b).get(name) for b in backends.registry().values()
                   for name in ("_compile_error", "_mod_errors", "_variants"))
