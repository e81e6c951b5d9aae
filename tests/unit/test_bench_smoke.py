"""`rag-kvcache bench` end to end on a tiny synthetic set (tiny random-weight Llama), and the runner's
pieces: the variant plan, the slot rotation, the paired summary."""

from __future__ import annotations

import json

import pytest
from synthetic import synthetic_multihop
from typer.testing import CliRunner

from rag_kvcache.bench import runner
from rag_kvcache.bench.corpus import distractors_in, place_evidence
from rag_kvcache.bench.datasets import write_jsonl
from rag_kvcache.bench.fidelity import FIDELITY_KEYS
from rag_kvcache.bench.report import METRIC_KEYS, label, markdown_table
from rag_kvcache.bench.runner import PLAN_FILE as PLAN
from rag_kvcache.bench.summary import summarise
from rag_kvcache.bench.variants import (
    NOISE_FLOOR,
    BenchSettings,
    Variant,
    made_with,
    parse_methods,
    parse_variant,
    plan,
    rotated,
)
from rag_kvcache.cli import app
from rag_kvcache.config import Config, FusionConfig, IndexSettings, QueryConfig
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.store.controller import calibrate


@pytest.fixture(scope="module")
def bench_out(tiny, tmp_path_factory):
    """Run the CLI's `bench --sweep` on 3 synthetic questions with the tiny Llama standing in for SmolLM2."""
    root = tmp_path_factory.mktemp("bench")
    write_jsonl(synthetic_multihop(3), root / "synthetic.jsonl")
    args = [
        "bench",
        "--dataset",
        str(root / "synthetic.jsonl"),
        "--sweep",
        "--out",
        str(root / "out"),
        "--top-k",
        "3",
        "--chunk-tokens",
        "128",
        "--max-new-tokens",
        "4",
        "--kv-codec",
        "none",
    ]  # lossless caches: the exact methods score exactly
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelAdapter, "load", classmethod(lambda cls, config: tiny))
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "| Method |" in result.output
    return root / "out"


