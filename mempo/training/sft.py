"""SFT cold start: teach the policy the memory format from correct trajectories.

    mempo train sft --policy outputs/policy --data data/prepared --out outputs/sft   # after `mempo data prepare`
    mempo train sft --policy outputs/policy --trajectories my_trajs.jsonl --out outputs/sft

One training sample per assistant turn: the memory-context prompt of that turn (system,
question, previous memory, last action + observation; chat-templated) -> the assistant's
turn. The loss is the token-mean cross-entropy on the assistant tokens only (prompt tokens
are labelled -100). Prompt and response are tokenised separately and concatenated, exactly
as the rollout tokenises them, so SFT and RL see the same token boundaries.

Trajectories come from the scripted teacher, run on the tasks the data stage wrote
(`data.out/sft.parquet`, `sft_val.parquet`; `mempo.data.sft_split`), or from any jsonl of
turns, episodes or episode records (`sft.trajectories`; formats in
`mempo.training.sft_data`). Episode records are rendered in `rollout.context`: the memory
agent's prompts (MemPO) or the whole history (the Search-R1-style baseline), so both
policies learn from the same teacher episodes. The teacher's correct episodes are written as
records to `OUT/trajectories/{train,val}_episodes.jsonl` (and, rendered, to
`{train,val}.jsonl`); the full-history baseline's SFT stage reads them instead of running
the teacher again. This module holds the sample types and the training loop; the data is
`mempo.training.sft_data`'s, the stage's setup and ending `mempo.training.stage`'s.

Writes `OUT/model/` (HF folder), `OUT/metrics.json`, `OUT/history.jsonl`, `OUT/plots/sft_loss.png`,
and checkpoints under `OUT/checkpoints/` (resumable with `--resume auto`).
"""

from __future__ import annotations

import logging
import math
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mempo.errors import DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTSample:
    """One supervised turn: chat `messages` (ending with the user turn) -> `response` text."""

    messages: list[dict[str, str]]
    response: str


@dataclass(frozen=True)
class TokenizedSample:
    """`input_ids` = prompt ids + response ids (+ eos); `n_prompt` leading ids carry no loss,
    except those `prompt_lm` marks (True) when the trainer adds a prompt LM loss. A sample
    merged from several turns (`merge_prefix_turns`) lists every response's `[start, end)`
    in `spans`; those tokens carry the loss, the rest of the sample is their prompt."""

    input_ids: list[int]
    n_prompt: int
    prompt_lm: tuple[bool, ...] | None = None
    spans: tuple[tuple[int, int], ...] | None = None

    def loss_spans(self) -> tuple[tuple[int, int], ...]:
        return self.spans if self.spans is not None else ((self.n_prompt, len(self.input_ids)),)


_INFO_RE = re.compile(r"<information>.*?(</information>|$)", re.S)


