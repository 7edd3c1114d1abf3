"""Lessons: which feedback teaches something, judged by the model itself, and the gate check
that a learned adapter fits its lessons.

A feedback candidate is (context messages x, the assistant's response y, feedback f): an explicit
`/v1/feedback` text or the user's next message (the (prompt, response, follow-up) triplet of
"Aligning Language Models from User Interactions"). Its score is the mean per-token forward KL
between the teacher (the same model with f written into the last user turn, as
`selfdistill.teacher.build_teacher_messages` does for training) and the student (without f), on
the tokens of y:

    score = 1/|y| · Σ_t KL( p(· | x ⊕ f, y<t) ‖ p(· | x, y<t) )        (nats per token)

A follow-up that does not bear on y ("What is 27*4?" after an email draft) barely changes the
distribution over y's tokens (score ≈ 0); a correction does. Candidates above a threshold become
lessons; the score is recorded either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from selfdistill.chat import Message, prompt_ids
from selfdistill.losses import masked_mean, per_token_divergence
from selfdistill.teacher import (
    BaseRegime,
    LiveRegime,
    PrivilegedContext,
    TeacherRegime,
    build_teacher_messages,
    score_completions,
)
from selfdistill.teacher.regimes import is_peft

FEEDBACK_KIND = "user_followup"
"""How the teacher is shown the feedback (`selfdistill.teacher.contexts`)."""


def teacher_messages(messages: list[Message], feedback: str) -> list[Message]:
    """The teacher's view: `messages` with `feedback` in the last user turn."""
    return build_teacher_messages(messages, [PrivilegedContext(FEEDBACK_KIND, feedback)]).messages


def divergence(
    model: Any,
    tokenizer: Any,
    lessons: Sequence[Mapping[str, Any]],
    regime: TeacherRegime,
    *,
    max_response_tokens: int = 256,
) -> float:
    """Mean per-token KL(teacher ‖ student) over the responses of `lessons` (dicts with
    `messages`, `response`, `feedback`), the formula of the module docstring, with the teacher's
    weights chosen by `regime` (`LiveRegime`: the model itself). 0.0 when no response has a
    token. Runs without gradient."""
    pad = tokenizer.pad_token_id
    student, teacher, responses = [], [], []
    for lesson in lessons:
        ids = tokenizer(lesson["response"], add_special_tokens=False)["input_ids"]
        if not ids:
            continue
        student.append(prompt_ids(tokenizer, list(lesson["messages"])))
        shown = teacher_messages(lesson["messages"], lesson["feedback"])
        teacher.append(prompt_ids(tokenizer, shown))
        responses.append(ids[:max_response_tokens])
    if not responses:
        return 0.0
    with torch.no_grad():
        scored = score_completions(model, regime, student, teacher, responses, pad)
        per_token = per_token_divergence(scored.student_logits, scored.teacher_logits, alpha=0.0)
        return float(masked_mean(per_token, scored.mask))


def score(model: Any, tokenizer: Any, lesson: Mapping[str, Any]) -> float:
    """A candidate's score: the model is its own teacher (`LiveRegime`)."""
    return divergence(model, tokenizer, [lesson], LiveRegime())


class LessonFit:
    """Gate check (`GateSpec.checks`): the candidate fits the round's lessons better than the
    baseline. Value = `divergence` with the *base* model as teacher (adapter disabled; a model
    without adapter is its own base), the target self-distillation trains toward. The gate calls
    a check on the baseline first, then on the candidate (`evaluate_gate`); the candidate passes
    when its value is lower than the baseline's by more than `margin`."""

    def __init__(self, lessons: Sequence[Mapping[str, Any]], margin: float = 0.0) -> None:
        self.lessons, self.margin = list(lessons), margin
        self.values: list[float] = []
        self.__qualname__ = "LessonFit"

    def __call__(self, model: Any, tokenizer: Any) -> dict[str, Any]:
        regime = BaseRegime() if is_peft(model) else LiveRegime()
        value = divergence(model, tokenizer, self.lessons, regime)
        self.values.append(value)
        baseline = self.values[0]
        rule = f"lesson divergence < baseline {baseline:.4f} − {self.margin:g}"
        return {"passed": value < baseline - self.margin, "value": value, "rule": rule}
