"""The conversation cache: a chat's next turn reads the K/V of the turns before it (prompt and answer)
and computes only its new tokens; exact methods stay exact, tenants never share, memory stays bounded."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_pipeline import docs, index  # noqa: F401

from rag_kvcache.config import FusionConfig, GenerationConfig
from rag_kvcache.engine.decoding import DecodePool
from rag_kvcache.engine.generation import decode_together
from rag_kvcache.engine.prompt import Segment
from rag_kvcache.query.answers import collect_answer
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.store.conversations import ConversationCache

L, H, D = 2, 2, 4


def kv(n: int, fill: float = 0.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K/V [H, n, D] whose value at position i is fill + i (keys) and -(fill + i) (values)."""
    ramp = (fill + torch.arange(n, dtype=torch.float32))[None, :, None].expand(H, n, D)  # [H, n, D]
    return [ramp.clone() for _ in range(L)], [-ramp.clone() for _ in range(L)]


def read(hit) -> tuple[torch.Tensor, torch.Tensor]:
    return hit.kv.layer(L - 1)


def test_a_prompt_reads_the_longest_stored_run_it_begins_with_but_its_last_token():
    cache = ConversationCache(1 << 20)
    cache.insert("", range(10), *kv(10), "cacheblend", exact=False)
    assert cache.match("", [7, 8]) is None
    hit = cache.match("", list(range(6)) + [99])  # diverges after 6 tokens
    assert hit.n_tokens == 6
    k, v = read(hit)
    assert torch.equal(k[0, :, 0], torch.arange(6.0)) and torch.equal(v[0, :, 0], -torch.arange(6.0))
    assert cache.match("", range(10)).n_tokens == 9  # the last token is always computed
    assert cache.match("", range(14)).n_tokens == 10


def test_a_branch_is_split_and_shares_the_common_run():
    cache = ConversationCache(1 << 20)
    first = list(range(10))
    other = list(range(6)) + [50, 51, 52]
    cache.insert("", first, *kv(10), "reuse", exact=False)
    cache.insert("", other, *kv(9, fill=100.0), "reuse", exact=False)
    s = cache.stats
    assert (s.nodes, s.tokens) == (3, 13)  # [0..5], [6..9], [50..52]: the shared run stored once
    k, _ = read(cache.match("", other + [1]))
    assert torch.equal(k[0, :, 0], torch.tensor([0.0, 1, 2, 3, 4, 5, 106, 107, 108]))  # shared run: the first's
    k, _ = read(cache.match("", first + [1]))
    assert torch.equal(k[0, :, 0], torch.arange(10.0))


def test_an_exact_method_reads_only_its_own_nodes_and_makes_the_path_its_own():
    cache = ConversationCache(1 << 20)
    cache.insert("", range(8), *kv(8, fill=100.0), "cacheblend", exact=False)
    assert cache.match("", range(9), "full") is None
    assert cache.match("", range(9)).n_tokens == 8  # an inexact method reads anyone's
    cache.insert("", range(8), *kv(8), "full", exact=True)
    hit = cache.match("", range(9), "full")
    assert hit.n_tokens == 8 and torch.equal(read(hit)[0][0, :, 0], torch.arange(8.0))
    cache.insert("", range(4), *kv(4, fill=500.0), "cacheblend", exact=False)  # an inexact write changes nothing
    assert torch.equal(read(cache.match("", range(9), "full"))[0][0, :, 0], torch.arange(8.0))


def test_tenants_never_read_each_others_conversations():
    cache = ConversationCache(1 << 20)
    cache.insert("tenant-a", range(8), *kv(8), "reuse", exact=False)
    assert cache.match("tenant-b", range(9)) is None and cache.match("", range(9)) is None
    assert cache.match("tenant-a", range(9)).n_tokens == 8


