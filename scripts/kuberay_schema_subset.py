"""Regenerate mempo/orchestration/kuberay_rayjob_v1.schema.json from KubeRay's RayJob CRD.

    python scripts/kuberay_schema_subset.py ray.io_rayjobs.yaml KUBERAY_TAG > \
        mempo/orchestration/kuberay_rayjob_v1.schema.json

The input is `ray-operator/config/crd/bases/ray.io_rayjobs.yaml` of a KubeRay release (not
vendored here). The output keeps the `v1` version's openAPIV3Schema for the fields
mempo.orchestration.rayjob_manifest writes (KEEP below), types/enums/required/int-or-string
exactly as the CRD states them, drops descriptions, and forbids any other field: the API server
would prune an unknown (misspelt) field silently, a test should not.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml

CONTAINER = {
    "name": None, "image": None, "imagePullPolicy": None, "ports": {"name": None, "containerPort": None},
    "env": {"name": None, "value": None, "valueFrom": {"secretKeyRef": {"name": None, "key": None, "optional": None}}},
    "resources": {"requests": None, "limits": None},
    "volumeMounts": {"name": None, "mountPath": None, "readOnly": None},
    "securityContext": {"allowPrivilegeEscalation": None},
}
POD = {
    "metadata": None,
    "spec": {
        "containers": CONTAINER,
        "volumes": {"name": None, "persistentVolumeClaim": {"claimName": None, "readOnly": None},
                    "emptyDir": {"medium": None, "sizeLimit": None}},
        "securityContext": {"runAsNonRoot": None, "runAsUser": None, "runAsGroup": None, "fsGroup": None},
        "nodeSelector": None,
        "tolerations": {"key": None, "operator": None, "effect": None},
        "serviceAccountName": None,
    },
}
KEEP = {
    "apiVersion": None, "kind": None, "metadata": None,
    "spec": {
        "entrypoint": None, "runtimeEnvYAML": None, "submissionMode": None, "shutdownAfterJobFinishes": None,
        "ttlSecondsAfterFinished": None, "activeDeadlineSeconds": None, "backoffLimit": None, "suspend": None,
        "rayClusterSpec": {
            "rayVersion": None, "enableInTreeAutoscaling": None,
            "headGroupSpec": {"rayStartParams": None, "template": POD},
            "workerGroupSpecs": {"groupName": None, "replicas": None, "minReplicas": None, "maxReplicas": None,
                                 "rayStartParams": None, "template": POD},
        },
    },
}
KEYS = ("type", "format", "enum", "default", "pattern", "minimum", "maximum", "anyOf", "required", "additionalProperties")


def trim(node: dict[str, Any], keep: dict[str, Any] | None) -> dict[str, Any]:
    """The CRD schema `node` reduced to the properties named in `keep` (None: the node as is)."""
    out = {k: node[k] for k in KEYS if k in node}
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        out.pop("type", None)
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = trim(out["additionalProperties"], None)
    if node.get("type") == "array":
        out["items"] = trim(node["items"], keep)
        return out
    if "properties" in node:
        names = list(node["properties"]) if keep is None else list(keep)
        missing = [n for n in names if n not in node["properties"]]
        if missing:
            raise SystemExit(f"not in the CRD: {missing}")
        out["properties"] = {n: trim(node["properties"][n], None if keep is None else keep[n]) for n in names}
        if keep is not None:
            out["additionalProperties"] = False
            out["required"] = [r for r in node.get("required", [])]
    return out


def main() -> None:
    crd = yaml.safe_load(open(sys.argv[1], encoding="utf-8"))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = trim(version["schema"]["openAPIV3Schema"], KEEP)
    schema = {"$schema": "http://json-schema.org/draft-07/schema#",
              "$comment": (f"Subset of KubeRay {sys.argv[2]} ray-operator/config/crd/bases/ray.io_rayjobs.yaml "
                           "(v1 openAPIV3Schema) for the fields mempo writes; other fields forbidden. "
                           "Regenerate with scripts/kuberay_schema_subset.py."), **schema}
    json.dump(schema, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
