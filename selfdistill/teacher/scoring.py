"""Scoring the student's own tokens under the student prompt and under the teacher prompt.

Layout of a packed batch, per row: `[pad … prompt | completion … pad]`. Prompts are left-padded
to width P and completions right-padded to width T, so every completion starts at column P and
the columns line up across the student batch and the teacher batch, whose prompt widths differ.
The logits at columns P−1 … P+T−2 predict completion tokens 0 … T−1: the forward asks the model
for the last T+1 positions only (`logits_to_keep`) and drops the final one.

Positions are passed explicitly as `cumsum(attention_mask) − 1` (clamped at 0): a plain HF forward
does not derive them from the mask. Rotary models hide the error (a constant shift cancels in
q·k), but models with absolute position embeddings would give padded logits that differ from the
unpadded ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from selfdistill.teacher.regimes import TeacherRegime, model_logits


@dataclass
class PackedBatch:
    """Prompts and completions packed for one forward. B rows, P prompt and T completion columns."""

    input_ids: Tensor  # (B, P+T) long
    attention_mask: Tensor  # (B, P+T) long, 1 on real tokens
    position_ids: Tensor  # (B, P+T) long, 0 at each row's first real token
    completion_ids: Tensor  # (B, T) long, pad id where `completion_mask` is False
    completion_mask: Tensor  # (B, T) bool, True on completion tokens
    prompt_width: int  # P


@dataclass
class ScoredBatch:
    """Student and teacher logits over the same completion tokens."""

    student_logits: Tensor  # (B, T, V), with gradient when enabled
    teacher_logits: Tensor  # (B, T, V), no gradient
    completion_ids: Tensor  # (B, T) long
    mask: Tensor  # (B, T) bool


def build_batch(
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    *,
    device: torch.device | str | None = None,
    completion_width: int | None = None,
) -> PackedBatch:
    """Pack token ids as `[pad … prompt | completion … pad]` (see module docstring).

    Every prompt needs at least one token (the one predicting the first completion token); a
    completion may be empty (its row is all masked) as long as one is not. `completion_width`
    (≥ the longest completion; default: the longest) fixes the completion block's width, so a
    teacher batch over some rows lines up position by position with the student batch.
    """
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(
            f"need as many prompts as completions (>= 1), got {len(prompts)} and {len(completions)}"
        )
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width_p, width_t = max(map(len, prompts)), max(map(len, completions))
    if width_t == 0:
        raise ValueError("all completions are empty: nothing to score")
    if completion_width is not None:
        if completion_width < width_t:
            raise ValueError(f"completion_width={completion_width} is shorter than the longest "
                             f"completion ({width_t} tokens)")
        width_t = completion_width
    rows = len(prompts)
    input_ids = torch.full((rows, width_p + width_t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        start, end = width_p - len(prompt), width_p + len(completion)
        input_ids[i, start:end] = torch.tensor(prompt + completion, dtype=torch.long)
        attention_mask[i, start:end] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return PackedBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device),
        completion_ids=input_ids[:, width_p:].to(device),
        completion_mask=attention_mask[:, width_p:].bool().to(device),
        prompt_width=width_p,
    )


def _inputs(batch: PackedBatch) -> tuple[Tensor, Tensor, Tensor, int]:
    width_t = batch.completion_ids.shape[1]
    return batch.input_ids, batch.attention_mask, batch.position_ids, width_t + 1


def completion_logits(model: torch.nn.Module, batch: PackedBatch) -> Tensor:
    """Logits predicting each completion token, (B, T, V); with gradient when grad is enabled.

    Row b, column t is the model's distribution for completion token t given the prompt and
    completion tokens 0 … t−1.
    """
    return model_logits(model, *_inputs(batch))[:, :-1]


def score_completions(
    model: torch.nn.Module,
    regime: TeacherRegime,
    student_prompts: list[list[int]],
    teacher_prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
) -> ScoredBatch:
    """One teacher forward (no gradient) and one student forward over the same completions.

    The teacher runs first, so nothing it does to the model can touch the student's graph.
    """
    device = next(model.parameters()).device
    student = build_batch(student_prompts, completions, pad_id, device=device)
    teacher = build_batch(teacher_prompts, completions, pad_id, device=device)
    teacher_logits = regime.teacher_logits(model, *_inputs(teacher))[:, :-1]
    student_logits = completion_logits(model, student)
    if teacher_logits.shape != student_logits.shape:
        raise RuntimeError(
            f"teacher logits {tuple(teacher_logits.shape)} and student logits "
            f"{tuple(student_logits.shape)} do not line up"
        )
    return ScoredBatch(
        student_logits=student_logits,
        teacher_logits=teacher_logits,
        completion_ids=student.completion_ids,
        mask=student.completion_mask,
    )
