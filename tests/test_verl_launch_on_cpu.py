"""`mempo train verl` on CPU: the planned command is accepted and composed by verl's own
entry point (`main_ppo --cfg job`), inputs, the preflight and the verl pin are checked, the
MLflow URI stays off the command line and out of launch.json, and a checkpoint in verl's FSDP
layout is merged to an HF folder by `verl.model_merger`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from verl_cpu_helpers import REPO_ROOT, subprocess_env, tiny_policy  # noqa: F401

from mempo.config import load_params
from mempo.errors import ConfigError, DataError
from mempo.training.verl_checkpoints import latest_checkpoint, merge_checkpoint
from mempo.training.verl_launch import RETRIEVER_ENV, check_verl_install, hydra_value, plan_verl_run
from mempo.training.verl_preflight import check_inputs


def _params(tmp_path: Path, policy: Path, **extra):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    overrides = {"verl.policy": str(policy), "verl.data": str(data), "verl.out": str(tmp_path / "train"),
                 "verl.retriever": "http://10.1.2.3:8013", **extra}
    return load_params(None, overrides=overrides)


def _fsdp_checkpoint(policy: Path, root: Path, step: int) -> Path:
    """A world-size-1 checkpoint in the layout verl's FSDP checkpoint manager writes."""
    from transformers import AutoModelForCausalLM

    actor = root / f"global_step_{step}" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(policy)
    with torch.no_grad():  # a visible "training" change, so the merge is not a copy of the start
        model.model.embed_tokens.weight.mul_(1.5)
    torch.save(model.state_dict(), actor / "model_world_size_1_rank_0.pt")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    for f in policy.iterdir():
        if f.suffix in (".json", ".jinja") and f.name != "policy.json":
            (actor / "huggingface" / f.name).write_bytes(f.read_bytes())
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    return actor.parent