def test_over_budget_the_least_recently_used_leaves_go_first():
    per_token = 2 * L * H * D * 4  # bytes of one token's K and V
    cache = ConversationCache(25 * per_token)
    cache.insert("", range(10), *kv(10), "reuse", exact=False)
    cache.insert("", range(100, 110), *kv(10), "reuse", exact=False)
    cache.match("", range(11))  # the first conversation is read again: the second is now the older
    cache.insert("", range(200, 210), *kv(10), "reuse", exact=False)
    s = cache.stats
    assert s.bytes <= 25 * per_token and s.tokens == 20 and s.evicted_tokens == 10
    assert cache.match("", range(101, 111)) is None
    assert cache.match("", range(11)).n_tokens == 10 and cache.match("", range(200, 211)).n_tokens == 10


def test_each_tenant_has_the_budget_to_itself_and_its_salts_share_it():
    """One global budget once let two of tenant B's chats evict tenant A's. A salt's tenant is its text before
    the first ':'; its salts (a request's cache_salt) share the tenant's budget, never add to it."""
    per_token = 2 * L * H * D * 4
    cache = ConversationCache(15 * per_token)
    cache.insert("a", range(10), *kv(10), "reuse", exact=False)
    cache.insert("b", range(100, 110), *kv(10), "reuse", exact=False)
    cache.insert("b:salt", range(200, 210), *kv(10), "reuse", exact=False)  # b over its budget: b's oldest go
    assert cache.match("a", range(11)).n_tokens == 10
    assert cache.match("b", range(100, 111)) is None and cache.match("b:salt", range(200, 211)).n_tokens == 10
    a, b = cache.stats_of("a"), cache.stats_of("b")
    assert (a.tokens, a.evicted_tokens, a.hits) == (10, 0, 1) and (b.tokens, b.evicted_tokens, b.hits) == (10, 10, 1)
    assert b.bytes <= cache.max_bytes and cache.stats.tokens == 20 and cache.stats.lookups == 3
    assert set(cache.tenants()) == {"a", "b"} and cache.stats_of("nobody").tokens == 0


def test_a_budget_below_one_byte_is_refused():
    with pytest.raises(ValueError, match="max_bytes=0"):
        ConversationCache(0)


# ---- through the generator ---------------------------------------------------------------------
def turn(gen: FusedGenerator, segments: list[Segment], method: str, salt: str = ""):
    """Answer `segments`; returns the answer and the prompt's and answer's tokens (the next turn's start)."""
    live = gen.start(segments, FusionConfig(method=method), GenerationConfig(max_new_tokens=6), salt)
    answer = collect_answer(gen.run(live), None)
    return answer, [t for s in segments for t in s.ids] + live.decoder.ids


def chat(index, question: str) -> list[Segment]:
    fmt = index.format
    return fmt.segments(
        [h.chunk.token_ids for h in index.search(question, 3)], fmt.question_ids(index.adapter.tokenizer, question)
    )


@pytest.mark.parametrize("method", ["full", "prefix"])
def test_an_exact_methods_next_turn_equals_its_answer_without_the_cache(index, method):
    """Turn 2 (turn 1's prompt, its answer, a new question) through the conversation cache computes only
    the new tokens, and its first-token logits and answer equal the same prompt fused without the cache."""
    tok = index.adapter.tokenizer
    gen, cold = FusedGenerator(index, ConversationCache(1 << 30)), FusedGenerator(index)
    first, before = turn(gen, chat(index, "Who kept the lighthouse diary?"), method)
    assert first.conversation_tokens == 0
    follow = tuple(tok("and in which year was it lit?", add_special_tokens=False)["input_ids"])
    second = [Segment(tuple(before), False, "text"), Segment(follow, False, "question")]
    warm, _ = turn(gen, second, method)
    again = collect_answer(cold.stream(second, FusionConfig(method=method), GenerationConfig(max_new_tokens=6)), None)
    n_stored = len(before) - (first.finish_reason == "length")  # cut at max_new_tokens: its last token never fed
    assert warm.conversation_tokens == n_stored
    assert warm.recomputed_tokens == warm.prompt_tokens - n_stored
    assert warm.cached_tokens >= n_stored
    torch.testing.assert_close(warm.first_token_logits, again.first_token_logits, atol=1e-4, rtol=1e-4)
    assert turn(FusedGenerator(index), second, method)[1] == turn(gen, second, method)[1]