def test_bench_writes_every_record_summary_and_plot(bench_out):
    results = json.loads((bench_out / "results.json").read_text())
    variants = [v.label for v in plan(BenchSettings(sweep=True), FusionConfig().for_chunks(128), Config())]
    *entries, floor = results["summary"]
    assert [Variant(e["method"], tuple(e["params"].items())).label for e in entries] == variants
    assert (floor["method"], floor["params"], floor["noise_floor"], floor["n"]) == ("full", NOISE_FLOOR, True, 3)
    assert len(results["records"]) == 3 * len(variants)
    assert len((bench_out / "records.jsonl").read_text().splitlines()) == len(results["records"])
    for entry in entries:
        assert set(METRIC_KEYS) <= set(entry) and entry["n"] == 3 and entry["baseline"] == "cacheblend r=0.15"
        assert {"kv_load", runner.OTHER_STAGE} <= set(entry["stage_median_s"])
    for entry in results["summary"]:
        for key in FIDELITY_KEYS:
            low, high = entry[f"{key}_ci"]
            assert low <= entry[key] <= high and entry[f"{key}_diff_ci"] is not None
    assert "TF KL" in (bench_out / "results.md").read_text()
    meta = results["meta"]
    assert meta["questions_done"] == 3 and meta["indexing"]["tokens"] > 0
    assert 0 < meta["indexing"]["fraction_of_forward"]
    before, after = meta["indexing"]["forward_tokens_per_s_before_after"]  # the yardstick brackets the indexing
    assert before > 0 and after > 0 and meta["indexing"]["forward_tokens_per_s"] == pytest.approx((before + after) / 2)
    assert (bench_out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![pareto](pareto.png)" in (bench_out / "results.md").read_text()


def test_exact_methods_match_full(bench_out):
    """`full` against itself and the exact `prefix` must score perfectly: the metric plumbing is paired right."""
    summary = {
        (e["method"], tuple(e["params"].items())): e
        for e in json.loads((bench_out / "results.json").read_text())["summary"]
    }
    for key in [("full", ()), ("prefix", ())]:
        entry = summary[key]
        assert entry["f1_vs_full"] == 1.0 and entry["tf_top1"] == 1.0
        assert entry["tf_kl"] == pytest.approx(0.0, abs=1e-6) and entry["first_token_kl"] == pytest.approx(
            0.0, abs=1e-6
        )
        assert entry["tf_logp_delta"] == pytest.approx(0.0, abs=1e-5)
    floor, reuse, blend = (
        summary[("full", (("kv", "bfloat16"),))],
        summary[("reuse", ())],
        summary[("cacheblend", (("r", 0.15),))],
    )
    assert 0 < floor["tf_kl"] < reuse["tf_kl"]  # rounding to bfloat16 perturbs, far less than reusing caches
    assert blend["tf_kl_diff"] == 0.0 and reuse["tf_kl_diff"] == pytest.approx(reuse["tf_kl"] - blend["tf_kl"])
    assert summary[("full", ())]["recompute_fraction"] == 1.0
    assert summary[("reuse", ())]["recompute_fraction"] < summary[("cacheblend", (("r", 0.5),))]["recompute_fraction"]


def test_plan_puts_defaults_first_and_dedupes_the_sweep():
    labels = [v.label for v in plan(BenchSettings(sweep=True), FusionConfig(ratio=0.15, epic_k=16), Config())]
    assert labels[:6] == ["full", "prefix", "reuse", "cacheblend r=0.15", "epic k=16", "epic_match k=16"]
    assert labels[6:] == [
        "cacheblend r=0.05",
        "cacheblend r=0.1",
        "cacheblend r=0.25",
        "cacheblend r=0.5",
        "epic k=0",
        "epic k=4",
        "epic k=32",
    ]
    only = BenchSettings(methods=("full", "reuse"), baseline="reuse")
    assert [v.label for v in plan(only, FusionConfig(), Config())] == ["full", "reuse"]


def test_plan_reads_the_caches_a_method_runs_on():
    """`method@caches` names another index's caches (a chunk_prefill or a codec); the run's own (the default
    cached_neighbours caches, int8k-int4v) are unwritten."""
    settings = BenchSettings(
        methods=(
            "full",
            "cacheblend",
            "reuse@neighbours",
            "cacheblend@cached_neighbours",
            "cacheblend@neighbours",
            "cacheblend@none",
            "cacheblend@int8k-int4v",
        ),
        baseline="cacheblend@neighbours",
    )
    variants = plan(settings, FusionConfig(ratio=0.15), Config())
    assert [v.label for v in variants] == [
        "full",
        "cacheblend r=0.15",
        "reuse@neighbours",
        "cacheblend@neighbours r=0.15",
        "cacheblend@none r=0.15",
    ]  # int8k-int4v: the run's own (the default)
    assert variants[2] == Variant("reuse", caches="neighbours")
    assert made_with(Config(), "none").index.codec == "none"
    assert made_with(Config(), "neighbours").index.chunk_prefill == "neighbours"
    with pytest.raises(ValueError, match="unknown chunk caches 'nearby'"):
        plan(BenchSettings(methods=("full", "reuse@nearby"), baseline="full"), FusionConfig(), Config())


def test_bench_over_a_folder_of_ones_own_documents(tiny, tmp_path):
    """`bench --dataset FOLDER --questions FILE`: the questions answered over the folder's files by every
    method, scored by fidelity to full (no reference answers: no F1 against them), with the TTFT-against-
    fidelity plot."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, example in enumerate(synthetic_multihop(2)):
        (docs / f"doc{i}.txt").write_text("\n".join(d.text for d in example.documents), encoding="utf-8")
    (tmp_path / "q.txt").write_text("\n".join(e.question for e in synthetic_multihop(2)) + "\n", encoding="utf-8")
    args = [
        "bench",
        "--dataset",
        str(docs),
        "--questions",
        str(tmp_path / "q.txt"),
        "--methods",
        "full,reuse,cacheblend",
        "--out",
        str(tmp_path / "out"),
        "--top-k",
        "2",
        "--chunk-tokens",
        "32",
        "--max-new-tokens",
        "4",
        "--warmup",
        "0",
        "--kv-codec",
        "none",
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelAdapter, "load", classmethod(lambda cls, config: tiny))
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    records = json.loads((tmp_path / "out" / "results.json").read_text())["records"]
    assert len(records) == 2 * 3 and {r["gold"] == [] and r["f1_gold"] is None for r in records} == {True}
    assert [r["tf_kl"] for r in records if r["method"] == "full"] == [pytest.approx(0.0, abs=1e-6)] * 2
    assert (tmp_path / "out" / "pareto.png").is_file()


def test_bench_runs_methods_on_neighbour_caches_beside_the_default_ones(tiny, tmp_path):
    """One run, two indexes over one corpus: `reuse@neighbours` answers from the context-aware caches (a
    different cache, so a different fidelity), `full@neighbours` is still exact, and both are paired with
    the default-cache baseline question by question."""
    config = Config(index=IndexSettings(chunk_tokens=24), query=QueryConfig(top_k=3))
    settings = BenchSettings(
        methods=("full", "reuse", "full@neighbours", "reuse@neighbours"), baseline="reuse", warmup=0
    )
    result = runner.run_benchmark(synthetic_multihop(2), tmp_path, config, settings, adapter=tiny, progress=False)
    summary = {label(e): e for e in result.summary if not e.get("noise_floor")}
    assert list(summary) == ["full", "reuse", "full@neighbours", "reuse@neighbours"]
    assert summary["full@neighbours"]["tf_kl"] == pytest.approx(0.0, abs=1e-6)
    assert summary["reuse@neighbours"]["caches"] == "neighbours" and summary["reuse"]["caches"] is None
    assert summary["reuse@neighbours"]["tf_kl"] != pytest.approx(summary["reuse"]["tf_kl"], rel=1e-3)
    assert summary["reuse@neighbours"]["tf_kl_diff"] == pytest.approx(
        summary["reuse@neighbours"]["tf_kl"] - summary["reuse"]["tf_kl"]
    )
    assert (tmp_path / "work" / "index-neighbours" / "neighbours.sqlite").is_file()
    assert result.meta["indexing_neighbours"]["chunks"] == result.meta["indexing"]["chunks"]


def test_variant_maps_short_params_onto_fusion_config():
    fusion = Variant("cacheblend", (("r", 0.05),)).fusion(FusionConfig(check_layer=2))
    assert (fusion.method, fusion.ratio, fusion.check_layer) == ("cacheblend", 0.05, 2)
    assert Variant("epic", (("k", 4),)).fusion(FusionConfig()).epic_k == 4


def test_rotation_puts_every_variant_in_every_slot_once():
    variants = [Variant(m) for m in ("full", "prefix", "reuse")]
    slots = {v: {rotated(variants, i).index(v) for i in range(3)} for v in variants}
    assert all(s == {0, 1, 2} for s in slots.values())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"methods": ("prefix", "reuse")}, "must include 'full'"),
        ({"methods": ("full", "full")}, "must not repeat"),
        ({"threads": 0}, "threads must be >= 1"),
        ({"warmup": -1}, "warmup must be >= 0"),
        ({"methods": ("full", "reuse")}, "baseline 'cacheblend' is not among the methods"),
        ({"evidence": "first"}, "unknown evidence place 'first'"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchSettings(**kwargs)


def test_bad_variant_is_refused():
    with pytest.raises(ValueError, match="unknown fusion method 'nope'"):
        Variant("nope")
    with pytest.raises(ValueError, match=r"unknown variant parameters \['z'\]"):
        Variant("epic", (("z", 1),))


def _rec(qid: str, label: str, ttft: float, f1: float, kl: float, hit: bool | None = None) -> dict:
    method, _, param = label.partition(" ")
    params = {param.split("=")[0]: float(param.split("=")[1])} if param else {}
    return {
        "id": qid,
        "method": method,
        "params": params,
        "label": label,
        "ttft_s": ttft,
        "retrieval_s": 0.01,
        "prompt_tokens": 100,
        "f1_gold": f1,
        "f1_vs_full": f1,
        "rouge_l_gold": None,
        "exact_hit": hit,
        "tf_kl": kl,
        "tf_top1": 1.0 - kl,
        "tf_logp_delta": -kl,
        "first_token_kl": kl / 2,
        "recompute_fraction": 0.1,
        "compute_fraction": 0.2,
        "stages": {"kv_load": ttft / 2},
    }


def test_summary_speedup_is_the_median_of_paired_ratios():
    """Hand-computed: full 4, 8, 10 s; cacheblend 1, 1, 5 s -> ratios 4, 8, 2 -> median 4 (not 22/7)."""
    variants = [Variant("full"), Variant("cacheblend", (("r", 0.15),))]
    records = [
        _rec("a", "full", 4.0, 1.0, 0.0),
        _rec("a", "cacheblend r=0.15", 1.0, 1.0, 0.1),
        _rec("b", "full", 8.0, 1.0, 0.0),
        _rec("b", "cacheblend r=0.15", 1.0, 0.5, 0.2),
        _rec("c", "full", 10.0, 1.0, 0.0),
        _rec("c", "cacheblend r=0.15", 5.0, 0.0, 0.6),
    ]
    full, blend = summarise(records, variants, baseline=variants[0])
    assert full["speedup_vs_full"] == 1.0
    assert blend["speedup_vs_full"] == 4.0
    assert blend["ttft_median_s"] == 1.0 and blend["ttft_p90_s"] == pytest.approx(4.2)
    assert (
        blend["f1_vs_full"] == 0.5 and blend["tf_kl"] == pytest.approx(0.3) and blend["tf_top1"] == pytest.approx(0.7)
    )
    assert blend["tf_kl_diff"] == pytest.approx(0.3) and full["tf_kl_diff"] == 0.0 and blend["baseline"] == "full"
    assert 0.1 <= blend["tf_kl_ci"][0] < 0.3 < blend["tf_kl_ci"][1] <= 0.6
    assert blend["rouge_l_gold"] is None and blend["stage_median_s"] == {"kv_load": 0.5}
    assert "planted_accuracy" not in blend


def test_summary_ttft_over_share_pairs_each_question_with_fulls():
    """Hand-computed: cacheblend's TTFT over (its compute fraction x full's TTFT) per question, then the median:
    1 / (0.2 x 4) = 1.25, 1 / (0.2 x 8) = 0.625, 5 / (0.2 x 10) = 2.5 -> 1.25; full's is 1 by definition."""
    variants = [Variant("full"), Variant("cacheblend", (("r", 0.15),))]
    records = [
        _rec("a", "full", 4.0, 1.0, 0.0) | {"compute_fraction": 1.0},
        _rec("a", "cacheblend r=0.15", 1.0, 1.0, 0.1),
        _rec("b", "full", 8.0, 1.0, 0.0) | {"compute_fraction": 1.0},
        _rec("b", "cacheblend r=0.15", 1.0, 0.5, 0.2),
        _rec("c", "full", 10.0, 1.0, 0.0) | {"compute_fraction": 1.0},
        _rec("c", "cacheblend r=0.15", 5.0, 0.0, 0.6),
    ]
    full, blend = summarise(records, variants)
    assert full["ttft_over_share"] == 1.0 and blend["ttft_over_share"] == pytest.approx(1.25)
    records[1] |= {"compute_fraction": 0.0}  # a method that computes nothing has no share to compare with
    assert summarise(records, variants)[1]["ttft_over_share"] is None


