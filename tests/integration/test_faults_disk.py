"""Injected faults of the disk and of dirty states (issue 14, items 7-9): a full disk at every write
(SQLite's commit, vectors.faiss, the counters; a real full tmpfs), read-only indexes (a real read-only
mount), a kill inside index creation, temporary files of killed runs, orphan caches, a foreign model."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from test_faults import CFG, QUESTION, TESTS, assert_consistent, replace_model, tiny_model_dir, write_docs  # noqa: F401

from rag_kvcache.errors import StorageFullError
from rag_kvcache.index import KVIndex
from rag_kvcache.indexing.provenance import ForeignModelError
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.retrieval import database
from rag_kvcache.retrieval.database import ForeignIndexError

NEW_DOC = "The regatta winners receive a silver oar that hangs in the town hall. " * 3


@pytest.fixture()
def index(tiny, tmp_path) -> KVIndex:
    return KVIndex.build(write_docs(tmp_path / "docs", 3), tmp_path / "idx", CFG, adapter=tiny, progress=False)


def add_new_doc(index: KVIndex) -> Path:
    docs = index.path.parent / "docs"
    (docs / "new.txt").write_text(NEW_DOC)
    return docs


def assert_unchanged(index: KVIndex, n_chunks: int, tiny, caplog) -> None:
    """SQLite holds what it held, vectors.faiss matches it (no rebuild on open), no temporary file left."""
    assert len(list(index.chunks.all_chunks())) == n_chunks
    assert not list(index.path.glob(".vectors.faiss.*"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        reopened = KVIndex.open(index.path, CFG, adapter=tiny)
    assert "rebuilding" not in caplog.text and len(reopened.chunks) == n_chunks


def full_at_current_size(connect):
    """`connect` (path, mode, immutable) whose writing connections find the disk full at the file's current size:
    SQLite reports SQLITE_FULL, from a page limit on the connection."""

    def connect_full(db_path, mode, immutable=False):
        conn = connect(db_path, mode, immutable)
        if mode != "ro":
            (pages,) = conn.execute("PRAGMA page_count").fetchone()
            conn.execute(f"PRAGMA max_page_count = {pages}")
        return conn

    return connect_full


def test_a_full_disk_at_the_sqlite_commit_is_a_typed_error_and_the_index_intact(index, tiny, monkeypatch, caplog):
    """A failed SQLite commit surfaced as an uncaught sqlite3.OperationalError traceback. SQLite itself
    reports the disk full here (SQLITE_FULL, from a page limit on the writer's connection)."""
    n_chunks = len(index.chunks)
    docs = add_new_doc(index)
    monkeypatch.setattr(database, "connect", full_at_current_size(database.connect))
    writer = KVIndex.open(index.path, CFG, adapter=tiny)  # its first write connects for writing
    with pytest.raises(StorageFullError, match=r"no space left .* while committing \d+ new chunks") as failure:
        writer.update(docs, progress=False)
    assert failure.value.errno == errno.ENOSPC and failure.value.filename == str(index.path / "index.sqlite")
    monkeypatch.undo()
    assert_unchanged(index, n_chunks, tiny, caplog)
    assert FusedGenerator(writer).ask(QUESTION).cache_misses == 0  # still usable
    assert index.update(docs, progress=False).added == ["new.txt"]  # space freed: the same command works
    assert_consistent(index.path, tiny)


def test_a_full_disk_writing_vectors_faiss_leaves_the_sync_uncommitted(index, tiny, monkeypatch, caplog):
    """A failed FAISS write raised a raw OSError after the sync had committed in SQLite."""
    n_chunks = len(index.chunks)
    docs = add_new_doc(index)
    fsync = os.fsync

    def no_space_for_vectors(fd):
        if ".vectors.faiss." in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", no_space_for_vectors)
    with pytest.raises(StorageFullError, match=r"no space left .* while writing the \d+-byte vectors.faiss"):
        index.update(docs, progress=False)
    monkeypatch.undo()
    assert_unchanged(index, n_chunks, tiny, caplog)
    assert [h.chunk.source for h in index.search(QUESTION, 1)] == ["observatory.txt"]  # the in-memory vectors too
    assert index.update(docs, progress=False).added == ["new.txt"]
    assert_consistent(index.path, tiny)


def test_a_failed_counters_write_keeps_the_answer(index, monkeypatch, caplog):
    """In the API a finished answer was thrown away because writing stats.json failed."""
    write_text = Path.write_text

    def no_space_for_stats(path, *args, **kwargs):
        if path.name.startswith(".stats.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", no_space_for_stats)
    with caplog.at_level(logging.WARNING):
        answer = FusedGenerator(index).ask(QUESTION)
    assert answer.answer and answer.chunks[0].source == "observatory.txt"
    assert "could not write the KV store counters" in caplog.text and "No space left" in caplog.text
    assert not (index.path / "kv" / f".stats.json.{os.getpid()}").exists()  # no partial counters file left behind


def test_a_corrupt_cache_that_cannot_be_removed_is_still_a_recomputed_miss(index, monkeypatch, caplog):
    """A reader of a read-only index that met a corrupt cache crashed removing it (EROFS) instead of
    recomputing: the entry stays where it is, and every answer is the intact index's."""
    asked = FusedGenerator(index).ask(QUESTION, top_k=6)
    reference = asked.answer
    laid_out = index.config.query.in_prompt_order(asked.chunks)  # the answer lists them best first
    (first,) = index.chunks.get([laid_out[0].id])  # a cache the question reads, whatever the directory order:
    victim = index.store.disk.path(index.addressing.own_key(first.token_ids))  # the first chunk's, behind the prefix
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    reopened = KVIndex.open(index.path, CFG, adapter=index.adapter)

    def read_only(self, key, *args):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self.path(key)))

    monkeypatch.setattr(type(reopened.store.disk), "remove", read_only)
    monkeypatch.setattr(type(reopened.store.disk), "write", read_only)
    with caplog.at_level(logging.WARNING):
        answers = [FusedGenerator(reopened).ask(QUESTION, top_k=6).answer for _ in range(2)]
    assert answers == [reference, reference]
    assert "could not remove the corrupt KV cache entry" in caplog.text and victim.read_bytes() == bytes(data)


