"""The MemPO pipeline on Kubeflow Pipelines v2, composed from components/.

    python -m pipelines.mempo_pipeline          # compile both YAMLs (what `make compile` runs)

Two pipelines from one definition:

- `mempo-pipeline` (pipelines/mempo_pipeline.yaml): the cluster run. Its train step is
  `train_rayjob_op`: a one-CPU pod that submits a KubeRay RayJob running `mempo train verl`
  on the GPU nodes and hands the merged model on. The RayJob template is rendered here, at
  compile time, from params.yaml `cluster:` (`make compile` after changing it) and is a
  constant input of the step, readable in the compiled YAML; the step's pod mounts the run
  volume (`cluster.shared_claim` at `cluster.shared_mount`) where the Ray pods mount it.
  GPU accelerators and limits on SFT, index and eval; CPU/memory on the others;
- `mempo-pipeline-cpu` (pipelines/mempo_pipeline_cpu.yaml): the same steps sized for CPU,
  with the local trainer (`train_op`); the tests run it under `kfp.local.SubprocessRunner`
  on the tiny world.

The retrieval service is the shared `mempo-retriever` Service (containers/retriever/k8s);
`retriever_url=""` makes train and eval load the index artifact in process instead.
Caching is off for the steps that touch the live registry (register, promote) and for the
MLflow parent-run steps; every other step is cached on its inputs.
"""

import sys
from pathlib import Path

from kfp import compiler, dsl, kubernetes

from components.data import data_op
from components.eval import eval_op
from components.index import index_op
from components.lineage import close_parent_run_op, open_parent_run_op
from components.policy import policy_op
from components.promote import promote_op
from components.register import register_op
from components.sft import sft_op
from components.train import train_op, train_rayjob_op
from components.validate import validate_op
from components.world import world_op
from mempo.config import load_params
from mempo.orchestration.rayjob_manifest import base_rayjob

HERE = Path(__file__).resolve().parent
SHARED_RETRIEVER = "http://mempo-retriever.mempo.svc.cluster.local:8013"
CLUSTER = load_params(HERE.parent / "params.yaml").cluster


