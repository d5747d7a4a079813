"""MemPO's two advantages: the GRPO outcome advantage A^T and the memory advantage A^M.

Both trainers (local and verl) call these functions; nothing else computes advantages.

    A_T = grpo_outcome_advantage(scores, group_ids)                     # [N rollouts]
    p = answer_probability(model, tok, prompts, answers)                # .prob, .mean_logprob
    R_M = memory_reward(model, tok, turns, eps="full_context", form="logprob")  # [M turn records]
    A_M = memory_advantage(R_M, turn_group_ids, turn_index)             # [M]
    adv = combine(A_T[rollout_of_turn], A_M, mem_mask, lambda_mem=1.0)  # [M, L] per token

The method (MemPO, arXiv 2603.00680) rewards a memory by the difference of the model's
log-probabilities of the gold answer given the memory context and given the full context
that memory replaces: R^M_t = mean log P(a* | q, mem_t) - mean log P(a* | q, full history
before turn t), each the mean per-token teacher-forced log-probability. That is the default
(`mempo:` eps="full_context", form="logprob"). Ablations, each a `params.yaml` value:
eps="previous" (the score of the previous turn's memory, 0 before the first memory),
eps="none", form="prob" (geometric-mean probabilities instead of mean log-probabilities).
A^M is normalised with norm_by_std=True within (group, turn index) (group="per_turn").
Standard deviations are the unbiased sample std (as verl's GRPO); a group of one gives 0.
`final_memory="skip"` (`mempo.final_memory`) leaves each rollout's last memory out of A^M
(`last_turn_flags`): it is read by no later turn, and a memory written as the episode
closes ("Answers: a1; a2.") scores high for the answers it has found, so scoring it
credits closing, wrong parts included (docs/results.md, "Why MemPO answers early").
`final_memory="closing"` keeps the closing memories' A^M but normalises each among its task's
closing memories (at any turn) instead of among the memories written at its turn index, and
the other memories among themselves: a closing memory then competes with the other rollouts'
closes, by the answers each holds, not with memories of rollouts still searching. Only
rollouts that answered close: the last memory of a rollout stopped at the turn limit has read
the most and would outscore every close, so it stays with the memories of its turn. Measured
in RL (docs/results.md, "The fixed `closing` rule in RL"), both modes take the closes out of
the per-turn sets, and with them `score`'s push to answer.
`rm_max` (`mempo.rm_max`) caps R^M from above. With eps="full_context", rm_max=0 makes the
memory reward a retention penalty: a memory can lose against the history it replaces (it
dropped what the history holds) and never gain on it, so restating answers in a closing
memory earns nothing over a memory that keeps an unfinished search's findings.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

EpsMode = Literal["previous", "full_context", "none"]
RewardForm = Literal["prob", "logprob"]
MemGroupMode = Literal["per_turn", "per_group"]
FinalMemoryMode = Literal["score", "skip", "closing"]

GroupIds = Sequence[Hashable] | torch.Tensor


def _codes(ids: GroupIds) -> torch.Tensor:
    """Map arbitrary hashable ids (strings, ints, tuples) to int64 codes 0..G-1, shape [N]."""
    if isinstance(ids, torch.Tensor):
        _, inv = torch.unique(ids, return_inverse=True)
        return inv.long().reshape(-1)
    table: dict[Hashable, int] = {}
    return torch.tensor([table.setdefault(g, len(table)) for g in ids], dtype=torch.long)


def _as_float64(values: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Flatten to float64 without a float32 round trip (Python floats keep full precision)."""
    if isinstance(values, torch.Tensor):
        return values.detach().reshape(-1).double().cpu()
    return torch.as_tensor(values, dtype=torch.float64).reshape(-1)


def _group_normalise(values: torch.Tensor, codes: torch.Tensor, norm_by_std: bool, eps: float,
                     min_std: float = 0.0) -> torch.Tensor:
    """(v - mean_g) / (max(std_g, min_std) + eps) per group code (or v - mean_g); groups of
    one give 0."""
    v = values.double()
    n_groups = int(codes.max()) + 1 if codes.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.double).index_add_(0, codes, torch.ones_like(v))
    total = torch.zeros(n_groups, dtype=torch.double).index_add_(0, codes, v)
    mean = total / count.clamp(min=1)
    centred = v - mean[codes]
    out = centred
    if norm_by_std:
        sq = torch.zeros(n_groups, dtype=torch.double).index_add_(0, codes, centred * centred)
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        out = centred / (std.clamp(min=min_std)[codes] + eps)
    out = torch.where(count[codes] > 1, out, torch.zeros_like(out))
    return out.to(torch.float32)


