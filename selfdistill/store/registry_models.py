"""The adapter registry's tables (migration 0002), beside the trace store's in one schema.

adapter_version ─< adapter_gate_run        (each time a gate evaluated it against a baseline)
adapter_scope ─< adapter_activation        (every change of a scope's active version, numbered)
adapter_scope ──> adapter_version          (the active one; NULL = the base model)

A version row never changes after it is written, except `weights_deleted_at` when `adapters gc`
removes its files. Its id is the content hash of its weights (`selfdistill.registry.weights`).
`run_id` and `data_ids` name rows of the trace store that trained it, which may be a different
database (the run's own ``traces.db``), so they are plain strings, not foreign keys.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from selfdistill.store.models import ID_LENGTH, Base, UTCDateTime, new_id, utcnow

ACTIONS = ("promote", "force", "rollback")
"""How a scope's active version changed: a passed gate, a forced promotion, a rollback."""

SCOPE_LENGTH = 200


def _version_fk(*, index: bool = False) -> Mapped[str | None]:
    return mapped_column(String(ID_LENGTH), ForeignKey("adapter_versions.id"), index=index)


class AdapterVersion(Base):
    """An immutable adapter: weights (by content hash), what it was trained on and from."""

    __tablename__ = "adapter_versions"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)  # SHA-256 hex
    scope: Mapped[str] = mapped_column(String(SCOPE_LENGTH), index=True)
    base_model: Mapped[str] = mapped_column(String(500))  # as the run named it
    base_path: Mapped[str | None] = mapped_column(String(1000))  # what was loaded
    base_sha256: Mapped[str | None] = mapped_column(String(64))
    parent_id: Mapped[str | None] = _version_fk()
    run_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    run_name: Mapped[str | None] = mapped_column(String(200))
    source: Mapped[str | None] = mapped_column(String(1000))  # the run directory proposed
    data_ids: Mapped[list[str]] = mapped_column(JSON)  # trace-store attempt ids, training order
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    train_gate: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    weights_path: Mapped[str] = mapped_column(String(1000))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    weights_deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class AdapterScope(Base):
    """A tenant: ``global``, ``workspace:<id>`` or ``user:<id>``. `active_version_id` NULL means
    the scope adds nothing (resolution falls through); `quota_bytes` NULL means no quota."""

    __tablename__ = "adapter_scopes"

    name: Mapped[str] = mapped_column(String(SCOPE_LENGTH), primary_key=True)
    active_version_id: Mapped[str | None] = _version_fk()
    quota_bytes: Mapped[int | None] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class AdapterActivation(Base):
    """One change of a scope's active version. `seq` numbers a scope's changes 1, 2, ... with no
    gaps (unique per scope, so two writers can never both append the same change)."""

    __tablename__ = "adapter_activations"
    __table_args__ = (
        UniqueConstraint("scope", "seq"),
        CheckConstraint("action IN ('promote', 'force', 'rollback')", name="action"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)
    scope: Mapped[str] = mapped_column(
        String(SCOPE_LENGTH), ForeignKey("adapter_scopes.name")
    )  # indexed by the unique (scope, seq) constraint
    seq: Mapped[int] = mapped_column(Integer)
    action: Mapped[str] = mapped_column(String(16))
    from_version_id: Mapped[str | None] = _version_fk()
    to_version_id: Mapped[str | None] = _version_fk(index=True)
    actor: Mapped[str] = mapped_column(String(200))
    reason: Mapped[str | None] = mapped_column(Text)
    gate_run_id: Mapped[str | None] = mapped_column(
        String(ID_LENGTH), ForeignKey("adapter_gate_runs.id")
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class AdapterGateRun(Base):
    """A gate evaluation of `version_id` against `baseline_version_id` (NULL = the base model):
    the verdict (`GateVerdict.to_dict()`), every suite's scores and the spec it ran."""

    __tablename__ = "adapter_gate_runs"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)
    version_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("adapter_versions.id"), index=True
    )
    scope: Mapped[str] = mapped_column(String(SCOPE_LENGTH))
    baseline_version_id: Mapped[str | None] = _version_fk()
    passed: Mapped[bool] = mapped_column(Boolean)
    verdict: Mapped[dict[str, Any]] = mapped_column(JSON)
    suites: Mapped[dict[str, Any]] = mapped_column(JSON)  # {"before": {...}, "after": {...}}
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    seconds: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
