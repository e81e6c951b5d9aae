"""`chunk_prefill="grouped"` (issue 33 item 1): similar chunks prefilled together as one sequence, each chunk's
one cache cut from it, so a cache carries the context of the similar chunks before it at the cost of one
forward over the corpus. Each stored cache equals a prefill of the chunk behind its recorded group context;
a prompt that lays a group out as it was indexed reads every chunk exactly."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from test_cached_neighbours import assert_same, text_cache, write_docs
from test_faults import tiny_model_dir  # noqa: F401
from test_fusion import ATOL

from rag_kvcache.config import Config, FusionConfig, IndexSettings, QueryConfig
from rag_kvcache.engine.fusion import FusionInput
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.index import KVIndex
from rag_kvcache.indexing.grouping import similar_groups
from rag_kvcache.query.generator import FusedGenerator

# caches stored as computed: the exactness checks compare K/V to float tolerance; groups of three
GROUPED = Config(
    index=IndexSettings(chunk_tokens=24, chunk_prefill="grouped", context_chunks=2, codec="none"),
    query=QueryConfig(top_k=3),
)


@pytest.fixture(params=["tiny", "bpe_tiny"])
def model(request):
    """MiniLM's WordPiece (no separator token between chunks) and a byte-level BPE (a separator token)."""
    return request.getfixturevalue(request.param)


@pytest.fixture()
def index(model, tmp_path) -> KVIndex:
    write_docs(tmp_path / "docs")
    return KVIndex.build(tmp_path / "docs", tmp_path / "idx", GROUPED, adapter=model, progress=False)


def groups_of(index: KVIndex) -> list[list[tuple[int, ...]]]:
    """The index's groups, each in the order it was laid out, read back from the recorded contexts."""
    near = {c.token_ids: [tuple(n) for n in index.addressing.near(c.token_ids)] for c in index.chunks.all_chunks()}
    return [[*reversed(before), ids] for ids, before in near.items() if not any(ids in n for n in near.values())]


def test_similar_groups_partition_the_rows_and_gather_the_similar():
    rng = np.random.default_rng(0)
    directions = np.eye(3, 8, dtype=np.float32) * 10  # three well-separated directions
    which = rng.permutation(np.repeat(np.arange(3), 4))  # 12 rows, 4 of each, shuffled
    rows = directions[which] + rng.normal(0, 0.1, (12, 8)).astype(np.float32)
    groups = similar_groups(rows, 4)
    assert sorted(i for g in groups for i in g) == list(range(12))
    assert all(len(set(which[g])) == 1 for g in groups) and len(groups) == 3
    assert similar_groups(rows, 5)[0][0] == 0 and max(map(len, similar_groups(rows, 5))) == 5
    assert similar_groups(np.zeros((0, 8), np.float32), 3) == []
    with pytest.raises(ValueError, match="size must be >= 1, got 0"):
        similar_groups(rows, 0)


def test_each_chunk_has_one_cache_a_prefill_behind_its_group_gives(model, index):
    """The invariant: a chunk's stored cache equals a prefill of it behind the prefix and the chunks before it
    in its group (its recorded context); each chunk has that one cache and no behind-prefix one besides."""
    groups = groups_of(index)
    assert max(map(len, groups)) == 3 and sum(map(len, groups)) == len(index.chunks)
    live = index.maker.live_keys()
    assert len(live) == len(index.chunks) + 1  # one cache a chunk, and the prefix's
    assert sorted(p.stem for p in index.store.disk.files()) == sorted(live)
    for group in groups:
        for k, ids in enumerate(group):
            (context,) = index.addressing.contexts_at(k, ids)
            assert context == index.addressing.neighbour_context(list(reversed(group[:k])))
            assert_same(index.store.get(index.addressing.key(ids, context)), text_cache(model, ids, context))


