"""Do our trainer and TRL's SDFTTrainer compute the same function? (benchmarks/vs_trl.py)

One model, one batch, both trainers' own code paths:

1. TRL's trainer wraps the model with LoRA; its B matrices are set to small seeded random
   values, so student (adapter on) and teacher (adapter off) differ and the loss is not 0.
2. Eight knowledge prompts; completions sampled from that student and cut to the shortest one's
   length, so every row has the same number of tokens (see "reduction" below). The student
   prompt is the chat-templated question; the teacher prompt is built by our
   `build_teacher_messages` (a `fact` context) and given as token ids to both sides.
3. TRL: ``trainer.compute_loss(model, batch)`` on its batch layout (left-padded prompts,
   right-padded completions). Ours: ``score_batch`` + ``update_loss`` (what ``train_step``
   runs). Both backward; the LoRA gradients are compared too.
4. The per-token divergence of TRL's ``compute_topk_self_distillation_loss`` and ours
   (``per_token_divergence``) on the same logits.

Semantic differences that remain (written into the report):
- reduction: TRL averages each sequence's tokens, then the sequences; we average all tokens of
  the batch. Equal when every row has the same length (as here); otherwise rows weigh
  differently. The check also reports both reductions on the uncut batch.
- the tail bucket: TRL computes the tail as log(1 − Σ top-k p) (cancellation when the top-k
  holds almost all the mass); we sum the rest of the vocabulary directly. Same value up to
  float32 rounding.
- TRL divides student and teacher logits by the sampling temperature; with temperature 1 (here)
  that is the identity. We never rescale.
"""

from __future__ import annotations

import tempfile
from typing import Any

from trl_side import Settings, our_config, trl_trainer


def _batches(tok: Any, samples: list[Any], pad: int) -> tuple[dict[str, Any], Any]:
    """TRL's batch dict and our PackedBatch for the same prompts / teacher prompts / tokens."""
    import torch

    from selfdistill.teacher import build_batch

    sb = build_batch([s.prompt for s in samples], [s.completion for s in samples], pad)
    tb = build_batch([s.teacher_prompt for s in samples], [s.completion for s in samples], pad)
    p = sb.prompt_width
    trl = {
        "prompt_ids": sb.input_ids[:, :p], "prompt_mask": sb.attention_mask[:, :p],
        "completion_ids": sb.completion_ids,
        "completion_mask": sb.completion_mask.long(),
        "teacher_input_ids": tb.input_ids, "teacher_attention_mask": tb.attention_mask,
        "raw_completion_lengths": sb.completion_mask.sum(-1),
    }
    assert torch.equal(tb.completion_ids, sb.completion_ids)
    return trl, sb


def _samples(s: Settings, model: Any, tok: Any, rows: list[Any], cut: bool) -> list[Any]:
    from selfdistill.chat import prompt_ids
    from selfdistill.rollout import generate
    from selfdistill.teacher import PrivilegedContext, build_teacher_messages
    from selfdistill.train.methods import Sample

    rows = rows[:s.batch_size]
    prompts = [prompt_ids(tok, r.messages) for r in rows]
    comps = [g[0].token_ids for g in generate(model, tok, prompts, max_new_tokens=s.max_new_tokens,
                                              batch_size=len(prompts))]
    if cut:
        width = min(len(c) for c in comps)
        comps = [c[:width] for c in comps]
    out = []
    for g, (r, p, c) in enumerate(zip(rows, prompts, comps, strict=True)):
        sample = Sample(g, r, g, p, c)
        tp = build_teacher_messages(r.messages, [PrivilegedContext("fact", r.privileged_context)])
        sample.teacher_prompt = prompt_ids(tok, tp.messages)
        out.append(sample)
    return out


def _grads(model: Any) -> dict[str, Any]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def same_loss_check(s: Settings) -> dict[str, Any]:
    """Both trainers' loss and LoRA gradients on one batch; per-token divergence max diff."""
    import torch
    from trl.experimental.sdft.loss_utils import compute_topk_self_distillation_loss

    from selfdistill.data import load_rows
    from selfdistill.losses import masked_mean, per_token_divergence
    from selfdistill.models import load_model
    from selfdistill.teacher import completion_logits, make_regime
    from selfdistill.train.loop import PhaseTimer, score_batch, seed_everything, update_loss

    seed_everything(s.seed)
    lm = load_model(s.model, progress=False)
    tok = lm.tokenizer
    rows = load_rows(s.train_data, require=("prompt", "privileged_context"), purpose="bench")
    with tempfile.TemporaryDirectory() as out:
        trainer = trl_trainer(s, lm.model, tok, rows, out)
    model = trainer.model
    gen = torch.Generator().manual_seed(s.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    cfg = our_config(s)
    res: dict[str, Any] = {}
    for cut in (True, False):
        samples = _samples(s, model, tok, rows, cut)
        trl_batch, sb = _batches(tok, samples, tok.pad_token_id)
        model.eval()  # TRL: no gradient-accumulation scaling outside training mode
        trl_loss = trainer.compute_loss(model, trl_batch)
        trl_loss.backward()
        trl_grads = _grads(model)
        model.zero_grad(set_to_none=True)
        ctx_rows, t_logits, sb2 = score_batch(make_regime("base"), model, samples,
                                              tok.pad_token_id, PhaseTimer())
        ours, _ = update_loss(cfg, model, samples, sb2, t_logits, ctx_rows, 0)
        ours.backward()
        our_grads = _grads(model)
        model.zero_grad(set_to_none=True)
        key = "equal_lengths" if cut else "ragged"
        res[key] = {"trl_loss": float(trl_loss), "our_loss": float(ours),
                    "tokens": int(sb.completion_mask.sum()),
                    "row_lengths": sb.completion_mask.sum(-1).tolist()}
        with torch.no_grad():  # both per-token divergences on identical logits
            s_logits = completion_logits(model, sb2).float()
            mine = per_token_divergence(s_logits, t_logits, alpha=s.alpha, topk=s.topk,
                                        add_tail=True)
            theirs = compute_topk_self_distillation_loss(
                s_logits, t_logits, distillation_topk=s.topk, distillation_alpha=s.alpha,
                distillation_add_tail=True)
        mask = sb2.completion_mask
        res[key]["per_token_max_abs_diff"] = float((theirs - mine)[mask].abs().max())
        res[key]["per_token_max"] = float(mine[mask].abs().max())
        # our per-token values reduced TRL's way (per-row mean, then mean) and ours
        row_mean = (mine * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        res[key]["ours_trl_reduction"] = float(row_mean.mean())
        res[key]["ours_token_mean"] = float(masked_mean(mine, mask))
        diffs = [float((trl_grads[n] - g).abs().max()) for n, g in our_grads.items()]
        res[key].update(grad_max_abs_diff=max(diffs),
                        grad_max_abs=max(float(g.abs().max()) for g in our_grads.values()),
                        grad_tensors=len(our_grads), trl_grad_tensors=len(trl_grads))
    return res

