"""Tests for rag_kvcache.bench.datasets: loaders, format inference, errors and the synthetic generator."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from synthetic import synthetic_multihop

from rag_kvcache.bench.corpus import write_question_passages
from rag_kvcache.bench.datasets import (
    Document,
    QAExample,
    infer_format,
    load_dataset,
    load_folder,
    load_jsonl,
    load_longbench,
    load_musique,
    write_jsonl,
)

REAL_MUSIQUE = Path(__file__).resolve().parents[3] / "shared" / "data" / "musique_dev.json"

MUSIQUE_RECORDS = [
    {
        "question": "Where was the author of X educated?",
        "answers": ["Exeter College"],
        "ctxs": [{"title": "X", "text": "X was written by Y."}, {"title": "Y", "text": "Y studied at Exeter College."}],
    },
    {"question": "Who founded Z?", "answers": ["A", "B"], "ctxs": [{"title": "Z", "text": "Z was founded by A."}]},
]


def _write_lines(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _longbench(dataset: str, idx: int) -> dict:
    return {
        "input": f"question {idx}?",
        "context": f"long context {idx}",
        "answers": [f"answer {idx}"],
        "_id": f"id{idx}",
        "dataset": dataset,
        "length": 3,
        "all_classes": None,
        "language": "en",
    }


def test_load_musique_small_file(tmp_path):
    path = tmp_path / "mini.json"
    path.write_text(json.dumps(MUSIQUE_RECORDS), encoding="utf-8")
    examples = load_musique(path)
    assert [e.id for e in examples] == ["musique-0", "musique-1"]
    assert examples[0] == QAExample(
        id="musique-0",
        question="Where was the author of X educated?",
        answers=("Exeter College",),
        documents=(Document("X", "X was written by Y."), Document("Y", "Y studied at Exeter College.")),
        task="qa",
    )
    assert examples[1].answers == ("A", "B")
    assert load_dataset(path) == examples  # inferred from the .json suffix


@pytest.mark.skipif(not REAL_MUSIQUE.is_file(), reason=f"real MuSiQue data not present at {REAL_MUSIQUE}")
def test_load_musique_real_file():
    examples = load_dataset(REAL_MUSIQUE, "musique")
    assert len(examples) == 100
    assert all(len(e.documents) == 10 for e in examples)
    assert all(e.answers and e.question and e.task == "qa" for e in examples)
    assert len({e.id for e in examples}) == 100


def test_load_longbench_tasks(tmp_path):
    path = _write_lines(tmp_path / "lb.jsonl", [_longbench("hotpotqa", 0), _longbench("gov_report_e", 1)])
    qa, summ = load_longbench(path)
    assert qa.id == "id0" and qa.question == "question 0?" and qa.task == "qa"
    assert qa.documents == (Document("hotpotqa", "long context 0"),)
    assert summ.task == "summarization" and summ.documents[0].title == "gov_report"
    assert load_dataset(path) == [qa, summ]  # inferred: .jsonl records with "context"


def test_longbench_summarization_may_have_empty_question(tmp_path):
    record = _longbench("multi_news", 0) | {"input": ""}
    (example,) = load_longbench(_write_lines(tmp_path / "lb.jsonl", [record]))
    assert example.task == "summarization" and example.question == ""


def test_load_jsonl_string_and_object_documents(tmp_path):
    records = [
        {"question": "q1?", "answers": ["a1"], "documents": ["plain text doc", "another"]},
        {"question": "q2?", "answers": ["a2"], "documents": [{"title": "T", "text": "body"}], "id": "custom"},
    ]
    path = _write_lines(tmp_path / "mine.jsonl", records)
    first, second = load_jsonl(path)
    assert first.id == "example-0"
    assert first.documents == (Document("", "plain text doc"), Document("", "another"))
    assert second.id == "custom" and second.documents == (Document("T", "body"),)
    assert infer_format(path) == "jsonl"


def test_synthetic_round_trip_through_jsonl(tmp_path):
    examples = synthetic_multihop(5, seed=7)
    path = tmp_path / "synthetic.jsonl"
    write_jsonl(examples, path)
    assert load_jsonl(path) == examples
    assert load_dataset(path, "jsonl") == examples
    assert load_dataset(path) == examples
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_synthetic_is_deterministic_per_seed():
    assert synthetic_multihop(4, seed=1) == synthetic_multihop(4, seed=1)
    assert synthetic_multihop(4, seed=1) != synthetic_multihop(4, seed=2)


@pytest.mark.parametrize("distractors", [0, 4, 11])
def test_synthetic_questions_need_both_hops(distractors):
    for ex in synthetic_multihop(20, seed=3, distractors=distractors):
        assert len(ex.documents) == 2 + distractors
        person = re.fullmatch(r"In which country was (.+) born\?", ex.question).group(1)
        (country,) = ex.answers
        texts = [d.text for d in ex.documents]
        (city,) = [m.group(1) for t in texts if (m := re.search(rf"{person} was born in ([^.]+)\.", t))]
        (capital_doc,) = [t for t in texts if f"{city} is the capital of {country}." in t]
        assert sum(country in t for t in texts) == 1, "the answer must appear only in the second-hop doc"
        assert person not in capital_doc, "the second hop must not mention the person"
        assert all(60 <= len(t.split()) <= 150 for t in texts)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, "n must be"),
        ({"n": 1, "distractors": -1}, "distractors"),
        ({"n": 1, "distractors": 99}, "distractors"),
    ],
)
def test_synthetic_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        synthetic_multihop(**kwargs)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.json"
    for fmt in ("musique", "longbench", "jsonl", None):
        with pytest.raises(FileNotFoundError, match="nope.json"):
            load_dataset(missing, fmt)


def test_unknown_format_name(tmp_path):
    path = _write_lines(tmp_path / "x.jsonl", [{"question": "q", "answers": ["a"], "documents": ["d"]}])
    with pytest.raises(ValueError, match="'squad'"):
        load_dataset(path, "squad")


def test_uninferable_suffix(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("{}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"'\.txt'"):
        load_dataset(path)


def test_malformed_line_reports_line_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "q", "answers": ["a"], "documents": ["d"]})
    path.write_text(f"{good}\n\n{{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        load_jsonl(path)


def test_malformed_musique_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("[{", encoding="utf-8")
    with pytest.raises(ValueError, match="malformed JSON"):
        load_musique(path)


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"question": "q", "answers": [], "documents": ["d"]}, "no answers"),
        ({"question": "q", "answers": ["a"], "documents": []}, "no documents"),
        ({"question": "q", "documents": ["d"]}, "missing key 'answers'"),
        ({"question": "q", "answers": "a", "documents": ["d"]}, "'answers' must be list"),
        ({"question": "q", "answers": [1], "documents": ["d"]}, "list of strings"),
        ({"question": "q", "answers": ["a"], "documents": [{"text": "t"}]}, "document 0: missing key 'title'"),
        ({"question": "", "answers": ["a"], "documents": ["d"]}, "non-empty question"),
        ({"question": "q", "answers": ["a"], "documents": ["d"], "task": "chat"}, "'chat'"),
        (["not", "an", "object"], "expected a JSON object"),
    ],
)
def test_bad_jsonl_records(tmp_path, record, match):
    path = _write_lines(tmp_path / "bad.jsonl", [record])
    with pytest.raises(ValueError, match=match):
        load_jsonl(path)


def test_musique_error_names_the_example(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([MUSIQUE_RECORDS[0], {"question": "q", "answers": ["a"]}]), encoding="utf-8")
    with pytest.raises(ValueError, match=r"example 1: missing key 'ctxs'"):
        load_musique(path)


def test_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no examples"):
        load_dataset(path)


def _musique_like(n: int) -> list[QAExample]:
    filler = "it was built in the old style. many people visit it every year. "
    return [
        QAExample(
            f"m{i}",
            f"question {i}?",
            ("gold",),
            tuple(
                Document("", f"{filler}the tower of kelm {i}-{j} is a stone tower in the north. {filler * 3}")
                for j in range(3)
            ),
        )
        for i in range(n)
    ]


def test_planted_facts_are_deterministic_exact_and_placed_after_the_first_rank():
    from rag_kvcache.bench.datasets import PLANTED_HEAD_WORDS, planted_facts

    examples = _musique_like(6)
    planted = planted_facts(examples, top_k=4, seed=3)
    assert planted == planted_facts(examples, top_k=4, seed=3) and planted != planted_facts(examples, top_k=4, seed=4)
    assert planted[:2] == planted_facts(examples[:2], top_k=4, seed=3)  # independent of what follows
    for ex, source in zip(planted, examples):
        assert ex.task == "exact" and 1 <= ex.evidence_rank <= 3 and ex.id == f"planted-{source.id}"
        holding = [d for d in ex.documents if ex.answers[0] in d.text]
        assert len(holding) == 1 and len(ex.documents) == len(source.documents)
        subject = re.search(r"the tower of kelm \d-\d", ex.question).group()  # the question names the passage's subject
        assert subject in holding[0].text
        head = " ".join(holding[0].text.split()[: PLANTED_HEAD_WORDS + 20])  # within the embedder's reach
        assert ex.answers[0] in head and not holding[0].text.startswith(subject)


def test_paraphrased_planted_facts_are_the_same_facts_asked_without_the_facts_words():
    """The paraphrased set plants the same facts in the same passages; each question shares no content word
    (4+ letters, not a stop word: the words `epic_match` counts) with its fact but the subject's."""
    from rag_kvcache.bench.datasets import _FACTS, planted_facts
    from rag_kvcache.engine.sentences import MIN_WORD_LETTERS, STOP_WORDS

    def words(text: str) -> set[str]:
        return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= MIN_WORD_LETTERS and w not in STOP_WORDS}

    for fact, question, _, paraphrase in _FACTS:
        assert words(fact) & words(question) - {"s"}  # the lexical question does echo its fact
        assert not (words(fact.format(s="", a="")) & words(paraphrase.format(s=""))), paraphrase
    examples = _musique_like(6)
    lexical, paraphrased = planted_facts(examples, seed=5), planted_facts(examples, seed=5, paraphrased=True)
    assert [(ex.id, ex.documents, ex.answers, ex.evidence_rank) for ex in lexical] == [
        (ex.id, ex.documents, ex.answers, ex.evidence_rank) for ex in paraphrased
    ]
    assert all(a.question != b.question for a, b in zip(lexical, paraphrased))


