"""The call path (issue 31): a call's derived fields are computed once, and a first call walks
a short path (counted in attnlab Python calls, a figure that does not depend on the machine)."""

import collections
import dataclasses
import os
import sys

import torch

import attnlab
from attnlab import masks
from attnlab._call import build_call
from attnlab.backends import dispatch

_PACKAGE = os.path.dirname(attnlab.__file__)


def _attnlab_calls(fn) -> collections.Counter:
    calls = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(_PACKAGE):
            calls[frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_derived_fields_are_plain_and_follow_replace():
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8)
    call = build_call(q, k, k, causal=True, align="bottom_right")
    assert (call.batch, call.q_heads, call.kv_heads, call.tq, call.tk, call.head_dim, call.value_dim) == (2, 4, 2, 3, 5, 8, 8)
    assert (call.mask_kind, call.causal_offset, call.dtype, call.device.type) == ("causal", 2, torch.float32, "cpu")
    derived = {"batch", "q_heads", "kv_heads", "tq", "tk", "head_dim", "value_dim", "dtype", "device",
               "requires_grad", "mask_kind", "causal_offset"}
    assert derived <= {f.name for f in dataclasses.fields(call)}  # fields, not properties recomputed per read
    floats = dataclasses.replace(call, mask=torch.zeros(1, 1, 3, 5, requires_grad=True), _memo={})
    assert floats.mask_kind == "float" and floats.requires_grad
    with torch.no_grad():
        assert not build_call(q.requires_grad_(), k, k).requires_grad


def test_a_first_call_walks_a_short_path():
    q = torch.randn(2, 4, 16, 8)
    dispatch.clear_plans()
    first = _attnlab_calls(lambda: attnlab.attention(q, q, q, causal=True))
    assert sum(first.values()) <= 100, first.most_common(10)
    assert "cost" not in first and first["reasons_of"] == 1  # sdpa claims it: no one else is asked
    warm = _attnlab_calls(lambda: attnlab.attention(torch.randn(2, 4, 16, 8), q, q, causal=True))
    assert sum(warm.values()) <= 5, warm
    bools = torch.rand(2, 1, 16, 16) > 0.5
    assert sum(_attnlab_calls(lambda: attnlab.attention(q, q, q, mask=bools)).values()) <= 100
    planned = attnlab.plan(q, q, q, causal=True)
    assert sum(_attnlab_calls(lambda: planned(q, q, q)).values()) <= 3


def test_the_mask_is_one_value_normalised_at_the_entry():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
    window = masks.sliding_window_mod(4, 6, window=2)
    kinds = {
        "none": build_call(q, k, k),
        "causal": build_call(q, k, k, causal=True),
        "bool": build_call(q, k, k, mask=torch.rand(1, 1, 4, 6) > 0.3, causal=True),
        "float": build_call(q, k, k, mask=torch.zeros(1, 1, 1, 6)),
        "mod": build_call(q, k, k, mask=window, causal=True, align="bottom_right"),
        "prepared": build_call(q, k, k, mask=masks.prepare(window, tq=4, tk=6)),
    }
    assert {name: call.mask_kind for name, call in kinds.items()} == {name: name for name in kinds}
    assert [kinds[n].causal_offset for n in ("none", "causal", "bool", "float")] == [None, 0, 0, None]
    # causal is ANDed into a mod once, at the entry: the mod is the whole mask (offset Tk - Tq = 2)
    mod = kinds["mod"]
    want = masks.materialize(window, tq=4, tk=6) & masks.causal_mask(4, 6, align="bottom_right")
    assert mod.causal_offset == 2 and torch.equal(masks.materialize(mod.mask, tq=4, tk=6), want)
    assert mod.mask_mod() is mod.mask and torch.equal(mod.allowed()[0, 0], want[0, 0])
    # a causal mask that blocks no key is no causal part
    assert build_call(q[:, :, :1], k, k, causal=True, align="bottom_right").mask_kind == "none"


def test_backends_decide_from_the_mask_kind():
    from attnlab.backends import flex, sdpa

    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
    window = masks.sliding_window_mod(4, 6, window=2)
    pad = torch.rand(1, 1, 1, 6) > 0.3
    cases = {  # options: (sdpa's mask source, flex's mask path)
        (): ("none", None),
        (("causal", True),): ("is_causal", "rows"),
        (("causal", True), ("align", "bottom_right")): ("materialised", "rows"),
        (("mask", pad),): ("user", "dense"),
        (("mask", pad), ("causal", True)): ("segments", "dense"),  # a padded batch: calls on its real keys
        (("mask", window),): ("materialised", "rows"),
        (("mask", window), ("causal", True)): ("materialised", "rows"),
        (("mask", lambda b, h, i, j: i >= j),): ("materialised", "dense"),
        (("mask", masks.prepare(window, tq=4, tk=6)),): ("materialised", "rows"),
    }
    for options, want in cases.items():
        call = build_call(q, k, k, **dict(options))
        assert (sdpa.sdpa_plan(call).mask_source, flex._mask_path(call)) == want, (options, call.mask_kind)