def test_indexing_computes_each_token_once(tiny, tmp_path, monkeypatch):
    """The cost: one forward over the prefix, and every chunk's tokens and the separators inside its group once."""
    write_docs(tmp_path / "docs")
    index = KVIndex.create(tmp_path / "idx", GROUPED, adapter=tiny)
    computed, real = [], tiny.prefill_packed
    monkeypatch.setattr(
        tiny,
        "prefill_packed",
        lambda chunks, past=None, pause=None: computed.extend(chunks) or real(chunks, past, pause),
    )
    index.update(tmp_path / "docs", progress=False)
    monkeypatch.undo()
    groups = groups_of(index)
    sep = len(index.format.separator_ids)
    chunk_tokens = sum(len(c.token_ids) for c in index.chunks.all_chunks())
    assert sum(map(len, computed)) == len(index.format.prefix_ids) + chunk_tokens + sep * (
        len(index.chunks) - len(groups)
    )


def test_a_prompt_laying_a_group_out_reads_it_exactly(model, index):
    """A prompt with a group's chunks in the order they were indexed reproduces each chunk's context: every
    chunk's cache is exact, and `reuse` (which recomputes only the question) equals a full prefill."""
    group = max(groups_of(index), key=len)
    fmt, question = index.format, "Who kept the diary?"
    gen = FusedGenerator(index)
    for chunks, exact in ((group, True), (group[::-1], False)):
        segments = fmt.segments(chunks, fmt.question_ids(model.tokenizer, question))
        caches = index.caches.open(segments)
        parts = FusionInput.build(segments, caches.sources, caches.contexts).parts
        assert caches.missing == 0
        assert all(p.exact for p in parts if p.segment.label.startswith("chunk")) == exact
    segments = fmt.segments(group, fmt.question_ids(model.tokenizer, question))
    torch.testing.assert_close(
        gen.fuse(segments, FusionConfig(method="reuse")).result.logits,
        gen.fuse(segments, FusionConfig(method="full")).result.logits,
        atol=ATOL,
        rtol=0,
    )


def test_a_missing_cache_is_recomputed_behind_its_group_and_the_answer_unchanged(model, index, caplog):
    """Fault: a grouped chunk's cache gone is recomputed behind its group's text, stored again, logged, and
    equals the one the group's forward made."""
    group = max(groups_of(index), key=len)
    ids = group[-1]
    (context,) = index.addressing.contexts_at(0, ids)
    key = index.addressing.key(ids, context)
    before = index.store.get(key)
    index.store.memory.remove(key)
    index.store.disk.remove(key)
    segments = index.format.segments(group, index.format.question_ids(model.tokenizer, "Who kept the diary?"))
    with caplog.at_level(logging.INFO):
        assert index.caches.open(segments).missing == 1
    assert "made and stored the KV cache" in caplog.text and key in index.store.disk
    assert_same(index.store.get(key), before)