# ---- real faults: a full tmpfs and a read-only mount, in a private mount namespace ----------------------
REAL = f"""
import json, os, sys
sys.path[:0] = {TESTS!r}
from pathlib import Path
from tiny_model import MINILM_DIR, tiny_llama
from transformers import AutoTokenizer
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.index import KVIndex
from rag_kvcache.errors import StorageFullError
from test_faults import CFG, QUESTION, write_docs
adapter = ModelAdapter(tiny_llama(), AutoTokenizer.from_pretrained(MINILM_DIR), name="tiny-llama")
step, root, docs = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
out = {{}}
if step == "full":
    KVIndex.build(docs, root / "idx", CFG, adapter=adapter, progress=False).close()
    with open(root / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError as e:
            out["filled"] = e.errno
    (docs / "new.txt").write_text("The regatta winners receive a silver oar that hangs in the town hall. " * 30)
    try:
        KVIndex.create(root / "idx", CFG, adapter=adapter).update(docs, progress=False)
    except StorageFullError as e:
        out["update"] = str(e)
index = KVIndex.open(root / "idx", CFG, adapter=adapter)
answer = FusedGenerator(index).ask(QUESTION)
out |= {{"answer": answer.answer, "source": answer.chunks[0].source, "misses": answer.cache_misses,
         "writable": os.access(root / "idx", os.W_OK)}}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def private_mounts(tmp_path_factory) -> None:
    """Skip unless this process may mount in a private mount namespace (root with CAP_SYS_ADMIN)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip(
            "real full-disk and read-only mounts need root and unshare(1); the monkeypatched tests cover the paths"
        )
    target = tmp_path_factory.mktemp("probe")
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {target}"],
        capture_output=True,
        text=True,
    )
    if probe.returncode:
        pytest.skip(f"cannot mount in a private namespace here: {probe.stderr.strip()}")


def run_mounted(mounts: str, *args: str) -> dict:
    result = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'{mounts} && exec "$0" -c "$1" "$2" "$3" "$4"',
            sys.executable,
            REAL,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_an_intact_index_on_a_really_full_disk_answers_and_refuses_updates(private_mounts, tmp_path):
    """On a full disk an intact index was reported as "not a rag-kvcache index" (SQLite cannot create its
    WAL shared-memory file) and a finished answer was lost with its counters: a 2 MiB tmpfs, filled."""
    root = tmp_path / "mnt"
    root.mkdir()
    docs = write_docs(tmp_path / "docs", 3)
    out = run_mounted(f"mount -t tmpfs -o size=2m tmpfs {root}", "full", str(root), str(docs))
    assert out["filled"] == errno.ENOSPC
    assert "no space left on the device" in out["update"]
    assert out["source"] == "observatory.txt" and out["misses"] == 0 and out["answer"]


