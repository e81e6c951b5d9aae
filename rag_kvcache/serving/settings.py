"""The server's settings: a frozen config whose fields carry the help texts `rag-kvcache serve` shows
(kept apart from the app so that the CLI imports it without FastAPI)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..config import StorageConfig, at_least, one_of, setting
from ..errors import ConfigError


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens and what it admits."""

    host: str = setting("127.0.0.1", "Address to bind (127.0.0.1: this machine only; 0.0.0.0: every interface).")
    port: int = setting(8000, "TCP port.")
    api_keys: tuple[str, ...] = setting(
        (),
        "Require `Authorization: Bearer KEY` with one of these keys on every route but /health (repeatable). Each "
        "key is a tenant: caches of request text (prompt heads) and conversations are its own, and /metrics shows "
        "it its own numbers. These keys may only ask: they cannot change the documents.",
        secret=True,
    )
    admin_keys: tuple[str, ...] = setting(
        (),
        "Keys that may also change the corpus (POST /v1/documents) and see every tenant's numbers on /metrics "
        "(repeatable); each is a tenant of its own too. With keys given, only these may write; with none at all, "
        "anyone who reaches the server may.",
        secret=True,
    )
    docs_dir: Path | None = setting(
        None, "The documents folder POST /v1/documents writes into and syncs the index with (unset: no such route)."
    )
    max_queue: int = setting(8, "Requests that may wait for the engine; more are refused with 429.")
    max_batch: int = setting(
        8,
        "Most requests decoded together, one batched model step advancing each by a token "
        "(their fused prefills run one at a time); 1 serves one request at a time.",
    )
    max_prompt_tokens: int = setting(8192, "Longest prompt admitted, in tokens (longer: 400).")
    max_tokens: int = setting(1024, "Most tokens a request may ask to generate (more: 400).")
    max_per_key: int = setting(
        8,
        "Most requests one API key may have waiting or in service at once (more: 429), "
        "so that one client cannot take every place; 0: no limit. Without keys, none.",
    )
    max_body_bytes: int = setting(
        16 << 20, "Largest request body, in bytes (larger: 413, refused before it is parsed)."
    )
    order: Literal["fcfs", "cache_aware"] = setting(
        "cache_aware",
        "Which waiting requests go first: the oldest, one prefill at a time (fcfs); or (cache_aware) first every "
        "request whose prompt the conversation cache holds but a short tail (a chat's next turn, a question asked "
        "again), which joins the decoding batch without a prefill of its own, then the others oldest first.",
    )
    prefetch: bool | None = setting(
        None,
        "While the engine computes, read the chunk caches of the next waiting request from disk or the remote "
        "tier into the memory tier on a thread of their own, so that its prefill reads them from memory. Unset: "
        "on when the index reads a remote tier (a trace over a Redis 2.4 ms away ran 18-19% faster with it), off "
        "otherwise (from a local disk on 2 cores its reads competed with the compute and it ran 2-8% slower).",
    )
    top_k: int | None = setting(
        None,
        "Retrieve the index's top K chunks for the last user message of every chat request that names no chunks "
        "of its own (no `rag_kvcache.chunk_ids` or `top_k`: a plain OpenAI client's chat) and fuse them, as "
        '`rag_kvcache: {"top_k": K}` does; a request opts out with `"top_k": 0`. Completions keep their prompt '
        "as given. Unset: no retrieval unless a request asks for it.",
    )
    backfill_slice_s: float = setting(
        float("inf"),
        "Under a disk budget, the longest a request waits for the chunk caches the server makes between requests "
        "(those the budget admits, of chunks the prompts computed in place): the work stops before a model layer "
        "once a slice is spent and goes on at the next moment no request waits (0: a layer at a time). inf (the "
        "default): no bound, each gap makes every cache the last prompts wanted, which fills the hot set fastest; "
        "a request may then wait seconds. Under unbroken load a bound slows the filling: on a Zipf stream of "
        "questions at a 10% budget, 1 s slices cut the hit ratio from 0.72 to 0.70 and 0.1 s slices to 0.33.",
    )
    history: Literal["halve", "refuse"] = setting(
        "halve",
        "A chat longer than the prompt limit: drop its oldest half of messages in one step, so that the next "
        "turns read the shortened chat from the conversation cache (halve), or refuse it with 400 (refuse).",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port!r}")
        one_of(self, order=("fcfs", "cache_aware"), history=("halve", "refuse"))
        if not all(self.api_keys) or not all(self.admin_keys):
            raise ConfigError("api_keys and admin_keys must not be empty strings (give none for no authentication)")
        if both := set(self.api_keys) & set(self.admin_keys):
            raise ConfigError(f"{len(both)} key(s) given both as an api key and as an admin key: give each once")
        if self.top_k is not None and not 1 <= self.top_k <= 64:
            raise ConfigError(f"top_k must be in [1, 64] (or unset: no retrieval), got {self.top_k!r}")
        if not self.backfill_slice_s >= 0:  # NaN too
            raise ConfigError(f"backfill_slice_s must be >= 0 seconds (inf: no bound), got {self.backfill_slice_s!r}")
        at_least(self, max_queue=0, max_batch=1, max_prompt_tokens=1, max_tokens=1, max_body_bytes=1, max_per_key=0)

    @property
    def authenticates(self) -> bool:
        """Whether requests need a key (any key given)."""
        return bool(self.api_keys or self.admin_keys)

    def prefetches(self, storage: StorageConfig) -> bool:
        """Whether the server reads waiting requests' caches ahead: `prefetch` as given, else when `storage` has a
        remote tier."""
        return storage.remote is not None if self.prefetch is None else self.prefetch
