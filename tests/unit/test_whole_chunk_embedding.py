"""A chunk is searched whole: its windows under the embedder's limit are FAISS's units, a chunk scores as its best
window, and its own vector is their normalised mean (real MiniLM embedder and tokenizer, CPU, seconds)."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer
from transformers import PreTrainedTokenizerBase

from rag_kvcache.indexing import staging
from rag_kvcache.retrieval import database as db
from rag_kvcache.retrieval.chunk_index import ChunkIndex
from rag_kvcache.retrieval.chunking import chunk_document
from rag_kvcache.retrieval.database import DB_FILE
from rag_kvcache.retrieval.embedder import (
    WINDOW_OVERLAP,
    chunk_embeddings,
    load_embedder,
    token_spans,
    unit_vectors,
    window_tokens,
    windows,
)
from rag_kvcache.retrieval.integrity import Verified
from rag_kvcache.retrieval.records import TextDocument
from rag_kvcache.retrieval.vectors import EMBEDDING_DTYPE

FILLER = (
    "Volcanoes erupt when magma rises through the crust, and lava flows, ash clouds and pyroclastic flows follow. "
    "To cook spaghetti, boil plenty of salted water, add the pasta, stir, and drain it al dente. "
    "In chess the knight moves in an L shape, and castling moves the king towards a rook. "
    "Jupiter is the largest planet of the solar system; its Great Red Spot is a storm larger than Earth. "
    "Tomato plants need full sun, regular watering and stakes to support their stems. "
    "The river delta floods every spring, leaving silt that farmers plough into their fields. "
    "Medieval scribes copied manuscripts by candlelight in cold monastery rooms. "
)
CLEAN = Verified([], [], None, 0)  # what `ChunkIndex.verify` finds in a sound index
FIRST_HALF = FILLER * 3  # about 420 word pieces: past all-MiniLM-L6-v2's 254 tokens of text
SECOND = {
    "harbour.txt": "The harbour of Veldmark exports copper kettles to the northern islands.",
    "choir.txt": "The choir of Brennisford sings only on Tuesdays, in a barn lit by oil lamps.",
}


@pytest.fixture(scope="module")
def embedder() -> SentenceTransformer:
    return load_embedder()  # bfloat16 where the CPU computes it natively


@pytest.fixture(scope="module")
def exact() -> SentenceTransformer:
    """The embedder in float32: in bfloat16 a text's vector moves ~1e-3 with the batch it is padded in."""
    return load_embedder(dtype="float32")


def _chunker(tokenizer: PreTrainedTokenizerBase):
    return lambda text, source: chunk_document(text, source, tokenizer, 512)


def _index(
    tmp_path: Path, embedder: SentenceTransformer, tokenizer: PreTrainedTokenizerBase, more: dict[str, str] = {}
) -> ChunkIndex:
    """An index of the two texts that differ only in their last sentence, one 512-token chunk each (and `more`
    documents, by source)."""
    index = ChunkIndex.create(tmp_path / "index", embedder, "all-MiniLM-L6-v2", {})
    documents = [TextDocument(source, f"{FIRST_HALF}{sentence}") for source, sentence in SECOND.items()]
    documents += [TextDocument(source, text) for source, text in more.items()]
    staging.commit(index, staging.stage_texts(index, documents, _chunker(tokenizer), batch_size=8, progress=False))
    assert len(index) == 2 + len(more)
    return index


QUESTIONS = {
    "harbour.txt": "What does the harbour of Veldmark export?",
    "choir.txt": "On which day does the choir of Brennisford sing?",
}
DISTRACTORS = {  # under the limit: one window each
    "cells.txt": "Photosynthesis turns light into chemical energy in the chloroplasts of plant cells. " * 3,
    "markets.txt": "The stock exchange closed higher after the central bank held interest rates steady. " * 3,
}