def grpo_outcome_advantage(
    scores: torch.Tensor | Sequence[float],
    group_ids: GroupIds,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """A^T_i = (R_i - mean_g) / (std_g + eps) over the rollouts of one prompt (group g).

    Args:
        scores: outcome rewards R^T, shape [N] (one per rollout).
        group_ids: the prompt (uid) of each rollout, length N.
        norm_by_std: divide by the group's unbiased std (False: only subtract the mean).
        eps: added to the std.
    Returns:
        float tensor [N]; 0 for rollouts alone in their group.
    """
    s = _as_float64(scores)
    return _group_normalise(s, _codes(group_ids), norm_by_std, eps)


@dataclass
class AnswerProbability:
    """Teacher-forced answer likelihood, one entry per (prompt, answer) pair.

    Attributes:
        prob: geometric-mean per-token probability exp(mean_l log p(a_l | prompt, a_<l)), [N].
        mean_logprob: mean_l log p(a_l | prompt, a_<l), [N] (nats per answer token).
        n_tokens: answer tokens scored, [N] (int64).
    """

    prob: torch.Tensor
    mean_logprob: torch.Tensor
    n_tokens: torch.Tensor


def answer_probability(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    answers: Sequence[str],
    batch_size: int = 16,
    padding_side: Literal["left", "right"] = "right",
    packed: bool = False,
) -> AnswerProbability:
    """Teacher-forced probability of each answer after its prompt, batched.

    Prompt and answer are tokenised separately (no special tokens added) and concatenated,
    so the scored tokens are exactly the answer's tokens. Results match unbatched calls for
    either padding side (left-padded rows get position ids from the mask). Log-softmax is
    taken in float32. Logits are computed at the answer positions only, and a right-padded
    batch runs without a mask (`mempo.training.forward.logits_at`), which keeps the cost of
    the head flat in the prompt length and lets attention use its causal kernel.

    Args:
        model: a transformers causal LM (eval mode is the caller's job; no grad is taken).
        tokenizer: its tokenizer.
        prompts: N rendered prompt strings (e.g. `render_prompt(..., ANSWER_PROBE_PREFIX)`).
        answers: N answer strings, scored as given (e.g. `answer_continuation(a)`).
        batch_size: rows per forward pass.
        padding_side: "right" (default, cheaper: no mask) or "left".
        packed: probes that share leading tokens (the turns of one episode's full history)
            share a row (`mempo.training.packing`): each prefix runs once. The same numbers
            up to float rounding; `padding_side` is then unused.
    Returns:
        `AnswerProbability` with tensors of shape [N] on the CPU.
    """
    from mempo.training.forward import has_plain_head, logits_at

    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    probs: list[torch.Tensor] = []
    means: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    all_p = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    all_a = [tokenizer.encode(a, add_special_tokens=False) for a in answers]
    for i, (p, a) in enumerate(zip(all_p, all_a, strict=True)):
        if not a or not p:
            raise ValueError(f"{'answer' if not a else 'prompt'} {i} tokenises to nothing: "
                             f"{(answers if not a else prompts)[i]!r}")
    if packed and has_plain_head(model):
        return _packed_answer_probability(model, all_p, all_a, batch_size, device, pad_id)
    # Batches of similar length (less padding: full-history probes range from tens to thousands
    # of tokens); results go back to the callers' order below.
    order = sorted(range(len(prompts)), key=lambda i: len(all_p[i]) + len(all_a[i]))
    for start in range(0, len(prompts), batch_size):
        idx = order[start:start + batch_size]
        p_ids = [all_p[i] for i in idx]
        a_ids = [all_a[i] for i in idx]
        seqs = [p + a for p, a in zip(p_ids, a_ids, strict=True)]
        width = max(len(s) for s in seqs)
        b = len(seqs)
        input_ids = torch.full((b, width), pad_id, dtype=torch.long)
        attention = torch.zeros((b, width), dtype=torch.long)
        offsets = []
        for r, s in enumerate(seqs):
            off = width - len(s) if padding_side == "left" else 0
            input_ids[r, off:off + len(s)] = torch.tensor(s)
            attention[r, off:off + len(s)] = 1
            offsets.append(off)
        # the token at sequence index j is predicted by the logits at index j - 1
        where = torch.zeros((b, width), dtype=torch.bool)
        for r in range(b):
            first = offsets[r] + len(p_ids[r])  # sequence index of the first answer token
            where[r, first - 1:first - 1 + len(a_ids[r])] = True
        with torch.no_grad():
            logits = logits_at(model, input_ids.to(device), attention.to(device), where.to(device)).float()
        for r, rows in enumerate(logits.split([len(x) for x in a_ids])):
            logp = rows.log_softmax(-1).gather(-1, torch.tensor(a_ids[r], device=rows.device)[:, None])[:, 0]
            mean = logp.mean().cpu()
            means.append(mean)
            probs.append(mean.exp())
            counts.append(torch.tensor(len(a_ids[r])))
    back = sorted(range(len(order)), key=lambda j: order[j])  # position in `order` of each input
    return AnswerProbability(torch.stack([probs[j] for j in back]), torch.stack([means[j] for j in back]),
                             torch.stack([counts[j] for j in back]).long())


def _packed_answer_probability(model: Any, prompts: list[list[int]], answers: list[list[int]], batch_size: int,
                               device: Any, pad_id: int) -> AnswerProbability:
    """`answer_probability` over prefix-tree packs (`mempo.training.packing`): up to
    `batch_size` trunks per forward pass (right-padded, no mask), then their branches, up to
    `batch_size` per pass, each on a copy of its trunk's cache cut to what it shares, under a
    mask that hides the rest of the trunk. Needs `has_plain_head(model)`."""
    from transformers import DynamicCache

    from mempo.training.packing import pack_sequences

    seqs = [p + a for p, a in zip(prompts, answers, strict=True)]
    packs = sorted(pack_sequences(seqs, [len(p) - 1 for p in prompts]), key=lambda pk: len(seqs[pk.trunk]))
    means = torch.zeros(len(seqs), dtype=torch.float32)

    def score(hidden: torch.Tensor, picks: list[tuple[int, int, int]]) -> None:
        """picks: (seq, row, column of the logits predicting its first answer token)."""
        rows = torch.tensor([r for i, r, _ in picks for _ in answers[i]], device=hidden.device)
        cols = torch.tensor([c + j for i, _, c in picks for j in range(len(answers[i]))], device=hidden.device)
        logits = model.lm_head(hidden[rows, cols]).float()
        targets = torch.tensor([t for i, _, _ in picks for t in answers[i]], device=logits.device)
        logp = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0].cpu()
        for (i, _, _), lp in zip(picks, logp.split([len(answers[i]) for i, _, _ in picks]), strict=True):
            means[i] = lp.mean()

    for start in range(0, len(packs), batch_size):
        group = packs[start:start + batch_size]
        width = len(seqs[group[-1].trunk])
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        for r, pk in enumerate(group):
            ids[r, :len(seqs[pk.trunk])] = torch.tensor(seqs[pk.trunk])
        with torch.no_grad():
            out = model.model(input_ids=ids.to(device), use_cache=True, past_key_values=DynamicCache(config=model.config))
            score(out.last_hidden_state, [(pk.trunk, r, len(prompts[pk.trunk]) - 1) for r, pk in enumerate(group)])
            cache = out.past_key_values
            branches = [(r, b) for r, pk in enumerate(group) for b in pk.branches]
            for b0 in range(0, len(branches), batch_size):
                chunk = branches[b0:b0 + batch_size]
                tails = [seqs[b.seq][b.shared:] for _, b in chunk]
                m = max(len(t) for t in tails)
                keep = torch.tensor([r for r, _ in chunk], device=device)
                bcache = DynamicCache(config=model.config)
                for layer, lay in enumerate(cache.layers):
                    bcache.update(lay.keys.index_select(0, keep), lay.values.index_select(0, keep), layer)
                b_ids = torch.full((len(chunk), m), pad_id, dtype=torch.long)
                pos = torch.zeros((len(chunk), m), dtype=torch.long)
                allowed = torch.zeros((len(chunk), 1, m, width + m), dtype=torch.bool)
                own = torch.ones((m, m), dtype=torch.bool).tril()
                for j, ((_, b), tail) in enumerate(zip(chunk, tails, strict=True)):
                    b_ids[j, :len(tail)] = torch.tensor(tail)
                    pos[j] = torch.arange(b.shared, b.shared + m)
                    allowed[j, 0, :, :b.shared] = True
                    allowed[j, 0, :, width:] = own
                mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(
                    ~allowed, torch.finfo(torch.float32).min)
                tail_out = model.model(input_ids=b_ids.to(device), attention_mask=mask.to(device),
                                       position_ids=pos.to(device), past_key_values=bcache, use_cache=True)
                score(tail_out.last_hidden_state,
                      [(b.seq, j, len(prompts[b.seq]) - 1 - b.shared) for j, (_, b) in enumerate(chunk)])
    return AnswerProbability(means.exp(), means, torch.tensor([len(a) for a in answers], dtype=torch.long))


