"""Teacher regime `model`: a separate causal LM scores the student's tokens.

Self-distillation gets a better next-token distribution from the same weights with better
context; classic on-policy distillation (Agarwal et al., "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes", arXiv 2306.13649; Thinking Machines, "On-Policy
Distillation", 2025) gets it from different, usually stronger, weights. The rest of the loop is
identical: the student samples, the teacher scores the student's own tokens in one forward pass
(no generation), the student is pulled toward the teacher's per-token distribution. With
`teacher.context=same_as_self_distillation` the other model also sees the privileged context
(a stronger teacher that also reads the feedback); with `none` it sees the student's prompt.

Departures and limits:
- Same tokenizer only. The student's token ids are fed to the teacher as they are, so the two
  tokenizers must agree on every token's id and on the special tokens; `check_tokenizers` says
  what differs at start-up. Cross-tokenizer distillation (aligning different vocabularies) is
  out of scope.
- The teacher's output width may differ from the student's (models of one family often pad
  their embedding matrices differently): its logits are cut to the student's width, or padded
  with a very negative logit (probability ~0) for ids it has no row for (`align_vocab`); ids the
  tokenizer can produce must have a row in both, which `load_teacher` checks.
- Memory: the teacher is loaded once, in eval mode with `requires_grad=False` on every parameter
  (no gradient, no optimizer state, not part of the student's module tree, so never saved into
  the adapter), optionally in bfloat16; its forward runs under `no_grad` and computes logits for
  the completion positions only (`logits_to_keep`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from selfdistill.errors import UserError
from selfdistill.teacher.regimes import TeacherRegime

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_tokenizers(student: Any, teacher: Any) -> str | None:
    """None when the teacher tokenizer maps every token to the student's id and has the same
    special tokens (BOS, EOS, UNK and the set of all special ids); else what differs, in words.

    The pad token is not compared: padded positions are masked out of every forward.
    """
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        differ = sorted(k for k in s_vocab.keys() | t_vocab.keys()
                        if s_vocab.get(k) != t_vocab.get(k))
        return (f"the vocabularies differ ({len(s_vocab)} tokens vs {len(t_vocab)}; "
                f"{len(differ)} tokens have a different id or are missing, "
                f"e.g. {differ[:3]})")
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id"):
        s_id, t_id = getattr(student, attr, None), getattr(teacher, attr, None)
        if s_id != t_id:
            return f"{attr} differs (student {s_id}, teacher {t_id})"
    s_special, t_special = set(student.all_special_ids), set(teacher.all_special_ids)
    if s_special != t_special:
        return (f"the special tokens differ (only the student's: {sorted(s_special - t_special)}"
                f", only the teacher's: {sorted(t_special - s_special)})")
    return None


def align_vocab(logits: Tensor, width: int) -> Tensor:
    """Teacher logits (..., V_T) as (..., width): cut extra columns, or pad missing ones with the
    dtype's lowest finite value (probability 0 after softmax, no NaN in the divergences)."""
    have = logits.shape[-1]
    if have == width:
        return logits
    if have > width:
        return logits[..., :width]
    pad = logits.new_full((*logits.shape[:-1], width - have), torch.finfo(logits.dtype).min)
    return torch.cat([logits, pad], dim=-1)


def output_width(model: Any) -> int | None:
    """Rows of the output head (logit columns) of an HF model; None when it has no such head."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    return None if head is None else int(head.weight.shape[0])


class ModelRegime(TeacherRegime):
    """The teacher is another model (`teacher`), frozen; the student's weights are not used."""

    name = "model"
    frozen = True

    def __init__(self, teacher: torch.nn.Module, *, path: str = "") -> None:
        super().__init__()
        self.teacher = teacher.eval().requires_grad_(False)
        self.path = path  # recorded in checkpoints; the weights are not (they never change)
        self._width: int | None = None

    def setup(self, model: torch.nn.Module) -> None:
        """Put the teacher on the student's device and note the student's logit width."""
        if self._ready:
            return
        self.teacher.to(next(model.parameters()).device)
        self._width = output_width(model)
        super().setup(model)

    def _logits(self, model: torch.nn.Module, *inputs: Any) -> Tensor:
        logits = super()._logits(model, *inputs)
        return logits if self._width is None else align_vocab(logits, self._width)

    @contextlib.contextmanager
    def _weights(self, model: torch.nn.Module) -> Iterator[Any]:
        yield self.teacher

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "path": self.path}


def load_teacher(name: str, student_tokenizer: Any, *, dtype: str = "float32",
                 progress: bool = True) -> ModelRegime:
    """Load teacher model `name` (HF directory, hub id or "default") as a `ModelRegime`.

    The tokenizer is checked against the student's before any weights are loaded; UserError
    (exit code 2) names what differs. `dtype` is "float32" or "bfloat16" (the teacher's weights
    and forward; its logits are cast to float32 by the loop).
    """
    from selfdistill.models import load_model, load_tokenizer, resolve_model

    path = resolve_model(name, progress=progress)
    try:
        teacher_tok = load_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"teacher.model={name}: could not load its tokenizer: {exc}") from None
    problem = check_tokenizers(student_tokenizer, teacher_tok)
    if problem is not None:
        raise UserError(
            f"teacher.model={name} ({path}) does not share the student's tokenizer: {problem}. "
            "The teacher scores the student's token ids, so both need the same tokenizer; "
            "pick a teacher of the same model family (cross-tokenizer distillation is not "
            "supported)")
    teacher = load_model(path, dtype=DTYPES[dtype], progress=progress).model
    width, needed = output_width(teacher), len(student_tokenizer)
    if width is not None and width < needed:
        raise UserError(f"teacher.model={name}: its output head has {width} rows but the "
                        f"tokenizer has {needed} tokens: the model and tokenizer do not match")
    return ModelRegime(teacher, path=path)
