"""KFP component: the policy the trainers start from (tiny, smollm2 or a checked base model)."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Model, Output

from components.images import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def policy_op(params_file: str, overrides: dict, world: Input[Dataset], policy: Output[Model]) -> None:
    """Writes an HF model folder; the tiny tokenizer is trained on the world's corpus and questions."""
    import os

    from mempo.config import load_params
    from mempo.policy import bootstrap_policy

    p = load_params(params_file, overrides={
        **overrides,
        "policy.out": policy.path,
        "policy.corpus": os.path.join(world.path, "corpus.jsonl"),
        "policy.questions": [os.path.join(world.path, "qa", "train.jsonl")],
    }).policy
    manifest = bootstrap_policy(p)
    policy.metadata.update({k: manifest.get(k) for k in ("kind", "architecture", "parameters")})
