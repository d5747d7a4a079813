"""KFP components: open and close the MLflow parent run of one pipeline execution.

Every tracking step receives the parent's run id and nests its own stage run under it.
"""

from kfp import dsl

from components.images import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def open_parent_run_op(mlflow_uri: str, experiment: str, pipeline_name: str) -> str:
    """Creates the parent run (status RUNNING) and returns its id."""

    from mlflow import MlflowClient

    from mempo.tracking import configure, ensure_experiment, git_commit, use_tracking

    use_tracking(mlflow_uri)
    uri = configure()
    sha, _ = git_commit()
    run = MlflowClient(uri).create_run(
        ensure_experiment(experiment), run_name=pipeline_name,
        tags={"mempo.stage": "pipeline", "mempo.orchestrator": "kubeflow", "mlflow.source.git.commit": sha},
    )
    return run.info.run_id


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def close_parent_run_op(mlflow_uri: str, parent_run_id: str, status: str) -> None:
    """Ends the parent run with `status` (FINISHED after the last step)."""

    from mlflow import MlflowClient

    from mempo.tracking import configure, use_tracking

    use_tracking(mlflow_uri)
    MlflowClient(configure()).set_terminated(parent_run_id, status=status)