def test_planted_accuracy_counts_only_what_full_gets_right():
    variants = [Variant("full"), Variant("reuse")]
    hits = {"a": (True, True), "b": (True, False), "c": (False, True), "d": (True, False)}
    records = [
        _rec(q, label, 1.0, 1.0, 0.0, hit) for q, pair in hits.items() for label, hit in zip(("full", "reuse"), pair)
    ]
    full, reuse = summarise(records, variants)
    assert (full["planted_accuracy"], full["planted_n"], full["exact_accuracy"]) == (1.0, 3, 0.75)
    assert (reuse["planted_accuracy"], reuse["planted_n"], reuse["exact_accuracy"]) == (pytest.approx(1 / 3), 3, 0.5)
    assert "tf_kl_diff" not in reuse  # no baseline given


def test_planted_distractor_counts_facts_answered_with_another_questions_fact():
    """Of the three facts full answers, reuse misses two: one with another question's fact from the prompt."""
    variants = [Variant("full"), Variant("reuse")]
    hits = {"a": (True, True), "b": (True, False), "c": (False, True), "d": (True, False)}
    taken = {("reuse", "b")}  # reuse answered b with a distractor; d with something else
    records = [
        _rec(q, label, 1.0, 1.0, 0.0, hit) | {"distractor_hit": (label, q) in taken}
        for q, pair in hits.items()
        for label, hit in zip(("full", "reuse"), pair)
    ]
    full, reuse = summarise(records, variants)
    assert full["planted_distractor"] == 0.0 and reuse["planted_distractor"] == pytest.approx(1 / 3)
    assert "Planted: distractor" in markdown_table([full, reuse])


