"""The server's rows (`selfdistill.store.serve_models`): tenants with consent and pause flags,
completions, lessons and learning rounds. Functions take a `sessionmaker`-like factory so the
app and the learner share them; each write is one committed transaction, so what a request
acknowledged is on disk (crash-safe)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from selfdistill.store.models import utcnow
from selfdistill.store.serve_models import ServeCompletion, ServeLesson, ServeRound, ServeTenant

Sessions = Callable[[], Session]


def tenant(sessions: Sessions, scope: str, consent_default: bool) -> dict[str, Any]:
    """The tenant's flags ({scope, consent, paused}); defaults when it was never seen."""
    with sessions() as s:
        row = s.get(ServeTenant, scope)
        if row is None:
            return {"scope": scope, "consent": consent_default, "paused": False}
        return {"scope": scope, "consent": row.consent, "paused": row.paused}


def set_flags(sessions: Sessions, scope: str, consent_default: bool, **flags: bool) -> dict:
    """Set `consent` and/or `paused` of a tenant (created with defaults if new)."""
    with sessions() as s, s.begin():
        row = s.get(ServeTenant, scope)
        if row is None:
            row = ServeTenant(scope=scope, consent=consent_default, paused=False)
            s.add(row)
        for key, value in flags.items():
            setattr(row, key, bool(value))
        row.updated_at = utcnow()
    return tenant(sessions, scope, consent_default)


def tenants(sessions: Sessions) -> list[dict[str, Any]]:
    """Every known tenant with its flags and lesson counts by status."""
    with sessions() as s:
        counts: dict[str, dict[str, int]] = {}
        for scope, status, n in s.execute(
            select(ServeLesson.scope, ServeLesson.status, func.count()).group_by(
                ServeLesson.scope, ServeLesson.status
            )
        ):
            counts.setdefault(scope, {})[status] = n
        rows = s.scalars(select(ServeTenant).order_by(ServeTenant.scope)).all()
        out = {
            r.scope: {"scope": r.scope, "consent": r.consent, "paused": r.paused} for r in rows
        }
    for scope in counts:
        out.setdefault(scope, {"scope": scope, "consent": None, "paused": False})
    return [{**v, "lessons": counts.get(k, {})} for k, v in sorted(out.items())]


def add_completion(sessions: Sessions, **row: Any) -> None:
    """Store one served completion (already redacted)."""
    with sessions() as s, s.begin():
        s.add(ServeCompletion(**row))


def completion(sessions: Sessions, completion_id: str) -> dict[str, Any] | None:
    """A stored completion, or None."""
    with sessions() as s:
        row = s.get(ServeCompletion, completion_id)
        return None if row is None else row.as_dict()


def find_completion(
    sessions: Sessions, scope: str, messages: list[dict], response: str
) -> str | None:
    """The id of the newest completion of `scope` with these (redacted) messages and response."""
    with sessions() as s:
        for row in s.scalars(
            select(ServeCompletion)
            .where(ServeCompletion.scope == scope, ServeCompletion.response == response)
            .order_by(ServeCompletion.created_at.desc())
            .limit(20)
        ):
            if row.messages == messages:
                return row.id
    return None


def lessons_since(sessions: Sessions, scope: str, seconds: float) -> int:
    """How many lessons `scope` added in the last `seconds` (the rate limit's count)."""
    since = utcnow() - timedelta(seconds=seconds)
    with sessions() as s:
        return s.scalar(
            select(func.count())
            .select_from(ServeLesson)
            .where(ServeLesson.scope == scope, ServeLesson.created_at >= since)
        )


def add_lesson(sessions: Sessions, **row: Any) -> dict[str, Any]:
    """Store a feedback candidate as `pending` (committed before the caller acknowledges)."""
    with sessions() as s, s.begin():
        lesson = ServeLesson(status="pending", **row)
        s.add(lesson)
        s.flush()
        return lesson.as_dict()


def lessons(
    sessions: Sessions, *, scope: str | None = None, status: str | Iterable[str] | None = None
) -> list[dict[str, Any]]:
    """Lessons, oldest first, filtered by scope and status."""
    q = select(ServeLesson).order_by(ServeLesson.created_at, ServeLesson.id)
    if scope is not None:
        q = q.where(ServeLesson.scope == scope)
    if status is not None:
        q = q.where(ServeLesson.status.in_([status] if isinstance(status, str) else status))
    with sessions() as s:
        return [r.as_dict() for r in s.scalars(q)]


def score_lesson(sessions: Sessions, lesson_id: str, score: float, threshold: float) -> str:
    """Record a pending lesson's score; it becomes accepted (score > threshold) or rejected."""
    status = "accepted" if score > threshold else "rejected"
    with sessions() as s, s.begin():
        s.execute(
            update(ServeLesson)
            .where(ServeLesson.id == lesson_id, ServeLesson.status == "pending")
            .values(status=status, score=score, threshold=threshold, scored_at=utcnow())
        )
    return status


def finish_round(sessions: Sessions, lesson_ids: list[str], **row: Any) -> dict[str, Any]:
    """Record a learning round and mark its lessons trained, in one transaction."""
    with sessions() as s, s.begin():
        rnd = ServeRound(lesson_ids=lesson_ids, **row)
        s.add(rnd)
        s.flush()
        s.execute(
            update(ServeLesson)
            .where(ServeLesson.id.in_(lesson_ids))
            .values(status="trained", round_id=rnd.id)
        )
        return rnd.as_dict()


def rounds(sessions: Sessions, scope: str | None = None) -> list[dict[str, Any]]:
    """Learning rounds, oldest first."""
    q = select(ServeRound).order_by(ServeRound.created_at)
    if scope is not None:
        q = q.where(ServeRound.scope == scope)
    with sessions() as s:
        return [r.as_dict() for r in s.scalars(q)]
