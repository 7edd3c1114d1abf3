"""The two sides of benchmarks/vs_trl.py, each run in its own worker process, and the same-loss
check. Imports TRL (the `bench` extra); the selfdistill package never does.

Settings shared by both sides (``Settings``): the model directory, the knowledge rows, LoRA rank
16 / alpha 32 on every linear layer except the head, top-k 100 with a tail bucket, alpha 0.5,
frozen-base teacher (adapter disabled), 8 prompts per step, 1 completion each, at most 64 new
tokens, temperature 1, one optimizer step per rollout batch, constant learning rate, gradient
clip 1.0, the same seed and thread count. The teacher prompt wording is ours on both sides (TRL's
``teacher_prompt_template`` is set to the text our ``fact`` template produces).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from common import current_rss_bytes, peak_rss_bytes

# Our fact template, rendered with TRL's placeholders (see selfdistill.teacher.contexts).
TEACHER_TEMPLATE = "{prompt}\n\nUseful fact: {privileged_context}\n\nNow answer the request."


@dataclass
class Settings:
    model: str
    train_data: str
    batch_size: int = 8
    max_new_tokens: int = 64
    learning_rate: float = 1e-4
    seed: int = 0
    threads: int = 2
    topk: int = 100
    alpha: float = 0.5
    lora_rank: int = 16
    lora_alpha: float = 32.0
    steps: int = 3
    warmup: int = 1
    micro_batch_size: int | None = None  # ours only
    chunk_size: int | None = None  # ours only; None = our default (loss.chunk_size)
    gradient_checkpointing: bool = False  # ours only
    fold_lora: bool = True  # ours only: decode through LoRA-folded weights (rollout.fold_lora)
    pack_weights: bool = True  # ours only: oneDNN-packed decode weights (rollout.pack_weights)
    # "bfloat16": bf16 autocast on both sides (ours precision=bfloat16, TRL bf16=True); weights,
    # gradients and optimizer state stay float32 on both
    precision: str = "float32"
    # "bfloat16": the frozen base weights are stored in bf16 on both sides (ours base_dtype,
    # TRL's model loaded in bf16; LoRA weights stay float32 on both)
    base_dtype: str = "float32"
    # the CLI's allocator setting (selfdistill.allocator.keep_freed_memory: freed blocks stay in
    # the heap, no fresh pages per tensor): what `selfdistill train` runs with
    keep_freed_memory: bool = False


def _setup(s: Settings) -> None:
    """Every side's process: oneDNN's kernel caches bounded as the CLI bounds them (a process
    setting, not trainer code: TRL's side gets it too), the thread count, and the CLI's
    allocator setting where `keep_freed_memory`."""
    import torch

    from selfdistill.allocator import bound_kernel_caches, keep_freed_memory

    bound_kernel_caches()  # before any kernel runs
    torch.set_num_threads(s.threads)
    if s.keep_freed_memory and not keep_freed_memory():
        raise RuntimeError("keep_freed_memory was asked for but could not be applied (needs "
                           "glibc, and SELFDISTILL_MALLOC unset)")


def our_config(s: Settings) -> Any:
    from selfdistill.train.config import TrainConfig

    loss = {"estimator": "topk", "topk": s.topk, "add_tail": True, "alpha": s.alpha,
            **({"chunk_size": s.chunk_size} if s.chunk_size else {})}  # else: our default
    extra: dict[str, Any] = {"micro_batch_size": s.micro_batch_size} if s.micro_batch_size else {}
    return TrainConfig(model=s.model, method="sdft", train_data=s.train_data, seed=s.seed,
                       steps=s.warmup + s.steps, batch_size=s.batch_size, num_generations=1,
                       max_new_tokens=s.max_new_tokens, temperature=1.0,
                       learning_rate=s.learning_rate, threads=s.threads, trace_store=None,
                       probe_data=None, lora={"rank": s.lora_rank, "alpha": s.lora_alpha},
                       teacher={"regime": "base"}, loss=loss, rollout={"fold_lora": s.fold_lora,
                                                                  "pack_weights": s.pack_weights},
                       gradient_checkpointing=s.gradient_checkpointing,
                       precision=s.precision, base_dtype=s.base_dtype, **extra)


def run_ours(s: Settings) -> dict[str, Any]:
    """Our trainer: `warmup + steps` calls of `train_step`; per-step wall time and phases."""
    _setup(s)
    from selfdistill.data import load_rows
    from selfdistill.train.loop import build_model, make_step_context, train_step

    cfg = our_config(s)
    model, tok, _ = build_model(cfg, progress=False)
    rows = load_rows(s.train_data, require=("prompt", "privileged_context"), purpose="bench")
    ctx = make_step_context(cfg, model, tok, rows)
    loaded = current_rss_bytes()
    steps = []
    for i in range(s.warmup + s.steps):
        m = train_step(cfg, ctx, i)
        phases = {k[5:]: v for k, v in m.items() if k.startswith("time_")}
        steps.append({"seconds": m["step_seconds"], "tokens": m["tokens"], "loss": m["loss"],
                      "phases": phases})
    return _result(steps[s.warmup:], loaded)


def _result(steps: list[dict[str, Any]], loaded: int) -> dict[str, Any]:
    for st in steps:
        st["phases"]["other"] = max(st["seconds"] - sum(st["phases"].values()), 0.0)
    return {"steps": steps, "rss_loaded": loaded, "rss_peak": peak_rss_bytes(),
            "loadavg": os.getloadavg()}


def trl_trainer(s: Settings, model: Any, tok: Any, rows: list[Any], out_dir: str) -> Any:
    """TRL's SDFTTrainer on `model` (a plain HF model; TRL wraps it with the same LoRA)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl.experimental.sdft import SDFTConfig, SDFTTrainer

    data = Dataset.from_list([{"prompt": r.messages, "privileged_context": r.privileged_context}
                              for r in rows])
    args = SDFTConfig(
        output_dir=out_dir, per_device_train_batch_size=s.batch_size, num_generations=1,
        max_completion_length=s.max_new_tokens, temperature=1.0, learning_rate=s.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        max_steps=s.warmup + s.steps, seed=s.seed, use_cpu=True,
        bf16=s.precision == "bfloat16",
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, distillation_mode="topk_logits", distillation_topk=s.topk,
        distillation_add_tail=True, distillation_alpha=s.alpha, teacher_model_kind="base",
        teacher_prompt_template=TEACHER_TEMPLATE,
    )
    lora = LoraConfig(r=s.lora_rank, lora_alpha=s.lora_alpha, lora_dropout=0.0,
                      target_modules="all-linear", task_type="CAUSAL_LM")
    return SDFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                       peft_config=lora)


