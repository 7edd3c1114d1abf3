"""Feedback into lessons: explicit (`POST /v1/feedback`) and implicit (a user turn after an
assistant turn). Only for consenting tenants; text is PII-redacted before it is stored; every
candidate is committed as `pending` before it is acknowledged, then scored by the model itself
(`selfdistill.serve.lessons.score`): explicit feedback at once, implicit by the learner."""

from __future__ import annotations

from typing import Any

from selfdistill.chat import Message
from selfdistill.governance import RateLimited, admit_lesson, redact, redact_messages
from selfdistill.serve import lessons, state
from selfdistill.serve.protocol import APIError, FeedbackRequest
from selfdistill.serve.service import Route, Service, Tenant


def _clean(service: Service, messages: list[Message]) -> tuple[list[Message], dict[str, int]]:
    if not service.cfg.governance.redact:
        return messages, {}
    out, counts = redact_messages(messages)
    return out, dict(counts)


def store_completion(service: Service, tenant: Tenant, cid: str, messages: list[Message],
                     text: str, route: Route) -> None:
    """Keep a consenting tenant's completion (redacted) so feedback can name it."""
    msgs, counts = _clean(service, [*messages, {"role": "assistant", "content": text}])
    state.add_completion(service.sessions, id=cid, scope=tenant.scope, version_id=route.version,
                         messages=msgs[:-1], response=msgs[-1]["content"], redactions=counts)


def implicit(service: Service, tenant: Tenant, messages: list[Message], route: Route) -> None:
    """A conversation `[..., user, assistant, user]`: the last user turn is a feedback candidate
    on the assistant turn before it. Dropped silently over the rate limit."""
    if not service.cfg.learner.implicit or len(messages) < 3:
        return
    if messages[-2]["role"] != "assistant" or messages[-3]["role"] != "user":
        return
    try:
        admit_lesson(service.sessions, tenant.scope, service.cfg.governance.lessons_per_hour)
    except RateLimited:
        return
    msgs, counts = _clean(service, messages)
    cid = state.find_completion(service.sessions, tenant.scope, msgs[:-2], msgs[-2]["content"])
    state.add_lesson(service.sessions, scope=tenant.scope, source="implicit", completion_id=cid,
                     version_id=route.version, messages=msgs[:-2], response=msgs[-2]["content"],
                     feedback=msgs[-1]["content"], rating=None, redactions=counts)


def explicit(service: Service, tenant: Tenant, req: FeedbackRequest) -> dict[str, Any]:
    """Store feedback on a completion of this tenant, score it, return the lesson's record."""
    if tenant.scope is None:
        raise APIError(400, "feedback needs a tenant: the `user` field or the "
                       "X-Selfdistill-Scope header", param="user")
    if not service.learns(tenant):
        raise APIError(403, f"{tenant.scope} has not consented to learning: nothing of its "
                       "conversations is stored; opt in with POST /v1/consent",
                       code="consent_required")
    done = state.completion(service.sessions, req.completion_id)
    if done is None or done["scope"] != tenant.scope:
        raise APIError(404, f"completion {req.completion_id!r} not found for {tenant.scope}",
                       param="completion_id", code="completion_not_found")
    try:
        admit_lesson(service.sessions, tenant.scope, service.cfg.governance.lessons_per_hour)
    except RateLimited as exc:
        raise APIError(429, str(exc), code="lesson_rate_limited") from None
    text = redact(req.text) if service.cfg.governance.redact else None
    counts = dict(done["redactions"])
    for k, v in (text.counts if text else {}).items():
        counts[k] = counts.get(k, 0) + v
    lesson = state.add_lesson(
        service.sessions, scope=tenant.scope, source="explicit", completion_id=done["id"],
        version_id=done["version_id"], messages=done["messages"], response=done["response"],
        feedback=text.text if text else req.text, rating=req.rating, redactions=counts)
    return {"object": "feedback", **score_pending(service, lesson)}


def score_pending(service: Service, lesson: dict[str, Any]) -> dict[str, Any]:
    """Score one pending lesson with the model that now serves its tenant; record the result."""
    scope = lesson["scope"]
    kind, _, name = scope.partition(":")
    tenant = Tenant(name if kind == "user" else None, scope if kind == "workspace" else None)
    route = service.route(service.model_name, tenant)
    with service.engine.pin(route.adapter):
        value = service.engine.run(
            route.adapter, lambda m: lessons.score(m, service.engine.tokenizer, lesson))
    threshold = service.cfg.learner.threshold
    status = state.score_lesson(service.sessions, lesson["id"], value, threshold)
    return {"id": lesson["id"], "completion_id": lesson["completion_id"], "status": status,
            "accepted": status == "accepted", "score": value, "threshold": threshold,
            "redactions": lesson["redactions"]}
