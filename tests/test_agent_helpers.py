"""Shared helpers for the agent tests: a real byte-level BPE tokenizer and a tiny Qwen2 model,
both built offline in a second (no hub). Imported by tests/test_agent_*.py and test_advantage.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mempo.agent.format import TAGS

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_bpe_tokenizer(texts: list[str], vocab_size: int = 600) -> Any:
    """A byte-level BPE (Qwen/GPT-2 style) trained on `texts`, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts + TAGS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def corpus_texts(world: Path) -> list[str]:
    """Passage texts of a generated world's corpus."""
    with open(world / "corpus.jsonl", encoding="utf-8") as fh:
        return [json.loads(line)["contents"] for line in fh]


def tiny_qwen2(vocab_size: int, seed: int = 0) -> Any:
    """A randomly initialised 2-layer Qwen2 causal LM (float32, eval mode)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg).eval()
