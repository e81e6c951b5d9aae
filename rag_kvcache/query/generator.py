"""`FusedGenerator`: the query path. A prompt's segments in, their caches fused, text out.

One question flows downhill: `ask` retrieves (or takes the given hits) and lays out the prompt;
`complete` takes any prompt (a string or chat messages), tokenises it whole and finds the indexed
chunks in it by their token ids (`layout`'s `PromptLayout`), so pipelines that build their own prompts are
fused too; `stream` fuses the prompt's caches (`fuse`: the index opens them, a fusion method blends them) and
decodes from the fused cache, yielding text as it comes and an `Answer` with the numbers last. With a
`ConversationCache`, every fused prompt's K/V (at once) and its answer's are kept, and a prompt that continues
one (a chat's next turn, the same question again) reads them and computes only its new tokens. A chat over
its token limit is shortened by its `ChatFit` (`ChatFit.fitted`), and the cut its next turn will need is
prepared ahead (`prepare_fit`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace

import torch

from ..config import FusionConfig, GenerationConfig
from ..engine.buffers import KVBufferPool
from ..engine.cache import ChunkKV, resident
from ..engine.decoding import DecodePool
from ..engine.fusion import DirectReader, FusionInput, FusionResult, LayerReader, WholeReader
from ..engine.generation import Decoder
from ..engine.methods import Method, get_method
from ..engine.model import ModelAdapter
from ..engine.profiling import StageClock
from ..engine.prompt import ChatTurn, Segment
from ..index import KVIndex
from ..retrieval.reader import EmptyIndexError
from ..retrieval.records import Hit
from ..store.controller import resolve_ratio
from ..store.conversations import ConversationCache, ConversationHit
from ..store.loading import LayerFeed
from .answers import Answer, Fused, Generation, PendingKV, PromptTooLongError, RetrievedChunk, collect_answer
from .fitting import ChatFit
from .layout import PromptLayout, n_tokens, prompt_ids, segments_after, warn_unquoted

log = logging.getLogger(__name__)


def _nodes(method: Method) -> str | None:
    """Whose conversation-cache nodes `method` reads: an exact method its own only (their K/V are what it
    computes), any other every node (None)."""
    return method.name if method.exact else None


class FusedGenerator:
    """Answers questions over a `KVIndex` by fusing the retrieved chunks' caches."""

    def __init__(
        self,
        index: KVIndex,
        conversations: ConversationCache | None = None,
    ) -> None:
        """`conversations`: where fused prompts' K/V are kept for the turns that continue them (None:
        nothing is kept, every prompt is fused from the chunk caches alone). The fusion methods run on the
        index's model (`index.model`: transformers' weights, or vLLM's in the connector's worker); answering
        decodes on transformers' (`index.adapter`)."""
        self.index = index
        self.layers = index.model
        self.conversations = conversations
        self.layout = PromptLayout(index)  # prompts laid out over the index's chunks
        self.fit = ChatFit(self.layout, conversations)  # a chat over its limit shortened, its cut kept
        self.buffers = KVBufferPool(self.layers.layout.n_layers)  # one prompt's fused K/V, reused once let go

    @property
    def adapter(self) -> ModelAdapter:
        """transformers' weights, which answering decodes on (`KVIndex.adapter`)."""
        return self.index.adapter

    def ask(
        self,
        question: str,
        hits: Sequence[Hit] | None = None,
        *,
        top_k: int | None = None,
        fusion: FusionConfig | None = None,
        generation: GenerationConfig | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Answer:
        """Answer `question` over `hits` (in order), or over the top-k chunks retrieved for it, laid out in
        the index's `chunk_order` (the answer lists them best first); `on_text` receives the text as it streams."""
        fmt = self.index.format
        question_ids = fmt.question_ids(self.layers.tokenizer, question)  # refuses an empty question
        retrieval_s, ranked = 0.0, hits
        if ranked is None:
            t0 = time.perf_counter()
            ranked = self.index.search(question, top_k or self.index.config.query.top_k)
            retrieval_s = time.perf_counter() - t0
            hits = self.index.config.query.in_prompt_order(ranked)
        if not hits:  # an answer from no chunks is the model's guess presented as retrieved
            raise EmptyIndexError(
                f"no chunks to answer from: index {self.index.path} holds {len(self.index.chunks)} chunks"
                + ("" if len(self.index.chunks) else "; index documents into it first")
            )
        segments = fmt.segments([h.chunk.token_ids for h in hits], question_ids)
        answer = collect_answer(self.stream(segments, fusion, generation), on_text)
        chunks = [RetrievedChunk(h.chunk.id, h.chunk.source, float(h.score)) for h in ranked]
        return replace(answer, retrieval_s=retrieval_s, chunks=chunks)

    def complete(
        self,
        prompt: str | Sequence[Mapping[str, str]],
        *,
        fusion: FusionConfig | None = None,
        generation: GenerationConfig | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Answer:
        """Answer any prompt, a string or chat messages (`render_prompt`), reading from the cache every
        indexed chunk found in it (`PromptLayout.prompt_segments`); `on_text` receives the text as it streams.
        Rendering, tokenising and matching the prompt is part of the TTFT (stage `match`)."""
        t0 = time.perf_counter()
        segments = self.layout.prompt_segments(prompt, fusion)
        match_s = time.perf_counter() - t0
        warn_unquoted(segments, fusion or self.index.config.query.fusion)
        answer = collect_answer(self.stream(segments, fusion, generation), on_text)
        return replace(answer, ttft_s=answer.ttft_s + match_s, stages={"match": match_s, **answer.stages})

    def prepare_fit(
        self, turns: Sequence[ChatTurn], fusion: FusionConfig, limit: int, salt: str, n_prompt: int, dropped: int = 0
    ) -> int:
        """Ahead of the turn that will outgrow `limit`: the K/V of the shortened chat that turn will be cut to,
        computed now (the server runs this while idle, after an answer) and kept in the conversation cache,
        so the turn that drops the chat's oldest turns reads the rest instead of computing it.

        `turns` is the chat as the client sends it, the answer just given last; the prompt just answered had
        `n_prompt` tokens and left out the `dropped` oldest turns after the system's (`ChatFit.fitted`). Whether
        there is a cut to prepare, and which, is `ChatFit.cut_ahead`'s. Returns the tokens computed (0: the next
        turn is expected to fit under the cut in use, or there is no conversation cache)."""
        if self.conversations is None or (cut := self.fit.cut_ahead(turns, fusion, limit, n_prompt, dropped)) is None:
            return 0
        head, out, c = cut
        fused, method = self.fuse(out, fusion, salt), get_method(fusion.method)
        self.conversations.insert(salt, head, fused.result.keys, fused.result.values, method.name, method.exact)
        log.info("prepared the %d-token chat the next turn will be cut to (%d turns dropped)", len(head), c)
        return len(head) - fused.conversation_tokens

    def stream(
        self,
        segments: Sequence[Segment],
        fusion: FusionConfig | None = None,
        generation: GenerationConfig | None = None,
    ) -> Iterator[str | Answer]:
        """Yield the answer's text pieces as they are generated, then the `Answer` with its numbers
        (its `answer` field empty: the text is what was streamed)."""
        yield from self.run(self.start(segments, fusion, generation))

    def run(self, live: Generation) -> Iterator[str | Answer]:
        """Decode a started generation alone: its text pieces, then its `Answer` (`finish`). The first token's
        text comes out before the prompt's K/V are given to the decoder (`settle`)."""
        first = [] if live.first_token is None else live.decoder.take(live.first_token)
        for step in first:
            yield step.text
        self.settle(live)
        for step in live.decoder.run(None):  # none when the first token ended the answer
            yield step.text
        yield self.finish(live)

    def start(
        self,
        segments: Sequence[Segment],
        fusion: FusionConfig | None = None,
        generation: GenerationConfig | None = None,
        salt: str = "",
        pool: DecodePool | None = None,
    ) -> Generation:
        """Fuse the prompt's caches and sample the first token: a `Generation` whose decoder takes that
        token and, once `settle`d, the ones after it, alone (`Decoder.run`) or batched with others'
        (`decode_together`: those started into one `pool` attend in one call); `finish` gives its `Answer` once
        the decoder is done and gives its slot back. `salt`: the tenant whose caches of request text (a prompt
        head) this prompt may read and write (`KVIndex.caches.open`). The fused K/V wait in `pending` for
        `settle`, which copies them into the pool and the conversation cache (the answer's go there once
        `finish`ed), so that the first token can go out before those copies are made."""
        fusion = fusion or self.index.config.query.fusion
        generation = generation or self.index.config.query.generation
        self._fits(segments, generation)
        t0 = time.perf_counter()
        fused = self.fuse(segments, fusion, salt)
        result = fused.result
        decoder = Decoder(self.adapter, generation)
        first = decoder.sample(result.logits)
        ttft = time.perf_counter() - t0
        stats = replace(fused, result=replace(result, keys=[], values=[]))
        pending = PendingKV(result.keys, result.values, pool)
        return Generation(decoder, first, fusion.method, stats, t0, ttft, prompt_ids(segments), salt, pending)

    def settle(self, live: Generation) -> None:
        """Give a started generation's fused K/V (`start`'s `pending`) to its decoder, a slot of the pool `start`
        was given, and to the conversation cache, so that the same prompt sent again while this one decodes reads
        them; then let them go. What `start` leaves until its first token is out: the copies take milliseconds
        a thousand tokens. Once; nothing to do for a generation settled or made otherwise (`enter`)."""
        pending = live.pending
        if pending is None or live.decoder.cache is not None:
            return
        live.decoder.start(pending.keys, pending.values, pending.pool, prompt=live.ids)  # a copy of its own
        if self.conversations is not None:
            method = get_method(live.method)
            self.conversations.insert(live.salt, live.ids, pending.keys, pending.values, method.name, method.exact)
        pending.keys, pending.values = [], []

    def load(self, segments: Sequence[Segment], fusion: FusionConfig | None = None, salt: str = "") -> int:
        """Read the chunk caches `fuse` would read for this prompt into the memory tier ahead of its prefill
        (`CacheOpener.load`); returns how many were read now. Touches neither the model, nor the conversation
        cache, nor the index's SQLite connection: it may run on another thread while the engine's computes."""
        method = get_method((fusion or self.index.config.query.fusion).method)
        return self.index.caches.load(segments, salt) if method.reads_cache else 0

    def joinable(self, segments: Sequence[Segment], fusion: FusionConfig | None = None, salt: str = "") -> int | None:
        """The tokens a prompt leaves to compute when it needs no fusion of its own: the conversation cache
        holds a head of it longer than the system prefix, and nothing after that head is read from a chunk
        cache. The head is then one exact cached segment at position 0, so every method computes the rest, the
        tail, alone (what `start` would fuse), and `enter` can leave it to a batched step. None for any other
        prompt. Reads nothing from the cache (no lookup counted)."""
        if self.conversations is None:
            return None
        method = get_method((fusion or self.index.config.query.fusion).method)
        ids = prompt_ids(segments)
        held = self.conversations.held(salt, ids, _nodes(method))
        if held <= self._stored(segments):
            return None
        if method.reads_cache and any(s.cacheable for s in segments_after(segments, ids, held, True)):
            return None  # a chunk after the held head would be read from its cache: fused by `start`
        return len(ids) - held

    def enter(
        self,
        segments: Sequence[Segment],
        pool: DecodePool,
        fusion: FusionConfig | None = None,
        generation: GenerationConfig | None = None,
        salt: str = "",
    ) -> Generation:
        """Start a prompt that needs no fusion of its own (`joinable`) without one: the K/V of the head the
        conversation cache holds go into a slot of `pool`, and the tail is left to the decoder's first batched
        step (`decode_together`, beside other rows), which samples the first token. Returns a `Generation`
        without one (`first_token` None; `entered` once that step is done); a prompt that is not joinable is
        refused (`ValueError`)."""
        fusion = fusion or self.index.config.query.fusion
        generation = generation or self.index.config.query.generation
        tail = self.joinable(segments, fusion, salt)
        if tail is None or self.conversations is None:
            raise ValueError("enter() takes a prompt the conversation cache holds but its tail: use start()")
        self._fits(segments, generation)
        t0 = time.perf_counter()
        ids = prompt_ids(segments)
        hit = self.conversations.match(salt, ids, _nodes(get_method(fusion.method)))
        if hit is None or hit.n_tokens != len(ids) - tail:
            raise RuntimeError(f"the conversation cache held {len(ids) - tail} tokens of the prompt and read {hit}")
        layers = [hit.kv.layer(i) for i in range(hit.kv.n_layers)]  # L x ([H_kv, n, D], [H_kv, n, D])
        decoder = Decoder(self.adapter, generation)
        decoder.start([k for k, _ in layers], [v for _, v in layers], pool, tail=ids[hit.n_tokens :], prompt=ids)
        result = FusionResult([], [], torch.empty(0), tail, tail / len(ids), [tail] * hit.kv.n_layers)
        stats = Fused(result, len(ids), 0, 0, hit.n_tokens)
        return Generation(decoder, None, fusion.method, stats, t0, 0.0, ids, salt)

    def entered(self, live: Generation) -> Generation:
        """A generation from `enter` after the batched step that fed its tail: its time to the first token
        (now) and the logits it was sampled from. Once: a later call would move its time to the first token."""
        if live.first_token is not None or live.decoder.first_logits is None or live.fused.result.logits.numel():
            raise RuntimeError("entered() takes a generation from enter() once, after the step that fed its tail")
        result = replace(live.fused.result, logits=live.decoder.first_logits)
        return replace(live, fused=replace(live.fused, result=result), ttft_s=time.perf_counter() - live.started)

    def _fits(self, segments: Sequence[Segment], generation: GenerationConfig) -> None:
        """Refuse a prompt that, with the tokens it may generate, does not fit the model's positions."""
        n_prompt, limit = n_tokens(segments), self.layers.context_length
        if n_prompt + generation.max_new_tokens > limit:
            raise PromptTooLongError(
                f"the prompt has {n_prompt} tokens and up to {generation.max_new_tokens} more may be generated, beyond "
                f"the {limit} positions of model {self.layers.name!r}: retrieve fewer chunks or shorten the question"
            )

    def _stored(self, segments: Sequence[Segment]) -> int:
        """The prompt's head whose cache is always stored (the system prefix): a conversation hit no longer
        than it saves nothing."""
        return min(len(segments[0].ids), len(self.index.format.prefix_ids)) if segments[0].cacheable else 0

    def finish(self, live: Generation) -> Answer:
        """The `Answer` of a generation whose decoder is done (its `answer` field empty: the text is
        what was streamed); the index's counters are flushed."""
        if not live.decoder.done:
            raise RuntimeError(f"the generation is not complete ({len(live.decoder.ids)} tokens so far)")
        self.settle(live)  # an answer complete at its first token: its prompt is kept all the same
        generation_s = time.perf_counter() - live.started - live.ttft_s
        self.index.flush_stats()  # a failure is logged: the answer is never lost for its counters
        if self.conversations is not None and live.ids:
            self._remember(live)
        live.decoder.close()
        n_generated, result = len(live.decoder.ids), live.fused.result
        return Answer(
            answer="",
            method=live.method,
            ttft_s=live.ttft_s,
            retrieval_s=0.0,
            prompt_tokens=live.fused.prompt_tokens,
            recomputed_tokens=result.recomputed_tokens,
            compute_fraction=result.compute_fraction,
            generation_s=generation_s,
            generated_tokens=n_generated,
            cache_misses=live.fused.cache_misses,
            cache_computed_tokens=live.fused.cache_computed_tokens,
            conversation_tokens=live.fused.conversation_tokens,
            finish_reason="length" if n_generated >= live.decoder.cfg.max_new_tokens else "stop",
            stages=result.stages,
            first_token_logits=result.logits,
        )

    def _remember(self, live: Generation) -> None:
        """Keep the K/V of a finished generation's prompt and of the answer tokens fed back (all but the
        last) in the conversation cache, for a prompt that continues them."""
        cache, method = live.decoder.cache, get_method(live.method)
        ids = live.ids + tuple(live.decoder.ids[: cache.length - len(live.ids)])
        self.conversations.insert(live.salt, ids, cache.keys, cache.values, method.name, method.exact)

    def _recall(
        self, segments: Sequence[Segment], method: Method, salt: str
    ) -> tuple[Sequence[Segment], ConversationHit | None]:
        """The prompt's segments with the run of tokens it begins with that the conversation cache holds
        (an exact method's own K/V only) made one cached segment at position 0, and that run's K/V; the
        segments as they are (and None) when the cache holds no more of them than the prompt's own head."""
        if self.conversations is None:
            return segments, None
        ids = prompt_ids(segments)
        hit = self.conversations.match(salt, ids, _nodes(method))
        # the system prefix's cache is always stored; a longer head of request text (a chat's turns before the
        # chunks of its last one) is new text every turn, so a hit that reaches past the prefix saves computing it
        if hit is None or hit.n_tokens <= self._stored(segments):
            return segments, None
        return [
            Segment(ids[: hit.n_tokens], True, "conversation"),
            *segments_after(segments, ids, hit.n_tokens, method.reads_cache),
        ], hit

    def fuse(self, segments: Sequence[Segment], fusion: FusionConfig, salt: str = "") -> Fused:
        """The prompt's KV cache: the index opens the segments' caches (none for a method that reads
        none), the fusion method blends them, reading cached layers `prefetch_layers` ahead. The tokens
        a conversation cache holds the K/V of (an earlier turn of this chat) are read from it instead:
        they come first, as one cached segment at position 0 that no method recomputes; a method that
        computes every token computes the rest (prefix caching over its own earlier K/V).

        Stages: `kv_load` (opening entries, and recomputing missing ones), `layout` (where the caches go in
        the prompt, `KVPlacement`), `kv_wait` (the fusion waiting for cached layers, what the recompute did not
        hide, and placing each one in the prompt's K/V), then the method's own (`selective_prefill`'s).
        The K/V are written into this generator's `buffers`: a `Fused` kept by the caller keeps its
        buffers, which the pool hands out again only once nothing else holds them.
        """
        method = get_method(fusion.method)
        chunk_tokens = self.index.config.index.chunk_tokens
        fusion = fusion.check_model(self.layers.layout.n_layers, chunk_tokens).for_chunks(chunk_tokens)
        if fusion.ratio == "auto":  # the loading controller's ratio, from this machine's calibration
            fusion = resolve_ratio(self.index.config.with_query(fusion=fusion), self.layers)[0].query.fusion
        clock = StageClock(self.layers.device)
        with clock.stage("kv_load"):
            segments, hit = self._recall(segments, method, salt)
            if hit is not None and not method.reads_cache:
                method = get_method("prefix")  # exact over its own K/V
            if method.reads_cache:
                opened = segments if hit is None else [replace(segments[0], cacheable=False), *segments[1:]]
                in_place = self.index.store.budget is not None  # under a budget: a chunk without a cache, in place
                caches = self.index.caches.open(opened, salt, in_place=in_place)
                sources, contexts = caches.sources, caches.contexts
                if hit is not None:
                    sources = [hit.kv, *sources[1:]]
            else:
                caches, sources, contexts = None, [None] * len(segments), [()] * len(segments)
            inp = FusionInput.build(list(segments), sources, contexts, device=self.layers.device)
        depth = self.index.config.runtime.storage.prefetch_layers
        with clock.stage("layout"):
            placement = inp.placement(self.layers)
        if (
            caches is not None
            and self.layers.graphs is None
            and self.layers.device.type == "cpu"
            and all(map(resident, inp.sources))
        ):  # every cache in memory: nothing to read ahead of the compute (beside a GPU: DMA, through the feed)
            reader: LayerReader = WholeReader(inp.sources, placement, self.layers.layout.n_layers, self.buffers)
            result = method(self.layers, inp, fusion, clock, reader)
        elif caches is None or depth == 0 or self.layers.graphs is not None:  # graphs: read at once, not ahead
            reader = DirectReader(inp.sources, placement, self.buffers)
            result = method(self.layers, inp, fusion, clock, reader)
        else:
            with LayerFeed(inp.sources, placement, self.layers.layout.n_layers, depth, self.buffers) as feed:
                result = method(self.layers, inp, fusion, clock, feed)
        if caches is not None and caches.exact_in_place:  # their caches, as the prefill computed them
            self.index.caches.harvest(
                [
                    (at, ChunkKV.cut(result.keys, result.values, at.start, at.start + len(at.ids)))
                    for at in caches.exact_in_place
                ]
            )
        repaired, computed = (0, 0) if caches is None else (caches.repaired, caches.computed_tokens)
        return Fused(result, inp.n_tokens, repaired, computed, 0 if hit is None else hit.n_tokens)
