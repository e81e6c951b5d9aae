"""Relevance checks that read the chunk caches: an agent's "is this chunk relevant?" step for every retrieved
chunk at once, at the cost of the check's question alone.

A check's prompt is the index's own layout of one chunk, `[system prefix][chunk][check question]`. The
system prefix and the chunk are read from their caches, the chunk's keys re-rotated to its place as the `reuse`
method reads them, and only the check question's tokens are computed: the chunks' caches go into the slots of
one `DecodePool` and the question is fed to all of them in one batched forward (`ModelAdapter.extend_rows`: the
weights read once, each row attending over its own chunk alone). Where the chunk's cache was computed behind the
prefix alone (`chunk_prefill="behind_prefix"`, the first of the default `cached_neighbours` index's two caches
of every chunk, the first chunk of each group of `grouped` caches) the verdict is what a full prefill of the
check prompt gives; a cache computed in another context (behind its group's earlier chunks) makes it `reuse`'s
approximation. With `exact=True` such a chunk's tokens are computed
with the question instead, as the `prefix` method would: every verdict exact, chunks of one length sharing a
forward. The verdict is read from the first answer token's distribution: the probability of "yes" against "no",
with no decoding.

A passage given as text rather than as an indexed chunk is computed with the question, its text tokenized as
text (control tokens spelt out), never read from a cache: a cache vouches only for the chunk it was computed
from. Every check prompt is bounded (`max_prompt_tokens`, and the model's context): a longer question or
passage is refused with `PromptTooLongError` before anything is computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import takewhile

import torch

from ..engine.decoding import DecodeCache, DecodePool
from ..engine.fusion import FusionInput, SegmentKV
from ..engine.ops import rotate_keys, rotation
from ..engine.prompt import Segment
from ..errors import RagKVCacheError
from ..index import KVIndex
from ..retrieval.records import ChunkRecord
from .answers import PromptTooLongError
from .generator import FusedGenerator

RELEVANCE_CHECK = (
    "Is the document above relevant to answering this question? Question: {question}\nAnswer with yes or no."
)
MAX_CHECK_PROMPT_TOKENS = 8192  # the longest check prompt by default: the server's default limit on a prompt


@dataclass(frozen=True)
class Verdict:
    """One passage's check: whether it is relevant, the model's probability of "yes" (against "no") and how many
    prompt tokens were computed (the rest read from the chunk's cache). `chunk`: the indexed chunk checked, or
    the text checked (all of it computed)."""

    chunk: ChunkRecord | str
    relevant: bool
    p_yes: float
    computed_tokens: int


class RelevanceCheck:
    """Asks the model whether each chunk is relevant to a question, reading the chunks' caches (`exact`: only
    the caches a full prefill of the check prompt would compute; the other chunks computed). A check prompt
    longer than `max_prompt_tokens` (or the model's context) is refused."""

    def __init__(
        self,
        generator: FusedGenerator,
        template: str = RELEVANCE_CHECK,
        threshold: float = 0.5,
        exact: bool = False,
        max_prompt_tokens: int = MAX_CHECK_PROMPT_TOKENS,
    ) -> None:
        if "{question}" not in template:
            raise RagKVCacheError(f"the check template must contain '{{question}}', got {template!r}")
        if not 0.0 <= threshold <= 1.0:
            raise RagKVCacheError(f"threshold must be in [0, 1], got {threshold!r}")
        if max_prompt_tokens < 1:
            raise RagKVCacheError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens!r}")
        self.generator = generator
        self.template = template
        self.threshold = threshold
        self.exact = exact
        self.max_prompt_tokens = min(max_prompt_tokens, generator.layers.context_length)
        tokenizer = generator.adapter.tokenizer
        self.yes, self.no = (_single_tokens(tokenizer, words) for words in (("yes", "Yes"), ("no", "No")))

    def __call__(self, question: str, chunks: Sequence[ChunkRecord | str]) -> list[Verdict]:
        """A verdict for each passage, in order: an indexed chunk read from its cache, a text computed. The
        passages whose check prompts leave the same number of tokens to compute (all of them unless `exact`)
        are checked in one batched forward. `PromptTooLongError` (nothing computed) when the question, or
        a passage with it, is over `max_prompt_tokens`."""
        generator, fmt = self.generator, self.generator.index.format
        check = fmt.question_ids(
            generator.adapter.tokenizer, self.template.format(question=question.strip())
        )  # refuses an empty question
        self._bound(len(fmt.prefix_ids) + len(check), "the question")
        prompts = [self._segments(chunk, check, i) for i, chunk in enumerate(chunks)]
        pool = DecodePool()
        rows: list[DecodeCache] = []
        tails: list[list[int]] = []  # per chunk, the tokens after its cached head: computed
        computed: list[int] = []
        for segments in prompts:
            keys, values, n_opened = _cached_head(generator.index, segments, self.exact)
            tails.append([t for seg in segments for t in seg.ids][keys[0].shape[1] :])
            rows.append(pool.admit(keys, values, room=len(tails[-1])))
            computed.append(len(tails[-1]) + n_opened)
        p_yes = [0.0] * len(chunks)
        for width in sorted({len(t) for t in tails}):
            batch = [i for i, t in enumerate(tails) if len(t) == width]
            logits = generator.adapter.extend_rows([tails[i] for i in batch], [rows[i] for i in batch])  # [B, V]
            for i, value in zip(batch, self.p_yes(logits).tolist()):
                p_yes[i] = value
        return [Verdict(chunk, p >= self.threshold, p, n) for chunk, p, n in zip(chunks, p_yes, computed)]

    def _segments(self, chunk: ChunkRecord | str, check: tuple[int, ...], i: int) -> list[Segment]:
        """The check prompt of passage `i`: an indexed chunk's cacheable, a text's tokenized as text and computed."""
        fmt = self.generator.index.format
        if isinstance(chunk, ChunkRecord):
            segments = fmt.segments([chunk.token_ids], check)
        else:
            text = self.generator.adapter.tokenizer(chunk, add_special_tokens=False, split_special_tokens=True)
            segments = [
                replace(s, cacheable=False) if s.label == "chunk0" else s
                for s in fmt.segments([tuple(text.input_ids)], check)
            ]
        self._bound(sum(len(s.ids) for s in segments), f"passage {i} with the question")
        return segments

    def _bound(self, n_tokens: int, what: str) -> None:
        """Refuse a check prompt of `n_tokens` over `max_prompt_tokens` (`what` makes it so, for the message)."""
        if n_tokens > self.max_prompt_tokens:
            raise PromptTooLongError(
                f"{what} makes a check prompt of {n_tokens} tokens, over the limit of {self.max_prompt_tokens} "
                "tokens (max_prompt_tokens, or the model's context)"
            )

    def p_yes(self, logits: torch.Tensor) -> torch.Tensor:
        """The probability of "yes" against "no" [B] from the first answer token's logits [B, V]."""
        p = torch.softmax(logits, dim=-1)  # [B, V]
        yes, no = p[:, self.yes].sum(-1), p[:, self.no].sum(-1)  # [B], [B]
        return yes / (yes + no).clamp_min(torch.finfo(torch.float32).tiny)  # [B]


