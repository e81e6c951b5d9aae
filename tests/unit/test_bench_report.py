"""Tests for rag_kvcache.bench.report: labels, Markdown table, Pareto plot and the report bundle."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rag_kvcache.bench.report import label, markdown_table, render_pareto, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _entry(method: str, params: dict, ttft: float, tf_kl: float | None, **overrides) -> dict:
    entry = {
        "method": method,
        "params": params,
        "ttft_median_s": ttft,
        "speedup_vs_full": 0.8 / ttft,
        "compute_fraction": params.get("r"),
        "tf_kl": tf_kl,
        "tf_kl_ci": None if tf_kl is None else [tf_kl / 2, tf_kl * 2],
        "tf_kl_diff": None,
        "tf_top1": 0.9,
        "tf_logp_delta": -0.05,
        "first_token_kl": 0.05,
        "f1_gold": 0.4,
        "f1_vs_full": 0.7,
    }
    return entry | overrides


@pytest.fixture
def summary() -> list[dict]:
    return [
        _entry("full", {}, 0.8, 0.0, compute_fraction=1.0, first_token_kl=0.0),
        _entry("naive", {}, 0.1, 0.2, compute_fraction=0.0),
        *(_entry("cacheblend", {"r": r}, 0.1 + r, 0.1 - r / 10, tf_kl_diff=-r) for r in (0.3, 0.05, 0.15)),
        *(_entry("epic", {"k": k}, 0.1 + k / 200, 0.1 - k / 1000, first_token_kl=None) for k in (4, 16)),
        {
            "method": "full",
            "params": {"kv": "bfloat16"},
            "noise_floor": True,
            "tf_kl": 2e-5,
            "tf_kl_ci": [1e-5, 3e-5],
            "tf_top1": 1.0,
            "tf_logp_delta": 0.0,
            "first_token_kl": 1e-5,
        },
    ]


def test_label():
    assert label({"method": "full", "params": {}}) == "full"
    assert label({"method": "cacheblend", "params": {"r": 0.15}}) == "cacheblend r=0.15"
    assert label({"method": "epic", "params": {"k": 16}}) == "epic k=16"
    assert label({"method": "m", "params": {"r": 0.1, "layer": 1}}) == "m r=0.1 layer=1"


def test_markdown_table_rows_and_formatting(summary):
    table = markdown_table(summary)
    lines = table.strip().split("\n")
    assert len(lines) == 2 + len(summary)  # header, separator, one row per entry
    assert all(line.startswith("| ") and line.endswith(" |") for line in lines)
    assert len({line.count("|") for line in lines}) == 1
    full = lines[2].split(" | ")
    assert full[0] == "| full"
    assert full[1:5] == ["0.800", "1.0x", "1.000", "0.00 [0.00, 0.00]"]  # 3 s.f. seconds, speedup "N.Nx"
    cb = next(line for line in lines if line.startswith("| cacheblend r=0.15 |"))
    assert "| 0.250 | 3.2x | 0.150 | 0.0850 [0.0425, 0.170] | -0.15 |" in cb  # ttft 0.1 + 0.15; 0.8 / 0.25 = 3.2
    epic = next(line for line in lines if line.startswith("| epic k=4 |"))
    assert "| – |" in epic  # missing first-token KL
    floor = next(line for line in lines if line.startswith("| full kv=bfloat16 |"))
    assert "| 2.00e-05 [1.00e-05, 3.00e-05] |" in floor and "Planted acc" not in lines[0]
    planted = markdown_table([summary[0] | {"planted_accuracy": 0.5, "planted_accuracy_ci": [0.25, 0.75]}])
    assert "Planted acc" in planted and "| 0.50 [0.25, 0.75] |" in planted


def test_markdown_table_rejects_incomplete_entries(summary):
    del summary[1]["tf_kl"]
    with pytest.raises(ValueError, match=r"missing \['tf_kl'\]"):
        markdown_table(summary)


def test_render_pareto_makes_a_png(summary):
    assert render_pareto(summary).startswith(PNG_MAGIC)


def _png_width(png: bytes) -> int:
    return int.from_bytes(png[16:20], "big")


def test_render_pareto_adds_a_planted_panel_when_there_is_planted_accuracy(summary):
    both = render_pareto([e | {"planted_accuracy": 0.8} for e in summary])
    assert _png_width(both) == 2 * _png_width(render_pareto(summary))


def test_render_pareto_skips_entries_without_quality(summary, caplog):
    summary[1]["tf_kl"] = None
    render_pareto(summary)
    assert "not plotting 'naive'" in caplog.text


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"ttft_median_s": 0.0}, "must be > 0"),
        ({"tf_kl": None}, "nothing to plot"),
    ],
)
def test_render_pareto_errors(override, match):
    with pytest.raises(ValueError, match=match):
        render_pareto([_entry("full", {}, 0.8, 1.0) | override])


def test_write_report(tmp_path, summary):
    records = [{"id": "q0", "method": "full", "ttft_s": np.float32(0.5), "answer": "Paris"}]
    meta = {"model": "SmolLM2-135M", "questions": 100}
    out = write_report(summary, records, tmp_path / "run", meta)
    assert sorted(p.name for p in out.iterdir()) == ["pareto.png", "results.json", "results.md"]

    data = json.loads((out / "results.json").read_text())
    assert data["meta"] == meta and data["summary"] == summary
    assert data["records"][0]["ttft_s"] == pytest.approx(0.5)

    md = (out / "results.md").read_text()
    assert "- **model**: SmolLM2-135M" in md and "![pareto](pareto.png)" in md
    assert sum(line.startswith("| ") for line in md.splitlines()) == 2 + len(summary)
    assert (out / "pareto.png").read_bytes().startswith(PNG_MAGIC)


def test_write_report_writes_nothing_on_bad_input(tmp_path, summary):
    with pytest.raises(ValueError, match="NaN or inf"):
        write_report(summary, [{"ttft_s": float("nan")}], tmp_path / "run", {})
    with pytest.raises(TypeError, match="not JSON serialisable: object"):
        write_report(summary, [{"x": object()}], tmp_path / "run", {})
    assert not (tmp_path / "run").exists()
