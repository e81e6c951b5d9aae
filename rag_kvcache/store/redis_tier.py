"""A tier shared by every process and machine that opens the index: a Redis or Valkey server.

Each entry is one string value holding the entry in the store's format (`backend.encode_entry`, the
bytes a disk tier's file holds), under `<format>:<codec>:<key>`: an index that stores caches with
another codec, or a later format, never reads it. Layer-wise reads are `GETRANGE`s of the layer's
byte ranges, one pipelined request per layer, so the pipelined loader (`loading.LayerFeed`) reads
layer i+1 over the network while layer i is fused; the header is checked when an entry is opened and
each layer against its checksums when read, as on disk.

- Written once: `SET ... NX`, so the first process to compute an entry stores it and later writers
  of the same key leave it; a `SET` is all-or-nothing (a writer that dies mid-command stores nothing).
- Evicted by the server (`maxmemory` with an `allkeys-*` policy, see docs/scaling.md). One value per
  entry, so eviction takes an entry whole; an entry evicted, or replaced, between its opening and the
  reading of a layer reads short or fails its checksum: a corrupt entry, recomputed, never a wrong hit.
- Authenticated when the cluster shares a secret (`StorageConfig.remote_secret`): a value is the entry
  and an HMAC-SHA256 of its Redis key and bytes, read whole and verified before any layer is used. The
  checksums prove an entry intact, not that it is the chunk its key names: without the secret, anyone
  who can write to the server can plant another chunk's valid entry under a key (the trust boundary is
  then the server's ACLs and TLS, docs/scaling.md). An entry that fails the check is dropped (and so
  may be written again by an honest process) and recomputed.
- Trusted as computed (`trusted`, what indexing skips) only when read and verified with the secret; without
  one, no entry is. Without a secret the tier is read-only (no `SET`, no `DEL`) unless
  `StorageConfig.remote_writable`: a corrupt or mismatching entry is then left there, and read past (the
  recomputed cache is on the reader's disk, which it reads first).
- The server going away never fails an answer: a request that fails or times out is a miss (an entry
  being read raises `UnreachableEntryError`, which the index recomputes), counted in `errors`, logged
  once; the tier is then skipped for `remote_retry` seconds before it is tried again.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Collection
from functools import partial
from typing import TypeVar

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..config import StorageConfig
from ..engine.cache import ChunkKV
from .backend import FORMAT, Backend, Entry, UnreachableEntryError
from .codecs import get_codec

log = logging.getLogger(__name__)
T = TypeVar("T")

_DOWN = (redis.ConnectionError, redis.TimeoutError)  # the server is unreachable: skip it for a while
_TAG_BYTES = hashlib.sha256().digest_size
_VERIFY_BATCH = 64  # entries read per pipelined request by `trusted` (about 80 MB of 128-token SmolLM2 caches)


class RedisTier(Backend):
    """Entries on the Redis or Valkey server at `config.remote`, encoded by `codec` (a name in `CODECS`)."""

    def __init__(
        self, config: StorageConfig, codec: str, on_loaded: Callable[[str, ChunkKV], None] | None = None
    ) -> None:
        if config.remote is None:
            raise ValueError("a RedisTier needs StorageConfig.remote, a redis:// URL; got None")
        super().__init__(get_codec(codec), on_loaded)
        self.name = config.remote_address
        self.client = redis.Redis.from_url(  # one immediate retry: a pooled connection the server closed
            config.remote,
            socket_timeout=config.remote_timeout,
            socket_connect_timeout=config.remote_timeout,
            retry=Retry(NoBackoff(), 1),
        )
        self.retry = config.remote_retry
        self._secret = config.remote_secret
        self.writable = config.remote_writes
        self._prefix = f"{FORMAT}:{codec}:"
        self._lock = threading.Lock()
        self._down_until: float | None = None  # monotonic time; None while the server answers
        self._logged: set[str] = set()

    def redis_key(self, key: str) -> str:
        return self._prefix + key

    def where(self, key: str) -> str:
        return f"{self.name} {self.redis_key(key)}"

    # ---- the backend ------------------------------------------------------------------------------
    def write(self, key: str, data: bytes) -> int:
        """Store `data` unless the key is already there (another process computed it first); with a secret,
        an entry there that does not verify (planted) is replaced. Returns the bytes written, 0 when it was
        there, the server did not take it, or the tier is read-only."""
        if not self.writable:
            return 0
        name = self.redis_key(key)
        value = data if self._secret is None else bytes(data) + self._tag(name, data)
        written = self._request(lambda: self.client.set(name, value, nx=True), None)
        if not written and self._secret is not None and self._forged(key):
            written = self._request(lambda: self.client.set(name, value), None)
        if not written:
            return 0
        self.count(bytes_written=len(value))
        return len(value)

    def _forged(self, key: str) -> bool:
        """Whether the entry under `key` does not verify with the secret (then logged and counted corrupt)."""
        value = self._request(lambda: self.client.get(self.redis_key(key)), None)
        if value is None:
            return False
        try:
            self._authentic(self.redis_key(key), value)
        except ValueError as err:
            log.warning("replacing the KV cache entry %s: %s", self.where(key), err)
            self.count(corrupt=1)
            return True
        return False

    def blob(self, key: str) -> RedisBlob | VerifiedBlob | None:
        """The entry's bytes on the server, read by ranges; with a secret, read whole and verified
        (ValueError when the tag does not match: `Backend.open` drops the entry)."""
        name = self.redis_key(key)
        if self._secret is None:
            size = self.client.strlen(name)
            return RedisBlob(self, name, size) if size else None
        value = self.client.get(name)
        return None if value is None else self._authentic(name, value)

    def _authentic(self, name: str, value: bytes) -> VerifiedBlob:
        """The entry `value` holds under Redis key `name`, its HMAC verified with the secret, or `ValueError`."""
        data, tag = value[:-_TAG_BYTES], value[-_TAG_BYTES:]
        if len(value) <= _TAG_BYTES or not hmac.compare_digest(tag, self._tag(name, data)):
            raise ValueError(
                "its HMAC does not verify with this cluster's secret: written without it, by another "
                "writer, or for another key"
            )
        return VerifiedBlob(memoryview(data))

    def _tag(self, name: str, data: bytes | bytearray | memoryview) -> bytes:
        mac = hmac.new(self._secret, name.encode(), hashlib.sha256)
        mac.update(data)
        return mac.digest()

    def __contains__(self, key: str) -> bool:
        return bool(self._request(lambda: self.client.exists(self.redis_key(key)), 0))

    def held(self, keys: Collection[str]) -> set[str]:
        """Those of `keys` the server holds, asked in one pipelined request (none when it does not answer); the
        store asks only for a non-empty set (`KVStore.missing`)."""
        order = list(keys)

        def exists() -> list[int]:
            pipe = self.client.pipeline(transaction=False)
            for key in order:
                pipe.exists(self.redis_key(key))
            return pipe.execute()

        found = self._request(exists, [0] * len(order))
        return {key for key, n in zip(order, found) if n}

    def trusted(self, keys: Collection[str]) -> set[str]:
        """Those of `keys` whose entries were read here and verified with the cluster's secret (HMAC, then the
        header), `_VERIFY_BATCH` to a pipelined request; an entry that fails is dropped. None without a secret
        (an entry then proves only that someone who can write to the server stored it), nor of a batch the
        server does not answer."""
        if self._secret is None:
            return set()
        order, found = list(keys), set()
        for start in range(0, len(order), _VERIFY_BATCH):
            batch = order[start : start + _VERIFY_BATCH]
            values = self._request(partial(self._get_all, batch), [None] * len(batch))
            found |= {key for key, value in zip(batch, values) if value is not None and self._verifies(key, value)}
        return found

    def _get_all(self, keys: list[str]) -> list[bytes | None]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(self.redis_key(key))
        return pipe.execute()

    def _verifies(self, key: str, value: bytes) -> bool:
        """Whether `value`, read under `key`, is an authentic, well-formed entry (else it is dropped)."""
        try:
            Entry(self, key, self._authentic(self.redis_key(key), value))
        except ValueError as err:
            self.drop(key, err)
            return False
        self.count(bytes_read=len(value))
        return True

    def remove(self, key: str) -> None:
        """Delete the entry; nothing in a read-only tier (`writable` False)."""
        if self.writable:
            self._request(lambda: self.client.delete(self.redis_key(key)), None)

    def open(self, key: str) -> Entry | None:
        """The entry, or None when missing, corrupt (then removed) or the server does not answer."""
        if not self._available():
            self.count(misses=1)
            return None
        try:
            entry = super().open(key)
        except redis.RedisError as err:
            self._failed(err)
            self.count(misses=1)
            return None
        self._answered()
        return entry

    # ---- the server's health --------------------------------------------------------------------
    def _request(self, call: Callable[[], T], default: T) -> T:
        """`call()` on the server, or `default` when it is skipped as down or the request fails."""
        if not self._available():
            return default
        try:
            result = call()
        except redis.RedisError as err:
            self._failed(err)
            return default
        self._answered()
        return result

    def _available(self) -> bool:
        with self._lock:
            return self._down_until is None or time.monotonic() >= self._down_until

    def _answered(self) -> None:
        if self._down_until is not None:
            with self._lock:
                self._down_until = None
                self._logged.clear()
            log.info("the KV remote tier %s answers again", self.name)

    def _failed(self, err: redis.RedisError) -> None:
        """Count a failed request and log it once per outage; an unreachable server is skipped for
        `retry` seconds."""
        self.count(errors=1)
        down = isinstance(err, _DOWN)
        with self._lock:
            if down:
                self._down_until = time.monotonic() + self.retry
            first = type(err).__name__ not in self._logged
            self._logged.add(type(err).__name__)
        if first and down:
            log.warning(
                "the KV remote tier %s does not answer (%s: %s): its entries are read from the lower tiers or "
                "recomputed; retrying in %g s",
                self.name,
                type(err).__name__,
                err,
                self.retry,
            )
        elif first:
            log.warning("the KV remote tier %s refused a request (%s: %s)", self.name, type(err).__name__, err)

    def server_info(self) -> dict[str, int | str]:
        """The server's own figures (for the whole database, not only this index's entries): keys,
        memory used, its limit and policy, keys it evicted. Raises `redis.RedisError`."""
        memory, stats = self.client.info("memory"), self.client.info("stats")
        return {
            "keys": self.client.dbsize(),
            "used_memory": memory["used_memory"],
            "maxmemory": memory["maxmemory"],
            "maxmemory_policy": memory["maxmemory_policy"],
            "evicted_keys": stats["evicted_keys"],
        }


class RedisBlob:
    """An entry's value on the server, read by `GETRANGE`."""

    def __init__(self, tier: RedisTier, name: str, size: int) -> None:
        self._tier, self._name, self.size = tier, name, size

    def read(self, offset: int, n: int) -> bytes:
        return self._tier.client.getrange(self._name, offset, offset + n - 1) if n > 0 else b""

    def read_into(self, ranges: list[tuple[np.ndarray, int]]) -> list[int]:
        pipe = self._tier.client.pipeline(transaction=False)
        for buf, offset in ranges:
            pipe.getrange(self._name, offset, offset + len(buf) - 1)
        try:
            values = pipe.execute()
        except redis.RedisError as err:
            self._tier._failed(err)
            raise UnreachableEntryError(f"{self._tier.name} {self._name}: {type(err).__name__}: {err}") from err
        for (buf, _), value in zip(ranges, values):
            n = min(len(value), len(buf))
            buf[:n] = np.frombuffer(value, dtype=np.uint8, count=n)
        return [len(value) for value in values]


class VerifiedBlob:
    """An entry's bytes, read whole from the server and authenticated."""

    def __init__(self, data: memoryview) -> None:
        self._data, self.size = data, len(data)

    def read(self, offset: int, n: int) -> bytes:
        return bytes(self._data[offset : offset + max(n, 0)])

    def read_into(self, ranges: list[tuple[np.ndarray, int]]) -> list[int]:
        got = []
        for buf, offset in ranges:
            part = self._data[offset : offset + len(buf)]
            buf[: len(part)] = np.frombuffer(part, dtype=np.uint8)
            got.append(len(part))
        return got