def test_noise_floor_row_comes_from_full_records():
    records = [_rec("a", "full", 1.0, 1.0, 0.0) | {"noise_floor": dict.fromkeys(FIDELITY_KEYS, 0.01)}]
    _, floor = summarise(records, [Variant("full")], baseline=Variant("full"))
    assert floor["params"] == NOISE_FLOOR and floor["tf_kl"] == 0.01 and floor["tf_kl_diff"] == pytest.approx(0.01)
    assert "ttft_median_s" not in floor


def test_methods_all_is_every_registered_method():
    from rag_kvcache.engine.methods import METHODS

    assert parse_methods("all") == tuple(METHODS)
    assert parse_methods(" full, reuse ,") == ("full", "reuse")


def test_planted_chunk_is_moved_to_its_rank():
    from types import SimpleNamespace

    from rag_kvcache.bench.datasets import Document, QAExample

    hits = [SimpleNamespace(chunk=SimpleNamespace(text=t)) for t in ("fact: Zorvane Kel.", "a", "b", "c")]
    ex = QAExample("q", "who?", ("Zorvane Kel",), (Document("", "x"),), task="exact", evidence_rank=2)
    placed, found = place_evidence(hits, ex)
    assert found == 0 and [h.chunk.text for h in placed] == ["a", "b", "fact: Zorvane Kel.", "c"]
    missing = QAExample("q", "who?", ("Nobody Here",), (Document("", "x"),), task="exact", evidence_rank=1)
    assert place_evidence(hits, missing) == (hits, None)
    with pytest.raises(ValueError, match="evidence_rank 5 is beyond the 4 retrieved"):
        place_evidence(hits, QAExample("q", "who?", ("a",), (Document("", "x"),), task="exact", evidence_rank=5))
    assert place_evidence(hits, ex, move=False) == (hits, 0)  # left where retrieval ranked it
    far = QAExample("q", "who?", ("Zorvane Kel",), (Document("", "x"),), task="exact", evidence_rank=5)
    assert place_evidence(hits, far, move=False) == (hits, 0)  # a drawn rank not used is not checked


