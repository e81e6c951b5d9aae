"""The loading controller: the paper's ratio rule, the tier choice, calibration, and the CLI
(`calibrate`, `ask --ratio auto`, `stats`) on a tiny Llama saved to disk."""

from __future__ import annotations

import json

import pytest
from tiny_model import tiny_llama
from typer.testing import CliRunner

from rag_kvcache.cli import app
from rag_kvcache.config import Config, FusionConfig, IndexSettings, RuntimeConfig
from rag_kvcache.index import KVIndex
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.store.controller import (
    Calibration,
    NotCalibratedError,
    calibrate,
    choose_ratio,
    choose_tier,
    load_calibration,
    resolve_ratio,
)

runner = CliRunner()


def calibration(disk_bytes_per_s: float) -> Calibration:
    return Calibration(
        machine="m",
        model_fingerprint="f",
        codec="none",
        bytes_per_token_layer=1000.0,
        read_bytes_per_s={"memory": 1e12, "page_cache": 1e10, "disk": disk_bytes_per_s},
        prefill_s_per_token_layer=1e-6,
        measured_at="now",
    )


def test_ratio_is_the_floor_when_loading_is_fast():
    d = choose_ratio(calibration(1e10), "disk", n_tokens=1000)  # load 0.1 ms, full recompute 1 ms per layer
    assert d.ratio == 0.15 and d.balanced_ratio == pytest.approx(0.1) and not d.adds_delay
    assert "quality floor" in d.explain()


def test_ratio_grows_until_recompute_hides_slow_loading():
    d = choose_ratio(calibration(2.5e9), "disk", n_tokens=1000)  # load 0.4 ms: recompute 40% hides it
    assert d.ratio == pytest.approx(0.4) and d.load_s == pytest.approx(d.recompute_s)
    assert choose_ratio(calibration(1e8), "disk", n_tokens=1000).ratio == 1.0  # capped
    assert choose_ratio(calibration(2.5e9), "disk", 9).ratio == pytest.approx(0.4)  # L cancels


def test_cheapest_tier_that_adds_no_delay():
    assert choose_tier(calibration(1e10), 0.15, 1000).tier == "disk"
    slow_disk = choose_tier(calibration(1e8), 0.15, 1000)
    assert slow_disk.tier == "memory" and not slow_disk.adds_delay
    with pytest.raises(ValueError, match="'tape'"):
        calibration(1e9).load_s("tape", 10)


def test_calibrate_saves_what_resolve_ratio_uses(tiny, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The main telescope of the Veldmark Observatory is named Harrow's Eye. " * 4)
    cfg = Config(index=IndexSettings(chunk_tokens=32), runtime=RuntimeConfig(cache_dir=tmp_path / "cache")).with_index(
        codec="none"
    )
    index = KVIndex.build(docs, tmp_path / "idx", cfg, adapter=tiny, progress=False)
    auto = index.config.with_fusion(ratio="auto")
    assert resolve_ratio(index.config, index.adapter) == (index.config, None)  # a number is kept
    with pytest.raises(NotCalibratedError, match="rag-kvcache calibrate"):
        resolve_ratio(auto, index.adapter)
    cal = calibrate(tiny, tmp_path / "idx", cfg.index.codec, cfg.runtime.cache_dir, n_tokens=32, entries=2, repeats=1)
    assert set(cal.read_bytes_per_s) == {"memory", "page_cache", "disk"} and cal.prefill_s_per_token_layer > 0
    layout = tiny.layout
    assert cal.bytes_per_token_layer > 2 * layout.n_kv_heads * layout.head_dim * layout.dtype.itemsize  # + header
    assert load_calibration(cfg.runtime.cache_dir, tiny, "none") == cal
    resolved, decision = resolve_ratio(auto, index.adapter)
    assert (
        resolved.query.fusion.ratio == decision.ratio >= 0.15
        and decision.n_tokens == cfg.query.top_k * cfg.index.chunk_tokens
    )
    assert not list((tmp_path / "idx" / ".calibration-store").rglob("*.safetensors"))  # cleaned up
    q = "What is the telescope called?"
    by_number = FusedGenerator(index).ask(q, fusion=FusionConfig(ratio=decision.ratio))
    by_auto = FusedGenerator(index).ask(q, fusion=auto.query.fusion)  # the generator resolves `auto` the same way
    assert by_auto.recomputed_tokens == by_number.recomputed_tokens and by_auto.answer == by_number.answer


def test_cli_calibrate_ask_auto_and_stats(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("RAG_KVCACHE_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    tiny_llama().save_pretrained(model)
    tokenizer.save_pretrained(model)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The main telescope of the Veldmark Observatory is named Harrow's Eye. " * 12)
    idx = str(tmp_path / "idx")
    result = runner.invoke(
        app,
        [
            "index",
            str(docs),
            "--index",
            idx,
            "--chunk-tokens",
            "128",
            "--model",
            str(model),
            "--kv-codec",
            "int8-channel",
        ],
    )
    assert result.exit_code == 0, result.output
    ask = ["ask", "What is the telescope called?", "--index", idx, "--json", "--max-new-tokens", "2", "--top-k", "1"]
    result = runner.invoke(app, [*ask, "--ratio", "auto"])
    assert result.exit_code == 2 and "calibrate" in result.output
    result = runner.invoke(app, ["calibrate", "--index", idx, "--tokens", "32"])
    assert result.exit_code == 0, result.output
    assert "ratio auto" in result.output and "page_cache" in result.output
    result = runner.invoke(app, [*ask, "--ratio", "auto"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["controller"]["ratio"] >= 0.15 and out["controller"]["tier"] == "disk"
    assert runner.invoke(app, [*ask, "--ratio", "1.5"]).exit_code == 2
    result = runner.invoke(app, ["stats", "--index", idx])
    assert result.exit_code == 0, result.output
    assert "disk" in result.output and "memory" in result.output and "codec int8-channel" in result.output
