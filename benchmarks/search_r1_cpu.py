"""Start Search-R1's own `search_r1/search/retrieval_server.py`, unchanged, on a CPU machine,
as the baseline server of `benchmarks/retrieval.py --baseline-cmd`.

Search-R1's server calls `.cuda()` on its encoder and inputs, `.half()` on the encoder, and
binds 0.0.0.0:8000. Here those calls are no-ops (the encoder runs in fp32 on the CPU, as
ours does) and uvicorn binds 127.0.0.1:<port>; everything else is its code as published.

    .venv/bin/python benchmarks/retrieval.py --backends onnx-int8 --baseline-cmd \\
      "{python} benchmarks/search_r1_cpu.py <Search-R1 checkout>/search_r1/search/retrieval_server.py \\
       {port} {index_file} {corpus} {model}"

Its endpoint unpacks (results, scores) from a call that returns results only unless the
request has "return_scores": true, so every request the benchmark sends sets it.
"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str]) -> None:
    if len(argv) != 5:
        raise SystemExit("usage: search_r1_cpu.py RETRIEVAL_SERVER_PY PORT INDEX_FILE CORPUS_JSONL MODEL_DIR")
    server, port, index_file, corpus, model = argv
    import torch
    import uvicorn

    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.nn.Module.half = lambda self: self  # type: ignore[method-assign]
    run = uvicorn.run
    uvicorn.run = lambda app, **kw: run(app, host="127.0.0.1", port=int(port), log_level="warning")
    # Any retriever name but bm25 selects its dense retriever; "minilm" adds no query prefix.
    sys.argv = [server, "--index_path", index_file, "--corpus_path", corpus, "--topk", "3",
                "--retriever_name", "minilm", "--retriever_model", model]
    runpy.run_path(server, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