class _PhaseClock:
    """Wall seconds per phase and per optimizer step of a TRL run, from wrappers around the
    trainer's own methods and Trainer callbacks (no change to what TRL computes)."""

    def __init__(self) -> None:
        self.cur: dict[str, float] = {}
        self.tokens = 0
        self.steps: list[dict[str, Any]] = []
        self._t0 = self._opt0 = 0.0

    @contextmanager
    def phase(self, name: str) -> Any:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.cur[name] = self.cur.get(name, 0.0) + time.perf_counter() - t0

    def wrap(self, fn: Callable[..., Any], name: Callable[[], str]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            with self.phase(name()):
                return fn(*a, **k)
        return timed


def run_trl(s: Settings) -> dict[str, Any]:
    """TRL's trainer: `trainer.train()` for `warmup + steps` optimizer steps."""
    _setup(s)
    import tempfile

    import torch
    from transformers import TrainerCallback

    from selfdistill.data import load_rows
    from selfdistill.models import load_model
    from selfdistill.train.loop import seed_everything

    seed_everything(s.seed)
    lm = load_model(s.model, progress=False, dtype=getattr(torch, s.base_dtype))
    rows = load_rows(s.train_data, require=("prompt", "privileged_context"), purpose="bench")
    clock = _PhaseClock()
    with tempfile.TemporaryDirectory() as out:
        trainer = trl_trainer(s, lm.model, lm.tokenizer, rows, out)
        want = "bf16" if s.precision == "bfloat16" else "no"
        if trainer.accelerator.mixed_precision != want:  # the comparison would not be same-work
            raise RuntimeError(f"TRL runs mixed precision {trainer.accelerator.mixed_precision!r}"
                               f", expected {want!r} for precision={s.precision}")
        trained = {p.dtype for p in trainer.model.parameters() if p.requires_grad}
        if trained != {torch.float32}:  # ours trains float32 LoRA weights whatever the base's
            raise RuntimeError(f"TRL trains LoRA weights of dtype {trained}, not float32")
        gen = trainer._generate

        def generate(ids: Any) -> Any:
            with clock.phase("generate"):
                prompts, completions = gen(ids)
            clock.tokens += sum(len(c) for c in completions)
            return prompts, completions

        trainer._generate = generate
        # student = compute_loss (student forward, teacher forward, loss) minus the teacher
        # forward, plus backward; settled in on_step_end.
        trainer._forward_logits = clock.wrap(
            trainer._forward_logits,
            lambda: "student_fwd" if torch.is_grad_enabled() else "teacher")
        trainer.compute_loss = clock.wrap(trainer.compute_loss, lambda: "loss_total")
        trainer.accelerator.backward = clock.wrap(trainer.accelerator.backward,
                                                  lambda: "backward")

        class Steps(TrainerCallback):
            def on_step_begin(self, *a: Any, **k: Any) -> None:
                clock.cur, clock.tokens, clock._t0 = {}, 0, time.perf_counter()

            def on_pre_optimizer_step(self, *a: Any, **k: Any) -> None:
                clock._opt0 = time.perf_counter()

            def on_step_end(self, *a: Any, **k: Any) -> None:
                end = time.perf_counter()
                cur = clock.cur
                phases = {"generate": cur.get("generate", 0.0), "teacher": cur.get("teacher", 0.0),
                          "student": cur.get("loss_total", 0.0) - cur.get("teacher", 0.0)
                          + cur.get("backward", 0.0), "optimizer": end - clock._opt0}
                clock.steps.append({"seconds": end - clock._t0, "tokens": clock.tokens,
                                    "phases": phases})

            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                       **k: Any) -> None:
                if logs and "loss" in logs and clock.steps:
                    clock.steps[-1]["loss"] = logs["loss"]

        trainer.add_callback(Steps())
        loaded = current_rss_bytes()
        trainer.train()
    return _result(clock.steps[s.warmup:], loaded)


def run_side(cfg: dict[str, Any]) -> dict[str, Any]:
    """Worker entry: ``cfg = {"side": "ours" | "ours_lean" | "trl" | "check", **Settings}``."""
    side = cfg.pop("side")
    s = Settings(**cfg)
    if side == "check":
        from same_loss import same_loss_check

        _setup(s)
        return same_loss_check(s)
    return run_trl(s) if side == "trl" else run_ours(s)  # "ours" or "ours_lean"


__all__ = ["Settings", "our_config", "run_side", "trl_trainer"]
