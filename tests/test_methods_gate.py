"""`cacheblend_gate` (issue 13): above its bound it recomputes every token (equals `full`), below it is CacheBlend."""

from __future__ import annotations

import torch
from test_fusion import ATOL, rag_prompt, run

from rag_kvcache.engine.methods import relative_deviation


def test_relative_deviation():
    k = torch.randn(2, 5, 8)
    assert relative_deviation(k, k) == 0.0
    assert abs(relative_deviation(k, torch.zeros_like(k)) - 1.0) < 1e-6


def test_gate_above_its_bound_falls_back_to_full(tiny):
    inp = rag_prompt(tiny)
    ref = run(tiny, inp, "full")
    out = run(tiny, inp, "cacheblend_gate", ratio=0.15, gate_bound=0.0)
    assert out.compute_fraction > run(tiny, inp, "cacheblend", ratio=0.15).compute_fraction
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)
    for v, vr in zip(out.values, ref.values):
        torch.testing.assert_close(v, vr, atol=ATOL, rtol=0)


def test_gate_below_its_bound_is_cacheblend(tiny):
    inp = rag_prompt(tiny)
    blend = run(tiny, inp, "cacheblend", ratio=0.15)
    out = run(tiny, inp, "cacheblend_gate", ratio=0.15, gate_bound=1e9)
    assert out.active_per_layer == blend.active_per_layer
    torch.testing.assert_close(out.logits, blend.logits, atol=0, rtol=0)
