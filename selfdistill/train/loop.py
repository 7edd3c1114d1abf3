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

import functools
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
from selfdistill.rollout.base import HFSampler
from selfdistill.rollout.hf import generate
from selfdistill.rollout.seeding import (
    ANCHOR_STREAM,
    BASE_ANCHOR_STREAM,
    TASK_STREAM,
    sample_seed,
)
from selfdistill.rollout.weights import frozen_weights_in
from selfdistill.teacher import (
    PackedBatch,
    PromptCache,
    build_batch,
    build_teacher_messages,
    length_groups,
    load_teacher,
    make_regime,
)
from selfdistill.train.config import TrainConfig
from selfdistill.train.dist import SINGLE
from selfdistill.train.methods import (
    ROLLOUT_METHODS,
    Sample,
    sdft_contexts,
    sdpo_contexts,
    token_counts,
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
    sampler: Any = None  # rollout backend (`rollout.base.Sampler`); None = in-process HF
    dist: Any = SINGLE  # ranks and collectives (`train.dist.Dist`)
    train_model: Any = None  # the engine's wrapper of `model` (DDP / FSDP); None = `model`
    prompt_cache: PromptCache | None = None  # frozen teachers' prompt keys/values
    base_anchors: dict[int, Any] = field(default_factory=dict)  # anchor_source=base samples


def make_samples(cfg: TrainConfig, ctx: StepContext, indices: list[int], step: int,
                 timer: PhaseTimer, offset: int = 0) -> list[Sample]:
    """Targets of one step: rollouts for sdft/sdpo/grpo (task prompts first, then the step's
    anchor prompts), fixed texts for sft/cpt. `indices` are this rank's rows, starting at
    position `offset` of the global batch: groups are numbered globally (task prompt k of the
    step = group k; anchor prompt j = group batch_size + j)."""
    tok = ctx.tokenizer
    rows = [ctx.rows[i] for i in indices]
    if cfg.method == "cpt":
        start = cpt_prompt(tok)
        return [Sample(i, r, offset + g, start, _text_ids(tok, r.privileged_context),
                       r.privileged_context) for g, (i, r) in enumerate(zip(indices, rows,
                                                                            strict=True))]
    prompts = [prompt_ids(tok, r.messages) for r in rows]
    if cfg.method == "sft":
        return [Sample(i, r, offset + g, p, _text_ids(tok, r.privileged_context),
                       r.privileged_context)
                for g, (i, r, p) in enumerate(zip(indices, rows, prompts, strict=True))]
    a_shard = ctx.dist.shard(cfg.anchor_batch_size, "anchor_batch_size")
    a_idx = (batch_indices(step, len(ctx.anchors), cfg.anchor_batch_size, cfg.seed + 1)[a_shard]
             if cfg.anchor_batch_size else [])
    a_rows = [ctx.anchors[i] for i in a_idx]
    a_prompts = [prompt_ids(tok, r.messages) for r in a_rows]
    with timer("generate"):
        if cfg.anchor_source == "base":
            groups, _ = _rollouts(cfg, ctx, step, (prompts, offset), ([], a_shard.start))
            a_groups = [[c] for c in base_anchor_completions(cfg, ctx, a_idx)]
        else:
            groups, a_groups = _rollouts(cfg, ctx, step, (prompts, offset),
                                         (a_prompts, a_shard.start))
    lag = lambda c: step - c.meta.get("adapter_version", step)  # noqa: E731
    samples = [Sample(i, r, offset + g, p, c.token_ids, c.text, behaviour_logprobs=c.logprobs,
                      lag=lag(c))
               for g, (i, r, p, group) in enumerate(zip(indices, rows, prompts, groups,
                                                        strict=True))
               for c in group]
    on_policy = cfg.anchor_source == "student"  # base samples' log-probs are not a sampler's
    samples += [Sample(i, r, cfg.batch_size + a_shard.start + j, p, group[0].token_ids,
                       group[0].text, anchor=True,
                       behaviour_logprobs=group[0].logprobs if on_policy else None,
                       lag=lag(group[0]) if on_policy else 0)
                for j, (i, r, p, group) in enumerate(zip(a_idx, a_rows, a_prompts, a_groups,
                                                         strict=True))]
    return samples


def _rollouts(cfg: TrainConfig, ctx: StepContext, step: int,
              task: tuple[list[list[int]], int],
              anchor: tuple[list[list[int]], int]) -> tuple[list[Any], list[Any]]:
    """`num_generations` completions per task prompt and one per anchor prompt, each seeded by
    its global index in the step (`rollout.seeding`), so the tokens do not depend on the
    sharding; `task` / `anchor` = (prompts, global index of the first). One sampler call when
    both take one completion."""
    sampler = ctx.sampler or HFSampler.from_config(cfg.rollout, ctx.model, ctx.tokenizer)
    sampler.sync(ctx.model, step, ctx.dist)
    n = cfg.num_generations
    (t_ps, t_first), (a_ps, a_first) = task, anchor
    t_seeds = [sample_seed(cfg.seed, step, TASK_STREAM, (t_first + i) * n + j)
               for i in range(len(t_ps)) for j in range(n)]
    a_seeds = [sample_seed(cfg.seed, step, ANCHOR_STREAM, a_first + i) for i in range(len(a_ps))]

    def run(ps: list[list[int]], k: int, seeds: list[int]) -> list[Any]:
        return sampler.sample(ps, n=k, max_new_tokens=cfg.max_new_tokens,
                              temperature=cfg.temperature, top_p=cfg.top_p, seeds=seeds)

    if n == 1:
        both = run(t_ps + a_ps, 1, t_seeds + a_seeds)
        return both[:len(t_ps)], both[len(t_ps):]
    return run(t_ps, n, t_seeds), run(a_ps, 1, a_seeds) if a_ps else []


def base_anchor_completions(cfg: TrainConfig, ctx: StepContext, indices: list[int]) -> list[Any]:
    """`anchor_source=base`: the initial weights' completion of each anchor prompt (adapter off),
    seeded by the anchor's index and reused in every later step. All anchors are drawn at the
    first call, in their file order and fixed batches, so a resumed run (which draws them again)
    gets bit-identical tokens: a batch's padding, and so its float rounding, never depends on
    which anchors a step happened to need first."""
    if not ctx.base_anchors:
        every = list(range(len(ctx.anchors)))
        prompts = [prompt_ids(ctx.tokenizer, ctx.anchors[i].messages) for i in every]
        seeds = [sample_seed(cfg.seed, 0, BASE_ANCHOR_STREAM, i) for i in every]
        with ctx.model.disable_adapter():
            drawn = generate(ctx.model, ctx.tokenizer, prompts, n=1,
                             max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                             top_p=cfg.top_p, batch_size=BASE_ANCHOR_BATCH, seeds=seeds,
                             fold_lora=False)
        ctx.base_anchors.update((i, group[0]) for i, group in zip(every, drawn, strict=True))
    return [ctx.base_anchors[i] for i in indices]


BASE_ANCHOR_BATCH = 16  # fixed: the draw must not depend on the run's batch settings


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
            tp = teacher_messages(cfg, ctx.tokenizer, s.row.messages, s.contexts)
            s.teacher_prompt = prompt_ids(ctx.tokenizer, tp.messages)
            s.teacher_messages = tp.messages
            s.truncated_tokens = tp.truncated_tokens
    if cfg.teacher.context == "none" and cfg.method in ROLLOUT_METHODS:
        for s in samples:  # classic on-policy distillation: every rollout, no privileged context
            s.contexts, s.truncated_tokens = [], 0
        anchors = anchors + samples
    for s in anchors:  # the teacher sees exactly the student's prompt
        s.teacher_prompt, s.teacher_messages = s.prompt, s.row.messages


def teacher_messages(cfg: TrainConfig, tok: Any, messages: list[dict[str, str]],
                     contexts: list[Any]) -> Any:
    """The teacher's prompt (`TeacherPrompt`): `messages` with `contexts`, capped per config."""
    return build_teacher_messages(messages, contexts, tokenizer=tok,
                                  max_context_tokens=cfg.teacher.max_context_tokens,
                                  truncate=cfg.teacher.truncate)


def fixed_teacher_prompts(cfg: TrainConfig, tok: Any, rows: list[Row],
                          anchors: list[Row]) -> list[list[int]]:
    """Teacher prompts known before training (those that do not depend on an attempt): every
    anchor's (the student's prompt), and every row's under sdft (its fixed privileged context)
    or under `teacher.context=none` (the student's prompt). SDPO's feedback prompts are not."""
    out = [prompt_ids(tok, r.messages) for r in anchors]
    if cfg.teacher.context == "none" and cfg.method in ROLLOUT_METHODS:
        out += [prompt_ids(tok, r.messages) for r in rows]
    elif cfg.method == "sdft":
        out += [prompt_ids(tok, teacher_messages(cfg, tok, r.messages, sdft_contexts(r)).messages)
                for r in rows]
    return out


def train_step(cfg: TrainConfig, ctx: StepContext, step: int) -> dict[str, float]:
    """One rollout batch and `updates_per_batch` optimizer steps; returns the step's metrics."""
    timer = PhaseTimer()
    t_start = time.perf_counter()
    dist = ctx.dist  # data parallelism: this rank's shard of the global batch (train/dist.py)
    shard = dist.shard(cfg.batch_size, "batch_size")
    indices = batch_indices(step, len(ctx.rows), cfg.batch_size, cfg.seed)[shard]
    model, train_model = ctx.model, ctx.train_model or ctx.model
    with precision(cfg, model):
        samples = make_samples(cfg, ctx, indices, step, timer, offset=shard.start)
    attach_contexts(cfg, ctx, samples, timer)
    share = share_prefix(cfg, model, train_model)
    metrics: dict[str, float] = {}
    # teacher and student passes round the frozen weights to bf16 once, not at every forward
    with frozen_weights_in(model, frozen_weight_dtype(cfg, model, dist)):
        with precision(cfg, model):
            ctx_rows, teacher_logits, sb = score_batch(ctx.regime, model, samples,
                                                       ctx.tokenizer.pad_token_id, timer,
                                                       share_prefix=share,
                                                       prompt_cache=ctx.prompt_cache)
        has_signal = dist.any(_has_signal(cfg, samples, ctx_rows))
        counts = dist.global_counts(token_counts(samples, sb.completion_mask, ctx_rows))
        for update in range(cfg.updates_per_batch if has_signal else 0):
            with timer("student"):  # forward + loss + backward, in micro-batches if configured
                loss, m = student_backward(cfg, train_model, samples, sb, teacher_logits,
                                           ctx_rows, update, ctx.tokenizer.pad_token_id,
                                           lambda: precision(cfg, model), counts=counts,
                                           backward=dist.backward)
            with timer("optimizer"):
                gnorm = dist.clip_grad_norm_(train_model, cfg.max_grad_norm)
                ctx.optimizer.step()
                ctx.optimizer.zero_grad(set_to_none=True)
                ctx.scheduler.step()
                ctx.regime.after_step(model)
            if update == 0:
                metrics.update(m, loss=loss.item(), grad_norm=gnorm)
    model.eval()
    elapsed = time.perf_counter() - t_start
    n_tokens = int(sb.completion_mask.sum())
    metrics.update(_batch_metrics(samples, ctx_rows), lr=ctx.scheduler.get_last_lr()[0],
                   tokens=n_tokens, tokens_per_s=n_tokens / elapsed, step_seconds=elapsed,
                   **{f"time_{k}": v for k, v in timer.seconds.items()})
    metrics["skipped_update"] = float(not has_signal)
    metrics = dist.reduce_metrics(metrics)
    if dist.world > 1 and cfg.trace_store is not None:  # rank 0 records the global batch
        samples = sorted((s for part in dist.gather(samples) for s in part),
                         key=lambda s: (s.anchor, s.group))
    if ctx.recorder is not None:
        ctx.recorder.on_step(step + 1, samples, metrics)
    return metrics


def precision(cfg: TrainConfig, model: Any) -> Any:
    """Autocast for forward passes under `cfg.precision`: bfloat16 runs the matmuls in bf16
    (weights, gradients and optimizer state stay float32; logits are cast back to float32 for
    the losses); float32 is a no-op; auto is bfloat16 where `native_bf16` holds."""
    return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16,
                          enabled=autocast_dtype(cfg, model) is not None)


