"""Per-stage wall-clock accounting of the query path (KV load, assembly/RoPE, per-layer compute)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch


class StageClock:
    """Accumulates seconds per named stage. On CUDA, `sync=True` waits for the device at each stage
    boundary so times are attributed correctly (at the price of the overlap they would otherwise have)."""

    def __init__(self, device: torch.device | str = "cpu", sync: bool = False) -> None:
        self.sync = sync and torch.device(device).type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - start
