"""`rag-kvcache stats`, `check`, `gc` and `calibrate`: an index's numbers, integrity, orphaned caches and
the loading controller's measurements."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .common import base_config, fail, model_process, out, placed
from .options import INDEX_HELP, KVRemote, PlacedDevice, PlacedDType


def stats(index_dir: Annotated[Path, typer.Option("--index", help=INDEX_HELP)], kv_remote: KVRemote = None) -> None:
    """Print the KV store's counters per tier (totals over every process that used it) and its size."""
    from ..index import KVIndex
    from ..store.kvstore import KVStore

    try:
        cfg = KVIndex.config_of(index_dir, base_config()).with_storage(remote=kv_remote)
        store = KVStore(index_dir / "kv", cfg.index.codec, cfg.runtime.storage)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    table = Table("tier", "hits", "misses", "hit rate", "read", "written", "evictions", "corrupt", "errors")
    for tier, s in store.stats().items():
        rate = f"{s.hits / (s.hits + s.misses):.1%}" if s.hits + s.misses else "-"
        table.add_row(
            tier,
            str(s.hits),
            str(s.misses),
            rate,
            _mib(s.bytes_read),
            _mib(s.bytes_written),
            str(s.evictions),
            str(s.corrupt),
            str(s.errors),
        )
    out.print(table)
    sizes = [p.stat().st_size for p in store.disk.files()]
    ledger = None if store.ledger is None else store.ledger.stats()
    budget = "unbounded" if ledger is None or ledger.budget is None else _mib(ledger.budget)
    out.print(
        f"disk tier: {len(sizes)} entries, {_mib(sum(sizes))} (budget {budget}), codec {cfg.index.codec}; "
        f"memory tier budget {_mib(cfg.runtime.storage.memory_bytes)} per process, eviction {cfg.runtime.storage.eviction}"
    )
    if ledger is not None:
        _print_ledger(ledger)
    if store.remote is not None:
        _print_remote(store.remote)


def _print_ledger(ledger) -> None:
    """The disk tier's budget at work: what prompts read from it, what it refused and evicted, its hot set."""
    out.print(
        f"chunk caches prompts read from disk: {ledger.hits} hits, {ledger.misses} misses, byte hit ratio "
        f"{ledger.hit_ratio:.1%}; {ledger.refused} writes refused and {ledger.evictions} entries evicted by the budget"
    )
    if ledger.hot:
        hot = Table("hot set: key", "reads", "size", "priority (GDSF)")
        for key, uses, nbytes, priority in ledger.hot:
            hot.add_row(key, str(uses), _mib(nbytes), f"{priority:.3g}")
        out.print(hot)


def _print_remote(remote) -> None:
    """The remote tier's server figures (its whole database: other indexes' entries count too)."""
    import redis

    try:
        info = remote.server_info()
    except redis.RedisError as e:
        out.print(f"remote tier {remote.name}: does not answer ({type(e).__name__}: {e})", highlight=False)
        return
    limit = _mib(info["maxmemory"]) if info["maxmemory"] else "no limit"
    out.print(
        f"remote tier {remote.name}: {info['keys']} keys, {_mib(info['used_memory'])} used of {limit} "
        f"(maxmemory-policy {info['maxmemory_policy']}), {info['evicted_keys']} keys evicted by the server",
        highlight=False,
    )


