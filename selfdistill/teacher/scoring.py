"""Scoring the student's own tokens under the student prompt and under the teacher prompt.

Layout of a packed batch, per row: `[pad … prompt | completion … pad]`. Prompts are left-padded
to width P and completions right-padded to width T, so every completion starts at column P and
the columns line up across the student batch and the teacher batch, whose prompt widths differ.
The logits at columns P−1 … P+T−2 predict completion tokens 0 … T−1: the forward runs the output
head at those T positions only (`model_logits`).

Positions are passed explicitly as `cumsum(attention_mask) − 1` (clamped at 0): a plain HF forward
does not derive them from the mask. Rotary models hide the error (a constant shift cancels in
q·k), but models with absolute position embeddings would give padded logits that differ from the
unpadded ones.

Shared prefix (`share_prefix=True`): when every prompt starts with the same S tokens (a chat
template's system prompt: 24 of the default model's ~38 prompt tokens), the layout becomes
`[shared S | pad … rest of prompt | completion … pad]`. Each row is still its own tokens at its
own positions with padding masked, so the logits are those of the plain layout; `model_logits`
then runs the S columns once (batch 1) and the rest against their keys and values, broadcast
to the B rows (`prefix_width` = S).
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
    prefix_width: int = 0  # S: leading columns that are the same real tokens in every row


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
    share_prefix: bool = False,
) -> PackedBatch:
    """Pack token ids as `[pad … prompt | completion … pad]` (see module docstring).

    Every prompt needs at least one token (the one predicting the first completion token); a
    completion may be empty (its row is all masked) as long as one is not. `completion_width`
    (≥ the longest completion; default: the longest) fixes the completion block's width, so a
    teacher batch over some rows lines up position by position with the student batch.
    `share_prefix`: put the prompts' longest common prefix (leaving every prompt ≥ 1 token of
    its own) in the first columns, unpadded, and record its width (`prefix_width`).
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
    shared = common_prefix(prompts) if share_prefix and rows > 1 else 0
    input_ids, attention_mask = left_pad(prompts, pad_id, shared, extra=width_t)
    for i, completion in enumerate(completions):
        input_ids[i, width_p:width_p + len(completion)] = torch.tensor(completion,
                                                                       dtype=torch.long)
        attention_mask[i, width_p:width_p + len(completion)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return PackedBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device),
        completion_ids=input_ids[:, width_p:].to(device),
        completion_mask=attention_mask[:, width_p:].bool().to(device),
        prompt_width=width_p,
        prefix_width=shared,
    )


def left_pad(prompts: list[list[int]], pad_id: int, shared: int = 0,
             extra: int = 0) -> tuple[Tensor, Tensor]:
    """(B, P + `extra`) long ids and attention mask, P = the longest prompt: each prompt laid out
    as `[shared prefix | pad … rest of prompt]` (plain left padding when `shared` = 0), then
    `extra` pad columns (mask 0) for the caller to fill."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width + extra), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        start = width - len(p) + shared
        ids[i, :shared] = torch.tensor(p[:shared], dtype=torch.long)
        ids[i, start:width] = torch.tensor(p[shared:], dtype=torch.long)
        mask[i, :shared] = 1
        mask[i, start:width] = 1
    return ids, mask


def common_prefix(prompts: list[list[int]]) -> int:
    """Length of the longest common prefix of `prompts`, capped so that every prompt keeps at
    least one token after it (the rows' own columns are never empty)."""
    shortest = min(map(len, prompts)) - 1
    first = prompts[0]
    n = 0
    while n < shortest and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def length_groups(lengths: list[int], overhead: int = 512) -> list[list[int]]:
    """Split rows into groups of similar length, each packed and run on its own: indices into
    `lengths`, sorted by length within and across groups.

    Minimizes Σ_groups (rows · longest + overhead) over contiguous runs of the sorted lengths
    (dynamic programming, O(n²)): padded token-columns computed, plus `overhead` token-columns'
    worth of fixed cost per extra forward. E.g. 16 teacher prompts of ~70 tokens (a fact in
    context) and 16 anchors of ~38 become two groups instead of one padded to 78.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)  # best[j]: cost of the first j rows
    for j in range(1, n + 1):
        for i in range(j):  # last group = sorted rows i .. j-1
            cost = best[i] + (j - i) * lengths[order[j - 1]] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def _inputs(batch: PackedBatch) -> tuple[Tensor, Tensor, Tensor, int, int]:
    return (batch.input_ids, batch.attention_mask, batch.position_ids,
            batch.completion_ids.shape[1], batch.prefix_width)


def completion_logits(model: torch.nn.Module, batch: PackedBatch) -> Tensor:
    """Logits predicting each completion token, (B, T, V); with gradient when grad is enabled.

    Row b, column t is the model's distribution for completion token t given the prompt and
    completion tokens 0 … t−1.
    """
    return model_logits(model, *_inputs(batch))


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
    teacher_logits = regime.teacher_logits(model, *_inputs(teacher))
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
