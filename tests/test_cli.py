"""The `rag-kvcache` command on a tiny random Llama saved to disk (loaded like any local model)."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_llama
from typer.testing import CliRunner

from rag_kvcache.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_llama().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("cli")
    docs = root / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The main telescope of the Veldmark Observatory is named Harrow's Eye. " * 12)
    (docs / "b.txt").write_text("Saltmere is a mill village on the river Anvel with a bakery. " * 12)
    (docs / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (docs / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    result = runner.invoke(app, ["index", str(docs), "--index", str(root / "idx"), "--chunk-tokens", "128",
                                 "--model", str(model_dir)])
    assert result.exit_code == 0, result.output
    return root, result.output


def test_index_reports_and_skips(built):
    _, output = built
    assert "2 added" in output and "2 skipped" in output


def test_ask_json(built, model_dir):
    root, _ = built
    result = runner.invoke(app, ["ask", "What is the telescope called?", "--index", str(root / "idx"),
                                 "--json", "--max-new-tokens", "4", "--top-k", "2"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    for key in ("answer", "method", "ttft_s", "retrieval_s", "prompt_tokens", "recomputed_tokens", "chunks"):
        assert key in out
    assert out["method"] == "cacheblend" and out["chunks"][0]["source"] == "a.txt"
    assert set(out["chunks"][0]) == {"id", "source", "score"}


def test_ask_text_and_methods(built):
    root, _ = built
    for method in ("full", "prefix", "reuse", "epic"):
        result = runner.invoke(app, ["ask", "Saltmere?", "--index", str(root / "idx"), "--method", method,
                                     "--max-new-tokens", "3"])
        assert result.exit_code == 0, result.output
        assert f"{method}: ttft" in result.output


def test_ask_cacheblend_knobs(built):
    root, _ = built
    base = ["ask", "What is the telescope called?", "--index", str(root / "idx"), "--json", "--max-new-tokens", "2",
            "--top-k", "2", "--ratio", "0.2"]
    one_step = runner.invoke(app, base)
    gradual = runner.invoke(app, [*base, "--filter-steps", "3", "--deviation", "v"])
    assert one_step.exit_code == 0 and gradual.exit_code == 0, gradual.output
    # gradual filtering starts wider and ends at --ratio: the same number of tokens reach the last layer
    assert json.loads(gradual.stdout)["recomputed_tokens"] == json.loads(one_step.stdout)["recomputed_tokens"]
    result = runner.invoke(app, [*base, "--check-layer", "2", "--filter-steps", "3"])
    assert result.exit_code == 2 and "beyond the model's 4 layers" in " ".join(result.output.split())


@pytest.mark.parametrize("args,message", [
    (["ask", "  ", "--index", "IDX"], "the question is empty"),
    (["ask", "q", "--index", "MISSING"], "not found"),
    (["index", "MISSING", "--index", "IDX"], "MISSING"),
])
def test_bad_input_is_a_clear_error(built, tmp_path, args, message):
    root, _ = built
    args = [str(root / "idx") if a == "IDX" else str(tmp_path / "missing") if a == "MISSING" else a for a in args]
    message = str(tmp_path / "missing") if message == "MISSING" else message
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())  # rich may wrap long lines


def test_foreign_index_is_refused(tmp_path):
    (tmp_path / "index.sqlite").write_text("hello")
    result = runner.invoke(app, ["ask", "q", "--index", str(tmp_path)])
    assert result.exit_code == 2 and "error" in result.output
