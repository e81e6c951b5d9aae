"""One fused prompt for an agent's two steps over the same retrieved chunks: "is each chunk relevant?" and
"answer from the relevant ones".

`SharedPrompt` fuses the answer's prompt over every retrieved chunk once (`FusedGenerator.fuse`, the index's
layout `[system prefix][chunk][separator][chunk]...[question]`). `check` asks the relevance question of each chunk
over that prompt's K/V: one `DecodePool` row a chunk, each hiding every other chunk, the separators and the
question (an attention mask, `DecodePool.admit`'s `hidden`), the check question computed for all rows in one
batched forward. `answer` decodes from the same K/V with the chunks judged irrelevant hidden (and the separators a
prompt without them would not have): only the question is computed again, since its K/V saw every chunk; when every
chunk is kept the fused prompt is decoded as it is. No chunk cache is opened twice and no chunk fused twice, which
the two steps on their own do (`RelevanceCheck` reads each chunk's cache, then the answer fuses the kept ones).

What it approximates, beside the fusion method's own approximation: a kept chunk's K/V are as they were fused
beside the hidden ones (a method that recomputes tokens computed them attending to the chunks before them; under
`full` they saw every earlier chunk), and every token keeps its place, so the question sits where it sat behind
all the chunks, with gaps where hidden ones are. A check sees its chunk where it sits in the answer's prompt, not
right after the system prefix where `RelevanceCheck` reads it. The answer's K/V are not the prompt's own, so the
conversation cache does not keep them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

import torch

from ..config import FusionConfig, GenerationConfig
from ..engine.decoding import DecodePool
from ..engine.generation import Decoder
from ..errors import RagKVCacheError
from ..retrieval.records import ChunkRecord
from .answers import Answer, Generation, PromptTooLongError, collect_answer
from .generator import FusedGenerator
from .layout import prompt_ids
from .relevance import RelevanceCheck, Verdict


class SharedPrompt:
    """The fused prompt of `question` over `chunks` (in order), kept for `check` and `answer` (see the module).
    Holds the prompt's K/V (`FusedGenerator.buffers`) until it is let go."""

    def __init__(
        self,
        generator: FusedGenerator,
        question: str,
        chunks: Sequence[ChunkRecord],
        fusion: FusionConfig | None = None,
    ) -> None:
        if not chunks:
            raise RagKVCacheError("a shared prompt needs at least one chunk, got none")
        fmt, tokenizer = generator.index.format, generator.layers.tokenizer
        self.generator, self.question, self.chunks = generator, question.strip(), list(chunks)
        self.fusion = fusion or generator.index.config.query.fusion
        segments = fmt.segments([c.token_ids for c in chunks], fmt.question_ids(tokenizer, question))
        ends = torch.tensor([len(s.ids) for s in segments]).cumsum(0).tolist()
        self.spans = [(end - len(s.ids), end) for s, end in zip(segments, ends) if s.label.startswith("chunk")]
        self.tail = segments[-1].ids  # the question: computed again when a chunk is hidden
        self.ids = prompt_ids(segments)  # where the answer's drafts are looked up (`GenerationConfig.draft_tokens`)
        self.head = ends[-1] - len(self.tail)  # the prefix, the chunks and their separators
        self._fits(ends[-1], "")
        t0 = time.perf_counter()
        self.fused = generator.fuse(segments, self.fusion)
        self.fuse_s = time.perf_counter() - t0

    def _fits(self, n: int, then: str) -> None:
        """Refuse `n` positions (`then`: what takes them past the prompt's) beyond the model's."""
        limit = self.generator.layers.context_length
        if n > limit:
            raise PromptTooLongError(
                f"the shared prompt has {self.head + len(self.tail)} tokens{then}: {n} positions, beyond the {limit} "
                f"of model {self.generator.layers.name!r}; retrieve fewer chunks or shorten the question"
            )

    def hidden(self, keep: Collection[int]) -> torch.Tensor:
        """The head's positions a prompt of the chunks `keep` (indices) alone would not have, bool [head]: the
        other chunks, and each separator but those between two kept chunks."""
        if bad := sorted(set(keep) - set(range(len(self.chunks)))):
            raise RagKVCacheError(f"chunks {bad} are not among the prompt's {len(self.chunks)} chunks")
        mask = torch.zeros(self.head, dtype=torch.bool)  # [head]
        for i, (start, end) in enumerate(self.spans):  # per chunk: once a step, never inside the layer loop
            mask[start:end] = i not in keep
            if i:  # the separator before chunk i is seen when it joins i to an earlier kept chunk
                mask[self.spans[i - 1][1] : start] = not (i in keep and any(j < i for j in keep))
        return mask

    def _head_kv(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        result = self.fused.result
        keys = [k[:, : self.head] for k in result.keys]  # L x [H_kv, head, D]
        values = [v[:, : self.head] for v in result.values]  # L x [H_kv, head, D]
        return keys, values

    def check(self, check: RelevanceCheck) -> list[Verdict]:
        """`check`'s verdict on each chunk (its template, threshold and yes/no tokens), read from the shared
        prompt: every chunk's check question computed in one batched forward, each row seeing its chunk alone."""
        fmt, adapter = self.generator.index.format, self.generator.adapter
        ids = fmt.question_ids(adapter.tokenizer, check.template.format(question=self.question))
        self._fits(self.head + len(ids), f" and the check question {len(ids)} after its chunks")
        keys, values = self._head_kv()
        pool = DecodePool()
        rows = [pool.admit(keys, values, room=len(ids), hidden=self.hidden({i})) for i in range(len(self.chunks))]
        try:
            p_yes = check.p_yes(adapter.extend_rows([ids] * len(rows), rows)).tolist()  # [B]
        finally:
            for row in rows:
                row.close()
        return [Verdict(c, p >= check.threshold, p, len(ids)) for c, p in zip(self.chunks, p_yes)]

    @torch.inference_mode()
    def forced_logits(self, keep: Collection[int], answer_ids: Sequence[int]) -> torch.Tensor:
        """Teacher forcing through the prompt with the chunks not in `keep` hidden: the next-token logits at every
        position of `answer_ids` [T, V] (the question computed again over the kept chunks predicts the first; the
        answer's tokens so far each next one), as `teacher_forced_logits` scores a fused prompt."""
        if not answer_ids:
            raise ValueError("teacher forcing needs at least one answer token, got none")
        adapter = self.generator.adapter
        keys, values = self._head_kv()
        row = DecodePool().admit(keys, values, room=len(self.tail) + len(answer_ids), hidden=self.hidden(keep))
        try:
            logits = [adapter.extend_rows([self.tail], [row])]  # [1, V]
            logits += [adapter.decode_rows([t], [row]) for t in answer_ids[:-1]]  # T-1 x [1, V]
        finally:
            row.close()
        return torch.cat(logits).float()  # [T, V]

    def answer(
        self,
        keep: Collection[int],
        generation: GenerationConfig | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Answer:
        """The answer from the chunks `keep` (indices; the others hidden), decoded from the shared prompt; `on_text`
        receives the text as it streams. Its `ttft_s` is this step's (the question computed again over the kept
        chunks, when one is hidden); the prompt's fusion was paid once, in `fuse_s`."""
        generator, result = self.generator, self.fused.result
        generation = generation or generator.index.config.query.generation
        n = generation.max_new_tokens
        self._fits(self.head + len(self.tail) + n, f" and up to {n} more may be generated")
        hidden = self.hidden(keep)
        t0 = time.perf_counter()
        decoder = Decoder(generator.adapter, generation)
        if hidden.any():
            keys, values = self._head_kv()
            cache = decoder.start(keys, values, hidden=hidden, tail=self.tail, prompt=self.ids)
            logits = generator.adapter.extend_rows([decoder.feed()], [cache])[0]  # [V]
        else:
            decoder.start(result.keys, result.values, prompt=self.ids)
            logits = result.logits  # [V]
        first = decoder.sample(logits)
        ttft = time.perf_counter() - t0
        stats = replace(self.fused, result=replace(result, keys=[], values=[], logits=logits))
        live = Generation(decoder, first, self.fusion.method, stats, t0, ttft, (), "")  # no ids: nothing remembered
        return collect_answer(generator.run(live), on_text)
