"""Weekly MemPO retraining: data prepare -> validate -> train -> eval -> register -> promote.

Config only: every task is one `mempo` CLI call (see dags/mempo_dag_common.py), run locally
or in the stage's image by a KubernetesPodOperator (`MEMPO_AIRFLOW_MODE=kubernetes`).
Each run writes under its own folder `<workdir>/<run_id>/`; the retrieval service is the
shared `mempo-retriever` Service (containers/retriever/k8s/), or an index folder locally.

    airflow dags test mempo_retrain -c '{"workdir": "/tmp/runs", "qa_dir": "data/world/qa", ...}'
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

# The scheduler puts the dags folder on sys.path; a bare DagBag or a dag bundle may not.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mempo_dag_common import DEFAULT_ARGS, MODE, RUN_DIR, RUN_MOUNT, mempo_task  # noqa: E402

LOCAL = MODE == "local"
RUN = RUN_DIR

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
                         description="parent folder of every run's outputs (shared volume in kubernetes mode)"),
        "project_dir": Param(os.environ.get("MEMPO_PROJECT_DIR", "/app"), type="string",
                             description="local mode: the checkout the CLI runs in (params.yaml)"),
        "params_file": Param("params.yaml", type="string", description="the params file, relative to project_dir"),
        "qa_dir": Param(f"{RUN_MOUNT}/data/qa", type="string",
                        description="FlashRAG QA sets: train.jsonl, val.jsonl, test.jsonl"),
        "init_model": Param(f"{RUN_MOUNT}/models/sft", type="string",
                            description="the checkpoint RL starts from (the SFT cold start), a folder or models:/ URI"),
        "retriever": Param("http://mempo-retriever.mempo.svc.cluster.local:8013", type="string",
                           description="retrieval service URL, or an index folder (in-process) locally"),
        "model_name": Param("mempo-agent", type="string", description="MLflow registered model"),
        "eval_limit": Param(200, type="integer", minimum=1, description="questions per benchmark"),
    },
) as dag:
    common = ["--params", "{{ params.params_file }}"]
    qa = "{{ params.qa_dir }}"

    prepare = mempo_task(
        "prepare_data",
        [*common,
         "--set", f"data.sources=[{{name: world, path: {qa}/train.jsonl, split: train}}, "
                  f"{{name: world, path: {qa}/val.jsonl, split: val}}]",
         "--set", f"data.eval_sets=[{qa}/test.jsonl]",
         "--set", f"data.out={RUN}/data",
         "--set", f"validate.out={RUN}/validation",
         "data", "prepare"],
        cpu="4", memory="16Gi", doc="verl-schema parquet; gates its inputs (qa contract) before writing",
    )
    validate = mempo_task(
        "validate_data",
        [*common, "validate", "--suite", "prepared", "--data", f"{RUN}/data",
         "--report", f"{RUN}/validation/prepared", "--eval-set", f"{qa}/test.jsonl"],
        doc="the prepared-data contract; a failure stops the run before training",
    )
    train = mempo_task(
        "train",
        [*common,
         "--set", "train.policy={{ params.init_model }}",
         "--set", f"train.data={RUN}/data",
         "--set", "train.retriever={{ params.retriever }}",
         "--set", f"train.out={RUN}/train",
         "train", "grpo"],
        image_name="train", gpus=8, cpu="64", memory="512Gi", timeout=timedelta(hours=48),
        doc="GRPO + memory advantage (local trainer here; the verl image runs `mempo train verl`)",
    )
    evaluate = mempo_task(
        "evaluate",
        [*common,
         "--set", f"eval.model={RUN}/train/model",
         "--set", "eval.retriever={{ params.retriever }}",
         "--set", "eval.limit={{ params.eval_limit }}",
         "--set", f"eval.out={RUN}/eval",
         "--set", f"benchmarks.world={qa}/test.jsonl",
         "eval"],
        image_name="eval", gpus=1, cpu="8", memory="64Gi", timeout=timedelta(hours=8),
        doc="memory agent vs baselines on every benchmark; metrics.json decides promotion",
    )
    register = mempo_task(
        "register",
        [*common,
         "--set", "register.model_name={{ params.model_name }}",
         "--set", f"register.model_dir={RUN}/train/model",
         "--set", f"register.metrics={RUN}/eval/metrics.json",
         "--set", f"register.data={{train_data: {RUN}/data, qa: {qa}}}",
         "--set", f"register.out={RUN}/register",
         "register"],
        doc="an MLflow model version with the eval metrics and data versions as tags",
    )
    promote = mempo_task(
        "promote",
        [*common, "promote", "--registered", f"{RUN}/register/registered.json", "--out", f"{RUN}/promote"],
        retries=3, doc="the gate: @challenger -> @champion only if it wins; evidence as version tags",
    )

    prepare >> validate >> train >> evaluate >> register >> promote
