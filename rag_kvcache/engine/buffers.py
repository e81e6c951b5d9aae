"""Memory for a prompt's fused K/V, kept across prompts and handed out only when nothing else holds it.

The fusion writes each layer's K/V of the whole prompt into one buffer [2, H_kv, N, D] (4.7 MB for a
3,050-token SmolLM2 prompt in float32, 140 MB for its 30 layers); the decoder copies them and lets them
go. Allocated afresh for every prompt, that memory goes back to the system when it is freed (glibc
trims its heap), and the next prompt takes it back a page at a time: one minor page fault per 4 KiB
written (34,000 for 140 MB), about 1.5 us each. A `KVBufferPool` keeps the buffers, as gpt-fast's
`KVCache` and transformers' `StaticLayer` keep theirs, so a prompt writes into memory that is already
mapped: in the bench's sequence of asks (MuSiQue, 2 threads), CacheBlend's fuse took 37,000-66,000
minor faults without it and 9,000-21,000 with it (those left are its first layers' MLP temporaries),
EPIC's 22,000-33,000 and then none.

Safety: a buffer is handed out only when the pool is the only holder of its storage. PyTorch counts
every tensor that views a storage (the storage's use count, which torch's CUDA-graph trees also read
before they reuse an output's memory), so a result some caller keeps (the bench's teacher forcing, a
decoder that has not copied it yet, another thread's fusion in progress) keeps its buffers from being
handed out again for as long as any view of them lives; hand-outs are serialised by a lock. The pool
keeps at most `limit` buffers (one prompt's layers, for the generator): a prompt fused while another
prompt's K/V are still held gets fresh memory, as without a pool. A buffer's old contents are stale:
whoever takes one writes all of it before reading (`FusionInput.assemble` writes every position).
On CUDA, reuse is ordered by the stream, as the caching allocator's is.
"""

from __future__ import annotations

import math
import threading

import torch


def _holders(t: torch.Tensor) -> int:
    """How many references hold `t`'s storage (every tensor viewing it, and its Python storage object)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class KVBufferPool:
    """Up to `limit` flat buffers, each handed out (`take`) as a view of the shape asked for when nothing
    but the pool holds it, and grown when a larger one is asked for; `limit=0` keeps none (every `take`
    allocates)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"a buffer pool keeps 0 or more buffers, got limit={limit!r}")
        self.limit = limit
        self._lock = threading.Lock()
        self._buffers: list[tuple[torch.Tensor, int]] = []  # a flat buffer, its holders when the pool alone holds it

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Memory of `shape` (contents undefined): a kept buffer no one else holds, else a new one, kept if
        the pool has room or in place of an idle buffer too small or of another kind."""
        n, device = math.prod(shape), torch.device(device)
        with self._lock:
            idle = [i for i, (buf, alone) in enumerate(self._buffers) if _holders(buf) == alone]
            for i in idle:
                buf = self._buffers[i][0]
                if buf.dtype == dtype and buf.device == device and buf.numel() >= n:
                    return buf[:n].view(shape)  # a view: the pool no longer holds it alone
            buf = torch.empty(n, dtype=dtype, device=device)
            if idle:
                self._buffers[idle[0]] = buf, _holders(buf)
            elif len(self._buffers) < self.limit:
                self._buffers.append((buf, _holders(buf)))
            return buf.view(shape)