@dataclass(frozen=True)
class MemoryTurn:
    """One turn's memory, for the memory reward.

    Attributes:
        rollout_id: the rollout (episode) this turn belongs to.
        turn_index: 0-based turn number within the rollout.
        question: the task's question.
        memory: the `<mem>` text written at this turn ("" / None when none was written).
        answer: the gold answer to score (multi-objective: "a1; a2; ...").
        full_context_prompt: the full history this turn's memory summarises, rendered and
            ending with `ANSWER_PROBE_PREFIX`: the prompt the full-history agent sees at this
            turn, i.e. turns 0..t-1 with their observations,
            `render_prompt(tok, full_context_messages(episode, t), ANSWER_PROBE_PREFIX)`.
            (mem_t is written after reading observation t-1 and before observation t exists,
            so the history through t-1 is exactly what it could keep.) eps="full_context" only.
    """

    rollout_id: Hashable
    turn_index: int
    question: str
    memory: str | None
    answer: str
    full_context_prompt: str | None = None


def memory_reward_from_scores(
    mem_scores: torch.Tensor | Sequence[float],
    rollout_ids: GroupIds,
    turn_index: torch.Tensor | Sequence[int],
    eps: EpsMode = "previous",
    full_context_scores: torch.Tensor | Sequence[float] | None = None,
    rm_max: float | None = None,
) -> torch.Tensor:
    """R^M_{i,t} = S(mem_{i,t}) - eps_{i,t} from already computed scores S (P or mean log P).

    Args:
        mem_scores: S(a* | q, mem_{i,t}), shape [M], one per turn record.
        rollout_ids: rollout of each record, length M.
        turn_index: turn number of each record, [M].
        eps: "previous": eps_{i,t} = S(mem_{i,t-1}) of the same rollout, 0 when there is
            no turn t-1 record (before the first memory); "full_context": eps_{i,t} =
            `full_context_scores`; "none": eps = 0.
        full_context_scores: S(a* | full history up to turn t), [M] (eps="full_context").
        rm_max: upper bound of R^M (None = no bound): min(R^M, rm_max).
    Returns:
        float tensor [M].
    """
    r = _memory_reward_unbounded(mem_scores, rollout_ids, turn_index, eps, full_context_scores)
    return r if rm_max is None else r.clamp(max=float(rm_max))


