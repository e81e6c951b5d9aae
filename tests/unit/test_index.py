"""The chunk index over a small folder, with the real MiniLM embedder and tokenizer (CPU, seconds)."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import PreTrainedTokenizerBase

from rag_kvcache.config import ConfigError, RuntimeConfig
from rag_kvcache.errors import RagKVCacheError
from rag_kvcache.indexing import staging
from rag_kvcache.retrieval import embedder as embedding
from rag_kvcache.retrieval.chunk_index import ChunkIndex
from rag_kvcache.retrieval.chunking import Chunk, chunk_document
from rag_kvcache.retrieval.database import FORMAT, ForeignIndexError, chunk_id
from rag_kvcache.retrieval.documents import read_documents
from rag_kvcache.retrieval.embedder import load_embedder, unit_vectors
from rag_kvcache.retrieval.records import ChunkRecord
from rag_kvcache.retrieval.vectors import IndexType

DOCS = {
    "volcanoes.txt": (
        "Volcanoes erupt when magma rises through the crust. Lava flows, ash clouds and pyroclastic "
        "flows follow an eruption.\n\nMount Etna in Sicily is one of the most active volcanoes on Earth."
    ),
    "pasta.md": (
        "To cook spaghetti, boil plenty of salted water, add the pasta and stir. Drain it al dente and "
        "toss it with tomato sauce, olive oil and grated parmesan cheese."
    ),
    "chess.txt": "In chess, the knight moves in an L shape. Castling moves the king towards a rook.",
    "notes/astronomy.txt": (
        "Jupiter is the largest planet of the solar system; its Great Red Spot is a storm larger than Earth. "
        "Saturn's rings are made of ice."
    ),
    "notes/gardening.txt": "Tomato plants need full sun, regular watering and stakes to support their stems.",
}
Chunker = Callable[[str, str], list[Chunk]]


@pytest.fixture(scope="module")
def embedder() -> SentenceTransformer:
    return load_embedder()


@pytest.fixture(scope="module")
def chunker(tokenizer: PreTrainedTokenizerBase) -> Chunker:
    return lambda text, source: chunk_document(text, source, tokenizer, 16)


def _write(root: Path, files: dict[str, str | bytes]) -> None:
    for source, content in files.items():
        path = root / source
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    root = tmp_path / "docs"
    _write(root, {**DOCS, ".hidden.txt": "never indexed", ".git/config": "never indexed"})
    return root


def _build(tmp_path: Path, docs: Path, embedder: SentenceTransformer, chunker: Chunker) -> ChunkIndex:
    """A flat index of `docs` in `tmp_path / "index"`."""
    index = ChunkIndex.create(tmp_path / "index", embedder, "all-MiniLM-L6-v2", {"chunk_tokens": "16"})
    staging.commit(index, staging.stage_sync(index, docs, chunker, batch_size=4, progress=False))
    return index


def _top_source(index: ChunkIndex, query: str) -> str:
    return index.search(query, 1)[0].chunk.source


def test_a_staged_sync_writes_nothing_until_it_is_committed(
    tmp_path: Path, docs: Path, embedder: SentenceTransformer, chunker: Chunker
) -> None:
    index = ChunkIndex.create(tmp_path / "index", embedder, "all-MiniLM-L6-v2", {"chunk_tokens": "16"})
    staged = staging.stage_sync(index, docs, chunker, progress=False)
    assert staged.report.new_chunks and len(staged.embeddings) == len(staged.report.new_chunks)
    reopened = ChunkIndex.open(tmp_path / "index", embedder)  # what another process sees meanwhile
    assert len(index) == len(reopened) == 0
    assert staging.commit(index, staged) is staged.report and len(index) == len(staged.report.new_chunks)
    assert len(ChunkIndex.open(tmp_path / "index", embedder)) == len(staged.report.new_chunks)


@pytest.mark.parametrize("index_type", ["flat", "hnsw"])
def test_build_search_and_resync(
    tmp_path: Path, docs: Path, embedder: SentenceTransformer, chunker: Chunker, index_type: IndexType
) -> None:
    index = ChunkIndex.create(tmp_path / "index", embedder, "all-MiniLM-L6-v2", {"chunk_tokens": "16"}, index_type)
    report = staging.commit(index, staging.stage_sync(index, docs, chunker, batch_size=4, progress=False))

    assert report.added == [
        "chess.txt",
        "pasta.md",
        "volcanoes.txt",
        "notes/astronomy.txt",
        "notes/gardening.txt",
    ]
    assert (report.changed, report.removed, report.unchanged, report.skipped) == ([], [], [], [])
    expected = [chunk for source, text in DOCS.items() for chunk in chunker(text, source)]
    assert len(index) == len(report.new_chunks) == len(expected) > len(DOCS)
    assert {(c.source, c.token_ids) for c in index.all_chunks()} == {(c.source, c.token_ids) for c in expected}
    assert _top_source(index, "Which volcano in Sicily erupts lava?") == "volcanoes.txt"
    assert _top_source(index, "how long to boil spaghetti") == "pasta.md"
    hits = index.search("planets and their storms", 5)
    assert hits[0].chunk.source == "notes/astronomy.txt"
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)

    _write(
        docs,
        {
            "chess.txt": "The Eiffel Tower in Paris was completed in 1889 for the World's Fair.",
            "baking.txt": "Sourdough bread rises thanks to wild yeast in a fermented starter.",
        },
    )
    (docs / "volcanoes.txt").unlink()
    report = staging.commit(index, staging.stage_sync(index, docs, chunker, progress=False, prune=True))

    assert report.added == ["baking.txt"]
    assert report.changed == ["chess.txt"]
    assert report.removed == ["volcanoes.txt"]
    assert report.unchanged == ["pasta.md", "notes/astronomy.txt", "notes/gardening.txt"]
    assert {c.source for c in report.new_chunks} == {"baking.txt", "chess.txt"}
    sources = {c.source for c in index.all_chunks()}
    assert sources == {"baking.txt", "chess.txt", "pasta.md", "notes/astronomy.txt", "notes/gardening.txt"}
    n_chunks = len(index)
    assert n_chunks == len(list(index.all_chunks()))
    assert _top_source(index, "wild yeast sourdough starter") == "baking.txt"
    assert _top_source(index, "When was the Eiffel Tower built?") == "chess.txt"
    assert "volcanoes.txt" not in {h.chunk.source for h in index.search("volcano lava eruption", len(index))}
    index.close()

    with ChunkIndex.open(tmp_path / "index", embedder) as reopened:
        assert len(reopened) == len(list(reopened.all_chunks())) == n_chunks
        assert reopened.meta["index_type"] == index_type
        assert _top_source(reopened, "wild yeast sourdough starter") == "baking.txt"


def test_unchanged_resync_writes_nothing(
    tmp_path: Path, docs: Path, embedder: SentenceTransformer, chunker: Chunker
) -> None:
    with _build(tmp_path, docs, embedder, chunker) as index:
        vectors = tmp_path / "index" / "vectors.faiss"
        mtime = vectors.stat().st_mtime_ns
        report = staging.commit(index, staging.stage_sync(index, docs, chunker, progress=False))
        assert (report.added, report.changed, report.removed, report.new_chunks) == ([], [], [], [])
        assert len(report.unchanged) == len(DOCS)
        assert vectors.stat().st_mtime_ns == mtime


def test_get_and_meta(tmp_path: Path, docs: Path, embedder: SentenceTransformer, chunker: Chunker) -> None:
    with _build(tmp_path, docs, embedder, chunker) as index:
        chunks = list(index.all_chunks())
        ids = [chunks[3].id, chunks[0].id, chunks[3].id]
        assert index.get(ids) == [chunks[3], chunks[0], chunks[3]]
        with pytest.raises(KeyError, match="nope"):
            index.get([chunks[0].id, "nope"])
        assert index.meta == {
            "chunk_tokens": "16",
            "format": FORMAT,
            "embedder": "all-MiniLM-L6-v2",
            "embedding_dim": "384",
            "index_type": "flat",
        }
    assert ChunkIndex.read_meta(tmp_path / "index")["chunk_tokens"] == "16"
    with pytest.raises(FileExistsError, match="already exists"):
        ChunkIndex.create(tmp_path / "index", embedder, "all-MiniLM-L6-v2", {})
    with pytest.raises(ValueError, match="contradicts"):
        ChunkIndex.create(tmp_path / "other", embedder, "all-MiniLM-L6-v2", {"format": "mine"})
    consistent = {"embedder": "all-MiniLM-L6-v2", "index_type": "hnsw"}
    with ChunkIndex.create(tmp_path / "other", embedder, "all-MiniLM-L6-v2", consistent, "hnsw") as index:
        assert index.meta["index_type"] == "hnsw"


def test_chunk_id_is_stable_and_content_addressed() -> None:
    # pinned: an id that changed between versions would orphan every stored chunk and its caches
    assert chunk_id("a.txt", 0, (1, 2, 3)) == "e2dcc87c0b370cc9"
    assert chunk_id("a.txt", 0, [1, 2, 3]) == "e2dcc87c0b370cc9"  # the token ids count, not their container
    variants = {
        chunk_id("a.txt", 0, (1, 2, 3)),
        chunk_id("a.txt", 0, (1, 2, 4)),
        chunk_id("b.txt", 0, (1, 2, 3)),
        chunk_id("a.txt", 1, (1, 2, 3)),
    }
    assert len(variants) == 4


def test_search_edge_cases(
    tmp_path: Path,
    docs: Path,
    embedder: SentenceTransformer,
    chunker: Chunker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with _build(tmp_path, docs, embedder, chunker) as index:
        with caplog.at_level(logging.WARNING, logger="rag_kvcache.retrieval"):
            hits = index.search("volcano", len(index) + 10)
        assert len(hits) == len(index)
        assert {h.chunk.id for h in hits} == {c.id for c in index.all_chunks()}
        assert "exceeds" in caplog.text
        with pytest.raises(ValueError, match="got 0"):
            index.search("volcano", 0)
        with pytest.raises(ValueError, match="empty"):
            index.search("  \n", 3)


@pytest.mark.parametrize("index_type", ["flat", "hnsw"])
def test_nearest_reads_the_stored_vectors_and_takes_each_text_once(
    tmp_path: Path, docs: Path, embedder: SentenceTransformer, chunker: Chunker, index_type: IndexType
) -> None:
    """A chunk's nearest chunks are what searching its own text finds, each text once and never its own (a
    copied file's chunks are one text), found by the index's vectors: embedding nothing again."""
    shutil.copy(docs / "chess.txt", docs / "chess-copy.txt")
    index = ChunkIndex.create(tmp_path / "index", embedder, "all-MiniLM-L6-v2", {"chunk_tokens": "16"}, index_type)
    staging.commit(index, staging.stage_sync(index, docs, chunker, batch_size=4, progress=False))
    with index:
        chunks = sorted(index.all_chunks(), key=lambda c: c.id)
        by_text = []
        for chunk in chunks:
            texts = dict.fromkeys(h.chunk.token_ids for h in index.search(chunk.text, len(index)))
            by_text.append(set([t for t in texts if t != chunk.token_ids][:2]))
        index.embed = None  # type: ignore[method-assign, assignment]  # nearest must not embed
        nearest = index.nearest(chunks, 2)
        assert [{n.token_ids for n in row} for row in nearest] == by_text  # as sets: near ties may swap
        assert all(len(row) == 2 for row in nearest) and sum(c.source == "chess-copy.txt" for c in chunks) > 0
        assert index.nearest([], 2) == []
        with pytest.raises(ValueError, match="got 0"):
            index.nearest(chunks, 0)
        stranger = Chunk("elsewhere.txt", 0, (1, 2, 3), 0, 5, "hello")
        with pytest.raises(RagKVCacheError, match="not in"):
            index.nearest([ChunkRecord.from_chunk(stranger)], 2)


def _deny(monkeypatch: pytest.MonkeyPatch, *paths: Path) -> None:
    """Make reading `paths` fail as a chmod 000 would for a non-root user (root ignores the bits)."""
    denied = {str(path) for path in paths}
    read_bytes, scandir = Path.read_bytes, os.scandir

    def guarded_read_bytes(path: Path) -> bytes:
        if str(path) in denied:
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    def guarded_scandir(path: str | Path = ".") -> os.ScandirIterator:
        if str(path) in denied:
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(Path, "read_bytes", guarded_read_bytes)
    monkeypatch.setattr(os, "scandir", guarded_scandir)


def test_skips_unindexable_files_with_warnings(
    tmp_path: Path,
    docs: Path,
    embedder: SentenceTransformer,
    chunker: Chunker,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _write(
        docs,
        {
            "image.png": b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR",
            "latin1.txt": "café crème".encode("latin-1"),
            "empty.txt": "",
            "blank.txt": " \n\t\n",
            "locked.txt": "secret",
            "private/diary.txt": "secret",
        },
    )
    locked_file, locked_folder = docs / "locked.txt", docs / "private"
    for path in (locked_file, locked_folder):
        path.chmod(0)
    if os.access(locked_file, os.R_OK):  # running as root
        _deny(monkeypatch, locked_file, locked_folder)
    expected = {
        "image.png": "binary",
        "latin1.txt": "not UTF-8",
        "empty.txt": "empty",
        "blank.txt": "empty",
        "locked.txt": "unreadable",
        "private": "unreadable folder",
    }

    try:
        with caplog.at_level(logging.WARNING, logger="rag_kvcache.retrieval"):
            files, skipped = read_documents(docs)
            with _build(tmp_path, docs, embedder, chunker) as index:
                report = staging.commit(index, staging.stage_sync(index, docs, chunker, progress=False))
                assert {c.source for c in index.all_chunks()} == set(DOCS)
    finally:
        locked_folder.chmod(0o700)

    assert sorted(f.source for f in files) == sorted(DOCS)
    assert report.skipped == skipped
    assert {s.source: s.reason.split(" (")[0] for s in skipped} == expected
    for source in expected:
        assert any(source in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records), source


def test_read_documents_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing"):
        read_documents(tmp_path / "missing")
    (tmp_path / "file.txt").write_text("x", encoding="utf-8")
    with pytest.raises(NotADirectoryError, match=r"file\.txt"):
        read_documents(tmp_path / "file.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        read_documents(tmp_path / "empty")
    _write(tmp_path / "junk", {"a.bin": b"\0\1\2", ".hidden.txt": "hidden"})
    with pytest.raises(ValueError, match="junk"):
        read_documents(tmp_path / "junk")


def test_open_rejects_foreign_index(tmp_path: Path, embedder: SentenceTransformer) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ChunkIndex.open(tmp_path / "nowhere", embedder)
    (tmp_path / "plain").mkdir()
    with pytest.raises(ForeignIndexError, match="plain"):
        ChunkIndex.open(tmp_path / "plain", embedder)

    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "index.sqlite").write_bytes(b"not a database at all" * 100)
    with pytest.raises(ForeignIndexError, match="garbage"):
        ChunkIndex.open(tmp_path / "garbage", embedder)

    (tmp_path / "other").mkdir()
    with sqlite3.connect(tmp_path / "other" / "index.sqlite") as conn:
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
        conn.execute("INSERT INTO meta VALUES ('format', 'someone-elses-v7')")
    conn.close()
    with pytest.raises(ForeignIndexError, match="someone-elses-v7"):
        ChunkIndex.open(tmp_path / "other", embedder)
    with pytest.raises(ForeignIndexError, match="someone-elses-v7"):
        ChunkIndex.read_meta(tmp_path / "other")


@pytest.mark.parametrize("damage", ["deleted", "stale", "corrupt"])
def test_damaged_faiss_file_is_rebuilt_on_open(
    tmp_path: Path,
    docs: Path,
    embedder: SentenceTransformer,
    chunker: Chunker,
    caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:
    vectors = tmp_path / "index" / "vectors.faiss"
    with _build(tmp_path, docs, embedder, chunker) as index:
        shutil.copy(vectors, tmp_path / "old.faiss")
        _write(docs, {"pasta.md": "Quantum computers use qubits that can be in superposition."})
        staging.commit(index, staging.stage_sync(index, docs, chunker, progress=False))
        n_chunks = len(index)
    if damage == "deleted":
        vectors.unlink()
    elif damage == "stale":  # as if the process died between the SQLite commit and the FAISS rename
        shutil.copy(tmp_path / "old.faiss", vectors)
    else:
        vectors.write_bytes(b"\0garbage")

    with caplog.at_level(logging.WARNING, logger="rag_kvcache.retrieval"):
        index = ChunkIndex.open(tmp_path / "index", embedder)
    with index:
        assert "rebuilding" in caplog.text
        assert len(index) == n_chunks
        assert _top_source(index, "qubits and superposition") == "pasta.md"
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger="rag_kvcache.retrieval"),
        ChunkIndex.open(tmp_path / "index", embedder),
    ):
        assert "rebuilding" not in caplog.text


def test_load_embedder_accepts_hub_style_default_name(embedder: SentenceTransformer) -> None:
    other = load_embedder("sentence-transformers/all-MiniLM-L6-v2")
    assert other.get_embedding_dimension() == embedder.get_embedding_dimension() == 384


def test_second_folder_adds_and_prune_removes(
    tmp_path: Path, docs: Path, embedder: SentenceTransformer, chunker: Chunker
) -> None:
    other = tmp_path / "other"
    _write(other, {"baking.txt": "Sourdough bread rises thanks to wild yeast in a fermented starter."})
    with _build(tmp_path, docs, embedder, chunker) as index:
        report = staging.commit(index, staging.stage_sync(index, other, chunker, progress=False))
        assert (report.added, report.removed) == (["baking.txt"], [])
        assert {c.source for c in index.all_chunks()} == {*DOCS, "baking.txt"}
        assert _top_source(index, "Which volcano in Sicily erupts lava?") == "volcanoes.txt"
        report = staging.commit(index, staging.stage_sync(index, other, chunker, progress=False, prune=True))
        assert report.removed == sorted(DOCS) and report.unchanged == ["baking.txt"]
        assert {c.source for c in index.all_chunks()} == {"baking.txt"} and len(index) == len(report.unchanged)


def test_match_finds_chunks_added_and_forgets_removed_ones(
    tmp_path: Path, docs: Path, embedder: SentenceTransformer, chunker: Chunker, tokenizer
) -> None:
    with _build(tmp_path, docs, embedder, chunker) as index:
        chunk = max((c for c in index.all_chunks() if c.source == "pasta.md"), key=lambda c: len(c.token_ids))
        prompt = tuple(tokenizer("Answer from this: ", add_special_tokens=False).input_ids) + chunk.token_ids + (102,)
        [(span, record)] = index.match(prompt)
        assert record == chunk and (span.offset, span.length) == (0, len(chunk.token_ids))
        (docs / "pasta.md").unlink()
        staging.commit(index, staging.stage_sync(index, docs, chunker, progress=False, prune=True))
        assert index.match(prompt) == []
        with sqlite3.connect(tmp_path / "index" / "index.sqlite") as conn:  # an index from before the table
            conn.execute("DROP TABLE ngrams")
    with ChunkIndex.open(tmp_path / "index", embedder) as reopened:  # rebuilt from the chunks on open
        chess = max((c for c in reopened.all_chunks() if c.source == "chess.txt"), key=lambda c: len(c.token_ids))
        assert [r.id for _, r in reopened.match((7,) + chess.token_ids + (8,))] == [chess.id]


def test_the_embedder_in_bfloat16_embeds_and_ranks_as_in_float32() -> None:
    """`RuntimeConfig.embedder_dtype="bfloat16"`: the embedder's weights in bfloat16, its vectors pointing where
    float32's do and ranking this folder's texts for each question as they do."""
    exact_model, half = load_embedder(dtype="float32"), load_embedder(dtype="bfloat16")
    assert {p.dtype for p in exact_model.parameters()} == {torch.float32}
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    texts = list(DOCS.values())
    exact, low = unit_vectors(exact_model, texts), unit_vectors(half, texts)  # [T, E] each, as `ChunkIndex.embed`'s
    assert float((exact * low).sum(axis=1).min()) > 0.999
    questions = ["Which planet is the largest?", "How is spaghetti cooked?", "How does a knight move?"]
    ranked = [
        np.argsort(-(unit_vectors(m, questions) @ v.T), axis=1).tolist() for m, v in ((exact_model, exact), (half, low))
    ]
    assert ranked[0] == ranked[1]


@pytest.mark.parametrize(
    ("flags", "native"),
    [("fpu sse2 avx512f avx512_bf16 avx512_vnni", True), ("fpu amx_bf16 amx_tile", True), ("fpu sse2 avx2", False)],
)
def test_native_bfloat16_reads_the_cpus_flags(tmp_path: Path, flags: str, native: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: a CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert embedding.native_bfloat16(cpuinfo) is native
    assert embedding.native_bfloat16(tmp_path / "missing") is False  # another system: no such file


@pytest.mark.parametrize("native", [True, False])
def test_auto_runs_the_embedder_in_bfloat16_only_on_a_cpu_that_computes_it(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    monkeypatch.setattr(embedding, "native_bfloat16", lambda: native)
    assert embedding.embedder_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
    assert embedding.embedder_dtype("auto", "cuda:0") == "float32"
    assert embedding.embedder_dtype("float32", "cpu") == "float32"
    assert embedding.embedder_dtype("bfloat16", "cpu") == "bfloat16"
    assert RuntimeConfig().embedder_dtype == "auto"


def test_embedder_dtype_is_checked() -> None:
    with pytest.raises(ConfigError, match="embedder_dtype must be one of auto, .*'int4'"):
        RuntimeConfig(embedder_dtype="int4")
