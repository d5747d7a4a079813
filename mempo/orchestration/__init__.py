"""Cluster-side orchestration shared by the Kubeflow components and the Airflow DAGs.

- `mempo.orchestration.rayjob_manifest`: the cluster train step's KubeRay `RayJob` running
  `mempo train verl` (render, validate);
- `mempo.orchestration.rayjob`: that step run (submit, wait, collect);
- `mempo.orchestration.publish`: repoint an index root's `current` at a new build.

The DAG files and components only call these; nothing here runs at DAG-parse time.
"""
