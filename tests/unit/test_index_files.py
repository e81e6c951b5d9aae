"""The files an index is opened with (issue 75): one that fails to parse is named in the error (the file and
what is wrong), `check` reports it and `check --repair` drops what can be rebuilt (the neighbour table,
pending.json) so that the index opens; the recorded settings carry a checksum, so settings edited after the
index was built are refused; the index's own files are never indexed as documents, whatever the documents
folder is."""

from __future__ import annotations

import json
import sqlite3

import pytest
from test_faults import CFG, QUESTION, replace_model, tiny_model_dir, write_docs  # noqa: F401
from typer.testing import CliRunner

from rag_kvcache.cli import app
from rag_kvcache.errors import IndexFileError, RagKVCacheError
from rag_kvcache.index import KVIndex
from rag_kvcache.indexing.neighbours import LEGACY_FILE, NEIGHBOURS_DB, NeighbourTable
from rag_kvcache.indexing.provenance import SETTINGS_CHECKSUM_KEY, SETTINGS_KEY
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.retrieval.documents import INDEX_ENTRIES, read_documents


@pytest.fixture()
def built(tiny_model_dir, tmp_path):  # noqa: F811
    """An index of the tiny model (cached_neighbours: its neighbour table recorded) in a folder, closed."""
    KVIndex.build(
        write_docs(tmp_path / "docs", 3), tmp_path / "idx", replace_model(CFG, tiny_model_dir), progress=False
    ).close()
    return tmp_path / "idx"


def cli(*args: str) -> tuple[int, str]:
    """The command's exit code and output, without white space (Rich wraps lines within paths)."""
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, "".join(result.output.split())


def squeezed(text: str) -> str:
    return "".join(text.split())


def set_settings(index_dir, text: str) -> None:
    with sqlite3.connect(index_dir / "index.sqlite") as conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = ?", (text, SETTINGS_KEY))


CORRUPT = {  # a file -> what is written over it, and what is wrong with it then
    NEIGHBOURS_DB: (b"not a database, cut mid-write", "is not a neighbour table"),
    LEGACY_FILE: (b'{"abc": [[1, 2], ', "is not JSON"),  # an index made before the table was SQLite, cut mid-write
    "pending.json": (b'{"abc": [[1, 2], ', "is not JSON"),
}


@pytest.mark.parametrize("name", CORRUPT)
def test_a_corrupt_record_is_named_and_check_repair_drops_it_so_the_index_opens(built, tmp_path, name):
    assert len(NeighbourTable(built)) > 0
    data, what = CORRUPT[name]
    (built / name).write_bytes(data)
    with pytest.raises(IndexFileError, match=f"{name} {what}") as raised:
        KVIndex.open(built).maker.pending()  # the neighbour table is read at open, pending.json when asked
    assert isinstance(raised.value, RagKVCacheError) and str(built / name) in str(raised.value)
    code, out = cli("check", "--index", str(built))
    assert code == 1 and squeezed(f"found: {built / name} {what}") in out and "--repair" in out, out
    code, out = cli("check", "--index", str(built), "--repair")
    assert code == 0 and squeezed(f"repaired: dropped {built / name}") in out, out
    assert not (built / name).exists()
    index = KVIndex.open(built)
    assert FusedGenerator(index).ask(QUESTION).answer  # chunks without neighbour records read their own caches
    index.update(tmp_path / "docs", progress=False)  # the next index run records the neighbours again
    assert len(NeighbourTable(built)) > 0
    assert cli("check", "--index", str(built))[0] == 0


def test_a_record_of_the_wrong_shape_is_named(built):
    (built / LEGACY_FILE).write_text('["not", "a", "table"]')
    with pytest.raises(IndexFileError, match="neighbours.json holds .*not a table"):
        KVIndex.open(built)
    (built / LEGACY_FILE).unlink()
    with sqlite3.connect(built / NEIGHBOURS_DB) as conn:
        conn.execute("DROP TABLE near")  # an SQLite file, but not a neighbour table
    with pytest.raises(IndexFileError, match=f"{NEIGHBOURS_DB} is not a neighbour table.*no such table: near"):
        KVIndex.open(built)
    code, out = cli("check", "--index", str(built))
    assert code == 1 and squeezed(f"{NEIGHBOURS_DB} is not a neighbour table (no such table: near)") in out, out


def test_corrupt_recorded_settings_are_named_and_check_cannot_rebuild_them(built):
    set_settings(built, '{"chunk_tokens": 24,')
    with pytest.raises(IndexFileError, match=r"index.sqlite.*'settings'.*not JSON"):
        KVIndex.config_of(built)
    code, out = cli("check", "--index", str(built), "--repair")
    assert code == 1 and squeezed(f"{built}/index.sqlite meta key 'settings' is not JSON") in out, out
    assert "notrepaired:" in out
    code, out = cli("ask", QUESTION, "--index", str(built))
    assert code != 0 and squeezed(f"{built}/index.sqlite meta key 'settings' is not JSON") in out, out


def test_recorded_settings_edited_after_the_index_was_built_are_refused(built):
    with sqlite3.connect(built / "index.sqlite") as conn:
        meta = dict(conn.execute("SELECT key, value FROM meta"))
    assert SETTINGS_CHECKSUM_KEY in meta  # recorded when the index was created
    edited = json.loads(meta[SETTINGS_KEY]) | {"chunk_prefill": "behind_prefix"}
    set_settings(built, json.dumps(edited, sort_keys=True))
    with pytest.raises(IndexFileError, match=r"'settings'.*edited after the index was built"):
        KVIndex.open(built)
    code, out = cli("check", "--index", str(built))
    assert code == 1 and "editedaftertheindexwasbuilt" in out, out