def _encode_prompt(tokenizer: Any, text: str, prompt_lm: bool) -> tuple[list[int], tuple[bool, ...] | None]:
    """The prompt's token ids and, with `prompt_lm`, per token: True outside `<information>`
    blocks (from the same call's offsets). Retrieved passages stay out of the prompt LM loss
    so the policy never learns corpus facts by heart from them."""
    if not prompt_lm:
        return tokenizer.encode(text, add_special_tokens=False), None
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [m.span() for m in _INFO_RE.finditer(text)]
    return list(enc["input_ids"]), tuple(not any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"])


def tokenize_samples(
    samples: Sequence[SFTSample], tokenizer: Any, max_tokens: int | None = None, prompt_lm: bool = False,
) -> list[TokenizedSample]:
    """Tokenise prompt and response separately (as the rollout does) and append eos.

    Samples longer than `max_tokens` keep their response and lose prompt tokens from the
    left (the system prompt goes first; the question and memory stay). Samples whose
    response alone exceeds `max_tokens` are dropped with a warning. `prompt_lm`: also mark
    the prompt tokens outside retrieved passages for the prompt LM loss (`collate`).
    """
    from mempo.agent.format import render_prompt

    out: list[TokenizedSample] = []
    dropped = 0
    eos = tokenizer.eos_token_id
    for s in samples:
        p, lm = _encode_prompt(tokenizer, render_prompt(tokenizer, s.messages), prompt_lm)
        r = tokenizer.encode(s.response, add_special_tokens=False) + ([eos] if eos is not None else [])
        if max_tokens is not None and len(p) + len(r) > max_tokens:
            if len(r) >= max_tokens:
                dropped += 1
                continue
            cut = len(p) + len(r) - max_tokens
            p, lm = p[cut:], (lm[cut:] if lm is not None else None)
        out.append(TokenizedSample(p + r, len(p), lm))
    if dropped:
        log.warning("dropped %d SFT samples whose response exceeds %s tokens", dropped, max_tokens)
    return out


def merge_prefix_turns(samples: Sequence[TokenizedSample], max_tokens: int | None = None) -> list[TokenizedSample]:
    """Merge runs of consecutive samples in which each sample's ids (prompt + response + eos)
    are a prefix of the next one's prompt: the turns of one full-history (Search-R1 style)
    episode. The merged sample is the last turn's ids with every turn's response as a loss
    span. Causal attention gives each response token exactly the logits it has in its own
    sample, so the loss per response token is unchanged, and an episode of T turns costs one
    forward pass over its final length instead of T passes over growing prefixes. The check
    is on token ids: a turn whose prompt was re-tokenised differently or cut to `max_tokens`
    starts a new sample. Memory-context turns never extend each other (the memory replaces
    the history), so they come back as they are.
    """
    from mempo.training.prefix import chained_runs

    def extends(prev: TokenizedSample, smp: TokenizedSample) -> bool:
        return (len(smp.input_ids) > len(prev.input_ids) and smp.input_ids[:len(prev.input_ids)] == prev.input_ids
                and (max_tokens is None or len(smp.input_ids) <= max_tokens))

    out: list[TokenizedSample] = []
    for run in chained_runs(samples, extends):
        last = run[-1]
        spans = tuple(sp for smp in run for sp in smp.loss_spans())
        out.append(last if len(run) == 1 else TokenizedSample(last.input_ids, last.n_prompt, last.prompt_lm, spans))
    return out


def collate(batch: Sequence[TokenizedSample], pad_id: int, prompt_weight: float = 0.0) -> dict[str, Any]:
    """Right-pad a batch. Returns input_ids, attention_mask, labels: LongTensor [B, T], and
    loss_weights: FloatTensor [B, T] (1 on response tokens, `prompt_weight` on the prompt
    tokens a sample's `prompt_lm` marks, 0 elsewhere)."""
    import torch

    width = max(len(s.input_ids) for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    weights = torch.zeros((len(batch), width), dtype=torch.float32)
    for r, s in enumerate(batch):
        n = len(s.input_ids)
        ids[r, :n] = torch.tensor(s.input_ids)
        att[r, :n] = 1
        if prompt_weight > 0 and s.prompt_lm is not None:
            weights[r, :s.n_prompt] = prompt_weight * torch.tensor(s.prompt_lm, dtype=torch.float32)
        for a, b in s.loss_spans():
            labels[r, a:b] = ids[r, a:b]
            weights[r, a:b] = 1.0
    return {"input_ids": ids, "attention_mask": att, "labels": labels, "loss_weights": weights}


def token_loss(model: Any, batch: dict[str, Any], device: Any, reference: bool = False,
               share_prefix: bool = True) -> tuple[Any, float]:
    """Weighted sum of next-token cross-entropy (`loss_weights`; without them, 1 on labelled
    tokens) and the sum of the weights. Divide for the weighted token mean; with no prompt
    weight that is the mean over assistant tokens.

    Logits come only from the positions whose next token has a weight, and a right-padded
    batch (as `collate` pads) runs without its mask (`mempo.training.forward.logits_at`):
    the padding and retrieved passages that make up most of an SFT batch get no LM head. The
    leading tokens every sample shares (chat template, system prompt) run once, LM head
    included (`_shared_prefix_loss`; `share_prefix=False` runs them per sample, as
    benchmarks/sft_step.py's `unshared` way).
    `reference` is the model's own forward instead: the mask, logits at every position (what
    the tests compare with).

    Returns (loss_sum: scalar tensor, weight_sum: float).
    """
    import torch.nn.functional as F

    from mempo.training.forward import has_plain_head, logits_at, right_padded, shared_prefix_length

    ids = batch["input_ids"].to(device)
    att = batch["attention_mask"].to(device)
    weights = batch.get("loss_weights")
    weights = (batch["labels"] != -100).float() if weights is None else weights
    weights = weights.to(device)[:, 1:]  # weights[:, t]: the token at t + 1, predicted at t
    targets = ids[:, 1:]
    if reference:
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
        return (ce * weights.reshape(-1)).sum(), float(weights.sum())
    shared = shared_prefix_length(ids, att) if share_prefix and has_plain_head(model) and right_padded(att) else 0
    if shared:
        return _shared_prefix_loss(model, ids, weights, shared), float(weights.sum())
    sel = weights != 0
    # share_prefix=False: the check above already found no shared prefix to run once
    logits = logits_at(model, ids, att, F.pad(sel, (0, 1)), share_prefix=False).float()  # [positions with a weight, V]
    ce = F.cross_entropy(logits, targets[sel], reduction="none")
    return (ce * weights[sel]).sum(), float(weights.sum())


def _shared_prefix_loss(model: Any, ids: Any, weights: Any, n_prefix: int) -> Any:
    """`token_loss`'s weighted sum for a right-padded batch whose first `n_prefix` ids every
    row shares (the chat template and system prompt): the prefix runs once
    (`mempo.training.forward.prefix_hidden`), and so does the LM head at its positions, whose
    predictions of the prefix's own next tokens are the same in every row: one cross-entropy
    there, weighted by the rows' weights summed. The prediction at the prefix's last position
    (of each row's first own token) and everything after it are per row.
    ids: [B, T]; weights: [B, T - 1] (weights[:, t]: the token at t + 1)."""
    import torch
    import torch.nn.functional as F

    from mempo.training.forward import prefix_hidden

    rows = ids.shape[0]
    head, tail = prefix_hidden(model, ids, n_prefix)  # [P, H], [B, T - P, H]
    w_head = weights[:, :n_prefix - 1].sum(0)  # [P - 1]: predictions of ids 1..P-1, equal in every row
    sel_head = w_head != 0
    ce_head = F.cross_entropy(model.lm_head(head[:-1][sel_head]).float(), ids[0, 1:n_prefix][sel_head],
                              reduction="none")
    # Positions P-1 .. T-2, predicting ids P .. T-1: the prefix's last hidden state, then the row's own.
    hidden = torch.cat([head[-1:][None].expand(rows, -1, -1), tail[:, :-1]], 1)  # [B, T - P, H]
    w_tail = weights[:, n_prefix - 1:]
    sel_tail = w_tail != 0
    ce_tail = F.cross_entropy(model.lm_head(hidden[sel_tail]).float(), ids[:, n_prefix:][sel_tail], reduction="none")
    return (ce_head * w_head[sel_head]).sum() + (ce_tail * w_tail[sel_tail]).sum()


def length_bucketed_batches(
    lengths: Sequence[int], batch_size: int, seed: int, epoch: int
) -> list[list[int]]:
    """Shuffled batches of similar length (less padding), reproducible per (seed, epoch).

    Indices are shuffled, cut into chunks of 50 batches, sorted by length inside a chunk,
    batched, and the batch order is shuffled again.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    chunk = batch_size * 50
    batches: list[list[int]] = []
    for c in range(0, len(idx), chunk):
        part = sorted(idx[c:c + chunk], key=lambda i: lengths[i])
        batches.extend(part[b:b + batch_size] for b in range(0, len(part), batch_size))
    rng.shuffle(batches)
    return batches


def evaluate_loss(model: Any, data: Sequence[TokenizedSample], batch_size: int, pad_id: int, device: Any) -> float:
    """Token-mean validation loss (nats per assistant token) over `data`."""
    import torch

    if not data:
        return float("nan")
    model.eval()
    total, count = 0.0, 0
    order = sorted(range(len(data)), key=lambda i: len(data[i].input_ids))
    with torch.no_grad():
        for b in range(0, len(order), batch_size):
            loss, n = token_loss(model, collate([data[i] for i in order[b:b + batch_size]], pad_id), device)
            total += float(loss)
            count += n
    model.train()
    return total / max(count, 1)


def make_optimizer(model: Any, lr: float, weight_decay: float, warmup_steps: int, total_steps: int) -> tuple[Any, Any]:
    """AdamW + linear warmup then cosine decay to 10% of `lr` over `total_steps`."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(warmup_steps, 1)
        progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def run_sft(params: Any, tracking: bool = True) -> dict[str, Any]:
    """Run the SFT stage: `params` is the whole `mempo.config.Params` (reads `sft`, `agent`,
    `mempo`). Returns the final metrics.

    Steps: teacher trajectories (or a jsonl) -> tokenise -> AdamW on the assistant-token
    loss, checkpoints every `checkpoint_every` steps (`resume: auto` continues), validation
    loss every `eval_every` steps -> `OUT/model` (HF folder), logged to MLflow with the
    metrics and curves. An exception ends the MLflow run FAILED.
    """
    from mempo.data.sft_split import sft_split_paths
    from mempo.training.stage import tracked

    p = params.sft
    data = ({"trajectories": p.trajectories} if p.trajectories
            else dict(zip(("sft_tasks", "sft_val_tasks"), map(str, sft_split_paths(params.data.out)), strict=True)))
    return tracked("sft", tracking, lambda: _run_sft(params), params=p, data={"policy": p.policy, **data})


def _run_sft(params: Any) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    from mempo.data.sft_split import sft_split_paths
    from mempo.tracking import log_metrics
    from mempo.training.sft_data import sft_samples
    from mempo.training.stage import CurvePlot, TrainingStage

    p = params.sft
    stage = TrainingStage.start(p.out, p.policy, seed=p.seed, threads=p.threads, device=p.device, dtype=p.dtype)
    model, tok, device = stage.model, stage.tokenizer, stage.device
    model.train()

    train_s, val_s, data_stats = sft_samples(params, tok)
    train_t = tokenize_samples(train_s, tok, p.max_tokens, prompt_lm=p.prompt_loss_weight > 0)
    val_t = tokenize_samples(val_s, tok, p.max_tokens)
    if not train_t:
        raise DataError("no SFT samples left after tokenisation", field="sft.max_tokens")
    # Full-history turns of an episode share their prefix: one sample per episode, and as
    # many of them per step as keep the turns per step (and so the steps) of batch_size turns.
    n_turns = len(train_t)
    train_t, val_t = merge_prefix_turns(train_t, p.max_tokens), merge_prefix_turns(val_t, p.max_tokens)
    batch_size = max(1, round(p.batch_size * len(train_t) / n_turns))
    data_stats["merged_samples"] = len(train_t)
    if len(train_t) < n_turns:
        log.info("SFT: %d turns merged into %d prefix-sharing samples; %d samples per step",
                 n_turns, len(train_t), batch_size)
    lengths = [len(s.input_ids) for s in train_t]
    steps_per_epoch = math.ceil(len(train_t) / batch_size)
    total_steps = p.max_steps or max(1, int(p.epochs * steps_per_epoch))
    log.info("SFT: %d train / %d val samples, %.0f tokens/sample, %d steps on %s",
             len(train_t), len(val_t), sum(lengths) / len(lengths), total_steps, device)

    opt, sched = make_optimizer(model, p.lr, p.weight_decay, p.warmup_steps, total_steps)
    # The run's identity: params plus the contents of what it reads (see grpo.py).
    sources = ({"trajectories": p.trajectories, "val_trajectories": p.val_trajectories} if p.trajectories
               else {"world": p.world, "retriever": p.retriever,
                     **dict(zip(("tasks", "val_tasks"), sft_split_paths(params.data.out), strict=True))})
    state = stage.resume(p.resume, {"sft": p.model_dump(), "rollout": params.rollout.model_dump(),
                                    "multi_rule": params.mempo.multi_rule}, {"policy": p.policy, **sources}, opt, sched)

    pad_id = tok.pad_token_id
    t_start = time.perf_counter()
    tokens_seen = 0
    last_val = next((r["val_loss"] for r in reversed(state.history) if "val_loss" in r), float("nan"))
    epoch_batches: dict[int, list[list[int]]] = {}
    bar = tqdm(total=total_steps, initial=state.step, desc="sft", unit="step", mininterval=2.0)
    while state.step < total_steps:
        epoch, pos = divmod(state.step, steps_per_epoch)
        if epoch not in epoch_batches:
            epoch_batches = {epoch: length_bucketed_batches(lengths, batch_size, p.seed, epoch)}
        batch = collate([train_t[i] for i in epoch_batches[epoch][pos]], pad_id, p.prompt_loss_weight)
        t0 = time.perf_counter()
        loss_sum, n_tok = token_loss(model, batch, device)
        loss = loss_sum / max(n_tok, 1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), p.grad_clip))
        opt.step()
        sched.step()
        state.step += 1
        step_tokens = int(batch["attention_mask"].sum())
        tokens_seen += step_tokens
        row: dict[str, float] = {
            "step": state.step, "epoch": epoch + (pos + 1) / steps_per_epoch, "loss": loss.item(),
            "grad_norm": grad_norm, "lr": sched.get_last_lr()[0],
            "tokens_per_s": step_tokens / max(time.perf_counter() - t0, 1e-9),
        }
        if state.step % p.eval_every == 0 or state.step == total_steps:
            row["val_loss"] = evaluate_loss(model, val_t, batch_size, pad_id, device)
        state.history.append(row)
        log_metrics({k: v for k, v in row.items() if k != "step"}, step=state.step, prefix="sft")
        bar.update(1)
        last_val = row.get("val_loss", last_val)  # the bar shows the newest validation loss
        bar.set_postfix(loss=f"{row['loss']:.3f}", val=f"{last_val:.3f}")
        if state.step % p.checkpoint_every == 0 and state.step < total_steps:
            state.data_position = {"epoch": epoch, "batch": pos + 1}
            stage.checkpoint(opt, sched, state, p.keep_checkpoints)
    bar.close()

    val_losses = [r["val_loss"] for r in state.history if "val_loss" in r]
    elapsed = time.perf_counter() - t_start
    metrics = {
        "steps": state.step,
        "train_samples": n_turns,
        "val_samples": len(val_t),
        "final_loss": state.history[-1]["loss"] if state.history else float("nan"),
        "final_val_loss": val_losses[-1] if val_losses else float("nan"),
        "train_seconds": elapsed,
        "tokens_per_s": tokens_seen / max(elapsed, 1e-9),
        **{f"data_{k}" if not k.startswith("data") else k: v for k, v in data_stats.items()},
    }
    stage.finish({"kind": "sft", "base": str(p.policy), "steps": state.step, "context": params.rollout.context},
                 metrics, state.history, [CurvePlot(["loss", "val_loss"], "sft_loss.png", "SFT loss")], "sft_final")
    return metrics
