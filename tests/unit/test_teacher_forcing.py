"""Teacher forcing: an answer forced through a prompt cache is scored position by position, as an
ordinary forward over prompt + answer would score it; through `full`'s own cache it matches `full`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rag_kvcache.bench.metrics import bootstrap_ci, teacher_forced
from rag_kvcache.config import GenerationConfig
from rag_kvcache.engine.generation import Decoder, sample_token, teacher_forced_logits


def _greedy(adapter, prompt: torch.Tensor, n: int) -> tuple[list, list, torch.Tensor, list[int]]:
    keys, values, logits = adapter.prefill(prompt)  # L x [1, H_kv, N, D], [1, V]
    keys, values = [k[0] for k in keys], [v[0] for v in values]
    cfg = GenerationConfig(max_new_tokens=n)
    steps = Decoder(adapter, cfg).steps(keys, values, logits[0], sample_token(logits[0], cfg, None))
    return keys, values, logits[0], [s.token_id for s in steps if s.token_id is not None]


def test_forcing_full_answer_through_its_own_cache_is_perfect(tiny):
    prompt = torch.randint(1000, 20000, (1, 24), generator=torch.Generator().manual_seed(0))
    keys, values, first, answer = _greedy(tiny, prompt, 6)
    forced = teacher_forced_logits(tiny, keys, values, first, answer)  # [T, V]
    assert forced.shape == (6, tiny.model.config.vocab_size)
    scores = teacher_forced(forced, forced, answer)
    assert scores == {"tf_kl": 0.0, "tf_top1": 1.0, "tf_logp_delta": 0.0, "first_token_kl": 0.0}
    # Position by position, the same logits as one ordinary forward over prompt + answer.
    whole = tiny.model(torch.cat([prompt, torch.tensor([answer[:-1]])], dim=1)).logits[0, prompt.shape[1] - 1 :]
    torch.testing.assert_close(forced, whole.float(), atol=1e-4, rtol=1e-4)
    assert all(k.shape[-2] == 24 for k in keys)  # the cache was not extended


def test_a_perturbed_cache_scores_worse(tiny):
    prompt = torch.randint(1000, 20000, (1, 24), generator=torch.Generator().manual_seed(1))
    keys, values, first, answer = _greedy(tiny, prompt, 6)
    reference = teacher_forced_logits(tiny, keys, values, first, answer)
    noisy = [v + torch.randn(v.shape, generator=torch.Generator().manual_seed(2)) for v in values]
    scores = teacher_forced(reference, teacher_forced_logits(tiny, keys, noisy, first, answer), answer)
    assert scores["tf_kl"] > 0 and scores["first_token_kl"] == 0.0  # the first logits came from the prompt


def test_teacher_forced_metrics_by_hand():
    ref = np.log([[0.5, 0.5], [0.9, 0.1]])
    mine = np.log([[0.5, 0.5], [0.1, 0.9]])
    scores = teacher_forced(ref, mine, [0, 0])
    kl = 0.9 * np.log(9) + 0.1 * np.log(1 / 9)
    assert scores["tf_kl"] == pytest.approx(kl / 2) and scores["first_token_kl"] == pytest.approx(0.0)
    assert scores["tf_top1"] == 0.5  # position 0 is a tie, argmax picks token 0
    assert scores["tf_logp_delta"] == pytest.approx((np.log(0.1) - np.log(0.9)) / 2)
    with pytest.raises(ValueError, match="equal shape"):
        teacher_forced(ref, mine[:1], [0, 0])


def test_bootstrap_ci_brackets_the_mean_and_narrows_with_n():
    rng = np.random.default_rng(0)
    small, large = rng.normal(1.0, 1.0, 20), rng.normal(1.0, 1.0, 500)
    lo, hi = bootstrap_ci(small)
    assert lo < small.mean() < hi
    lo2, hi2 = bootstrap_ci(large)
    assert hi2 - lo2 < (hi - lo) / 2
    assert bootstrap_ci([3.0, 3.0]) == (3.0, 3.0)
