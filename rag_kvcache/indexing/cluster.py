"""Indexing on a Ray cluster: chunk caches computed by a pool of Ray actors, each holding a loaded
model, and written by them straight into the store the index is configured with; the driver
(`KVIndex.update(workers=...)`) reads, chunks and embeds the documents, checks that every new chunk's
cache is in its store, and commits the index once at the end, as a local run does.

Actors rather than Ray Data: the work is "run this loaded model over these token ids and store what
comes out", a side effect with nothing to collect. An actor pool (`ray.util.ActorPool`) says that
directly, with the model loaded once per actor and the actor's writer thread overlapping its next
batch; Ray Data would wrap the same actors in a streaming executor and turn each batch of token ids
into Arrow/NumPy blocks for output we would throw away. A failed actor surfaces as its task's
exception on the driver, which leaves the index uncommitted.

Work is dealt out as packs of chunks (`token_packs`, one packed forward each): a chunk's cache is then
bit for bit the one a local run computes, whichever actor computes it beside whichever chunks (at
the same torch thread count: an actor has one CPU, so one thread). Caches
are content-addressed, so a job killed mid-way is resumed by running it again: the chunks whose
caches were stored are not sent out again. Each actor checks that its model's fingerprint is the
driver's: another model's caches would be stored under keys that name this one.

Where caches go: the index's disk tier (`<index>/kv`: on one machine, or a folder every machine
mounts; writes are atomic renames) and, with `StorageConfig.remote`, the shared Redis tier, which is
what actors on other machines need. The driver refuses to commit chunks whose caches it cannot see.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from tqdm.auto import tqdm

from ..config import Config
from ..engine.model import ModelAdapter
from ..store.addressing import cache_key
from ..store.kvstore import KVStore
from .precompute import WriteBehind, compute_caches, compute_grouped, group_sequence, pack_tokens, token_packs

Ids = tuple[int, ...]  # a chunk's (or a prefix's) token ids
Groups = Sequence[Sequence[Ids]]  # groups of similar chunks, each prefilled together (`chunk_prefill="grouped"`)


class CacheWorker:
    """What one Ray actor runs: a loaded model whose chunk caches are written behind its compute."""

    def __init__(self, config: Config, store_root: str, namespace: str, fingerprint: str) -> None:
        self.adapter = ModelAdapter.load(config)
        self.pack_tokens = pack_tokens(config)
        if self.adapter.fingerprint != fingerprint:
            raise ValueError(
                f"the Ray worker loaded {config.index.model!r} with fingerprint {self.adapter.fingerprint}, not the "
                f"driver's {fingerprint}: every worker must load the same weights and dtype"
            )
        self.namespace = namespace
        self.writer = WriteBehind(KVStore(Path(store_root), config.index.codec, config.runtime.storage))
        self._behind: dict[Ids, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # a prefix's K/V

    def store(self, chunks: Sequence[Ids], context: Ids) -> int:
        """Compute the caches of `chunks` behind `context` and queue their writes; returns their tokens."""
        for i, kv in compute_caches(self.adapter, chunks, context, self.pack_tokens):
            self.writer.put(cache_key(self.namespace, context, chunks[i]), kv)
        return sum(map(len, chunks))

    def store_groups(self, groups: Groups, prefix: Ids, separator: Ids, keys: dict[Ids, str]) -> int:
        """Prefill `groups` of similar chunks behind `prefix` (`compute_grouped`: one pack, as the driver dealt
        it) and queue each chunk's cache under its key in `keys`; returns their tokens."""
        if prefix not in self._behind:
            self._behind[prefix] = self.adapter.prefill_packed([prefix])[0]
        for ids, kv in compute_grouped(self.adapter, groups, self._behind[prefix], separator, self.pack_tokens):
            self.writer.put(keys[ids], kv)
        return sum(len(ids) for group in groups for ids in group)

    def flush(self) -> None:
        """Wait for every queued write (raises the first write error)."""
        self.writer.flush()