def test_a_read_only_mount_opens_answers_and_writes_nothing(private_mounts, index, tmp_path):
    """Readers needed write access ("attempt to write a readonly database"); as root chmod does not stop
    writes, so the index is bind-mounted read-only. A damaged vectors.faiss is rebuilt in memory only."""
    vectors = index.path / "vectors.faiss"
    damaged = bytearray(vectors.read_bytes())
    damaged[-5] ^= 0xFF
    vectors.write_bytes(bytes(damaged))
    index.close()
    before = {p: p.stat().st_mtime_ns for p in index.path.rglob("*")}
    out = run_mounted(
        f"mount --bind {index.path} {index.path} && mount -o remount,bind,ro {index.path}",
        "read-only",
        str(tmp_path),
        str(tmp_path / "docs"),
    )
    assert out["writable"] is False and out["source"] == "observatory.txt" and out["misses"] == 0
    assert {p: p.stat().st_mtime_ns for p in index.path.rglob("*")} == before and vectors.read_bytes() == damaged


def test_vectors_faiss_is_created_with_the_umask_mode(tiny, tmp_path):
    """vectors.faiss was created 0600 (a temporary file's mode), so other readers could not open it."""
    old = os.umask(0o002)
    try:
        index = KVIndex.build(write_docs(tmp_path / "docs", 1), tmp_path / "idx", CFG, adapter=tiny, progress=False)
    finally:
        os.umask(old)
    assert (index.path / "vectors.faiss").stat().st_mode & 0o777 == 0o664


@pytest.mark.parametrize("state", ["empty_file", "no_tables"])
def test_a_kill_inside_index_creation_is_recovered(tiny, tiny_model_dir, tmp_path, state):  # noqa: F811
    """A kill inside index creation left an index.sqlite without tables that every later run refused
    ("no such table: meta"): readers are told what happened, and the next index run creates the index."""
    idx = tmp_path / "idx"
    idx.mkdir()
    if state == "empty_file":
        (idx / "index.sqlite").touch()
    else:  # killed after SQLite made the file and switched to WAL, before the schema committed
        conn = sqlite3.connect(idx / "index.sqlite")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.close()
    with pytest.raises(ForeignIndexError, match="without tables .* creation was interrupted"):
        KVIndex.open(idx, CFG, adapter=tiny)
    docs = write_docs(tmp_path / "docs", 2)
    if state == "empty_file":
        index = KVIndex.build(docs, idx, CFG, adapter=tiny, progress=False)
        assert index.search(QUESTION, 1)[0].chunk.source == "observatory.txt"
        assert_consistent(idx, tiny)
    else:  # the command a user re-runs
        from typer.testing import CliRunner

        from rag_kvcache.cli import app

        result = CliRunner().invoke(
            app, ["index", str(docs), "--index", str(idx), "--model", str(tiny_model_dir), "--chunk-tokens", "24"]
        )
        assert result.exit_code == 0 and "3 added" in " ".join(result.output.split()), result.output
        assert KVIndex.open(idx).search(QUESTION, 1)[0].chunk.source == "observatory.txt"


def test_temp_files_of_killed_runs_are_collected_at_sync(index, tmp_path):
    """`.vectors.faiss.*` temporary files of killed runs stayed forever."""
    killed = [index.path / ".vectors.faiss.4242-deadbeef", index.path / ".vectors.faiss.tmpab12cd"]  # ours, older ours
    for path in killed:
        path.write_bytes(b"half a file")
    dead_cache = index.store.root / "ab" / f".tmp-999999999-1-{'ab' * 16}.safetensors"
    dead_cache.parent.mkdir(exist_ok=True)
    dead_cache.write_bytes(b"half")
    stray = index.store.root / "ab" / ".tmp-editor-swap.safetensors"
    stray.write_bytes(b"not ours")
    index.update(tmp_path / "docs", progress=False)
    assert not any(p.exists() for p in [*killed, dead_cache]) and stray.exists()


