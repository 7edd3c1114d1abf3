"""The FastAPI application: OpenAI-compatible chat, vLLM-compatible completions and LoRA loading,
feedback, and the admin API (`create_app`). Every error is an OpenAI-style error object with a
4xx status (5xx only for the server's own faults, without a traceback in the body)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from selfdistill.errors import UserError
from selfdistill.serve.protocol import APIError
from selfdistill.serve.service import Service

log = logging.getLogger("selfdistill.serve")


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON: 413 over `limit` bytes, 400 when it is not JSON."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit}")
    body = await request.body()
    if len(body) > limit:
        raise APIError(413, f"request body of {len(body)} bytes exceeds the limit of {limit}")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


def create_app(service: Service) -> FastAPI:
    """The application serving `service` (routes in `routes_*` and `admin`)."""
    from selfdistill.serve import admin, routes_chat, routes_vllm

    app = FastAPI(title="selfdistill serve", docs_url=None, redoc_url=None)
    app.state.service = service

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(UserError)
    async def _user_error(_: Request, exc: UserError) -> JSONResponse:
        return JSONResponse(APIError(400, str(exc)).body(), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in err["loc"] if p != "body") or None
        return JSONResponse(
            APIError(400, f"{param or 'body'}: {err['msg']}", param=param).body(), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = "no such endpoint" if exc.status_code == 404 else str(exc.detail)
        return JSONResponse(APIError(exc.status_code, msg).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        body = APIError(500, f"internal server error ({type(exc).__name__})", type="server_error")
        return JSONResponse(body.body(), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": service.model_name, "time": time.time()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        data = [{"id": service.model_name, "object": "model", "created": created,
                 "owned_by": "selfdistill", "root": service.engine.path, "parent": None}]
        data += [{"id": name, "object": "model", "created": created, "owned_by": "selfdistill",
                  "root": str(service.engine.adapters.get(adapter, "")),
                  "parent": service.model_name}
                 for name, adapter in service.loras.items()]
        return {"object": "list", "data": data}

    routes_vllm.register(app, service)
    routes_chat.register(app, service)
    admin.register(app, service)
    return app