def test_an_index_made_before_the_settings_checksum_opens(built):
    with sqlite3.connect(built / "index.sqlite") as conn:
        conn.execute("DELETE FROM meta WHERE key = ?", (SETTINGS_CHECKSUM_KEY,))
    assert KVIndex.open(built).recorded.chunk_tokens == 24
    assert cli("check", "--index", str(built))[0] == 0


@pytest.mark.parametrize("where", ["same", "inside"])
def test_the_index_files_are_never_indexed_as_documents(tiny_model_dir, tmp_path, where):  # noqa: F811
    docs = write_docs(tmp_path / "docs", 2)
    index_dir = docs if where == "same" else docs / "idx"
    cfg = replace_model(CFG, tiny_model_dir)
    KVIndex.build(docs, index_dir, cfg, progress=False).close()
    index = KVIndex.open(index_dir)
    (docs / "doc000.txt").write_text("A changed document about the harbour ferry.")
    report = index.update(docs, progress=False)  # neighbours.sqlite, kv/ and the rest exist now
    sources = set(index.chunks.documents())
    assert sources == {"doc000.txt", "doc001.txt", "observatory.txt"}, sources
    skipped = {s.source: s.reason for s in report.skipped}
    assert ("idx" in skipped) if where == "inside" else {NEIGHBOURS_DB, "kv", "index.sqlite"} <= skipped.keys()
    assert all("index" in reason for reason in skipped.values()), skipped


def test_every_entry_an_index_folder_holds_is_known_as_the_indexs_own(built):
    (built / "pending.json").write_text("{}")  # a run in progress
    assert {p.name for p in built.iterdir() if not p.name.startswith(".")} <= set(INDEX_ENTRIES)
    (built / "notes").mkdir()
    (built / "notes" / "a.txt").write_text("A note kept in a folder inside the index folder.")
    files, skipped = read_documents(built / "notes", exclude=(built,))
    assert [f.source for f in files] == ["a.txt"] and skipped == []  # not the index's own: read
    with pytest.raises(ValueError, match="no readable text files"):
        read_documents(built / "kv", exclude=(built,))  # the caches' folder: every file the index's own


def test_the_neighbour_table_holds_each_neighbours_tokens_once_and_another_process_reads_what_is_recorded(tmp_path):
    """Under a budget every chunk's neighbours are recorded. As JSON that spelled each neighbour out for every chunk
    naming it, the table took about 18 bytes a token of the corpus and was read and rewritten whole. In SQLite each
    neighbour's tokens are stored once, a record is one transaction, and a reader opened before it (a server while
    `index` runs) reads it at its next lookup; texts no row names any more are dropped with their rows."""
    shared, other = (5, 6, 7), (8, 9)
    reader = NeighbourTable(tmp_path)
    assert not reader and "a" not in reader and len(reader) == 0  # no file yet
    writer = NeighbourTable(tmp_path)
    writer.record([("a", [shared, other]), ("b", [shared]), ("c", [other, shared])])
    assert dict(reader) == {"a": [shared, other], "b": [shared], "c": [other, shared]}
    with sqlite3.connect(tmp_path / NEIGHBOURS_DB) as conn:
        assert conn.execute("SELECT COUNT(*) FROM texts").fetchone() == (2,)
    writer.record([("b", [other])])  # recorded again: replaced
    assert reader["b"] == [other]
    assert writer.forget({"b"}) == 2 and dict(reader) == {"b": [other]}
    with sqlite3.connect(tmp_path / NEIGHBOURS_DB) as conn:
        assert conn.execute("SELECT COUNT(*) FROM texts").fetchone() == (1,)


def test_an_index_whose_neighbour_table_is_json_has_it_moved_into_sqlite_and_names_the_same_caches(built):
    """An index made before the table was SQLite holds `neighbours.json`: the first process that may write the
    folder moves it into the table and deletes it, and the index names the caches it named (no orphans)."""
    table = {key: [list(ids) for ids in near] for key, near in NeighbourTable(built).items()}
    live = set(KVIndex.open(built).maker.live_keys())
    for name in (NEIGHBOURS_DB, f"{NEIGHBOURS_DB}-wal", f"{NEIGHBOURS_DB}-shm"):
        (built / name).unlink(missing_ok=True)
    (built / LEGACY_FILE).write_text(json.dumps(table))
    index = KVIndex.open(built)
    assert not (built / LEGACY_FILE).exists() and len(NeighbourTable(built)) == len(table)
    assert set(index.maker.live_keys()) == live and index.orphans() == []


def test_a_full_disk_while_recording_neighbours_is_a_typed_error_and_leaves_the_table_as_it_was(tmp_path, monkeypatch):
    """A record is one transaction: on a full disk (SQLite's SQLITE_FULL, from a page limit on the writer's
    connection) it raises `StorageFullError` naming what it was doing, and readers see the table as it was."""
    from test_faults_disk import full_at_current_size

    from rag_kvcache.errors import StorageFullError
    from rag_kvcache.indexing import neighbours

    table = NeighbourTable(tmp_path)
    table.record([("a", [(5, 6, 7)])])
    table.close()
    monkeypatch.setattr(neighbours, "_connect", full_at_current_size(neighbours._connect))
    with pytest.raises(StorageFullError, match="no space left .* while recording chunks' neighbours"):
        NeighbourTable(tmp_path).record([(f"c{i}", [tuple(range(i, i + 500))]) for i in range(200)])
    monkeypatch.undo()
    assert dict(NeighbourTable(tmp_path)) == {"a": [(5, 6, 7)]}
