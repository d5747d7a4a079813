"""KFP component: register the trained policy as an MLflow model version with its evidence."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Model

from components.images import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def register_op(
    params_file: str,
    overrides: dict,
    mlflow_uri: str,
    parent_run_id: str,
    trained: Input[Model],
    evaluation: Input[Artifact],
    data: Input[Dataset],
) -> str:
    """Creates the model version; returns its `models:/NAME/VERSION` URI."""
    import os

    from mempo.config import load_params
    from mempo.registry.gate import gate_from_params
    from mempo.registry.register import register_model
    from mempo.tracking import use_tracking

    use_tracking(mlflow_uri, parent_run_id)
    params = load_params(params_file, overrides=overrides)
    p = params.registration
    result = register_model(
        p.model_name, os.path.join(trained.path, "model"), os.path.join(evaluation.path, "metrics.json"),
        data={"train_data": data.path}, train_metrics_path=os.path.join(trained.path, "metrics.json"),
        gate=gate_from_params(params.promote), params=p,
    )
    return result.model_uri
