"""Made-up, pronounceable names, unique within a world, so no model knows them from pretraining."""

from __future__ import annotations

import random

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "j", "k", "kh", "l", "m", "n", "p",
           "qu", "r", "s", "sh", "st", "t", "th", "tr", "v", "w", "z", "zh"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ai", "ei", "ia", "io", "ou", "y"]
_CODAS = ["", "", "", "l", "n", "r", "s", "th", "m", "nd", "rk", "x", "sk", "v"]
_CITY_ENDS = ["ford", "haven", "mere", "dale", "bury", "wick", "stead", "holm", "gate", "port",
              "field", "moor"]
_COUNTRY_ENDS = ["ia", "ora", "ania", "eth", "istan", "avia", "onia"]
_COMPANY_KINDS = ["Systems", "Industries", "Holdings", "Works", "Labs", "Group", "Foundry",
                  "Logistics", "Media", "Textiles", "Robotics", "Mills"]
_BOOK_NOUNS = ["Harbor", "Lantern", "Orchard", "Winter", "Mirror", "Tide", "Garden", "Tower",
               "Compass", "River", "Feather", "Ember", "Salt", "Archive", "Meadow", "Bridge"]
_BOOK_ADJS = ["Glass", "Silent", "Last", "Crimson", "Hollow", "Northern", "Paper", "Distant",
              "Burning", "Quiet", "Golden", "Broken", "Lost", "Iron", "Velvet", "Ninth"]
_RIVER_ENDS = ["a", "en", "ine", "ar", "is", "uun"]


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def _word(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(_syllable(rng) for _ in range(rng.randint(lo, hi))).capitalize()


class NameFactory:
    """Draws unique names of each kind from one RNG (same seed, same names)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def _unique(self, make) -> str:  # type: ignore[no-untyped-def]
        for _ in range(10_000):
            name = make()
            key = name.lower()
            if key not in self.used and len(name) <= 40:
                self.used.add(key)
                return name
        raise RuntimeError("name space exhausted; lower the world size")

    def surnames(self, n: int) -> list[str]:
        return [self._unique(lambda: _word(self.rng, 2, 2)) for _ in range(n)]

    def person(self, surnames: list[str]) -> str:
        # Shared surnames make families: a search for one surname returns several people.
        return self._unique(lambda: f"{_word(self.rng, 1, 2)} {self.rng.choice(surnames)}")

    def city(self) -> str:
        return self._unique(lambda: _word(self.rng, 1, 2) + self.rng.choice(_CITY_ENDS))

    def country(self) -> str:
        return self._unique(lambda: _word(self.rng, 1, 2) + self.rng.choice(_COUNTRY_ENDS))

    def company(self) -> str:
        return self._unique(lambda: f"{_word(self.rng, 2, 2)} {self.rng.choice(_COMPANY_KINDS)}")

    def book(self) -> str:
        return self._unique(
            lambda: f"The {self.rng.choice(_BOOK_ADJS)} {self.rng.choice(_BOOK_NOUNS)} of {_word(self.rng, 1, 2)}"
        )

    def river(self) -> str:
        return self._unique(lambda: _word(self.rng, 1, 2) + self.rng.choice(_RIVER_ENDS))


# Words of entity names that are ordinary vocabulary ("Textiles", "The Golden Tower"), not
# made-up names: renaming (mempo.training.sft_data.rename_entities) leaves them alone.
GENERIC_NAME_WORDS: frozenset[str] = frozenset(_COMPANY_KINDS + _BOOK_NOUNS + _BOOK_ADJS + ["The", "of"])


def fresh_word(rng: random.Random) -> str:
    """A made-up capitalised word of 1-3 syllables (not checked against any world)."""
    return _word(rng, 1, 3)
