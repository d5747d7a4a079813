"""A minimal OpenAI-compatible `/v1/completions` server for a local Hugging Face policy.

It is the loopback peer the evaluation's `--backend openai` is tested against (in
production that endpoint is an SGLang or vLLM server); small on purpose: one model, token-id
or text prompts, greedy or sampled, stop strings kept in the output.

    with serve_completions(model_dir, served_name="policy") as base_url:
        ...  # OpenAIGenerator(base_url, "policy", tokenizer)

    python -m mempo.evaluation.openai_server --model outputs/train/final --port 30000

Binds 127.0.0.1 by default. Requests are served one at a time (a lock around the model).
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict


class CompletionRequest(BaseModel):
    """The `/v1/completions` fields this server reads (others, e.g. vLLM/SGLang flags, are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: list[int] | str
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] | str | None = None
    logprobs: int | None = None
    seed: int | None = None


def build_app(model_dir: str | Path, served_name: str = "policy", device: str = "cpu", decoder: str = "fast") -> Any:
    """The FastAPI app: `POST /v1/completions`, `GET /v1/models`, `GET /health`. `decoder`:
    "fast" | "hf" (see `mempo.agent.generation.make_generator`)."""
    import torch
    from fastapi import FastAPI, HTTPException
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mempo.agent.generation import SamplingParams, make_generator

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    generator = make_generator(model, tokenizer, decoder)
    lock = threading.Lock()

    app = FastAPI(title="mempo policy (OpenAI-compatible completions)")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "model": served_name}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_name, "object": "model"}]}

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> dict[str, Any]:
        if req.model != served_name:
            raise HTTPException(404, f"model '{req.model}' is not served here (serving '{served_name}')")
        if req.max_tokens < 1:
            raise HTTPException(400, "max_tokens must be >= 1")
        ids = req.prompt if isinstance(req.prompt, list) else tokenizer.encode(req.prompt, add_special_tokens=False)
        if not ids:
            raise HTTPException(400, "empty prompt")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        sampling = SamplingParams(
            max_new_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
            stop=tuple(stop), seed=req.seed, logprobs=req.logprobs is not None,
        )
        with lock:
            gen = generator.generate([ids], sampling)[0]
        choice: dict[str, Any] = {
            "index": 0,
            "text": gen.text,
            "output_token_ids": gen.token_ids,
            "finish_reason": gen.finish_reason,
            "logprobs": None if gen.logprobs is None else {"token_logprobs": gen.logprobs},
        }
        return {
            "id": f"cmpl-{time.monotonic_ns()}",
            "object": "text_completion",
            "model": served_name,
            "choices": [choice],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(gen.token_ids),
                      "total_tokens": len(ids) + len(gen.token_ids)},
        }

    return app


@contextlib.contextmanager
def serve_completions(
    model_dir: str | Path, served_name: str = "policy", host: str = "127.0.0.1", port: int = 0
) -> Iterator[str]:
    """Run the server in a background thread; yield its base URL (`http://127.0.0.1:PORT`).

    `port=0` picks a free port. The server is stopped when the block exits.
    """
    import uvicorn

    app = build_app(model_dir, served_name)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="openai-completions", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the completions server did not start")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face model folder")
    ap.add_argument("--served-name", default="policy")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--decoder", choices=["fast", "hf"], default="fast", help="in-process generator")
    args = ap.parse_args()
    import uvicorn

    uvicorn.run(build_app(args.model, args.served_name, decoder=args.decoder), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