class RayWorkers:
    """A pool of Ray actors computing chunk caches into an index's store (`store_root`, keyed under
    `namespace`, by a model of `fingerprint`), for `KVIndex.update(workers=...)`; `KVIndex.ray_workers()`
    makes the pool of an index.

    Connects to the cluster `config.runtime.ray` names (`ray.init(address=...)`: 'auto', 'ray://host:port', or
    'local' to start one on this machine), unless this process is connected already, and starts
    `config.runtime.ray_workers` actors (0: one per CPU the cluster has free), each holding one CPU, or one GPU
    when the index's device is CUDA. `close()` (or leaving the `with` block) stops them.
    """

    def __init__(self, config: Config, store_root: Path, namespace: str, fingerprint: str) -> None:
        try:
            import ray
        except ImportError as err:
            raise ValueError(f"indexing on Ray needs ray: pip install 'rag-kvcache[ray]' ({err})") from err
        from ray.util import ActorPool

        self._ray, self._pool_of = ray, ActorPool
        self.pack_tokens = pack_tokens(config)
        if not ray.is_initialized():
            ray.init(address=config.runtime.ray, include_dashboard=False)
        n = config.runtime.ray_workers or max(1, int(ray.available_resources().get("CPU", 1)))
        gpus = 1 if config.runtime.device.startswith("cuda") else 0
        actor = ray.remote(num_cpus=1, num_gpus=gpus)(CacheWorker)
        self.actors = [actor.remote(config, str(store_root), namespace, fingerprint) for _ in range(n)]

    def store(self, chunks: Sequence[Ids], context: Ids, progress: bool = True) -> None:
        """Compute and store the caches of `chunks` behind `context`, packs dealt out to the actors as
        they come free; returns when every cache is written."""
        packs = [[chunks[i] for i in pack] for pack in token_packs(chunks, self.pack_tokens)]
        work = lambda actor, pack: actor.store.remote(pack, context)  # noqa: E731
        self._deal(packs, work, sum(map(len, chunks)), "KV precompute", progress)

    def store_groups(
        self, groups: Groups, prefix: Ids, separator: Ids, keys: dict[Ids, str], progress: bool = True
    ) -> None:
        """`chunk_prefill="grouped"`: compute and store the caches of the chunks of `groups`, each under its key in
        `keys`, the groups dealt out in the packs a local run prefills together (so each cache is the one it
        computes); returns when every cache is written."""
        sequences = [group_sequence(g, separator) for g in groups]
        packs = [[groups[g] for g in pack] for pack in token_packs(sequences, self.pack_tokens)]
        work = lambda actor, pack: actor.store_groups.remote(  # noqa: E731
            pack, prefix, separator, {ids: keys[ids] for group in pack for ids in group}
        )
        self._deal(packs, work, sum(len(ids) for group in groups for ids in group), "KV precompute, grouped,", progress)

    def _deal(
        self, packs: Sequence[Any], work: Callable[[Any, Any], Any], tokens: int, what: str, progress: bool
    ) -> None:
        """`work(actor, pack)` for every pack, dealt out to the actors as they come free (each returns the tokens
        it computed: the progress bar's `tokens`), then every actor's queued writes flushed."""
        bar = tqdm(total=tokens, unit="tok", disable=not progress, desc=f"{what} on {len(self.actors)} Ray workers")
        for n_tokens in self._pool_of(self.actors).map_unordered(work, packs):
            bar.update(n_tokens)
        self._ray.get([actor.flush.remote() for actor in self.actors])
        bar.close()

    def close(self, drain_s: float = 60.0) -> None:
        """Let the actors finish the writes they queued (for up to `drain_s` seconds: after an interrupted
        job, every cache stored is one the next run reuses), then kill them."""
        self._ray.wait([actor.flush.remote() for actor in self.actors], num_returns=len(self.actors), timeout=drain_s)
        for actor in self.actors:
            self._ray.kill(actor)

    def __enter__(self) -> RayWorkers:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
