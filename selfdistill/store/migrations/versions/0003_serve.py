"""Server: tenants (consent, pause), completions, lessons, learning rounds, deletion proofs.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the column types: a migration must not change when the models do.
ID = sa.String(length=64)
SCOPE = sa.String(length=200)
TIME = sa.DateTime(timezone=True)


def _pk(table: str, col: str = "id") -> sa.PrimaryKeyConstraint:
    return sa.PrimaryKeyConstraint(col, name=op.f(f"pk_{table}"))


def upgrade() -> None:
    """Create the server's five tables."""
    op.create_table(
        "serve_tenants",
        sa.Column("scope", SCOPE, nullable=False),
        sa.Column("consent", sa.Boolean(), nullable=False),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        sa.Column("updated_at", TIME, nullable=False),
        _pk("serve_tenants", "scope"),
    )
    op.create_table(
        "serve_completions",
        sa.Column("id", sa.String(length=100), nullable=False),
        sa.Column("scope", SCOPE, nullable=False),
        sa.Column("version_id", ID, nullable=True),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("response", sa.Text(), nullable=False),
        sa.Column("redactions", sa.JSON(), nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        _pk("serve_completions"),
    )
    op.create_index(op.f("ix_serve_completions_scope"), "serve_completions", ["scope"])
    op.create_table(
        "serve_lessons",
        sa.Column("id", ID, nullable=False),
        sa.Column("scope", SCOPE, nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("completion_id", sa.String(length=100), nullable=True),
        sa.Column("version_id", ID, nullable=True),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("response", sa.Text(), nullable=False),
        sa.Column("feedback", sa.Text(), nullable=False),
        sa.Column("rating", sa.Float(), nullable=True),
        sa.Column("redactions", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("threshold", sa.Float(), nullable=True),
        sa.Column("round_id", ID, nullable=True),
        sa.Column("created_at", TIME, nullable=False),
        sa.Column("scored_at", TIME, nullable=True),
        _pk("serve_lessons"),
    )
    op.create_index(op.f("ix_serve_lessons_scope"), "serve_lessons", ["scope"])
    op.create_index(op.f("ix_serve_lessons_status"), "serve_lessons", ["status"])
    op.create_table(
        "serve_rounds",
        sa.Column("id", ID, nullable=False),
        sa.Column("scope", SCOPE, nullable=False),
        sa.Column("lesson_ids", sa.JSON(), nullable=False),
        sa.Column("run_dir", sa.String(length=1000), nullable=True),
        sa.Column("parent_version_id", ID, nullable=True),
        sa.Column("version_id", ID, nullable=True),
        sa.Column("promoted", sa.Boolean(), nullable=False),
        sa.Column("verdict", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.Column("created_at", TIME, nullable=False),
        _pk("serve_rounds"),
    )
    op.create_index(op.f("ix_serve_rounds_scope"), "serve_rounds", ["scope"])
    op.create_table(
        "serve_deletions",
        sa.Column("id", ID, nullable=False),
        sa.Column("scope_digest", sa.String(length=64), nullable=False),
        sa.Column("removed", sa.JSON(), nullable=False),
        sa.Column("remaining", sa.JSON(), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        _pk("serve_deletions"),
    )


def downgrade() -> None:
    """Drop the server's tables."""
    for table in (
        "serve_deletions",
        "serve_rounds",
        "serve_lessons",
        "serve_completions",
        "serve_tenants",
    ):
        op.drop_table(table)