def test_an_inexact_methods_next_turn_reads_the_fused_kv_as_it_was_used(index):
    """CacheBlend's turn 2 reads turn 1's K/V (the fused chunks and the answer) unchanged, recomputes
    none of it, and its logits equal a fusion whose cache for those tokens is that same K/V."""
    tok = index.adapter.tokenizer
    conversations = ConversationCache(1 << 30)
    gen = FusedGenerator(index, conversations)
    first, before = turn(gen, chat(index, "What does the bakery in Saltmere sell?"), "cacheblend")
    stored = conversations.match("", before + [0])
    assert stored.n_tokens == len(before) - (first.finish_reason == "length")
    follow = tuple(tok("on which day?", add_special_tokens=False)["input_ids"])
    segments = [Segment(tuple(before), False, "text"), Segment(follow, False, "question")]
    live = gen.start(segments, FusionConfig(method="cacheblend"), GenerationConfig(max_new_tokens=1))
    gen.settle(live)
    assert live.fused.conversation_tokens == stored.n_tokens
    assert live.fused.result.recomputed_tokens <= len(follow) + 1
    for layer in range(index.adapter.layout.n_layers):
        k, v = stored.kv.layer(layer)  # [H_kv, n, D]
        torch.testing.assert_close(live.decoder.cache.keys[layer][:, : stored.n_tokens], k, atol=0, rtol=0)
        torch.testing.assert_close(live.decoder.cache.values[layer][:, : stored.n_tokens], v, atol=0, rtol=0)


@pytest.mark.parametrize("method", ["full", "cacheblend"])
def test_the_same_prompt_sent_while_the_first_decodes_reads_its_kv(index, method):
    """A prompt's fused K/V are kept as soon as its first token is out (`settle`): the same prompt started again
    before the first is answered reads all of it but its last token, and samples from the same logits."""
    gen = FusedGenerator(index, ConversationCache(1 << 30))
    segments, fusion = chat(index, "Who kept the lighthouse diary?"), FusionConfig(method=method)
    first = gen.start(segments, fusion, GenerationConfig(max_new_tokens=4))
    gen.settle(first)
    again = gen.start(segments, fusion, GenerationConfig(max_new_tokens=4))
    n = sum(len(s.ids) for s in segments)
    assert (first.fused.conversation_tokens, again.fused.conversation_tokens) == (0, n - 1)
    assert again.fused.result.recomputed_tokens == 1
    torch.testing.assert_close(again.fused.result.logits, first.fused.result.logits, atol=1e-4, rtol=1e-4)


def test_the_first_token_goes_out_before_the_prompts_kv_are_copied(index):
    """`start` samples the first token and leaves the fused K/V pending: no pool slot taken, nothing in the
    conversation cache. `settle` makes both copies, once; `run` yields the first token's text before it, and
    answers as decoding after a settled start does."""
    conversations = ConversationCache(1 << 30)
    gen, pool = FusedGenerator(index, conversations), DecodePool()
    segments, fusion = chat(index, "Who kept the lighthouse diary?"), FusionConfig(method="cacheblend")
    generation = GenerationConfig(max_new_tokens=6)
    ids = [t for s in segments for t in s.ids]
    live = gen.start(segments, fusion, generation, pool=pool)
    assert live.decoder.cache is None and pool.rows == [] and conversations.match("", [*ids, 0]) is None
    gen.settle(live)
    assert pool.rows == [live.decoder.cache] and conversations.match("", [*ids, 0]).n_tokens == len(ids)
    gen.settle(live)  # once: no second slot, no second copy
    assert pool.rows == [live.decoder.cache] and live.pending.keys == []
    settled = collect_answer(gen.run(live), None)

    other = FusedGenerator(index, ConversationCache(1 << 30))
    streamed = other.run(other.start(segments, fusion, generation))
    first = next(streamed)  # the first token's text, its K/V not yet copied anywhere
    assert other.conversations.match("", [*ids, 0]) is None
    rest = list(streamed)
    assert first + "".join(rest[:-1]) == settled.answer and rest[-1].generated_tokens == settled.generated_tokens
    assert other.conversations.match("", [*ids, 0]).n_tokens >= len(ids)  # the prompt, then the answer, kept


