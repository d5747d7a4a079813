"""KFP component: the generated knowledge world (corpus + QA sets)."""

from kfp import dsl
from kfp.dsl import Dataset, Output

from components.images import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def world_op(params_file: str, overrides: dict, world: Output[Dataset]) -> None:
    """Writes `world/corpus.jsonl`, `world/qa/{train,val,test}.jsonl`, `world/manifest.json`."""
    from mempo.config import load_params
    from mempo.world import generate_world

    p = load_params(params_file, overrides={**overrides, "world.out": world.path}).world
    manifest = generate_world(p.out, size=p.size, seed=p.seed)
    world.metadata.update({k: manifest[k] for k in ("size", "seed", "passages", "questions")})
