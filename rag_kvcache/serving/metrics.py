"""Prometheus metrics of the server, in a registry of its own (one per app, so that two servers in
one process, as in the tests, never share counters).

Latencies are histograms per fusion method; tokens are counters (`rate()` gives tokens per second)
plus a per-request decode-speed histogram; the KV store's counters per tier (`TierStats`: hits,
misses, bytes read and written, evictions, corrupt entries, a remote tier's failed requests) are read
from the store when scraped (totals over every process that used the index), the conversation cache's
(`ConversationStats`) from the engine's generator.

A request's own series (`RequestMetrics`: requests by route and status, latencies, tokens, cancellations,
the conversation cache's counts) are kept twice: in the server's registry (every tenant's, summed) and in
its tenant's (an API key's), so that a key is shown its own numbers and an admin key everyone's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..query.answers import Answer
from ..store.backend import TierStats
from ..store.conversations import ConversationStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
FRACTION_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TIER_COUNTERS = {  # each TierStats counter -> (metric name, help), exported per tier
    "hits": ("hits", "KV store reads served, per tier."),
    "misses": ("misses", "KV store reads missed, per tier."),
    "bytes_read": ("read_bytes", "Bytes of KV cache entries read, per tier."),
    "bytes_written": ("written_bytes", "Bytes of KV cache entries written, per tier."),
    "evictions": ("evictions", "KV cache entries evicted, per tier."),
    "corrupt": ("corrupt", "Corrupt entries found, per tier."),
    "errors": ("errors", "Requests to a remote tier that failed (server down, refused, timed out), per tier."),
}


class _StoreCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, TierStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        families = {
            field: CounterMetricFamily(f"rag_kvcache_kv_cache_{name}", doc, labels=["tier"])
            for field, (name, doc) in TIER_COUNTERS.items()
        }
        for tier, s in self._stats().items():
            for field, family in families.items():
                family.add_metric([tier], getattr(s, field))
        yield from families.values()


class _ConversationCollector(Collector):
    def __init__(self, stats: Callable[[], ConversationStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s, name = self._stats(), "rag_kvcache_conversation_cache"
        yield GaugeMetricFamily(f"{name}_bytes", "Bytes of K/V the conversation cache holds.", value=s.bytes)
        yield GaugeMetricFamily(f"{name}_max_bytes", "The conversation cache's budget in bytes.", value=s.max_bytes)
        yield GaugeMetricFamily(f"{name}_tokens", "Tokens whose K/V the conversation cache holds.", value=s.tokens)
        yield CounterMetricFamily(f"{name}_lookups", "Prompts looked up in the conversation cache.", value=s.lookups)
        yield CounterMetricFamily(f"{name}_hits", "Prompts that continued a stored conversation.", value=s.hits)
        yield CounterMetricFamily(
            f"{name}_hit_tokens", "Prompt tokens read from the conversation cache.", value=s.hit_tokens
        )
        yield CounterMetricFamily(
            f"{name}_evicted_tokens", "Tokens evicted from the conversation cache.", value=s.evicted_tokens
        )


class _TenantConversationCollector(Collector):
    """Every tenant's conversation-cache counts, labelled by tenant id (an admin's view)."""

    def __init__(self, tenants: Callable[[], dict[str, ConversationStats]]) -> None:
        self._tenants = tenants

    def collect(self) -> Iterator[Metric]:
        name = "rag_kvcache_tenant_conversation_cache"
        held = GaugeMetricFamily(
            f"{name}_bytes", "Bytes of K/V the conversation cache holds, per tenant.", labels=["tenant"]
        )
        hits = CounterMetricFamily(
            f"{name}_hits", "Prompts that continued a stored conversation, per tenant.", labels=["tenant"]
        )
        evicted = CounterMetricFamily(
            f"{name}_evicted_tokens", "Tokens evicted from the conversation cache, per tenant.", labels=["tenant"]
        )
        for tenant, s in self._tenants().items():
            held.add_metric([tenant], s.bytes)
            hits.add_metric([tenant], s.hits)
            evicted.add_metric([tenant], s.evicted_tokens)
        yield from (held, hits, evicted)


class RequestMetrics:
    """The series of requests themselves, in a registry of their own: a tenant's (its key's requests), or
    the whole server's (`ServerMetrics`). `conversation_stats`: the conversation cache's counts to export."""

    def __init__(self, conversation_stats: Callable[[], ConversationStats] | None = None) -> None:
        self.registry = CollectorRegistry()
        counter = partial(Counter, registry=self.registry)
        per_method = partial(Histogram, labelnames=["method"], registry=self.registry)
        self.requests = counter(
            "rag_kvcache_requests", "Requests answered, by route and status code.", ["route", "status"]
        )
        self.cancelled = counter("rag_kvcache_requests_cancelled", "Generations stopped because the client left.")
        self.ttft = per_method(
            "rag_kvcache_ttft_seconds", "Time to first token (fusion included), per method.", buckets=LATENCY_BUCKETS
        )
        self.e2e = per_method(
            "rag_kvcache_request_seconds",
            "Admission to last token (queueing included), per method.",
            buckets=LATENCY_BUCKETS,
        )
        self.recomputed = per_method(
            "rag_kvcache_recomputed_fraction",
            "Fraction of the prompt's tokens recomputed at query time, per method.",
            buckets=FRACTION_BUCKETS,
        )
        self.prompt_tokens = counter("rag_kvcache_prompt_tokens", "Prompt tokens, per method.", ["method"])
        self.cached_tokens = counter(
            "rag_kvcache_cached_prompt_tokens", "Prompt tokens read from the KV cache.", ["method"]
        )
        self.completion_tokens = counter("rag_kvcache_completion_tokens", "Generated tokens, per method.", ["method"])
        self.decode_rate = per_method(
            "rag_kvcache_decode_tokens_per_second", "Decoding speed after the first token.", buckets=RATE_BUCKETS
        )
        if conversation_stats is not None:
            self.registry.register(_ConversationCollector(conversation_stats))

    def observe(self, answer: Answer, e2e_s: float) -> None:
        """Record a finished generation."""
        m = answer.method
        self.ttft.labels(m).observe(answer.ttft_s)
        self.e2e.labels(m).observe(e2e_s)
        self.recomputed.labels(m).observe(answer.recomputed_tokens / max(answer.prompt_tokens, 1))
        self.prompt_tokens.labels(m).inc(answer.prompt_tokens)
        self.cached_tokens.labels(m).inc(answer.cached_tokens)
        self.completion_tokens.labels(m).inc(answer.generated_tokens)
        if answer.generated_tokens > 1 and answer.generation_s > 0:
            self.decode_rate.labels(m).observe((answer.generated_tokens - 1) / answer.generation_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ServerMetrics(RequestMetrics):
    """Every metric the server exports, in its own registry: every tenant's requests (`RequestMetrics`) and the
    server's own series (queue, batches, the KV store's tiers; with `tenant_conversations`, each tenant's
    conversation-cache counts)."""

    def __init__(
        self,
        store_stats: Callable[[], dict[str, TierStats]],
        conversation_stats: Callable[[], ConversationStats] | None = None,
        tenant_conversations: Callable[[], dict[str, ConversationStats]] | None = None,
    ) -> None:
        super().__init__(conversation_stats)
        r = self.registry
        counter, gauge, histogram = (
            partial(Counter, registry=r),
            partial(Gauge, registry=r),
            partial(Histogram, registry=r),
        )
        self.rejected = counter("rag_kvcache_requests_rejected", "Requests refused with 429: the queue was full.")
        self.queue_wait = histogram(
            "rag_kvcache_queue_wait_seconds", "Time a request waited for the engine.", buckets=LATENCY_BUCKETS
        )
        self.queue_depth = gauge("rag_kvcache_queue_depth", "Requests admitted and waiting for the engine.")
        self.active = gauge(
            "rag_kvcache_active_requests",
            "Requests admitted to the engine: in its scheduler's queue for their prefill, or being served.",
        )
        self.decode_batch = histogram(
            "rag_kvcache_decode_batch_size", "Requests advanced by each batched decoding step.", buckets=BATCH_BUCKETS
        )
        self.decoding = gauge("rag_kvcache_decoding_requests", "Requests in the decoding batch now.")
        self.joined = counter(
            "rag_kvcache_joined_requests",
            "Requests that joined the decoding batch without a prefill of their own: the conversation cache held "
            "all of their prompt but a short tail, fed by a batched step (--order cache_aware).",
        )
        self.prefetched = counter(
            "rag_kvcache_prefetched_caches",
            "Chunk caches read into the memory tier for a waiting request while others computed (--prefetch).",
        )
        self.decode_bytes = gauge(
            "rag_kvcache_decode_cache_bytes",
            "Bytes of the decoding requests' K/V buffers (every slot as long as the longest request's); 0 when none "
            "decodes.",
        )
        self.background = counter(
            "rag_kvcache_background_tasks",
            "Tasks no request waits for (a chat's shortened history prepared), run while idle, by outcome.",
            ["outcome"],
        )
        self.background_queue = gauge("rag_kvcache_background_queue", "Background tasks waiting for an idle moment.")
        r.register(_StoreCollector(store_stats))
        if tenant_conversations is not None:
            r.register(_TenantConversationCollector(tenant_conversations))
