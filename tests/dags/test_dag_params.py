"""DAG-run params as a hostile user would pass them: the Param patterns refuse them at trigger
time, and even rendered without that check they reach the `mempo` commands as plain argument
values (a real bash runs the local commands; the Kubernetes pods run no shell at all). Plus
the index volume wiring: builder, publisher and retriever share one claim and one path."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"
RUN_ID = "manual__2026-01-05T00:00:00+00:00"
RUN_NAME = "manual__2026-01-05T00-00-00_00-00"


def _hostile(canary: Path) -> str:
    """Breaks out of single quotes, double quotes, `$()`, backticks and YAML flow syntax."""
    return f"x'; touch {canary}; echo '\"$(touch {canary})`touch {canary}`}}, {{name: evil"


def _bag(mode: str, monkeypatch: pytest.MonkeyPatch, cli: str | None = None):
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("MEMPO_AIRFLOW_MODE", mode)
    if cli:
        monkeypatch.setenv("MEMPO_CLI", cli)
    sys.modules.pop("mempo_dag_common", None)  # the mode and CLI are read when the helper is imported
    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    return bag


def _render(task, params: dict):
    """The task with its templates rendered for one run (what the worker would execute)."""
    rendered = copy.deepcopy(task)
    rendered.render_template_fields({"params": params, "run_id": RUN_ID})
    if hasattr(type(rendered), "build_pod_request_obj"):
        # building the pod asks the hook whether it runs in a cluster (it would load a
        # kubeconfig); there is no cluster here, and the answer only sets one label
        rendered.__dict__["hook"] = SimpleNamespace(is_in_cluster=False)
    return rendered


def _string_params(dag) -> list[str]:
    return [k for k, v in dag.params.dump().items() if isinstance(v, str)]


@pytest.mark.parametrize("mode", ["local", "kubernetes"])
def test_param_patterns_refuse_hostile_values_when_a_run_is_triggered(mode, monkeypatch, tmp_path):
    from airflow.sdk.exceptions import ParamValidationError

    bag = _bag(mode, monkeypatch)
    for dag in bag.dags.values():
        names = _string_params(dag)
        assert names, dag.dag_id
        for name in names:
            params = copy.deepcopy(dag.params)
            with pytest.raises(ParamValidationError, match=name):
                params.update({name: _hostile(tmp_path / "canary")})
            params = copy.deepcopy(dag.params)
            with pytest.raises(ParamValidationError):
                params.update({name: "/data/$(reboot)"})
        # the defaults pass their own patterns
        copy.deepcopy(dag.params).validate()


RECORDER = """#!{python}
import json, os, sys
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def test_local_commands_pass_hostile_values_as_single_arguments(monkeypatch, tmp_path):
    """Every BashOperator rendered with hostile params (Param validation bypassed) and run in
    a real bash: the recorder sees each value inside its argument, and nothing else ran."""
    recorder = tmp_path / "mempo-recorder"
    recorder.write_text(RECORDER.format(python=sys.executable))
    recorder.chmod(0o755)
    canary = tmp_path / "canary"
    evil = _hostile(canary)
    bag = _bag("local", monkeypatch, cli=str(recorder))
    checked = 0
    for dag in bag.dags.values():
        params = {**dag.params.dump(), **{k: evil for k in _string_params(dag)}, "project_dir": str(tmp_path)}
        for task in dag.tasks:
            t = _render(task, params)
            assert evil not in t.bash_command  # values never become command text
            record = tmp_path / f"{dag.dag_id}.{task.task_id}.jsonl"
            env = {"PATH": os.environ["PATH"], **t.env, "RECORD": str(record)}
            proc = subprocess.run(["bash", "-c", t.bash_command], env=env, cwd=tmp_path, capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr
            argv = json.loads(record.read_text().splitlines()[0])
            assert any(evil in a for a in argv), (dag.dag_id, task.task_id, argv)
            assert argv[:2] == ["--params", evil] or argv[:1] == ["index"], argv
            checked += 1
    assert checked == 9  # 6 retrain tasks + validate, build, publish
    assert not canary.exists()


def test_local_train_is_the_local_trainer_and_values_land_where_they_belong(monkeypatch, tmp_path):
    recorder = tmp_path / "rec"
    recorder.write_text(RECORDER.format(python=sys.executable))
    recorder.chmod(0o755)
    dag = _bag("local", monkeypatch, cli=str(recorder)).dags["mempo_retrain"]
    params = {**dag.params.dump(), "workdir": "/runs", "qa_dir": "/qa", "init_model": "/models/sft",
              "retriever": "http://r:8013", "project_dir": str(tmp_path)}
    argvs = {}
    for task_id in ("prepare_data", "train", "register"):
        t = _render(dag.get_task(task_id), params)
        record = tmp_path / f"{task_id}.jsonl"
        subprocess.run(["bash", "-c", t.bash_command], env={"PATH": os.environ["PATH"], **t.env,
                                                            "RECORD": str(record)}, cwd=tmp_path, check=True)
        argvs[task_id] = json.loads(record.read_text())
    sets = dict(a.split("=", 1) for a in argvs["prepare_data"][3::2] if "=" in a)
    assert yaml.safe_load(sets["data.sources"]) == [
        {"name": "world", "path": "/qa/train.jsonl", "split": "train"},
        {"name": "world", "path": "/qa/val.jsonl", "split": "val"}]
    assert sets["data.out"] == f"/runs/{RUN_NAME}/data"
    assert argvs["train"][-2:] == ["train", "grpo"] and f"train.out=/runs/{RUN_NAME}/train" in argvs["train"]
    reg = dict(a.split("=", 1) for a in argvs["register"] if a.startswith("register."))
    assert yaml.safe_load(reg["register.data"]) == {"train_data": f"/runs/{RUN_NAME}/data", "qa": "/qa"}


def test_kubernetes_pods_run_no_shell_and_carry_values_only_in_env(monkeypatch, tmp_path):
    evil = _hostile(tmp_path / "canary")
    bag = _bag("kubernetes", monkeypatch)
    for dag in bag.dags.values():
        params = {**dag.params.dump(), **{k: evil for k in _string_params(dag)}}
        for task in dag.tasks:
            pod = _render(task, params).build_pod_request_obj()
            c = pod.spec.containers[0]
            assert c.command in (["mempo"], ["kubectl"]), (task.task_id, c.command)
            assert not any(evil in a for a in c.args), (task.task_id, c.args)
            if c.command == ["mempo"]:
                env = {e.name: e.value for e in c.env}
                assert any(evil in (v or "") for v in env.values()), task.task_id
                refs = {a.split("$(", 1)[1].split(")", 1)[0] for a in c.args if "$(" in a}
                assert refs and refs <= set(env), (task.task_id, refs)


def test_kubernetes_train_step_submits_a_rayjob_and_asks_no_gpu(monkeypatch):
    dag = _bag("kubernetes", monkeypatch).dags["mempo_retrain"]
    pod = _render(dag.get_task("train"), dag.params.dump()).build_pod_request_obj()
    c = pod.spec.containers[0]
    assert c.args[c.args.index("train"):c.args.index("train") + 2] == ["train", "rayjob"]
    assert "nvidia.com/gpu" not in (c.resources.limits or {})
    assert pod.spec.service_account_name == "mempo-rayjob-submitter"
    assert not pod.spec.node_selector and not pod.spec.tolerations
    # the submitting pod sees the run volume where the Ray pods write the merged model
    from mempo.config import load_params

    cluster = load_params(REPO / "params.yaml").cluster
    claims = {v.name: v.persistent_volume_claim.claim_name for v in pod.spec.volumes}
    assert {m.mount_path: claims[m.name] for m in c.volume_mounts} == {cluster.shared_mount: cluster.shared_claim}


def _mounts(pod) -> dict[str, str]:
    claims = {v.name: v.persistent_volume_claim.claim_name for v in pod.spec.volumes}
    return {m.mount_path: claims[m.name] for m in pod.spec.containers[0].volume_mounts}


def test_index_builder_publisher_and_retriever_share_one_claim_and_path(monkeypatch):
    from airflow.sdk.exceptions import ParamValidationError

    dag = _bag("kubernetes", monkeypatch).dags["mempo_index"]
    deployment = yaml.safe_load((REPO / "containers/retriever/k8s/deployment.yaml").read_text())
    spec = deployment["spec"]["template"]["spec"]
    retriever = spec["containers"][0]
    volumes = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
    served = {m["mountPath"]: volumes[m["name"]] for m in retriever["volumeMounts"] if m["name"] in volumes}
    (index_mount, index_claim), = served.items()
    assert retriever["args"][retriever["args"].index("--index") + 1] == f"{index_mount}/current"

    params = dag.params.dump()
    assert params["index_root"] == index_mount
    build = _render(dag.get_task("build_index"), params).build_pod_request_obj()
    publish = _render(dag.get_task("publish"), params).build_pod_request_obj()
    assert _mounts(build)[index_mount] == index_claim
    assert _mounts(publish) == {index_mount: index_claim}
    env = {e.name: e.value for e in build.spec.containers[0].env}
    out = build.spec.containers[0].args[build.spec.containers[0].args.index("--out") + 1]
    assert out == "$(MEMPO_INDEX_ROOT)/$(MEMPO_BUILD)" and env["MEMPO_INDEX_ROOT"] == index_mount
    assert env["MEMPO_BUILD"] == RUN_NAME
    assert params["corpus"].startswith(next(p for p, c in _mounts(build).items() if c != index_claim))
    with pytest.raises(ParamValidationError):  # a root the retriever cannot see is refused
        copy.deepcopy(dag.params).update({"index_root": "/mnt/mempo/indexes"})
    assert [t.task_id for t in dag.get_task("publish").downstream_list] == ["roll_retriever"]


def test_local_publish_runs_mempo_index_publish_without_a_shell_pipeline(monkeypatch, tmp_path):
    """The rendered publish step, run for real: `current` becomes a relative link to the build."""
    wrapper = tmp_path / "mempo"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -m mempo.cli \"$@\"\n")
    wrapper.chmod(0o755)
    dag = _bag("local", monkeypatch, cli=str(wrapper)).dags["mempo_index"]
    root = tmp_path / "indexes"
    (root / RUN_NAME).mkdir(parents=True)
    (root / RUN_NAME / "manifest.json").write_text("{}")
    (root / "old").mkdir()
    os.symlink("old", root / "current")
    t = _render(dag.get_task("publish"), {**dag.params.dump(), "index_root": str(root), "project_dir": str(tmp_path)})
    assert "ln " not in t.bash_command and "mv " not in t.bash_command and "&&" not in t.bash_command
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), **t.env}
    proc = subprocess.run(["bash", "-c", t.bash_command], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert os.readlink(root / "current") == RUN_NAME
    assert json.loads(proc.stdout)["previous"] == "old"


def test_task_factory_refuses_templates_and_undeclared_references():
    sys.path.insert(0, str(DAGS))
    from mempo_dag_common import bash_word, check_args, k8s_arg

    with pytest.raises(ValueError, match="template"):
        check_args(["--out", "{{ params.x }}"], {})
    with pytest.raises(ValueError, match="MEMPO_Y"):
        check_args(["${MEMPO_Y}/a"], {"MEMPO_X": "{{ params.x }}"})
    assert bash_word('a"b`c$d${MEMPO_X}/e') == '"a\\"b\\`c\\$d${MEMPO_X}/e"'
    assert k8s_arg("$(date)-${MEMPO_X}") == "$$(date)-$(MEMPO_X)"
    out = subprocess.run(["bash", "-c", "printf %s " + bash_word("$(id)`id`${MEMPO_X}")],
                         env={"MEMPO_X": "'; id"}, capture_output=True, text=True, check=True).stdout
    assert out == "$(id)`id`'; id"


def test_the_retriever_roll_runs_as_a_service_account_allowed_to_do_exactly_that(monkeypatch):
    """The index DAG's kubectl pods run as mempo-index-publisher; its Role (in
    containers/retriever/k8s/publisher-rbac.yaml) grants what `rollout restart` and `rollout
    status` need on the retriever Deployment, in the Deployment's namespace, and no more."""
    dag = _bag("kubernetes", monkeypatch).dags["mempo_index"]
    deployment = yaml.safe_load((REPO / "containers/retriever/k8s/deployment.yaml").read_text())
    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "containers/retriever/k8s/publisher-rbac.yaml").read_text())}
    name, namespace = deployment["metadata"]["name"], deployment["metadata"]["namespace"]
    granted: set[tuple[str, str | None]] = set()
    for rule in docs["Role"]["rules"]:
        assert rule["apiGroups"] == ["apps"] and rule["resources"] == ["deployments"], rule
        for verb in rule["verbs"]:
            for res_name in rule.get("resourceNames", [None]):
                granted.add((verb, res_name))
    assert granted == {("get", name), ("patch", name), ("list", None), ("watch", None)}
    binding = docs["RoleBinding"]
    assert binding["roleRef"]["name"] == docs["Role"]["metadata"]["name"]
    account = docs["ServiceAccount"]["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"], "namespace": namespace}]
    assert {d["metadata"]["namespace"] for d in docs.values()} == {namespace}
    for task_id, verb in (("roll_retriever", "restart"), ("retriever_ready", "status")):
        pod = _render(dag.get_task(task_id), dag.params.dump()).build_pod_request_obj()
        c = pod.spec.containers[0]
        assert pod.spec.service_account_name == account["name"], task_id
        assert c.command == ["kubectl"] and c.args[:3] == ["rollout", verb, f"deployment/{name}"], c.args
        assert c.args[c.args.index("-n") + 1] == namespace