def test_a_conversation_is_its_tenants_alone(index):
    gen = FusedGenerator(index, ConversationCache(1 << 30))
    first, before = turn(gen, chat(index, "Who kept the lighthouse diary?"), "reuse", salt="a")
    segments = [Segment(tuple(before), False, "text"), Segment((1000, 1001), False, "question")]
    assert turn(gen, segments, "reuse", salt="b")[0].conversation_tokens == 0
    assert turn(gen, segments, "reuse", salt="a")[0].conversation_tokens == len(before) - (
        first.finish_reason == "length"
    )


def follow_up(index, gen: FusedGenerator, method: str, question: str = "and in which year was it lit?"):
    """Turn 1 answered through `gen`, then turn 2's segments: turn 1's prompt and answer, a new question."""
    _, before = turn(gen, chat(index, "Who kept the lighthouse diary?"), method)
    follow = tuple(index.adapter.tokenizer(question, add_special_tokens=False)["input_ids"])
    return [Segment(tuple(before), False, "text"), Segment(follow, False, "question")]


@pytest.mark.parametrize("method", ["full", "cacheblend"])
def test_a_held_prompt_enters_a_batched_step_and_answers_as_its_fusion(index, method):
    """A prompt the conversation cache holds all of but its new question enters without a fusion
    (`FusedGenerator.enter`): a decoding step beside another row feeds its tail, and its first logits, K/V and
    answer equal `start`'s fusion of the same prompt over the same cache (which computes the tail alone too)."""
    gen, ref = FusedGenerator(index, ConversationCache(1 << 30)), FusedGenerator(index, ConversationCache(1 << 30))
    second = follow_up(index, gen, method)
    assert follow_up(index, ref, method) == second  # the same turn 1 in both caches
    fusion, generation = FusionConfig(method=method), GenerationConfig(max_new_tokens=6)
    fused = ref.start(second, fusion, generation)
    ref.settle(fused)
    list(fused.decoder.run(fused.first_token))
    pool = DecodePool()
    other = gen.start(chat(index, "What does the bakery in Saltmere sell?"), fusion, generation, pool=pool)
    other.decoder.take(other.first_token)
    gen.settle(other)
    live = gen.enter(second, pool, fusion, generation)
    n = sum(len(s.ids) for s in second)
    assert live is not None and live.first_token is None
    assert live.fused.conversation_tokens == fused.fused.conversation_tokens == n - len(live.decoder.tail)
    decode_together([other.decoder, live.decoder])
    live = gen.entered(live)
    with pytest.raises(RuntimeError, match="once"):  # a second call would move its time to the first token
        gen.entered(live)
    torch.testing.assert_close(live.fused.result.logits, fused.fused.result.logits, atol=1e-4, rtol=1e-4)
    for layer in range(index.adapter.layout.n_layers):
        torch.testing.assert_close(
            live.decoder.cache.keys[layer][:, :n], fused.decoder.cache.keys[layer][:, :n], atol=1e-4, rtol=1e-4
        )
    while not live.decoder.done:
        decode_together([live.decoder])
    answer = gen.finish(live)
    assert live.decoder.ids == fused.decoder.ids
    assert answer.recomputed_tokens == n - answer.conversation_tokens == fused.fused.result.recomputed_tokens
    assert answer.ttft_s > 0 and answer.first_token_logits.shape == fused.fused.result.logits.shape


