"""KFP component: the SFT cold start on the scripted teacher's memory-format trajectories."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components.images import LOCAL_TRAINER_IMAGE


@dsl.component(base_image=LOCAL_TRAINER_IMAGE, install_kfp_package=False)
def sft_op(
    params_file: str,
    overrides: dict,
    retriever_url: str,
    mlflow_uri: str,
    parent_run_id: str,
    policy: Input[Model],
    world: Input[Dataset],
    data: Input[Dataset],
    index: Input[Artifact],
    sft: Output[Model],
    metrics: Output[Metrics],
) -> None:
    """Writes `sft/model` (HF folder) and its curves: the teacher solves the data step's SFT
    tasks (`data/sft.parquet`); retrieves through `retriever_url` if set, else in process
    from the index artifact."""

    from mempo.config import load_params
    from mempo.tracking import use_tracking
    from mempo.training.sft import run_sft

    use_tracking(mlflow_uri, parent_run_id)
    params = load_params(params_file, overrides={
        **overrides, "sft.policy": policy.path, "sft.world": world.path, "data.out": data.path,
        "sft.retriever": retriever_url or index.path, "sft.out": sft.path,
    })
    result = run_sft(params)
    for k, v in result.items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            metrics.log_metric(k, float(v))
