"""Layer-wise loading of a prompt's chunk caches, pipelined with the fusion (CacheBlend §5).

The fusion needs layer i's cached K/V only when it reaches layer i. A `LayerFeed` runs a
background thread that reads layers in order into a queue of at most `depth` layers, so while
layer i is being recomputed, layers i+1..i+depth are being read (and verified, and decoded); asking
for layer i waits only for layer i. Reading releases the GIL (see `tiers`), so the overlap is real
even on CPU. The thread packs each layer's caches (`pack_layer`); `get` places the pack in a buffer
from the query path's pool, in the fusion's thread (`KVPlacement.assemble`): placed by the reader too,
the fusion's many small operations waited on the reader's for Python's GIL (benchmarks/RESULTS.md,
issue 30). The fusion times its waits (`kv_wait`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import torch

from ..engine.buffers import KVBufferPool
from ..engine.cache import LayerSource, pack_layer
from ..engine.fusion import KVPlacement


class LayerFeed:
    """Each layer's K/V of a prompt [2, H_kv, N, D] with its segments' caches assembled, in layer order.

    A context manager: leaving it stops a reader the fusion did not drain (it ended early or failed).
    Buffers come from `pool` (default: none kept, each one new).
    """

    def __init__(
        self,
        sources: Sequence[LayerSource | None],
        placement: KVPlacement,
        n_layers: int,
        depth: int,
        pool: KVBufferPool | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"a feed reads ahead by at least one layer, got depth {depth!r}")
        self._sources = list(sources)
        self._placement = placement
        self._n_layers = n_layers
        self._pool = pool or KVBufferPool(0)
        self._next = 0
        self._queue: queue.Queue[torch.Tensor | None | BaseException] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-layer-reader", daemon=True)
        self._thread.start()

    def __enter__(self) -> LayerFeed:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> None:
        with torch.inference_mode():
            for layer in range(self._n_layers):
                if self._stop.is_set():
                    return
                try:
                    item: torch.Tensor | None | BaseException = pack_layer(
                        self._sources, layer, self._placement.positions.device
                    )
                except BaseException as err:  # handed to the consumer, raised in its thread
                    item = err
                self._queue.put(item)  # blocks while `depth` layers wait to be fused
                if isinstance(item, BaseException):
                    return

    def get(self, layer: int) -> torch.Tensor:
        if layer != self._next:
            raise ValueError(f"a feed yields layers in order: asked for layer {layer}, the next is {self._next}")
        self._next += 1
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return self._placement.assemble(item, self._pool)

    def fill(self, layers: range, out: torch.Tensor) -> None:
        for i, layer in enumerate(layers):
            out[i].copy_(self.get(layer))  # [2, H_kv, N, D]

    def close(self) -> None:
        """Stop reading ahead and let the reader thread finish."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.01)
            except queue.Empty:
                pass