def test_a_run_killed_midway_keeps_what_it_stored_and_the_next_completes_it(tiny, tmp_path, monkeypatch):
    """Fault: indexing killed after two caches were written. The next run computes only the chunks without a
    stored cache (grouped again among themselves); every cache it reads then equals a prefill behind its
    recorded group, and nothing is left orphaned."""
    import rag_kvcache.indexing.maker as maker

    write_docs(tmp_path / "docs")
    index = KVIndex.create(tmp_path / "idx", GROUPED, adapter=tiny)
    real = maker.compute_grouped

    def dies_after_two(*args, **kwargs):
        for n, item in enumerate(real(*args, **kwargs)):
            if n == 2:
                raise KeyboardInterrupt("killed while computing grouped caches")
            yield item

    monkeypatch.setattr(maker, "compute_grouped", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        index.update(tmp_path / "docs", progress=False)
    monkeypatch.undo()
    stored = {p.stem for p in index.store.disk.files()}
    assert len(stored) == 3  # the prefix's and two chunks'
    reopened = KVIndex.open(index.path, adapter=tiny)
    computed: list[tuple[int, ...]] = []

    def counts(*args, **kwargs):
        for ids, kv in real(*args, **kwargs):
            computed.append(ids)
            yield ids, kv

    monkeypatch.setattr(maker, "compute_grouped", counts)
    reopened.update(tmp_path / "docs", progress=False)
    kept = {ids for key, ids, _ in reopened.maker.live() if key in stored}
    assert len(computed) == len(reopened.chunks) - 2 and not kept & set(computed)
    assert stored < reopened.maker.live_keys() and reopened.orphans() == []
    for _, ids, (context,) in reopened.maker.live():
        if ids != reopened.format.prefix_ids:
            assert_same(reopened.store.get(reopened.addressing.key(ids, context)), text_cache(tiny, ids, context))


def test_documents_added_later_are_grouped_among_themselves_and_nothing_is_orphaned(tiny, tmp_path):
    write_docs(tmp_path / "docs")
    index = KVIndex.build(tmp_path / "docs", tmp_path / "idx", GROUPED, adapter=tiny, progress=False)
    before = {key: index.store.get(key) for key in index.maker.live_keys()}
    (tmp_path / "docs" / "mill.txt").write_text(
        "The windmill at Saltmere grinds rye for the bakery. Its sails were replaced in 1990 after a storm."
    )
    index.update(tmp_path / "docs", progress=False)
    reopened = KVIndex.open(index.path, adapter=tiny)
    assert set(before) < set(reopened.maker.live_keys()) and reopened.orphans() == []
    for key, kv in before.items():
        assert_same(reopened.store.get(key), kv)
    new = [c for c in reopened.chunks.all_chunks() if c.source == "mill.txt"]
    assert all(not set(map(tuple, reopened.addressing.near(c.token_ids))) - {n.token_ids for n in new} for c in new)
    question = "When were the windmill's sails replaced?"
    segments = reopened.format.segments(
        [h.chunk.token_ids for h in reopened.search(question, 3)],
        reopened.format.question_ids(tiny.tokenizer, question),
    )
    assert reopened.caches.open(segments).missing == 0


def test_bench_and_cli_name_it():
    from typer.testing import CliRunner

    from rag_kvcache.bench.variants import made_with, parse_variant
    from rag_kvcache.cli import app

    assert parse_variant("epic_match@behind_prefix", FusionConfig(), Config()).caches == "behind_prefix"
    assert parse_variant("epic_match@grouped", FusionConfig(), Config()).caches == "grouped"
    assert parse_variant("epic_match@cached_neighbours", FusionConfig(), Config()).caches is None  # the run's own
    assert made_with(Config(), "behind_prefix").index.chunk_prefill == "behind_prefix"
    result = CliRunner().invoke(app, ["index", "--help"], terminal_width=200)
    assert result.exit_code == 0 and "grouped" in result.output


def test_a_grouped_index_built_before_the_default_changed_stays_grouped(tiny_model_dir, tmp_path):  # noqa: F811
    """The default became `cached_neighbours`: an index built with grouped caches is opened, asked and indexed
    again (by a process whose defaults are the new ones) as what it records, reading only its own caches."""
    from typer.testing import CliRunner

    from rag_kvcache.cli import app

    write_docs(tmp_path / "docs")
    built = GROUPED.with_index(model=str(tiny_model_dir))  # the model `index` loads
    tiny = ModelAdapter.load(built)
    old = KVIndex.build(tmp_path / "docs", tmp_path / "idx", built, adapter=tiny, progress=False)
    question = "What is the main telescope of the Veldmark Observatory named?"
    before = FusedGenerator(old).ask(question)
    stored = {p.stem for p in old.store.disk.files()}
    assert Config().index.chunk_prefill == "cached_neighbours"
    reopened = KVIndex.open(
        tmp_path / "idx", Config(query=GROUPED.query).with_index(model=built.index.model), adapter=tiny
    )
    assert reopened.config.index.chunk_prefill == "grouped" and not reopened.maker.with_neighbours
    after = FusedGenerator(reopened).ask(question)
    assert after.cache_misses == 0 and after.answer == before.answer
    assert torch.equal(after.first_token_logits, before.first_token_logits)
    reopened.close()
    result = CliRunner().invoke(app, ["index", str(tmp_path / "docs"), "--index", str(tmp_path / "idx")])
    assert result.exit_code == 0, result.output  # no flags: the recorded settings, nothing to compute
    assert {p.stem for p in KVIndex.open(tmp_path / "idx", adapter=tiny).store.disk.files()} == stored
