"""The tiny policy: a byte-level BPE tokenizer trained on the world, and a small Qwen2 model.

    mempo policy bootstrap --tiny --corpus data/world/corpus.jsonl --out outputs/policy
    from mempo.policy.tiny import TinyPolicySpec, bootstrap_tiny

The tokenizer is trained on the corpus and question files (turn tags and ChatML markers as
added tokens); the model is a Qwen2-architecture causal LM initialised from a seeded config,
optionally warmed up on a copy task (`copy_warmup`) so SFT starts from a model that can
repeat what it reads. Entirely offline; sized to train at ~10k tokens/s on 2 CPU threads.
Writes the same folder contract as the other kinds (`mempo.policy.bootstrap`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mempo.errors import DataError
from mempo.io import atomic_dir, write_json
from mempo.policy.bootstrap import POLICY_MANIFEST

if TYPE_CHECKING:
    from mempo.config.stages import PolicyParams

log = logging.getLogger(__name__)


# ChatML, as Qwen2.5 and SmolLM2 use it, so prompts built for the tiny policy have the same
# shape as for the real ones. `add_generation_prompt` opens the assistant turn.
#
# One difference: the tiny policy's template leaves out system messages. Its model is trained
# from scratch on prompts whose system message is always the same text, so that text tells it
# nothing, and it was about half of every prompt (215 of ~440 tokens of an average SFT sample
# on the small world): dropping it doubles the tokens per second spent on what varies. Real
# models (smollm2, a base model) keep their own templates and read the system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
IM_START, IM_END, END_OF_TEXT, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>"


@dataclass(frozen=True)
class TinyPolicySpec:
    """Size of the tiny policy: the tiny-model keys of the `policy:` section. Its defaults are
    `PolicyParams`' (tests/test_config_derived.py holds them equal), written out because the
    bare GPU machine runs this module without pydantic (scripts/gpu_smoke.py);
    `from_params` builds one from the section. The default (2 x 128, 1.5k vocab, ~0.7M
    parameters) trains at about 10k tokens/s on 2 CPU threads; 4 x 256 was measured at 2.5k
    tokens/s."""

    vocab_size: int = 1536
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 2048
    seed: int = 0
    max_token_chars: int = 0  # longest BPE token in characters (0 = no limit)
    copy_steps: int = 800     # copy warm-up optimiser steps after init (0 = none); see `copy_warmup`
    copy_lr: float = 1e-3     # its constant AdamW LR
    copy_batch: int = 32      # sequences per step

    @classmethod
    def from_params(cls, params: PolicyParams) -> TinyPolicySpec:
        """The spec the `policy:` section asks for (every field is a `policy.` key of the same name)."""
        return cls(**{f.name: getattr(params, f.name) for f in fields(cls)})


def _training_texts(
    corpus: Path, question_files: Sequence[Path], extra_texts: Sequence[str]
) -> Iterator[str]:
    from mempo.datasets import iter_corpus, load_qa

    # The prompt scaffolding appears in every training sample; repeating it makes BPE spend
    # merges on its words so prompts stay short.
    for _ in range(200):
        yield from extra_texts
    for passage in iter_corpus(corpus):
        yield passage.contents
    for qfile in question_files:
        for item in load_qa(qfile):
            yield item.question
            yield from item.golden_answers


def train_tiny_tokenizer(
    texts: Iterable[str], added_tokens: Sequence[str], vocab_size: int = 1536, max_token_chars: int = 0
) -> Any:
    """Train a byte-level BPE tokenizer; returns a `transformers` fast tokenizer.

    `added_tokens` (the turn tags) become single tokens that are *not* special, so decoding
    with `skip_special_tokens=True` keeps them; the ChatML markers are special.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [END_OF_TEXT, IM_START, IM_END, PAD]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        max_token_length=max_token_chars or None,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=None,
        additional_special_tokens=[END_OF_TEXT, IM_START],
    )
    # Tags are added after training so BPE never splits them and never merges across them.
    fast.add_tokens(list(added_tokens))
    fast.chat_template = CHATML_TEMPLATE
    fast.model_max_length = 1 << 20
    fast.padding_side = "left"
    return fast


