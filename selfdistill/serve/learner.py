"""The background learner: scores pending feedback candidates, and when a tenant has enough
accepted lessons (or its newest one has waited long enough) runs a learning round:

1. self-distillation (SDFT, `selfdistill.train`: `build_model`, `make_step_context`,
   `train_step`) on the tenant's lessons — prompt = the conversation before the answer, the
   teacher's privileged context = the feedback (kind `user_followup`), teacher = the base model —
   starting from the tenant's active adapter (if its shape fits), in a run directory with its
   own trace store;
2. the adapter is proposed to the registry under the tenant's scope and promoted through the
   gate: the forgetting probes may lose at most `probe_tolerance`, and the candidate must fit the
   lessons better than the active version (`LessonFit`);
3. on promotion the new version is loaded into the engine (new requests use it; running requests
   keep the adapter they pinned), and the round and its lessons are recorded in one transaction.

A crash before step 4 leaves the lessons `accepted`: the next start trains on them again; a
round that fails with an error is recorded with it (its lessons are kept, marked `trained`). The
learner never learns into `global`, into a paused tenant, or into one without consent. It runs in
a thread; all model work of requests and learner is interleaved by the engine's lock (scoring) or
runs on the learner's own model copy (training, gate).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from selfdistill.data import Row
from selfdistill.errors import UserError
from selfdistill.registry import GateSpec, PromotionConflict
from selfdistill.serve import feedback, state
from selfdistill.serve.lessons import FEEDBACK_KIND, LessonFit
from selfdistill.serve.service import Service
from selfdistill.store.models import new_id

log = logging.getLogger("selfdistill.serve.learner")
ACTOR = "selfdistill-learner"


def scope_dir(scope: str) -> str:
    """A directory name for a scope (``user:alice`` → ``user-alice``)."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in scope.replace(":", "-"))


