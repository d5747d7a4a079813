"""The checks before a verl launch: inputs present, retriever reachable, every Ray node ready.

    from mempo.training.verl_preflight import check_inputs, preflight
    check_inputs(plan, params)                            # DataError naming the missing input
    report = preflight(plan, params, tracking_uri=uri)    # ConfigError naming the problem

A refused launch costs no GPU time: the retriever must answer a search from this node; with
`nnodes > 1` every path must be under `verl.shared_dir`, MLflow must be a tracking server (a
sqlite file exists on one node only), and, on a running Ray cluster, a probe task on every
node (`node_report`) must see this run's output folder, have `MLFLOW_TRACKING_URI` and reach
the retriever. `mempo.training.verl_launch` runs them before starting verl.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from mempo.errors import ConfigError, DataError

if TYPE_CHECKING:
    from mempo.training.verl_launch import VerlRunPlan

# Tracking servers every node can reach; a sqlite/file store lives on one node's disk.
_SERVER_SCHEMES = ("http", "https", "databricks")


def check_inputs(plan: VerlRunPlan, params: Any) -> None:
    """DataError naming the missing input (policy folder, train/val parquet, tool config)."""
    if not plan.tool_config.is_file():
        raise ConfigError("no retrieval tool config beside the Hydra config (every node loads this copy)",
                          path=plan.tool_config)
    policy = Path(params.verl.policy)
    if not (policy / "config.json").exists():
        raise DataError("policy folder has no config.json (run `mempo train sft` or `mempo policy`)",
                        path=policy, field="verl.policy")
    for split in ("train", "val"):
        f = Path(params.verl.data) / f"{split}.parquet"
        if not f.exists():
            raise DataError(f"no {split}.parquet (run `mempo data prepare`)", path=f, field="verl.data")


def check_retriever(url: str, timeout_s: float) -> str:
    """"" when `url` (a retrieval service URL) answers a search, else why not."""
    from mempo.retrieval import open_retriever

    try:
        retriever = open_retriever(url, timeout_s=timeout_s, retries=0)
        try:
            retriever.search(["preflight reachability check"], topk=1)
        finally:
            getattr(retriever, "close", lambda: None)()
    except Exception as e:  # noqa: BLE001 - any failure means "not reachable", reported as text
        return f"{type(e).__name__}: {e}"
    return ""


def node_report(marker: str, retriever: str, timeout_s: float) -> dict[str, Any]:
    """What one node sees (run there as a Ray task by `probe_ray_nodes`).

    Returns {"node", "shared" (the marker file is visible), "mlflow" (MLFLOW_TRACKING_URI is
    set; its value stays on the node), "retriever" ("" or the error)}.
    """
    import socket

    return {"node": socket.gethostname(), "shared": os.path.exists(marker),
            "mlflow": bool(os.environ.get("MLFLOW_TRACKING_URI")),
            "retriever": check_retriever(retriever, timeout_s) if retriever.startswith(("http://", "https://")) else ""}


def probe_ray_nodes(address: str, marker: str, retriever: str, timeout_s: float) -> list[dict[str, Any]]:
    """`node_report` on every alive node of the Ray cluster at `address` ("" = a local one)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=address or None, logging_level=logging.WARNING, log_to_driver=False,
             include_dashboard=False if not address else None)
    try:
        report = ray.remote(num_cpus=0)(node_report)
        refs = [report.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            marker, retriever, timeout_s) for n in ray.nodes() if n.get("Alive")]
        return list(ray.get(refs, timeout=3 * timeout_s + 120))
    finally:
        ray.shutdown()


def preflight(plan: VerlRunPlan, params: Any, *, tracking_uri: str,
              probe: Callable[[str, str, str, float], list[dict[str, Any]]] = probe_ray_nodes) -> dict[str, Any]:
    """Refuse a launch that would burn GPU hours on a setup that cannot work (module docstring, 2).

    Returns what was checked (recorded in launch.json); raises ConfigError naming the problem.
    """
    vp = params.verl
    timeout = vp.preflight_timeout_s
    report: dict[str, Any] = {"retriever": vp.retriever}
    is_http = vp.retriever.startswith(("http://", "https://"))
    if is_http:
        why = check_retriever(vp.retriever, timeout)
        if why:
            raise ConfigError(f"the retriever does not answer from this node ({why}); start `mempo serve retriever` "
                              "where every Ray node reaches it (rollouts would only see 'search failed')",
                              field="verl.retriever")
    elif not Path(vp.retriever).exists():
        raise ConfigError("no such index folder or corpus file", path=vp.retriever, field="verl.retriever")
    if vp.nnodes <= 1:
        return report
    if not is_http:
        raise ConfigError("with nnodes > 1 the retriever must be a service URL (an index folder would be loaded "
                          "on every node from that node's disk)", field="verl.retriever")
    if not vp.shared_dir:
        raise ConfigError("nnodes > 1 needs storage every node mounts: set verl.shared_dir (FSDP shards land "
                          "on each rank's disk, and the merge reads them all)", field="verl.shared_dir")
    shared = Path(vp.shared_dir).resolve()
    for name in ("policy", "data", "out"):
        path = Path(getattr(vp, name)).resolve()
        if shared not in (path, *path.parents):
            raise ConfigError(f"is not under verl.shared_dir {shared}: other nodes cannot read it",
                              path=path, field=f"verl.{name}")
    scheme = urlparse(tracking_uri).scheme
    if scheme not in _SERVER_SCHEMES:
        raise ConfigError(f"nnodes > 1 needs an MLflow tracking server (http/https), not a {scheme or 'file'} "
                          "store that exists on one node only: set MLFLOW_TRACKING_URI", field="MLFLOW_TRACKING_URI")
    report["shared_dir"] = str(shared)
    if not vp.ray_address:
        return report
    marker = plan.out / "verl" / f".shared-probe-{uuid.uuid4().hex}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("written by the launcher; every node must see it\n")
    try:
        nodes = probe(vp.ray_address, str(marker), vp.retriever, timeout)
    finally:
        marker.unlink(missing_ok=True)
    problems = [f"{n['node']}: " + ", ".join(
        p for p, bad in (("does not see " + str(plan.out), not n["shared"]), ("has no MLFLOW_TRACKING_URI", not n["mlflow"]),
                         (f"cannot reach the retriever ({n['retriever']})", bool(n["retriever"]))) if bad)
        for n in nodes if not n["shared"] or not n["mlflow"] or n["retriever"]]
    if len(nodes) < vp.nnodes:
        problems.append(f"the Ray cluster has {len(nodes)} alive node(s), nnodes is {vp.nnodes}")
    if problems:
        raise ConfigError("the Ray nodes are not ready: " + "; ".join(problems))
    report["nodes"] = [n["node"] for n in nodes]
    return report
