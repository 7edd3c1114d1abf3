"""Write plans: validate the caller's records, give them ids and timestamps, and return a function
that inserts them into a session.

Planning happens on the caller's thread (so a bad record fails where it was made, and ids are known
at once); applying happens wherever the transaction is, the caller's thread for `TraceStore` or
the background thread for `TraceWriter`. Both share these plans, so they write identical rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.orm import Session

from selfdistill.errors import UserError
from selfdistill.store.models import (
    CREDIT_SCOPES,
    Attempt,
    Base,
    Checkpoint,
    Feedback,
    Run,
    StepAttempt,
    TeacherContext,
    TrainingStep,
    new_id,
    utcnow,
)

Apply = Callable[[Session], object]


@dataclass(frozen=True)
class WritePlan:
    """Ids of the rows to be written, and the function that writes them into a session."""

    ids: list[str]
    apply: Apply


def _inserts(*batches: tuple[type[Base], list[dict[str, Any]]]) -> Apply:
    def apply(session: Session) -> None:
        for model, rows in batches:
            if rows:  # one executemany per table: a batched insert
                session.execute(insert(model), rows)

    return apply


def _check_keys(what: str, record: Mapping[str, Any], required: set[str], optional: set[str]):
    missing = required - record.keys()
    unknown = record.keys() - required - optional
    if missing or unknown:
        raise ValueError(
            f"{what} record: missing {sorted(missing)}, unknown {sorted(unknown)}; "
            f"expected {sorted(required)} and optionally {sorted(optional)}"
        )


def check_scope(scope: str) -> str:
    """Validate a scope: "global", or "<kind>:<name>" such as "user:alice" or "workspace:x"."""
    kind, sep, name = scope.partition(":")
    if scope != "global" and not (sep and kind and name and not any(c.isspace() for c in scope)):
        raise UserError(
            f"scope {scope!r}: use 'global' or '<kind>:<name>', e.g. 'user:alice' or 'workspace:x'"
        )
    return scope


def plan_run(
    name: str,
    *,
    scope: str = "global",
    config: Mapping[str, Any] | None = None,
    status: str = "running",
    run_id: str | None = None,
) -> WritePlan:
    """A new run."""
    row = {
        "id": run_id or new_id(),
        "name": name,
        "scope": check_scope(scope),
        "status": status,
        "config": dict(config or {}),
        "created_at": utcnow(),
    }
    return WritePlan([row["id"]], _inserts((Run, [row])))


def plan_run_status(run_id: str, status: str) -> WritePlan:
    """Change a run's status (e.g. "running" → "finished" | "failed")."""

    def apply(session: Session) -> None:
        session.execute(update(Run).where(Run.id == run_id).values(status=status))

    return WritePlan([run_id], apply)


_ATTEMPT_REQUIRED = {"prompt", "completion", "completion_ids"}
_ATTEMPT_OPTIONAL = {"id", "step", "prompt_source", "logprobs", "sampler_version", "group_id"}


def plan_attempts(run_id: str, attempts: Iterable[Mapping[str, Any]]) -> WritePlan:
    """Attempts of one run. Each record: prompt (messages), completion (text), completion_ids;
    optionally id, step, prompt_source, logprobs, sampler_version, group_id."""
    rows = []
    for a in attempts:
        _check_keys("attempt", a, _ATTEMPT_REQUIRED, _ATTEMPT_OPTIONAL)
        logprobs = a.get("logprobs")
        rows.append(
            {
                "id": a.get("id") or new_id(),
                "run_id": run_id,
                "step": None if a.get("step") is None else int(a["step"]),
                "prompt": a["prompt"],
                "prompt_source": a.get("prompt_source"),
                "completion": a["completion"],
                # int()/float() here so a tensor's elements fail now, not in the writer thread
                "completion_ids": [int(t) for t in a["completion_ids"]],
                "logprobs": None if logprobs is None else [float(x) for x in logprobs],
                "sampler_version": a.get("sampler_version"),
                "group_id": a.get("group_id"),
                "created_at": utcnow(),
            }
        )
    return WritePlan([r["id"] for r in rows], _inserts((Attempt, rows)))


_FEEDBACK_OPTIONAL = {"id", "text", "reward", "passed", "evidence", "credit_scope", "artifact"}


