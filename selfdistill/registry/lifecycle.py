"""Changes to the registry: propose (under a scope's quota), promote (through the gate), rollback,
and gc. `Lifecycle` adds them to `RegistryBase`; `Registry` adds the reads.

Concurrency: every change of a scope is one short transaction that first locks that scope's row:
``SELECT ... FOR UPDATE`` on PostgreSQL (other scopes proceed), ``BEGIN IMMEDIATE`` on SQLite
(the file's one writer, held for milliseconds). A gate evaluation takes minutes, so it runs
*outside* the lock against the active version it read; the promotion then commits only if that
is still the active one (else `PromotionConflict`: run it again). Either the whole change commits
or none of it: a crash leaves the old or the new version active, never neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from selfdistill.errors import UserError
from selfdistill.registry import queries
from selfdistill.registry.base import RegistryBase
from selfdistill.registry.gate import GateOutcome, GateSpec, default_spec, evaluate_gate
from selfdistill.registry.runs import base_sha256, read_run
from selfdistill.registry.weights import adapter_bytes
from selfdistill.store.models import utcnow
from selfdistill.store.records import check_scope
from selfdistill.store.registry_models import (
    AdapterActivation,
    AdapterGateRun,
    AdapterScope,
    AdapterVersion,
)

BASE = "base"
"""Version reference meaning "no adapter" (e.g. ``rollback --to base``)."""


class PromotionConflict(UserError):
    """The scope's active version changed while the gate ran; the verdict is stale."""