def autocast_dtype(cfg: TrainConfig, model: Any) -> torch.dtype | None:
    """The dtype `precision(cfg, model)` runs linear layers in: bfloat16, or None (float32)."""
    device = next(model.parameters()).device
    return torch.bfloat16 if resolve_precision(cfg.precision, device) == "bfloat16" else None


def frozen_weight_dtype(cfg: TrainConfig, model: Any, dist: Any = SINGLE) -> torch.dtype | None:
    """The dtype a step's teacher and student passes store the frozen linear weights in
    (`rollout.weights.frozen_weights_in`; None = as loaded): autocast's dtype, except under
    gradient checkpointing (the memory option: the bf16 copy is held for the whole step, where
    checkpointed layers free autocast's per-layer copies; measured on the vs-TRL lean settings,
    bf16, 2-core AVX512 EPYC: +170 MiB peak for 0.35 s of a 4.7 s step) and under a sharding
    engine (FSDP / DeepSpeed own the parameters)."""
    if cfg.gradient_checkpointing or dist.sharded:
        return None
    return autocast_dtype(cfg, model)


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` → "bfloat16" when `native_bf16(device)`, else "float32"; others unchanged."""
    if precision != "auto":
        return precision
    return "bfloat16" if native_bf16(device) else "float32"


@functools.cache
def native_bf16(device: torch.device) -> bool:
    """Whether `device` runs bfloat16 matmuls in hardware: a CUDA device that supports bf16, or
    a CPU with AVX512-BF16 or AMX. Elsewhere (e.g. AVX2-only CPUs) oneDNN emulates bf16, and an
    autocast forward+backward was measured ~50× slower than float32 (2-core AVX2 EPYC)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False


def share_prefix(cfg: TrainConfig, model: Any, train_model: Any) -> bool:
    """Whether the student scores its batch with a shared prefix (`cfg.share_prefix`). Not
    through an engine wrapper (DDP counts one forward per backward; the prefix is a second)
    nor under gradient checkpointing (the recomputed layers would extend the cache twice)."""
    return cfg.share_prefix and train_model is model and not cfg.gradient_checkpointing


def score_batch(regime: Any, model: Any, samples: list[Sample], pad: int,
                timer: PhaseTimer, *, share_prefix: bool = False,
                prompt_cache: PromptCache | None = None,
                ) -> tuple[list[int], torch.Tensor | None, PackedBatch]:
    """Teacher logits (no gradient, (B_ctx, T, V)) of the samples with a teacher prompt, their
    row indices, and the packed student batch. Shared by `train_step` and `traces replay`.

    A frozen teacher reads the keys and values of prompts in its `prompt_cache` and runs over
    those rows' completions only. The other rows run in groups of similar prompt length
    (`length_groups`: task rows with a long privileged context and anchor rows with none pad
    to their own widths), each sharing its prompts' common prefix. The student batch
    shares its prefix when `share_prefix`."""
    ctx_rows = [i for i, s in enumerate(samples) if s.teacher_prompt is not None]
    device = next(model.parameters()).device
    sb = build_batch([s.prompt for s in samples], [s.completion for s in samples], pad,
                     device=device, share_prefix=share_prefix)
    width = sb.completion_ids.shape[1]  # the longest completion may be a row without context
    teacher_logits = None
    if not ctx_rows:
        return ctx_rows, teacher_logits, sb
    prompts = [samples[i].teacher_prompt for i in ctx_rows]
    completions = [samples[i].completion for i in ctx_rows]
    use_cache = prompt_cache is not None and regime.frozen
    cached = [j for j, p in enumerate(prompts) if use_cache and p in prompt_cache]
    rest = sorted(set(range(len(prompts))) - set(cached))
    parts = []  # (rows of ctx_rows, their logits)
    with timer("teacher"):
        if cached:
            cache, cache_width = prompt_cache.assemble([prompts[j] for j in cached])
            tb = build_batch([prompts[j] for j in cached], [completions[j] for j in cached], pad,
                             device=device, completion_width=width)
            parts.append((cached, regime.teacher_logits(
                model, tb.input_ids, tb.attention_mask, tb.position_ids, width, cache_width,
                cache).float()))
        for group in length_groups([len(prompts[j]) for j in rest]):
            rows = [rest[j] for j in group]
            tb = build_batch([prompts[j] for j in rows], [completions[j] for j in rows], pad,
                             device=device, completion_width=width, share_prefix=True)
            parts.append((rows, regime.teacher_logits(
                model, tb.input_ids, tb.attention_mask, tb.position_ids, width,
                tb.prefix_width).float()))
        if len(parts) == 1 and parts[0][0] == list(range(len(prompts))):
            return ctx_rows, parts[0][1], sb
        teacher_logits = parts[0][1].new_empty((len(prompts), *parts[0][1].shape[1:]))
        for rows, logits in parts:
            teacher_logits[torch.tensor(rows, device=logits.device)] = logits
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


def build_model(cfg: TrainConfig, *, progress: bool,
                device: torch.device | None = None) -> tuple[Any, Any, str]:
    """Load the base model and wrap it for training (LoRA by default). Seeds before LoRA init.
    `device` (a rank's device under data parallelism) overrides `cfg.device`."""
    from selfdistill.models import attach_lora, load_model

    lm = load_model(cfg.model, progress=progress, dtype=getattr(torch, cfg.base_dtype))
    seed_everything(cfg.seed)
    model = lm.model.to(device or resolve_device(cfg.device))
    if cfg.gradient_checkpointing:  # `activation_…` is the newer transformers name
        kw = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
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


def uses_prompt_cache(cfg: TrainConfig, regime: Any) -> bool:
    """Whether the teacher reads prompts from a prompt cache: a frozen regime, cache not off."""
    return bool(regime.frozen and cfg.teacher.prompt_cache_mb)


def warm_prompt_cache(cfg: TrainConfig, regime: Any, model: Any, tokenizer: Any,
                      rows: list[Row], anchors: list[Row]) -> PromptCache | None:
    """The frozen teacher's cache of the prompts known before training (None when the regime
    is not frozen, the cache is off or no prompt is fixed). Deterministic: the same rows give
    bit-identical entries, which `traces replay` relies on to recompute a step exactly."""
    if not uses_prompt_cache(cfg, regime):
        return None
    prompts = fixed_teacher_prompts(cfg, tokenizer, rows, anchors)
    if not prompts:
        return None
    cache = PromptCache(cfg.teacher.prompt_cache_mb * 2**20)
    with precision(cfg, model):
        cache.warm(regime, model, prompts, tokenizer.pad_token_id)
    return cache


def make_step_context(cfg: TrainConfig, model: Any, tokenizer: Any, rows: list[Row],
                      anchors: list[Row] = (), *, dist: Any = SINGLE,
                      train_model: Any = None, sampler: Any = None) -> StepContext:
    """Everything a step needs. Under data parallelism `train_model` is the engine's wrapper
    of `model` (`Dist.prepare_model`): the optimizer is built over its parameters."""
    optimizer, scheduler = make_optimizer(cfg, train_model or model)
    regime = make_teacher_regime(cfg, tokenizer)
    graders = None
    if cfg.method in ("sdpo", "grpo"):
        from selfdistill.envs import make_env

        reveal = cfg.sdpo.reveal_answer

        def graders(row: Row) -> Any:
            return make_env(row, reveal=reveal)
    cache = warm_prompt_cache(cfg, regime, model, tokenizer, rows, list(anchors))
    return StepContext(model, tokenizer, regime, optimizer, scheduler, rows, list(anchors),
                       graders, sampler=sampler or HFSampler.from_config(
                           cfg.rollout, model, tokenizer), dist=dist,
                       train_model=train_model, prompt_cache=cache)


__all__ = ["ROLLOUT_METHODS", "StepContext", "batch_indices", "build_model", "make_step_context",
           "make_teacher_regime", "seed_everything", "train_step", "update_loss",
           "uses_prompt_cache", "warm_prompt_cache"]