def check(
    index_dir: Annotated[Path, typer.Option("--index", help=INDEX_HELP)],
    repair: Annotated[
        bool,
        typer.Option(
            help="Rebuild what can be rebuilt: vectors.faiss from the stored embeddings, "
            "damaged embeddings by re-embedding, missing or corrupt KV caches by "
            "recomputing; a neighbour table or pending.json that does not parse dropped; collect orphans. "
            "What is intact is not recomputed."
        ),
    ] = False,
) -> None:
    """Verify every file of an index: the records it is opened with (its settings, neighbour table, pending.json),
    SQLite (integrity and every chunk row), vectors.faiss (checksum and ids) and every KV cache (every tensor's
    checksum). Exits 1 when something is wrong and not repaired."""
    from ..index import KVIndex
    from ..maintenance import check as check_index
    from ..maintenance import check_records

    model_process()
    try:
        report = check_records(index_dir, repair=repair)  # what the index cannot open without
        if opened := report.ok:
            index = KVIndex.open(index_dir, KVIndex.config_of(index_dir, base_config()), rewrite=False)  # as it is
            report = check_index(index, repair=repair, found=report)
    except (OSError, ValueError) as e:
        fail(str(e))
    for problem in report.problems:
        out.print(f"[red]found:[/red] {problem}", highlight=False)
    for garbage in report.garbage:
        out.print(f"[yellow]garbage:[/yellow] {garbage} (`rag-kvcache gc` deletes it)", highlight=False)
    for work in report.resumable:
        out.print(f"resumable: {work}", highlight=False)
    for done in report.repaired:
        out.print(f"[green]repaired:[/green] {done}", highlight=False)
    for left in report.unrepaired:
        out.print(f"[red]not repaired:[/red] {left}", highlight=False)
    if not opened:
        out.print(
            f"{index_dir}: damaged; it cannot open until what was found is repaired "
            + ("(`rag-kvcache check --repair`)" if not report.unrepaired else "(see above)"),
            highlight=False,
        )
        raise typer.Exit(1)
    out.print(
        f"{index_dir}: {'ok' if report.ok else 'damaged'}; {report.caches_checked} KV caches checked, "
        f"{report.caches_cold} not made (made when a question needs them), "
        f"{report.reembedded} chunks re-embedded, {report.recomputed} KV caches recomputed",
        highlight=False,
    )
    if not report.ok:
        raise typer.Exit(1)


def gc(index_dir: Annotated[Path, typer.Option("--index", help=INDEX_HELP)]) -> None:
    """Delete the KV caches no indexed chunk uses (of edited or deleted documents, of another model) and the
    temporary files of killed runs. `index` does this after every run too."""
    from ..index import KVIndex
    from ..maintenance import gc as collect

    model_process()
    try:
        collected = collect(KVIndex.open(index_dir, KVIndex.config_of(index_dir, base_config())))
    except (OSError, ValueError) as e:
        fail(str(e))
    out.print(f"{index_dir}: {collected}", highlight=False)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def calibrate(
    index_dir: Annotated[Path, typer.Option("--index", help="Measure for this index's model, codec and disk.")],
    tokens: Annotated[int, typer.Option(min=16, help="Tokens per synthetic chunk cache.")] = 512,
    device: PlacedDevice = None,
    dtype: PlacedDType = None,
) -> None:
    """Measure tier read speeds and recompute time on this machine (once per model).

    Shows what the loading controller would choose (`ask --ratio auto` uses the measurement).
    """
    from ..index import KVIndex
    from ..store.controller import MEASURED_TIERS, choose_ratio, choose_tier
    from ..store.controller import calibrate as measure

    model_process()
    try:
        cfg = placed(KVIndex.config_of(index_dir, base_config()), device, dtype)
        idx = KVIndex.open(index_dir, cfg)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    cal = measure(idx.adapter, index_dir, cfg.index.codec, cfg.runtime.cache_dir, n_tokens=tokens)
    table = Table("tier", "read throughput", "load per layer", "balanced ratio")
    n_tokens = cfg.query.top_k * cfg.index.chunk_tokens
    for tier in MEASURED_TIERS:
        d = choose_ratio(cal, tier, n_tokens, cfg.runtime.storage.quality_floor)
        table.add_row(
            tier,
            f"{cal.read_bytes_per_s[tier] / 2**30:.2f} GiB/s",
            f"{d.load_s * 1e3:.3f} ms",
            f"{d.balanced_ratio:.3f}",
        )
    out.print(table)
    out.print(
        f"recompute: {cal.prefill_s_per_token_layer * 1e6:.2f} us per token per layer "
        f"({cal.recompute_s(1.0, n_tokens) * 1e3:.1f} ms per layer for {n_tokens} tokens); "
        f"stored KV: {cal.bytes_per_token_layer:.0f} B per token per layer ({cal.codec})"
    )
    out.print(f"ratio auto (disk): {choose_ratio(cal, 'disk', n_tokens, cfg.runtime.storage.quality_floor).explain()}")
    out.print(
        f"tier for ratio {cfg.query.fusion.ratio}: {choose_tier(cal, cfg.query.fusion.ratio, n_tokens).explain()}"
    )
