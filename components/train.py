"""KFP component: GRPO + the memory advantage (the local trainer; GPU on the cluster)."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components.images import LOCAL_TRAINER_IMAGE


@dsl.component(base_image=LOCAL_TRAINER_IMAGE, install_kfp_package=False)
def train_op(
    params_file: str,
    overrides: dict,
    retriever_url: str,
    mlflow_uri: str,
    parent_run_id: str,
    init: Input[Model],
    data: Input[Dataset],
    index: Input[Artifact],
    trained: Output[Model],
    metrics: Output[Metrics],
) -> None:
    """Trains from `init/model` on `data`; writes `trained/model` (HF folder) and curves."""
    import os

    from mempo.config import load_params
    from mempo.training.grpo import run_grpo

    if mlflow_uri:
        os.environ["MLFLOW_TRACKING_URI"] = mlflow_uri
    if parent_run_id:
        os.environ["MEMPO_PARENT_RUN_ID"] = parent_run_id
    params = load_params(params_file, overrides={
        **overrides, "train.policy": os.path.join(init.path, "model"), "train.data": data.path,
        "train.retriever": retriever_url or index.path, "train.out": trained.path,
    })
    result = run_grpo(params)
    for k, v in result.items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            metrics.log_metric(k, float(v))