def test_a_fact_in_a_chunks_second_half_ranks_its_chunk_first(
    tmp_path: Path, embedder: SentenceTransformer, tokenizer: PreTrainedTokenizerBase
) -> None:
    texts = [f"{FIRST_HALF}{sentence}" for sentence in SECOND.values()]
    assert min(len(s) for s in token_spans(embedder, [FIRST_HALF])) > window_tokens(embedder)
    truncated = unit_vectors(embedder, texts)  # [2, E]: what a single window reads
    assert float(truncated[0] @ truncated[1]) > 0.9999  # the difference is invisible to it
    embedded = chunk_embeddings(embedder, texts)
    assert embedded.counts.tolist() == [2, 2] and embedded.windows.shape == (4, truncated.shape[1])
    assert float(embedded.windows[1] @ embedded.windows[3]) < 0.99  # the last windows differ
    assert np.allclose(np.linalg.norm(embedded.windows, axis=1), 1.0, atol=1e-6)
    assert np.allclose(np.linalg.norm(embedded.chunks, axis=1), 1.0, atol=1e-6)

    index = _index(tmp_path, embedder, tokenizer, DISTRACTORS)
    for source, question in QUESTIONS.items():
        hits = index.search(question, 4)
        assert [h.chunk.source for h in hits][0] == source and hits[0].score > hits[1].score, (question, hits)
        (chunk,) = [i for i, t in enumerate(texts) if t.endswith(SECOND[source])]
        windows_score = unit_vectors(embedder, [question]) @ embedded.of_chunk(chunk).T  # [1, 2]
        assert hits[0].score == pytest.approx(float(windows_score.max()), abs=2e-3)  # its best window's score
        assert float(windows_score[0, 1]) > float(windows_score[0, 0])  # the second half's window


