"""The trace store's tables (SQLAlchemy 2 ORM): every arrow of the loop as a row.

run ─< attempt ─< feedback            (the world's answer to one attempt)
          │   └─< teacher_context     (the teacher prompt built from that feedback)
          └──< step_attempt >── training_step   (which step consumed which attempts, in batch order)
run ─< checkpoint                     (weights written after a step)

Ids are 32-hex-character strings that sort by creation time (see `new_id`), so ids made on the
trainer's hot path are known before anything reaches the database. Timestamps are aware UTC
datetimes on every backend (`UTCDateTime`).

The "token" credit scope: a per-token signal (the advantage ``log pi_T - log pi_S`` of each
completion token) exists only for a training step and one attempt, so its summary lives on the
link row `StepAttempt.token_credit` (e.g. ``{"n": 57, "mean": -0.12, "min": -3.1, "max": 0.8}``),
next to the step-level reductions in `TrainingStep.metrics`. Rollout- and artifact-level credit are
properties of the feedback itself (`Feedback.credit_scope`, `Feedback.artifact`).

Changing a table here needs a new migration in `selfdistill/store/migrations/versions/`; the test
suite fails while the migrations and these models disagree.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

CREDIT_SCOPES = ("rollout", "token", "artifact")
"""Where a piece of feedback assigns credit: the whole rollout, specific tokens, or one artifact
(a test, a file) named in `Feedback.artifact`."""

ID_LENGTH = 64  # column width; generated ids are 32 characters, caller-chosen ids may be longer

_id_lock = threading.Lock()
_id_last = [0, 0]  # (milliseconds, random part) of the last id made in this process


def _reset_ids_after_fork() -> None:
    # A forked child (e.g. a data-loader worker) must not continue the parent's sequence, or both
    # processes would hand out the same "next" id within one millisecond.
    _id_last[:] = [0, 0]


os.register_at_fork(after_in_child=_reset_ids_after_fork)


def new_id() -> str:
    """A new 32-hex-character id: 12 hex digits of Unix milliseconds, then 20 random ones.

    Ids sort by creation time. Within one millisecond the random part is incremented instead of
    redrawn, so ids made by one process are strictly increasing (like a monotonic ULID).
    """
    with _id_lock:
        ms = time.time_ns() // 1_000_000
        if ms <= _id_last[0]:
            ms, rnd = _id_last[0], _id_last[1] + 1
        else:
            rnd = secrets.randbits(79)  # top bit clear: 2**79 increments of headroom
        _id_last[:] = [ms, rnd]
    return f"{ms:012x}{rnd:020x}"


def utcnow() -> datetime:
    """The current time as an aware UTC datetime."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """An aware UTC datetime on every backend.

    PostgreSQL stores ``timestamptz``; SQLite has no time zones, so the value is stored as naive
    UTC and marked UTC again when read. Naive datetimes are refused rather than guessed at.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Convert to UTC (naive UTC for SQLite)."""
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware one, e.g. datetime.now(UTC)")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Return an aware UTC datetime."""
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# Deterministic constraint names on every backend, so a later migration can name what it drops.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base of the trace store's tables."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)

    def as_dict(self) -> dict[str, Any]:
        """The row's columns as a JSON-ready dict (datetimes as ISO-8601 strings)."""
        out: dict[str, Any] = {}
        for col in self.__table__.columns:
            value = getattr(self, col.key)
            out[col.key] = value.isoformat() if isinstance(value, datetime) else value
        return out


def _id_column(*, primary_key: bool = True) -> Mapped[str]:
    return mapped_column(String(ID_LENGTH), primary_key=primary_key, default=new_id)


def _fk(target: str) -> Mapped[str]:
    # CASCADE so that deleting a run or an attempt (governance: deletion requests, `rewind`)
    # removes everything derived from it instead of leaving dangling evidence.
    return mapped_column(String(ID_LENGTH), ForeignKey(target, ondelete="CASCADE"), index=True)


def _created_at() -> Mapped[datetime]:
    return mapped_column(UTCDateTime(), default=utcnow)


class Run(Base):
    """One training job. `scope` is whose adapter it trains: "global", "user:alice", ..."""

    __tablename__ = "runs"

    id: Mapped[str] = _id_column()
    name: Mapped[str] = mapped_column(String(200))
    scope: Mapped[str] = mapped_column(String(200), index=True)
    status: Mapped[str] = mapped_column(String(32))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = _created_at()