def test_planted_facts_round_trip_through_jsonl(tmp_path):
    from rag_kvcache.bench.datasets import planted_facts

    planted = planted_facts(_musique_like(2))
    write_jsonl(planted, tmp_path / "planted.jsonl")
    assert load_jsonl(tmp_path / "planted.jsonl") == planted


def test_planted_spec_loads_a_musique_file(tmp_path):
    from rag_kvcache.bench.datasets import load_dataset

    records = [
        {"question": ex.question, "answers": ["gold"], "ctxs": [{"title": "", "text": d.text} for d in ex.documents]}
        for ex in _musique_like(3)
    ]
    (tmp_path / "m.json").write_text(json.dumps(records))
    planted = load_dataset(f"planted:{tmp_path / 'm.json'}", top_k=2)
    assert len(planted) == 3 and {ex.evidence_rank for ex in planted} == {1}
    paraphrased = load_dataset(f"planted-paraphrased:{tmp_path / 'm.json'}", top_k=2)
    assert [ex.answers for ex in paraphrased] == [ex.answers for ex in planted]
    with pytest.raises(ValueError, match="top_k must be >= 2"):
        load_dataset(f"planted:{tmp_path / 'm.json'}", top_k=1)
    with pytest.raises(ValueError, match="needs task 'exact'"):
        QAExample("x", "q?", ("a",), (Document("", "t"),), evidence_rank=1)


