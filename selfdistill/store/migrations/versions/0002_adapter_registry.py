"""Adapter registry: versions, scopes, activations (the promotion history) and gate runs.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the column types: a migration must not change when the models do.
ID = sa.String(length=64)
SCOPE = sa.String(length=200)
TIME = sa.DateTime(timezone=True)


def _fk(col: str, table: str, source: str, key: str = "id") -> sa.ForeignKeyConstraint:
    name = op.f(f"fk_{source}_{col}_{table}")
    return sa.ForeignKeyConstraint([col], [f"{table}.{key}"], name=name)


def upgrade() -> None:
    """Create the registry's four tables."""
    op.create_table(
        "adapter_versions",
        sa.Column("id", ID, nullable=False),
        sa.Column("scope", SCOPE, nullable=False),
        sa.Column("base_model", sa.String(length=500), nullable=False),
        sa.Column("base_path", sa.String(length=1000), nullable=True),
        sa.Column("base_sha256", sa.String(length=64), nullable=True),
        sa.Column("parent_id", ID, nullable=True),
        sa.Column("run_id", ID, nullable=True),
        sa.Column("run_name", sa.String(length=200), nullable=True),
        sa.Column("source", sa.String(length=1000), nullable=True),
        sa.Column("data_ids", sa.JSON(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("train_gate", sa.JSON(), nullable=True),
        sa.Column("weights_path", sa.String(length=1000), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("weights_deleted_at", TIME, nullable=True),
        sa.Column("created_at", TIME, nullable=False),
        _fk("parent_id", "adapter_versions", "adapter_versions"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_versions")),
    )
    op.create_index(op.f("ix_adapter_versions_scope"), "adapter_versions", ["scope"])

    op.create_table(
        "adapter_scopes",
        sa.Column("name", SCOPE, nullable=False),
        sa.Column("active_version_id", ID, nullable=True),
        sa.Column("quota_bytes", sa.BigInteger(), nullable=True),
        sa.Column("updated_at", TIME, nullable=False),
        _fk("active_version_id", "adapter_versions", "adapter_scopes"),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_adapter_scopes")),
    )

    op.create_table(
        "adapter_gate_runs",
        sa.Column("id", ID, nullable=False),
        sa.Column("version_id", ID, nullable=False),
        sa.Column("scope", SCOPE, nullable=False),
        sa.Column("baseline_version_id", ID, nullable=True),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("verdict", sa.JSON(), nullable=False),
        sa.Column("suites", sa.JSON(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        _fk("version_id", "adapter_versions", "adapter_gate_runs"),
        _fk("baseline_version_id", "adapter_versions", "adapter_gate_runs"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_gate_runs")),
    )
    op.create_index(op.f("ix_adapter_gate_runs_version_id"), "adapter_gate_runs", ["version_id"])

    op.create_table(
        "adapter_activations",
        sa.Column("id", ID, nullable=False),
        sa.Column("scope", SCOPE, nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("from_version_id", ID, nullable=True),
        sa.Column("to_version_id", ID, nullable=True),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("gate_run_id", ID, nullable=True),
        sa.Column("created_at", TIME, nullable=False),
        sa.CheckConstraint(
            "action IN ('promote', 'force', 'rollback')", name=op.f("ck_adapter_activations_action")
        ),
        _fk("scope", "adapter_scopes", "adapter_activations", key="name"),
        _fk("from_version_id", "adapter_versions", "adapter_activations"),
        _fk("to_version_id", "adapter_versions", "adapter_activations"),
        _fk("gate_run_id", "adapter_gate_runs", "adapter_activations"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_activations")),
        sa.UniqueConstraint("scope", "seq", name=op.f("uq_adapter_activations_scope_seq")),
    )
    op.create_index(
        op.f("ix_adapter_activations_to_version_id"), "adapter_activations", ["to_version_id"]
    )


def downgrade() -> None:
    """Drop the registry's tables (dependants first)."""
    for table in ("adapter_activations", "adapter_gate_runs", "adapter_scopes", "adapter_versions"):
        op.drop_table(table)