def test_search_returns_k_distinct_chunks_when_several_windows_of_one_chunk_match(
    tmp_path: Path, embedder: SentenceTransformer, tokenizer: PreTrainedTokenizerBase
) -> None:
    veldmark = "The harbour of Veldmark exports copper kettles to the northern islands. "
    everywhere = (veldmark + FILLER) * 3 + veldmark  # Veldmark in every window of one 512-token chunk
    index = _index(tmp_path, embedder, tokenizer, {"veldmark.txt": everywhere, **DISTRACTORS})
    (chunk,) = [c for c in index.all_chunks() if c.source == "veldmark.txt"]
    assert index.embed_chunks([chunk.text]).counts.tolist() == [2]
    question = "What does the harbour of Veldmark export?"
    for k in (1, 2, 3, len(index)):
        hits = index.search(question, k)
        ids = [h.chunk.id for h in hits]
        assert len(ids) == k and len(set(ids)) == k, hits
        assert ids[0] == chunk.id and [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    near = index.nearest([chunk], 3)[0]
    assert len(near) == 3 and chunk.id not in {c.id for c in near} and len({c.id for c in near}) == 3


def test_a_chunk_under_the_limit_embeds_as_a_plain_encode(
    embedder: SentenceTransformer, exact: SentenceTransformer
) -> None:
    short = FILLER
    assert max(len(s) for s in token_spans(embedder, [short])) <= window_tokens(embedder)
    assert windows(short, token_spans(embedder, [short])[0], window_tokens(embedder)) == [(0, len(short))]
    for model in (embedder, exact):
        one = chunk_embeddings(model, [short])
        assert one.counts.tolist() == [1] and np.array_equal(one.windows, unit_vectors(model, [short]))
        assert np.array_equal(one.chunks, one.windows)
    mixed = chunk_embeddings(exact, [f"{FIRST_HALF}{SECOND['choir.txt']}", short, "Saltmere?"])
    assert mixed.counts.tolist() == [2, 1, 1]
    assert np.allclose(mixed.chunks[1:], unit_vectors(exact, [short, "Saltmere?"]), atol=1e-6)  # batched with windows
    assert np.allclose(mixed.windows[2:], mixed.chunks[1:])


def test_windows_cover_the_chunk_under_the_limit_with_overlap(embedder: SentenceTransformer) -> None:
    text = FILLER * 6  # two and a half windows' worth of word pieces
    size = window_tokens(embedder)
    spans = token_spans(embedder, [text])[0]
    ranges = windows(text, spans, size)
    assert len(ranges) >= 3 and ranges[0][0] == 0 and ranges[-1][1] == len(text.rstrip())
    whole = embedder.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    starts = [next(i for i, (a, _) in enumerate(spans) if a >= lo) for lo, _ in ranges]
    for (lo, hi), start in zip(ranges, starts, strict=True):
        ids = embedder.tokenizer(text[lo:hi], add_special_tokens=False)["input_ids"]
        assert len(ids) <= size and ids == whole[start : start + len(ids)]  # the same tokens, none cut off
    for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
        shared = sum(lo <= a and b <= hi for a, b in spans)
        assert 0 < shared <= WINDOW_OVERLAP  # a small overlap, no gap


def _stored(index_dir: Path) -> dict[tuple[str, int], np.ndarray]:
    """Every stored vector: each chunk's own by (id, -1), each window's by (chunk id, ordinal)."""
    with sqlite3.connect(index_dir / DB_FILE) as conn:
        rows = conn.execute("SELECT id, -1, embedding FROM chunks").fetchall()
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'windows'").fetchone():
            rows += conn.execute("SELECT chunk, ordinal, embedding FROM windows").fetchall()
    return {(chunk, j): np.frombuffer(blob, dtype=EMBEDDING_DTYPE) for chunk, j, blob in rows}


def test_a_repaired_embedding_is_the_one_indexing_stored(
    tmp_path: Path, exact: SentenceTransformer, tokenizer: PreTrainedTokenizerBase
) -> None:
    index = _index(tmp_path, exact, tokenizer)
    before = _stored(tmp_path / "index")
    assert len(before) == 2 + 4  # two chunks of two windows
    chunk = sorted(c for c, _ in before)[0]
    assert index.reembed([chunk]) == 1
    after = _stored(tmp_path / "index")
    assert after.keys() == before.keys() and all(np.allclose(after[k], before[k], atol=1e-6) for k in before)
    assert not np.allclose(before[chunk, -1], unit_vectors(exact, [index.get([chunk])[0].text])[0], atol=1e-3)
    assert np.allclose(index.vectors(index.get([chunk])), before[chunk, -1][None], atol=1e-6)


def test_check_finds_a_damaged_window_vector_and_repair_rebuilds_it(
    tmp_path: Path, exact: SentenceTransformer, tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = _index(tmp_path, exact, tokenizer, DISTRACTORS)
    answers = {q: [(h.chunk.id, round(h.score, 5)) for h in index.search(q, 3)] for q in QUESTIONS.values()}
    embedded: list[str] = []
    encode = exact.encode
    monkeypatch.setattr(exact, "encode", lambda texts, *a, **kw: (embedded.extend(texts), encode(texts, *a, **kw))[1])
    assert index.verify() == CLEAN
    stored = _stored(tmp_path / "index")
    harbour = next(c for c in index.all_chunks() if c.source == "harbour.txt")

    # the second-half window's vector damaged in vectors.faiss: rebuilt from SQLite, nothing embedded
    vectors = tmp_path / "index" / "vectors.faiss"
    data = bytearray(vectors.read_bytes())
    at = bytes(data).find(stored[harbour.id, 1].tobytes())
    assert at >= 0
    data[at + 8 : at + 12] = np.float32(7.0).tobytes()
    vectors.write_bytes(bytes(data))
    found = index.verify()
    assert found.bad_rows == [] and "does not match the checksum" in (found.vectors or "")
    index.rewrite_vectors()
    assert index.verify() == CLEAN and embedded == []
    assert bytes(vectors.read_bytes()).find(stored[harbour.id, 1].tobytes()) >= 0

    # the same window's stored vector damaged in SQLite: found as that chunk's, and re-embedded from its text
    damaged = stored[harbour.id, 1].copy()
    damaged[5] *= 2.0**40
    with sqlite3.connect(tmp_path / "index" / DB_FILE) as conn:
        conn.execute(
            "UPDATE windows SET embedding = ? WHERE chunk = ? AND ordinal = 1", (damaged.tobytes(), harbour.id)
        )
    (row,) = index.verify().bad_rows
    assert row.chunk == harbour.id and row.embedding_only and "window 1" in row.reason, row
    assert index.reembed([row.chunk]) == 1 and len(embedded) == 2  # its two windows
    assert index.verify() == CLEAN
    assert np.allclose(_stored(tmp_path / "index")[harbour.id, 1], stored[harbour.id, 1], atol=1e-6)
    again = {q: [(h.chunk.id, round(h.score, 5)) for h in index.search(q, 3)] for q in QUESTIONS.values()}
    assert again == answers


def test_an_index_of_one_vector_a_chunk_opens_answers_and_takes_new_documents(
    tmp_path: Path, embedder: SentenceTransformer, tokenizer: PreTrainedTokenizerBase, caplog: pytest.LogCaptureFixture
) -> None:
    index = _index(tmp_path, embedder, tokenizer, DISTRACTORS)
    index_dir = tmp_path / "index"
    index.close()
    with sqlite3.connect(index_dir / DB_FILE) as conn:  # the format before windows: no table, FAISS over chunks
        conn.execute("DROP TABLE windows")
    old = ChunkIndex.open(index_dir, embedder)  # its vectors.faiss no longer matches: rewritten from the chunks
    old.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        old = ChunkIndex.open(index_dir, embedder, rewrite=False)
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # opened as it is, nothing rebuilt
    assert len(old) == 4 and old._vectors.ntotal == 4
    assert old.verify() == CLEAN
    hits = old.search(QUESTIONS["harbour.txt"], 4)
    assert len({h.chunk.id for h in hits}) == 4
    chunks = list(old.all_chunks())
    assert len(old.nearest(chunks, 2)) == 4 and old.vectors(chunks).shape == (4, 384)

    # a new document: the window table is made, the old chunks one window each, the new one in windows
    later = TextDocument("later.txt", f"{FIRST_HALF}The lighthouse of Ostmarrow is painted with green stripes.")
    staging.commit(old, staging.stage_texts(old, [later], _chunker(tokenizer), batch_size=8, progress=False))
    assert db.has_windows(old._conn) and len(old) == 5 and old._vectors.ntotal == 4 + 2
    assert old.verify() == CLEAN
    assert old.search("How is the lighthouse of Ostmarrow painted?", 1)[0].chunk.source == "later.txt"
    old.delete(["later.txt"])
    assert len(old) == 4 and old._vectors.ntotal == 4 and old.verify() == CLEAN
    assert ChunkIndex.open(index_dir, embedder).verify() == CLEAN


def test_another_embedder_over_its_limit_is_named_in_a_warning(
    embedder: SentenceTransformer, caplog: pytest.LogCaptureFixture
) -> None:
    long = f"{FIRST_HALF}{SECOND['harbour.txt']}"
    with caplog.at_level(logging.WARNING, logger="rag_kvcache.retrieval.embedder"):
        chunk_embeddings(embedder, [FILLER], name="my-org/short-embedder")
        chunk_embeddings(embedder, [long], name="all-MiniLM-L6-v2")  # the default's limit is in the docs
        assert not caplog.records
        chunk_embeddings(embedder, [long, FILLER], name="my-org/short-embedder")
    (record,) = caplog.records
    assert "my-org/short-embedder" in record.getMessage() and "max_seq_length 256" in record.getMessage()


def test_the_window_table_of_an_index_made_without_rowids_is_moved_at_its_next_write(
    tmp_path: Path, embedder: SentenceTransformer, tokenizer: PreTrainedTokenizerBase
) -> None:
    """The window table was made `WITHOUT ROWID`, which holds its 1.5 KB rows at a third of each page: on Django's
    documentation 45 MB of pages for 15 MB of vectors, the most of `index.sqlite`. New indexes make a rowid table;
    an index made before is read as it is and has its rows moved into one by its next write, every vector kept."""
    index = _index(tmp_path, embedder, tokenizer, DISTRACTORS)
    index_dir = tmp_path / "index"
    index.close()
    with sqlite3.connect(index_dir / DB_FILE) as conn:  # the table as an index made before holds it
        assert "WITHOUT ROWID" not in conn.execute("SELECT sql FROM sqlite_master WHERE name = 'windows'").fetchone()[0]
        conn.execute("ALTER TABLE windows RENAME TO w")
        conn.execute(db.WINDOWS_SCHEMA[:-1] + ") WITHOUT ROWID")
        conn.execute("INSERT INTO windows SELECT * FROM w")
        conn.execute("DROP TABLE w")
    stored = _stored(index_dir)
    old = ChunkIndex.open(index_dir, embedder)
    answers = {q: [(h.chunk.id, round(h.score, 5)) for h in old.search(q, 3)] for q in QUESTIONS.values()}
    later = TextDocument("later.txt", "The lighthouse of Ostmarrow is painted with green stripes.")
    staging.commit(old, staging.stage_texts(old, [later], _chunker(tokenizer), batch_size=8, progress=False))
    with sqlite3.connect(index_dir / DB_FILE) as conn:
        (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'windows'").fetchone()
        assert (
            "WITHOUT ROWID" not in sql and not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'w'").fetchone()
        )
    moved = _stored(index_dir)
    assert stored.keys() < moved.keys() and all(np.array_equal(moved[k], v) for k, v in stored.items())
    assert old.verify() == CLEAN
    old.delete(["later.txt"])
    assert {q: [(h.chunk.id, round(h.score, 5)) for h in old.search(q, 3)] for q in QUESTIONS.values()} == answers