def _memory_reward_unbounded(
    mem_scores: torch.Tensor | Sequence[float],
    rollout_ids: GroupIds,
    turn_index: torch.Tensor | Sequence[int],
    eps: EpsMode,
    full_context_scores: torch.Tensor | Sequence[float] | None,
) -> torch.Tensor:
    s = torch.as_tensor(mem_scores, dtype=torch.float64).reshape(-1)
    if eps == "none":
        return s.float()
    if eps == "full_context":
        if full_context_scores is None:
            raise ValueError("eps='full_context' needs full_context_scores")
        f = torch.as_tensor(full_context_scores, dtype=torch.float64).reshape(-1)
        return (s - f).float()
    if eps != "previous":
        raise ValueError(f"unknown eps mode '{eps}' (previous | full_context | none)")
    codes = _codes(rollout_ids).tolist()
    turns = torch.as_tensor(turn_index).reshape(-1).tolist()
    where = {(c, int(t)): k for k, (c, t) in enumerate(zip(codes, turns, strict=True))}
    base = torch.zeros_like(s)
    for k, (c, t) in enumerate(zip(codes, turns, strict=True)):
        prev = where.get((c, int(t) - 1))
        if prev is not None:
            base[k] = s[prev]
    return (s - base).float()


def memory_reward(
    model: Any,
    tokenizer: Any,
    turns: Sequence[MemoryTurn],
    eps: EpsMode = "previous",
    form: RewardForm = "prob",
    batch_size: int = 16,
    packed: bool = True,
    rm_max: float | None = None,
) -> torch.Tensor:
    """R^M for each turn record: P(a* | q, mem_{i,t}) - eps_{i,t}, at most `rm_max` (see module docstring).

    P comes from `answer_probability` on a prompt of only the question and that memory
    (`mempo.agent.format.answer_probe_messages`), rendered with the tokenizer's chat
    template. form="prob" uses the geometric-mean probability, form="logprob" the mean
    log-probability (then R^M is a difference of mean log-probs). `packed`: probes that
    share leading tokens (one episode's full histories; one question's memories) run them
    once (`answer_probability(packed=True)`; the same scores up to float rounding).

    Returns:
        float tensor [len(turns)].
    """
    from mempo.agent.format import (
        ANSWER_PROBE_PREFIX,
        answer_continuation,
        answer_probe_messages,
        render_prompt,
    )

    if form not in ("prob", "logprob"):
        raise ValueError(f"unknown memory reward form '{form}' (prob | logprob)")
    prompts = [render_prompt(tokenizer, answer_probe_messages(t.question, t.memory), ANSWER_PROBE_PREFIX)
               for t in turns]
    answers = [answer_continuation(t.answer) for t in turns]

    def pick(ap: AnswerProbability) -> torch.Tensor:
        return ap.prob if form == "prob" else ap.mean_logprob

    mem_scores = pick(answer_probability(model, tokenizer, prompts, answers, batch_size=batch_size, packed=packed))
    full_scores = None
    if eps == "full_context":
        missing = [k for k, t in enumerate(turns) if t.full_context_prompt is None]
        if missing:
            raise ValueError(f"eps='full_context' needs full_context_prompt (missing for turn record {missing[0]})")
        full_scores = pick(answer_probability(
            model, tokenizer, [t.full_context_prompt or "" for t in turns], answers, batch_size=batch_size,
            packed=packed))
    return memory_reward_from_scores(
        mem_scores, [t.rollout_id for t in turns], [t.turn_index for t in turns], eps, full_scores, rm_max)


