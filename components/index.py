"""KFP component: the retrieval index over the world's corpus (BM25 or dense FAISS)."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Output

from components.images import INDEX_IMAGE


@dsl.component(base_image=INDEX_IMAGE, install_kfp_package=False)
def index_op(params_file: str, overrides: dict, world: Input[Dataset], index: Output[Artifact]) -> None:
    """Builds the index of `world/corpus.jsonl` into the `index` artifact (with its manifest)."""
    import os

    from mempo.config import load_params
    from mempo.retrieval.index import build_index

    p = load_params(params_file, overrides={
        **overrides, "index.corpus": os.path.join(world.path, "corpus.jsonl"), "index.out": index.path,
    }).index
    tuning = {k: getattr(p, k) for k in ("hnsw_m", "hnsw_ef_construction", "hnsw_ef_search", "ivf_nlist",
                                         "ivf_nprobe", "pq_m", "pq_nbits", "pq_rerank")}
    manifest = build_index(
        p.corpus, p.out, method=p.method, encoder=p.encoder, index_type=p.index_type,
        index_params=tuning, batch_size=p.batch_size, shard_size=p.shard_size, device=p.device,
        faiss_gpu=p.faiss_gpu, use_ray=p.ray, ray_actors=p.ray_actors,
        ray_address=p.ray_address or None, bm25_k1=p.bm25_k1, bm25_b=p.bm25_b,
    )
    index.metadata.update({k: manifest.get(k) for k in ("method", "index_type", "count", "dim")})
