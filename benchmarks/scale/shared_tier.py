"""Two processes sharing one Redis tier: the second one's first query over chunks the first computed is
a remote hit; remote read throughput; TTFT with the caches read from Redis, the local disk and memory.

    .venv/bin/python benchmarks/scale/shared_tier.py --data ../shared/data/musique_dev.json --out /tmp/scale-shared

1. Starts a `redis-server` on a free 127.0.0.1 port (persistence off, `--maxmemory`, `allkeys-lru`) and
   stops it at the end.
2. Process A (`rag-kvcache index DOCS --index A --kv-remote URL`, a subprocess) indexes the distinct
   passages of the first `--questions` MuSiQue questions (read at run time, never committed): every
   chunk cache goes to A's disk tier and to Redis.
3. Process B (this script again, `reader`, another subprocess) copies A's index without its caches
   (another machine holding the same index files) and opens it with `--kv-remote`, memory tier off and an
   empty disk tier; it asks the first question (top 6 chunks) and reports the tier counters (a shared
   tier works when every chunk read is a remote hit and none is recomputed). Then:
   - remote read throughput: each retrieved entry opened from Redis and read layer by layer (`GETRANGE`s
     of a layer's tensors in one pipelined request, then each tensor's xxh3 checked), MB/s per layer
     read and per whole entry; beside it the same entries read from A's disk tier, with the page cache
     warm (A has just written them) and after asking the kernel to drop their pages (`fdatasync` and
     `POSIX_FADV_DONTNEED`, `DiskTier.drop_page_cache`; on a VM the host may still cache them), and one
     plain `GET` of each whole value;
   - TTFT of the same question with `reuse` and `cacheblend` (and `full`, which reads no cache), the
     caches read from Redis over loopback (B, memory tier off), from A's disk tier (memory tier off;
     page cache warm, and dropped before each ask) and from the in-process memory tier (A's index, its
     memory tier filled by one ask), `--repeats` rounds, sources interleaved within a round so that
     load from other processes hits all of them.

Results go to `OUT/results.json`, the load average recorded with every phase; what they were in this
repository's run: `README.md` beside this script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import redis

READER = "reader"


def start_redis(work: Path, maxmemory: str) -> tuple[subprocess.Popen, str]:
    """`redis-server` on a free loopback port, persistence off; returns the process and its URL."""
    server = shutil.which("redis-server") or shutil.which("valkey-server")
    if server is None:
        raise RuntimeError("redis-server not found: install the Debian package redis-server (scripts/setup.sh does)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(work),
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            maxmemory,
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 30
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start on port {port} (exit code {proc.poll()})") from None
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="musique_dev.json")
    parser.add_argument("--out", type=Path, required=True, help="work folder (emptied); results.json goes here")
    parser.add_argument("--questions", type=int, default=1, help="MuSiQue questions whose passages are indexed")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of reads and of TTFT")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads in both processes (1 on a loaded machine)"
    )
    parser.add_argument("--maxmemory", default="2gb", help="redis-server --maxmemory")
    args = parser.parse_args()

    from rag_kvcache.bench.corpus import write_corpus
    from rag_kvcache.bench.datasets import load_musique

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    examples = load_musique(args.data)[: args.questions]
    write_corpus(examples, args.out / "docs")
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    proc, url = start_redis(Path(tempfile.mkdtemp(prefix="redis-", dir=args.out)), args.maxmemory)
    try:
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "rag_kvcache",
                "index",
                str(args.out / "docs"),
                "--index",
                str(args.out / "a"),
                "--kv-remote",
                url,
            ],
            check=True,
            env=env,
        )
        indexing = {"wall_s": time.perf_counter() - t0, "load_avg_1m": [load, os.getloadavg()[0]]}
        info = redis.Redis.from_url(url).info("memory")
        indexing |= {"redis_keys": redis.Redis.from_url(url).dbsize(), "redis_used_memory": info["used_memory"]}
        print(
            f"A indexed in {indexing['wall_s']:.1f} s; Redis holds {indexing['redis_keys']} keys, "
            f"{info['used_memory'] / 2**20:.0f} MiB",
            flush=True,
        )
        subprocess.run(
            [
                sys.executable,
                __file__,
                READER,
                str(args.out),
                url,
                examples[0].question,
                str(args.repeats),
                str(args.threads),
            ],
            check=True,
            env=env,
        )
    finally:
        proc.terminate()
        proc.wait(30)
    results = json.loads((args.out / "reader.json").read_text()) | {"indexing_a": indexing}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


def reader(out: Path, url: str, question: str, repeats: int, threads: int) -> None:
    """Process B: the first query over A's chunks through Redis, read throughput, TTFT per source."""
    import torch

    from rag_kvcache.config import FusionConfig, GenerationConfig
    from rag_kvcache.engine.model import ModelAdapter
    from rag_kvcache.index import KVIndex
    from rag_kvcache.query.generator import FusedGenerator

    torch.set_num_threads(threads)
    a_path = out / "a"
    base = KVIndex.config_of(a_path)
    adapter = ModelAdapter.load(base)
    no_memory = replace(base.runtime.storage, memory_bytes=0)
    b_path = out / "b"
    shutil.copytree(a_path, b_path, ignore=lambda d, names: ["kv"] if Path(d) == a_path else [])
    views = {  # source of the caches -> the index read through it
        "redis": KVIndex.open(b_path, base.with_runtime(storage=replace(no_memory, remote=url)), adapter),
        "disk": KVIndex.open(a_path, base.with_runtime(storage=no_memory), adapter),
        "memory": KVIndex.open(a_path, base, adapter),
    }
    b = views["redis"]
    gen = GenerationConfig(max_new_tokens=4)
    hits = b.search(question, base.query.top_k)

    # The first query of B: every cache from Redis, none recomputed, B's own disk tier empty.
    first = FusedGenerator(b).ask(question, hits, fusion=FusionConfig(method="cacheblend"), generation=gen)
    stats = b.store.stats()  # B's own counters (its store folder was not copied): each ask flushes them
    remote, local = stats["remote"], stats["disk"]
    first_query = {
        "ttft_s": first.ttft_s,
        "cache_misses": first.cache_misses,
        "chunks": len(hits),
        "remote": remote.as_dict(),
        "disk": local.as_dict(),
        "b_disk_files": len(list(b.store.disk.files())),
        "load_avg_1m": os.getloadavg()[0],
    }
    print(
        f"B's first query: {len(hits)} chunks + the prefix; remote tier hits {remote.hits}, misses {remote.misses}, "
        f"errors {remote.errors}; disk hits {local.hits}, misses {local.misses}; recomputed (cache misses) "
        f"{first.cache_misses}; B's disk files {first_query['b_disk_files']}; TTFT {first.ttft_s * 1000:.0f} ms",
        flush=True,
    )

    # Read throughput: the retrieved entries layer by layer from Redis and from A's disk (page cache warm,
    # and dropped), sources interleaved in each round; plain GETs of the whole values.
    keys = [b.addressing.key(h.chunk.token_ids) for h in hits]
    disk = views["disk"].store.disk
    timed: dict[str, list[tuple[int, float]]] = {}
    whole: dict[str, list[tuple[int, float]]] = {}
    gets = []
    for _ in range(repeats):
        for name in ("redis", "disk", "disk_dropped"):
            if name == "disk_dropped":
                disk.drop_page_cache()
            layers, entries = read_times(b.store.remote if name == "redis" else disk, keys)
            timed.setdefault(name, []).extend(layers)
            whole.setdefault(name, []).extend(entries)
        t0 = time.perf_counter()
        gets.append(
            sum(len(b.store.remote.client.get(b.store.remote.redis_key(k))) for k in keys) / (time.perf_counter() - t0)
        )
    reads: dict[str, object] = {
        name: {
            "entry_MBps_median": statistics.median(n / s / 1e6 for n, s in whole[name]),
            "layer_MBps_median": statistics.median(n / s / 1e6 for n, s in timed[name]),
            "layer_ms_median": statistics.median(s * 1000 for _, s in timed[name]),
            "layer_MB_median": statistics.median(n / 1e6 for n, _ in timed[name]),
            "entries_read": len(whole[name]),
        }
        for name in timed
    }
    reads["redis_plain_get_MBps_median"] = statistics.median(gets) / 1e6
    for name in timed:
        r = reads[name]
        print(
            f"read {name}: whole entries {r['entry_MBps_median']:.0f} MB/s; per layer {r['layer_MBps_median']:.0f} MB/s "
            f"({r['layer_ms_median']:.2f} ms for {r['layer_MB_median']:.2f} MB); medians over {r['entries_read']} entry "
            "reads",
            flush=True,
        )
    print(f"redis plain GET of the whole values: {reads['redis_plain_get_MBps_median']:.0f} MB/s", flush=True)

    # TTFT per source and method, sources interleaved within each round.
    generators = {name: FusedGenerator(view) for name, view in views.items()}
    generators["memory"].ask(
        question, hits, fusion=FusionConfig(method="reuse"), generation=gen
    )  # fills the memory tier
    ttft: dict[str, dict[str, list[float]]] = {}
    misses = 0
    for _ in range(repeats):
        for method in ("reuse", "cacheblend"):
            for name in ("redis", "disk", "disk_dropped", "memory"):
                if name == "disk_dropped":
                    disk.drop_page_cache()
                answer = generators[name.removesuffix("_dropped")].ask(
                    question, hits, fusion=FusionConfig(method=method), generation=gen
                )
                ttft.setdefault(method, {}).setdefault(name, []).append(answer.ttft_s)
                misses += answer.cache_misses
        ttft.setdefault("full", {}).setdefault("none", []).append(
            generators["disk"].ask(question, hits, fusion=FusionConfig(method="full"), generation=gen).ttft_s
        )
    for method, by_source in ttft.items():
        print(
            f"TTFT {method}: "
            + ", ".join(f"{name} {statistics.median(v) * 1000:.0f} ms" for name, v in by_source.items()),
            flush=True,
        )
    tiers = {name: {t: s.as_dict() for t, s in view.store.stats().items()} for name, view in views.items()}
    result = {
        "question": question,
        "prompt_tokens": first.prompt_tokens,
        "threads": threads,
        "first_query_b": first_query,
        "reads": reads,
        "ttft_s": ttft,
        "cache_misses_in_ttft_rounds": misses,
        "tier_stats": tiers,
        "load_avg_1m_end": os.getloadavg()[0],
    }
    (out / "reader.json").write_text(json.dumps(result, indent=1))


def read_times(tier, keys: list[str]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """Each entry opened from `tier` and read layer by layer, its tensors verified: (bytes, seconds) of
    every layer read and of every whole entry (opening included)."""
    layers, entries = [], []
    for key in keys:
        t0 = time.perf_counter()
        entry = tier.open(key)
        if entry is None:
            raise RuntimeError(f"{tier.where(key)} is missing: the benchmark expects every retrieved entry there")
        for i in range(entry.n_layers):
            before, t1 = tier.stats.bytes_read, time.perf_counter()
            entry.layer(i)
            layers.append((tier.stats.bytes_read - before, time.perf_counter() - t1))
        entries.append((sum(n for n, _ in layers[-entry.n_layers :]), time.perf_counter() - t0))
    return layers, entries


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == READER:
        reader(Path(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