def test_planted_facts_sit_where_the_run_says(tiny, tmp_path):
    """Each question's fact is made the text of its third retrieved chunk. `retrieved`: the prompt's chunks in
    the default order, best last, the fact first; `placed`: the same chunks with the fact's moved to its drawn
    place (second). The setting is part of the run's plan."""
    from dataclasses import replace

    from rag_kvcache.bench.corpus import build_index

    config = Config(index=IndexSettings(chunk_tokens=24, codec="none"), query=QueryConfig(top_k=3))
    examples = [replace(ex, task="exact", evidence_rank=1) for ex in synthetic_multihop(2)]
    index, _ = build_index(examples, tmp_path / "retrieved" / "work", config, tiny, False)
    try:
        ranked = {ex.id: [h.chunk for h in index.search(ex.question, 3)] for ex in examples}
    finally:
        index.close()
    examples = [replace(ex, answers=(ranked[ex.id][2].text,)) for ex in examples]
    (tmp_path / "placed").mkdir()
    (tmp_path / "placed" / "work").symlink_to(tmp_path / "retrieved" / "work")  # the same index
    records = {}
    for evidence in ("retrieved", "placed"):
        settings = BenchSettings(methods=("full", "reuse"), baseline="reuse", warmup=0, evidence=evidence)
        result = runner.run_benchmark(examples, tmp_path / evidence, config, settings, adapter=tiny, progress=False)
        records[evidence] = {r["id"]: r for r in result.records if r["method"] == "full"}
        assert json.loads((tmp_path / evidence / PLAN).read_text())["evidence"] == evidence
    for ex in examples:
        order = [c.id for c in ranked[ex.id]]
        retrieved, placed = records["retrieved"][ex.id], records["placed"][ex.id]
        assert (retrieved["evidence_retrieved_rank"], retrieved["evidence_rank"]) == (2, 0)
        assert retrieved["chunks"] == order[::-1]
        assert (placed["evidence_retrieved_rank"], placed["evidence_rank"]) == (2, 1)
        assert placed["chunks"] == [order[1], order[2], order[0]]


