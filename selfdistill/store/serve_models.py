"""The server's tables (migration 0003), beside the registry's in one schema (`selfdistill serve`).

serve_tenants         consent to learning, pause flag (one row per scope that was ever seen)
serve_completions     completions served to consenting tenants (redacted), for feedback by id
serve_lessons         feedback candidates: context, response, feedback, the model's own score,
                      status pending → accepted | rejected → trained
serve_rounds          learning rounds: which lessons, which version, the gate's verdict
serve_deletions       proof of each tenant deletion: counts removed and counts left (all zero)

Nothing here holds text of a tenant without consent: completions and lessons are only written
for tenants whose `consent` is true, after PII redaction (`selfdistill.governance.redact`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Boolean, Float, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from selfdistill.store.models import ID_LENGTH, Base, UTCDateTime, new_id, utcnow
from selfdistill.store.registry_models import SCOPE_LENGTH

LESSON_STATUSES = ("pending", "accepted", "rejected", "trained")
"""pending: stored, not yet scored; accepted / rejected: scored against the threshold;
trained: consumed by a learning round (whatever the gate then decided)."""


class ServeTenant(Base):
    """A tenant (a registry scope such as ``user:alice``) as the server knows it."""

    __tablename__ = "serve_tenants"

    scope: Mapped[str] = mapped_column(String(SCOPE_LENGTH), primary_key=True)
    consent: Mapped[bool] = mapped_column(Boolean, default=False)
    paused: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ServeCompletion(Base):
    """One chat completion served to a consenting tenant (redacted text)."""

    __tablename__ = "serve_completions"

    id: Mapped[str] = mapped_column(String(100), primary_key=True)  # "chatcmpl-..."
    scope: Mapped[str] = mapped_column(String(SCOPE_LENGTH), index=True)
    version_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))  # None = base model
    messages: Mapped[list[dict[str, str]]] = mapped_column(JSON)
    response: Mapped[str] = mapped_column(Text)
    redactions: Mapped[dict[str, int]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ServeLesson(Base):
    """A feedback candidate: (context messages, response, feedback) with the model's score."""

    __tablename__ = "serve_lessons"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)
    scope: Mapped[str] = mapped_column(String(SCOPE_LENGTH), index=True)
    source: Mapped[str] = mapped_column(String(16))  # "explicit" | "implicit"
    completion_id: Mapped[str | None] = mapped_column(String(100))
    version_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))  # that answered
    messages: Mapped[list[dict[str, str]]] = mapped_column(JSON)  # context, ends with a user turn
    response: Mapped[str] = mapped_column(Text)
    feedback: Mapped[str] = mapped_column(Text)
    rating: Mapped[float | None] = mapped_column(Float)
    redactions: Mapped[dict[str, int]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), index=True, default="pending")
    score: Mapped[float | None] = mapped_column(Float)  # mean per-token divergence, nats
    threshold: Mapped[float | None] = mapped_column(Float)
    round_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    scored_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class ServeRound(Base):
    """One learning round of a tenant: lessons → run → proposed version → gate verdict."""

    __tablename__ = "serve_rounds"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)
    scope: Mapped[str] = mapped_column(String(SCOPE_LENGTH), index=True)
    lesson_ids: Mapped[list[str]] = mapped_column(JSON)
    run_dir: Mapped[str | None] = mapped_column(String(1000))
    parent_version_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    version_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    promoted: Mapped[bool] = mapped_column(Boolean, default=False)
    verdict: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    error: Mapped[str | None] = mapped_column(Text)
    seconds: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ServeDeletion(Base):
    """Proof of a tenant deletion: what was removed and what was left (every count zero)."""

    __tablename__ = "serve_deletions"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)
    scope_digest: Mapped[str] = mapped_column(String(64))  # SHA-256 of the scope, not the name
    removed: Mapped[dict[str, int]] = mapped_column(JSON)
    remaining: Mapped[dict[str, int]] = mapped_column(JSON)
    actor: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