def test_a_prompt_that_needs_a_fusion_is_not_joinable_and_reads_nothing(index):
    """`joinable` gives the tail of a prompt the conversation cache holds (what its fusion computes), and None, without
    counting a lookup, for a prompt with no conversation cache and one with a chunk after the held head that its
    method reads from a cache (or that an exact method never computed); `enter` refuses what is not joinable."""
    conversations = ConversationCache(1 << 30)
    gen = FusedGenerator(index, conversations)
    second = follow_up(index, gen, "cacheblend")
    fusion = FusionConfig(method="cacheblend")
    lookups = conversations.stats.lookups
    tail = gen.joinable(second, fusion)
    assert FusedGenerator(index).joinable(second, fusion) is None
    chunked = [*second[:1], *chat(index, "Who founded the observatory?")[1:]]  # its chunks after the held head
    assert gen.joinable(chunked, fusion) is None
    assert gen.joinable(chunked, FusionConfig(method="full")) is None  # full's nodes: none
    assert conversations.stats.lookups == lookups
    with pytest.raises(ValueError, match="use start"):
        gen.enter(chunked, DecodePool(), fusion, GenerationConfig(max_new_tokens=2))
    assert tail == gen.start(second, fusion, GenerationConfig(max_new_tokens=2)).fused.result.recomputed_tokens


@pytest.mark.parametrize("method", ["full", "cacheblend"])
def test_cache_aware_lets_a_held_request_join_the_batch_and_it_answers_as_under_fcfs(index, method):
    """Served with `cache_aware`, a chat's next turn (held by the conversation cache but its new question) joins
    the decoding batch beside a cold request without a prefill of its own (counted), and both answers equal
    what `fcfs`, which prefills each, streams for them."""
    from rag_kvcache.serving.metrics import ServerMetrics
    from rag_kvcache.serving.scheduler import Scheduler

    async def on_engine(fn, *args):
        return fn(*args)

    fusion, generation = FusionConfig(method=method), GenerationConfig(max_new_tokens=6)
    cold = chat(index, "What does the bakery in Saltmere sell?")

    def serve(order: str) -> tuple[list[tuple[str, object]], ServerMetrics]:
        gen = FusedGenerator(index, ConversationCache(1 << 30))
        second = follow_up(index, gen, method)
        metrics = ServerMetrics(index.store.stats)
        scheduler = Scheduler(gen, on_engine, 4, metrics, order, prefetch=False)

        async def answer(segments) -> tuple[str, object]:
            items = [item async for item in scheduler.stream(segments, fusion, generation)]
            return "".join(items[:-1]), items[-1]

        async def main():
            try:
                return await asyncio.gather(answer(cold), answer(second))
            finally:
                await scheduler.close()

        return asyncio.run(main()), metrics

    (fifo, fifo_metrics), (aware, aware_metrics) = serve("fcfs"), serve("cache_aware")
    assert [text for text, _ in aware] == [text for text, _ in fifo]
    joined = aware[1][1]
    assert joined.recomputed_tokens == joined.prompt_tokens - joined.conversation_tokens < 20
    assert aware_metrics.registry.get_sample_value("rag_kvcache_joined_requests_total") == 1
    assert fifo_metrics.registry.get_sample_value("rag_kvcache_joined_requests_total") == 0


