"""KVIndex + FusedGenerator on the tiny Llama: real indexing, retrieval, fused answers, bad input."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from tiny_model import tiny_llama

from rag_kvcache.config import Config, FusionConfig, GenerationConfig, IndexSettings, QueryConfig
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.errors import ConfigError
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.retrieval.database import ForeignIndexError

DOCS = {
    "lighthouse.txt": "The lighthouse on Tessaly was lit in 1856. Its keeper Ada Rennick kept a diary of ships. " * 3,
    "observatory.txt": "The main telescope of the Veldmark Observatory is named Harrow's Eye. It is a refractor. " * 3,
    "bakery.txt": "Saltmere's bakery sells a dark rye loaf with caraway seeds every market day. " * 3,
    "notes/harbour.txt": "Orrin's Ford harbour has a granite breakwater and a ferry to Tessaly twice a day. " * 3,
}
CFG = Config(
    index=IndexSettings(chunk_tokens=24), query=QueryConfig(top_k=3, generation=GenerationConfig(max_new_tokens=6))
).with_index(codec="none")  # lossless: exact


@pytest.fixture()
def docs(tmp_path):
    root = tmp_path / "docs"
    for name, text in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture()
def index(tiny, docs, tmp_path) -> KVIndex:
    return KVIndex.build(docs, tmp_path / "idx", CFG, adapter=tiny, progress=False)


def test_index_precomputes_every_chunk(index):
    chunks = list(index.chunks.all_chunks())
    assert len(chunks) >= len(DOCS)
    assert all(index.addressing.own_key(c.token_ids) in index.store for c in chunks)


def test_ask_retrieves_and_fuses(index):
    answer = FusedGenerator(index).ask("What is the telescope of the Veldmark Observatory named?")
    assert answer.chunks[0].source == "observatory.txt"
    assert answer.method == FusionConfig().method and answer.cache_misses == 0  # the default
    assert 0 < answer.recomputed_tokens < answer.prompt_tokens
    assert answer.ttft_s > 0 and answer.generated_tokens <= 6
    assert {"kv_load", "kv_wait", "attention", "mlp"} <= set(answer.stages)


@pytest.mark.parametrize("order", ["best_last", "best_first"])
def test_ask_lays_the_retrieved_chunks_out_in_the_chunk_order(tiny, index, order):
    """Retrieving, `ask` lays the chunks out in the config's order (best_last: the best next to the question)
    and fuses what `ask` over those hits in that order fuses; its answer lists them best first either way."""
    q = "What is the telescope of the Veldmark Observatory named?"
    reopened = KVIndex.open(index.path, CFG.with_query(chunk_order=order), adapter=tiny)
    gen, full, k = FusedGenerator(reopened), FusionConfig(method="full"), len(reopened.chunks)
    hits = reopened.search(q, k)  # every chunk: the repeated texts' equal chunks are not all there is
    answer = gen.ask(q, top_k=k, fusion=full)
    laid_out = gen.ask(q, hits[::-1] if order == "best_last" else hits, fusion=full)
    other = gen.ask(q, hits if order == "best_last" else hits[::-1], fusion=full)
    torch.testing.assert_close(answer.first_token_logits, laid_out.first_token_logits, atol=0, rtol=0)
    assert not torch.equal(answer.first_token_logits, other.first_token_logits)  # the order is seen
    assert [c.id for c in answer.chunks] == [h.chunk.id for h in hits]


def test_an_unknown_chunk_order_is_refused():
    with pytest.raises(ConfigError, match="chunk_order must be one of best_last, best_first, got 'middle'"):
        QueryConfig(chunk_order="middle")
    assert QueryConfig(chunk_order="best_first").in_prompt_order([1, 2, 3]) == [1, 2, 3]
    assert QueryConfig().in_prompt_order((1, 2, 3)) == [3, 2, 1]  # the default: the best last


def test_exact_methods_answer_like_full(index):
    gen = FusedGenerator(index)
    q = "Who kept the lighthouse diary?"
    hits = index.search(q, 3)
    answers = {m: gen.ask(q, hits, fusion=FusionConfig(method=m, ratio=1.0)) for m in ("full", "prefix", "cacheblend")}
    assert answers["full"].answer == answers["prefix"].answer == answers["cacheblend"].answer
    torch.testing.assert_close(
        answers["prefix"].first_token_logits, answers["full"].first_token_logits, atol=1e-4, rtol=0
    )


def test_another_model_misses_never_hits_wrongly(index, tokenizer, tmp_path):
    other = ModelAdapter(tiny_llama(seed=7), tokenizer, name="other")
    reopened = KVIndex.open(index.path, CFG, adapter=other)
    gen = FusedGenerator(reopened)
    q = "What does the bakery sell?"
    hits = reopened.search(q, 3)
    fused = gen.ask(q, hits, fusion=FusionConfig(method="prefix"))
    assert fused.cache_misses == 3  # every chunk missed: caches of the first model are never served
    full = gen.ask(q, hits, fusion=FusionConfig(method="full"))
    torch.testing.assert_close(fused.first_token_logits, full.first_token_logits, atol=1e-4, rtol=0)
    again = gen.ask(q, hits, fusion=FusionConfig(method="prefix"))
    assert again.cache_misses == 0  # the misses were computed and stored for this model


def test_top_k_larger_than_index(index, caplog):
    with caplog.at_level(logging.WARNING):
        answer = FusedGenerator(index).ask("harbour", top_k=1000)
    assert len(answer.chunks) == len(index.chunks) and "exceeds" in caplog.text


def test_empty_question(index):
    with pytest.raises(ValueError, match="empty"):
        FusedGenerator(index).ask("   ")


def test_incremental_update(index, docs):
    (docs / "bakery.txt").unlink()
    (docs / "new.txt").write_text("The regatta winners receive a silver oar that hangs in the town hall. " * 2)
    report = index.update(docs, progress=False, prune=True)
    assert report.removed == ["bakery.txt"] and report.added == ["new.txt"]
    assert all(h.chunk.source != "bakery.txt" for h in index.search("rye loaf caraway", 10))
    assert FusedGenerator(index).ask("What do regatta winners get?").chunks[0].source == "new.txt"


def test_bad_folders_lose_nothing(index, tmp_path):
    n = len(index.chunks)
    with pytest.raises(FileNotFoundError):
        index.update(tmp_path / "missing", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError):
        index.update(tmp_path / "empty", progress=False)
    assert len(index.chunks) == n and FusedGenerator(index).ask("harbour ferry").answer is not None


def test_missing_and_foreign_index(tiny, tmp_path):
    with pytest.raises(FileNotFoundError):
        KVIndex.open(tmp_path / "nope", CFG, adapter=tiny)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "index.sqlite").write_bytes(b"not a database at all" * 10)
    with pytest.raises(ForeignIndexError):
        KVIndex.open(foreign, CFG, adapter=tiny)


def test_other_tokenizer_is_refused(index):
    from tiny_model import MINILM_DIR
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(MINILM_DIR)
    other.add_tokens(["veldmark"])  # a vocabulary the stored token ids were not made with
    with pytest.raises(ValueError, match="tokenizes differently"):
        KVIndex.open(index.path, CFG, adapter=ModelAdapter(tiny_llama(), other, name="x"))


def test_index_can_be_copied_and_reopened(index, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(index.path, copy)
    reopened = KVIndex.open(copy, CFG, adapter=index.adapter)
    assert FusedGenerator(reopened).ask("ferry to Tessaly").cache_misses == 0


def test_engine_serves_on_its_thread_and_closes(index):
    from rag_kvcache import ServingEngine

    with ServingEngine(index.path, index.config, index.adapter) as engine:
        hits = engine.search("Who kept the lighthouse diary?", 2)
        steps = list(
            engine.stream(
                engine.index.format.segments(
                    [h.chunk.token_ids for h in hits],
                    engine.index.format.question_ids(engine.index.adapter.tokenizer, "Who?"),
                )
            )
        )
        assert steps[-1].prompt_tokens > 0 and steps[-1].usage["cached_tokens"] > 0
    with pytest.raises(RuntimeError, match="shutdown"):
        engine.search("diary", 1)
    engine.close()  # closing twice is harmless


def test_epic_unset_recomputes_an_eighth_of_the_index_chunk_size(index):
    """A fusion config without `epic_k` fuses with an eighth of the index's chunk size (24 // 8 = 3 heads here):
    the same K/V and logits as `epic_k=3` given, not those of another k."""
    gen, question = FusedGenerator(index), "Who founded the observatory?"
    fmt = index.format
    segments = fmt.segments(
        [h.chunk.token_ids for h in index.search(question, 3)], fmt.question_ids(index.adapter.tokenizer, question)
    )
    unset = gen.fuse(segments, FusionConfig(method="epic")).result
    given = gen.fuse(segments, FusionConfig(method="epic", epic_k=3)).result
    other = gen.fuse(segments, FusionConfig(method="epic", epic_k=1)).result
    assert unset.active_per_layer == given.active_per_layer != other.active_per_layer
    torch.testing.assert_close(unset.logits, given.logits, atol=0, rtol=0)