def _cached_head(
    index: KVIndex, segments: Sequence[Segment], exact: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """The per-layer K/V [H_kv, N, D] of a check prompt's leading cached segments, keys re-rotated to their
    places (`exact`: only the leading caches that are exact there, `SegmentKV.exact`), and the tokens whose caches
    the index computed now (missing entries, recomputed when opened)."""
    caches = index.caches.open(segments)
    parts = FusionInput.build(segments, caches.sources, caches.contexts).parts
    read: Callable[[SegmentKV], bool] = (lambda p: p.exact) if exact else (lambda p: p.kv is not None)
    head = [(p.start, p.kv) for p in takewhile(read, parts) if p.kv is not None]  # every part read has a cache
    adapter = index.adapter
    layout, device = adapter.layout, adapter.device
    turns = {  # the same rotation for every layer: made once
        i: rotation(start - kv.position, adapter.inv_freq.to(device))  # cos, sin [1, D]
        for i, (start, kv) in enumerate(head)
        if kv.position != start
    }
    none = torch.empty(layout.n_kv_heads, 0, layout.head_dim, dtype=layout.dtype, device=device)  # [H_kv, 0, D]
    keys, values = [], []
    for layer in range(layout.n_layers):
        layers = [kv.layer(layer) for _, kv in head]  # [H_kv, T, D] x 2 each
        turned = [
            rotate_keys(k.to(device), *turns[i]) if i in turns else k.to(device) for i, (k, _) in enumerate(layers)
        ]
        keys.append(torch.cat([none, *turned], 1))  # [H_kv, N, D]
        values.append(torch.cat([none, *(v.to(device) for _, v in layers)], 1))  # [H_kv, N, D]
    return keys, values, caches.computed_tokens


def _single_tokens(tokenizer, words: Sequence[str]) -> list[int]:
    """The ids of the words that are one token, alone or after a space (how an answer can begin)."""
    ids = {
        ids[0]
        for w in words
        for text in (w, f" {w}")
        if len(ids := tokenizer(text, add_special_tokens=False).input_ids) == 1
    }
    if not ids:
        raise RagKVCacheError(f"none of {list(words)} is a single token of this tokenizer: no verdict can be read")
    return sorted(ids)
