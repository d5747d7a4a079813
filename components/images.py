"""The image each component runs in on a cluster (built from containers/<name>/Dockerfile).

`MEMPO_IMAGE_REGISTRY` / `MEMPO_IMAGE_TAG` are read when the pipeline is compiled.
"""

from __future__ import annotations

import os

REGISTRY = os.environ.get("MEMPO_IMAGE_REGISTRY", "ghcr.io/mempo")
TAG = os.environ.get("MEMPO_IMAGE_TAG", "0.1.0")

BASE_IMAGE = f"{REGISTRY}/mempo-base:{TAG}"
INDEX_IMAGE = f"{REGISTRY}/mempo-index:{TAG}"
TRAIN_IMAGE = f"{REGISTRY}/mempo-train:{TAG}"
EVAL_IMAGE = f"{REGISTRY}/mempo-eval:{TAG}"
