"""Rollout log-probs equal a teacher-forced forward's log-probs of the sampled tokens."""

from __future__ import annotations

import torch

from selfdistill.rollout import generate


class _Tok:  # the few tokenizer attributes `generate` uses
    eos_token_id = 2
    pad_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_sampled_token_logprobs_match_a_forward_pass(tiny_model):
    torch.manual_seed(3)
    prompt = [5, 17, 99, 4, 250]
    (c,), = generate(tiny_model, _Tok(), [prompt], max_new_tokens=12, n=1)
    assert len(c.token_ids) == len(c.logprobs) >= 1
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logits = tiny_model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(c.logprobs), expected, rtol=1e-4, atol=1e-5)