def build_pipeline(gpu: bool):
    """The pipeline function (`gpu=True`: cluster-sized, `False`: CPU-sized)."""

    name = "mempo-pipeline" if gpu else "mempo-pipeline-cpu"

    def retriever_token(task):
        # the retrieval service's bearer token from its Secret, for the steps that search
        if gpu:
            kubernetes.use_secret_as_env(task, secret_name=CLUSTER.retriever_secret,
                                         secret_key_to_env={CLUSTER.retriever_secret_key: "MEMPO_RETRIEVER_TOKEN"})

    def size(task, cpu: str, memory: str, gpus: int = 0, accelerator: str = "nvidia.com/gpu"):
        if gpu:
            task.set_cpu_request(cpu).set_cpu_limit(cpu).set_memory_request(memory).set_memory_limit(memory)
            if gpus:
                task.set_accelerator_type(accelerator).set_accelerator_limit(gpus)
        return task

    @dsl.pipeline(name=name, description="MemPO: world -> contracts -> index -> data -> policy -> SFT -> "
                  "GRPO + memory advantage -> eval -> register -> gated promotion")
    def mempo_pipeline(
        params_file: str = "params.yaml",
        overrides: dict = {},  # noqa: B006 - KFP pipeline parameters take literal defaults
        retriever_url: str = SHARED_RETRIEVER if gpu else "",
        mlflow_uri: str = "",
        experiment: str = "mempo",
    ) -> bool:
        parent = open_parent_run_op(mlflow_uri=mlflow_uri, experiment=experiment, pipeline_name=name)
        parent.set_display_name("MLflow parent run").set_caching_options(False)
        run_id = parent.output
        common = {"params_file": params_file, "overrides": overrides}

        world = world_op(**common).set_display_name("knowledge world")
        size(world, "2", "8Gi")
        corpus_ok = validate_op(**common, suite="corpus", data=world.outputs["world"], relpath="corpus.jsonl",
                                world=world.outputs["world"]).set_display_name("corpus contract")
        size(corpus_ok, "4", "16Gi")
        index = index_op(**common, world=world.outputs["world"]).after(corpus_ok)
        size(index.set_display_name("retrieval index").set_retry(2), "16", "128Gi", gpus=1)
        data = data_op(**common, world=world.outputs["world"]).set_display_name("training data")
        size(data, "4", "16Gi")
        data_ok = validate_op(**common, suite="prepared", data=data.outputs["data"], relpath="",
                              world=world.outputs["world"]).set_display_name("prepared-data contract")
        size(data_ok, "4", "16Gi")
        policy = policy_op(**common, world=world.outputs["world"]).set_display_name("base policy")
        size(policy, "4", "32Gi")
        sft = sft_op(**common, retriever_url=retriever_url, mlflow_uri=mlflow_uri, parent_run_id=run_id,
                     policy=policy.outputs["policy"], world=world.outputs["world"], data=data.outputs["data"],
                     index=index.outputs["index"])
        size(sft.set_display_name("SFT cold start").set_retry(2), "16", "256Gi", gpus=8)
        retriever_token(sft)
        if gpu:
            train = train_rayjob_op(**common, rayjob=base_rayjob(CLUSTER), retriever_url=retriever_url,
                                    parent_run_id=run_id, init=sft.outputs["sft"], data=data.outputs["data"])
            train.set_display_name("GRPO + memory advantage (verl RayJob)").set_retry(2)
            size(train.after(data_ok), "1", "2Gi")
            kubernetes.mount_pvc(train, pvc_name=CLUSTER.shared_claim, mount_path=CLUSTER.shared_mount)
        else:
            train = train_op(**common, retriever_url=retriever_url, mlflow_uri=mlflow_uri, parent_run_id=run_id,
                             init=sft.outputs["sft"], data=data.outputs["data"], index=index.outputs["index"])
            train.after(data_ok).set_display_name("GRPO + memory advantage").set_retry(2)
        evaluation = eval_op(**common, retriever_url=retriever_url, mlflow_uri=mlflow_uri, parent_run_id=run_id,
                             trained=train.outputs["trained"], world=world.outputs["world"],
                             index=index.outputs["index"])
        size(evaluation.set_display_name("evaluation").set_retry(2), "8", "64Gi", gpus=1)
        retriever_token(evaluation)
        registered = register_op(**common, mlflow_uri=mlflow_uri, parent_run_id=run_id,
                                 trained=train.outputs["trained"], evaluation=evaluation.outputs["evaluation"],
                                 data=data.outputs["data"])
        size(registered.set_display_name("register model version").set_caching_options(False), "2", "8Gi")
        gate = promote_op(**common, mlflow_uri=mlflow_uri, parent_run_id=run_id, model_uri=registered.output)
        size(gate.set_display_name("promotion gate").set_caching_options(False).set_retry(3), "1", "2Gi")
        close = close_parent_run_op(mlflow_uri=mlflow_uri, parent_run_id=run_id, status="FINISHED").after(gate)
        close.set_display_name("close MLflow parent run").set_caching_options(False)
        return gate.output

    return mempo_pipeline


mempo_pipeline = build_pipeline(gpu=True)
mempo_pipeline_cpu = build_pipeline(gpu=False)
COMPILED = {mempo_pipeline: HERE / "mempo_pipeline.yaml", mempo_pipeline_cpu: HERE / "mempo_pipeline_cpu.yaml"}


def compile_all(out_dir: Path | None = None) -> list[Path]:
    """Compile both pipelines to YAML (into `out_dir`, default pipelines/); returns the paths."""
    paths = []
    for pipeline, path in COMPILED.items():
        target = (out_dir / path.name) if out_dir else path
        compiler.Compiler().compile(pipeline, str(target))
        paths.append(target)
    return paths


if __name__ == "__main__":
    for p in compile_all(Path(sys.argv[1]) if len(sys.argv) > 1 else None):
        print(f"compiled {p}")
