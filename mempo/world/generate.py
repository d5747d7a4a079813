"""Generate the knowledge world: entities, Wikipedia-style passages and FlashRAG QA sets.

    mempo world generate --out data/world --size small --seed 13

Writes (every file atomically, the folder as a whole):

    DIR/corpus.jsonl          {"id", "contents": "Title\\ntext"}  (wiki-18 / Search-R1 format)
    DIR/qa/train.jsonl        FlashRAG: {"id", "question", "golden_answers", "metadata"}
    DIR/qa/val.jsonl, DIR/qa/test.jsonl
    DIR/entities.json         the world's facts (for debugging and the scripted teacher)
    DIR/manifest.json         seed, size, counts, sha256 of every file

Questions are anchored on "subject" people. Subjects are split train/val/test (and train
into two halves, `part: sft|rl`), so no person asked about in val/test is asked about in
train. Mayors and company founders are "notable" people: they appear inside chains and as
answers but are never the subject of a question. Every question carries its supporting chain
in `metadata.chain`: one hop per retrieval, each with the entity to look up, the relation, the
value found, and the id of the passage that states it.

Same seed and size, same bytes.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mempo.io import atomic_dir, sha256_file, write_json, write_jsonl
from mempo.world.names import NameFactory


@dataclass(frozen=True)
class WorldSpec:
    """How many entities of each kind. Subjects are the people questions are asked about."""

    subjects: int
    cities: int
    countries: int
    companies: int
    books: int
    rivers: int
    split: tuple[float, float, float] = (0.7, 0.1, 0.2)


# `small` (the default run) is sized for generalisation: a prototype found a 0.7M-param
# policy memorised names on a 300-person world but generalised on ~1,500 people.
SIZES: dict[str, WorldSpec] = {
    "tiny": WorldSpec(subjects=60, cities=10, countries=4, companies=8, books=20, rivers=4),
    "small": WorldSpec(subjects=1200, cities=60, countries=10, companies=80, books=400, rivers=16),
    "medium": WorldSpec(subjects=5000, cities=200, countries=24, companies=300, books=1600, rivers=40),
}

OCCUPATIONS = ["architect", "chemist", "painter", "engineer", "historian", "sailor", "poet",
               "surgeon", "composer", "botanist", "lawyer", "astronomer", "baker", "pilot",
               "sculptor", "economist", "linguist", "geologist", "teacher", "photographer"]
INDUSTRIES = ["shipping", "software", "textile", "mining", "publishing", "aerospace", "food",
              "energy", "banking", "robotics"]


@dataclass
class Person:
    id: str
    name: str
    birth_year: int
    birth_city: str  # city id
    occupation: str
    employer: str | None = None  # company id
    role: str = "subject"  # subject | mayor | founder
    doc_id: str = ""


@dataclass
class City:
    id: str
    name: str
    country: str
    population: int
    founded: int
    mayor: str = ""  # person id
    doc_id: str = ""


@dataclass
class Country:
    id: str
    name: str
    capital: str = ""  # city id
    doc_id: str = ""


@dataclass
class Company:
    id: str
    name: str
    founder: str  # person id
    hq: str  # city id
    founded: int
    industry: str
    doc_id: str = ""


@dataclass
class Book:
    id: str
    title: str
    author: str  # person id
    year: int
    doc_id: str = ""


@dataclass
class River:
    id: str
    name: str
    cities: list[str]
    length_km: int
    doc_id: str = ""


@dataclass
class World:
    people: dict[str, Person] = field(default_factory=dict)
    cities: dict[str, City] = field(default_factory=dict)
    countries: dict[str, Country] = field(default_factory=dict)
    companies: dict[str, Company] = field(default_factory=dict)
    books: dict[str, Book] = field(default_factory=dict)
    rivers: dict[str, River] = field(default_factory=dict)
    passages: list[dict[str, str]] = field(default_factory=list)


# ------------------------------------------------------------------------------ entities


def _build_entities(spec: WorldSpec, rng: random.Random) -> World:
    names = NameFactory(rng)
    w = World()
    surnames = names.surnames(max(8, spec.subjects // 4))
    for i in range(spec.countries):
        w.countries[f"K{i}"] = Country(f"K{i}", names.country())
    country_ids = list(w.countries)
    for i in range(spec.cities):
        # Every country gets at least one city; the rest are spread at random.
        k = country_ids[i] if i < len(country_ids) else rng.choice(country_ids)
        w.cities[f"C{i}"] = City(
            f"C{i}", names.city(), k, population=rng.randrange(20, 2000) * 1000,
            founded=rng.randint(900, 1900),
        )
    city_ids = list(w.cities)
    for k in country_ids:
        w.countries[k].capital = rng.choice([c for c in city_ids if w.cities[c].country == k])

    def new_person(role: str, lo: int, hi: int) -> Person:
        pid = f"P{len(w.people)}"
        p = Person(pid, names.person(surnames), rng.randint(lo, hi), rng.choice(city_ids),
                   rng.choice(OCCUPATIONS), role=role)
        w.people[pid] = p
        return p

    for c in city_ids:
        mayor = new_person("mayor", 1940, 1985)
        mayor.occupation = "politician"
        w.cities[c].mayor = mayor.id
    for i in range(spec.companies):
        founder = new_person("founder", 1920, 1980)
        founder.occupation = "entrepreneur"
        w.companies[f"O{i}"] = Company(
            f"O{i}", names.company(), founder.id, rng.choice(city_ids),
            founded=rng.randint(max(founder.birth_year + 22, 1950), 2015),
            industry=rng.choice(INDUSTRIES),
        )
    company_ids = list(w.companies)
    for _ in range(spec.subjects):
        p = new_person("subject", 1930, 2000)
        p.employer = rng.choice(company_ids)
    subject_ids = [p for p in w.people if w.people[p].role == "subject"]
    for i in range(spec.books):
        author = w.people[rng.choice(subject_ids)]
        w.books[f"B{i}"] = Book(f"B{i}", names.book(), author.id,
                                year=rng.randint(author.birth_year + 20, author.birth_year + 60))
    for i in range(spec.rivers):
        w.rivers[f"R{i}"] = River(f"R{i}", names.river(), rng.sample(city_ids, k=min(3, len(city_ids))),
                                  length_km=rng.randint(40, 3000))
    return w


# ------------------------------------------------------------------------------ passages

_PERSON_OPENINGS = [
    "{name} (born {year}) is a {occ}.",
    "{name} is a {occ} born in {year}.",
    "{name}, born in {year}, is a {occ}.",
]
_PERSON_BIRTH = [
    "{last} was born in {city}.",
    "{last} is a native of {city}, where {pron} was born.",
    "Born in the city of {city}, {last} grew up there.",
]
_PERSON_WORK = [
    "{last} works for {company}.",
    "Since moving on from early jobs, {last} has been employed by {company}.",
    "{last} is currently an employee of {company}.",
]
_CITY = [
    "{name} is a city in {country}. It was founded in {founded} and has about {pop} inhabitants. "
    "The mayor of {name} is {mayor}.",
    "{name}, founded in {founded}, is a city of {country} with a population of about {pop}. "
    "{mayor} serves as mayor of {name}.",
]
_COUNTRY = [
    "{name} is a country. Its capital is {capital}, and its largest cities include {cities}.",
    "{name} is a sovereign state whose capital city is {capital}. Other cities in {name} include {cities}.",
]
_COMPANY = [
    "{name} is a {industry} company founded in {founded} by {founder}. It is headquartered in {hq}.",
    "{name} was founded by {founder} in {founded}. The {industry} firm has its headquarters in {hq}.",
]
_BOOK = [
    "{title} is a novel written by {author}, published in {year}.",
    "{title} ({year}) is a book by the author {author}.",
]
_RIVER = [
    "The {name} is a river {length} km long. It flows through {cities}.",
    "The {name} river runs for {length} km and passes the cities of {cities}.",
]


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _write_passages(w: World, rng: random.Random) -> None:
    """One passage per entity, in a fixed kind order; ids are stable for a given seed."""
    out = w.passages

    def add(title: str, text: str) -> str:
        doc_id = str(len(out))
        out.append({"id": doc_id, "contents": f"{title}\n{text}"})
        return doc_id

    for c in w.countries.values():
        cities = [x.name for x in w.cities.values() if x.country == c.id and x.id != c.capital][:3]
        text = rng.choice(_COUNTRY).format(
            name=c.name, capital=w.cities[c.capital].name, cities=_join(cities or ["none recorded"])
        )
        c.doc_id = add(c.name, text)
    for c in w.cities.values():
        text = rng.choice(_CITY).format(
            name=c.name, country=w.countries[c.country].name, founded=c.founded,
            pop=f"{c.population:,}", mayor=w.people[c.mayor].name,
        )
        c.doc_id = add(c.name, text)
    for p in w.people.values():
        last = p.name.split(" ")[-1]
        parts = [
            rng.choice(_PERSON_OPENINGS).format(name=p.name, year=p.birth_year, occ=p.occupation),
            rng.choice(_PERSON_BIRTH).format(last=p.name, city=w.cities[p.birth_city].name,
                                             pron=rng.choice(["she", "he"])),
        ]
        if p.employer is not None:
            parts.append(rng.choice(_PERSON_WORK).format(last=last, company=w.companies[p.employer].name))
        elif p.role == "mayor":
            city = next(c for c in w.cities.values() if c.mayor == p.id)
            parts.append(f"{last} is a politician and the mayor of {city.name}.")
        p.doc_id = add(p.name, " ".join(parts))
    for o in w.companies.values():
        text = rng.choice(_COMPANY).format(
            name=o.name, industry=o.industry, founded=o.founded,
            founder=w.people[o.founder].name, hq=w.cities[o.hq].name,
        )
        o.doc_id = add(o.name, text)
    for b in w.books.values():
        text = rng.choice(_BOOK).format(title=b.title, author=w.people[b.author].name, year=b.year)
        b.doc_id = add(b.title, text)
    for r in w.rivers.values():
        text = rng.choice(_RIVER).format(
            name=r.name, length=r.length_km, cities=_join([w.cities[c].name for c in r.cities])
        )
        r.doc_id = add(f"{r.name} (river)", text)


# ------------------------------------------------------------------------------ questions


def _hop(entity: str, relation: str, value: str, doc_id: str) -> dict[str, str]:
    return {"entity": entity, "relation": relation, "value": value, "doc_id": doc_id}


def _subject_questions(w: World, p: Person) -> list[dict[str, Any]]:
    """All question templates anchored on subject `p`, each with its hop chain."""
    city = w.cities[p.birth_city]
    country = w.countries[city.country]
    mayor = w.people[city.mayor]
    comp = w.companies[p.employer] if p.employer else None
    h_born = _hop(p.name, "born_in", city.name, p.doc_id)
    h_mayor = _hop(city.name, "mayor", mayor.name, city.doc_id)
    h_country = _hop(city.name, "country", country.name, city.doc_id)
    qs: list[dict[str, Any]] = [
        {"template": "born_in", "question": f"Where was {p.name} born?", "answer": city.name,
         "chain": [h_born]},
        {"template": "birth_year", "question": f"In what year was {p.name} born?",
         "answer": str(p.birth_year), "chain": [_hop(p.name, "birth_year", str(p.birth_year), p.doc_id)]},
        {"template": "mayor_of_birth_city",
         "question": f"Who is the mayor of the city where {p.name} was born?",
         "answer": mayor.name, "chain": [h_born, h_mayor]},
        {"template": "birth_country", "question": f"In which country was {p.name} born?",
         "answer": country.name, "chain": [h_born, h_country]},
    ]
    if comp is not None:
        founder = w.people[comp.founder]
        fcity = w.cities[founder.birth_city]
        hq = w.cities[comp.hq]
        h_emp = _hop(p.name, "works_for", comp.name, p.doc_id)
        h_founder = _hop(comp.name, "founded_by", founder.name, comp.doc_id)
        h_fborn = _hop(founder.name, "born_in", fcity.name, founder.doc_id)
        qs += [
            {"template": "employer", "question": f"Which company does {p.name} work for?",
             "answer": comp.name, "chain": [h_emp]},
            {"template": "employer_founder",
             "question": f"Who founded the company that {p.name} works for?",
             "answer": founder.name, "chain": [h_emp, h_founder]},
            {"template": "employer_hq_country",
             "question": f"In which country is the company that {p.name} works for headquartered?",
             "answer": w.countries[hq.country].name,
             "chain": [h_emp, _hop(comp.name, "headquarters", hq.name, comp.doc_id),
                       _hop(hq.name, "country", w.countries[hq.country].name, hq.doc_id)]},
            {"template": "employer_founder_birth_city",
             "question": f"In which city was the founder of the company that {p.name} works for born?",
             "answer": fcity.name, "chain": [h_emp, h_founder, h_fborn]},
            {"template": "employer_founder_birth_city_mayor",
             "question": f"Who is the mayor of the city where the founder of the company that {p.name} works for was born?",
             "answer": w.people[fcity.mayor].name,
             "chain": [h_emp, h_founder, h_fborn,
                       _hop(fcity.name, "mayor", w.people[fcity.mayor].name, fcity.doc_id)]},
        ]
    for b in (b for b in w.books.values() if b.author == p.id):
        qs.append({"template": "book_author_birth_city",
                   "question": f"In which city was the author of {b.title} born?",
                   "answer": city.name,
                   "chain": [_hop(b.title, "author", p.name, b.doc_id), h_born]})
        break
    return qs


def _qtype(chain: list[dict[str, str]], template: str) -> str:
    if template.startswith("compare"):
        return "comparison"
    return "single" if len(chain) == 1 else "bridge"


def _comparison(w: World, a: Person, b: Person) -> dict[str, Any]:
    earlier = a if a.birth_year < b.birth_year else b
    return {
        "template": "compare_birth_year",
        "question": f"Who was born earlier, {a.name} or {b.name}?",
        "answer": earlier.name,
        "chain": [_hop(a.name, "birth_year", str(a.birth_year), a.doc_id),
                  _hop(b.name, "birth_year", str(b.birth_year), b.doc_id)],
    }


def _make_questions(
    w: World, spec: WorldSpec, rng: random.Random
) -> dict[str, list[dict[str, Any]]]:
    subjects = [p for p in w.people.values() if p.role == "subject"]
    rng.shuffle(subjects)
    n = len(subjects)
    n_train = round(n * spec.split[0])
    n_val = round(n * spec.split[1])
    groups = {
        "train": subjects[:n_train],
        "val": subjects[n_train:n_train + n_val],
        "test": subjects[n_train + n_val:],
    }
    out: dict[str, list[dict[str, Any]]] = {}
    for split, people in groups.items():
        rows: list[dict[str, Any]] = []
        half = len(people) // 2
        part_of = {p.id: ("sft" if i < half else "rl") if split == "train" else split
                   for i, p in enumerate(people)}
        for p in people:
            for q in _subject_questions(w, p):
                # A bridge whose answer already stands in the first passage (e.g. the
                # founder was born in the subject's own city) is a shortcut: drop it.
                first = w.passages[int(q["chain"][0]["doc_id"])]["contents"]
                if len(q["chain"]) > 1 and q["answer"] in first:
                    continue
                q["subjects"] = [p.id]
                rows.append(q)
        # Comparisons pair two subjects of the same split (and the same train half).
        by_part: dict[str, list[Person]] = {}
        for p in people:
            by_part.setdefault(part_of[p.id], []).append(p)
        for members in by_part.values():
            for i in range(0, len(members) - 1, 2):
                a, b = members[i], members[i + 1]
                if a.birth_year != b.birth_year:
                    q = _comparison(w, a, b)
                    q["subjects"] = [a.id, b.id]
                    rows.append(q)
        rng.shuffle(rows)
        items = []
        for i, q in enumerate(rows):
            chain = q["chain"]
            items.append({
                "id": f"world-{split}-{i:05d}",
                "question": q["question"],
                "golden_answers": [q["answer"]],
                "metadata": {
                    "type": _qtype(chain, q["template"]),
                    "hops": len(chain),
                    "template": q["template"],
                    "supporting_ids": list(dict.fromkeys(h["doc_id"] for h in chain)),
                    "part": part_of[q["subjects"][0]],
                    "subjects": [w.people[s].name for s in q["subjects"]],
                    "chain": chain,
                },
            })
        out[split] = items
    return out


# ------------------------------------------------------------------------------ driver


def build_world(size: str = "small", seed: int = 13) -> tuple[World, dict[str, list[dict[str, Any]]]]:
    """Build the world in memory: (entities with passages, {split: FlashRAG rows})."""
    if size not in SIZES:
        raise ValueError(f"unknown world size {size!r}; choose one of {sorted(SIZES)}")
    spec = SIZES[size]
    rng = random.Random(seed)
    w = _build_entities(spec, rng)
    _write_passages(w, rng)
    return w, _make_questions(w, spec, rng)


def generate_world(out: str | Path, size: str = "small", seed: int = 13) -> dict[str, Any]:
    """Write the world to `out` (replacing it atomically). Returns the manifest."""
    w, splits = build_world(size, seed)
    out = Path(out)
    with atomic_dir(out) as tmp:
        write_jsonl(tmp / "corpus.jsonl", w.passages)
        for split, rows in splits.items():
            write_jsonl(tmp / "qa" / f"{split}.jsonl", rows)
        entities = {
            kind: {k: asdict(v) for k, v in getattr(w, kind).items()}
            for kind in ("people", "cities", "countries", "companies", "books", "rivers")
        }
        write_json(tmp / "entities.json", entities, indent=None)
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "generator": "mempo.world",
            "seed": seed,
            "size": size,
            "passages": len(w.passages),
            "questions": {s: len(r) for s, r in splits.items()},
            "types": {s: dict(sorted(Counter(r["metadata"]["type"] for r in rows).items()))
                      for s, rows in splits.items()},
            "hops": {s: dict(sorted(Counter(str(r["metadata"]["hops"]) for r in rows).items()))
                     for s, rows in splits.items()},
            "sha256": {f: sha256_file(tmp / f) for f in files},
        }
        write_json(tmp / "manifest.json", manifest)
    return manifest