class Lifecycle(RegistryBase):
    """Propose, promote, rollback, quotas and gc (see the module docstring for locking)."""

    def propose(
        self, run_dir: str | Path, scope: str | None = None, parent: str | None = None
    ) -> dict[str, Any]:
        """Register the adapter of a finished training run as a version of `scope` (default:
        the run's). Identical weights already registered for the scope return that version
        (``created`` False). Fails (UserError) beyond the scope's quota, or when the weights
        belong to another scope. `parent` defaults to the scope's active version."""
        run = read_run(run_dir)
        scope = check_scope(scope or run.scope)
        with self.session() as s:
            parent_id = None if parent is None else queries.resolve_ref(s, parent)
            self._check_quota(s, scope, adapter_bytes(run.adapter_dir), None)  # before writing
        vid, path, _ = self.weights.put(run.adapter_dir)
        base_hash = base_sha256(run.base_path)
        with self._locked(scope) as (s, row):
            existing = s.get(AdapterVersion, vid)
            if existing is not None:
                if existing.scope != scope:
                    raise UserError(
                        f"these weights are version {vid[:12]} of scope {existing.scope}; a "
                        f"version belongs to one scope, so it cannot also be one of {scope}"
                    )
                if existing.weights_deleted_at is not None:  # gc removed its files: restore
                    self._check_quota(s, scope, adapter_bytes(run.adapter_dir), row.quota_bytes)
                    self.weights.put(run.adapter_dir)  # under the lock: gc cannot interleave
                    existing.weights_deleted_at, existing.weights_path = None, str(path)
                return {**queries.version_dict(existing), "created": False}
            self._check_quota(s, scope, adapter_bytes(path), row.quota_bytes)
            v = AdapterVersion(
                id=vid,
                scope=scope,
                base_model=run.base_model,
                base_path=run.base_path,
                base_sha256=base_hash,
                parent_id=parent_id or row.active_version_id,
                run_id=run.run_id,
                run_name=run.run_name,
                source=str(run.run_dir),
                data_ids=run.data_ids,
                config=run.config,
                metrics=run.metrics,
                train_gate=run.train_gate,
                weights_path=str(path),
                size_bytes=adapter_bytes(path),
                created_at=utcnow(),
            )
            s.add(v)
        return {**queries.version_dict(v), "created": True}

    def _check_quota(self, s: Session, scope: str, new_bytes: int, quota: int | None) -> None:
        if quota is None:
            row = s.get(AdapterScope, scope)
            quota = None if row is None else row.quota_bytes
        if quota is None:
            return
        used = queries.usage(s, scope)
        if used + new_bytes > quota:
            raise UserError(
                f"scope {scope}: storage quota exceeded ({used} bytes used + {new_bytes} new > "
                f"{quota}); free space with `selfdistill adapters gc` (removes versions never "
                f"activated) or raise it: `selfdistill adapters quota --scope {scope} --bytes N`"
            )

    def set_quota(self, scope: str, quota_bytes: int | None) -> None:
        """Limit the bytes of stored weights of `scope` (None = unlimited)."""
        if quota_bytes is not None and quota_bytes < 0:
            raise UserError(f"quota {quota_bytes}: must be ≥ 0 bytes (or None for no quota)")
        with self._locked(check_scope(scope)) as (_, row):
            row.quota_bytes = quota_bytes

    # -- promotion and rollback ---------------------------------------------------------------

    def default_gate(self, version: str) -> GateSpec:
        """The gate a version's own training config implies (`gate.default_spec`)."""
        with self.session() as s:
            return default_spec(self._version(s, version).config)

    def promote(
        self,
        version: str,
        scope: str | None = None,
        *,
        force: bool = False,
        actor: str | None = None,
        reason: str | None = None,
        gate: GateSpec | dict[str, Any] | None = None,
        progress: bool = False,
    ) -> dict[str, Any]:
        """Make `version` the active version of its scope. Unless `force`, the gate first
        evaluates it against the active version (or the base model); the result is stored,
        and a failed gate changes nothing (``promoted`` False). `force` skips the gate and is
        recorded as action "force". Returns {promoted, scope, version, previous, gate, ...}."""
        with self.session() as s:
            v = self._version(s, version)
            scope = check_scope(scope or v.scope)
            if scope != v.scope:
                raise UserError(
                    f"version {v.id[:12]} belongs to scope {v.scope}, not {scope}: a scope only "
                    f"activates its own versions; propose the run with --scope {scope}"
                )
            row = s.get(AdapterScope, scope)
            baseline = None if row is None else row.active_version_id
            if baseline == v.id:
                raise UserError(f"version {v.id[:12]} is already active in {scope}")
            old = None if baseline is None else s.get_one(AdapterVersion, baseline)
        gate_run = None
        if not force:
            queries.check_same_base(v, old)
            spec = (
                gate
                if isinstance(gate, GateSpec)
                else (default_spec(v.config) if gate is None else GateSpec.model_validate(gate))
            )
            outcome = self._evaluate(spec, v, old, progress)
            gate_run = self._record_gate(v, scope, baseline, outcome)
            if not outcome.verdict.promote:
                return {
                    "promoted": False,
                    "scope": scope,
                    "version": v.id,
                    "active": baseline,
                    "gate": gate_run,
                }
        with self._locked(scope) as (s, row):
            if not force and row.active_version_id != baseline:
                raise PromotionConflict(
                    f"scope {scope}: the active version changed from {baseline} to "
                    f"{row.active_version_id} while the gate ran; run the promotion again"
                )
            act = self._activate(
                s,
                row,
                v.id,
                "force" if force else "promote",
                actor,
                reason,
                None if gate_run is None else gate_run["id"],
            )
        return {
            "promoted": True,
            "scope": scope,
            "version": v.id,
            "previous": baseline,
            "forced": force,
            "gate": gate_run,
            "activation": act,
        }

    def _evaluate(
        self, spec: GateSpec, v: AdapterVersion, old: AdapterVersion | None, progress: bool
    ) -> GateOutcome:
        from selfdistill.models import load_model

        base = load_model(queries.base_ref(v), progress=progress)
        old_dir = None if old is None else self._weights(old)
        return evaluate_gate(
            spec, base.model, base.tokenizer, self._weights(v), old_dir, progress=progress
        )

    def _record_gate(
        self, v: AdapterVersion, scope: str, baseline: str | None, outcome: GateOutcome
    ) -> dict[str, Any]:
        row = AdapterGateRun(
            version_id=v.id,
            scope=scope,
            baseline_version_id=baseline,
            passed=outcome.verdict.promote,
            verdict=outcome.verdict.to_dict(),
            suites={"before": outcome.before, "after": outcome.after, "custom": outcome.custom},
            spec=outcome.spec,
            seconds=outcome.seconds,
            created_at=utcnow(),
        )
        with self.store.session() as s, s.begin():
            s.add(row)
        return row.as_dict()

    def _activate(
        self,
        s: Session,
        row: AdapterScope,
        to: str | None,
        action: str,
        actor: str | None,
        reason: str | None,
        gate_run_id: str | None,
    ) -> dict[str, Any]:
        if to is not None:
            self._weights(s.get_one(AdapterVersion, to))  # UserError if gc removed them
        seq = (
            s.scalar(
                select(func.coalesce(func.max(AdapterActivation.seq), 0)).where(
                    AdapterActivation.scope == row.name
                )
            )
            + 1
        )
        act = AdapterActivation(
            scope=row.name,
            seq=seq,
            action=action,
            from_version_id=row.active_version_id,
            to_version_id=to,
            actor=actor or self.actor,
            reason=reason,
            gate_run_id=gate_run_id,
            created_at=utcnow(),
        )
        s.add(act)
        row.active_version_id, row.updated_at = to, utcnow()
        s.flush()  # the activation and the pointer commit together or not at all
        return act.as_dict()

    def rollback(
        self,
        scope: str = "global",
        to: str | None = None,
        *,
        actor: str | None = None,
        reason: str | None = None,
    ) -> dict[str, Any]:
        """Re-activate the version that was active before the current one was promoted, or `to`
        (a version that was active in `scope` before, or "base"), in one transaction. Nothing
        is deleted."""
        scope = check_scope(scope)
        target_ref = to if to in (None, BASE) else self.ref(to)
        with self._locked(scope) as (s, row):
            history = queries.history_rows(s, scope)
            stack = queries.promotion_stack(history)
            if to is None:
                if len(stack) < 2:
                    raise UserError(
                        f"scope {scope}: nothing to roll back (no promotion is "
                        "active); see `selfdistill adapters show` / `list`"
                    )
                target = stack[-2]
            else:
                target = None if target_ref == BASE else target_ref
                seen = {a.to_version_id for a in history} | {a.from_version_id for a in history}
                if target is not None and target not in seen:
                    raise UserError(
                        f"version {target[:12]} was never active in {scope}; "
                        "promote it instead (the gate applies)"
                    )
            if target == row.active_version_id:
                raise UserError(f"scope {scope}: {target or BASE} is already active")
            act = self._activate(s, row, target, "rollback", actor, reason, None)
        return {
            "scope": scope,
            "version": target,
            "previous": act["from_version_id"],
            "activation": act,
        }

    def gc(self, *, grace_s: float = 3600.0, dry_run: bool = False) -> dict[str, Any]:
        """Remove weights nothing can need: of versions never active in any scope (rollback can
        reach every version that ever was), older than `grace_s`, and files on disk that no
        version names. Version rows stay (lineage), marked ``weights_deleted_at``."""
        with self.session() as s:
            candidates = queries.gc_candidates(s, grace_s)
            known = set(s.scalars(select(AdapterVersion.id)))
        orphans = [
            i
            for i in self.weights.stored_ids()
            if i not in known and queries.older_than(self.weights.path(i), grace_s)
        ]
        removed, freed = [], 0
        for vid, scope in [] if dry_run else candidates:
            # Under the scope's lock, so no promotion or re-proposal of it interleaves. Files go
            # after the mark is flushed: a crash before the commit leaves a row whose files are
            # missing, which every use reports and the next gc finishes.
            with self._locked(scope) as (s, _):
                v = s.get_one(AdapterVersion, vid)
                if queries.is_referenced(s, vid) or v.weights_deleted_at is not None:
                    continue
                v.weights_deleted_at = utcnow()
                s.flush()
                freed += self.weights.remove(vid)
                removed.append(vid)
        for vid in [] if dry_run else orphans:
            freed += self.weights.remove(vid)
        stale = [] if dry_run else self.weights.remove_stale(grace_s)
        return {
            "dry_run": dry_run,
            "versions": removed if not dry_run else [c[0] for c in candidates],
            "orphans": orphans,
            "stale": stale,
            "freed_bytes": freed,
        }
