"""The admin API (bearer token: `admin_token` or $SELFDISTILL_ADMIN_TOKEN; without one configured
every admin call is refused) and the tenant's own consent switch (`POST /v1/consent`).

| method | path | what |
|---|---|---|
| GET | /admin/tenants | tenants: consent, paused, lesson counts by status, active version |
| GET | /admin/tenants/{scope} | one tenant: flags, versions, activation history, rounds |
| POST | /admin/tenants/{scope}/promote | {version, force?, reason?}: gated (global too) |
| POST | /admin/tenants/{scope}/rollback | {to?, reason?}: previous version, or `to` |
| POST | /admin/tenants/{scope}/pause · /resume | stop / restart learning for the tenant |
| PUT | /admin/tenants/{scope}/consent | {learning: bool} |
| DELETE | /admin/tenants/{scope} | delete everything of the tenant; returns the proof |
| GET | /admin/learner | learner status |
| POST | /admin/learner/tick | run one learner pass now and return its rounds |
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from selfdistill.errors import UserError
from selfdistill.serve import state
from selfdistill.serve.protocol import APIError
from selfdistill.serve.service import SCOPE_HEADER, Service
from selfdistill.store.records import check_scope


def _auth(service: Service, request: Request) -> None:
    token = service.cfg.token()
    if token is None:
        raise APIError(403, "the admin API is disabled: set admin_token (or "
                       "SELFDISTILL_ADMIN_TOKEN) when starting the server", code="admin_disabled")
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise APIError(401, "admin API: missing or wrong bearer token "
                       "(Authorization: Bearer <token>)", code="invalid_token")


def _scope(scope: str) -> str:
    try:
        return check_scope(scope)
    except UserError as exc:
        raise APIError(400, str(exc), param="scope") from None


def register(app: FastAPI, service: Service) -> None:
    """Add the admin routes and /v1/consent."""
    from selfdistill.serve.app import read_json

    limit = service.cfg.limits.max_request_bytes

    async def body(request: Request) -> dict[str, Any]:
        if not await request.body():
            return {}
        obj = await read_json(request, limit)
        if not isinstance(obj, dict):
            raise APIError(400, "the request body must be a JSON object")
        return obj

    @app.post("/v1/consent")
    async def consent(request: Request) -> Any:
        obj = await body(request)
        if not isinstance(obj.get("learning"), bool):
            raise APIError(400, "learning: true or false is required", param="learning")
        tenant = service.tenant(obj.get("user"), request.headers.get(SCOPE_HEADER))
        if tenant.scope is None:
            raise APIError(400, "consent needs a tenant: `user` or X-Selfdistill-Scope",
                           param="user")
        return service.set_flags(tenant.scope, consent=obj["learning"])

    @app.get("/admin/tenants")
    async def tenants(request: Request) -> Any:
        _auth(service, request)
        active = {s["name"]: s.get("active_version_id") for s in service.registry.scopes()}
        rows = state.tenants(service.sessions)
        for r in rows:
            r["active_version"] = active.get(r["scope"])
        known = {r["scope"] for r in rows}
        rows += [{"scope": name, "consent": None, "paused": False, "lessons": {},
                  "active_version": v} for name, v in active.items() if name not in known]
        return {"object": "list", "data": rows}

    @app.get("/admin/tenants/{scope}")
    async def tenant(scope: str, request: Request) -> Any:
        _auth(service, request)
        scope = _scope(scope)
        return {**service.flags(scope), "versions": service.registry.list(scope),
                "history": service.registry.history(scope),
                "rounds": state.rounds(service.sessions, scope)}

    @app.post("/admin/tenants/{scope}/promote")
    async def promote(scope: str, request: Request) -> Any:
        _auth(service, request)
        scope, obj = _scope(scope), await body(request)
        if not isinstance(obj.get("version"), str):
            raise APIError(400, "version: a version id (or unique prefix) is required",
                           param="version")
        res = await run_in_threadpool(
            service.registry.promote, obj["version"], scope, force=bool(obj.get("force")),
            actor="admin", reason=obj.get("reason"))
        if res["promoted"]:
            await run_in_threadpool(service.ensure_version, res["version"])
        return res

    @app.post("/admin/tenants/{scope}/rollback")
    async def rollback(scope: str, request: Request) -> Any:
        _auth(service, request)
        scope, obj = _scope(scope), await body(request)
        res = await run_in_threadpool(service.registry.rollback, scope, obj.get("to"),
                                      actor="admin", reason=obj.get("reason"))
        if res["version"]:
            await run_in_threadpool(service.ensure_version, res["version"])
        return res

    @app.post("/admin/tenants/{scope}/pause")
    async def pause(scope: str, request: Request) -> Any:
        _auth(service, request)
        return service.set_flags(_scope(scope), paused=True)

    @app.post("/admin/tenants/{scope}/resume")
    async def resume(scope: str, request: Request) -> Any:
        _auth(service, request)
        return service.set_flags(_scope(scope), paused=False)

    @app.put("/admin/tenants/{scope}/consent")
    async def set_consent(scope: str, request: Request) -> Any:
        _auth(service, request)
        obj = await body(request)
        if not isinstance(obj.get("learning"), bool):
            raise APIError(400, "learning: true or false is required", param="learning")
        return service.set_flags(_scope(scope), consent=obj["learning"])

    @app.delete("/admin/tenants/{scope}")
    async def delete(scope: str, request: Request) -> Any:
        _auth(service, request)
        scope = _scope(scope)
        if scope == "global":
            raise APIError(400, "global is not a tenant; roll it back instead", param="scope")
        return await run_in_threadpool(service.delete_tenant, scope)

    @app.get("/admin/learner")
    async def learner(request: Request) -> Any:
        _auth(service, request)
        return {"running": service.cfg.learner.enabled, **service.learner.status}

    @app.post("/admin/learner/tick")
    async def tick(request: Request) -> Any:
        _auth(service, request)
        return {"rounds": await run_in_threadpool(service.learner.tick)}
