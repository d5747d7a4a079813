"""Wikipedia-style passages for every entity of the world, from a few sentence templates each.

    from mempo.world.passages import write_passages
    write_passages(world, rng)   # fills world.passages: {"id", "contents": "Title\\ntext"}

Each fact a question's chain hops through is stated in exactly one passage, whose id the
question's `metadata.chain` records. The second draw of `build_world` (after the entities).
"""

from __future__ import annotations

import random

from mempo.world.entities import World

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


def write_passages(w: World, rng: random.Random) -> None:
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
