"""Weekly MemPO retraining: data prepare -> validate -> train -> eval -> register -> promote.

Config only: every task is one `mempo` CLI call (see dags/mempo_dag_common.py), run locally
or in the stage's image by a KubernetesPodOperator (`MEMPO_AIRFLOW_MODE=kubernetes`).
Each run writes under its own folder `<workdir>/<run_id>/`; the retrieval service is the
shared `mempo-retriever` Service (containers/retriever/k8s/), or an index folder locally.

`train` is the local trainer (`mempo train grpo`) in local mode. In kubernetes mode it is
`mempo train rayjob` in a small CPU pod: it submits a KubeRay RayJob that runs
`mempo train verl` on the GPU nodes (sized by params.yaml `cluster:`), waits for it, and
finds the merged model in `<run>/train/model` on the run volume, which the Ray pods mount at
the same path. The pod's service account (`mempo-rayjob-submitter`,
containers/train/k8s/rayjob-rbac.yaml) may create, read and delete RayJobs.

    airflow dags test mempo_retrain -c '{"workdir": "/tmp/runs", "qa_dir": "data/world/qa", ...}'
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

# The scheduler puts the dags folder on sys.path; a bare DagBag or a dag bundle may not.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mempo_dag_common import (  # noqa: E402
    DEFAULT_ARGS,
    MODE,
    NAME_PATTERN,
    PATH_PATTERN,
    RUN_DIR,
    RUN_MOUNT,
    mempo_task,
    ref,
)

LOCAL = MODE == "local"

with DAG(
    dag_id="mempo_retrain",
    description="MemPO: prepare data, validate, train (GRPO + memory advantage), evaluate, register, gated promotion",
    schedule="@weekly",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    dagrun_timeout=timedelta(hours=72),
    tags=["mempo", "training", "mlops"],
    doc_md=__doc__,
    params={
        "workdir": Param(os.environ.get("MEMPO_AIRFLOW_WORKDIR", f"{RUN_MOUNT}/runs"), type="string",
                         pattern=PATH_PATTERN,
                         description="parent folder of every run's outputs (shared volume in kubernetes mode)"),
        "project_dir": Param(os.environ.get("MEMPO_PROJECT_DIR", "/app"), type="string", pattern=PATH_PATTERN,
                             description="local mode: the checkout the CLI runs in (params.yaml)"),
        "params_file": Param("params.yaml", type="string", pattern=PATH_PATTERN,
                             description="the params file, relative to project_dir"),
        "qa_dir": Param(f"{RUN_MOUNT}/data/qa", type="string", pattern=PATH_PATTERN,
                        description="FlashRAG QA sets: train.jsonl, val.jsonl, test.jsonl"),
        "init_model": Param(f"{RUN_MOUNT}/models/sft", type="string", pattern=PATH_PATTERN,
                            description="the checkpoint RL starts from (the SFT cold start), a folder"),
        "retriever": Param("http://mempo-retriever.mempo.svc.cluster.local:8013", type="string",
                           pattern=PATH_PATTERN,
                           description="retrieval service URL, or an index folder (in-process) locally"),
        "model_name": Param("mempo-agent", type="string", pattern=NAME_PATTERN, description="MLflow registered model"),
        "eval_limit": Param(200, type="integer", minimum=1, description="questions per benchmark"),
    },
) as dag:
    # Every DAG-run value reaches the commands through these variables (never as command text).
    env = {
        "MEMPO_PARAMS_FILE": "{{ params.params_file }}",
        "MEMPO_RUN_DIR": RUN_DIR,
        "MEMPO_QA_DIR": "{{ params.qa_dir }}",
        "MEMPO_INIT_MODEL": "{{ params.init_model }}",
        "MEMPO_RETRIEVER": "{{ params.retriever }}",
        "MEMPO_MODEL_NAME": "{{ params.model_name }}",
        "MEMPO_EVAL_LIMIT": "{{ params.eval_limit }}",
    }
    common = ["--params", ref("MEMPO_PARAMS_FILE")]
    run, qa = ref("MEMPO_RUN_DIR"), ref("MEMPO_QA_DIR")

    prepare = mempo_task(
        "prepare_data",
        [*common,
         # YAML built around pattern-checked values, each single-quoted
         "--set", f"data.sources=[{{name: world, path: '{qa}/train.jsonl', split: train}}, "
                  f"{{name: world, path: '{qa}/val.jsonl', split: val}}]",
         "--set", f"data.eval_sets=['{qa}/test.jsonl']",
         "--set", f"data.out={run}/data",
         "--set", f"validate.out={run}/validation",
         "data", "prepare"],
        env=env, cpu="4", memory="16Gi", doc="verl-schema parquet; gates its inputs (qa contract) before writing",
    )
    validate = mempo_task(
        "validate_data",
        [*common, "validate", "--suite", "prepared", "--data", f"{run}/data",
         "--report", f"{run}/validation/prepared", "--eval-set", f"{qa}/test.jsonl"],
        env=env, doc="the prepared-data contract; a failure stops the run before training",
    )
    if LOCAL:
        train = mempo_task(
            "train",
            [*common,
             "--set", "train.policy=" + ref("MEMPO_INIT_MODEL"),
             "--set", f"train.data={run}/data",
             "--set", "train.retriever=" + ref("MEMPO_RETRIEVER"),
             "--set", f"train.out={run}/train",
             "train", "grpo"],
            env=env, timeout=timedelta(hours=48),
            doc="GRPO + memory advantage with the local trainer (one process, CPU or one GPU)",
        )
    else:
        train = mempo_task(
            "train",
            [*common, "train", "rayjob",
             "--policy", ref("MEMPO_INIT_MODEL"), "--data", f"{run}/data", "--out", f"{run}/train",
             "--retriever", ref("MEMPO_RETRIEVER")],
            env=env, cpu="1", memory="1Gi", service_account="mempo-rayjob-submitter",
            # the RayJob's own cost cap (cluster.active_deadline_s, 48 h) + time to schedule
            timeout=timedelta(hours=50), retries=1,
            doc="submits a KubeRay RayJob running `mempo train verl` on the GPU nodes and waits for it; "
                "a retry attaches to (or replaces a failed) job of the same run",
        )
    evaluate = mempo_task(
        "evaluate",
        [*common,
         "--set", f"eval.model={run}/train/model",
         "--set", "eval.retriever=" + ref("MEMPO_RETRIEVER"),
         "--set", "eval.limit=" + ref("MEMPO_EVAL_LIMIT"),
         "--set", f"eval.out={run}/eval",
         "--set", f"benchmarks.world={qa}/test.jsonl",
         "eval"],
        env=env, image_name="eval", gpus=1, cpu="8", memory="64Gi", timeout=timedelta(hours=8),
        doc="memory agent vs baselines on every benchmark; metrics.json decides promotion",
    )
    register = mempo_task(
        "register",
        [*common,
         "--set", "register.model_name=" + ref("MEMPO_MODEL_NAME"),
         "--set", f"register.model_dir={run}/train/model",
         "--set", f"register.metrics={run}/eval/metrics.json",
         "--set", f"register.data={{train_data: '{run}/data', qa: '{qa}'}}",
         "--set", f"register.out={run}/register",
         "register"],
        env=env, doc="an MLflow model version with the eval metrics and data versions as tags",
    )
    promote = mempo_task(
        "promote",
        [*common, "promote", "--registered", f"{run}/register/registered.json", "--out", f"{run}/promote"],
        env=env, retries=3, doc="the gate: @challenger -> @champion only if it wins; evidence as version tags",
    )

    prepare >> validate >> train >> evaluate >> register >> promote
