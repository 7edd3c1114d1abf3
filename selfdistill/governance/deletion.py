"""Deleting a tenant, with proof: every row of its scope in the server's and the registry's
tables, its adapters' weight directories and its learning runs (their trace stores included) are
removed; then each is counted again, and the counts before (removed) and after (remaining, all
zero) are recorded in `serve_deletions` under the SHA-256 of the scope name (the name itself is
not kept)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, or_, select, update

from selfdistill.registry import Registry
from selfdistill.store.models import utcnow
from selfdistill.store.registry_models import (
    AdapterActivation,
    AdapterGateRun,
    AdapterScope,
    AdapterVersion,
)
from selfdistill.store.serve_models import (
    ServeCompletion,
    ServeDeletion,
    ServeLesson,
    ServeRound,
    ServeTenant,
)

_BY_SCOPE = {
    "lessons": (ServeLesson, ServeLesson.scope),
    "completions": (ServeCompletion, ServeCompletion.scope),
    "rounds": (ServeRound, ServeRound.scope),
    "tenant_rows": (ServeTenant, ServeTenant.scope),
    "activations": (AdapterActivation, AdapterActivation.scope),
    "versions": (AdapterVersion, AdapterVersion.scope),
    "scope_rows": (AdapterScope, AdapterScope.name),
}


def _count(reg: Registry, scope: str, versions: list[str]) -> dict[str, int]:
    with reg.session() as s:
        out = {
            name: s.scalar(select(func.count()).select_from(table).where(col == scope))
            for name, (table, col) in _BY_SCOPE.items()
        }
        out["gate_runs"] = s.scalar(
            select(func.count())
            .select_from(AdapterGateRun)
            .where(or_(AdapterGateRun.scope == scope, AdapterGateRun.version_id.in_(versions)))
        )
    return out


def _paths(reg: Registry, scope: str, runs_dir: Path) -> tuple[list[str], list[Path]]:
    with reg.session() as s:
        versions = list(s.scalars(select(AdapterVersion.id).where(AdapterVersion.scope == scope)))
        run_dirs = [Path(p) for p in s.scalars(
            select(ServeRound.run_dir).where(ServeRound.scope == scope)) if p]
    paths = [reg.weights.path(v) for v in versions] + run_dirs + [runs_dir]
    return versions, [p for p in dict.fromkeys(paths) if p.exists()]


def delete_tenant(reg: Registry, scope: str, runs_dir: Path, actor: str) -> dict[str, Any]:
    """Remove everything of `scope` (see the module docstring) and return the proof:
    ``{"removed": {...}, "remaining": {...}, "deleted": bool, "id": ...}``."""
    versions, paths = _paths(reg, scope, runs_dir)
    removed = _count(reg, scope, versions)
    with reg.session() as s, s.begin():
        s.execute(update(AdapterVersion).where(  # lineage from other scopes stops here
            AdapterVersion.parent_id.in_(versions), AdapterVersion.scope != scope)
            .values(parent_id=None))
        s.execute(update(AdapterScope).where(AdapterScope.name == scope)
                  .values(active_version_id=None))
        s.execute(delete(AdapterActivation).where(AdapterActivation.scope == scope))
        s.execute(delete(AdapterGateRun).where(
            or_(AdapterGateRun.scope == scope, AdapterGateRun.version_id.in_(versions))))
        s.execute(update(AdapterVersion).where(AdapterVersion.id.in_(versions))
                  .values(parent_id=None))
        for name, (table, col) in _BY_SCOPE.items():
            if name != "activations":
                s.execute(delete(table).where(col == scope))
    removed["files"] = sum(sum(1 for f in p.rglob("*") if f.is_file()) for p in paths)
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
    remaining = _count(reg, scope, versions)
    remaining["files"] = sum(1 for p in paths if p.exists())
    proof = ServeDeletion(
        scope_digest=hashlib.sha256(scope.encode()).hexdigest(), removed=removed,
        remaining=remaining, actor=actor, created_at=utcnow())
    with reg.session() as s, s.begin():
        s.add(proof)
        s.flush()
        out = proof.as_dict()
    return {**out, "scope": scope, "deleted": not any(remaining.values())}
