"""Student forward+backward in micro-batches with the same gradient as one full-batch pass.

Peak memory of an update grows with the rows scored at once: the student's (B, T, V) logits,
their gradient and the divergence's (B·T, V) intermediates. With `micro_batch_size = m` the
student runs on ⌈B/m⌉ sub-batches in turn and backpropagates each before the next, so only
(m, T_m, V) of them are alive at a time (T_m: the micro-batch's own longest completion).
Rows are grouped by length (`length_order`), so padding — compute spent on nothing — shrinks
too.

Exactness. The method losses are weighted sums of token means, L = Σ_k w_k (1/N_k) Σ_{tokens
of term k} ℓ (task rows, anchor rows, GRPO rows: `methods.token_counts`). Every micro-batch's
loss is computed with the WHOLE batch's denominators N_k, so it is exactly its own tokens' share
of each term and the micro-batch losses sum to L: backpropagating each accumulates ∇L (up to
float32 summation order). Two things stay whole: GRPO groups (group-normalized advantages; the
micro-batch size must be a multiple of the group size and GRPO keeps the batch order), and an
sdpo mix of distillation and GRPO is rejected by `TrainConfig` (its GRPO term assumes the graded
rows come first, which length ordering breaks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from selfdistill.teacher import PackedBatch, build_batch, completion_logits
from selfdistill.train.methods import LossInputs, Sample, method_loss, token_counts


def loss_rows(method: str, samples: list[Sample]) -> list[int]:
    """Rows whose tokens the method's single token mean runs over: the rows with a teacher
    prompt for distillation (sdft, sdpo with distillation_weight 1), every row otherwise."""
    if method in ("sdft", "sdpo"):
        return [i for i, s in enumerate(samples) if s.teacher_prompt is not None]
    return list(range(len(samples)))


def loss_tokens(method: str, samples: list[Sample]) -> int:
    """N: the number of tokens the loss averages over (completion tokens of `loss_rows`)."""
    return sum(len(samples[i].completion) for i in loss_rows(method, samples))


def length_order(method: str, samples: list[Sample]) -> list[int]:
    """Row order for micro-batching: by total length (prompt + completion), so rows of similar
    length share a micro-batch and little compute goes to padding. GRPO keeps the batch order
    (its groups must stay whole and contiguous)."""
    if method == "grpo":
        return list(range(len(samples)))
    return sorted(range(len(samples)),
                  key=lambda i: (len(samples[i].completion), len(samples[i].prompt)))


def _method(cfg: Any) -> str:
    # sdpo with distillation_weight 0 is pure GRPO over every graded row.
    return "grpo" if cfg.method == "sdpo" and cfg.loss.distillation_weight == 0 else cfg.method


def student_backward(cfg: Any, model: Any, samples: list[Sample], sb: PackedBatch,
                     teacher_logits: torch.Tensor | None, ctx_rows: list[int], update: int,
                     pad_id: int, precision: Callable[[], Any],
                     counts: dict[str, float] | None = None,
                     backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """Student forward, the method's loss and its backward (gradients accumulate in the
    parameters); returns the (detached) loss and its metrics.

    `teacher_logits`: (len(ctx_rows), T, V) for the rows `ctx_rows` of the full batch `sb`.
    `cfg.micro_batch_size` None (or >= B) = one pass over `sb`; otherwise slices of that size of
    the rows in `length_order`, each re-packed to its own width, its loss taken over the whole
    batch's denominators (module docstring). `precision()` returns the forward's autocast
    context. `counts`: those denominators (`methods.token_counts`; global under data
    parallelism); None = this batch's. `backward(loss)`: the engine's backward
    (`Dist.backward`).
    """
    size = cfg.micro_batch_size or len(samples)
    if size >= len(samples):
        with precision():
            loss, metrics = update_loss(cfg, model, samples, sb, teacher_logits, ctx_rows, update,
                                        counts)
        backward(loss)
        return loss.detach(), metrics
    if counts is None:  # the whole batch's denominators: each micro-batch's loss is its share
        counts = token_counts(samples, sb.completion_mask, ctx_rows)
    method = _method(cfg)
    total = max(loss_tokens(method, samples), 1)
    t_row = {row: j for j, row in enumerate(ctx_rows)}
    order = length_order(method, samples)
    loss_sum, parts = torch.zeros(()), []
    for start in range(0, len(samples), size):
        idx = order[start:start + size]
        part = [samples[i] for i in idx]
        rows = [j for j, i in enumerate(idx) if i in t_row]
        mb = build_batch([s.prompt for s in part], [s.completion for s in part], pad_id,
                         device=sb.input_ids.device, share_prefix=sb.prefix_width > 0)
        t_logits = None
        if rows and teacher_logits is not None:
            pick = torch.tensor([t_row[idx[j]] for j in rows], device=teacher_logits.device)
            t_logits = teacher_logits[pick, :mb.completion_ids.shape[1]]
        with precision():
            loss, metrics = update_loss(cfg, model, part, mb, t_logits, rows, update, counts)
        backward(loss)
        loss_sum += loss.detach().cpu()
        parts.append((loss_tokens(method, part) / total, metrics))  # metrics: by token share
    return loss_sum, merge_metrics(parts)


def update_loss(cfg: Any, model: Any, samples: list[Sample], sb: PackedBatch,
                teacher_logits: torch.Tensor | None, ctx_rows: list[int], update: int,
                counts: dict[str, float] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Student forward (train mode) and the method's loss of one (micro-)batch. `counts`: loss
    denominators (`methods.token_counts`; None = this batch's own token counts)."""
    model.train()
    logits = completion_logits(model, sb).float()  # losses in float32 whatever the precision
    x = LossInputs(logits, sb.completion_ids, sb.completion_mask, teacher_logits,
                   torch.tensor(ctx_rows, dtype=torch.long, device=logits.device), counts)
    return method_loss(cfg.method, samples, x, cfg.loss, update=update,
                       group_size=cfg.num_generations)


def merge_metrics(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Metrics of micro-batches → one batch: `*_min` / `*_max` by min / max, everything else
    as the token-share-weighted sum (the batch mean of a token mean)."""
    out: dict[str, float] = {}
    for key in {k for _, m in parts for k in m}:
        vals = [(w, m[key]) for w, m in parts if key in m]
        if key.endswith("_min"):
            out[key] = min(v for w, v in vals if w > 0) if any(w > 0 for w, _ in vals) else 0.0
        elif key.endswith("_max"):
            out[key] = max(v for w, v in vals if w > 0) if any(w > 0 for w, _ in vals) else 0.0
        else:
            out[key] = sum(w * v for w, v in vals)
    return out
