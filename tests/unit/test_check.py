"""`rag-kvcache check [--repair]` (issue 14): every injected fault is reported, `--repair` restores a
working index, and what is intact is neither re-embedded nor recomputed (counted on the real model and
embedder)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from test_faults import CFG, QUESTION, replace_model, tiny_model_dir, write_docs  # noqa: F401

from rag_kvcache.index import KVIndex
from rag_kvcache.maintenance import check
from rag_kvcache.query.generator import FusedGenerator


@pytest.fixture()
def index(tiny, tiny_model_dir, tmp_path) -> KVIndex:  # noqa: F811
    """An index of the tiny model saved to a folder, so the CLI can open it too."""
    return KVIndex.build(
        write_docs(tmp_path / "docs", 3), tmp_path / "idx", replace_model(CFG, tiny_model_dir), progress=False
    )


@pytest.fixture()
def calls(index, monkeypatch) -> dict[str, int]:
    """How many caches the model computes and how many texts the embedder embeds (the real ones, counted)."""
    counts = {"computed": 0, "embedded": 0}

    def counting(name, method):
        def counted(items, *args, **kwargs):
            counts[name] += len(items)
            return method(items, *args, **kwargs)

        return counted

    monkeypatch.setattr(index.maker.recipe, "compute", counting("computed", index.maker.recipe.compute))
    monkeypatch.setattr(index.chunks._embedder, "encode", counting("embedded", index.chunks._embedder.encode))
    return counts


def test_an_intact_index_checks_clean_and_repair_computes_nothing(index, calls):
    report = check(index, progress=False)
    assert report.ok and report.problems == [] and report.caches_checked == len(index.maker.live_keys())
    repaired = check(index, repair=True, progress=False)
    assert repaired.ok and repaired.problems == [] and repaired.repaired == []
    assert calls == {"computed": 0, "embedded": 0} and repaired.recomputed == repaired.reembedded == 0


def test_check_reports_every_injected_fault_and_repair_restores_only_them(index, calls):
    before = FusedGenerator(index).ask(QUESTION)
    calls.update(computed=0, embedded=0)  # the question's embedding
    chunks = list(index.chunks.all_chunks())
    flipped, deleted, bad_embedding = chunks[0], chunks[1], chunks[2]
    path = index.store.path(index.addressing.own_key(flipped.token_ids))
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF  # in the last layer's data
    path.write_bytes(bytes(raw))
    index.store.path(index.addressing.own_key(deleted.token_ids)).unlink()
    vectors = index.path / "vectors.faiss"
    data = bytearray(vectors.read_bytes())
    data[-5] ^= 0xFF
    vectors.write_bytes(bytes(data))
    (blob,) = index.chunks._conn.execute("SELECT embedding FROM chunks WHERE id = ?", (bad_embedding.id,)).fetchone()
    damaged = np.frombuffer(blob, dtype="<f4").copy()
    damaged[5] *= 2.0**40  # one exponent bit: a score of ~1e11 for every question
    index.chunks._conn.execute("UPDATE chunks SET embedding = ? WHERE id = ?", (damaged.tobytes(), bad_embedding.id))
    orphan = index.store.path("ff" + index.addressing.own_key(flipped.token_ids)[2:])
    orphan.parent.mkdir(exist_ok=True)
    shutil.copy(index.store.path(index.addressing.own_key(chunks[3].token_ids)), orphan)
    (index.path / ".vectors.faiss.4242-deadbeef").write_bytes(b"killed mid-write")

    report = check(index, progress=False)
    found = "\n".join(report.problems + report.garbage)
    assert not report.ok and len(report.problems) == 3 and len(report.garbage) == 2, found
    assert f"KV cache {index.addressing.own_key(flipped.token_ids)}" in found and "corrupt" in found
    assert report.caches_cold == 1  # the deleted cache: not damage, made when a question needs it
    assert "vectors.faiss does not match the checksum" in found
    assert f"chunk {bad_embedding.id}: embedding is not a finite unit vector" in found
    assert "1 orphan KV caches" in found and ".vectors.faiss.4242-deadbeef" in found
    assert calls == {"computed": 0, "embedded": 0}

    repaired = check(index, repair=True, progress=False)
    assert repaired.ok and repaired.recomputed == 0 and repaired.reembedded == 1
    assert repaired.caches_cold == 2  # the deleted cache and the corrupt one, which `check` dropped when it found it
    assert calls == {"computed": 0, "embedded": 1}  # the one damaged embedding; the caches wait for a question
    assert repaired.collected.orphans == 1 and repaired.collected.temp_files == 1
    again = check(index, progress=False)
    assert again.ok and again.problems == again.garbage == [], again.problems
    after = FusedGenerator(index).ask(QUESTION)  # makes the dropped caches of the chunks it retrieves
    assert FusedGenerator(index).ask(QUESTION).cache_misses == 0 and after.answer == before.answer
    assert [c.id for c in after.chunks] == [c.id for c in before.chunks]
    torch.testing.assert_close(after.first_token_logits, before.first_token_logits, atol=1e-4, rtol=0)


def test_a_row_that_is_not_what_its_id_says_is_dropped_and_reindexed(index, tmp_path):
    """A corrupted SQLite row passed integrity_check and its chunk was never retrieved again: the row's
    token ids no longer give its id. Repair drops its document; the next index run reads it again."""
    victim = next(c for c in index.chunks.all_chunks() if c.source == "observatory.txt")
    ids = np.array(victim.token_ids, dtype="<i4")
    ids[3] += 1
    index.chunks._conn.execute("UPDATE chunks SET token_ids = ? WHERE id = ?", (ids.tobytes(), victim.id))
    report = check(index, progress=False)
    assert any(f"observatory.txt chunk {victim.id}: its id does not match" in p for p in report.problems)
    repaired = check(index, repair=True, progress=False)
    assert repaired.ok and any("dropped 1 damaged documents (observatory.txt)" in r for r in repaired.repaired)
    assert "observatory.txt" not in {c.source for c in index.chunks.all_chunks()}
    assert index.update(tmp_path / "docs", progress=False).added == ["observatory.txt"]
    assert check(index, progress=False).problems == []
    assert index.search(QUESTION, 1)[0].chunk.source == "observatory.txt"


def test_the_check_command_exits_non_zero_until_repaired(index):
    from typer.testing import CliRunner

    from rag_kvcache.cli import app

    index.store.path(index.addressing.own_key(next(index.chunks.all_chunks()).token_ids)).unlink()
    vectors = index.path / "vectors.faiss"
    damaged = bytearray(vectors.read_bytes())
    damaged[-5] ^= 0xFF
    vectors.write_bytes(bytes(damaged))
    found = CliRunner().invoke(app, ["check", "--index", str(index.path)])
    output = " ".join(found.output.split())
    assert found.exit_code == 1 and "1 not made" in output and "vectors.faiss does not match the checksum" in output
    assert vectors.read_bytes() == damaged  # a check without --repair changes nothing
    fixed = CliRunner().invoke(app, ["check", "--index", str(index.path), "--repair"])
    assert fixed.exit_code == 0, fixed.output
    assert "0 KV caches recomputed" in " ".join(fixed.output.split())  # the deleted cache waits for a question
    assert CliRunner().invoke(app, ["check", "--index", str(index.path)]).exit_code == 0