def plan_feedback(records: Iterable[Mapping[str, Any]]) -> WritePlan:
    """Feedback rows. Each record: attempt_id, kind; optionally id, text, reward, passed,
    evidence (dict), credit_scope (one of CREDIT_SCOPES, default "rollout"), artifact."""
    rows = []
    for f in records:
        _check_keys("feedback", f, {"attempt_id", "kind"}, _FEEDBACK_OPTIONAL)
        scope = f.get("credit_scope") or "rollout"
        if scope not in CREDIT_SCOPES:
            raise ValueError(f"feedback credit_scope {scope!r}: use one of {CREDIT_SCOPES}")
        reward, passed = f.get("reward"), f.get("passed")
        rows.append(
            {
                "id": f.get("id") or new_id(),
                "attempt_id": f["attempt_id"],
                "kind": f["kind"],
                "text": f.get("text") or "",
                "reward": None if reward is None else float(reward),
                "passed": None if passed is None else bool(passed),
                "evidence": dict(f.get("evidence") or {}),
                "credit_scope": scope,
                "artifact": f.get("artifact"),
                "created_at": utcnow(),
            }
        )
    return WritePlan([r["id"] for r in rows], _inserts((Feedback, rows)))


_CONTEXT_OPTIONAL = {"id", "kinds", "feedback_ids", "truncated_tokens"}


def plan_teacher_contexts(records: Iterable[Mapping[str, Any]]) -> WritePlan:
    """Teacher contexts. Each record: attempt_id, messages (the teacher prompt as built);
    optionally id, kinds (feedback kinds used), feedback_ids, truncated_tokens (default 0)."""
    rows = []
    for c in records:
        _check_keys("teacher context", c, {"attempt_id", "messages"}, _CONTEXT_OPTIONAL)
        rows.append(
            {
                "id": c.get("id") or new_id(),
                "attempt_id": c["attempt_id"],
                "kinds": list(c.get("kinds") or []),
                "feedback_ids": list(c.get("feedback_ids") or []),
                "messages": c["messages"],
                "truncated_tokens": int(c.get("truncated_tokens") or 0),
                "created_at": utcnow(),
            }
        )
    return WritePlan([r["id"] for r in rows], _inserts((TeacherContext, rows)))


def plan_step(
    run_id: str,
    step: int,
    attempt_ids: Sequence[str],
    *,
    loss: float | None = None,
    metrics: Mapping[str, Any] | None = None,
    token_credit: Mapping[str, Mapping[str, Any]] | None = None,
    checkpoint_before: str | None = None,
    checkpoint_after: str | None = None,
) -> WritePlan:
    """A training step and the attempts it consumed, in batch order; `token_credit` maps an
    attempt id to its per-token advantage summary (see `summarize_token_credit`)."""
    token_credit = token_credit or {}
    if len(set(attempt_ids)) != len(attempt_ids):
        raise ValueError(f"step {step}: an attempt id appears twice in attempt_ids")
    stray = set(token_credit) - set(attempt_ids)
    if stray:
        raise ValueError(
            f"step {step}: token_credit for attempts not in the batch: {sorted(stray)}"
        )
    step_id = new_id()
    row = {
        "id": step_id,
        "run_id": run_id,
        "step": int(step),
        "loss": None if loss is None else float(loss),
        "metrics": dict(metrics or {}),
        "checkpoint_before": checkpoint_before,
        "checkpoint_after": checkpoint_after,
        "created_at": utcnow(),
    }
    links = [
        {
            "step_id": step_id,
            "attempt_id": aid,
            "position": i,
            "token_credit": None if aid not in token_credit else dict(token_credit[aid]),
        }
        for i, aid in enumerate(attempt_ids)
    ]
    return WritePlan([step_id], _inserts((TrainingStep, [row]), (StepAttempt, links)))


def plan_checkpoint(
    run_id: str, step: int, path: str | Path, *, weights_sha256: str | None = None
) -> WritePlan:
    """A checkpoint written after `step`."""
    row = {
        "id": new_id(),
        "run_id": run_id,
        "step": int(step),
        "path": str(path),
        "weights_sha256": weights_sha256,
        "created_at": utcnow(),
    }
    return WritePlan([row["id"]], _inserts((Checkpoint, [row])))


def summarize_token_credit(values: Sequence[float], *, top: int = 5) -> dict[str, Any]:
    """The stored summary of one attempt's per-token advantages (``log pi_T - log pi_S``).

    Returns n, mean, min, max and the `top` positions with the largest |value|, as
    ``[[position, value], ...]``: where the teacher disagreed most. Empty input gives n = 0.
    """
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0, "mean": None, "min": None, "max": None, "top": []}
    order = sorted(range(len(vals)), key=lambda i: -abs(vals[i]))[:top]
    return {
        "n": len(vals),
        "mean": sum(vals) / len(vals),
        "min": min(vals),
        "max": max(vals),
        "top": [[i, vals[i]] for i in order],
    }


def sha256_file(path: str | Path, *, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file (for `Checkpoint.weights_sha256`)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
