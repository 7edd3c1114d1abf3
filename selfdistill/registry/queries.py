"""Reads over the registry's tables, shared by `Registry`: each takes an open session and returns
ORM rows or JSON-ready dicts (datetimes as ISO-8601 strings)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from selfdistill.errors import UserError
from selfdistill.store.registry_models import (
    AdapterActivation,
    AdapterGateRun,
    AdapterScope,
    AdapterVersion,
)

MIN_PREFIX = 4
_HEX = set("0123456789abcdef")


def resolve_ref(s: Session, ref: str) -> str:
    """The id of the one version whose id starts with `ref` (≥ `MIN_PREFIX` hex characters)."""
    r = ref.strip().lower()
    if len(r) < MIN_PREFIX or not set(r) <= _HEX:
        raise UserError(
            f"{ref!r} is not a version id or a prefix of one ({MIN_PREFIX} or more "
            "hex characters); see `selfdistill adapters list`"
        )
    ids = s.scalars(select(AdapterVersion.id).where(AdapterVersion.id.startswith(r)).limit(5)).all()
    if not ids:
        raise UserError(
            f"no adapter version {ref!r} in this registry; see "
            "`selfdistill adapters list` (or pass --registry)"
        )
    if len(ids) > 1:
        raise UserError(
            f"version prefix {ref!r} is ambiguous ({', '.join(i[:12] for i in ids)}"
            "...); give more characters"
        )
    return ids[0]


def version_dict(v: AdapterVersion) -> dict[str, Any]:
    """A version's row as a dict, with ``short`` (the first 12 characters of its id)."""
    return {**v.as_dict(), "short": v.id[:12]}


def weights_dir(v: AdapterVersion, elsewhere: Path | None = None) -> Path:
    """The version's weights directory: where it was stored, else `elsewhere` (the same id in
    the registry's current weights directory, if that moved); UserError if neither has it."""
    for path in (Path(v.weights_path), elsewhere):
        if v.weights_deleted_at is None and path is not None and path.is_dir():
            return path
    why = "removed by gc" if v.weights_deleted_at else "missing"
    raise UserError(
        f"version {v.id[:12]}: weights {why} at {v.weights_path}; if the weights directory "
        "moved, pass --weights-dir; if gc removed them, propose the run again"
    )


def base_ref(v: AdapterVersion) -> str:
    """What to load as the version's base: the directory it was trained on if it still exists,
    else the configured name ("default" = the embedded model)."""
    return v.base_path if v.base_path and Path(v.base_path).is_dir() else v.base_model


def check_same_base(v: AdapterVersion, old: AdapterVersion | None) -> None:
    """UserError when `v` was trained on another base model than the active version `old`."""
    if old is None:
        return
    same = (
        v.base_sha256 == old.base_sha256
        if v.base_sha256 and old.base_sha256
        else v.base_model == old.base_model
    )
    if not same:
        raise UserError(
            f"version {v.id[:12]} was trained on {v.base_model} (sha256 {v.base_sha256}) but the "
            f"active {old.id[:12]} on {old.base_model} (sha256 {old.base_sha256}); the gate "
            "cannot compare them: switch base models with --force"
        )


def usage(s: Session, scope: str) -> int:
    """Bytes of stored weights of the scope's versions."""
    stmt = select(func.coalesce(func.sum(AdapterVersion.size_bytes), 0)).where(
        AdapterVersion.scope == scope, AdapterVersion.weights_deleted_at.is_(None)
    )
    return int(s.scalar(stmt) or 0)


def history_rows(s: Session, scope: str) -> Sequence[AdapterActivation]:
    """The scope's activations in order."""
    stmt = select(AdapterActivation).where(AdapterActivation.scope == scope)
    return s.scalars(stmt.order_by(AdapterActivation.seq)).all()


def promotion_stack(history: Sequence[AdapterActivation]) -> list[str | None]:
    """Replay a scope's history as a stack (None = the base model at the bottom): a promotion
    pushes; a rollback pops back to its target (or pushes a target no longer on the stack).
    The entry under the top is what a plain rollback restores."""
    stack: list[str | None] = [None]
    for a in history:
        if a.action == "rollback" and a.to_version_id in stack:
            last = len(stack) - 1 - stack[::-1].index(a.to_version_id)
            del stack[last + 1 :]
        else:
            stack.append(a.to_version_id)
    return stack


def _active_in(s: Session) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, vid in s.execute(select(AdapterScope.name, AdapterScope.active_version_id)):
        if vid:
            out.setdefault(vid, []).append(name)
    return out


def _gate_runs(s: Session, vid: str) -> list[dict[str, Any]]:
    stmt = select(AdapterGateRun).where(AdapterGateRun.version_id == vid)
    return [g.as_dict() for g in s.scalars(stmt.order_by(AdapterGateRun.created_at))]