class Attempt(Base):
    """A student answer: the prompt as messages, the sampled tokens and their log-probs.

    `step` is the training step whose rollout produced it (None outside training, e.g. a served
    chat turn); `sampler_version` names the adapter that sampled it; `group_id` ties the answers
    of one SDPO/GRPO group together.
    """

    __tablename__ = "attempts"
    __table_args__ = (Index("ix_attempts_run_id_step", "run_id", "step"),)

    id: Mapped[str] = _id_column()
    run_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("runs.id", ondelete="CASCADE")
    )  # indexed by ix_attempts_run_id_step (run_id leads)
    step: Mapped[int | None] = mapped_column(Integer)
    prompt: Mapped[Any] = mapped_column(JSON)
    prompt_source: Mapped[str | None] = mapped_column(String(500))
    completion: Mapped[str] = mapped_column(Text)
    completion_ids: Mapped[list[int]] = mapped_column(JSON)
    logprobs: Mapped[list[float] | None] = mapped_column(JSON(none_as_null=True))
    sampler_version: Mapped[str | None] = mapped_column(String(200))
    group_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), index=True)
    created_at: Mapped[datetime] = _created_at()

    feedback: Mapped[list[Feedback]] = relationship(
        order_by="(Feedback.created_at, Feedback.id)", passive_deletes=True
    )
    teacher_contexts: Mapped[list[TeacherContext]] = relationship(
        order_by="(TeacherContext.created_at, TeacherContext.id)", passive_deletes=True
    )
    step_links: Mapped[list[StepAttempt]] = relationship(
        back_populates="attempt", passive_deletes=True
    )


class Feedback(Base):
    """The world's answer to an attempt: why it failed, not only whether it did.

    `evidence` holds the raw material (test output, traceback, the demonstration); `credit_scope`
    is one of `CREDIT_SCOPES`; `artifact` names the test or file the feedback concerns.
    """

    __tablename__ = "feedback"
    __table_args__ = (
        CheckConstraint("credit_scope IN ('rollout', 'token', 'artifact')", name="credit_scope"),
    )

    id: Mapped[str] = _id_column()
    attempt_id: Mapped[str] = _fk("attempts.id")
    kind: Mapped[str] = mapped_column(String(64))
    text: Mapped[str] = mapped_column(Text)
    reward: Mapped[float | None] = mapped_column(Float)
    passed: Mapped[bool | None] = mapped_column(Boolean)
    evidence: Mapped[dict[str, Any]] = mapped_column(JSON)
    credit_scope: Mapped[str] = mapped_column(String(16))
    artifact: Mapped[str | None] = mapped_column(String(500))
    created_at: Mapped[datetime] = _created_at()


class TeacherContext(Base):
    """The teacher prompt exactly as built for one attempt (after truncation).

    `kinds` lists the feedback kinds it was built from and `feedback_ids` the feedback rows;
    `truncated_tokens` counts the tokens cut to fit the context window (0 = nothing cut).
    """

    __tablename__ = "teacher_contexts"

    id: Mapped[str] = _id_column()
    attempt_id: Mapped[str] = _fk("attempts.id")
    kinds: Mapped[list[str]] = mapped_column(JSON)
    feedback_ids: Mapped[list[str]] = mapped_column(JSON)
    messages: Mapped[Any] = mapped_column(JSON)
    truncated_tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = _created_at()


class TrainingStep(Base):
    """One optimizer step: its loss, metrics, and the weights before and after.

    `checkpoint_before` / `checkpoint_after` are a `Checkpoint` id or path, or any other
    reference to weights (e.g. the base model's name before the first step).
    """

    __tablename__ = "training_steps"
    __table_args__ = (UniqueConstraint("run_id", "step"),)  # also serves run_id lookups

    id: Mapped[str] = _id_column()
    run_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("runs.id", ondelete="CASCADE")
    )
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    checkpoint_before: Mapped[str | None] = mapped_column(String(1000))
    checkpoint_after: Mapped[str | None] = mapped_column(String(1000))
    created_at: Mapped[datetime] = _created_at()

    attempt_links: Mapped[list[StepAttempt]] = relationship(
        back_populates="training_step", order_by="StepAttempt.position", passive_deletes=True
    )


class StepAttempt(Base):
    """Which attempts a training step consumed, in batch order, with their token-level credit."""

    __tablename__ = "step_attempts"

    step_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("training_steps.id", ondelete="CASCADE"), primary_key=True
    )
    attempt_id: Mapped[str] = mapped_column(
        String(ID_LENGTH),
        ForeignKey("attempts.id", ondelete="CASCADE"),
        primary_key=True,
        index=True,  # "which steps consumed this attempt" (export, lineage)
    )
    position: Mapped[int] = mapped_column(Integer)
    token_credit: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))

    training_step: Mapped[TrainingStep] = relationship(back_populates="attempt_links")
    attempt: Mapped[Attempt] = relationship(back_populates="step_links")


class Checkpoint(Base):
    """Weights written after `step`; `weights_sha256` lets a replay check it has the same ones."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "step"),)

    id: Mapped[str] = _id_column()
    run_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("runs.id", ondelete="CASCADE")
    )
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(1000))
    weights_sha256: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = _created_at()
