"""``selfdistill traces replay``: recompute a recorded step's loss from the trace store alone.

The step's batch comes back from the store (`TraceStore.step_batch`: prompts, completion token
ids, teacher messages, rewards, groups), is tokenized again with the run's tokenizer and chat
template, and scored by the weights the step started from: the checkpoint written right after the
previous step (with its teacher state, e.g. the EMA weights, from ``state.pt``), or for step 1
the base model with a fresh adapter, seeded as the trainer seeds it. The loss of the step's first
update is recomputed with the trainer's own functions (`loop.score_batch`, `loop.update_loss`)
and compared with the logged one. A match shows the store holds everything that shaped the update.

Limits: a step can be replayed only right after a checkpoint (``checkpoint_every=1`` makes every
step replayable); LoRA dropout > 0 draws fresh masks, so such a run does not replay exactly.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import select

from selfdistill.chat import prompt_ids
from selfdistill.data import Row
from selfdistill.errors import UserError
from selfdistill.store import TraceStore
from selfdistill.store.models import Checkpoint
from selfdistill.train.checkpoint import load_state, load_weights_into
from selfdistill.train.config import TrainConfig
from selfdistill.train.loop import (
    PhaseTimer,
    build_model,
    cpt_prompt,
    make_teacher_regime,
    precision,
    score_batch,
    share_prefix,
    update_loss,
    uses_prompt_cache,
    warm_prompt_cache,
)
from selfdistill.train.methods import Sample
from selfdistill.train.traces import weights_sha256

REL_TOL = 1e-4
"""Relative tolerance of a match (absolute 1e-9 near zero); on one machine replay is exact."""


def checkpoint_steps(store: TraceStore, run_id: str) -> dict[int, dict[str, Any]]:
    """The run's recorded checkpoints by step (the newest record of a step wins)."""
    with store.session() as session:
        stmt = select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.created_at)
        return {c.step: c.as_dict() for c in session.scalars(stmt)}


def replayable_steps(store: TraceStore, run_id: str) -> list[int]:
    """Recorded steps that can be replayed: step 1 and each step right after a checkpoint."""
    ckpts = checkpoint_steps(store, run_id)
    return [s["step"] for s in store.steps(run_id) if s["step"] == 1 or s["step"] - 1 in ckpts]


def _checkpoint_before(store: TraceStore, run_id: str, step: int,
                       run_dir: Path | None) -> Path | None:
    """The directory of the checkpoint written after step - 1 (None for step 1), its weights
    checked against the recorded SHA-256."""
    if step == 1:
        return None
    ckpts = checkpoint_steps(store, run_id)
    if step - 1 not in ckpts:
        steps = replayable_steps(store, run_id)
        raise UserError(
            f"step {step} cannot be replayed: no checkpoint was written right after step "
            f"{step - 1} (checkpoints after steps {sorted(ckpts) or 'none'}). Replayable steps: "
            f"{steps or 'none'} (step 1 and each step right after a checkpoint); train with "
            "checkpoint_every=1 to make every step replayable")
    rec = ckpts[step - 1]
    path = Path(rec["path"])
    if not path.is_dir() and run_dir is not None:  # the run directory was moved
        path = run_dir / "checkpoints" / path.name
    if not (path / "state.pt").is_file():
        raise UserError(f"step {step}: the checkpoint before it, {rec['path']}, is missing")
    sha = rec.get("weights_sha256")
    if sha is not None and weights_sha256(path / "weights") != sha:
        raise UserError(f"{path}: its weights changed since they were recorded (SHA-256 "
                        "differs); the step cannot be replayed from them")
    return path


def _samples(cfg: TrainConfig, tok: Any, attempts: list[dict[str, Any]]) -> list[Sample]:
    """The step's samples in batch order, tokenized as the trainer tokenized them."""
    groups: dict[Any, int] = {}
    out = []
    for a in attempts:
        row = Row(a["prompt"], source=a.get("prompt_source") or "")
        prompt = cpt_prompt(tok) if cfg.method == "cpt" else prompt_ids(tok, a["prompt"])
        group = groups.setdefault(a.get("group_id") or a["id"], len(groups))
        rollout = [f for f in a["feedback"] if f["credit_scope"] == "rollout"]
        reward = rollout[0]["reward"] if rollout else None
        s = Sample(-1, row, group, prompt, list(a["completion_ids"]), a["completion"], reward)
        if a["teacher_contexts"]:
            s.anchor = "anchor" in a["teacher_contexts"][0]["kinds"]
            s.teacher_messages = a["teacher_contexts"][0]["messages"]
            s.teacher_prompt = prompt_ids(tok, s.teacher_messages)
        out.append(s)
    return out


def replay_step(store: TraceStore, run_id: str, step: int, *,
                run_dir: str | Path | None = None) -> dict[str, Any]:
    """Recompute the first-update loss of training step `step` (1-based) of run `run_id`.

    Returns ``{"run_id", "step", "checkpoint", "logged_loss", "replayed_loss", "abs_diff",
    "match"}``. `run_dir` is where to look for checkpoints if the run directory was moved.
    UserError when the step is unknown, made no update, or has no checkpoint right before it.
    """
    batch = store.step_batch(run_id, step)
    logged = batch["step"]["loss"]
    if logged is None:
        raise UserError(f"step {step} made no optimizer update (no training signal in its "
                        "batch): there is no loss to replay")
    cfg = TrainConfig.model_validate(batch["run"]["config"])
    ckpt = _checkpoint_before(store, run_id, step, None if run_dir is None else Path(run_dir))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, tok, _ = build_model(cfg, progress=False)
    regime = make_teacher_regime(cfg, tok)
    if ckpt is not None:
        load_weights_into(model, ckpt / "weights")
        regime.load_state_dict(load_state(ckpt)["regime"])
    samples = _samples(cfg, tok, batch["attempts"])
    cache, note = _prompt_cache(cfg, regime, model, tok)
    with precision(cfg, model):
        ctx_rows, teacher_logits, sb = score_batch(regime, model, samples, tok.pad_token_id,
                                                   PhaseTimer(),
                                                   share_prefix=share_prefix(cfg, model, model),
                                                   prompt_cache=cache)
        with torch.no_grad():
            loss, _ = update_loss(cfg, model, samples, sb, teacher_logits, ctx_rows, update=0)
    replayed = loss.item()
    return {"run_id": run_id, "step": step, "checkpoint": "base" if ckpt is None else str(ckpt),
            "logged_loss": logged, "replayed_loss": replayed, "abs_diff": abs(replayed - logged),
            "match": math.isclose(replayed, logged, rel_tol=REL_TOL, abs_tol=1e-9),
            **({"note": note} if note else {})}


def _prompt_cache(cfg: TrainConfig, regime: Any, model: Any, tok: Any) -> tuple[Any, str]:
    """The frozen teacher's prompt cache as the run built it (from the run's training rows and
    anchors: the cached path rounds differently from a plain forward, visibly so in bfloat16),
    and a note when those files cannot be read any more (replay then runs without the cache)."""
    if not uses_prompt_cache(cfg, regime):
        return None, ""
    from selfdistill.train.run import load_datasets  # run imports the trainer; so do we

    try:
        rows, _, anchors = load_datasets(cfg)
    except UserError as exc:
        return None, (f"the run's data could not be read ({exc}); replayed without the "
                      "teacher's prompt cache, so rounding may differ from the run")
    return warm_prompt_cache(cfg, regime, model, tok, rows, anchors), ""
