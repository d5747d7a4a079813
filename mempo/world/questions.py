"""The world's QA sets: FlashRAG rows with each question's supporting chain, split by subject.

    from mempo.world.questions import make_questions
    splits = make_questions(world, spec, rng)   # {"train": [...], "val": [...], "test": [...]}

Subjects are split train/val/test (and train into two halves, `part: sft|rl`), so no person
asked about in val/test is asked about in train. Every row is
`{"id", "question", "golden_answers", "metadata"}` with `metadata.chain`: one hop per
retrieval (entity, relation, value, passage id). The third draw of `build_world`.
"""

from __future__ import annotations

import random
from typing import Any

from mempo.world.entities import Person, World, WorldSpec


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


def make_questions(
    w: World, spec: WorldSpec, rng: random.Random
) -> dict[str, list[dict[str, Any]]]:
    """`{split: FlashRAG rows}`: each subject's questions, and comparisons, drawn from `rng`."""
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