def build_tiny_model(tokenizer: Any, spec: TinyPolicySpec) -> Any:
    """A freshly initialised Qwen2ForCausalLM sized by `spec`, vocab matching `tokenizer`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def copy_warmup(model: Any, vocab: int, steps: int, lr: float = 1e-3, batch: int = 32,
                min_len: int = 8, max_len: int = 32, seed: int = 0, first_id: int = 0,
                threads: int = 1, progress: bool = True) -> list[float]:
    """Teach a freshly initialised model to copy: `steps` AdamW steps on random token
    sequences shown twice, with the loss on the repeat.

    Why: a pretrained LM can repeat a name it has just read (induction heads); a model
    trained from scratch on SFT data alone does not learn to. Measured on the small world
    (2 x 128): after 2,000 SFT steps, writing a held-out name that sits in the question
    still cost 3-9 nats per token, and repeating it right after writing it 5-8 nats; the
    policy wrote names it had seen in training instead, and held-out EM stayed at 0.
    Random ids (no text) teach the mechanism and no facts. The sequence length varies so
    the model must match content, not a fixed offset; with a fixed length it learns "copy
    from 16 back" instead. On 2 x 128, loss on the repeat stays near log(vocab) for about
    300 steps at LR 1e-3, then drops below 1 within ~100 more (a phase change); LR 3e-3 did
    not get there in 800 steps.

    Args:
        model: a causal LM (trained in place, left in eval mode).
        vocab: ids are drawn from [first_id, vocab).
        steps, lr, batch: optimiser steps, constant LR, sequences per step.
        min_len, max_len: length range of the random sequence (shown twice).
        seed: the data seed.
        threads: torch CPU threads while it runs (restored after; 0 = leave as is). One
            thread avoids OpenMP stalls on these small matrices, as in `sft.threads`.
    Returns: the loss on the repeated half, per step.
    """
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _copy_warmup(model, vocab, steps, lr, batch, min_len, max_len, seed, first_id, progress)
    finally:
        torch.set_num_threads(before)


def _copy_warmup(model: Any, vocab: int, steps: int, lr: float, batch: int, min_len: int, max_len: int,
                 seed: int, first_id: int, progress: bool) -> list[float]:
    import torch
    from tqdm.auto import tqdm

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses: list[float] = []
    bar = tqdm(range(steps), desc="copy warm-up", unit="step", disable=not progress)
    for _ in bar:
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        x = torch.randint(first_id, vocab, (batch, n), generator=gen)
        ids = torch.cat([x, x], dim=1)
        logits = model(input_ids=ids).logits[:, n - 1:-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


def bootstrap_tiny(
    out: str | Path,
    corpus: str | Path,
    question_files: Sequence[str | Path] = (),
    added_tokens: Sequence[str] | None = None,
    spec: TinyPolicySpec | None = None,
    extra_texts: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Train the tiny tokenizer and initialise the tiny Qwen2 policy into `out` (atomic).

    Args:
        out: output folder (replaced whole).
        corpus: wiki-18-format corpus the tokenizer learns from.
        question_files: FlashRAG QA files whose questions and answers it also learns from.
        added_tokens: tokens kept whole (default: the turn tags, `mempo.agent.format.TAGS`).
        spec: model size, init seed and copy warm-up (default: those of the `policy:` section,
            its 800 warm-up steps included; `TinyPolicySpec(copy_steps=0)` skips the warm-up).
        extra_texts: prompt scaffolding the tokenizer should encode compactly (default:
            the user templates of `mempo.agent.format`).
    Returns: the manifest written to `out/policy.json`.
    """
    spec = spec or TinyPolicySpec()
    if added_tokens is None or extra_texts is None:
        from mempo.agent import format as fmt

        added_tokens = fmt.TAGS if added_tokens is None else added_tokens
        # not the system prompt: the tiny chat template leaves it out (see CHATML_TEMPLATE)
        extra_texts = [
            fmt.USER_QUESTION_TEMPLATE, fmt.USER_MEMORY_TEMPLATE,
            fmt.USER_LAST_ACTION_TEMPLATE, fmt.INVALID_TURN_OBSERVATION,
        ] if extra_texts is None else extra_texts
    corpus = Path(corpus)
    if not corpus.exists():
        raise DataError("corpus file not found", path=corpus)
    qfiles = [Path(q) for q in question_files]
    tokenizer = train_tiny_tokenizer(
        _training_texts(corpus, qfiles, extra_texts), added_tokens, spec.vocab_size, spec.max_token_chars
    )
    model = build_tiny_model(tokenizer, spec)
    n_params = sum(p.numel() for p in model.parameters())
    copy: dict[str, Any] = {"steps": spec.copy_steps}
    if spec.copy_steps:
        # ordinary BPE pieces only: after the ChatML specials, before the turn tags
        lo = 1 + max(tokenizer.convert_tokens_to_ids(t) for t in (END_OF_TEXT, IM_START, IM_END, PAD))
        hi = min([tokenizer.convert_tokens_to_ids(t) for t in added_tokens] or [len(tokenizer)])
        losses = copy_warmup(model, hi, spec.copy_steps, spec.copy_lr, spec.copy_batch, seed=spec.seed, first_id=lo)
        tail = losses[-10:]
        copy.update(first_loss=round(losses[0], 4), final_loss=round(sum(tail) / len(tail), 4))
        log.info("copy warm-up: loss on the repeat %.3f -> %.3f over %d steps",
                 losses[0], copy["final_loss"], spec.copy_steps)
        if copy["final_loss"] > 1.0:  # the drop (a phase change) has not happened yet
            log.warning("copy warm-up ended at loss %.2f (> 1.0): the policy may not copy names; "
                        "raise policy.copy_steps", copy["final_loss"])
    manifest = {
        "kind": "tiny",
        "architecture": type(model).__name__,
        "parameters": n_params,
        "vocab_size": len(tokenizer),
        "spec": asdict(spec),
        "corpus": str(corpus),
        "question_files": [str(q) for q in qfiles],
        "added_tokens": list(added_tokens),
        "copy_warmup": copy,
    }
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / POLICY_MANIFEST, manifest)
    log.info("tiny policy: %d parameters, vocab %d -> %s", n_params, len(tokenizer), out)
    return manifest
