"""MLflow lineage for every stage: where runs go, how a stage run nests, what it is tagged with.

    from mempo.tracking import stage_run, log_metrics, log_json, log_plot

    with stage_run("train", params=params, data={"train_data": "data/prepared"}) as run:
        log_metrics({"loss": 0.3}, step=10)
        log_json({"eval_em": 0.41}, "metrics.json")
        log_plot("outputs/train/plots/reward.png")

One module per job:

- `where`: the project folder, the tracking URI and artifact root, experiments, on/off.
- `lineage`: git commit, input hashes, the hashes DVC recorded in dvc.lock.
- `runs`: the pipeline's parent run and each stage's nested run (ended FAILED on error).
- `log`: metrics, JSON, plots and files into the active run.

This package re-exports their public names: `mempo.tracking.<name>` is the interface every
stage, KFP component and DAG task calls (about twenty call sites), so a caller needs one
import whatever job the function does. New code may import from the submodules directly.

Set `MEMPO_TRACKING=0` to turn tracking off entirely (stage runs become no-ops).
"""

from mempo.tracking.lineage import (
    data_hashes,
    dvc_recorded_hashes,
    dvc_stage_hashes,
    git_commit,
    path_hash,
    tag_stage_runs_with_dvc_hashes,
)
from mempo.tracking.log import log_file, log_json, log_metrics, log_plot
from mempo.tracking.runs import (
    STAGE_WALL_METRIC,
    active_run_id,
    pipeline_run,
    stage_run,
    stage_wall_times,
)
from mempo.tracking.where import (
    DEFAULT_EXPERIMENT,
    ENV_PARENT_RUN,
    ENV_PROJECT_ROOT,
    ENV_TRACKING_OFF,
    artifact_root,
    configure,
    ensure_experiment,
    project_root,
    tracking_enabled,
    tracking_uri,
    use_tracking,
)

__all__ = [
    "DEFAULT_EXPERIMENT", "ENV_PARENT_RUN", "ENV_PROJECT_ROOT", "ENV_TRACKING_OFF",
    "STAGE_WALL_METRIC", "active_run_id", "artifact_root", "configure", "data_hashes",
    "dvc_recorded_hashes", "dvc_stage_hashes", "ensure_experiment", "git_commit", "log_file",
    "log_json", "log_metrics", "log_plot", "path_hash", "pipeline_run", "project_root",
    "stage_run", "stage_wall_times", "tag_stage_runs_with_dvc_hashes", "tracking_enabled",
    "tracking_uri", "use_tracking",
]
