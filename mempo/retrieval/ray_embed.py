"""Embedding with Ray Data: `map_batches` over an actor pool, one GPU per actor if any.

For corpora like wiki-18 (21M passages) on a cluster (`mempo index build --ray`); it also
runs on a laptop with a local Ray (`ray.init()` with this machine's CPUs). Each actor loads
the encoder once and embeds whole batches.

    vecs = embed_with_ray(texts, encoder="all-MiniLM-L6-v2", num_actors=2)   # (n, d) float32
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class _EmbedActor:
    """Ray actor: holds one Encoder, embeds `{"row", "text"}` batches."""

    def __init__(self, encoder: str, device: str, batch_size: int) -> None:
        from mempo.retrieval.encoder import Encoder

        self.encoder = Encoder(encoder, device=device, batch_size=batch_size)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        vecs = self.encoder.encode_passages([str(t) for t in batch["text"]])
        return {"row": batch["row"], "emb": vecs.astype(np.float16)}


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to `address` (a cluster) or start a local Ray, once per process."""
    import ray

    if ray.is_initialized():
        return
    kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                          "ignore_reinit_error": True}
    if address:
        kw["address"] = address
    elif num_cpus:
        kw["num_cpus"] = num_cpus
    ray.init(**kw)


def embed_with_ray(texts: Sequence[str], *, encoder: str, device: str = "cpu",
                   batch_size: int = 64, num_actors: int = 1,
                   address: str | None = None) -> np.ndarray:
    """Embed `texts` on a Ray actor pool; returns float32 (len(texts), dim) in input order.

    `device="cuda"` gives each actor one GPU (`num_gpus=1`); on CPU each actor takes one CPU.
    """
    import ray

    ensure_ray(address)
    ds = ray.data.from_items([{"row": i, "text": t} for i, t in enumerate(texts)])
    gpu = device.startswith("cuda")
    out = ds.map_batches(
        _EmbedActor,
        fn_constructor_kwargs={"encoder": encoder, "device": "cuda" if gpu else "cpu",
                               "batch_size": batch_size},
        batch_size=batch_size,
        batch_format="numpy",
        concurrency=max(1, int(num_actors)),
        num_gpus=1 if gpu else 0,
        num_cpus=0 if gpu else 1,
    )
    rows_parts, emb_parts = [], []
    for batch in out.iter_batches(batch_size=None, batch_format="numpy"):
        rows_parts.append(np.asarray(batch["row"], dtype=np.int64))
        emb_parts.append(np.stack(batch["emb"]) if batch["emb"].dtype == object
                         else np.asarray(batch["emb"]))
    rows = np.concatenate(rows_parts)
    embs = np.concatenate(emb_parts).astype(np.float32)
    result = np.empty_like(embs)
    result[rows] = embs  # Ray does not preserve order across actors; put rows back.
    return result