def test_a_step_that_fails_with_a_joined_request_fails_its_rows_and_gives_their_slots_back(index, monkeypatch):
    # fault injection: the batched forward that would feed a joined request's tail raises; both requests in that
    # step get the error, their slots are given back, and the next request is served as if nothing had happened
    from rag_kvcache.serving.metrics import ServerMetrics
    from rag_kvcache.serving.scheduler import Scheduler

    async def on_engine(fn, *args):
        return fn(*args)

    gen = FusedGenerator(index, ConversationCache(1 << 30))
    second = follow_up(index, gen, "cacheblend")
    fusion, generation = FusionConfig(method="cacheblend"), GenerationConfig(max_new_tokens=4)
    scheduler = Scheduler(gen, on_engine, 4, ServerMetrics(index.store.stats), "cache_aware", prefetch=False)
    real = type(index.adapter).extend_rows

    def planted(self, tokens, caches, keep=None):
        if any(len(row) > 1 for row in tokens):
            raise RuntimeError("planted step failure")
        return real(self, tokens, caches, keep)

    async def answer(segments) -> object:
        try:
            return [item async for item in scheduler.stream(segments, fusion, generation)][-1]
        except RuntimeError as e:
            return e

    async def main():
        try:
            with monkeypatch.context() as patch:
                patch.setattr(type(index.adapter), "extend_rows", planted)
                failed = await asyncio.gather(
                    answer(chat(index, "What does the bakery in Saltmere sell?")), answer(second)
                )
            assert scheduler.pool.size == 0
            return failed, await answer(second)
        finally:
            await scheduler.close()

    failed, again = asyncio.run(main())
    assert [str(e) for e in failed] == ["planted step failure"] * 2
    assert again.conversation_tokens > 0 and again.recomputed_tokens < 20


def test_requests_joining_the_batch_leave_a_place_to_the_oldest_that_needs_a_prefill(index):
    """Held requests join the batch in arrival order while it has places, but the oldest request that needs a
    prefill keeps one (only older requests go before it), and it is the one prefilled next; a prompt that is too
    long fails alone."""
    from rag_kvcache.serving.metrics import ServerMetrics
    from rag_kvcache.serving.scheduler import Job, Scheduler

    async def on_engine(fn, *args):
        return fn(*args)

    gen = FusedGenerator(index, ConversationCache(1 << 30))
    second = follow_up(index, gen, "cacheblend")
    fusion, generation = FusionConfig(method="cacheblend"), GenerationConfig(max_new_tokens=4)
    held = [Job(second, fusion, generation, "") for _ in range(4)]
    cold = Job(chat(index, "Who founded the observatory?"), fusion, generation, "")
    too_long = Job(second, fusion, GenerationConfig(max_new_tokens=index.model.context_length), "")
    scheduler = Scheduler(gen, on_engine, 3, ServerMetrics(index.store.stats), "cache_aware", prefetch=False)
    scheduler.pending.extend([held[0], too_long, cold, *held[1:]])

    async def main() -> None:
        await scheduler._board()

    asyncio.run(main())
    assert scheduler.decoding == held[:2] and list(scheduler.pending) == [cold, *held[2:]]
    assert "positions" in str(too_long.out.get_nowait())
    assert scheduler._next() is cold
    for job in scheduler.decoding:
        job.live.decoder.close()


def test_background_tasks_run_while_idle_and_a_failed_one_is_logged_and_counted(index, caplog):
    # fault injection: a task that raises is logged and counted; the next one still runs
    from rag_kvcache.serving.metrics import ServerMetrics
    from rag_kvcache.serving.scheduler import Scheduler

    async def on_engine(fn, *args):
        return fn(*args)

    def planted() -> None:
        raise RuntimeError("planted failure")

    metrics, ran = ServerMetrics(index.store.stats), []
    scheduler = Scheduler(FusedGenerator(index), on_engine, 1, metrics, "fcfs", prefetch=False)

    async def main() -> None:
        scheduler.later(planted)
        scheduler.later(lambda: ran.append("done"))
        for _ in range(500):  # at most 5 s
            if ran:
                break
            await asyncio.sleep(0.01)
        await scheduler.close()

    asyncio.run(main())
    assert ran == ["done"] and "planted failure" in caplog.text
    count = metrics.registry.get_sample_value
    assert count("rag_kvcache_background_tasks_total", {"outcome": "failed"}) == 1
    assert count("rag_kvcache_background_tasks_total", {"outcome": "done"}) == 1


