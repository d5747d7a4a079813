"""mempo.training.losses: batched response log-probs, low_var_kl, the clipped surrogate."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def small_lm():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(cfg).eval()


def _naive_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    logsm = logits.log_softmax(-1)
    return torch.stack([logsm[len(prompt) + j - 1, t] for j, t in enumerate(response)])


SHARED = [(7 * i) % 47 + 2 for i in range(20)]  # 20 leading ids of every prompt: a system prompt


@pytest.mark.parametrize("lead", [[], SHARED], ids=["nothing-shared", "shared-prefix"])
def test_batched_logprobs_match_one_sequence_at_a_time(small_lm, lead) -> None:
    """With and without 20 leading ids every row shares (then they run once:
    `mempo.training.forward.prefix_hidden`)."""
    from mempo.training.forward import shared_prefix_length
    from mempo.training.losses import pack_turns, response_logprobs

    prompts = [lead + [1, 2, 3, 4, 5, 6], lead + [7, 8], lead + [9, 10, 11]]
    responses = [[12, 13], [14, 15, 16, 17, 18], [19]]
    assert shared_prefix_length(*_ids_and_mask(prompts, responses)) == len(lead)
    batch = pack_turns(prompts, responses, pad_id=0)
    with torch.no_grad():
        logp, ent = response_logprobs(small_lm, batch, temperature=0.7, with_entropy=True)
    assert logp.shape == (3, 5)
    for r, (p, resp) in enumerate(zip(prompts, responses, strict=True)):
        expect = _naive_logprobs(small_lm, p, resp, temperature=0.7)
        torch.testing.assert_close(logp[r, :len(resp)], expect, atol=1e-5, rtol=1e-5)
        assert torch.all(logp[r, len(resp):] == 0)
        assert torch.all(ent[r, :len(resp)] > 0) and torch.all(ent[r, len(resp):] == 0)
    # the gradient of the batched log-probs (right padding, no mask, head at response positions)
    # is the gradient of the one-at-a-time ones
    grads = []
    for batched in (True, False):
        small_lm.zero_grad(set_to_none=True)
        if batched:
            total = response_logprobs(small_lm, batch)[0].sum()
        else:
            total = sum(torch.log_softmax(small_lm(input_ids=torch.tensor([p + resp])).logits[0], -1)[
                torch.arange(len(p) - 1, len(p) + len(resp) - 1), torch.tensor(resp)].sum()
                for p, resp in zip(prompts, responses, strict=True))
        total.backward()
        grads.append([q.grad.clone() for q in small_lm.parameters()])
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(*grads, strict=True))


def _ids_and_mask(prompts, responses):
    from mempo.training.losses import pack_turns

    batch = pack_turns(prompts, responses, pad_id=0)
    return batch.input_ids, batch.attention_mask


def test_low_var_kl_is_zero_on_equal_policies_and_positive_otherwise() -> None:
    from mempo.training.losses import low_var_kl

    a = torch.tensor([-1.0, -2.0, -0.5])
    assert torch.all(low_var_kl(a, a) == 0)
    kl = low_var_kl(a, a - 0.3)
    assert torch.all(kl > 0)
    # k3 = exp(d) - d - 1 with d = ref - logp = -0.3
    torch.testing.assert_close(kl, torch.full((3,), float(torch.exp(torch.tensor(-0.3)) + 0.3 - 1)))


def test_clipped_surrogate_clips_only_beyond_the_ratio_band() -> None:
    from mempo.training.losses import clipped_surrogate

    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    w = torch.full((1, 3), 1 / 3)
    loss, stats = clipped_surrogate(logp, old, adv, w, 0.2, 0.2)
    # token 0: ratio 1 -> -1; token 1: ratio 1.5, A>0 -> clipped at 1.2 -> -1.2;
    # token 2: ratio 0.5, A<0 -> clipped at 0.8 -> +0.8 (max of 0.5 and 0.8)
    assert loss.item() == pytest.approx((-1.0 - 1.2 + 0.8) / 3)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    # clipped tokens carry no gradient
    assert logp.grad[0, 1] == 0 and logp.grad[0, 2] == 0 and logp.grad[0, 0] != 0
