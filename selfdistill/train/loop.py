"""The on-policy loop: rollout → feedback → teacher context → signal → optimizer step.

One step (see DESIGN.md "The loop"):
1. the student samples `num_generations` completions for `batch_size` prompts (KV-cache
   generation, temperature / top-p from the config);
2. graders (sdpo/grpo) return rewards and feedback; each attempt gets its teacher context;
3. one batched teacher forward (no gradient, completion positions only) and one student forward
   score the student's own tokens; the method's loss (`methods.method_loss`) is reduced per token;
4. AdamW steps the adapter; the teacher regime updates (EMA). With `updates_per_batch > 1` the
   same rollouts are reused, importance-corrected, and the teacher logits are computed once.
Phase timings (generate / grade / teacher / student / optimizer) go to `metrics.jsonl`.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from selfdistill.chat import prompt_ids
from selfdistill.data import Row, is_graded, row_correct
from selfdistill.rollout import generate
from selfdistill.teacher import (
    PackedBatch,
    build_batch,
    build_teacher_messages,
    load_teacher,
    make_regime,
)
from selfdistill.train.config import TrainConfig
from selfdistill.train.methods import (
    ROLLOUT_METHODS,
    Sample,
    sdft_contexts,
    sdpo_contexts,
)
from selfdistill.train.microbatch import student_backward, update_loss


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def batch_indices(step: int, n_rows: int, batch_size: int, seed: int) -> list[int]:
    """Rows of step `step`: consecutive slices of per-epoch permutations (seeded by seed+epoch),
    so the data position is a pure function of the step — resume needs nothing else."""
    out = []
    start = step * batch_size
    for pos in range(start, start + batch_size):
        epoch, offset = divmod(pos, n_rows)
        perm = np.random.default_rng([seed, epoch]).permutation(n_rows)
        out.append(int(perm[offset]))
    return out


class PhaseTimer:
    """Accumulates wall seconds per named phase: `with timer("teacher"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


@dataclass
class StepContext:
    """What a step needs besides the config: the model, tokenizer, teacher regime, optimizer."""

    model: Any
    tokenizer: Any
    regime: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    rows: list[Row]
    anchors: list[Row] = field(default_factory=list)  # anchor prompts (see TrainConfig)
    graders: Any = None  # callable(row) -> env with .step(text) -> Feedback (sdpo / grpo)
    recorder: Any = None  # .on_step(step, samples, metrics): the trace store (off the hot path)


def make_samples(cfg: TrainConfig, ctx: StepContext, indices: list[int], step: int,
                 timer: PhaseTimer) -> list[Sample]:
    """Targets of one step: rollouts for sdft/sdpo/grpo (task prompts first, then the step's
    anchor prompts), fixed texts for sft/cpt."""
    tok = ctx.tokenizer
    rows = [ctx.rows[i] for i in indices]
    if cfg.method == "cpt":
        start = cpt_prompt(tok)
        return [Sample(i, r, g, start, _text_ids(tok, r.privileged_context), r.privileged_context)
                for g, (i, r) in enumerate(zip(indices, rows, strict=True))]
    prompts = [prompt_ids(tok, r.messages) for r in rows]
    if cfg.method == "sft":
        return [Sample(i, r, g, p, _text_ids(tok, r.privileged_context), r.privileged_context)
                for g, (i, r, p) in enumerate(zip(indices, rows, prompts, strict=True))]
    a_idx = (batch_indices(step, len(ctx.anchors), cfg.anchor_batch_size, cfg.seed + 1)
             if cfg.anchor_batch_size else [])
    a_rows = [ctx.anchors[i] for i in a_idx]
    a_prompts = [prompt_ids(tok, r.messages) for r in a_rows]
    with timer("generate"):
        groups, a_groups = _rollouts(cfg, ctx, prompts, a_prompts)
    samples = [Sample(i, r, g, p, c.token_ids, c.text)
               for g, (i, r, p, group) in enumerate(zip(indices, rows, prompts, groups,
                                                        strict=True))
               for c in group]
    samples += [Sample(i, r, len(rows) + j, p, group[0].token_ids, group[0].text, anchor=True)
                for j, (i, r, p, group) in enumerate(zip(a_idx, a_rows, a_prompts, a_groups,
                                                         strict=True))]
    return samples


def _rollouts(cfg: TrainConfig, ctx: StepContext, prompts: list[list[int]],
              a_prompts: list[list[int]]) -> tuple[list[Any], list[Any]]:
    """`num_generations` completions per task prompt and one per anchor prompt; one batched
    `generate` call when both take one completion."""
    def run(ps: list[list[int]], n: int) -> list[Any]:
        return generate(ctx.model, ctx.tokenizer, ps, n=n, max_new_tokens=cfg.max_new_tokens,
                        temperature=cfg.temperature, top_p=cfg.top_p,
                        batch_size=len(ps) * n) if ps else []

    if cfg.num_generations == 1:
        both = run(prompts + a_prompts, 1)
        return both[:len(prompts)], both[len(prompts):]
    return run(prompts, cfg.num_generations), run(a_prompts, 1)


def cpt_prompt(tok: Any) -> list[int]:
    """The student "prompt" of a cpt target: one start token (BOS, else EOS)."""
    return [tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id]


def _text_ids(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def attach_contexts(cfg: TrainConfig, ctx: StepContext, samples: list[Sample],
                    timer: PhaseTimer) -> None:
    """Grade attempts (sdpo/grpo) and build each sample's teacher prompt (sdft/sdpo)."""
    anchors = [s for s in samples if s.anchor]
    samples = [s for s in samples if not s.anchor]
    if cfg.method in ("sdpo", "grpo"):
        from selfdistill.envs import step_many

        with timer("grade"):  # sandboxed code runs wait on processes: grade in parallel
            feedback = step_many([ctx.graders(s.row) for s in samples], [s.text for s in samples])
            for s, fb in zip(samples, feedback, strict=True):
                s.feedback, s.reward = fb, float(fb.reward)
    if cfg.method == "sdft":
        for s in samples:
            s.contexts = sdft_contexts(s.row)
    elif cfg.method == "sdpo":
        for g in sorted({s.group for s in samples}):
            sdpo_contexts([s for s in samples if s.group == g],
                          success_threshold=cfg.sdpo.success_threshold,
                          sibling_solutions=cfg.sdpo.sibling_solutions,
                          include_self=cfg.sdpo.include_self,
                          feedback_for_successes=cfg.sdpo.feedback_for_successes,
                          environment_feedback=cfg.sdpo.environment_feedback)
    for s in samples:
        if s.contexts:
            tp = build_teacher_messages(s.row.messages, s.contexts, tokenizer=ctx.tokenizer,
                                        max_context_tokens=cfg.teacher.max_context_tokens,
                                        truncate=cfg.teacher.truncate)
            s.teacher_prompt = prompt_ids(ctx.tokenizer, tp.messages)
            s.teacher_messages = tp.messages
            s.truncated_tokens = tp.truncated_tokens
    if cfg.teacher.context == "none" and cfg.method in ROLLOUT_METHODS:
        for s in samples:  # classic on-policy distillation: every rollout, no privileged context
            s.contexts, s.truncated_tokens = [], 0
        anchors = anchors + samples
    for s in anchors:  # the teacher sees exactly the student's prompt
        s.teacher_prompt, s.teacher_messages = s.prompt, s.row.messages


def train_step(cfg: TrainConfig, ctx: StepContext, step: int) -> dict[str, float]:
    """One rollout batch and `updates_per_batch` optimizer steps; returns the step's metrics."""
    timer = PhaseTimer()
    t_start = time.perf_counter()
    indices = batch_indices(step, len(ctx.rows), cfg.batch_size, cfg.seed)
    model = ctx.model
    with precision(cfg, model):
        samples = make_samples(cfg, ctx, indices, step, timer)
    attach_contexts(cfg, ctx, samples, timer)
    with precision(cfg, model):
        ctx_rows, teacher_logits, sb = score_batch(ctx.regime, model, samples,
                                                   ctx.tokenizer.pad_token_id, timer)
    has_signal = _has_signal(cfg, samples, ctx_rows)
    metrics: dict[str, float] = {}
    for update in range(cfg.updates_per_batch if has_signal else 0):
        with timer("student"):  # forward + loss + backward, in micro-batches when configured
            loss, m = student_backward(cfg, model, samples, sb, teacher_logits, ctx_rows, update,
                                       ctx.tokenizer.pad_token_id, lambda: precision(cfg, model))
        with timer("optimizer"):
            params = [p for p in model.parameters() if p.requires_grad]
            gnorm = (torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                     if cfg.max_grad_norm else torch.tensor(0.0))
            ctx.optimizer.step()
            ctx.optimizer.zero_grad(set_to_none=True)
            ctx.scheduler.step()
            ctx.regime.after_step(model)
        if update == 0:
            metrics.update(m, loss=loss.item(), grad_norm=float(gnorm))
    model.eval()
    elapsed = time.perf_counter() - t_start
    n_tokens = int(sb.completion_mask.sum())
    metrics.update(_batch_metrics(samples, ctx_rows), lr=ctx.scheduler.get_last_lr()[0],
                   tokens=n_tokens, tokens_per_s=n_tokens / elapsed, step_seconds=elapsed,
                   **{f"time_{k}": v for k, v in timer.seconds.items()})
    metrics["skipped_update"] = float(not has_signal)
    if ctx.recorder is not None:
        ctx.recorder.on_step(step + 1, samples, metrics)
    return metrics


def precision(cfg: TrainConfig, model: Any) -> Any:
    """Autocast for forward passes under `cfg.precision`: bfloat16 runs the matmuls in bf16
    (weights, gradients and optimizer state stay float32; logits are cast back to float32 for
    the losses); float32 is a no-op."""
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=torch.bfloat16, enabled=cfg.precision == "bfloat16")


def score_batch(regime: Any, model: Any, samples: list[Sample], pad: int,
                timer: PhaseTimer) -> tuple[list[int], torch.Tensor | None, PackedBatch]:
    """Teacher logits (no gradient, (B_ctx, T, V)) of the samples with a teacher prompt, their
    row indices, and the packed student batch. Shared by `train_step` and `traces replay`."""
    ctx_rows = [i for i, s in enumerate(samples) if s.teacher_prompt is not None]
    device = next(model.parameters()).device
    sb = build_batch([s.prompt for s in samples], [s.completion for s in samples], pad,
                     device=device)
    width = sb.completion_ids.shape[1]  # the longest completion may be a row without context
    teacher_logits = None
    if ctx_rows:
        with timer("teacher"):
            tb = build_batch([samples[i].teacher_prompt for i in ctx_rows],
                             [samples[i].completion for i in ctx_rows], pad, device=device,
                             completion_width=width)
            teacher_logits = regime.teacher_logits(
                model, tb.input_ids, tb.attention_mask, tb.position_ids, width + 1)[:, :-1].float()
    return ctx_rows, teacher_logits, sb


def _has_signal(cfg: TrainConfig, samples: list[Sample], ctx_rows: list[int]) -> bool:
    if cfg.method in ("sft", "cpt"):
        return True
    distill_on = cfg.method != "sdpo" or cfg.loss.distillation_weight > 0
    if ctx_rows and distill_on:  # context rows (sdft / sdpo) or anchors (any rollout method)
        return True
    pg_on = cfg.method == "grpo" or cfg.loss.distillation_weight < 1
    rewards = [s.reward for s in samples if s.reward is not None]
    return pg_on and len(set(rewards)) > 1  # GRPO advantages are all zero in a uniform group


def _batch_metrics(samples: list[Sample], ctx_rows: list[int]) -> dict[str, float]:
    out: dict[str, float] = {
        "samples": len(samples),
        "no_context": len(samples) - len(ctx_rows),  # no distillation loss for these
        "anchor_samples": sum(s.anchor for s in samples),
        "completion_len": float(np.mean([len(s.completion) for s in samples])),
        "truncated_tokens": float(sum(s.truncated_tokens for s in samples)),
    }
    rewards = [s.reward for s in samples if s.reward is not None]
    if rewards:
        out["reward"] = float(np.mean(rewards))
    answered = [s for s in samples if is_graded(s.row)]
    if answered and samples[0].text:
        out["rollout_accuracy"] = float(np.mean([row_correct(s.row, s.text) for s in answered]))
    return out


def make_optimizer(cfg: TrainConfig, model: Any) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the trainable parameters; linear warm-up then constant or cosine decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    total, warm = max(cfg.steps * cfg.updates_per_batch, 1), cfg.warmup_steps

    def factor(i: int) -> float:
        if warm and i < warm:
            return (i + 1) / warm
        if cfg.lr_schedule == "cosine":
            frac = (i - warm) / max(total - warm, 1)
            return 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        return 1.0

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def build_model(cfg: TrainConfig, *, progress: bool) -> tuple[Any, Any, str]:
    """Load the base model and wrap it for training (LoRA by default). Seeds before LoRA init."""
    from selfdistill.models import attach_lora, load_model

    lm = load_model(cfg.model, progress=progress)
    seed_everything(cfg.seed)
    model = lm.model.to(resolve_device(cfg.device))
    if cfg.lora.enabled:
        model = attach_lora(model, rank=cfg.lora.rank, alpha=cfg.lora.alpha,
                            dropout=cfg.lora.dropout, target_modules=cfg.lora.target_modules)
    model.eval()
    return model, lm.tokenizer, lm.path


def resolve_device(name: str) -> torch.device:
    """`device` config value → torch device ("auto": the first GPU when there is one)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def make_teacher_regime(cfg: TrainConfig, tokenizer: Any) -> Any:
    """The configured teacher regime; `model` loads the other model once, after checking that
    its tokenizer is the student's (UserError otherwise)."""
    if cfg.teacher.regime == "model":
        return load_teacher(cfg.teacher.model, tokenizer, dtype=cfg.teacher.dtype,
                            progress=False)
    return make_regime(cfg.teacher.regime, rate=cfg.teacher.rate)


def make_step_context(cfg: TrainConfig, model: Any, tokenizer: Any, rows: list[Row],
                      anchors: list[Row] = ()) -> StepContext:
    optimizer, scheduler = make_optimizer(cfg, model)
    regime = make_teacher_regime(cfg, tokenizer)
    graders = None
    if cfg.method in ("sdpo", "grpo"):
        from selfdistill.envs import make_env

        reveal = cfg.sdpo.reveal_answer

        def graders(row: Row) -> Any:
            return make_env(row, reveal=reveal)
    return StepContext(model, tokenizer, regime, optimizer, scheduler, rows, list(anchors),
                       graders)


__all__ = ["ROLLOUT_METHODS", "StepContext", "batch_indices", "build_model", "make_step_context",
           "make_teacher_regime", "seed_everything", "train_step", "update_loss"]
