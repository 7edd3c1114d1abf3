"""What each method trains toward: its samples' targets and its loss. One loop runs them all.

- `sdft` (Shenfeld et al., "Self-Distillation Enables Continual Learning", arXiv 2601.19897):
  the teacher is the model with a demonstration (`privileged_context`) in its prompt.
- `sdpo` (Hübotter et al., "Reinforcement Learning via Self-Distillation", arXiv 2601.20802):
  `n` rollouts per prompt are graded; the teacher sees the grader's feedback and, for failed
  attempts, a successful sibling as `solution`. Mixed with a GRPO term by `distillation_weight`.
  Departure: attempts without usable context get no distillation loss (as in the reference)
  but still take part in the GRPO term when it is on.
- `grpo`: scalar reward only, group-normalized advantages, PPO-clip surrogate.
- `sft`: cross-entropy on the demonstration text as the answer.
- `cpt`: next-token loss on the privileged text itself (continued pre-training, no chat template).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from selfdistill.data import Row
from selfdistill.losses import (
    group_advantages,
    importance_weights,
    masked_mean,
    per_token_divergence,
    policy_gradient_objective,
    sampled_token_objective,
    token_logprobs,
)
from selfdistill.teacher import PrivilegedContext

ROLLOUT_METHODS = ("sdft", "sdpo", "grpo")


@dataclass
class Sample:
    """One attempt (or target) in a training batch and everything the loss needs about it."""

    row_index: int  # index into the training rows (stable across resume)
    row: Row
    group: int  # which prompt of the batch it belongs to (SDPO / GRPO group)
    prompt: list[int]  # student prompt ids (chat-templated)
    completion: list[int]  # tokens that are scored: the rollout, or the SFT/CPT target
    text: str = ""
    reward: float | None = None
    feedback: Any = None  # selfdistill.envs Feedback, when graded
    contexts: list[PrivilegedContext] = field(default_factory=list)  # empty = no usable context
    teacher_prompt: list[int] | None = None
    teacher_messages: list[dict[str, str]] | None = None  # the teacher prompt as built
    truncated_tokens: int = 0
    anchor: bool = False  # an anchor prompt: teacher prompt = student prompt (TrainConfig)
    old_logprobs: Tensor | None = None  # (len(completion),) log-probs at the first update
    behaviour_logprobs: list[float] | None = None  # the sampler's log-probs (NaN = unknown)
    lag: int = 0  # learner steps between the sampler's weights and the learner's (server backend)
    token_logratio: list[float] | None = None  # log p_T − log p_S per completion token (nats)


def sdft_contexts(row: Row) -> list[PrivilegedContext]:
    return [PrivilegedContext(row.context_kind, row.privileged_context)]


def sdpo_contexts(group: list[Sample], *, success_threshold: float, sibling_solutions: bool,
                  include_self: bool, feedback_for_successes: bool,
                  environment_feedback: bool = True) -> None:
    """Attach teacher contexts to one group of graded attempts, in place.

    A failed attempt gets its feedback text (kind from the grader) and, when some sibling
    succeeded, that sibling's text as `solution` first. A successful attempt gets context only
    when `include_self` (itself as solution) or `feedback_for_successes` is set. With
    `environment_feedback` off, only successful siblings teach (no feedback text at all).
    """
    wins = [s for s in group if s.reward is not None and s.reward >= success_threshold]
    for s in group:
        ctx: list[PrivilegedContext] = []
        success = s in wins
        others = [w for w in wins if w is not s or include_self]
        if sibling_solutions and others and (not success or include_self):
            ctx.append(PrivilegedContext("solution", others[0].text))
        if (environment_feedback and s.feedback is not None and s.feedback.text
                and (not success or feedback_for_successes)):
            ctx.append(PrivilegedContext("feedback", s.feedback.text))
        s.contexts = ctx


@dataclass
class LossInputs:
    """Logits and masks of one update, computed by the loop (which times the phases)."""

    student_logits: Tensor  # (B, T, V), with gradient
    completion_ids: Tensor  # (B, T)
    mask: Tensor  # (B, T) bool
    teacher_logits: Tensor | None  # (B_ctx, T, V) for the rows in `ctx_rows`, no gradient
    ctx_rows: Tensor  # (B_ctx,) long: which rows of the batch have teacher context
    counts: dict[str, float] | None = None  # loss denominators (`token_counts`); None = local


def token_counts(samples: list[Sample], mask: Tensor, ctx_rows: list[int]) -> dict[str, float]:
    """Tokens each loss term averages over: "all" (sft/cpt), "task" and "anchor" (distillation
    over the rows with a teacher prompt), "graded" (the GRPO term). `mask`: (B, T) bool.
    Data parallelism sums them over ranks (`Dist.global_counts`)."""
    tokens = mask.sum(-1).tolist()
    return {"all": float(sum(tokens)),
            "task": float(sum(tokens[r] for r in ctx_rows if not samples[r].anchor)),
            "anchor": float(sum(tokens[r] for r in ctx_rows if samples[r].anchor)),
            "graded": float(sum(t for t, s in zip(tokens, samples, strict=True)
                                if s.reward is not None))}


def _count(x: LossInputs, key: str) -> float | None:
    return None if x.counts is None else x.counts[key]


def start_policy(samples: list[Sample], logp: Tensor) -> dict[str, float]:
    """At the first update, fix each sample's `old_logprobs` (the policy its tokens are
    corrected from): the learner's log-probs, or the sampler's where the sampler lagged
    (`lag > 0`; unknown entries fall back to the learner's). logp: (B, T) learner log-probs.
    Returns `sampler_logprob_absdiff` (mean |sampler − learner| over the tokens of unlagged
    samples: the engines' numerical mismatch) and `sampler_lag` (mean lag) when known."""
    diffs: list[Tensor] = []
    for i, s in enumerate(samples):
        s.old_logprobs = logp[i, : len(s.completion)].detach().clone()
        if not s.behaviour_logprobs:
            continue
        n = min(len(s.behaviour_logprobs), logp.shape[1])
        beh = torch.tensor(s.behaviour_logprobs[:n], dtype=logp.dtype, device=logp.device)
        known = ~torch.isnan(beh)
        if s.lag > 0:
            s.old_logprobs[:n] = torch.where(known, beh, s.old_logprobs[:n])
        elif known.any():
            diffs.append((beh[known] - logp[i, :n].detach()[known]).abs())
    out = {"sampler_lag": float(sum(s.lag for s in samples)) / max(len(samples), 1)}
    if diffs:
        out["sampler_logprob_absdiff"] = float(torch.cat(diffs).mean())
    return out


def method_loss(method: str, samples: list[Sample], x: LossInputs, loss_cfg: Any,
                *, update: int, group_size: int) -> tuple[Tensor, dict[str, float]]:
    """The scalar loss of one update and its metrics (per-token means over the mask)."""
    logp = token_logprobs(x.student_logits, x.completion_ids)  # (B, T)
    metrics: dict[str, float] = {}
    if update == 0:
        metrics.update(start_policy(samples, logp))
    # (B, T); each sample's own tokens only, so a later update may pack it at another width
    old = torch.nn.utils.rnn.pad_sequence([s.old_logprobs for s in samples], batch_first=True)
    old = F.pad(old, (0, logp.shape[1] - old.shape[1]))
    mask = x.mask
    if method in ("sft", "cpt"):
        nll = masked_mean(-logp, mask, _count(x, "all"))
        # The metric is this batch's own token mean (with global counts `nll` is its share).
        return nll, {"nll": float(masked_mean(-logp.detach(), mask))}

    terms: list[Tensor] = []
    # Distillation over the rows with a teacher prompt: the method's context rows (sdft/sdpo)
    # and the anchor rows (any rollout method).
    weight = loss_cfg.distillation_weight if method == "sdpo" else 1.0
    if method in ("sdft", "sdpo") or x.ctx_rows.numel():
        anchor = torch.tensor([samples[r].anchor for r in x.ctx_rows.tolist()], dtype=torch.bool,
                              device=logp.device)
        corrected = update > 0 or any(s.lag > 0 for s in samples)
        distill, m, adv = _distillation(logp, old, x, loss_cfg, corrected, anchor)
        metrics.update(m)
        if update == 0 and adv is not None:  # token-level credit, kept for the trace store
            for j, row in enumerate(x.ctx_rows.tolist()):
                samples[row].token_logratio = adv[j][mask[row]].tolist()
        if weight > 0:
            terms.append(weight * distill)
    graded = [i for i, s in enumerate(samples) if s.reward is not None]  # never anchors
    if method == "grpo" or (method == "sdpo" and weight < 1):
        pg_weight = 1.0 if method == "grpo" else 1.0 - weight
        rewards = torch.tensor([samples[i].reward for i in graded], dtype=torch.float32,
                               device=logp.device)
        adv = group_advantages(rewards, group_size)
        n = len(graded)  # graded attempts come first, in whole groups
        pg_tok = policy_gradient_objective(logp[:n], old[:n], adv, clip_eps=loss_cfg.clip_eps)
        pg = masked_mean(pg_tok, mask[:n], _count(x, "graded"))
        metrics["pg_loss"] = float(masked_mean(pg_tok.detach(), mask[:n]))  # this batch's mean
        terms.append(pg_weight * pg)
    loss = torch.stack(terms).sum() if terms else logp.sum() * 0.0
    return loss, metrics


def _distillation(logp: Tensor, old: Tensor, x: LossInputs, cfg: Any, corrected: bool,
                  anchor: Tensor) -> tuple[Tensor, dict[str, float], Tensor | None]:
    """Divergence over the rows with a teacher prompt (importance-corrected when `corrected`:
    after the first update, or when the sampler lagged the learner):
    token mean over the task rows + `anchor_weight` × token mean over the anchor rows (`anchor`,
    (B_ctx,) bool). Rows without a teacher prompt contribute nothing. Metrics: `distill_loss`
    (task rows) and `anchor_distill_loss` (drift from the teacher on general prompts). Also
    returns the per-token log-ratio log p_T − log p_S of the rows, (B_ctx, T), detached."""
    if x.teacher_logits is None or x.ctx_rows.numel() == 0:
        return logp.sum() * 0.0, {"distill_loss": 0.0}, None
    rows = x.ctx_rows
    s_logits, mask = x.student_logits[rows], x.mask[rows]
    t_logp = token_logprobs(x.teacher_logits, x.completion_ids[rows])
    advantage = (t_logp - logp[rows]).detach()
    if cfg.estimator == "sampled":
        per_tok = sampled_token_objective(logp[rows], t_logp)
    else:
        topk = cfg.topk if cfg.estimator == "topk" else None
        # `s_logits` is a copy (row indexing), read by nothing else: with chunks its storage
        # can take the gradient, so backward allocates no (rows, T, V) tensor for it.
        per_tok = per_token_divergence(s_logits, x.teacher_logits, alpha=cfg.alpha, topk=topk,
                                       add_tail=cfg.add_tail, chunk_size=cfg.chunk_size,
                                       overwrite_student=cfg.chunk_size is not None)
    if corrected:
        per_tok = per_tok * importance_weights(logp[rows], old[rows], cfg.importance_clip)
    # Task rows and anchor rows are two token means, so `anchor_weight` sets their balance
    # whatever their lengths; with no anchors this is the plain token mean.
    a_mask = mask & anchor[:, None]
    t_mask = mask & ~a_mask
    loss = (masked_mean(per_tok, t_mask, _count(x, "task"))
            + cfg.anchor_weight * masked_mean(per_tok, a_mask, _count(x, "anchor")))
    with torch.no_grad():
        div = masked_mean(per_tok.detach(), t_mask)
        adv = advantage[mask]
        split = {}
        if anchor.any():
            split = {"anchor_distill_loss": float(masked_mean(per_tok.detach(), a_mask))}
    return loss, {
        "distill_loss": float(div), **split,
        # Token-level credit: the per-token log-ratio log p_T − log p_S on the sampled tokens.
        "advantage_mean": float(adv.mean()) if adv.numel() else 0.0,
        "advantage_min": float(adv.min()) if adv.numel() else 0.0,
        "advantage_max": float(adv.max()) if adv.numel() else 0.0,
    }, advantage
