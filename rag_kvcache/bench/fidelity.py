"""Fidelity to `full`, teacher-forced: full's greedy answer forced through a variant's fused cache and
scored position by position (`metrics.teacher_forced`); `full` with its K/V rounded to bfloat16 is the
noise floor.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch

from ..config import Config, GenerationConfig
from ..engine.generation import Decoder, sample_token, teacher_forced_logits
from ..engine.model import ModelAdapter
from ..engine.prompt import Segment
from ..query.answers import Fused
from ..query.generator import FusedGenerator
from .metrics import teacher_forced
from .variants import REFERENCE, Variant

log = logging.getLogger(__name__)

FIDELITY_KEYS = ("tf_kl", "tf_top1", "tf_logp_delta", "first_token_kl")


def greedy_answer_ids(adapter: ModelAdapter, fused: Fused, generation: GenerationConfig) -> list[int]:
    """The token ids of the greedy answer decoded from `fused` (what `ask` answers with, as ids)."""
    greedy = replace(generation, temperature=0.0)
    result = fused.result
    steps = Decoder(adapter, greedy).steps(
        result.keys, result.values, result.logits, sample_token(result.logits, greedy, None)
    )
    return [step.token_id for step in steps if step.token_id is not None]


def bfloat16_rounded(fused: Fused, adapter: ModelAdapter, last_token: int) -> tuple[list, list, torch.Tensor]:
    """The noise floor: `fused`'s K/V rounded to bfloat16 and back, and the last prompt token's logits
    recomputed over the rounded cache of the tokens before it [V]."""
    keys = [k.to(torch.bfloat16).to(k.dtype) for k in fused.result.keys]  # L x [H_kv, N, D]
    values = [v.to(torch.bfloat16).to(v.dtype) for v in fused.result.values]  # L x [H_kv, N, D]
    before = adapter.make_cache([k[:, :-1] for k in keys], [v[:, :-1] for v in values])
    first = adapter.decode([last_token], before, fused.prompt_tokens - 1)[-1]  # [V]
    return keys, values, first


def fidelity(
    generators: Mapping[str | None, FusedGenerator],
    segments: Sequence[Segment],
    variants: Sequence[Variant],
    config: Config,
) -> tuple[dict[Variant, Mapping[str, float | None]], Mapping[str, float | None]]:
    """Teacher-forced scores of every variant, and of the bfloat16 noise floor, against `full`: full's
    greedy answer forced through each variant's fused cache (`fuse` is deterministic: the cache the
    timed answer used). All None when full answers with no token at all."""
    generator = generators[None]
    adapter = generator.adapter
    reference = generator.fuse(segments, Variant(REFERENCE).fusion(config.query.fusion))
    answer_ids = greedy_answer_ids(adapter, reference, config.query.generation)
    if not answer_ids:
        log.warning("full answered with no token: no teacher-forced scores for this question")
        return {v: dict.fromkeys(FIDELITY_KEYS) for v in variants}, dict.fromkeys(FIDELITY_KEYS)

    def forced(keys: list, values: list, first: torch.Tensor) -> np.ndarray:
        return teacher_forced_logits(adapter, keys, values, first, answer_ids).cpu().numpy()  # [T, V]

    ref = reference.result
    ref_logits = forced(ref.keys, ref.values, ref.logits)  # [T, V]
    scores: dict[Variant, Mapping[str, float | None]] = {}
    for v in variants:
        fused = (
            reference if v == Variant(REFERENCE) else generators[v.caches].fuse(segments, v.fusion(config.query.fusion))
        )
        scores[v] = teacher_forced(
            ref_logits, forced(fused.result.keys, fused.result.values, fused.result.logits), answer_ids
        )
    floor = teacher_forced(ref_logits, forced(*bfloat16_rounded(reference, adapter, segments[-1].ids[-1])), answer_ids)
    return scores, floor
