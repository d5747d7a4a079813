"""KFP component: verl-schema training data from the world's QA sets (gated by the contracts)."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Output

from components.images import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def data_op(params_file: str, overrides: dict, world: Input[Dataset], data: Output[Dataset]) -> int:
    """Writes `data/{train,val}.parquet`, the SFT teacher's tasks `data/{sft,sft_val}.parquet`
    and the summary; returns the row count."""
    import os

    from mempo.config import load_params
    from mempo.data import run_data_stage

    qa = os.path.join(world.path, "qa")
    params = load_params(params_file, overrides={
        **overrides,
        "data.sources": [
            {"name": "world", "path": os.path.join(qa, "train.jsonl"), "split": "train"},
            {"name": "world", "path": os.path.join(qa, "val.jsonl"), "split": "val"},
        ],
        "data.eval_sets": [os.path.join(qa, "test.jsonl")],
        "data.out": data.path,
        "sft.world": world.path,
        "validate.out": os.path.join(os.path.dirname(data.path), "validation"),
    })
    result = run_data_stage(params.data, params.validation, params)
    rows = sum(result.rows.values()) if isinstance(result.rows, dict) else int(result.rows)
    data.metadata["rows"] = rows
    return rows
