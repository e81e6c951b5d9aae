"""Benchmark datasets: MuSiQue (CacheBlend JSON), LongBench JSONL, plain JSONL, a synthetic generator, planted
facts (made-up single-hop facts inserted into real passages, answered by an exact string), and a folder of the
user's own documents with their questions (no reference answers: the methods compared by fidelity to full)."""

from __future__ import annotations

import json
import logging
import os
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..retrieval.documents import read_documents

logger = logging.getLogger(__name__)

TASKS = ("qa", "summarization", "exact", "open")  # exact: the answer is a string to find in the generated text;
# open: no reference answer (a question about the user's own documents): scored by fidelity to full alone
FORMATS = ("musique", "longbench", "jsonl")
LONGBENCH_SUMMARIZATION = frozenset({"gov_report", "qmsum", "multi_news", "vcsum", "samsum"})

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class Document:
    """One retrievable passage."""

    title: str  # the passage's heading, written above its text in the corpus ("" for none)
    text: str


@dataclass(frozen=True)
class QAExample:
    """A question with its reference answers and candidate documents; `task` selects F1, Rouge-L,
    exact-string or no scoring against references (`open`: it has none). `evidence_rank`, for planted facts, is where among the retrieved chunks the
    chunk holding the answer is placed (0 = first); None keeps the retrieval order."""

    id: str
    question: str
    answers: tuple[str, ...]
    documents: tuple[Document, ...]
    task: str = "qa"
    evidence_rank: int | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"example {self.id!r}: task must be one of {TASKS}, got {self.task!r}")
        if not self.answers and self.task != "open":
            raise ValueError(f"example {self.id!r} has no answers")
        if self.answers and self.task == "open":
            raise ValueError(f"example {self.id!r}: an open question has no reference answers, got {self.answers!r}")
        if not self.documents:
            raise ValueError(f"example {self.id!r} has no documents")
        if self.task != "summarization" and not self.question.strip():
            raise ValueError(f"example {self.id!r}: a {self.task} example needs a non-empty question")
        if self.evidence_rank is not None and (self.task != "exact" or self.evidence_rank < 0):
            raise ValueError(
                f"example {self.id!r}: evidence_rank {self.evidence_rank!r} needs task 'exact' and a rank >= 0"
            )


def _object(record: Any, where: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}: {record!r}")
    return record


