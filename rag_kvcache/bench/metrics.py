"""Answer-quality and latency metrics: SQuAD F1/EM, Rouge-L, exact-string containment, KL divergence,
teacher-forced fidelity, bootstrap confidence intervals, robust summaries."""

from __future__ import annotations

import functools
import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

if TYPE_CHECKING:
    from rouge_score.rouge_scorer import RougeScorer

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD v1.1 normalisation: lowercase, drop punctuation and articles, collapse whitespace."""
    no_punc = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES_RE.sub(" ", no_punc).split())


def f1_score(prediction: str, ground_truth: str) -> float:
    """SQuAD v1.1 token F1 of normalised strings; 0.0 when they share no token (even if both are empty)."""
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(ground_truth).split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _require_answers(answers: Sequence[str]) -> None:
    if isinstance(answers, str) or len(answers) == 0:
        raise ValueError(f"answers must be a non-empty sequence of strings, got {answers!r}")


def max_f1(prediction: str, answers: Sequence[str]) -> float:
    """Best token F1 of `prediction` over all reference `answers`."""
    _require_answers(answers)
    return max(f1_score(prediction, answer) for answer in answers)


def contains_answer(prediction: str, answers: Sequence[str]) -> bool:
    """Whether any normalised reference answer occurs, on word boundaries, in the normalised prediction."""
    _require_answers(answers)
    pred = f" {normalize_answer(prediction)} "
    return any(f" {normalize_answer(answer)} " in pred for answer in answers if normalize_answer(answer))


@functools.lru_cache(maxsize=2)
def _rouge_l_scorer(stem: bool) -> RougeScorer:
    from rouge_score import rouge_scorer  # deferred: pulls in nltk (~2 s import)

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=stem)


def rouge_l(prediction: str, reference: str, stem: bool = True) -> float:
    """Rouge-L F-measure (Google `rouge-score`; lowercased ASCII alphanumeric tokens, Porter-stemmed)."""
    return float(_rouge_l_scorer(stem).score(reference, prediction)["rougeL"].fmeasure)


def _as_logits(logits: ArrayLike, name: str) -> np.ndarray:
    arr = np.asarray(logits, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D logit vector, got shape {arr.shape}")
    if np.isnan(arr).any() or np.isposinf(arr).any():
        raise ValueError(f"{name} contains NaN or +inf: {arr}")
    if np.isneginf(arr).all():
        raise ValueError(f"{name} is -inf everywhere: no probability mass")
    return arr


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def kl_divergence(p_logits: ArrayLike, q_logits: ArrayLike) -> float:
    """KL(P || Q) in nats between softmax(p_logits) and softmax(q_logits), computed in float64."""
    p = _as_logits(p_logits, "p_logits")
    q = _as_logits(q_logits, "q_logits")
    if p.shape != q.shape:
        raise ValueError(f"logit shapes differ: p {p.shape} vs q {q.shape}")
    log_p, log_q = _log_softmax(p), _log_softmax(q)
    support = np.isfinite(log_p)  # terms with p == 0 contribute 0
    return float(np.sum(np.exp(log_p[support]) * (log_p[support] - log_q[support])))


def _as_finite_1d(values: ArrayLike, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains non-finite values: {arr}")
    return arr


def median_p90(values: ArrayLike) -> dict[str, float]:
    """Median and 90th percentile (linear interpolation) of `values`, plus their count."""
    arr = _as_finite_1d(values, "values")
    return {
        "n": int(arr.size),
        "median": float(np.median(arr)),
        "p90": float(np.percentile(arr, 90, method="linear")),
    }


def median_ratio(numerators: ArrayLike, denominators: ArrayLike) -> float:
    """Median of per-item ratios, e.g. speedup = median over questions of ttft_full / ttft_method."""
    num = _as_finite_1d(numerators, "numerators")
    den = _as_finite_1d(denominators, "denominators")
    if num.shape != den.shape:
        raise ValueError(f"length mismatch: {num.size} numerators vs {den.size} denominators")
    if (den <= 0).any():
        raise ValueError(f"denominators must be positive, got {den}")
    return float(np.median(num / den))


def _log_softmax_rows(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def teacher_forced(reference_logits: ArrayLike, logits: ArrayLike, answer_ids: Sequence[int]) -> dict[str, float]:
    """Fidelity of a method to the reference over the reference's own answer forced through both.

    `reference_logits` and `logits` [T, V] are the next-token logits at each of the answer's T
    positions. Returns, in nats: `tf_kl`, the mean over positions of KL(reference || method);
    `tf_top1`, the fraction of positions whose argmax is the answer's token; `tf_logp_delta`, the
    method's mean log-probability of the answer tokens minus the reference's; `first_token_kl`, the
    KL at the first position alone.
    """
    ref = np.asarray(reference_logits, dtype=np.float64)
    mine = np.asarray(logits, dtype=np.float64)
    ids = np.asarray(answer_ids, dtype=np.int64)
    if ref.ndim != 2 or ref.shape != mine.shape or ref.shape[0] != ids.size or ids.size == 0:
        raise ValueError(
            f"need [T, V] logits of equal shape for T = {ids.size} > 0 answer tokens, got {ref.shape} and {mine.shape}"
        )
    if not (np.isfinite(ref).all() and np.isfinite(mine).all()):
        raise ValueError("teacher-forced logits contain NaN or inf")
    log_ref, log_mine = _log_softmax_rows(ref), _log_softmax_rows(mine)  # [T, V]
    kl = (np.exp(log_ref) * (log_ref - log_mine)).sum(axis=-1)  # [T]
    rows = np.arange(ids.size)
    return {
        "tf_kl": float(kl.mean()),
        "tf_top1": float((mine.argmax(axis=-1) == ids).mean()),
        "tf_logp_delta": float(log_mine[rows, ids].mean() - log_ref[rows, ids].mean()),
        "first_token_kl": float(kl[0]),
    }


def bootstrap_ci(values: ArrayLike, level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of `values` (resampled with replacement)."""
    arr = _as_finite_1d(values, "values")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, arr.size, size=(resamples, arr.size))].mean(axis=1)  # [resamples]
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def spearman(x: ArrayLike, y: ArrayLike) -> float:
    """Spearman's rank correlation of `x` and `y` (ranks by order; ties broken by position)."""
    a, b = _as_finite_1d(x, "x"), _as_finite_1d(y, "y")
    if a.size != b.size:
        raise ValueError(f"x has {a.size} values, y has {b.size}")
    return float(np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1])


def spearman_ci(
    x: ArrayLike, y: ArrayLike, level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of `spearman(x, y)`, the pairs resampled with replacement
    (resamples in which either side is constant are skipped)."""
    a, b = _as_finite_1d(x, "x"), _as_finite_1d(y, "y")
    rng = np.random.default_rng(seed)
    stats = [
        spearman(a[i], b[i])
        for i in rng.integers(0, a.size, size=(resamples, a.size))
        if np.ptp(a[i]) > 0 and np.ptp(b[i]) > 0
    ]
    if not stats:
        raise ValueError(f"no resample of {a.size} pairs varies on both sides: no rank correlation to bound")
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(stats, [tail, 100 - tail])
    return float(low), float(high)
