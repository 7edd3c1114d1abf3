"""The trainer's side of the trace store: every step's attempts, feedback, teacher contexts, the
step itself and its checkpoints, recorded off the hot path (`TraceStore.writer()`).

    recorder = open_recorder(cfg, run_dir, resume_step=None)   # or the step resumed from
    recorder.on_step(step, samples, metrics)    # after each training step (1-based)
    recorder.on_checkpoint(step, path)          # after each checkpoint is written
    recorder.close()                            # flush; status "finished" when the last step is in

The store run is named after the run directory; its id is kept in ``RUN_DIR/run_id`` so a resume
(or a restart from scratch in the same directory) continues the same run, first forgetting what
was recorded after the step it starts from (`TraceStore.rewind`). ``traces replay`` reads it back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from selfdistill.store import TraceStore, sha256_file, summarize_token_credit
from selfdistill.store.models import Checkpoint, Run, TrainingStep
from selfdistill.train.config import TrainConfig
from selfdistill.train.methods import Sample

RUN_ID_FILE = "run_id"
"""File in the run directory holding the store run's id."""

BASE = "base"
"""`checkpoint_before` of steps trained before any checkpoint was written."""

# Code-judge verdicts that concern the whole program rather than one test (selfdistill.envs.code).
_WHOLE_PROGRAM = {"no_code", "syntax_error", "missing_entry_point"}


def open_store(trace_store: str, run_dir: Path) -> TraceStore:
    """The store a config names: 'run' = SQLite file ``run_dir/traces.db``, else a URL."""
    return TraceStore(path=run_dir) if trace_store == "run" else TraceStore(trace_store)


def weights_sha256(weights_dir: Path) -> str | None:
    """SHA-256 of a checkpoint's weights: of its one safetensors file, or (sharded weights) of
    the sorted ``name:sha256`` lines of all of them; None when there are none."""
    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if len(files) == 1:
        return sha256_file(files[0])
    if not files:
        return None
    import hashlib

    lines = "".join(f"{f.name}:{sha256_file(f)}\n" for f in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def _finite(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in metrics.items()}


def feedback_records(attempt_id: str, feedback: Any, tests: Sequence[Any] | None) -> list[dict]:
    """Store records of one attempt's feedback: one with credit scope "rollout", plus one
    "artifact"-scoped record naming the first failing test when the code judge's evidence names
    one (not for whole-program failures such as a syntax error). `tests` are the row's tests."""
    out = [{"attempt_id": attempt_id, "kind": feedback.kind, "text": feedback.text,
            "reward": feedback.reward, "passed": feedback.passed,
            "evidence": dict(feedback.evidence), "credit_scope": "rollout"}]
    ev = feedback.evidence or {}
    failing = ev.get("failing_tests") or []
    if failing and ev.get("status") not in _WHOLE_PROGRAM:
        i = int(failing[0])
        status = (ev.get("test_statuses") or [ev.get("status")] * (i + 1))[i]
        test = tests[i] if tests is not None and i < len(tests) else None
        out.append({"attempt_id": attempt_id, "kind": feedback.kind,
                    "text": f"tests[{i}]: {status}", "reward": 0.0, "passed": False,
                    "evidence": {"test_index": i, "status": status, "test": test},
                    "credit_scope": "artifact", "artifact": f"tests[{i}]"})
    return out


class TraceRecorder:
    """Records a training run into a `TraceStore` through its background writer.

    `checkpoint_before` is what the next step starts from: "base", or the path of the latest
    checkpoint recorded. `final_step` is the run's last step (status "finished" once recorded).
    """

    def __init__(self, store: TraceStore, run_id: str, *, checkpoint_before: str = BASE,
                 final_step: int | None = None) -> None:
        self.store, self.run_id = store, run_id
        self.writer = store.writer()
        self.checkpoint_before = checkpoint_before
        self.final_step = final_step
        self.last_step: int | None = None
        self._closed = False

    def on_step(self, step: int, samples: list[Sample], metrics: dict[str, Any]) -> str:
        """Queue step `step` (1-based) with its samples as attempts, their feedback and teacher
        contexts; returns the step's id. Waits only while the previous step is being written."""
        w, run_id = self.writer, self.run_id
        attempt_ids = w.add_attempts(run_id, [self._attempt(step, s) for s in samples])
        credit = {}
        for aid, s in zip(attempt_ids, samples, strict=True):
            feedback_ids: list[str] = []
            if s.feedback is not None:
                records = feedback_records(aid, s.feedback, s.row.extra.get("tests"))
                feedback_ids = w.add_feedback(records)[:1]
            if s.teacher_messages is not None:
                w.add_teacher_contexts([{
                    "attempt_id": aid, "messages": s.teacher_messages,
                    # An anchor's teacher sees the bare prompt: recorded as kind "anchor".
                    "kinds": ["anchor"] if s.anchor else [c.kind for c in s.contexts],
                    "feedback_ids": feedback_ids if any(c.kind == "feedback"
                                                        for c in s.contexts) else [],
                    "truncated_tokens": s.truncated_tokens}])
            if s.token_logratio is not None:
                credit[aid] = summarize_token_credit(s.token_logratio)
        step_id = w.record_step(run_id, step, attempt_ids, loss=metrics.get("loss"),
                                metrics=_finite(metrics), token_credit=credit,
                                checkpoint_before=self.checkpoint_before)
        w.end_step()
        self.last_step = step
        return step_id

    def _attempt(self, step: int, s: Sample) -> dict[str, Any]:
        logprobs = None
        if s.old_logprobs is not None:  # the policy's log-probs of its tokens (first update)
            logprobs = s.old_logprobs[: len(s.completion)].tolist()
        return {"prompt": s.row.messages, "prompt_source": s.row.source or None,
                "completion": s.text, "completion_ids": s.completion, "logprobs": logprobs,
                "step": step, "group_id": f"{step}:{s.group}",
                "sampler_version": f"step:{step - 1}"}  # the weights after step - 1

    def on_checkpoint(self, step: int, path: str | Path) -> None:
        """Record the checkpoint written after `step` (with the SHA-256 of its weights) as that
        step's `checkpoint_after`; later steps name it as `checkpoint_before`."""
        path = Path(path).resolve()
        sha = weights_sha256(path / "weights")
        self.writer.record_checkpoint(self.run_id, step, str(path), weights_sha256=sha)
        run_id = self.run_id

        def link(session: Session) -> None:  # the step that produced it, if recorded
            session.execute(update(TrainingStep).where(
                TrainingStep.run_id == run_id, TrainingStep.step == step
            ).values(checkpoint_after=str(path)))

        self.writer.submit(link)
        self.writer.end_step()  # its own transaction: a crash in the next step keeps it
        self.checkpoint_before = str(path)

    def close(self) -> None:
        """Flush everything, mark the run finished (or "stopped" before its last step), close."""
        if self._closed:
            return
        self._closed = True
        try:
            self.writer.close()
            done = self.final_step is not None and self.last_step == self.final_step
            self.store.set_run_status(self.run_id, "finished" if done else "stopped")
        finally:
            self.store.close()


def _find_run(store: TraceStore, run_dir: Path, *, by_name: bool) -> str | None:
    """The run id in ``run_dir/run_id`` if the store has it; else, with `by_name` (a store of
    this run directory alone), the one run named after the directory."""
    id_file = run_dir / RUN_ID_FILE
    if id_file.is_file():
        run_id = id_file.read_text().strip()
        with store.session() as session:
            if session.get(Run, run_id) is not None:
                return run_id
    named = [r for r in store.runs() if r["name"] == run_dir.resolve().name] if by_name else []
    return named[0]["id"] if len(named) == 1 else None


def _checkpoint_at(store: TraceStore, run_id: str, step: int) -> dict[str, Any] | None:
    with store.session() as session:
        stmt = select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.step == step)
        row = session.scalars(stmt.order_by(Checkpoint.created_at.desc())).first()
        return None if row is None else row.as_dict()