def _field(record: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in record:
        raise ValueError(f"{where}: missing key {key!r} (keys: {sorted(record)})")
    value = record[key]
    if not isinstance(value, kind):
        raise ValueError(f"{where}: {key!r} must be {kind.__name__}, got {type(value).__name__}: {value!r}")
    return value


def _answers(record: dict[str, Any], where: str) -> tuple[str, ...]:
    answers = _field(record, "answers", list, where)
    if not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{where}: 'answers' must be a list of strings, got {answers!r}")
    return tuple(answers)


def _document(raw: Any, where: str) -> Document:
    if isinstance(raw, str):
        return Document(title="", text=raw)
    obj = _object(raw, where)
    return Document(title=_field(obj, "title", str, where), text=_field(obj, "text", str, where))


def _documents(raw: list[Any], where: str) -> tuple[Document, ...]:
    return tuple(_document(doc, f"{where}, document {i}") for i, doc in enumerate(raw))


def _check_file(path: PathLike) -> Path:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file not found: {p}")
    return p


def _iter_jsonl(path: PathLike) -> Iterator[tuple[str, Any]]:
    """Yield (location, record) for each non-blank line; location is 'file:line' for error messages."""
    p = _check_file(path)
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: malformed JSON line: {err}") from err


def _nonempty(examples: list[QAExample], path: PathLike) -> list[QAExample]:
    if not examples:
        raise ValueError(f"no examples in {path}")
    logger.info("loaded %d examples from %s", len(examples), path)
    return examples


def load_musique(path: PathLike) -> list[QAExample]:
    """CacheBlend/MuSiQue JSON: a list of {"question", "answers": [str], "ctxs": [{"title", "text"}]}."""
    p = _check_file(path)
    try:
        records = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{p}: malformed JSON: {err}") from err
    if not isinstance(records, list):
        raise ValueError(f"{p}: expected a JSON list of examples, got {type(records).__name__}")
    examples = []
    for i, raw in enumerate(records):
        where = f"{p}, example {i}"
        record = _object(raw, where)
        examples.append(
            QAExample(
                id=str(record.get("id", record.get("_id", f"musique-{i}"))),
                question=_field(record, "question", str, where),
                answers=_answers(record, where),
                documents=_documents(_field(record, "ctxs", list, where), where),
            )
        )
    return _nonempty(examples, p)


def _longbench_example(raw: Any, where: str) -> QAExample:
    record = _object(raw, where)
    dataset = _field(record, "dataset", str, where)
    task_name = dataset.removesuffix("_e")  # LongBench-E names its subsets "<name>_e"
    return QAExample(
        id=_field(record, "_id", str, where),
        question=_field(record, "input", str, where),
        answers=_answers(record, where),
        documents=(Document(title=task_name or "context", text=_field(record, "context", str, where)),),
        task="summarization" if task_name in LONGBENCH_SUMMARIZATION else "qa",
    )


def load_longbench(path: PathLike) -> list[QAExample]:
    """LongBench JSONL: {"input", "context", "answers", "_id", "dataset"}; the context is one document."""
    return _nonempty([_longbench_example(record, where) for where, record in _iter_jsonl(path)], path)


def _jsonl_example(raw: Any, index: int, where: str) -> QAExample:
    record = _object(raw, where)
    return QAExample(
        id=str(record.get("id", f"example-{index}")),
        question=_field(record, "question", str, where),
        answers=_answers(record, where),
        documents=_documents(_field(record, "documents", list, where), where),
        task=record.get("task", "qa"),
        evidence_rank=record.get("evidence_rank"),
    )


def load_jsonl(path: PathLike) -> list[QAExample]:
    """Plain JSONL: {"question", "answers", "documents"} with documents as strings or {"title", "text"}."""
    examples = [_jsonl_example(record, i, where) for i, (where, record) in enumerate(_iter_jsonl(path))]
    return _nonempty(examples, path)


_LOADERS = {"musique": load_musique, "longbench": load_longbench, "jsonl": load_jsonl}


def _first_record(path: Path) -> Any:
    return next((record for _, record in _iter_jsonl(path)), None)


def infer_format(path: PathLike) -> str:
    """Guess the format: `.json` is MuSiQue; `.jsonl` is LongBench if its records carry "context"."""
    p = _check_file(path)
    if p.suffix == ".json":
        return "musique"
    if p.suffix == ".jsonl":
        first = _first_record(p)
        return "longbench" if isinstance(first, dict) and "context" in first else "jsonl"
    raise ValueError(f"cannot infer dataset format from suffix {p.suffix!r} of {p}; pass one of {FORMATS}")


def load_folder(docs: PathLike, questions: PathLike) -> list[QAExample]:
    """The user's own documents (every text file under `docs`, read as `index` reads them) and questions about
    them (`questions`: a text file, one per line; blank lines and lines starting with '#' skipped): `open`
    examples, each over the whole folder, so retrieval picks each question's chunks."""
    if not Path(docs).is_dir():
        raise FileNotFoundError(f"documents folder not found: {docs}")
    files, _ = read_documents(Path(docs))
    if not files:
        raise ValueError(f"no readable text files in {docs}")
    documents = tuple(Document("", f.text) for f in files)  # no title: the corpus holds each file's text as it is
    lines = _check_file(questions).read_text(encoding="utf-8").splitlines()
    asked = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    examples = [QAExample(f"q{i}", q, (), documents, task="open") for i, q in enumerate(asked)]
    return _nonempty(examples, questions)


PLANTED = "planted:"
PLANTED_PARAPHRASED = "planted-paraphrased:"
# Where a planted fact's chunk goes in the prompt (the first is the default): moved to the place drawn for it, never
# the first (the hard case: the first chunk is read exactly), or left where retrieval and the prompt's chunk order put
# it (the pipeline as a user runs it).
EVIDENCE_PLACES = ("placed", "retrieved")


def load_dataset(
    path: PathLike,
    fmt: str | None = None,
    top_k: int = 6,
    seed: int = 0,
    questions: PathLike | None = None,
) -> list[QAExample]:
    """Load `path` in format `fmt` ("musique", "longbench", "jsonl"), inferred from the file if None;
    `planted:PASSAGES` plants one fact per question of the MuSiQue file PASSAGES (`planted_facts`), and
    `planted-paraphrased:PASSAGES` the same facts in the same passages, asked in other words. A folder
    `path` is the user's own documents, asked the `questions` file's questions (`load_folder`)."""
    if Path(path).is_dir() or questions is not None:
        if questions is None:
            raise ValueError(f"{path} is a folder of documents: give the questions to ask about it (--questions FILE)")
        if fmt is not None:
            raise ValueError(f"a documents folder with --questions has no format; got format {fmt!r}")
        return load_folder(path, questions)
    for prefix, paraphrased in ((PLANTED, False), (PLANTED_PARAPHRASED, True)):
        if str(path).startswith(prefix):
            if fmt not in (None, "musique"):
                raise ValueError(f"planted facts are made from a MuSiQue passages file, not format {fmt!r}")
            return planted_facts(
                load_musique(str(path)[len(prefix) :]), top_k=top_k, seed=seed, paraphrased=paraphrased
            )
    if fmt is not None and fmt not in _LOADERS:
        raise ValueError(f"unknown dataset format {fmt!r}; expected one of {FORMATS}")
    return _LOADERS[fmt or infer_format(path)](path)


def write_jsonl(examples: Iterable[QAExample], path: PathLike) -> None:
    """Write examples in the plain JSONL format read by `load_jsonl` (atomically)."""
    p = Path(path)
    lines = [
        json.dumps(
            {
                "id": ex.id,
                "question": ex.question,
                "answers": list(ex.answers),
                "documents": [{"title": d.title, "text": d.text} for d in ex.documents],
                "task": ex.task,
                **({} if ex.evidence_rank is None else {"evidence_rank": ex.evidence_rank}),
            },
            ensure_ascii=False,
        )
        for ex in examples
    ]
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, p)