def last_turn_flags(rollout_ids: GroupIds, turn_index: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """True for each rollout's last turn record (its highest turn index), bool [M]."""
    codes = _codes(rollout_ids).tolist()
    turns = torch.as_tensor(turn_index).reshape(-1).tolist()
    last: dict[int, int] = {}
    for c, t in zip(codes, turns, strict=True):
        last[c] = max(last.get(c, t), int(t))
    return torch.tensor([int(t) == last[c] for c, t in zip(codes, turns, strict=True)], dtype=torch.bool)


def _record_flags(flags: torch.Tensor | Sequence[bool], n: int, name: str) -> torch.Tensor:
    """`memory_advantage`'s per-record flags (skip, closing) as bool [n]; another length: ValueError."""
    out = torch.as_tensor(flags, dtype=torch.bool).reshape(-1)
    if out.numel() != n:
        raise ValueError(f"{name} has {out.numel()} flags for {n} memory rewards")
    return out


def final_memory_flags(mode: FinalMemoryMode, rollout_ids: GroupIds, turn_index: torch.Tensor | Sequence[int],
                       answered: torch.Tensor | Sequence[bool] | None = None) -> dict[str, torch.Tensor]:
    """`memory_advantage`'s keyword for a `final_memory` mode: {} for "score", {"skip":
    `last_turn_flags`} for "skip", and for "closing" {"closing": the last records of the rollouts
    that closed with an answer}. `answered` ([M], needed for "closing") flags the records whose
    rollout gave a final answer: a rollout stopped at the turn limit did not close, and its last
    memory, which has read the most and would outscore every close, stays in its (task, turn) set."""
    if mode == "score":
        return {}
    if mode not in ("skip", "closing"):
        raise ValueError(f"unknown final_memory mode '{mode}' (score | skip | closing)")
    last = last_turn_flags(rollout_ids, turn_index)
    if mode == "skip":
        return {"skip": last}
    if answered is None:
        raise ValueError("final_memory 'closing' needs `answered`: which records' rollouts gave a final answer")
    return {"closing": last & _record_flags(answered, last.numel(), "answered")}


def memory_advantage(
    rewards: torch.Tensor | Sequence[float],
    group_ids: GroupIds,
    turn_index: torch.Tensor | Sequence[int],
    norm_by_std: bool = True,
    group: MemGroupMode = "per_turn",
    eps: float = 1e-6,
    min_std: float = 0.0,
    skip: torch.Tensor | Sequence[bool] | None = None,
    closing: torch.Tensor | Sequence[bool] | None = None,
) -> torch.Tensor:
    """A^M: memory rewards normalised like GRPO within each (prompt group, turn index).

    Args:
        rewards: R^M, [M] turn records.
        group_ids: the prompt (uid) of each record's rollout, length M.
        turn_index: turn number of each record, [M].
        norm_by_std: divide by the unbiased std (else subtract the mean only).
        group: "per_turn" normalises within (group, turn index) (default); "per_group"
            within the group over all its turn records.
        eps: added to the std.
        min_std: the std is at least this. Memory rewards are continuous: when every memory
            of a set scores about the same (e.g. P(answer) ~ 1e-5 for all, a policy that never
            finds the answer), dividing by their tiny std would turn noise into unit-size
            advantages. With a floor, differences far below it give advantages near 0.
        skip: [M] flags; a skipped record gets 0 and is left out of the normalisation sets
            (e.g. `last_turn_flags` for `final_memory="skip"`).
        closing: [M] flags; a flagged record is normalised among its group's flagged records
            (any turn index), the others within their own sets without them (e.g.
            `final_memory_flags` for `final_memory="closing"`).
    Returns:
        float tensor [M]; 0 for records alone in their normalisation set.
    """
    r = _as_float64(rewards)
    close = None if closing is None else _record_flags(closing, r.numel(), "closing")
    if skip is not None:
        drop = _record_flags(skip, r.numel(), "skip")
        out = torch.zeros(r.numel(), dtype=torch.float32)
        keep = (~drop).nonzero().reshape(-1)
        if keep.numel():
            kept_groups = _codes(group_ids)[keep]  # codes: a tensor or a list of ids alike
            out[keep] = memory_advantage(r[keep], kept_groups, torch.as_tensor(turn_index).reshape(-1)[keep],
                                         norm_by_std, group, eps, min_std,
                                         closing=None if close is None else close[keep])
        return out
    g = _codes(group_ids).tolist()
    if group == "per_turn":
        t = torch.as_tensor(turn_index).reshape(-1).tolist()
        keys: list[Hashable] = list(zip(g, t, strict=True))
    elif group == "per_group":
        keys = list(g)
    else:
        raise ValueError(f"unknown memory advantage grouping '{group}' (per_turn | per_group)")
    if close is not None:
        keys = [(gi, "closing") if c else (k, "open") for gi, k, c in zip(g, keys, close.tolist(), strict=True)]
    return _group_normalise(r, _codes(keys), norm_by_std, eps, min_std)


def combine(
    A_T: torch.Tensor,
    A_M: torch.Tensor,
    mem_mask: torch.Tensor,
    lambda_mem: float = 1.0,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token advantage: A^T on every generated token plus lambda_mem * A^M on `<mem>` tokens.

    Args:
        A_T: outcome advantage of each turn record's rollout, [M] (or already per token, [M, L]).
        A_M: memory advantage of each turn record, [M].
        mem_mask: 1 on the tokens inside that turn's `<mem>` span, [M, L].
        lambda_mem: weight of the memory advantage (`mempo.lambda_mem`).
        response_mask: 1 on generated tokens, [M, L] (default: all ones); A is 0 elsewhere.
    Returns:
        float tensor [M, L].
    """
    mask = mem_mask.to(torch.float32)
    a_t = A_T.to(torch.float32)
    if a_t.dim() == 1:
        a_t = a_t[:, None].expand_as(mask)
    adv = a_t + lambda_mem * A_M.to(torch.float32)[:, None] * mask
    if response_mask is not None:
        adv = adv * response_mask.to(torch.float32)
    return adv