# ---- reading waiting requests' caches ahead (`serve --prefetch`) --------------------------------
def chunk_keys(index, segments: list[Segment]) -> set[str]:
    from rag_kvcache.store.addressing import address

    return {key for at in address(index.addressing, segments) if not at.request_text for key in at.keys}


def test_the_loader_reads_the_next_waiting_requests_caches_so_that_its_prefill_reads_no_disk(index):
    """With `prefetch`, the next request to be prefilled has every chunk cache it reads put in the memory tier
    on the loader's thread; its prefill then opens nothing on disk and answers as when it read the disk."""
    from rag_kvcache.serving.metrics import ServerMetrics
    from rag_kvcache.serving.scheduler import Job, Scheduler

    async def on_engine(fn, *args):
        return fn(*args)

    gen = FusedGenerator(index)
    fusion, generation = FusionConfig(method="cacheblend"), GenerationConfig(max_new_tokens=4)
    segments = chat(index, "Who founded the observatory?")
    keys = chunk_keys(index, segments)
    assert keys and not any(key in index.store.memory for key in keys)  # indexing fills no memory
    from_disk = collect_answer(gen.stream(segments, fusion, generation), None)
    for key in keys:  # the memory tier cold again
        index.store.memory.remove(key)
    metrics = ServerMetrics(index.store.stats)
    scheduler = Scheduler(gen, on_engine, 1, metrics, "fcfs", prefetch=True)
    done = Job(segments, fusion, generation, "", loaded=True)
    job = Job(segments, FusionConfig(method="full"), generation, "")  # reads no cache: nothing to load
    scheduler.pending.extend([done, job])
    scheduler._load_ahead()
    scheduler._loading.result()
    assert job.loaded and metrics.registry.get_sample_value("rag_kvcache_prefetched_caches_total") == 0
    scheduler.pending.append(waiting := Job(segments, fusion, generation, ""))
    scheduler._load_ahead()
    scheduler._loading.result()
    scheduler.loader.shutdown()
    assert waiting.loaded and all(key in index.store.memory for key in keys)
    assert metrics.registry.get_sample_value("rag_kvcache_prefetched_caches_total") == len(keys)
    disk_hits = index.store.stats()["disk"].hits  # this process's and those flushed
    answer = collect_answer(gen.stream(segments, fusion, generation), None)
    assert index.store.stats()["disk"].hits == disk_hits  # every cache read from memory
    assert answer.answer == from_disk.answer
    torch.testing.assert_close(answer.first_token_logits, from_disk.first_token_logits, atol=1e-5, rtol=1e-5)


def test_a_failed_load_is_logged_and_the_request_reads_its_caches_itself(index, monkeypatch, caplog):
    # fault injection: the loader's read raises; it is logged, and the request it was for is answered as without
    from rag_kvcache.serving.metrics import ServerMetrics
    from rag_kvcache.serving.scheduler import Scheduler

    async def on_engine(fn, *args):
        return fn(*args)

    def planted(*args) -> int:
        raise OSError("planted read failure")

    gen = FusedGenerator(index)
    fusion, generation = FusionConfig(method="cacheblend"), GenerationConfig(max_new_tokens=4)
    prompts = [chat(index, "Who founded the observatory?"), chat(index, "What does the bakery in Saltmere sell?")]
    expected = [collect_answer(gen.stream(p, fusion, generation), None).answer for p in prompts]
    monkeypatch.setattr(gen, "load", planted)
    scheduler = Scheduler(gen, on_engine, 2, ServerMetrics(index.store.stats), "fcfs", prefetch=True)

    async def answer(segments) -> str:
        return "".join([item async for item in scheduler.stream(segments, fusion, generation)][:-1])

    async def main() -> list[str]:
        try:
            return await asyncio.gather(*map(answer, prompts))
        finally:
            await scheduler.close()  # waits for the loader

    assert asyncio.run(main()) == expected
    assert "planted read failure" in caplog.text and "ahead of its prefill failed" in caplog.text