def open_recorder(cfg: TrainConfig, run_dir: Path, resume_step: int | None = None
                  ) -> TraceRecorder:
    """Open `cfg.trace_store` and the run of `run_dir` in it (created, or found again by
    ``run_dir/run_id``), forget what was recorded after `resume_step` (None = a fresh start:
    everything), and return a recorder for the steps to come."""
    assert cfg.trace_store is not None, "trace_store is off"
    run_dir = Path(run_dir)
    store = open_store(cfg.trace_store, run_dir)
    try:
        config = cfg.model_dump(mode="json")
        run_id = _find_run(store, run_dir, by_name=cfg.trace_store == "run")
        if run_id is None:
            run_id = store.create_run(run_dir.resolve().name, scope=cfg.scope, config=config)
        else:
            store.rewind(run_id, resume_step or 0)
            with store.session() as session, session.begin():  # the config that goes on
                session.execute(update(Run).where(Run.id == run_id).values(
                    config=config, scope=cfg.scope, status="running"))
        (run_dir / RUN_ID_FILE).write_text(run_id + "\n")
        before = BASE
        if resume_step:
            ckpt = _checkpoint_at(store, run_id, resume_step)
            path = run_dir / "checkpoints" / f"step_{resume_step:06d}"
            if ckpt is None and path.is_dir():  # written, but its record was lost in a crash
                store.record_checkpoint(run_id, resume_step, str(path.resolve()),
                                        weights_sha256=weights_sha256(path / "weights"))
                before = str(path.resolve())
            elif ckpt is not None:
                before = ckpt["path"]
        return TraceRecorder(store, run_id, checkpoint_before=before, final_step=cfg.steps)
    except BaseException:
        store.close()
        raise