# ---- planted facts ------------------------------------------------------------------------------------
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ia", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "m", "nd", "rk", "th")
# (fact, question, kind of answer, paraphrased question); {s} is the passage's subject, {a} the answer. The
# paraphrase shares no content word with the fact but the subject's (`test_bench_datasets`): what a repair
# that finds the evidence by the question's words cannot see.
_FACTS = (
    (
        "a survey of {s} in 2031 was led by the archivist {a}.",
        "Who led the 2031 survey of {s}?",
        "person",
        "Who headed the study of {s}?",
    ),
    (
        "the society devoted to {s} was founded by {a}.",
        "Who founded the society devoted to {s}?",
        "person",
        "Who started the association dedicated to {s}?",
    ),
    (
        "the oldest record of {s} is kept in the town of {a}.",
        "In which town is the oldest record of {s} kept?",
        "place",
        "Where is the earliest document about {s} held?",
    ),
    (
        "the registry lists {s} under the catalogue number {a}.",
        "Under which catalogue number does the registry list {s}?",
        "number",
        "What inventory code is {s} filed under?",
    ),
    (
        "the prize awarded for work on {s} is a bronze owl named {a}.",
        "What is the bronze owl awarded for work on {s} named?",
        "name",
        "What is the trophy given for research on {s} called?",
    ),
)
# A defining sentence: "<subject> is a ..." (passages are lower-cased), its subject captured.
_DEFINITION = re.compile(r"(?<=\. )([a-z0-9][a-z0-9' &-]{2,40}?) (?:is|was|are|were) (?:a|an|the) ")
_NOT_SUBJECTS = frozenset({"it", "this", "that", "he", "she", "they", "there", "these", "those", "which"})
PLANTED_HEAD_WORDS = 120  # facts go within a passage's first words: the embedder reads only a chunk's head


def _made_up_word(rng: random.Random) -> str:
    syllables = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3))]
    return ("".join(syllables) + rng.choice(_CODAS)).capitalize()


def _made_up_answer(rng: random.Random, kind: str) -> str:
    if kind == "person":
        return f"{_made_up_word(rng)} {_made_up_word(rng)}"
    if kind == "number":
        return str(rng.randint(10_000, 99_999))
    return _made_up_word(rng)


def _definitions(text: str) -> list[tuple[str, int]]:
    """(subject, index of the end of its sentence) for defining sentences in `text`'s first words."""
    head = " ".join(text.split()[:PLANTED_HEAD_WORDS])
    found = []
    for m in _DEFINITION.finditer(head):
        end = head.find(". ", m.end())
        if m.group(1) not in _NOT_SUBJECTS and end > 0:
            found.append((m.group(1), end + 1))
    return found


def plant_fact(example: QAExample, rng: random.Random, top_k: int, paraphrased: bool = False) -> QAExample | None:
    """`example`'s passages with one made-up fact inserted after a defining sentence of one of them
    (None when no passage has one), asked about by subject (`paraphrased`: in words the fact does not
    use), answered by an invented string, to be placed at a random retrieved rank other than the first."""
    candidates = [
        (i, subject, end) for i, doc in enumerate(example.documents) for subject, end in _definitions(doc.text)
    ]
    if not candidates:
        return None
    i, subject, end = rng.choice(candidates)
    fact, question, kind, paraphrase = rng.choice(_FACTS)
    answer = _made_up_answer(rng, kind)
    doc = example.documents[i]
    head = " ".join(doc.text.split()[:PLANTED_HEAD_WORDS])
    text = (
        f"{head[:end]} {fact.format(s=subject, a=answer)}{head[end:]} {' '.join(doc.text.split()[PLANTED_HEAD_WORDS:])}"
    )
    documents = (*example.documents[:i], Document(doc.title, text.strip()), *example.documents[i + 1 :])
    return QAExample(
        id=f"planted-{example.id}",
        question=(paraphrase if paraphrased else question).format(s=subject),
        answers=(answer,),
        documents=documents,
        task="exact",
        evidence_rank=rng.randint(1, top_k - 1),
    )


def planted_facts(
    examples: Iterable[QAExample], top_k: int = 6, seed: int = 0, paraphrased: bool = False
) -> list[QAExample]:
    """One planted-fact question per example that has a passage to plant it in (`plant_fact`).

    Deterministic per seed, and per example: the first n questions do not depend on how many follow;
    `paraphrased` asks the same facts, planted in the same passages, in other words.
    """
    if top_k < 2:
        raise ValueError(f"planted facts go at a retrieved rank other than the first: top_k must be >= 2, got {top_k}")
    planted = [plant_fact(ex, random.Random(f"{seed}:{ex.id}"), top_k, paraphrased) for ex in examples]
    kept = [ex for ex in planted if ex is not None]
    if not kept:
        raise ValueError("no passage has a defining sentence to plant a fact after")
    logger.info("planted %d facts (%d examples had no passage to plant in)", len(kept), len(planted) - len(kept))
    return kept
