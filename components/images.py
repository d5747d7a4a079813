"""The image each component runs in on a cluster (built from containers/<name>/Dockerfile).

`MEMPO_IMAGE_REGISTRY` / `MEMPO_IMAGE_TAG` are read when the pipeline is compiled.
"""

from __future__ import annotations

import os

REGISTRY = os.environ.get("MEMPO_IMAGE_REGISTRY", "ghcr.io/mempo")
TAG = os.environ.get("MEMPO_IMAGE_TAG", "0.1.0")

BASE_IMAGE = f"{REGISTRY}/mempo-base:{TAG}"
INDEX_IMAGE = f"{REGISTRY}/mempo-index:{TAG}"
EVAL_IMAGE = f"{REGISTRY}/mempo-eval:{TAG}"
# The SFT and GRPO components run the local trainer (torch + transformers on one node's
# GPUs) and, being lightweight components, need kfp inside the image: the eval image has
# both (the full lock on CUDA). containers/train is the verl + SGLang image for
# `mempo train verl` on a Ray cluster, which a single KFP pod does not host.
LOCAL_TRAINER_IMAGE = EVAL_IMAGE
