"""KFP component: a Great Expectations data contract; a failure fails the step, so nothing
downstream runs."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Output

from components.images import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def validate_op(
    params_file: str,
    overrides: dict,
    suite: str,
    data: Input[Dataset],
    relpath: str,
    world: Input[Dataset],
    report: Output[Artifact],
) -> int:
    """Run contract `suite` on `data/relpath` (the whole artifact if relpath is empty).

    For `prepared`, the world's test set is the leakage reference. Returns the rows checked.
    """
    import os

    from mempo.config import load_params
    from mempo.validation import validate_data

    params = load_params(params_file, overrides=overrides)
    target = os.path.join(data.path, relpath) if relpath else data.path
    eval_sets = [os.path.join(world.path, "qa", "test.jsonl")] if suite == "prepared" else []
    reports = validate_data(suite, target, params.validation, report_dir=report.path, eval_sets=eval_sets)
    rows = sum(r.rows for r in reports)
    report.metadata.update({"suite": suite, "rows": rows})
    return rows
