"""Tests for rag_kvcache.bench.metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rag_kvcache.bench.metrics import (
    f1_score,
    kl_divergence,
    max_f1,
    median_p90,
    median_ratio,
    normalize_answer,
    rouge_l,
    spearman,
    spearman_ci,
)


def test_normalize_answer_squad_rules():
    # lower -> drop punctuation ("brown-fox" -> "brownfox") -> drop articles -> collapse whitespace
    assert normalize_answer("The  Quick, brown-fox!  ") == "quick brownfox"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_f1_hand_computed():
    # "the cat sat" -> [cat, sat]; "a cat sat down" -> [cat, sat, down]; 2 common tokens
    # P = 2/2, R = 2/3, F1 = 2PR/(P+R) = (4/3)/(5/3) = 0.8
    assert f1_score("the cat sat", "a cat sat down") == pytest.approx(0.8)
    assert f1_score("Paris", "paris.") == 1.0
    assert f1_score("London", "Paris") == 0.0


def test_f1_counts_repeated_tokens_once_per_match():
    # [cat, cat] vs [cat]: 1 common, P = 1/2, R = 1, F1 = 2/3
    assert f1_score("cat cat", "cat") == pytest.approx(2 / 3)


def test_f1_empty_follows_official_squad_v1():
    assert f1_score("", "") == 0.0
    assert f1_score("the", "a") == 0.0  # both normalise to empty
    assert f1_score("", "Paris") == 0.0


def test_max_f1():
    assert max_f1("cat sat", ["dog", "the cat sat down"]) == pytest.approx(0.8)


@pytest.mark.parametrize("fn", [max_f1])
@pytest.mark.parametrize("answers", [[], (), "Paris"])
def test_answer_metrics_reject_bad_answer_lists(fn, answers):
    with pytest.raises(ValueError, match="answers"):
        fn("Paris", answers)


def test_rouge_l_hand_computed():
    # tokens [the cat sat on the mat] vs [the cat is on the mat]: LCS "the cat on the mat" = 5
    # P = R = 5/6 -> F = 5/6
    assert rouge_l("the cat sat on the mat", "The cat is on the mat.") == pytest.approx(5 / 6)
    assert rouge_l("identical text here", "identical text here") == pytest.approx(1.0)
    assert rouge_l("", "reference") == 0.0


def test_rouge_l_stemming():
    # stemmed: [run, dog] vs [the, dog, run]: LCS 1, P = 1/2, R = 1/3, F = 2PR/(P+R) = 0.4
    assert rouge_l("running dogs", "the dog runs") == pytest.approx(0.4)
    assert rouge_l("running dogs", "the dog runs", stem=False) == 0.0


def test_kl_identical_is_zero():
    logits = np.array([1.5, -0.3, 2.0, 0.0])
    assert kl_divergence(logits, logits) == pytest.approx(0.0, abs=1e-12)
    assert kl_divergence(logits, logits + 7.0) == pytest.approx(0.0, abs=1e-12)  # shift invariant


def test_kl_two_class_hand_formula():
    # P = (1/2, 1/2); Q = softmax(ln 3, 0) = (3/4, 1/4)
    # KL(P||Q) = 1/2 ln(0.5/0.75) + 1/2 ln(0.5/0.25) = 1/2 ln(4/3)
    assert kl_divergence([0.0, 0.0], [math.log(3), 0.0]) == pytest.approx(0.5 * math.log(4 / 3))
    # KL(Q||P) = 3/4 ln(0.75/0.5) + 1/4 ln(0.25/0.5) = 3/4 ln(3/2) - 1/4 ln 2
    expected = 0.75 * math.log(1.5) - 0.25 * math.log(2)
    assert kl_divergence([math.log(3), 0.0], [0.0, 0.0]) == pytest.approx(expected)


def test_kl_is_stable_for_large_logits_and_float16_input():
    # P ~ one-hot on class 0, Q ~ one-hot on class 1: KL ~ 1000 nats, must not overflow to inf/nan
    assert kl_divergence([1000.0, 0.0], [0.0, 1000.0]) == pytest.approx(1000.0)
    p16 = np.array([3.0, 1.0, -2.0], dtype=np.float16)
    assert kl_divergence(p16, p16) == pytest.approx(0.0, abs=1e-12)


def test_kl_masked_logits():
    # P = (1, 0) ignores the masked class; Q = (1/2, 1/2): KL = ln 2
    assert kl_divergence([0.0, -np.inf], [0.0, 0.0]) == pytest.approx(math.log(2))
    assert kl_divergence([0.0, 0.0], [0.0, -np.inf]) == math.inf


@pytest.mark.parametrize(
    ("p", "q", "match"),
    [
        ([0.0, 1.0], [0.0, 1.0, 2.0], "shapes differ"),
        ([[0.0, 1.0]], [[0.0, 1.0]], "1-D"),
        ([], [], "1-D"),
        ([0.0, np.nan], [0.0, 1.0], "NaN"),
        ([-np.inf, -np.inf], [0.0, 1.0], "-inf everywhere"),
    ],
)
def test_kl_rejects_bad_input(p, q, match):
    with pytest.raises(ValueError, match=match):
        kl_divergence(p, q)


def test_median_p90_of_1_to_10():
    # median of 1..10 = (5 + 6) / 2; p90 linear: rank 0.9 * 9 = 8.1 -> 9 + 0.1 * (10 - 9) = 9.1
    assert median_p90(range(1, 11)) == {"n": 10, "median": pytest.approx(5.5), "p90": pytest.approx(9.1)}
    assert median_p90([2.0]) == {"n": 1, "median": 2.0, "p90": 2.0}


@pytest.mark.parametrize("values", [[], [1.0, float("nan")], [[1.0, 2.0]]])
def test_median_p90_rejects_bad_values(values):
    with pytest.raises(ValueError, match="values"):
        median_p90(values)


def test_median_ratio_is_median_of_per_item_ratios():
    # ratios 1, 4, 3 -> median 3 (whereas the ratio of medians would be 4 / 1 = 4)
    assert median_ratio([1.0, 4.0, 9.0], [1.0, 1.0, 3.0]) == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("num", "den", "match"),
    [
        ([1.0, 2.0], [1.0], "length mismatch"),
        ([1.0], [0.0], "positive"),
        ([], [], "non-empty"),
    ],
)
def test_median_ratio_rejects_bad_input(num, den, match):
    with pytest.raises(ValueError, match=match):
        median_ratio(num, den)


def test_spearman_is_one_for_any_increasing_map_and_its_interval_brackets_it():
    rng = np.random.default_rng(0)
    x = rng.normal(size=200)
    assert spearman(x, np.exp(3 * x)) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    y = x + rng.normal(scale=2.0, size=200)  # a weak monotone relation
    lo, hi = spearman_ci(y, x)
    assert -1 < lo < spearman(y, x) < hi < 1
    with pytest.raises(ValueError, match="x has 3 values, y has 2"):
        spearman([1, 2, 3], [1, 2])
