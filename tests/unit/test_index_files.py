"""The files an index is opened with (issue 75): one that fails to parse is named in the error (the file and
what is wrong), `check` reports it and `check --repair` drops what can be rebuilt (neighbours.json,
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
from rag_kvcache.indexing.provenance import SETTINGS_CHECKSUM_KEY, SETTINGS_KEY
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.retrieval.documents import INDEX_ENTRIES, read_documents


@pytest.fixture()
def built(tiny_model_dir, tmp_path):  # noqa: F811
    """An index of the tiny model (cached_neighbours: neighbours.json recorded) in a folder, closed."""
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


@pytest.mark.parametrize("name", ["neighbours.json", "pending.json"])
def test_a_corrupt_record_is_named_and_check_repair_drops_it_so_the_index_opens(built, tmp_path, name):
    assert (built / "neighbours.json").is_file()
    (built / name).write_text('{"abc": [[1, 2], ')  # cut mid-write
    with pytest.raises(IndexFileError, match=rf"{name}.*not JSON") as raised:
        KVIndex.open(built).maker.pending()  # neighbours.json is read at open, pending.json when asked
    assert isinstance(raised.value, RagKVCacheError) and str(built / name) in str(raised.value)
    code, out = cli("check", "--index", str(built))
    assert code == 1 and f"found:{built / name}isnotJSON" in out and "--repair" in out, out
    code, out = cli("check", "--index", str(built), "--repair")
    assert code == 0 and squeezed(f"repaired: dropped {built / name}") in out, out
    assert not (built / name).exists()
    index = KVIndex.open(built)
    assert FusedGenerator(index).ask(QUESTION).answer  # chunks without neighbour records read their own caches
    index.update(tmp_path / "docs", progress=False)  # the next index run records the neighbours again
    assert json.loads((built / "neighbours.json").read_text())
    assert cli("check", "--index", str(built))[0] == 0


def test_a_record_of_the_wrong_shape_is_named(built):
    (built / "neighbours.json").write_text('["not", "a", "table"]')
    with pytest.raises(IndexFileError, match="neighbours.json holds .*not a table"):
        KVIndex.open(built)


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
    report = index.update(docs, progress=False)  # neighbours.json, kv/ and the rest exist now
    sources = set(index.chunks.documents())
    assert sources == {"doc000.txt", "doc001.txt", "observatory.txt"}, sources
    skipped = {s.source: s.reason for s in report.skipped}
    assert ("idx" in skipped) if where == "inside" else {"neighbours.json", "kv", "index.sqlite"} <= skipped.keys()
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


def test_the_neighbour_table_holds_each_neighbours_tokens_once_and_writes_them_back(tmp_path):
    """Under a budget every chunk's neighbours are recorded: as lists of Python ints, a neighbour mentioned by k
    chunks took k copies of its tokens at about 36 bytes a token. Read or recorded, each is held once, and the table
    writes back as it was read."""
    from rag_kvcache.indexing.records import NEIGHBOURS_FILE, IndexRecords

    shared, other = [5, 6, 7], [8, 9]
    (tmp_path / NEIGHBOURS_FILE).write_text(json.dumps({"a": [shared, other], "b": [shared], "c": [other, shared]}))
    records = IndexRecords(tmp_path)
    records.refresh_neighbours()
    table = records.neighbours
    assert table["a"][0] is table["b"][0] is table["c"][1] and table["a"][1] is table["c"][0]
    records.record("d", [(5, 6, 7)])  # recorded after the read: the same one
    assert table["d"][0] is table["a"][0]
    records.write_neighbours()
    written = json.loads((tmp_path / NEIGHBOURS_FILE).read_text())
    assert written == {"a": [shared, other], "b": [shared], "c": [other, shared], "d": [shared]}