def list_versions(s: Session, scope: str | None) -> list[dict[str, Any]]:
    """Versions oldest first, each with ``active_in`` and ``last_gate`` (or None)."""
    stmt = select(AdapterVersion).order_by(AdapterVersion.created_at, AdapterVersion.id)
    if scope is not None:
        stmt = stmt.where(AdapterVersion.scope == scope)
    active = _active_in(s)
    out = []
    for v in s.scalars(stmt):
        runs = _gate_runs(s, v.id)
        out.append(
            {
                **version_dict(v),
                "active_in": active.get(v.id, []),
                "last_gate": runs[-1] if runs else None,
            }
        )
    return out


def show(s: Session, v: AdapterVersion) -> dict[str, Any]:
    """A version with ``active_in``, ``gate_runs`` and the ``activations`` involving it."""
    stmt = select(AdapterActivation).where(
        or_(AdapterActivation.to_version_id == v.id, AdapterActivation.from_version_id == v.id)
    )
    acts = s.scalars(stmt.order_by(AdapterActivation.created_at, AdapterActivation.seq))
    return {
        **version_dict(v),
        "active_in": _active_in(s).get(v.id, []),
        "gate_runs": _gate_runs(s, v.id),
        "activations": [a.as_dict() for a in acts],
    }


def scopes(s: Session) -> list[dict[str, Any]]:
    """Every scope with ``used_bytes``."""
    rows = s.scalars(select(AdapterScope).order_by(AdapterScope.name)).all()
    return [{**r.as_dict(), "used_bytes": usage(s, r.name)} for r in rows]


def lineage(s: Session, v: AdapterVersion) -> list[dict[str, Any]]:
    """`v` then its parent, grandparent, ...: each with data ids, training gate and gate runs."""
    chain, seen = [], set()
    node: AdapterVersion | None = v
    while node is not None and node.id not in seen:  # a cycle cannot be written, but be safe
        seen.add(node.id)
        chain.append({**version_dict(node), "gate_runs": _gate_runs(s, node.id)})
        node = None if node.parent_id is None else s.get(AdapterVersion, node.parent_id)
    return chain


def _suite_accuracy(d: dict[str, Any] | None) -> dict[str, float]:
    return {k: v.get("accuracy") for k, v in (d or {}).items() if isinstance(v, dict)}


def diff(s: Session, a: AdapterVersion, b: AdapterVersion) -> dict[str, Any]:
    """Side by side: fields, training-eval accuracies (after), and the latest gate's checks."""
    fields = (
        "scope",
        "base_model",
        "base_sha256",
        "parent_id",
        "run_id",
        "size_bytes",
        "created_at",
    )
    da, db = version_dict(a), version_dict(b)
    out: dict[str, Any] = {
        "a": a.id,
        "b": b.id,
        "fields": {f: {"a": da[f], "b": db[f]} for f in fields},
    }
    ma, mb = _suite_accuracy(a.metrics.get("after")), _suite_accuracy(b.metrics.get("after"))
    out["train_after"] = {k: {"a": ma.get(k), "b": mb.get(k)} for k in sorted({*ma, *mb})}
    out["data_ids"] = {
        "a": len(a.data_ids),
        "b": len(b.data_ids),
        "shared": len(set(a.data_ids) & set(b.data_ids)),
    }
    ga, gb = (_gate_runs(s, x.id) for x in (a, b))
    checks: dict[str, dict[str, Any]] = {}
    for side, runs in (("a", ga), ("b", gb)):
        for c in runs[-1]["verdict"]["checks"] if runs else []:
            checks.setdefault(c["name"], {"a": None, "b": None})[side] = {
                k: c[k] for k in ("passed", "before", "after")
            }
    out["gate"] = {
        "a": ga[-1]["verdict"]["summary"] if ga else None,
        "b": gb[-1]["verdict"]["summary"] if gb else None,
        "checks": checks,
    }
    return out


def is_referenced(s: Session, vid: str) -> bool:
    """Whether a scope has `vid` active, or ever had (a rollback may restore it)."""
    active = s.scalar(select(func.count()).where(AdapterScope.active_version_id == vid))
    hist = s.scalar(
        select(func.count()).where(
            or_(AdapterActivation.to_version_id == vid, AdapterActivation.from_version_id == vid)
        )
    )
    return bool(active or hist)


def gc_candidates(s: Session, grace_s: float) -> list[tuple[str, str]]:
    """(id, scope) of versions with weights on disk that were never active, older than grace."""
    out = []
    now = time.time()
    for v in s.scalars(select(AdapterVersion).where(AdapterVersion.weights_deleted_at.is_(None))):
        if now - v.created_at.timestamp() >= grace_s and not is_referenced(s, v.id):
            out.append((v.id, v.scope))
    return out


def older_than(path: Path, grace_s: float) -> bool:
    """Whether `path` was last modified at least `grace_s` seconds ago."""
    return time.time() - path.stat().st_mtime >= grace_s
