"""A benchmark run's summary: per variant, medians, bootstrap CIs, paired differences from the baseline
and planted-fact accuracy over the recorded questions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .fidelity import FIDELITY_KEYS
from .metrics import bootstrap_ci, median_p90, median_ratio
from .variants import NOISE_FLOOR, REFERENCE, Variant


def _mean(values: Sequence[float | bool | None]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return float(np.mean(present)) if present else None


def _stage_medians(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    names = dict.fromkeys(name for r in records for name in r["stages"])
    return {name: float(np.median([r["stages"].get(name, 0.0) for r in records])) for name in names}


def _ttft_over_share(records: Sequence[Mapping[str, Any]], reference: Mapping[str, Mapping[str, Any]]) -> float | None:
    """Median over questions of a method's TTFT over its share of full's: its compute fraction times full's
    TTFT on the same question (1.0: as fast per token-layer as a full prefill; above it, the fixed costs
    of fusing and the work a token-layer count misses). None if a question's fraction is 0."""
    shares = [r["compute_fraction"] * reference[r["id"]]["ttft_s"] for r in records]
    return median_ratio([r["ttft_s"] for r in records], shares) if all(s > 0 for s in shares) else None


def _with_ci(name: str, values: Sequence[float | bool | None]) -> dict[str, Any]:
    """`name`: the mean of the present values, `name_ci`: its bootstrap CI (both None when none is present)."""
    present = [float(v) for v in values if v is not None]
    return {
        name: float(np.mean(present)) if present else None,
        f"{name}_ci": list(bootstrap_ci(present)) if present else None,
    }


