"""Fusion methods beyond CacheBlend (issue 13): invariants on the tiny random-weight Llama."""

from __future__ import annotations

import pytest
import torch
from test_fusion import ATOL, rag_prompt, run

from rag_kvcache.config import FusionConfig
from rag_kvcache.engine.methods import repick_schedule


def reusable_token_layers(result, inp) -> int:
    """Token-layers spent on reusable tokens: everything computed minus the uncached tokens, every layer."""
    return sum(result.active_per_layer) - int(inp.fresh.sum()) * len(result.active_per_layer)


def test_repick_schedule_matches_cacheblend_budget():
    cfg = FusionConfig(ratio=0.15, check_layer=1, repick_layers=(4, 10), repick_decay=0.5)
    schedule = repick_schedule(cfg, 30)
    spans = {1: 3, 4: 6, 10: 20}
    assert sum(schedule[layer] * span for layer, span in spans.items()) == pytest.approx(29 * 0.15)
    assert schedule[1] > 0.15 > schedule[10]


@pytest.mark.parametrize("bad", [(1, 3), (3, 2), (2, 30)])
def test_repick_schedule_refuses_layers_not_rising_within_the_model(bad):
    with pytest.raises(ValueError, match="repick layers"):
        repick_schedule(FusionConfig(check_layer=1, repick_layers=bad), 30)


def test_repick_without_decay_at_full_ratio_equals_full(tiny):
    inp = rag_prompt(tiny)
    ref = run(tiny, inp, "full")
    out = run(tiny, inp, "cacheblend_repick", ratio=1.0, repick_layers=(2, 3), repick_decay=1.0)
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)
    for v, vr in zip(out.values, ref.values):
        torch.testing.assert_close(v, vr, atol=ATOL, rtol=0)


@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.5])
def test_repick_stays_within_cacheblend_budget_and_narrows(tiny, ratio):
    inp = rag_prompt(tiny, n_chunks=4, chunk_len=40)
    blend = run(tiny, inp, "cacheblend", ratio=ratio)
    repick = run(tiny, inp, "cacheblend_repick", ratio=ratio, repick_layers=(2, 3), repick_decay=0.5)
    slack = len(repick.active_per_layer)  # one token of rounding per layer at most
    assert reusable_token_layers(repick, inp) <= reusable_token_layers(blend, inp) + slack
    counts = repick.active_per_layer
    assert counts[1] > counts[2] > counts[3]
