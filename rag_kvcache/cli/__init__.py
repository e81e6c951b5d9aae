"""`rag-kvcache`: index a folder, ask with fused KV, run the demo. The only place that prints or reads
environment variables (`RAG_KVCACHE_CACHE_DIR`: where converted models live; `RAG_KVCACHE_KV_REMOTE_SECRET`: the
key that authenticates the remote tier's entries).

Options that set a `Config` field take their default and help from the field (`config.setting`), so
rag_kvcache.config is the one source of both. torch, transformers and FAISS are imported inside the commands
that need them: `--help` and `--version` stay fast.
"""

from __future__ import annotations

from .asking import ask, chat
from .benchmarks import bench, demo
from .common import app
from .indexing import index
from .maintenance import calibrate, check, gc, stats
from .serving import serve

for command in (index, ask, chat, stats, check, gc, calibrate, demo, bench, serve):  # the order `--help` lists
    app.command()(command)

__all__ = ["app"]