def test_planted_accuracy_is_split_by_the_facts_place():
    """Facts left where retrieval ranked them: the accuracy of those read first (exactly) and of the later
    ones beside the overall one; facts all placed later have no split."""
    variants = [Variant("full"), Variant("reuse")]
    places = {"a": (0, True), "b": (0, True), "c": (2, False), "d": (3, True), "e": (None, False)}  # rank, reuse's hit
    records = [
        _rec(q, label, 1.0, 1.0, 0.0, hit) | {"evidence_rank": rank}
        for q, (rank, kept) in places.items()
        for label, hit in (("full", True), ("reuse", kept))
    ]
    _, reuse = summarise(records, variants)
    assert (reuse["planted_accuracy_first"], reuse["planted_n_first"]) == (1.0, 2)
    assert (reuse["planted_accuracy_later"], reuse["planted_n_later"]) == (0.5, 2)
    assert reuse["planted_n"] == 5 and "Planted acc: fact first" in markdown_table([reuse])
    later_only = [r | {"evidence_rank": 1} for r in records]
    assert "planted_accuracy_first" not in summarise(later_only, variants)[1]


def test_distractors_are_other_questions_facts_the_prompt_holds():
    from types import SimpleNamespace

    from rag_kvcache.bench.datasets import Document, QAExample

    hits = [
        SimpleNamespace(chunk=SimpleNamespace(text=t))
        for t in ("lists chester under 71429.", "lists hannibal under 48677.")
    ]
    ex = QAExample("q", "chester?", ("71429",), (Document("", "x"),), task="exact", evidence_rank=1)
    assert distractors_in(hits, ex, frozenset({"71429", "48677", "Koutre"})) == ["48677"]  # not its own, not absent
    assert distractors_in(hits, ex, frozenset()) == []


def test_stage_table_orders_stages_and_marks_missing():
    from rag_kvcache.bench.report import stage_table

    def entry(method: str, stages: dict) -> dict:
        return {"method": method, "params": {}, **dict.fromkeys(METRIC_KEYS, 1.0), "stage_median_s": stages}

    full = entry("full", {"prefill": 2.0, "kv_load": 0.001}) | {"ttft_over_share": 1.0}
    table = stage_table([full, entry("reuse", {"mlp": 0.0125, "kv_load": 0.5})])
    assert table.splitlines() == [
        "| Method | TTFT median (ms) | TTFT / share of full's | kv_load (ms) | mlp (ms) | prefill (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        "| full | 1000 | 1.000 | 1 | – | 2000 |",
        "| reuse | 1000 | – | 500 | 12 | – |",
    ]


def test_bench_ratio_auto_uses_the_loading_controller(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_KVCACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ModelAdapter, "load", classmethod(lambda cls, config: tiny))
    write_jsonl(synthetic_multihop(2), tmp_path / "synthetic.jsonl")
    args = [
        "bench",
        "--dataset",
        str(tmp_path / "synthetic.jsonl"),
        "--out",
        str(tmp_path / "out"),
        "--top-k",
        "2",
        "--chunk-tokens",
        "128",
        "--max-new-tokens",
        "2",
        "--methods",
        "full,cacheblend",
        "--ratio",
        "auto",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "rag-kvcache calibrate" in result.output
    assert not (tmp_path / "out" / "work").exists()  # refused before indexing anything
    calibrate(tiny, tmp_path / "cal", IndexSettings().codec, tmp_path / "cache", n_tokens=32, entries=2, repeats=1)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "loading controller: ratio" in result.output
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    decided = results["meta"]["controller"]["ratio"]
    assert decided >= 0.15
    assert [e["params"] for e in results["summary"] if e["method"] == "cacheblend"] == [{"r": decided}]


def _bench_args(root, *extra: str) -> list[str]:
    return [
        "bench",
        "--dataset",
        str(root / "synthetic.jsonl"),
        "--out",
        str(root / "out"),
        "--top-k",
        "2",
        "--chunk-tokens",
        "128",
        "--max-new-tokens",
        "2",
        "--methods",
        "full,reuse",
        "--baseline",
        "reuse",
        "--warmup",
        "0",
        *extra,
    ]


def test_resume_keeps_finished_questions_and_measures_the_rest(tiny, tmp_path, monkeypatch):
    """A run killed during question 3 (question 2 half written, a torn line) goes on: question 1's records
    are kept as measured, questions 2 and 3 are measured again, and the report covers all three."""
    monkeypatch.setattr(ModelAdapter, "load", classmethod(lambda cls, config: tiny))
    write_jsonl(synthetic_multihop(3), tmp_path / "synthetic.jsonl")
    assert CliRunner().invoke(app, _bench_args(tmp_path)).exit_code == 0
    records_path = tmp_path / "out" / "records.jsonl"
    lines = records_path.read_text().splitlines()  # 3 questions x 2 variants
    records_path.write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])

    result = CliRunner().invoke(app, _bench_args(tmp_path, "--resume"))
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["meta"]["resumed_questions"] == 1 and results["meta"]["questions_done"] == 3
    assert [json.dumps(r) for r in results["records"][:2]] == lines[:2]  # kept, not re-measured
    assert [(r["id"], r["label"]) for r in results["records"]] == [
        (json.loads(x)["id"], json.loads(x)["label"]) for x in lines
    ]
    assert records_path.read_text().splitlines()[:2] == lines[:2]
    assert len(records_path.read_text().splitlines()) == 6

    # Everything done: resuming again measures nothing and reports the same records.
    result = CliRunner().invoke(app, _bench_args(tmp_path, "--resume"))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "results.json").read_text())["records"] == results["records"]