# ---- your own documents ---------------------------------------------------------------------------------
def test_a_folder_with_questions_is_open_questions_over_every_file(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.md").write_text("# A\nThe harbour is called Saltmere.\n", encoding="utf-8")
    (docs / "sub" / "b.txt").write_text("The lighthouse keeper was Tobias Quell.", encoding="utf-8")
    (docs / "image.bin").write_bytes(b"\x00\xff\x00")  # skipped, as `index` skips it
    questions = tmp_path / "q.txt"
    questions.write_text("# about the harbour\nWhat is the harbour called?\n\n  Who kept the lighthouse?  \n")
    examples = load_dataset(docs, questions=questions)
    assert [(e.id, e.question, e.answers, e.task) for e in examples] == [
        ("q0", "What is the harbour called?", (), "open"),
        ("q1", "Who kept the lighthouse?", (), "open"),
    ]
    assert (
        examples[0].documents
        == examples[1].documents
        == (
            Document("", "# A\nThe harbour is called Saltmere.\n"),
            Document("", "The lighthouse keeper was Tobias Quell."),
        )
    )


@pytest.mark.parametrize(
    "case,match",
    [
        ("no_questions", "is a folder of documents: give the questions"),
        ("missing_folder", "documents folder not found"),
        ("missing_questions", "dataset file not found: .*nowhere.txt"),
        ("empty_folder", "no readable text files in"),
        ("blank_questions", "no examples in"),
        ("format", "has no format"),
    ],
)
def test_a_bad_folder_dataset_is_refused_naming_it(tmp_path, case, match):
    docs, questions = tmp_path / "docs", tmp_path / "q.txt"
    docs.mkdir()
    if case != "empty_folder":
        (docs / "a.txt").write_text("Some text.", encoding="utf-8")
    questions.write_text("\n# none\n" if case == "blank_questions" else "What?\n", encoding="utf-8")
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        if case == "no_questions":
            load_dataset(docs)
        elif case == "missing_folder":
            load_folder(tmp_path / "nowhere", questions)
        elif case == "missing_questions":
            load_dataset(docs, questions=tmp_path / "nowhere.txt")
        elif case == "format":
            load_dataset(docs, "jsonl", questions=questions)
        else:
            load_dataset(docs, questions=questions)


def test_an_open_question_has_no_reference_answers():
    with pytest.raises(ValueError, match="an open question has no reference answers"):
        QAExample("x", "Why?", ("because",), (Document("", "text"),), task="open")


def test_the_planted_set_writer_writes_what_bench_generates(tmp_path):
    """`datasets/planted.py` writes the planted (or paraphrased) set that `bench --dataset planted:` generates."""
    import runpy

    records = [
        {"question": ex.question, "answers": ["gold"], "ctxs": [{"title": "", "text": d.text} for d in ex.documents]}
        for ex in _musique_like(3)
    ]
    (tmp_path / "m.json").write_text(json.dumps(records))
    script = Path(__file__).resolve().parents[2] / "datasets" / "planted.py"
    for flag, spec in (([], "planted:"), (["--paraphrased"], "planted-paraphrased:")):
        out = tmp_path / f"{spec[:-1]}.jsonl"
        main = runpy.run_path(str(script))["main"]
        main([str(tmp_path / "m.json"), str(out), "--top-k", "2", *flag])
        assert load_jsonl(out) == load_dataset(f"{spec}{tmp_path / 'm.json'}", top_k=2)


def test_question_passages_are_written_one_file_per_listed_context_repeats_kept(tmp_path):
    """The scripts' layout (`write_question_passages`): every example's contexts in the order listed, a passage
    two questions share written twice, each file "title\\ntext"."""
    shared = Document("Harbour", "Saltmere is a harbour.")
    examples = [
        QAExample("a", "Where?", ("x",), (shared, Document("Tower", "It stands."))),
        QAExample("b", "What?", ("y",), (shared,)),
    ]
    write_question_passages(examples, tmp_path / "docs")
    files = {p.name: p.read_text(encoding="utf-8") for p in (tmp_path / "docs").iterdir()}
    assert files == {
        "000-00.txt": "Harbour\nSaltmere is a harbour.",
        "000-01.txt": "Tower\nIt stands.",
        "001-00.txt": "Harbour\nSaltmere is a harbour.",
    }
