"""KFP component: the multi-benchmark evaluation (memory agent vs baselines)."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Model, Output

from components.images import EVAL_IMAGE


@dsl.component(base_image=EVAL_IMAGE, install_kfp_package=False)
def eval_op(
    params_file: str,
    overrides: dict,
    retriever_url: str,
    mlflow_uri: str,
    parent_run_id: str,
    trained: Input[Model],
    world: Input[Dataset],
    index: Input[Artifact],
    evaluation: Output[Artifact],
    metrics: Output[Metrics],
    report: Output[HTML],
) -> float:
    """Evaluates `trained/model`; writes samples, metrics.json, plots and the report into
    `evaluation`, the flat metrics into `metrics`, the HTML report into `report`. Returns the
    memory agent's EM on the world benchmark (the primary metric of the default gate)."""
    import os
    import shutil

    from mempo.config import load_params
    from mempo.evaluation.runner import run_eval
    from mempo.tracking import use_tracking

    use_tracking(mlflow_uri, parent_run_id)
    params = load_params(params_file, overrides={
        **overrides, "eval.model": os.path.join(trained.path, "model"), "eval.out": evaluation.path,
        "eval.retriever": retriever_url or index.path,
        "benchmarks.world": os.path.join(world.path, "qa", "test.jsonl"),
    })
    result = run_eval(params.eval, params.benchmarks)
    for key, value in result.metrics.items():
        metrics.log_metric(key, float(value))
    html = os.path.join(evaluation.path, "report.html")
    if os.path.exists(html):
        shutil.copyfile(html, report.path)
    return float(result.metrics.get("memory/world/em", float("nan")))
