"""The offline knowledge world: a seeded, fictional encyclopedia with QA sets.

    mempo world generate --out data/world --size small --seed 13

See `mempo.world.generate.generate_world` for the layout it writes.
"""

from mempo.world.entities import SIZES, WorldSpec
from mempo.world.generate import generate_world

__all__ = ["SIZES", "WorldSpec", "generate_world"]
