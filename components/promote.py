"""KFP component: the promotion gate (`@challenger` -> `@champion` only if it wins).

It reads the live registry ("the current champion"), so the pipeline turns caching off.
"""

from kfp import dsl

from components.images import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def promote_op(params_file: str, overrides: dict, mlflow_uri: str, parent_run_id: str, model_uri: str) -> bool:
    """Gates the version in `model_uri` (`models:/NAME/VERSION`); returns whether it was promoted."""

    from mempo.config import load_params
    from mempo.registry.gate import gate_from_params
    from mempo.registry.promote import promote
    from mempo.tracking import use_tracking

    use_tracking(mlflow_uri, parent_run_id)
    name, version = model_uri.removeprefix("models:/").rsplit("/", 1)
    p = load_params(params_file, overrides=overrides).promote
    decision = promote(name, gate_from_params(p), version=version, lock_wait_s=p.lock_wait_s)
    print(decision.summary())
    return decision.promoted
