"""A chunk is embedded whole: windows under the embedder's limit pooled into one unit vector (real MiniLM
embedder and tokenizer, CPU, seconds)."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer
from transformers import PreTrainedTokenizerBase

from rag_kvcache.indexing import staging
from rag_kvcache.retrieval.chunk_index import ChunkIndex, TextDocument
from rag_kvcache.retrieval.chunking import chunk_document
from rag_kvcache.retrieval.database import DB_FILE
from rag_kvcache.retrieval.embedder import (
    WINDOW_OVERLAP,
    chunk_vectors,
    load_embedder,
    token_spans,
    unit_vectors,
    window_tokens,
    windows,
)
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
FIRST_HALF = FILLER * 3  # about 290 word pieces: past all-MiniLM-L6-v2's 254 tokens of text
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


def _index(tmp_path: Path, embedder: SentenceTransformer, tokenizer: PreTrainedTokenizerBase) -> ChunkIndex:
    """An index of the two texts that differ only in their last sentence, one 512-token chunk each."""
    index = ChunkIndex.create(tmp_path / "index", embedder, "all-MiniLM-L6-v2", {})
    documents = [TextDocument(source, f"{FIRST_HALF}{sentence}") for source, sentence in SECOND.items()]
    chunker = lambda text, source: chunk_document(text, source, tokenizer, 512)  # noqa: E731
    staging.commit(index, staging.stage_texts(index, documents, chunker, batch_size=8, progress=False))
    assert len(index) == 2
    return index


def test_chunks_differing_past_the_limit_embed_differently_and_the_question_finds_its_chunk(
    tmp_path: Path, embedder: SentenceTransformer, tokenizer: PreTrainedTokenizerBase
) -> None:
    texts = [f"{FIRST_HALF}{sentence}" for sentence in SECOND.values()]
    assert min(len(s) for s in token_spans(embedder, [FIRST_HALF])) > window_tokens(embedder)
    truncated = unit_vectors(embedder, texts)  # [2, E]: what a single window reads
    assert float(truncated[0] @ truncated[1]) > 0.9999  # the difference is invisible to it
    whole = chunk_vectors(embedder, texts)  # [2, E]
    assert float(whole[0] @ whole[1]) < 0.995  # the last window, and so the pooled vector, differs
    assert np.allclose(np.linalg.norm(whole, axis=1), 1.0, atol=1e-6)

    index = _index(tmp_path, embedder, tokenizer)
    for source, question in (
        ("harbour.txt", "What does the harbour of Veldmark export?"),
        ("choir.txt", "On which day does the choir of Brennisford sing?"),
    ):
        hits = index.search(question, 2)
        assert hits[0].chunk.source == source and hits[0].score > hits[1].score, (question, hits)


def test_a_chunk_under_the_limit_embeds_as_a_plain_encode(
    embedder: SentenceTransformer, exact: SentenceTransformer
) -> None:
    short = FILLER
    assert max(len(s) for s in token_spans(embedder, [short])) <= window_tokens(embedder)
    assert windows(short, token_spans(embedder, [short])[0], window_tokens(embedder)) == [(0, len(short))]
    for model in (embedder, exact):
        assert np.array_equal(chunk_vectors(model, [short]), unit_vectors(model, [short]))
    mixed = chunk_vectors(exact, [f"{FIRST_HALF}{SECOND['choir.txt']}", short, "Saltmere?"])  # [3, E]
    assert np.allclose(mixed[1:], unit_vectors(exact, [short, "Saltmere?"]), atol=1e-6)  # batched with windows


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


def test_a_repaired_embedding_is_the_one_indexing_stored(
    tmp_path: Path, exact: SentenceTransformer, tokenizer: PreTrainedTokenizerBase
) -> None:
    index = _index(tmp_path, exact, tokenizer)

    def stored() -> dict[str, np.ndarray]:
        with sqlite3.connect(tmp_path / "index" / DB_FILE) as conn:
            rows = conn.execute("SELECT id, embedding FROM chunks").fetchall()
        return {chunk: np.frombuffer(blob, dtype=EMBEDDING_DTYPE) for chunk, blob in rows}

    before = stored()
    chunk = sorted(before)[0]
    assert index.reembed([chunk]) == 1
    assert np.allclose(stored()[chunk], before[chunk], atol=1e-6)
    assert not np.allclose(before[chunk], unit_vectors(exact, [index.get([chunk])[0].text])[0], atol=1e-3)


def test_another_embedder_over_its_limit_is_named_in_a_warning(
    embedder: SentenceTransformer, caplog: pytest.LogCaptureFixture
) -> None:
    long = f"{FIRST_HALF}{SECOND['harbour.txt']}"
    with caplog.at_level(logging.WARNING, logger="rag_kvcache.retrieval.embedder"):
        chunk_vectors(embedder, [FILLER], name="my-org/short-embedder")
        chunk_vectors(embedder, [long], name="all-MiniLM-L6-v2")  # the default's limit is in the docs
        assert not caplog.records
        chunk_vectors(embedder, [long, FILLER], name="my-org/short-embedder")
    (record,) = caplog.records
    assert "my-org/short-embedder" in record.getMessage() and "max_seq_length 256" in record.getMessage()
