"""Prompts laid out over an index: what a front end sends (a string, chat turns, chunks by id) becomes the
segments the generator fuses, each indexed chunk found in the prompt by its token ids and read from its
cache (`find_chunks`), the prompt's head read from the system prefix's cache or one of its own
(`cached_head`), and a prompt template's recurring text learned and read from a cache (`template_text`).
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from typing import cast

from ..config import FusionConfig
from ..engine.methods import get_method
from ..engine.prompt import (
    ChatTurn,
    ChunkPart,
    Segment,
    StoredRun,
    chat_segments,
    prefix_head,
    render_prompt,
    with_runs,
)
from ..index import KVIndex
from ..retrieval.matching import MIN_SPAN
from ..retrieval.records import ChunkRecord
from ..retrieval.templates import TemplateSpans

log = logging.getLogger(__name__)


def cached_head(segments: Sequence[Segment], tokenizer, min_tokens: int = MIN_SPAN) -> list[Segment]:
    """`segments` with the prompt's head (the tokens before its first chunk) cached at position 0, but
    for its end where the first chunk's text begins, when some of it would be computed and at least
    `min_tokens` of it can be cached.

    A pipeline's own instructions (a prompt template's system message, e.g. LangChain's tutorial
    chain's) head every prompt it sends and are no indexed text. Their cache at position 0 is
    exact, as the system prefix's is: the index computes and stores it the first time (a cacheable
    segment at position 0 has no context), and every later prompt with the same head reads it, as
    prefix caching does. The head's last tokens are chunk text that did not match, re-tokenised, and
    the token before it, which may have merged with it: those differ from chunk to chunk, so they stay
    computed and prompts with the same instructions and other chunks share one cached head. Where the
    chunk text begins is found in text (`_head_end`), not by the first run's offset: that run may
    start deep in a chunk whose earlier text is not in the prompt (another chunk with the same
    sentences matched first, or a template that stripped the chunk's edge), and cutting the head by
    its offset cut into the instructions, a different head for every prompt. A prompt without a chunk
    is left as it is (it is answered as `full`).
    """
    first = next((i for i, seg in enumerate(segments) if seg.cacheable and seg.label != "prefix"), None)
    if not first or all(seg.cacheable for seg in segments[:first]):
        return list(segments)
    head = tuple(t for seg in segments[:first] for t in seg.ids)
    run = segments[first]
    n = _head_end(head, run.stored[: run.offset], tokenizer) - 1
    if n < min_tokens:
        return list(segments)
    return [Segment(head[:n], True, "prefix"), Segment(head[n:], False, "text"), *segments[first:]]


def warn_unquoted(segments: Sequence[Segment], fusion: FusionConfig) -> None:
    """Log a warning when `fusion`'s method reads chunk caches and the prompt to be answered quotes no
    indexed chunk (`PromptLayout.find_chunks` found none): it is computed in full."""
    if get_method(fusion.method).reads_cache and not _quotes_chunks(segments):
        log.warning(
            "%s found no indexed text in the prompt (%d tokens): no chunk of the index occurs in it token for "
            "token, so it is computed in full",
            fusion.method,
            n_tokens(segments),
        )


def _quotes_chunks(segments: Sequence[Segment]) -> bool:
    return any(s.cacheable and s.label != "prefix" for s in segments)


def system_turns(turns: Sequence[ChatTurn]) -> int:
    """How many turns the chat begins with that are the system's (never dropped to fit)."""
    return next((i for i, turn in enumerate(turns) if turn.role != "system"), len(turns))


def n_tokens(segments: Sequence[Segment]) -> int:
    return sum(len(seg.ids) for seg in segments)


def prompt_ids(segments: Sequence[Segment]) -> tuple[int, ...]:
    """The prompt's token ids: its segments' end to end."""
    return tuple(t for seg in segments for t in seg.ids)


def segments_after(segments: Sequence[Segment], ids: tuple[int, ...], n: int, read_caches: bool) -> list[Segment]:
    """The segments of a prompt (its tokens `ids`) from position `n` on: those wholly after it as they are
    when `read_caches`, the one `n` cuts computed from `n` on (its cache was computed with the tokens before
    the cut); without `read_caches`, one computed segment."""
    if not read_caches:
        return [Segment(ids[n:], False, "text")]
    out: list[Segment] = []
    start = 0
    for seg in segments:
        end = start + len(seg.ids)
        if start >= n:
            out.append(seg)
        elif end > n:
            out.append(Segment(seg.ids[n - start :], False, seg.label))
        start = end
    return out


def _head_end(head: Sequence[int], unmatched: Sequence[int], tokenizer) -> int:
    """How many of the `head` tokens come before the chunk text that ends it: the text of the chunk's
    `unmatched` ids before its first run, as far as the head's text ends with it (character for
    character: the prompt may have re-tokenised or stripped it), is cut off at a token boundary."""

    def text(ids: Sequence[int]) -> str:
        return tokenizer.decode(ids, clean_up_tokenization_spaces=False)

    whole, chunk = text(head), text(unmatched)
    shared = next(
        (k for k in range(min(len(whole), len(chunk))) if whole[-1 - k] != chunk[-1 - k]), min(len(whole), len(chunk))
    )
    end = len(whole) - shared  # the head's text before the chunk's
    return bisect_right(range(len(head) + 1), end, key=lambda n: len(text(head[:n]))) - 1


class PromptLayout:
    """Lays prompts out over `index`'s chunks; learns the prompt templates it sees (`template_text`)."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self.tokenizer = index.model.tokenizer
        self.templates = TemplateSpans()  # learned from the prompts laid out here

    def prompt_segments(
        self, prompt: str | Sequence[Mapping[str, str]], fusion: FusionConfig | None = None
    ) -> list[Segment]:
        """The segments of any prompt, rendered and tokenised whole: its head a run of the system prefix
        where it agrees with it, then `find_chunks`."""
        ids = render_prompt(self.tokenizer, self.index.config.index.system_prompt, prompt)
        return self.find_chunks(prefix_head(ids, self.index.format.prefix_ids), fusion)

    def chat_segments(
        self, turns: Sequence[ChatTurn], chunks: Sequence[ChunkRecord] = (), fusion: FusionConfig | None = None
    ) -> list[Segment]:
        """The segments of a chat, as every front end builds them (the server, both integrations): `chunks`
        (named or retrieved) at the head of the last turn, which must be the user's; the turns laid out by
        `chat_segments` (chunk parts as their stored ids, text with control tokens spelt out), a head of text
        that agrees with the system prefix read as a run of its cache (`prefix_head`); then every indexed
        chunk quoted in their text found by its token ids (`find_chunks`)."""
        if chunks:
            if not turns or turns[-1].role != "user":
                raise ValueError(
                    "chunks go at the head of the last message, which must be a user message; it is "
                    f"{turns[-1].role if turns else 'missing'!r}"
                )
            parts = tuple(ChunkPart(record.token_ids, f"chunk:{record.id}") for record in chunks)
            turns = [*turns[:-1], ChatTurn("user", parts + tuple(turns[-1].parts))]
        segments = chat_segments(self.tokenizer, self.index.config.index.system_prompt, turns)
        if not segments[0].cacheable:  # text first (quoted documents, no chunk parts): its run of the system prefix
            segments = [*prefix_head(segments[0].ids, self.index.format.prefix_ids), *segments[1:]]
        return self.find_chunks(segments, fusion)

    def next_head(self, turns: Sequence[ChatTurn]) -> tuple[int, ...]:
        """The tokens every prompt that continues `turns` with a user message begins with."""
        a, b = (
            [
                t
                for seg in chat_segments(
                    self.tokenizer, self.index.config.index.system_prompt, [*turns, ChatTurn("user", (x,))]
                )
                for t in seg.ids
            ]
            for x in ("a", "b")
        )
        return tuple(a[: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))])

    def find_chunks(self, segments: Sequence[Segment], fusion: FusionConfig | None = None) -> list[Segment]:
        """`segments` with every run of an indexed chunk's ids inside their computed text made a slice
        of that chunk's cache (`ChunkIndex.match`), and the prompt's head before the first chunk made
        cacheable (`cached_head`). Whether any chunk was found is the caller's to say (`warn_unquoted`):
        prompts are laid out more often than they are answered (a chat's candidate cuts, a background
        preparation, every request vLLM sees)."""
        fusion = fusion or self.index.config.query.fusion
        matches = self.index.chunks.match(prompt_ids(segments))
        runs = [StoredRun(s.start, c.token_ids, s.offset, s.length, f"chunk:{c.id}") for s, c in matches]
        out = cached_head(with_runs(segments, runs), self.tokenizer)
        if fusion.template_text and _quotes_chunks(out):
            out = self._template_runs(out)
        return out

    def _template_runs(self, segments: list[Segment]) -> list[Segment]:
        """`segments` (a prompt with chunks found in it) with the template text after its last chunk read
        from a cache: the spans learned behind its head (`TemplateSpans`: text that recurs after the
        chunks of prompts with this head over other chunks) become cacheable runs where they occur in the tail,
        exact on token ids. The tail teaches the spans first, so the second prompt with a template reads
        it; a span's cache is computed behind the system prefix, as a chunk's, and stored in the index's
        store when the span is learned (a span that shrinks gets a new entry)."""
        last = max(i for i, seg in enumerate(segments) if seg.cacheable and seg.label != "prefix")
        head = segments[0].ids if segments[0].cacheable else ()
        start = sum(len(seg.ids) for seg in segments[: last + 1])
        tail = [t for seg in segments[last + 1 :] for t in seg.ids]
        chunks = frozenset(seg.stored for seg in segments[1 : last + 1] if seg.cacheable)
        if learned := self.templates.learn(head, chunks, tail):
            self.index.maker.precompute(learned, progress=False)
            log.info(
                "learned %d template span(s) of %s tokens after the chunks of prompts with a %d-token head",
                len(learned),
                [len(s) for s in learned],
                len(head),
            )
        spans = self.templates.find(head, tail)  # each span's chunk is the template span's own token ids
        stored = [cast(tuple[int, ...], s.chunk) for s in spans]
        runs = [
            StoredRun(start + s.start, ids, s.offset, s.length, f"template:{len(ids)}") for s, ids in zip(spans, stored)
        ]
        return with_runs(segments, runs)