def test_orphan_caches_are_collected_at_sync_and_by_gc(tiny, tiny_model_dir, tmp_path):  # noqa: F811
    """5 edits and 5 deletions left 15 orphan caches (71.5 MiB for 3 live chunks): a sync deletes the caches
    of the chunks it removes; `gc` every cache that is not an indexed chunk's."""
    from typer.testing import CliRunner

    from rag_kvcache.cli import app

    docs = write_docs(tmp_path / "docs", 4)
    index = KVIndex.build(docs, tmp_path / "idx", replace_model(CFG, tiny_model_dir), progress=False)
    stored = lambda: {p.stem for p in index.store.disk.files()}  # noqa: E731
    assert stored() == set(index.maker.live_keys())
    for i in range(2):
        (docs / f"doc{i:03d}.txt").write_text(f"Edited document {i}: the ferry keeper's diary mentions the bakery.")
    (docs / "doc002.txt").unlink()
    report = index.update(docs, progress=False, prune=True)
    assert report.changed == ["doc000.txt", "doc001.txt"] and report.removed == ["doc002.txt"]
    assert stored() == set(index.maker.live_keys())  # collected at sync: nothing but the live caches
    index.delete(["doc003.txt"])
    assert stored() == set(index.maker.live_keys())
    live = next(iter(index.maker.live_keys()))
    orphan = index.store.path("ff" + live[2:])
    orphan.parent.mkdir(exist_ok=True)
    shutil.copy(index.store.path(live), orphan)  # not a chunk's: another model's, or a prompt head cached by a query
    index.update(docs, progress=False)
    assert orphan.exists()  # a sync collects only the caches of the chunks it removed
    result = CliRunner().invoke(app, ["gc", "--index", str(index.path)])
    assert result.exit_code == 0, result.output
    assert "deleted 1 orphan KV caches" in " ".join(result.output.split()) and not orphan.exists()
    assert stored() == set(index.maker.live_keys())


def test_ask_with_another_model_does_not_store_its_caches(index, tokenizer):
    """`ask --model X` wrote X's caches into the index: another model's are computed and used, and kept in
    the process's memory tier (a second question reuses them), never written to the index."""
    from tiny_model import tiny_llama

    from rag_kvcache.engine.model import ModelAdapter

    before = {p.name for p in index.store.disk.files()}
    other = ModelAdapter(tiny_llama(seed=1), tokenizer, name="tiny-llama-other")
    foreign = KVIndex.open(index.path, CFG, adapter=other)
    answer = FusedGenerator(foreign).ask(QUESTION)
    assert answer.cache_misses == CFG.query.top_k and answer.answer
    assert {p.name for p in index.store.disk.files()} == before
    memory = CFG.with_runtime(storage=replace(CFG.runtime.storage, memory_bytes=64 << 20))
    foreign = KVIndex.open(index.path, memory, adapter=other)
    gen = FusedGenerator(foreign)
    assert gen.ask(QUESTION).cache_misses == CFG.query.top_k and gen.ask(QUESTION).cache_misses == 0
    assert {p.name for p in index.store.disk.files()} == before
    assert foreign.collect().orphans == 0 and {p.name for p in index.store.disk.files()} == before  # none its own


def test_indexing_with_another_model_is_refused_and_writes_nothing(index, tokenizer):
    """`index` with changed weights (the CLI refuses another --model, not another checkpoint under the same
    name) wrote its prefix cache, and would have written new chunks' caches, into the index under its own
    namespace: caches no query of the index reads. Now it is refused, naming both fingerprints, and the index's
    files and chunks are as they were."""
    from tiny_model import tiny_llama

    from rag_kvcache.engine.model import ModelAdapter

    before = {p.name for p in index.store.disk.files()}
    chunks = sorted(c.id for c in index.chunks.all_chunks())
    other = ModelAdapter(tiny_llama(seed=1), tokenizer, name="tiny-llama-other")
    foreign = KVIndex.open(index.path, CFG, adapter=other)
    add_new_doc(index)
    with pytest.raises(ForeignModelError, match=f"{index.model.fingerprint}.*{other.fingerprint}"):
        foreign.update(index.path.parent / "docs", progress=False)
    assert {p.name for p in index.store.disk.files()} == before
    assert sorted(c.id for c in KVIndex.open(index.path, CFG, adapter=index.model).chunks.all_chunks()) == chunks
