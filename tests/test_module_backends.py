"""Every backend a module may be built with serves every call the module makes (prefill and
each cached decoding step), or the module refuses it when it is built, with the reason
(docs/modules.md, "Backends"). The reference is the module's own full forward."""

import pytest
import torch

import attnlab
from attnlab import backends
from attnlab import nn as anl
from attnlab.nn import QKV, Window, Chunk

BACKENDS = ["reference", "sdpa", "chunked", "blocks"]  # flex on CPU: Tk must be a multiple of 128
MODULES = {
    "mha": (lambda be: anl.MultiHeadAttention(16, 16, num_heads=4, backend=be), {}),
    "mha_gqa_rope": (lambda be: anl.MultiHeadAttention(16, 16, num_heads=4, positions="rope", backend=be, qkv=QKV(num_kv_heads=2)), {}),
    "mha_window_ring": (lambda be: anl.MultiHeadAttention(16, 16, num_heads=4, backend=be, pattern=Window(3)),
                        {"windowed": True}),
    "mha_chunk": (lambda be: anl.MultiHeadAttention(16, 16, num_heads=4, backend=be, pattern=Chunk(4)), {}),
    "mha_alibi_sinks": (lambda be: anl.MultiHeadAttention(16, 16, num_heads=4, positions="alibi", sinks=True, backend=be), {}),
    "mha_paged": (lambda be: anl.MultiHeadAttention(16, 16, num_heads=4, backend=be), {"page_size": 4}),
    "latent_window": (lambda be: anl.LatentAttention(16, 4, latent_dim=8, window=3, backend=be), {}),
    "gated_paged": (lambda be: anl.GatedAttention(16, 4, backend=be), {"page_size": 4}),
    "differential": (lambda be: anl.DifferentialAttention(16, 4, backend=be), {}),
}


@pytest.mark.parametrize("kind", sorted(MODULES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_decoding_on_a_named_backend_equals_the_full_forward(backend, kind):
    make, cache_options = MODULES[kind]
    torch.manual_seed(0)
    module = make(backend).eval()
    with torch.no_grad():
        if isinstance(module, anl.MultiHeadAttention) and module.sinks is not None:
            module.sinks.normal_()
        x = torch.randn(2, 11, 16)
        full = module(x)
        cache = module.new_cache(2, 11, **cache_options)
        steps = [module(x[:, :6], cache=cache)] + [module(x[:, t:t + 1], cache=cache) for t in range(6, 11)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-6, rtol=0)


def test_a_named_backend_serves_what_auto_passes_it_over_for():
    """blocks computes a call with nothing to skip exactly, forward and backward; auto still
    leaves it to sdpa and says why."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, t, 8, generator=g, dtype=torch.float64, requires_grad=True) for t in (1, 9, 9))
    keep = torch.rand(2, 1, 1, 9, generator=g) > 0.3
    for options in ({}, {"mask": keep}, {"causal": True, "align": "bottom_right"}):
        got = attnlab.attention(q, k, v, backend="blocks", **options)
        want = attnlab.attention(q, k, v, backend="reference", **options)
        grads = torch.autograd.grad(got.sum(), (q, k, v))
        expected = torch.autograd.grad(want.sum(), (q, k, v))
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
        for have, ref in zip(grads, expected):
            torch.testing.assert_close(have, ref, atol=1e-12, rtol=0)
    call = backends.build_call(q.detach(), k.detach(), v.detach())
    assert backends.select(call, "auto").name == "sdpa"
    assert "nothing to skip" in backends.reasons(call)["blocks"][0]


@pytest.mark.parametrize("backend,options,named", [
    ("sdpa", {"softcap": 5.0}, "softcap"),
    ("blocks", {"softcap": 5.0}, "softcap"),
    ("flex", {"sinks": True}, "sinks"),
])
def test_a_module_refuses_a_backend_that_declines_its_options_when_it_is_built(backend, options, named):
    with pytest.raises(ValueError, match=f"backend='{backend}' cannot serve this module's calls.*{named}"):
        anl.MultiHeadAttention(16, 16, num_heads=4, backend=backend, **options)