def test_resume_refuses_records_it_cannot_compare(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(ModelAdapter, "load", classmethod(lambda cls, config: tiny))
    write_jsonl(synthetic_multihop(2), tmp_path / "synthetic.jsonl")
    assert CliRunner().invoke(app, _bench_args(tmp_path)).exit_code == 0

    result = CliRunner().invoke(app, [*_bench_args(tmp_path, "--resume"), "--top-k", "3"])
    assert result.exit_code == 2 and "top_k: 2 -> 3" in result.output

    write_jsonl(synthetic_multihop(2, seed=1), tmp_path / "synthetic.jsonl")
    result = CliRunner().invoke(app, _bench_args(tmp_path, "--resume"))
    assert result.exit_code == 2 and "is not in this dataset" in " ".join(result.output.split())
    assert len(list((tmp_path / "out" / "work" / "docs").iterdir())) == 12  # refused before indexing the new set

    (tmp_path / "out" / "plan.json").unlink()
    result = CliRunner().invoke(app, _bench_args(tmp_path, "--resume"))
    assert result.exit_code == 2 and "plan.json is missing" in " ".join(result.output.split())


def test_bad_cacheblend_schedule_is_refused_before_indexing(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(ModelAdapter, "load", classmethod(lambda cls, config: tiny))
    write_jsonl(synthetic_multihop(1), tmp_path / "synthetic.jsonl")
    args = [
        *_bench_args(tmp_path),
        "--methods",
        "full,cacheblend",
        "--baseline",
        "cacheblend",
        "--check-layer",
        "3",
        "--filter-steps",
        "2",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "reaches layer 4, beyond the model's 4 layers" in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()


def test_plan_reads_a_parameter_written_with_the_method():
    """`METHOD:PARAM=VALUE[@CACHES]` sets that variant's parameter; the others keep the base's."""
    settings = BenchSettings(
        methods=("full", "cacheblend", "cacheblend:r=0.5", "epic:k=24@neighbours"), baseline="cacheblend:r=0.5"
    )
    labels = [v.label for v in plan(settings, FusionConfig(ratio=0.15, epic_k=16), Config())]
    assert labels == ["full", "cacheblend r=0.15", "cacheblend r=0.5", "epic@neighbours k=24"]
    assert parse_variant("epic:k=24", FusionConfig(), Config()).fusion(FusionConfig()).epic_k == 24
    assert parse_variant("epic_match:k=8", FusionConfig(), Config()).label == "epic_match k=8"
    for bad, message in [
        ("reuse:k=3", "reuse takes no parameter"),
        ("epic:r=0.1", "epic takes only k=VALUE"),
        ("epic:k=2.5", "k must be an int, got '2.5'"),
        ("cacheblend:r=x", "r must be a number"),
        ("cacheblend:k=3", "cacheblend takes only r=VALUE"),
    ]:
        with pytest.raises(ValueError, match=message):
            plan(BenchSettings(methods=("full", bad), baseline="full"), FusionConfig(), Config())
