"""Retrieval index rebuild: validate the corpus -> build the index -> publish it to the service.

Config only (see dags/mempo_dag_common.py). The new index is built into
`<index_root>/<run_id>/`; `publish` repoints `<index_root>/current` (an atomic symlink swap)
and, in kubernetes mode, restarts the shared `mempo-retriever` Deployment, whose pods load
`current` and only become Ready once `/health` answers (a rolling update: no downtime).

    airflow dags test mempo_index -c '{"corpus": "data/world/corpus.jsonl", "index_root": "/tmp/idx"}'
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

# The scheduler puts the dags folder on sys.path; a bare DagBag or a dag bundle may not.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mempo_dag_common import DEFAULT_ARGS, MODE, RUN_MOUNT, mempo_task  # noqa: E402

RUN = '{{ run_id | replace(":", "-") | replace("+", "_") }}'

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
        "corpus": Param(f"{RUN_MOUNT}/data/corpus.jsonl", type="string", description="wiki-18 format jsonl(.gz)"),
        "index_root": Param(f"{RUN_MOUNT}/indexes", type="string", description="one folder per build + `current`"),
        "project_dir": Param(os.environ.get("MEMPO_PROJECT_DIR", "/app"), type="string",
                             description="local mode: the checkout the CLI runs in (params.yaml)"),
        "params_file": Param("params.yaml", type="string", description="the params file, relative to project_dir"),
    },
) as dag:
    common = ["--params", "{{ params.params_file }}"]
    out = "{{ params.index_root }}/" + RUN

    validate_corpus = mempo_task(
        "validate_corpus",
        [*common, "validate", "--suite", "corpus", "--data", "{{ params.corpus }}",
         "--report", out + "-validation"],
        cpu="4", memory="16Gi", doc="the corpus contract; a failure stops the rebuild",
    )
    build = mempo_task(
        "build_index",
        [*common, "index", "build", "--corpus", "{{ params.corpus }}", "--out", out],
        image_name="index", gpus=1, cpu="16", memory="128Gi", timeout=timedelta(hours=12),
        doc="embeddings + FAISS (or BM25) with a manifest; resumes an interrupted build",
    )
    if MODE == "local":
        from airflow.providers.standard.operators.bash import BashOperator

        publish = BashOperator(
            task_id="publish",
            bash_command=f'ln -sfn "{out}" "{{{{ params.index_root }}}}/.current.tmp" && '
                         'mv -T "{{ params.index_root }}/.current.tmp" "{{ params.index_root }}/current"',
            doc_md="repoint `current` at the new index (rename is atomic)",
        )
    else:
        from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

        publish = KubernetesPodOperator(
            task_id="publish",
            name="mempo-index-publish",
            namespace=os.environ.get("MEMPO_K8S_NAMESPACE", "mempo"),
            image="bitnami/kubectl:1.31.4",
            cmds=["/bin/sh", "-c"],
            arguments=[
                f'ln -sfn "{out}" "{{{{ params.index_root }}}}/.current.tmp" && '
                'mv -T "{{ params.index_root }}/.current.tmp" "{{ params.index_root }}/current" && '
                "kubectl rollout restart deployment/mempo-retriever && "
                "kubectl rollout status deployment/mempo-retriever --timeout=30m"
            ],
            service_account_name="mempo-index-publisher",
            on_finish_action="delete_succeeded_pod",
            doc_md="repoint `current`, roll the retrieval Deployment, wait until it is Ready",
        )

    validate_corpus >> build >> publish
