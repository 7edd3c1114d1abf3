"""Initial trace store schema: runs, attempts, feedback, teacher contexts, training steps (with the
attempts each consumed) and checkpoints.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the column types: a migration must not change when models.py does.
ID = sa.String(length=64)
TIME = sa.DateTime(timezone=True)


def _id() -> sa.Column:
    return sa.Column("id", ID, nullable=False)


def _created_at() -> sa.Column:
    return sa.Column("created_at", TIME, nullable=False)


def _fk(col: str, table: str, source: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        [col], [f"{table}.id"], name=op.f(f"fk_{source}_{col}_{table}"), ondelete="CASCADE"
    )


def upgrade() -> None:
    """Create every table from an empty database."""
    op.create_table(
        "runs",
        _id(),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("scope", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        _created_at(),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    op.create_index(op.f("ix_runs_scope"), "runs", ["scope"])

    op.create_table(
        "attempts",
        _id(),
        sa.Column("run_id", ID, nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("prompt", sa.JSON(), nullable=False),
        sa.Column("prompt_source", sa.String(length=500), nullable=True),
        sa.Column("completion", sa.Text(), nullable=False),
        sa.Column("completion_ids", sa.JSON(), nullable=False),
        sa.Column("logprobs", sa.JSON(), nullable=True),
        sa.Column("sampler_version", sa.String(length=200), nullable=True),
        sa.Column("group_id", ID, nullable=True),
        _created_at(),
        _fk("run_id", "runs", "attempts"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
    )
    op.create_index(op.f("ix_attempts_group_id"), "attempts", ["group_id"])
    op.create_index("ix_attempts_run_id_step", "attempts", ["run_id", "step"])

    op.create_table(
        "checkpoints",
        _id(),
        sa.Column("run_id", ID, nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(length=1000), nullable=False),
        sa.Column("weights_sha256", sa.String(length=64), nullable=True),
        _created_at(),
        _fk("run_id", "runs", "checkpoints"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("run_id", "step", name=op.f("uq_checkpoints_run_id_step")),
    )

    op.create_table(
        "training_steps",
        _id(),
        sa.Column("run_id", ID, nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("checkpoint_before", sa.String(length=1000), nullable=True),
        sa.Column("checkpoint_after", sa.String(length=1000), nullable=True),
        _created_at(),
        _fk("run_id", "runs", "training_steps"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_steps")),
        sa.UniqueConstraint("run_id", "step", name=op.f("uq_training_steps_run_id_step")),
    )

    op.create_table(
        "feedback",
        _id(),
        sa.Column("attempt_id", ID, nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("passed", sa.Boolean(), nullable=True),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("credit_scope", sa.String(length=16), nullable=False),
        sa.Column("artifact", sa.String(length=500), nullable=True),
        _created_at(),
        sa.CheckConstraint(
            "credit_scope IN ('rollout', 'token', 'artifact')",
            name=op.f("ck_feedback_credit_scope"),
        ),
        _fk("attempt_id", "attempts", "feedback"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_feedback")),
    )
    op.create_index(op.f("ix_feedback_attempt_id"), "feedback", ["attempt_id"])

    op.create_table(
        "step_attempts",
        sa.Column("step_id", ID, nullable=False),
        sa.Column("attempt_id", ID, nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("token_credit", sa.JSON(), nullable=True),
        _fk("attempt_id", "attempts", "step_attempts"),
        _fk("step_id", "training_steps", "step_attempts"),
        sa.PrimaryKeyConstraint("step_id", "attempt_id", name=op.f("pk_step_attempts")),
    )
    op.create_index(op.f("ix_step_attempts_attempt_id"), "step_attempts", ["attempt_id"])

    op.create_table(
        "teacher_contexts",
        _id(),
        sa.Column("attempt_id", ID, nullable=False),
        sa.Column("kinds", sa.JSON(), nullable=False),
        sa.Column("feedback_ids", sa.JSON(), nullable=False),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("truncated_tokens", sa.Integer(), nullable=False),
        _created_at(),
        _fk("attempt_id", "attempts", "teacher_contexts"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_teacher_contexts")),
    )
    op.create_index(op.f("ix_teacher_contexts_attempt_id"), "teacher_contexts", ["attempt_id"])


def downgrade() -> None:
    """Drop every table (children first)."""
    for table in (
        "teacher_contexts",
        "step_attempts",
        "feedback",
        "training_steps",
        "checkpoints",
        "attempts",
        "runs",
    ):
        op.drop_table(table)  # drops the table's indexes with it