def _paired(name: str, mine: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """`name_diff`: mean over questions of (this - baseline), `name_diff_ci`: its bootstrap CI."""
    diffs = [mine[q] - baseline[q] for q in mine if q in baseline and mine[q] is not None and baseline[q] is not None]
    return {
        f"{name}_diff": float(np.mean(diffs)) if diffs else None,
        f"{name}_diff_ci": list(bootstrap_ci(diffs)) if diffs else None,
    }


def _fidelity_columns(
    scores: Sequence[Mapping[str, Any]], baseline: Sequence[Mapping[str, Any]] | None
) -> dict[str, Any]:
    """Each fidelity measure's mean and CI over `scores` (one per question, with its `id`), and its
    paired difference from `baseline`'s scores of the same questions."""
    out: dict[str, Any] = {}
    for key in FIDELITY_KEYS:
        out |= _with_ci(key, [s[key] for s in scores])
        if baseline is not None:
            out |= _paired(key, {s["id"]: s[key] for s in scores}, {b["id"]: b[key] for b in baseline})
    return out


def _planted(mine: Sequence[Mapping[str, Any]], reference: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Exact-string datasets: `planted_accuracy` among the questions full answers correctly (with its
    CI and how many there are), `planted_distractor` the share of those answered with a distractor
    (another question's fact in the prompt), and `exact_accuracy` over all questions. Where some facts sit
    first in the prompt (left where retrieval ranked them), the accuracy split by the fact's place: first (read
    exactly) or later."""
    if all(r["exact_hit"] is None for r in mine):
        return {}
    eligible = [r for r in mine if reference[r["id"]]["exact_hit"]]
    split: dict[str, Any] = {}
    if any(r.get("evidence_rank") == 0 for r in eligible):
        for place, here in (("first", lambda rank: rank == 0), ("later", lambda rank: rank is not None and rank > 0)):
            hits = [r["exact_hit"] for r in eligible if here(r.get("evidence_rank"))]
            split |= {**_with_ci(f"planted_accuracy_{place}", hits), f"planted_n_{place}": len(hits)}
    return {
        **_with_ci("planted_accuracy", [r["exact_hit"] for r in eligible]),
        "planted_n": len(eligible),
        **split,
        **_with_ci("planted_distractor", [r.get("distractor_hit") for r in eligible]),
        "exact_accuracy": _mean([r["exact_hit"] for r in mine]),
    }


def summarise(
    records: Sequence[Mapping[str, Any]], variants: Sequence[Variant], baseline: Variant | None = None
) -> list[dict[str, Any]]:
    """One entry per variant: latency percentiles, paired speedup over `full`, fidelity to `full`
    (means, bootstrap CIs, paired differences from `baseline`), secondary quality metrics; then the
    noise-floor entry (`full` with bfloat16-rounded K/V), which has fidelity columns only."""
    reference = {r["id"]: r for r in records if r["label"] == REFERENCE}
    base = [r for r in records if baseline is not None and r["label"] == baseline.label] or None
    summary = []
    for variant in variants:
        mine = [r for r in records if r["label"] == variant.label]
        if not mine:
            continue
        ttft = median_p90([r["ttft_s"] for r in mine])
        summary.append(
            {
                "method": variant.method,
                "params": dict(variant.params),
                "caches": variant.caches,
                "n": ttft["n"],
                "ttft_median_s": ttft["median"],
                "ttft_p90_s": ttft["p90"],
                "speedup_vs_full": median_ratio(
                    [reference[r["id"]]["ttft_s"] for r in mine], [r["ttft_s"] for r in mine]
                ),
                "ttft_over_share": _ttft_over_share(mine, reference),
                "baseline": None if base is None or baseline is None else baseline.label,
                **_fidelity_columns(mine, base),
                **_planted(mine, reference),
                "f1_gold": _mean([r["f1_gold"] for r in mine]),
                "rouge_l_gold": _mean([r["rouge_l_gold"] for r in mine]),
                "f1_vs_full": _mean([r["f1_vs_full"] for r in mine]),
                "recompute_fraction": _mean([r["recompute_fraction"] for r in mine]),
                "chunk_tokens_matched": _mean([r.get("chunk_tokens_matched") for r in mine]),
                "compute_fraction": _mean([r["compute_fraction"] for r in mine]),
                "retrieval_median_s": float(np.median([r["retrieval_s"] for r in mine])),
                "prompt_tokens_median": float(np.median([r["prompt_tokens"] for r in mine])),
                "stage_median_s": _stage_medians(mine),
            }
        )
    floors = [{"id": qid, **r["noise_floor"]} for qid, r in reference.items() if "noise_floor" in r]
    if floors:
        summary.append(
            {
                "method": REFERENCE,
                "params": dict(NOISE_FLOOR),
                "n": len(floors),
                "noise_floor": True,
                "baseline": None if base is None or baseline is None else baseline.label,
                **_fidelity_columns(floors, base),
            }
        )
    return summary


# ---- resuming ------------------------------------------------------------------------------------------


def headline(records: Sequence[Mapping[str, Any]], variants: Sequence[Variant]) -> dict[str, str]:
    """Progress-bar postfix: the running speedup and teacher-forced KL of each method at its default
    setting (its first variant)."""
    firsts = {v.method: v for v in reversed(variants) if v.method != REFERENCE}
    out = {}
    for method, variant in reversed(firsts.items()):
        mine = {r["id"]: r for r in records if r["label"] == variant.label}
        kl = _mean([r["tf_kl"] for r in mine.values()])
        speedup = median_ratio(
            [r["ttft_s"] for r in records if r["label"] == REFERENCE and r["id"] in mine],
            [r["ttft_s"] for r in mine.values()],
        )
        out[method] = f"{speedup:.1f}x" + ("" if kl is None else f" kl {kl:.3g}")
    return out


def evidence(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Planted facts: how many questions' fact-holding chunk retrieval found (placed at its rank)."""
    planted = {
        r["id"]: r["evidence_retrieved_rank"] for r in records if r["label"] == REFERENCE and r["exact_hit"] is not None
    }
    if not planted:
        return {}
    return {"planted_questions": len(planted), "evidence_retrieved": sum(rank is not None for rank in planted.values())}
