"""A synthetic two-hop QA set over fictional entities, for the bench tests (no model knows the answers)."""

from __future__ import annotations

import random

from rag_kvcache.bench.datasets import Document, QAExample

_FIRST = (
    "Alaric",
    "Brenna",
    "Caspian",
    "Delphine",
    "Evander",
    "Fenna",
    "Gideon",
    "Halvard",
    "Isolde",
    "Jorund",
    "Katrin",
    "Leopold",
    "Marisol",
    "Niamh",
    "Oswin",
    "Perpetua",
)
_LAST = (
    "Ashgrove",
    "Brightwater",
    "Coldmere",
    "Dunmore",
    "Everly",
    "Fairholm",
    "Greystone",
    "Hollowell",
    "Ironwood",
    "Kestrel",
    "Larkspur",
    "Mossbank",
    "Northcott",
    "Quillon",
)
_CITIES = (
    "Varnholt",
    "Quellmar",
    "Kelmarsh",
    "Brisk Harbor",
    "Tollvik",
    "Amberlee",
    "Corvanne",
    "Duskmoor",
    "Elmsreach",
    "Fallowmere",
    "Glimmerton",
    "Hesperin",
    "Istrelle",
    "Jarrowdale",
)
_COUNTRIES = (
    "Eldoria",
    "Marvessa",
    "Tyrnland",
    "Quoravia",
    "Sylmar",
    "Bellandor",
    "Karthun",
    "Ostmere",
    "Vandrel",
    "Zephyria",
    "Norhaven",
    "Caldoris",
)

_PERSON_FILLER = (
    "{x} is remembered by colleagues as a patient and methodical worker.",
    "Over a long career, {x} wrote several essays on craft, travel and memory.",
    "Friends describe {x} as quiet in public but generous with time and advice.",
    "In later years {x} spent many evenings restoring old clocks and furniture.",
    "A small collection of letters written by {x} is kept in a private archive.",
    "{x} once said that the most useful habit is to write everything down.",
    "Several former students of {x} went on to teach at regional schools.",
    "{x} preferred long walks to cars and rarely owned more than one coat.",
)
_CITY_FILLER = (
    "{x} is known for its narrow stone streets and busy morning markets.",
    "Visitors to {x} often remark on the bells that ring every quarter hour.",
    "The river that runs through {x} freezes only in the coldest winters.",
    "Much of the old town of {x} was rebuilt after a fire two centuries ago.",
    "{x} hosts a festival of music and lanterns at the end of every summer.",
    "Trade in wool, timber and salt made {x} prosperous in earlier times.",
    "The central library of {x} holds maps that date back several hundred years.",
    "Many residents of {x} commute by ferry across the wide harbour each day.",
)


def _paragraph(rng: random.Random, subject: str, fact: str, filler: tuple[str, ...]) -> Document:
    sentences = [s.format(x=subject) for s in rng.sample(filler, k=rng.randint(5, 7))]
    sentences.insert(rng.randint(0, len(sentences)), fact)
    return Document(title=subject, text=" ".join(sentences))


def _born(rng: random.Random, person: str, city: str) -> Document:
    return _paragraph(rng, person, f"{person} was born in {city}.", _PERSON_FILLER)


def _capital(rng: random.Random, city: str, country: str) -> Document:
    return _paragraph(rng, city, f"{city} is the capital of {country}.", _CITY_FILLER)


def _synthetic_example(rng: random.Random, ident: str, distractors: int) -> QAExample:
    k = distractors + 1
    persons = [f"{first} {last}" for first, last in zip(rng.sample(_FIRST, k), rng.sample(_LAST, k))]
    cities, countries = rng.sample(_CITIES, k), rng.sample(_COUNTRIES, k)
    docs = [_born(rng, persons[0], cities[0]), _capital(rng, cities[0], countries[0])]
    docs += [
        _born(rng, persons[i], cities[i]) if i % 2 else _capital(rng, cities[i], countries[i]) for i in range(1, k)
    ]
    rng.shuffle(docs)
    return QAExample(
        id=ident,
        question=f"In which country was {persons[0]} born?",
        answers=(countries[0],),
        documents=tuple(docs),
    )


def synthetic_multihop(n: int, seed: int = 0, distractors: int = 4) -> list[QAExample]:
    """Two-hop questions over fictional entities (person -> birth city -> country), plus distractor docs.

    Names are invented so the answer cannot come from a model's parametric memory; deterministic per seed.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    max_distractors = min(len(_FIRST), len(_LAST), len(_CITIES), len(_COUNTRIES)) - 1
    if not 0 <= distractors <= max_distractors:
        raise ValueError(f"distractors must be in [0, {max_distractors}], got {distractors}")
    rng = random.Random(seed)
    return [_synthetic_example(rng, f"synthetic-{seed}-{i}", distractors) for i in range(n)]