class Learner:
    """`start()` runs `tick()` every `poll_seconds` in a daemon thread; `tick()` can also be
    called directly (tests, `POST /admin/learner/tick`). `busy` is held during a tick."""

    def __init__(self, service: Service) -> None:
        self.service, self.cfg = service, service.cfg.learner
        self.runs_dir = service.cfg.home_dir() / "runs"
        self.busy = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.status: dict[str, Any] = {"rounds": 0, "last_error": None, "learning": None}

    def start(self) -> None:
        """Run in the background until `stop()`."""
        self._thread = threading.Thread(target=self._loop, name="selfdistill-learner",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to stop after the current tick."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # keep serving; the error is visible in /admin/learner
                log.exception("learner tick failed")
                self.status["last_error"] = f"{type(exc).__name__}: {exc}"
            self._stop.wait(self.cfg.poll_seconds)

    def tick(self) -> list[dict[str, Any]]:
        """Score pending candidates, then run a round for every tenant that is due."""
        with self.busy:
            for lesson in state.lessons(self.service.sessions, status="pending"):
                feedback.score_pending(self.service, lesson)
            return [self.learn(scope) for scope in self.due()]

    def due(self) -> list[str]:
        """Tenants with enough accepted lessons, or an old enough newest one."""
        by_scope: dict[str, list[dict[str, Any]]] = {}
        for lesson in state.lessons(self.service.sessions, status="accepted"):
            by_scope.setdefault(lesson["scope"], []).append(lesson)
        out = []
        now = datetime.now(UTC)
        for scope, items in by_scope.items():
            flags = self.service.flags(scope)
            if scope == "global" or flags["paused"] or not flags["consent"]:
                continue
            newest = datetime.fromisoformat(items[-1]["created_at"])
            idle = self.cfg.idle_seconds and (now - newest).total_seconds() >= self.cfg.idle_seconds
            if len(items) >= self.cfg.every_lessons or idle:
                out.append(scope)
        return out

    def learn(self, scope: str) -> dict[str, Any]:
        """One learning round for `scope` on its accepted lessons; returns the round record."""
        t0 = time.perf_counter()
        svc = self.service
        lessons = state.lessons(svc.sessions, scope=scope, status="accepted")
        round_id = new_id()
        run_dir = self.runs_dir / scope_dir(scope) / round_id
        parent = svc.registry.resolve(
            **({"user": scope[5:]} if scope.startswith("user:") else {"workspace": scope}))
        parent_id = parent.version if parent.scope == scope else None
        self.status["learning"] = scope
        row: dict[str, Any] = {"scope": scope, "run_dir": str(run_dir),
                               "parent_version_id": parent_id}
        try:
            self._train(scope, lessons, run_dir, parent_id)
            row.update(self._propose(scope, lessons, run_dir))
        except (UserError, PromotionConflict) as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # recorded, not retried forever; the lessons stay in the store
            log.exception("learning round for %s failed", scope)
            row["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            self.status["learning"] = None
        row["seconds"] = time.perf_counter() - t0
        rnd = state.finish_round(svc.sessions, [x["id"] for x in lessons], id=round_id, **row)
        self.status["rounds"] += 1
        verdict = (rnd.get("verdict") or {}).get("summary") or rnd.get("error")
        log.info("round %s: %s, %d lessons → %s, promoted=%s (%s), %.1f s", round_id[:12], scope,
                 len(lessons), (rnd["version_id"] or "-")[:12], rnd["promoted"], verdict,
                 rnd["seconds"])
        return rnd

    def _train(self, scope: str, lessons: list[dict], run_dir: Path,
               parent_id: str | None) -> None:
        import torch

        from selfdistill.train.checkpoint import load_weights_into
        from selfdistill.train.config import TrainConfig
        from selfdistill.train.loop import build_model, make_step_context, train_step
        from selfdistill.train.run import BUILTIN_ANCHORS
        from selfdistill.train.traces import open_recorder

        c, svc = self.cfg, self.service
        run_dir.mkdir(parents=True, exist_ok=True)
        data = run_dir / "lessons.jsonl"
        data.write_text("".join(json.dumps({
            "prompt": x["messages"], "privileged_context": x["feedback"],
            "context_kind": FEEDBACK_KIND, "lesson_id": x["id"]}) + "\n" for x in lessons))
        cfg = TrainConfig(
            model=svc.engine.path, method="sdft", train_data=str(data), output_dir=str(run_dir),
            steps=c.steps, batch_size=min(c.batch_size, len(lessons)),
            learning_rate=c.learning_rate, max_new_tokens=c.max_new_tokens,
            temperature=c.temperature, probe_data=None, checkpoint_every=0, scope=scope,
            anchor_data="builtin" if c.anchor_batch_size else None,
            anchor_batch_size=c.anchor_batch_size, threads=c.threads, device="cpu",
            lora={"rank": c.lora_rank, "alpha": 2.0 * c.lora_rank}, precision=c.precision,
            loss={"anchor_weight": c.anchor_weight},
            eval={"oracle": False})
        model, tok, path = build_model(cfg, progress=False)
        if parent_id is not None:
            try:
                load_weights_into(model, svc.registry.weights_path(parent_id))
            except (UserError, RuntimeError) as exc:  # another shape: start from the base
                log.warning("%s: not continuing from %s (%s)", scope, parent_id[:12], exc)
        rows = [Row(x["messages"], [], x["feedback"], FEEDBACK_KIND, {}, f"lesson {x['id']}")
                for x in lessons]
        anchors = []
        if c.anchor_batch_size:
            from selfdistill.data import load_rows

            anchors = load_rows(BUILTIN_ANCHORS, require=("prompt",), purpose="anchor")
        if c.threads:
            torch.set_num_threads(c.threads)
        ctx = make_step_context(cfg, model, tok, rows, anchors)
        ctx.recorder = open_recorder(cfg, run_dir)
        try:
            for step in range(cfg.steps):
                metrics = train_step(cfg, ctx, step)
                with (run_dir / "metrics.jsonl").open("a") as fh:
                    fh.write(json.dumps({"step": step + 1, **metrics}) + "\n")
        finally:
            ctx.recorder.close()
        model.save_pretrained(run_dir / "adapter", safe_serialization=True)
        (run_dir / "summary.json").write_text(json.dumps({
            "model": cfg.model, "model_path": path, "steps": cfg.steps,
            "config": cfg.model_dump(mode="json"), "adapter": str(run_dir / "adapter")}))

    def _propose(self, scope: str, lessons: list[dict], run_dir: Path) -> dict[str, Any]:
        c, reg = self.cfg, self.service.registry
        version = reg.propose(run_dir, scope=scope)
        checks = [LessonFit(lessons)] if c.require_lesson_fit else []
        spec = GateSpec(tasks={}, probes=list(c.probes), probe_tolerance=c.probe_tolerance,
                        checks=checks, max_new_tokens=c.gate_max_new_tokens)
        res = reg.promote(version["id"], actor=ACTOR, gate=spec,
                          reason=f"learner: {len(lessons)} lessons")
        if res["promoted"]:
            self.service.ensure_version(version["id"])  # hot swap: the next request uses it
        gate = res.get("gate") or {}
        return {"version_id": version["id"], "promoted": res["promoted"],
                "verdict": gate.get("verdict")}
