"""Relevance checks that read the chunk caches: an agent's "is this chunk relevant?" step, one chunk at a time,
at the cost of the check's question alone.

A check's prompt is the index's own layout of one chunk, `[system prefix][chunk][check question]`. The system
prefix and the chunk are cached exactly (the chunk computed behind the prefix at indexing time, the default
`chunk_prefill`), so the `prefix` method computes only the check question's tokens, and what it computes is
what a full prefill of that prompt computes. The verdict is read from the first answer token's distribution:
the probability of "yes" against "no", with no decoding. Each chunk is checked on its own (one small prefill
each, in turn); batching the checks into one forward is not built.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import FusionConfig
from .errors import RagKVCacheError
from .generator import FusedGenerator
from .retrieval.chunk_index import ChunkRecord

CHECK = ("Is the document above relevant to answering this question? Question: {question}\n"
         "Answer with yes or no.")
EXACT = FusionConfig(method="prefix")


@dataclass(frozen=True)
class Verdict:
    """One chunk's check: whether it is relevant, the model's probability of "yes" (against "no"), how many
    prompt tokens were computed (the rest read from the chunk's cache) and the seconds it took."""

    chunk: ChunkRecord
    relevant: bool
    p_yes: float
    computed_tokens: int
    seconds: float


class RelevanceCheck:
    """Asks the model whether each chunk is relevant to a question, reading the chunks' caches."""

    def __init__(self, generator: FusedGenerator, template: str = CHECK, threshold: float = 0.5) -> None:
        if "{question}" not in template:
            raise RagKVCacheError(f"the check template must contain '{{question}}', got {template!r}")
        if not 0.0 <= threshold <= 1.0:
            raise RagKVCacheError(f"threshold must be in [0, 1], got {threshold!r}")
        self.generator = generator
        self.template = template
        self.threshold = threshold
        tokenizer = generator.adapter.tokenizer
        self.yes, self.no = (_single_tokens(tokenizer, words) for words in (("yes", "Yes"), ("no", "No")))

    def __call__(self, question: str, chunks: Sequence[ChunkRecord]) -> list[Verdict]:
        """A verdict for each chunk, in order."""
        fmt, tokenizer = self.generator.index.format, self.generator.adapter.tokenizer
        check = fmt.question_ids(tokenizer, self.template.format(question=question.strip()))  # refuses an empty question
        verdicts = []
        for chunk in chunks:
            t0 = time.perf_counter()
            fused = self.generator.fuse(fmt.segments([chunk.token_ids], check), EXACT)
            p = torch.softmax(fused.result.logits.float(), dim=-1)  # [V]
            yes, no = p[self.yes].sum(), p[self.no].sum()  # [], []
            p_yes = float(yes / (yes + no).clamp_min(torch.finfo(torch.float32).tiny))
            verdicts.append(Verdict(chunk, p_yes >= self.threshold, p_yes,
                                    fused.result.recomputed_tokens + fused.cache_computed_tokens,
                                    time.perf_counter() - t0))
        return verdicts


def _single_tokens(tokenizer, words: Sequence[str]) -> list[int]:
    """The ids of the words that are one token, alone or after a space (how an answer can begin)."""
    ids = {ids[0] for w in words for text in (w, f" {w}")
           if len(ids := tokenizer(text, add_special_tokens=False).input_ids) == 1}
    if not ids:
        raise RagKVCacheError(f"none of {list(words)} is a single token of this tokenizer: no verdict can be read")
    return sorted(ids)
