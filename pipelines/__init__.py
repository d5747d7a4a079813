"""Kubeflow pipelines composed from components/ (compiled YAML beside each)."""
