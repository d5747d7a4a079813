"""The world's entities: sizes, the entity records, and the seeded draw that populates them.

    from mempo.world.entities import SIZES, build_entities
    w = build_entities(SIZES["tiny"], random.Random(13))   # people, cities, ... (no passages yet)

`build_entities` is the first of the three draws `mempo.world.generate.build_world` makes from
one `random.Random` (entities, then passages, then questions): the order of the calls is
part of "same seed and size, same bytes".
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

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


def build_entities(spec: WorldSpec, rng: random.Random) -> World:
    """Draw `spec`'s entities from `rng` (subjects, notable people, places, companies, works)."""
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
