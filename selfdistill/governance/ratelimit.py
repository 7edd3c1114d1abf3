"""Per-tenant lesson rate limit: at most N lessons per rolling hour, counted in the database
(so the limit holds across restarts and across server processes sharing one database)."""

from __future__ import annotations

from selfdistill.serve import state

WINDOW_S = 3600.0


class RateLimited(Exception):
    """The tenant reached its lesson limit for the rolling hour."""


def admit_lesson(sessions: state.Sessions, scope: str, per_hour: int) -> None:
    """Raise `RateLimited` when `scope` already added `per_hour` lessons in the last hour."""
    used = state.lessons_since(sessions, scope, WINDOW_S)
    if used >= per_hour:
        raise RateLimited(
            f"{scope} added {used} lessons in the last hour; the limit is {per_hour} "
            "(governance.lessons_per_hour)"
        )