@pytest.fixture(scope="module")
def launched(tiny_policy, tmp_path_factory):  # noqa: F811
    """Run verl's entry point on the planned command (--cfg job) and the merger, concurrently."""
    tmp = tmp_path_factory.mktemp("launch")
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tmp / 'mlflow.db'}")
    params = _params(tmp, tiny_policy, **{"verl.nnodes": 2, "verl.n_gpus_per_node": 4, "verl.lambda_mem": 0.25,
                                          "verl.overrides": ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"]})
    plan = plan_verl_run(params, mlflow_run_id="0123abcd")
    cfg_proc = subprocess.Popen([*plan.command, "--cfg", "job", "--resolve"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**subprocess_env(), **plan.env})
    step = _fsdp_checkpoint(tiny_policy, tmp / "ckpt", step=7)
    merged = merge_checkpoint(latest_checkpoint(tmp / "ckpt"), tmp / "train" / "model")
    stdout, stderr = cfg_proc.communicate(timeout=300)
    return {"plan": plan, "rc": cfg_proc.returncode, "stdout": stdout, "stderr": stderr, "step": step,
            "merged": merged, "params": params}


def test_verl_entry_point_composes_the_planned_command(launched):
    assert launched["rc"] == 0, launched["stderr"][-2000:]
    cfg = yaml.safe_load(launched["stdout"])
    plan, params = launched["plan"], launched["params"]
    assert cfg["actor_rollout_ref"]["model"]["path"] == str(Path(params.verl.policy).resolve())
    assert cfg["data"]["train_files"].endswith("/data/train.parquet")
    assert cfg["actor_rollout_ref"]["rollout"]["multi_turn"]["tool_config_path"] == str(plan.tool_config)
    assert cfg["trainer"]["nnodes"] == 2 and cfg["trainer"]["n_gpus_per_node"] == 4
    assert cfg["trainer"]["default_local_dir"] == str(plan.checkpoint_dir)
    assert cfg["trainer"]["v1"]["trainer_mode"] == "mempo_sync" and cfg["trainer"]["resume_mode"] == "auto"
    assert cfg["mempo"]["lambda_mem"] == 0.25 and cfg["mempo"]["eps"] == params.mempo.eps
    assert cfg["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"] == 2  # extra override
    env_vars = cfg["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]
    assert "MLFLOW_TRACKING_URI" not in env_vars  # inherited, never printed (verl prints this config)
    assert env_vars["MLFLOW_RUN_ID"] == "0123abcd"
    assert env_vars["VERL_USE_EXTERNAL_MODULES"] == "mempo.verl_plugin"
    assert env_vars[RETRIEVER_ENV] == "http://10.1.2.3:8013"
    assert env_vars["SGLANG_ENABLE_LOGITS_PROCESSER_CHUNK"] == "1"
    assert env_vars["SGLANG_LOGITS_PROCESSER_CHUNK_SIZE"] == "2048"
    # rows per mini-batch: 64 prompts x 4 turn rows per episode (verl multiplies by rollout.n)
    assert cfg["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] == 256
    assert cfg["mempo"]["probe_concurrency"] == 16 and cfg["mempo"]["max_tool_failure_rate"] == 0.2
    assert cfg["actor_rollout_ref"]["rollout"]["multi_turn"]["tool_config_path"] == str(
        REPO_ROOT / "configs" / "verl" / "retrieval_tool.yaml")


def test_checkpoint_merged_to_hf_folder_by_verl_model_merger(launched, tiny_policy):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = launched["merged"]
    model = AutoModelForCausalLM.from_pretrained(merged)
    start = AutoModelForCausalLM.from_pretrained(tiny_policy)
    assert model.dtype == torch.bfloat16  # verl's merger writes bf16, as for the 7B runs

    def as_saved(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()

    torch.testing.assert_close(model.model.embed_tokens.weight.float(), as_saved(start.model.embed_tokens.weight * 1.5))
    torch.testing.assert_close(model.model.layers[0].mlp.up_proj.weight.float(),
                               as_saved(start.model.layers[0].mlp.up_proj.weight))
    assert AutoTokenizer.from_pretrained(merged).encode("<mem>") == AutoTokenizer.from_pretrained(
        tiny_policy).encode("<mem>")
    assert latest_checkpoint(launched["step"].parent) == launched["step"]


def test_plan_takes_lambda_from_train_section_and_joins_a_cluster(tmp_path, tiny_policy, monkeypatch):  # noqa: F811
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///x.db")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    plan = plan_verl_run(_params(tmp_path, tiny_policy, **{"mempo.lambda_mem": 0.0, "verl.ray_address": "auto"}))
    assert "mempo.lambda_mem=0.0" in plan.overrides
    assert plan.env["RAY_ADDRESS"] == "auto" and "MLFLOW_TRACKING_URI" not in plan.env
    assert "MLFLOW_RUN_ID" not in plan.env and not plan.private_env  # inherited from the environment
    assert plan.command[1:4] == ["-m", "verl.trainer.main_ppo", "--config-path"]
    assert plan.model_dir == (tmp_path / "train" / "model").resolve()
    local = plan_verl_run(_params(tmp_path, tiny_policy))
    assert "RAY_ADDRESS" not in local.env  # verl's ray.init() starts a local head


def test_hydra_values_quote_only_when_needed():
    assert hydra_value("data/prepared/train.parquet") == "data/prepared/train.parquet"
    assert hydra_value("sqlite:////tmp/m.db") == "'sqlite:////tmp/m.db'"
    assert hydra_value("1.0") == "'1.0'" and hydra_value("true") == "'true'"
    assert hydra_value("it's") == "'it\\'s'"
    assert hydra_value(True) == "true" and hydra_value(None) == "null" and hydra_value(1e-6) == "1e-06"
    assert hydra_value(["a", 2]) == "[a,2]"


def test_workers_load_the_shipped_tool_config_with_the_retriever_from_the_environment(
        tmp_path, tiny_policy, monkeypatch):  # noqa: F811
    """Every node loads the one tool config of the image; the URL arrives as MEMPO_RETRIEVER_URL
    (the Ray runtime env), resolved by verl's own loader, so no per-run file on one node's disk."""
    from verl.tools.tool_registry import initialize_tools_from_config

    plan = plan_verl_run(_params(tmp_path, tiny_policy))
    assert plan.tool_config == REPO_ROOT / "configs" / "verl" / "retrieval_tool.yaml"
    monkeypatch.setenv(RETRIEVER_ENV, plan.env[RETRIEVER_ENV])
    tools = initialize_tools_from_config(str(plan.tool_config))
    assert tools[0].settings.retriever == "http://10.1.2.3:8013"
    assert tools[0].settings.timeout_s == 10.0
    monkeypatch.delenv(RETRIEVER_ENV)
    assert initialize_tools_from_config(str(plan.tool_config))[0].settings.retriever == "http://127.0.0.1:8013"
    assert not (tmp_path / "train").exists()  # planning writes nothing


def test_missing_inputs_are_named(tmp_path, tiny_policy):  # noqa: F811
    params = _params(tmp_path, tiny_policy)
    plan = plan_verl_run(params)
    with pytest.raises(DataError, match="train.parquet"):
        check_inputs(plan, params)
    (Path(params.verl.data) / "train.parquet").write_bytes(b"")
    with pytest.raises(DataError, match="val.parquet"):
        check_inputs(plan, params)
    no_policy = _params(tmp_path, tmp_path / "nowhere")
    with pytest.raises(DataError, match="config.json"):
        check_inputs(plan_verl_run(no_policy), no_policy)


def test_verl_pin_is_checked(tmp_path):
    assert check_verl_install() == "0.9.1"
    wrong = tmp_path / "REQUIRED_VERL.txt"
    wrong.write_text("verl==0.8.0\n")
    with pytest.raises(ConfigError, match="pinned to 0.8.0"):
        check_verl_install(wrong)


def test_cli_dry_run_prints_the_command(tmp_path, tiny_policy, capsys, monkeypatch):  # noqa: F811
    from mempo.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'm.db'}")
    rc = main(["--params", str(tmp_path / "none.yaml"), "train", "verl", "--dry-run", "--policy", str(tiny_policy),
               "--nnodes", "3", "trainer.save_freq=5"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dry_run"] is True and out["verl"] == "0.9.1"
    assert "verl.trainer.main_ppo" in out["command"] and "trainer.nnodes=3" in out["command"]
    assert out["command"].rstrip().endswith("trainer.save_freq=5")
    assert not (Path(out["out"]) / "verl").exists()  # a dry run writes nothing


STAND_IN_TRAINER = '''#!{python}
"""Stands in for `python -m verl.trainer.main_ppo ...` (no GPUs here): records what it was
given and writes a world-size-1 checkpoint in verl's FSDP layout, like one training step."""
import json, os, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a and not a.startswith("-"))
root = Path(args["trainer.default_local_dir"])
policy = Path(args["actor_rollout_ref.model.path"])
actor = root / "global_step_1" / "actor"
(actor / "huggingface").mkdir(parents=True)
torch.save(AutoModelForCausalLM.from_pretrained(policy).state_dict(), actor / "model_world_size_1_rank_0.pt")
(actor / "fsdp_config.json").write_text(json.dumps({{"world_size": 1}}))
for f in policy.iterdir():
    if f.suffix in (".json", ".jinja") and f.name != "policy.json":
        (actor / "huggingface" / f.name).write_bytes(f.read_bytes())
(root / "latest_checkpointed_iteration.txt").write_text("1")
Path(os.environ["STAND_IN_RECORD"]).write_text(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ)}}))
sys.exit(int(os.environ.get("STAND_IN_EXIT", "0")))
'''


@pytest.fixture()
def live_retriever(tiny_world):
    """`mempo serve retriever`'s app over the tiny world's corpus, on a loopback port."""
    from mempo.retrieval import InProcessRetriever
    from mempo.retrieval.server import create_app
    from mempo.retrieval.serving import BackgroundServer

    with BackgroundServer(create_app(InProcessRetriever.from_corpus(tiny_world / "corpus.jsonl")), port=0) as srv:
        yield srv.url


@pytest.mark.slow
def test_launch_runs_the_trainer_merges_and_tracks(tmp_path, tiny_policy, mlflow_uri, live_retriever,  # noqa: F811
                                                   monkeypatch):
    """launch_verl end to end with a stand-in for main_ppo: preflight against a live retriever,
    runtime env, MLflow stage run id handed to verl, merge of the written checkpoint,
    launch.json; a tracking URI with credentials reaches the process but no record of it."""
    import sys

    import mlflow

    from mempo.training.verl_launch import launch_verl

    trainer = tmp_path / "main_ppo_stand_in"
    trainer.write_text(STAND_IN_TRAINER.format(python=sys.executable))
    trainer.chmod(0o755)
    record = tmp_path / "record.json"
    monkeypatch.setenv("STAND_IN_RECORD", str(record))
    params = _params(tmp_path, tiny_policy, **{"verl.retriever": live_retriever})
    for split in ("train", "val"):
        (Path(params.verl.data) / f"{split}.parquet").write_bytes(b"PAR1")
    summary = launch_verl(params, python=str(trainer))

    seen = json.loads(record.read_text())
    assert seen["argv"][:2] == ["-m", "verl.trainer.main_ppo"]
    assert seen["env"]["VERL_USE_EXTERNAL_MODULES"] == "mempo.verl_plugin"
    assert seen["env"]["MLFLOW_TRACKING_URI"] == mlflow_uri
    assert f"++ray_kwargs.ray_init.runtime_env.env_vars.{RETRIEVER_ENV}='{live_retriever}'" in seen["argv"]
    run = mlflow.get_run(seen["env"]["MLFLOW_RUN_ID"])  # verl logs into our stage run
    assert run.info.run_name == "train_verl" and run.data.params["nnodes"] == "1"
    assert Path(summary["model"], "config.json").exists() and summary["exit_code"] == 0
    launch = json.loads((tmp_path / "train" / "verl" / "launch.json").read_text())
    assert launch["checkpoint"].endswith("global_step_1") and launch["preflight"]["retriever"] == live_retriever

    # credentials in the tracking URI: in the trainer's environment, nowhere in argv or launch.json
    import shutil

    shutil.rmtree(tmp_path / "train")
    secret_uri = "https://mempo:s3cret-token@mlflow.example.invalid"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", secret_uri)
    summary = launch_verl(params, python=str(trainer), tracking=False)
    seen = json.loads(record.read_text())
    assert seen["env"]["MLFLOW_TRACKING_URI"] == secret_uri
    assert not any("s3cret" in a for a in seen["argv"])
    assert "s3cret" not in (tmp_path / "train" / "verl" / "launch.json").read_text()
    assert "s3cret" not in json.dumps(summary)

    # a failed run: the error says where resume_mode=auto will pick up; nothing is merged
    from mempo.errors import MempoError

    shutil.rmtree(tmp_path / "train")
    monkeypatch.setenv("STAND_IN_EXIT", "3")
    with pytest.raises(MempoError, match="exited with 3.*global_step_1"):
        launch_verl(params, python=str(trainer), tracking=False)
    assert not (tmp_path / "train" / "model").exists()


def test_plan_and_dry_run_never_show_the_tracking_uri(tmp_path, tiny_policy, monkeypatch):  # noqa: F811
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mempo:s3cret-token@mlflow.example.invalid")
    plan = plan_verl_run(_params(tmp_path, tiny_policy), mlflow_run_id="r1")
    assert "s3cret" not in plan.shell() and not any("s3cret" in o for o in plan.overrides)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setenv("MEMPO_PROJECT_ROOT", str(tmp_path))
    local = plan_verl_run(_params(tmp_path, tiny_policy))
    # no URI in the environment: the default store goes to the process, still not into records
    assert local.private_env == {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"}
    assert "mlflow.db" not in local.shell()


def _multi(tmp_path, policy, **extra):
    return _params(tmp_path, policy, **{"verl.nnodes": 2, "verl.shared_dir": str(tmp_path), **extra})


def test_preflight_refuses_what_cannot_work(tmp_path, tiny_policy, live_retriever):  # noqa: F811
    import shutil

    from mempo.training.verl_preflight import preflight

    server = "https://mlflow.example.invalid"
    dead = _params(tmp_path, tiny_policy, **{"verl.retriever": "http://127.0.0.1:9", "verl.preflight_timeout_s": 2})
    with pytest.raises(ConfigError, match="verl.retriever.*does not answer"):
        preflight(plan_verl_run(dead), dead, tracking_uri=server)
    single = _params(tmp_path, tiny_policy, **{"verl.retriever": live_retriever})
    assert preflight(plan_verl_run(single), single, tracking_uri="sqlite:///x.db") == {"retriever": live_retriever}
    cases = [
        (_multi(tmp_path, tiny_policy, **{"verl.retriever": live_retriever, "verl.shared_dir": ""}), server,
         "verl.shared_dir"),
        (_multi(tmp_path, tiny_policy, **{"verl.retriever": live_retriever}), server, "verl.policy.*not under"),
        (_multi(tmp_path, tiny_policy, **{"verl.retriever": str(tmp_path)}), server, "must be a service URL"),
    ]
    shared_policy = tmp_path / "policy"
    shutil.copytree(tiny_policy, shared_policy)
    cases.append((_multi(tmp_path, shared_policy, **{"verl.retriever": live_retriever}), "sqlite:///m.db",
                  "tracking server"))
    for params, uri, match in cases:
        with pytest.raises(ConfigError, match=match):
            preflight(plan_verl_run(params), params, tracking_uri=uri)
    ok = _multi(tmp_path, shared_policy, **{"verl.retriever": live_retriever})
    assert preflight(plan_verl_run(ok), ok, tracking_uri=server)["shared_dir"] == str(tmp_path.resolve())


def test_preflight_probes_every_ray_node(tmp_path, tiny_policy, live_retriever, monkeypatch):  # noqa: F811
    """With a Ray cluster to join, each node must see the output folder, have a tracking URI
    and reach the retriever; the probe's answers decide (the probe itself: next test)."""
    import shutil

    from mempo.training.verl_preflight import node_report, preflight

    policy = tmp_path / "policy"
    shutil.copytree(tiny_policy, policy)
    params = _multi(tmp_path, policy, **{"verl.retriever": live_retriever, "verl.ray_address": "auto"})
    plan = plan_verl_run(params)
    markers = []

    def healthy(address, marker, retriever, timeout):
        markers.append(marker)
        here = node_report(marker, retriever, timeout)  # the real check, run here for node 1
        return [here, {**here, "node": "gpu-1"}]

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.invalid")
    assert preflight(plan, params, tracking_uri="https://m", probe=healthy)["nodes"][1] == "gpu-1"
    assert not Path(markers[0]).exists()  # the marker is removed again

    def broken(address, marker, retriever, timeout):
        return [{"node": "head", "shared": True, "mlflow": True, "retriever": ""},
                {"node": "gpu-1", "shared": False, "mlflow": False, "retriever": "ConnectError: refused"}]

    with pytest.raises(ConfigError, match=r"gpu-1: does not see .*has no MLFLOW_TRACKING_URI.*ConnectError"):
        preflight(plan, params, tracking_uri="https://m", probe=broken)
    with pytest.raises(ConfigError, match="1 alive node"):
        preflight(plan, params, tracking_uri="https://m", probe=lambda *a: broken(*a)[:1])


def test_node_report_checks_what_the_node_sees(tmp_path, live_retriever, monkeypatch):
    from mempo.training.verl_preflight import node_report

    marker = tmp_path / "marker"
    marker.write_text("x")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://m")
    assert node_report(str(marker), live_retriever, 5.0)["shared"] is True
    assert node_report(str(marker), live_retriever, 5.0)["retriever"] == ""
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    gone = node_report(str(tmp_path / "nope"), "http://127.0.0.1:9", 1.0)
    assert gone["shared"] is False and gone["mlflow"] is False and gone["retriever"]


@pytest.mark.slow
def test_probe_runs_on_a_real_ray_cluster(tmp_path, live_retriever):
    """The probe as a Ray task on a local one-node Ray cluster (the scheduling is Ray's)."""
    from mempo.training.verl_preflight import probe_ray_nodes

    marker = tmp_path / "marker"
    marker.write_text("x")
    reports = probe_ray_nodes("", str(marker), live_retriever, 5.0)
    assert len(reports) == 1 and reports[0]["shared"] is True and reports[0]["retriever"] == ""
