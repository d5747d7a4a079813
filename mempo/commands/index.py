"""`mempo index build`: corpus -> retrieval index folder (BM25 or dense FAISS)."""

from __future__ import annotations

import argparse
import json

from mempo.commands import params_from


def register(sub: argparse._SubParsersAction) -> None:
    from mempo.cli import add_subparser

    index = add_subparser(sub, "index", "the retrieval index (BM25 or dense FAISS)")
    isub = index.add_subparsers(dest="index_command", metavar="ACTION", required=True)
    b = add_subparser(isub, "build", "build an index folder from a wiki-18-format corpus")
    b.add_argument("--corpus", default=None, help="corpus .jsonl(.gz) (params: index.corpus)")
    b.add_argument("--out", default=None, help="index folder (params: index.out)")
    b.add_argument("--method", choices=["dense", "bm25"], default=None, help="params: index.method")
    b.add_argument("--encoder", default=None,
                   help="all-MiniLM-L6-v2 (packaged) or a local model folder (params: index.encoder)")
    b.add_argument("--index-type", choices=["flat", "hnsw", "ivfpq"], default=None,
                   help="dense FAISS index type (params: index.index_type)")
    b.add_argument("--hnsw-m", type=int, default=None)
    b.add_argument("--hnsw-ef-construction", type=int, default=None)
    b.add_argument("--hnsw-ef-search", type=int, default=None)
    b.add_argument("--ivf-nlist", type=int, default=None)
    b.add_argument("--ivf-nprobe", type=int, default=None)
    b.add_argument("--pq-m", type=int, default=None)
    b.add_argument("--pq-nbits", type=int, default=None)
    b.add_argument("--pq-rerank", type=int, default=None)
    b.add_argument("--batch-size", type=int, default=None, help="passages per encoder pass")
    b.add_argument("--shard-size", type=int, default=None, help="passages per embedding shard")
    b.add_argument("--device", default=None, help="cpu | cuda (params: index.device)")
    b.add_argument("--faiss-gpu", action="store_true", default=None, help="build FAISS on GPU 0")
    b.add_argument("--ray", action="store_true", default=None, help="embed with Ray Data")
    b.add_argument("--ray-actors", type=int, default=None, help="Ray actor pool size")
    b.add_argument("--reuse-embeddings", default=None, metavar="INDEX_DIR",
                   help="reuse the embedding shards of a dense index of the same corpus/encoder")
    b.set_defaults(handler=_build)
    p = add_subparser(isub, "publish", "repoint ROOT/current at ROOT/BUILD (atomic; the index DAG's publish step)")
    p.add_argument("--root", required=True, help="index root: one folder per build + `current`")
    p.add_argument("--build", required=True, help="the new build's folder name inside --root")
    p.set_defaults(handler=_publish)


def _build(args: argparse.Namespace) -> int:
    from mempo.retrieval.index import build_index

    keys = ["corpus", "out", "method", "encoder", "index_type", "hnsw_m", "hnsw_ef_construction",
            "hnsw_ef_search", "ivf_nlist", "ivf_nprobe", "pq_m", "pq_nbits", "pq_rerank",
            "batch_size", "shard_size", "device", "faiss_gpu", "ray", "ray_actors"]
    p = params_from(args, {f"index.{k}": getattr(args, k) for k in keys}).index
    index_params = {k: getattr(p, k) for k in ("hnsw_m", "hnsw_ef_construction", "hnsw_ef_search",
                                               "ivf_nlist", "ivf_nprobe", "pq_m", "pq_nbits",
                                               "pq_rerank")}
    manifest = build_index(
        p.corpus, p.out, method=p.method, encoder=p.encoder, index_type=p.index_type,
        index_params=index_params, batch_size=p.batch_size, shard_size=p.shard_size,
        device=p.device, faiss_gpu=p.faiss_gpu, use_ray=p.ray, ray_actors=p.ray_actors,
        ray_address=p.ray_address or None, bm25_k1=p.bm25_k1, bm25_b=p.bm25_b,
        reuse_embeddings_from=args.reuse_embeddings,
    )
    print(json.dumps({k: manifest.get(k) for k in ("method", "index_type", "count", "dim",
                                                   "build_seconds")}))
    print(f"index written to {p.out}")
    return 0


def _publish(args: argparse.Namespace) -> int:
    from mempo.orchestration.publish import publish_index

    print(json.dumps(publish_index(args.root, args.build)))
    return 0
