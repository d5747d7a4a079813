"""mempo.policy.bootstrap: the tiny policy, base-model checks, SmolLM2 from GGUF (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mempo.errors import DataError


@pytest.fixture(scope="module")
def tiny_policy(tiny_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mempo.policy import TinyPolicySpec, bootstrap_tiny

    out = tmp_path_factory.mktemp("policy") / "tiny"
    bootstrap_tiny(out, tiny_world / "corpus.jsonl", [tiny_world / "qa" / "train.jsonl"],
                   spec=TinyPolicySpec(vocab_size=600, seed=3, copy_steps=0))
    return out


def test_tiny_policy_is_a_loadable_hf_folder_with_tags_and_template(tiny_policy: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mempo.agent.format import TAGS, build_messages, render_prompt

    tok = AutoTokenizer.from_pretrained(tiny_policy)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy)
    for tag in TAGS:
        assert len(tok.encode(tag, add_special_tokens=False)) == 1, tag
    text = render_prompt(tok, build_messages("Who founded X?"))
    assert text.endswith("<|im_start|>assistant\n")
    # The tiny template leaves out the (constant) system message; the user turn is all there.
    assert text == "<|im_start|>user\nQuestion: Who founded X?<|im_end|>\n<|im_start|>assistant\n"
    # The turn tags survive decoding with special tokens skipped; the chat markers do not.
    ids = tok.encode("<mem> a </mem><answer> b </answer><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<mem> a </mem><answer> b </answer>"
    assert model.config.vocab_size == len(tok)
    assert tok.eos_token_id == model.generation_config.eos_token_id
    manifest = json.loads((tiny_policy / "policy.json").read_text())
    assert manifest["kind"] == "tiny"
    assert manifest["parameters"] == sum(p.numel() for p in model.parameters())


def test_tiny_policy_same_seed_same_weights(tiny_world: Path, tiny_policy: Path, tmp_path: Path) -> None:
    from mempo.io import sha256_file
    from mempo.policy import TinyPolicySpec, bootstrap_tiny

    bootstrap_tiny(tmp_path / "again", tiny_world / "corpus.jsonl", [tiny_world / "qa" / "train.jsonl"],
                   spec=TinyPolicySpec(vocab_size=600, seed=3, copy_steps=0))
    for name in ("model.safetensors", "tokenizer.json"):
        assert sha256_file(tmp_path / "again" / name) == sha256_file(tiny_policy / name)


def test_missing_corpus_is_a_data_error_and_writes_nothing(tmp_path: Path) -> None:
    from mempo.policy import bootstrap_tiny

    with pytest.raises(DataError, match="corpus file not found"):
        bootstrap_tiny(tmp_path / "out", tmp_path / "nope.jsonl")
    assert not (tmp_path / "out").exists()


def test_check_base_model_accepts_a_complete_folder_and_records_it(tiny_policy: Path, tmp_path: Path) -> None:
    from mempo.policy import check_base_model, resolve_policy_path

    manifest = check_base_model(tiny_policy, tmp_path / "rec")
    assert manifest["architecture"] == "Qwen2ForCausalLM"
    assert resolve_policy_path(tmp_path / "rec") == tiny_policy.resolve()
    assert resolve_policy_path(tiny_policy) == tiny_policy


def test_check_base_model_names_what_is_missing(tiny_policy: Path, tmp_path: Path) -> None:
    import shutil

    from mempo.policy import check_base_model

    with pytest.raises(DataError, match="no config.json"):
        check_base_model(tmp_path)
    broken = tmp_path / "no-template"
    shutil.copytree(tiny_policy, broken)
    (broken / "chat_template.jinja").unlink()
    cfg = json.loads((broken / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (broken / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(DataError, match="chat template"):
        check_base_model(broken)


def test_cli_bootstrap_tiny(tiny_world: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mempo.cli import main

    out = tmp_path / "p"
    rc = main(["--set", "policy.vocab_size=500", "--set", "policy.copy_steps=3", "policy", "bootstrap", "--tiny",
               "--corpus", str(tiny_world / "corpus.jsonl"),
               "--questions", str(tiny_world / "qa" / "train.jsonl"), "--out", str(out)])
    assert rc == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kind"] == "tiny"
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    warm = json.loads((out / "policy.json").read_text())["copy_warmup"]
    assert warm["steps"] == 3 and warm["first_loss"] > 0


def test_copy_warmup_teaches_a_small_model_to_repeat_what_it_read() -> None:
    """The warm-up's loss on the repeated half falls from ~log(vocab) once the model copies.
    Sized to be quick: a 2 x 32 model, 40 ids, sequences of 4-6."""
    import math

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mempo.policy.tiny import copy_warmup

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg)
    threads = torch.get_num_threads()
    losses = copy_warmup(model, 48, steps=200, lr=3e-3, batch=64, min_len=4, max_len=6, first_id=8,
                         progress=False)
    assert torch.get_num_threads() == threads  # restored
    assert losses[0] > 0.8 * math.log(40)
    assert sum(losses[-40:]) / 40 < 0.7 * math.log(40)
    assert not model.training


@pytest.mark.slow
def test_smollm2_converts_from_the_packaged_gguf(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mempo.agent.format import build_messages, render_prompt
    from mempo.policy import bootstrap_smollm2

    manifest = bootstrap_smollm2(tmp_path / "smol")
    assert manifest["parameters"] > 100_000_000
    tok = AutoTokenizer.from_pretrained(tmp_path / "smol")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "smol")
    assert "<|im_start|>assistant" in render_prompt(tok, build_messages("Who founded X?"))
    assert model.config.model_type == "llama"


def test_tiny_tokenizer_max_token_chars_splits_names_into_short_pieces(tiny_world: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from mempo.datasets import load_qa
    from mempo.policy import TinyPolicySpec, bootstrap_tiny

    names = [h.entity for q in load_qa(tiny_world / "qa" / "test.jsonl") for h in q.objectives[0].chain]
    lengths = {}
    for limit in (0, 5):
        out = tmp_path / f"t{limit}"
        bootstrap_tiny(out, tiny_world / "corpus.jsonl", [tiny_world / "qa" / "train.jsonl"],
                       spec=TinyPolicySpec(vocab_size=600, max_token_chars=limit, copy_steps=0))
        tok = AutoTokenizer.from_pretrained(out)
        pieces = [p for n in names for p in tok.tokenize(" " + n)]
        lengths[limit] = max(len(p.lstrip("Ġ")) for p in pieces)
    assert lengths[5] <= 5 < lengths[0]
