"""Layer-wise loading of a prompt's chunk caches, pipelined with the fusion (CacheBlend §5).

The fusion needs layer i's cached K/V only when it reaches layer i. A `LayerFeed` with depth d > 0
runs a background thread that reads layers in order into a queue of at most d layers, so while
layer i is being recomputed, layers i+1..i+d are being read (and verified, and decoded); asking
for layer i waits only for layer i. Depth 0 reads each layer when asked, in the caller's thread:
the same work, with no overlap. Reading releases the GIL (see `storage`), so the overlap is real
even on CPU.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Sequence

import torch

from .storage import LayerSource

LayerKV = list[tuple[torch.Tensor, torch.Tensor] | None]  # per segment: keys, values [H_kv, T, D], or None


class LayerFeed:
    """Per-layer cached K/V of a prompt's segments (None for segments without a cache), in layer order."""

    def __init__(
        self, sources: Sequence[LayerSource | None], n_layers: int, device: torch.device | str, depth: int
    ) -> None:
        if depth < 1:
            raise ValueError(f"a feed reads ahead by at least one layer, got depth {depth!r}")
        self._sources = list(sources)
        self._n_layers = n_layers
        self._device = device
        self._next = 0
        self.wait_s = 0.0  # time the consumer spent waiting for a layer
        self._queue: queue.Queue[LayerKV | BaseException] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-layer-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with torch.inference_mode():
            for layer in range(self._n_layers):
                if self._stop.is_set():
                    return
                try:
                    item: LayerKV | BaseException = read_layer(self._sources, layer, self._device)
                except BaseException as err:  # handed to the consumer, raised in its thread
                    item = err
                self._queue.put(item)  # blocks while `depth` layers wait to be fused
                if isinstance(item, BaseException):
                    return

    def get(self, layer: int) -> LayerKV:
        if layer != self._next:
            raise ValueError(f"a feed yields layers in order: asked for layer {layer}, the next is {self._next}")
        self._next += 1
        start = time.perf_counter()
        item = self._queue.get()
        self.wait_s += time.perf_counter() - start
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop reading ahead (the fusion ended or failed) and let the reader thread finish."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.01)
            except queue.Empty:
                pass


def read_layer(sources: Sequence[LayerSource | None], layer: int, device: torch.device | str) -> LayerKV:
    """One layer of every source, on `device`."""
    out: LayerKV = []
    for source in sources:
        if source is None:
            out.append(None)
            continue
        k, v = source.layer(layer)  # [H_kv, T, D]
        out.append((k.to(device), v.to(device)))
    return out
