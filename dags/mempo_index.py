"""Retrieval index rebuild: validate the corpus -> build the index -> publish it to the service.

Config only (see dags/mempo_dag_common.py). The new index is built into
`<index_root>/<run>/`; `publish` (`mempo index publish`, no shell) repoints
`<index_root>/current` at it with a relative symlink swapped in atomically. In kubernetes
mode the index root is the `mempo-indexes` volume, which the build and publish pods and the
retriever Deployment (containers/retriever/k8s/deployment.yaml) all mount at
`/mnt/mempo-indexes`; `roll_retriever` then restarts the Deployment, whose pods load
`current` and only become Ready once `/health` answers (a rolling update: no downtime), and
`retriever_ready` waits for the rollout.

    airflow dags test mempo_index -c '{"corpus": "data/world/corpus.jsonl", "index_root": "/tmp/idx"}'
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
    INDEX_MOUNT,
    INDEX_VOLUME,
    MODE,
    NAMESPACE,
    PATH_PATTERN,
    RUN_MOUNT,
    RUN_NAME,
    RUN_VOLUME,
    kubectl_task,
    mempo_task,
    ref,
)

KUBERNETES = MODE == "kubernetes"
# In kubernetes mode the index root is the shared index volume itself: a build anywhere
# else would be invisible to the retriever.
INDEX_ROOT_PATTERN = f"^{INDEX_MOUNT}$" if KUBERNETES else PATH_PATTERN

with DAG(
    dag_id="mempo_index",
    description="MemPO: rebuild the retrieval index from the corpus and roll the retrieval service",
    schedule="@monthly",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    dagrun_timeout=timedelta(hours=24),
    tags=["mempo", "retrieval", "mlops"],
    doc_md=__doc__,
    params={
        "corpus": Param(f"{RUN_MOUNT}/data/corpus.jsonl", type="string", pattern=PATH_PATTERN,
                        description="wiki-18 format jsonl(.gz)"),
        "index_root": Param(INDEX_MOUNT, type="string", pattern=INDEX_ROOT_PATTERN,
                            description="one folder per build + `current` (kubernetes: the index volume)"),
        "project_dir": Param(os.environ.get("MEMPO_PROJECT_DIR", "/app"), type="string", pattern=PATH_PATTERN,
                             description="local mode: the checkout the CLI runs in (params.yaml)"),
        "params_file": Param("params.yaml", type="string", pattern=PATH_PATTERN,
                             description="the params file, relative to project_dir"),
    },
) as dag:
    env = {
        "MEMPO_PARAMS_FILE": "{{ params.params_file }}",
        "MEMPO_CORPUS": "{{ params.corpus }}",
        "MEMPO_INDEX_ROOT": "{{ params.index_root }}",
        "MEMPO_BUILD": RUN_NAME,
    }
    common = ["--params", ref("MEMPO_PARAMS_FILE")]
    out = ref("MEMPO_INDEX_ROOT") + "/" + ref("MEMPO_BUILD")
    volumes = (RUN_VOLUME, INDEX_VOLUME)

    validate_corpus = mempo_task(
        "validate_corpus",
        [*common, "validate", "--suite", "corpus", "--data", ref("MEMPO_CORPUS"), "--report", out + "-validation"],
        env=env, mounts=volumes, cpu="4", memory="16Gi", doc="the corpus contract; a failure stops the rebuild",
    )
    build = mempo_task(
        "build_index",
        [*common, "index", "build", "--corpus", ref("MEMPO_CORPUS"), "--out", out],
        env=env, mounts=volumes, image_name="index", gpus=1, cpu="16", memory="128Gi", timeout=timedelta(hours=12),
        doc="embeddings + FAISS (or BM25) with a manifest; resumes an interrupted build",
    )
    publish = mempo_task(
        "publish",
        ["index", "publish", "--root", ref("MEMPO_INDEX_ROOT"), "--build", ref("MEMPO_BUILD")],
        env=env, mounts=(INDEX_VOLUME,), timeout=timedelta(minutes=10),
        doc="repoint `current` at the new index (a relative symlink, renamed into place)",
    )
    validate_corpus >> build >> publish
    if KUBERNETES:
        roll = kubectl_task(
            "roll_retriever", ["rollout", "restart", "deployment/mempo-retriever", "-n", NAMESPACE],
            service_account="mempo-index-publisher", timeout=timedelta(minutes=10),
            doc="restart the retrieval Deployment so its pods load the new `current`",
        )
        ready = kubectl_task(
            "retriever_ready",
            ["rollout", "status", "deployment/mempo-retriever", "-n", NAMESPACE, "--timeout=30m"],
            service_account="mempo-index-publisher", timeout=timedelta(minutes=35),
            doc="wait until every retriever pod serves the new index (readiness on /ready)",
        )
        publish >> roll >> ready
