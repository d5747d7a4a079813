"""KFP components of the train stage: GRPO + the memory advantage.

- `train_op`: the local trainer in the step's own pod (the CPU pipeline; one GPU at most);
- `train_rayjob_op`: the cluster pipeline's step. It submits a KubeRay RayJob that runs
  `mempo train verl` on the GPU nodes (mempo.orchestration.rayjob), waits for it, and hands
  the merged HF model on as its `trained` artifact. The pod itself needs one CPU, the run
  volume (mounted by the pipeline, kfp-kubernetes) and rights to create RayJobs.
"""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from components.images import BASE_IMAGE, LOCAL_TRAINER_IMAGE


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
    from mempo.tracking import use_tracking
    from mempo.training.grpo import run_grpo

    use_tracking(mlflow_uri, parent_run_id)
    params = load_params(params_file, overrides={
        **overrides, "train.policy": os.path.join(init.path, "model"), "train.data": data.path,
        "train.retriever": retriever_url or index.path, "train.out": trained.path,
    })
    result = run_grpo(params)
    for k, v in result.items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            metrics.log_metric(k, float(v))


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def train_rayjob_op(
    params_file: str,
    overrides: dict,
    rayjob: dict,
    retriever_url: str,
    parent_run_id: str,
    init: Input[Model],
    data: Input[Dataset],
    trained: Output[Model],
    metrics: Output[Metrics],
) -> None:
    """Runs `rayjob` (a KubeRay RayJob template rendered at compile time from params.yaml
    `cluster:`) on `init/model` and `data`; writes the merged model to `trained/model`."""
    import json
    from pathlib import Path

    from mempo.config import load_params
    from mempo.orchestration.rayjob import train_staged

    params = load_params(params_file, overrides=overrides)
    result = train_staged(
        params.cluster, rayjob, key=trained.uri, policy=Path(init.path) / "model", data=Path(data.path),
        model_out=Path(trained.path) / "model", retriever=retriever_url, parent_run_id=parent_run_id,
        overrides=[f"{k}={json.dumps(v)}" for k, v in overrides.items()],
    )
    metrics.log_metric("rayjob_seconds", float(result["seconds"]))
    if result.get("verl_step") is not None:
        metrics.log_metric("verl_steps", float(result["verl_step"]))
    print(json.dumps(result), flush=True)
