"""A training job end to end: validate → evaluate before → train (checkpoint / resume) →
save the adapter → evaluate after → gate verdict → report and plot."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from selfdistill.data import Row, is_graded, load_rows
from selfdistill.errors import DataError, UserError
from selfdistill.evals import evaluate
from selfdistill.evals.code import evaluate_code, has_tests
from selfdistill.evals.gate import decide
from selfdistill.evals.report import plot_run, write_report
from selfdistill.rollout.base import make_sampler
from selfdistill.teacher import PrivilegedContext, build_teacher_messages
from selfdistill.train.checkpoint import (
    latest_checkpoint,
    load_state,
    load_weights_into,
    rng_state,
    save_checkpoint,
    save_weights,
    set_rng_state,
)
from selfdistill.train.config import REQUIRED_COLUMNS, TrainConfig
from selfdistill.train.dist import Dist
from selfdistill.train.loop import (
    build_model,
    make_step_context,
    native_bf16,
    resolve_precision,
    train_step,
)
from selfdistill.train.metrics import MetricsLogger

_DATA = Path(__file__).resolve().parent.parent / "data"
BUILTIN_PROBES = _DATA / "probes.jsonl"
BUILTIN_ANCHORS = _DATA / "anchors.jsonl"


def load_datasets(cfg: TrainConfig) -> tuple[list[Row], dict[str, list[Row]], list[Row]]:
    """Training rows, evaluation suites and anchor prompts, validated before any model is loaded.

    Suites: "train" (the training rows that carry an `answer`, or `tests`: code problems,
    scored by their tests), each `eval_data` entry, and "probes" (forgetting probes) unless
    `probe_data` is None.
    """
    rows = load_rows(cfg.train_data, require=REQUIRED_COLUMNS[cfg.method],
                     purpose=f"{cfg.method} training")
    if cfg.method in ("sdpo", "grpo"):
        for r in rows:
            if not r.answers and "tests" not in r.extra:
                raise DataError(r.source, None, f"method={cfg.method} needs a grader in every "
                                "row: an 'answer' (QA) or 'tests' (code)")
    suites: dict[str, list[Row]] = {}
    answered = [r for r in rows if is_graded(r) or has_tests(r)]
    if answered:
        suites["train"] = answered
    for name, path in cfg.eval_data.items():
        suites[name] = load_rows(path, require=("prompt", "answer"), purpose="evaluation")
    if cfg.probe_data is not None:
        path = BUILTIN_PROBES if cfg.probe_data == "builtin" else cfg.probe_data
        suites["probes"] = load_rows(path, require=("prompt", "answer"), purpose="probe")
    if cfg.gate.task not in suites:
        raise UserError(f"gate.task={cfg.gate.task!r} is not an evaluation suite; "
                        f"suites: {sorted(suites)} (add it under eval_data)")
    anchors: list[Row] = []
    if cfg.anchor_batch_size:
        path = BUILTIN_ANCHORS if cfg.anchor_data == "builtin" else cfg.anchor_data
        anchors = load_rows(path, require=("prompt",), purpose="anchor")
    return rows, suites, anchors


def _oracle_messages(row: Row) -> list[dict[str, str]]:
    ctx = [PrivilegedContext(row.context_kind, row.privileged_context)]
    return build_teacher_messages(row.messages, ctx).messages


def run_suites(model: Any, tok: Any, suites: dict[str, list[Row]], cfg: TrainConfig, *,
               progress: bool, oracle: bool = False) -> dict[str, dict[str, Any]]:
    """Strict accuracy per suite (rows with `tests`: the code passes them all). `oracle=True`:
    only suites whose rows carry privileged context, with that context in the prompt (the
    teacher's ceiling). All suites' rows are answered in one pass, so a generation batch
    (`eval.batch_size`) is filled across suites rather than suite by suite."""
    if oracle:
        suites = {k: v for k, v in suites.items() if all(r.privileged_context for r in v)}
    rows = [r for part in suites.values() for r in part]
    if not rows:
        return {}
    score = evaluate_code if any(has_tests(r) for r in rows) else evaluate
    rep = score(model, tok, rows, max_new_tokens=cfg.eval.max_new_tokens,
                batch_size=cfg.eval.batch_size, progress=progress,
                messages_fn=_oracle_messages if oracle else None,
                desc=f"{'oracle ' if oracle else ''}{'+'.join(suites)}")
    out, start = {}, 0
    for name, part in suites.items():
        items = rep.items[start:start + len(part)]
        start += len(part)
        correct = sum(i.correct for i in items)
        out[name] = {"accuracy": correct / len(items) if items else 0.0, "correct": correct,
                     "n": len(items),
                     "items": [{"prompt": i.prompt[-1]["content"], "completion": i.completion,
                                "correct": i.correct} for i in items]}
    return out


def _strip(evals: dict[str, dict]) -> dict[str, dict]:
    return {k: {kk: vv for kk, vv in v.items() if kk != "items"} for k, v in evals.items()}


def run_training(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict:
    """Run (or resume) the job described by `cfg`; returns the summary also written to
    `OUTPUT_DIR/summary.json`. Under `accelerate launch` (train/dist.py) every rank trains its
    shard; rank 0 alone writes files and evaluates, the other ranks return `{"rank": r}`."""
    t_total = time.perf_counter()
    dist = Dist.from_env()
    progress = progress and dist.is_main
    rows, suites, anchors = load_datasets(cfg)
    run_dir = Path(cfg.output_dir)
    ckpt = latest_checkpoint(run_dir) if resume else None
    if not resume and (run_dir / "checkpoints" / "index.jsonl").exists():
        raise UserError(f"{run_dir} already holds a run: resume it with "
                        f"`selfdistill train --resume {run_dir}` or set output_dir=...")
    dist.shard(cfg.batch_size, "batch_size")  # fail before loading a model
    dist.shard(cfg.anchor_batch_size, "anchor_batch_size")
    config_yaml = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)

    model, tok, model_path = build_model(cfg, progress=progress, device=dist.device)
    device = next(model.parameters()).device
    if cfg.precision == "bfloat16" and not native_bf16(device) and dist.is_main:
        print(f"warning: precision=bfloat16 on a {device.type} without native bf16 matmuls "
              "(no AVX512-BF16/AMX): autocast is emulated and far slower than float32; "
              "precision=auto picks float32 here", file=sys.stderr)
    ctx = make_step_context(cfg, model, tok, rows, anchors, dist=dist,
                            train_model=dist.prepare_model(model),
                            sampler=make_sampler(cfg.rollout, model, tok, run_dir))
    try:
        return _train_and_evaluate(cfg, ctx, run_dir, ckpt, suites, config_yaml, model_path,
                                   t_total, progress)
    finally:
        if ctx.recorder is not None:
            ctx.recorder.close()
        ctx.sampler.close()
        dist.close()


def _train_and_evaluate(cfg: TrainConfig, ctx: Any, run_dir: Path, ckpt: Path | None,
                        suites: dict[str, list[Row]], config_yaml: str, model_path: str,
                        t_total: float, progress: bool) -> dict:
    model, tok, dist = ctx.model, ctx.tokenizer, ctx.dist
    main = dist.is_main  # rank 0 alone logs, evaluates, records traces and writes checkpoints
    logger = MetricsLogger(run_dir, enabled=main)
    eval_log = MetricsLogger(run_dir, name="evals.jsonl", enabled=main)
    start = 0
    if ckpt is not None:
        state = load_state(ckpt)
        load_weights_into(model, ckpt / "weights")
        if state["optimizer"] is not None:  # None: written by a sharded engine (dist.py)
            ctx.optimizer.load_state_dict(state["optimizer"])
        ctx.scheduler.load_state_dict(state["scheduler"])
        ctx.regime.load_state_dict(state["regime"])
        set_rng_state(state["rng"])
        start = state["step"]
        if main:
            logger.truncate_after(start)
            eval_log.truncate_after(start)
        before, oracle = state["before"], state["oracle"]
        if cfg.trace_store is not None and main:
            from selfdistill.train.traces import open_recorder

            ctx.recorder = open_recorder(cfg, run_dir, resume_step=start)
    elif main:
        logger.path.unlink(missing_ok=True)
        eval_log.path.unlink(missing_ok=True)
        before = run_suites(model, tok, suites, cfg, progress=progress)
        oracle = run_suites(model, tok, suites, cfg, progress=progress,
                            oracle=True) if cfg.eval.oracle else {}
        eval_log.log({"suites": _strip(before)}, 0)
        if cfg.trace_store is not None:
            from selfdistill.train.traces import open_recorder

            ctx.recorder = open_recorder(cfg, run_dir, resume_step=None)

    else:
        before = oracle = {}  # only rank 0 evaluates

    def checkpoint(step: int) -> None:
        weights = dist.full_state_dict(ctx.train_model)  # sharded engines only; every rank
        if main:  # data-parallel ranks hold identical weights and optimizer states
            path = save_checkpoint(run_dir, step, model, {
                "optimizer": dist.optimizer_state(ctx.optimizer),
                "scheduler": ctx.scheduler.state_dict(), "regime": ctx.regime.state_dict(),
                "rng": rng_state(), "before": before, "oracle": oracle,
                "world_size": dist.world}, weights)
            if ctx.recorder is not None:
                ctx.recorder.on_checkpoint(step, path)
        dist.barrier()

    t_train = time.perf_counter()
    bar = tqdm(range(start, cfg.steps), desc=f"train {cfg.method}", disable=not progress,
               initial=start, total=cfg.steps)
    for step in bar:
        metrics = train_step(cfg, ctx, step)
        logger.log(metrics, step + 1)
        # QA rows report accuracy; graded rows without an answer (code) report the mean reward.
        shown = {k: metrics[k] for k in ("loss", "rollout_accuracy", "reward") if k in metrics}
        bar.set_postfix({"acc" if k == "rollout_accuracy" else k: f"{v:.3f}"
                         for k, v in shown.items()})
        done = step + 1
        if main and cfg.eval.every_steps and done % cfg.eval.every_steps == 0 and \
                done < cfg.steps:
            task = {k: v for k, v in suites.items() if k != "probes"}
            eval_log.log({"suites": _strip(run_suites(model, tok, task, cfg, progress=False))},
                         done)
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps:
            checkpoint(done)
    bar.close()
    train_seconds = time.perf_counter() - t_train
    if start < cfg.steps or ckpt is None:
        checkpoint(cfg.steps)
    weights = dist.full_state_dict(ctx.train_model)
    if not main:
        return {"rank": dist.rank}
    save_weights(model, run_dir / "adapter", weights)

    after = run_suites(model, tok, suites, cfg, progress=progress)
    eval_log.log({"suites": _strip(after)}, cfg.steps)
    verdict = decide(_strip(before), _strip(after), task=cfg.gate.task,
                     min_improvement=cfg.gate.min_improvement,
                     probe_tolerance=cfg.gate.probe_tolerance)
    summary = {
        "model": cfg.model or "SmolLM2-135M-Instruct (embedded default)",
        "model_path": model_path, "steps": cfg.steps, "config": cfg.model_dump(mode="json"),
        "config_yaml": config_yaml, "before": _strip(before), "after": _strip(after),
        "oracle": _strip(oracle), "gate": verdict.to_dict(), "adapter": str(run_dir / "adapter"),
        "precision": resolve_precision(cfg.precision, next(ctx.model.parameters()).device),
        "train_seconds": train_seconds, "total_seconds": time.perf_counter() - t_total,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if cfg.registry is not None:  # needs summary.json; promotion stays a separate, gated act
        from selfdistill.registry import Registry

        reg = Registry(None if cfg.registry == "default" else cfg.registry)
        summary["proposed_version"] = reg.propose(run_dir, scope=cfg.scope)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "eval_after.json").write_text(json.dumps(after, indent=2, ensure_ascii=False))
    metrics = logger.read()
    write_report(run_dir, summary, metrics)
    plot_run(run_dir, metrics, eval_log.read())
    return summary
