"""`mempo data prepare` on the tiny knowledge world and on hand-made QA sets: verl schema,
round trip through the trainers' loader, compositions, dedup, leakage, determinism, and
loading with verl's own RLHFDataset and a real (tiny) tokenizer on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mempo.agent.format import build_messages
from mempo.config import Composition, DataParams, DataSource, ValidateParams
from mempo.data import PREPARED_SCHEMA, load_prepared, prepare_data
from mempo.datasets import load_qa
from mempo.errors import ValidationFailed
from mempo.io import sha256_file


def _world_params(world: Path, out: Path, **kw: object) -> DataParams:
    return DataParams(
        sources=[DataSource(name="world", path=str(world / "qa/train.jsonl"), split="train"),
                 DataSource(name="world", path=str(world / "qa/val.jsonl"), split="val")],
        eval_sets=[str(world / "qa/test.jsonl")], out=str(out), **kw,
    )


@pytest.fixture(scope="module")
def prepared(tiny_world: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DataParams]:
    """The default recipe (k=1 all + k=2 on half, train part `rl`), gates on."""
    root = tmp_path_factory.mktemp("data")
    params = _world_params(tiny_world, root / "data", train_parts=["rl"])
    prepare_data(params, ValidateParams(out=str(root / "validation")))
    return root / "data", params


def test_writes_verl_schema_summary_and_manifest(prepared: tuple[Path, DataParams], tiny_world: Path) -> None:
    out, _ = prepared
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "summary.json", "train.parquet", "val.parquet"]
    table = pq.read_table(out / "train.parquet")
    assert table.schema.equals(PREPARED_SCHEMA)
    rows = table.to_pylist()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["splits"]["train"]["rows"] == len(rows)
    # k=1 uses every kept rl question once; k=2 pairs half of them.
    n_rl = sum(1 for q in load_qa(tiny_world / "qa/train.jsonl") if q.metadata.get("part") == "rl")
    by_k = summary["splits"]["train"]["by_k"]
    assert by_k["1"] == n_rl and by_k["2"] == (n_rl // 2) // 2
    assert summary["dropped"]["train_part_filtered"] > 0
    for row in rows[:20]:
        ei = row["extra_info"]
        assert row["agent_name"] == "mem_agent" and row["ability"] == "fact-reasoning"
        assert row["prompt"] == build_messages(ei["question"])
        assert row["reward_model"]["style"] == "rule" and row["reward_model"]["ground_truth"]["target"]
        assert ei["split"] == "train" and ei["k"] == len(ei["objectives"])
    assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["files"]["train.parquet"] == sha256_file(out / "train.parquet")


def test_round_trip_through_the_trainers_loader_keeps_questions_and_answers(
    prepared: tuple[Path, DataParams], tiny_world: Path
) -> None:
    out, _ = prepared
    source = {q.id: q for q in load_qa(tiny_world / "qa/train.jsonl")}
    tasks = load_prepared(out / "train.parquet")
    assert {t.task.k for t in tasks} == {1, 2}
    for t in (p.task for p in tasks):
        originals = [source[i] for i in t.source_ids]
        assert [o.question for o in t.objectives] == [q.question for q in originals]
        assert [o.answers for o in t.objectives] == [q.golden_answers for q in originals]
        if t.k == 1:
            assert t.question == originals[0].question
            assert t.golden_answers == originals[0].golden_answers
        else:
            assert t.question == "; ".join(q.question for q in originals)
            assert list(t.golden_answers) == ["; ".join(q.golden_answers[0] for q in originals)]
        assert all(source[i].metadata["part"] == "rl" for i in t.source_ids)
        assert [o.chain for o in t.objectives] == [q.objectives[0].chain for q in originals]  # chains kept


def test_same_seed_same_bytes_other_seed_other_order(tiny_world: Path, tmp_path: Path) -> None:
    a = prepare_data(_world_params(tiny_world, tmp_path / "a", seed=3, gate=False))
    b = prepare_data(_world_params(tiny_world, tmp_path / "b", seed=3, gate=False))
    c = prepare_data(_world_params(tiny_world, tmp_path / "c", seed=4, gate=False))
    assert sha256_file(Path(a.out) / "train.parquet") == sha256_file(Path(b.out) / "train.parquet")
    ids = [t.task.id for t in load_prepared(Path(a.out) / "train.parquet")]
    other = [t.task.id for t in load_prepared(Path(c.out) / "train.parquet")]
    assert ids != other and a.rows == c.rows


def _write_qa(path: Path, items: list[tuple[str, str, list[str]]]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "question": q, "golden_answers": a}) + "\n"
                            for i, q, a in items))
    return path


def test_dedup_val_overlap_and_leakage_drop_are_counted(tmp_path: Path) -> None:
    train = _write_qa(tmp_path / "train.jsonl", [
        ("t1", "Who founded Acme?", ["Ann"]),
        ("t2", "who founded ACME", ["Ann"]),          # duplicate after normalisation
        ("t3", "Where is Oslo?", ["Norway"]),         # also in val
        ("t4", "What is the capital of Peru?", ["Lima"]),  # also in the eval set
        ("t5", "Who wrote Dune?", ["Herbert"]),
        ("t6", "Who painted the Mona Lisa?", ["Leonardo"]),
    ])
    val = _write_qa(tmp_path / "val.jsonl", [("v1", "Where is Oslo?", ["Norway"]),
                                             ("v2", "Where is Bergen?", ["Norway"])])
    test = _write_qa(tmp_path / "test.jsonl", [("e1", "What is the capital of Peru", ["Lima"])])
    params = DataParams(
        sources=[DataSource(name="toy", path=str(train), split="train"),
                 DataSource(name="toy", path=str(val), split="val")],
        compositions=[Composition(k=1, share=1.0)], eval_sets=[str(test)], out=str(tmp_path / "out"),
    )
    result = prepare_data(params, ValidateParams(out=str(tmp_path / "v")))
    assert result.summary["dropped"] == {"train_duplicate": 1, "train_eval_leak": 1, "train_in_val": 1}
    assert result.summary["dropped_examples"]["train_eval_leak"] == ["toy:t4"]
    kept = sorted(s for t in load_prepared(tmp_path / "out/train.parquet") for s in t.task.source_ids)
    assert kept == ["t1", "t5", "t6"]
    assert result.rows == {"train": 3, "val": 2}


def test_leakage_fail_stops_the_stage_and_names_the_question(tiny_world: Path, tmp_path: Path) -> None:
    test_item = load_qa(tiny_world / "qa/test.jsonl")[0]
    train = _write_qa(tmp_path / "train.jsonl", [("ok1", "Who wrote Dune?", ["Herbert"]),
                                                 ("leak1", test_item.question.lower() + "?",
                                                  test_item.golden_answers)])
    params = DataParams(sources=[DataSource(name="toy", path=str(train), split="train")],
                        compositions=[Composition(k=1)], eval_sets=[str(tiny_world / "qa/test.jsonl")],
                        leakage="fail", out=str(tmp_path / "out"))
    with pytest.raises(ValidationFailed) as info:
        prepare_data(params, ValidateParams(out=str(tmp_path / "v")))
    assert "leak1" in info.value.message and "test.jsonl" in info.value.message
    assert not (tmp_path / "out").exists()


def test_k_objective_mix_up_to_sixteen(tiny_world: Path, tmp_path: Path) -> None:
    params = _world_params(tiny_world, tmp_path / "out", compositions=[Composition(k=16, share=1.0)], gate=False)
    result = prepare_data(params)
    tasks = [p.task for p in load_prepared(tmp_path / "out/train.parquet")]
    assert tasks and all(t.k == 16 and len(t.objectives) == 16 for t in tasks)
    assert result.summary["splits"]["train"]["by_k"] == {"16": len(tasks)}
    assert all(len(set(t.source_ids)) == 16 for t in tasks)


def _tiny_chat_tokenizer(texts: list[str]):  # noqa: ANN202 - a transformers tokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "[PAD]", "<|system|>", "<|user|>", "<|assistant|>"]))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    hf.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return hf


def test_loads_with_verls_rlhf_dataset_and_a_tiny_tokenizer(prepared: tuple[Path, DataParams], tmp_path: Path) -> None:
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    out, _ = prepared
    rows = pq.read_table(out / "train.parquet").to_pylist()
    tokenizer = _tiny_chat_tokenizer([m["content"] for r in rows for m in r["prompt"]])
    config = OmegaConf.create({"max_prompt_length": 4096, "filter_overlong_prompts": True,
                               "filter_overlong_prompts_workers": 1, "cache_dir": str(tmp_path / "cache")})
    dataset = RLHFDataset([str(out / "train.parquet")], tokenizer, config)
    assert len(dataset) == len(rows)  # nothing filtered, nothing failed to tokenize
    sample = dataset[5]
    assert sample["raw_prompt"] == rows[5]["prompt"]
    assert sample["agent_name"] == "mem_agent"
    assert sample["index"] == rows[5]["extra_info"]["index"]
    assert sample["reward_model"]["ground_truth"]["target"] == rows[5]["reward_model"]["ground_truth"]["target"]
    batch = collate_fn([dataset[i] for i in range(4)])
    assert list(batch["agent_name"]) == ["mem_agent"] * 4
    # The verl reward wrapper scores a correct answer with the parquet's own ground truth.
    from mempo.rewards import compute_score

    ei = sample["extra_info"]
    answer = "; ".join(o["golden_answers"][0] for o in ei["objectives"])
    solution = f"<mem> found it </mem> <think> done </think> <answer> {answer} </answer>"
    assert compute_score(sample["data_source"], solution, sample["reward_model"]["ground_truth"], ei) == 1.0


def test_cli_prepare_logs_an_mlflow_stage_run(tiny_world: Path, tmp_path: Path, mlflow_uri: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from mempo.cli import main as cli_main

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "data": {"sources": [{"name": "world", "path": str(tiny_world / "qa/train.jsonl"), "split": "train"}],
                 "eval_sets": [str(tiny_world / "qa/test.jsonl")], "out": str(tmp_path / "data"),
                 "gate": False},
    }))
    assert cli_main(["--params", str(params), "data", "prepare", "--seed", "5"]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[0])
    assert printed["rows"]["train"] > 0 and "val" not in printed["rows"]

    import mlflow

    runs = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`mempo.stage` = 'data'")
    assert len(runs) == 1
    assert runs.iloc[0]["metrics.rows_train"] == printed["rows"]["train"]
    assert runs.iloc[0]["params.data.seed"] == "5"


def test_output_gate_failure_leaves_the_previous_data_untouched(tiny_world: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    params = _world_params(tiny_world, out, gate=False)
    prepare_data(params)
    before = sha256_file(out / "train.parquet")
    strict = ValidateParams(out=str(tmp_path / "v"), bounds={"prompt_max_chars": 50})
    with pytest.raises(ValidationFailed) as info:
        prepare_data(_world_params(tiny_world, out, seed=9), strict)
    assert "the prompt has 1..50 characters" in info.value.message
    assert info.value.path == str(out / "train.parquet") and info.value.row == 1
    assert sha256_file(out / "train.parquet") == before
    assert not list(tmp_path.glob(".tmp-*"))
