"""`POST /v1/chat/completions` (OpenAI-compatible, streaming or not) and `POST /v1/feedback`.

Every response carries the adapter that produced it: the `selfdistill` field
(``{"tenant", "scope", "version", "order", "learning"}``) in the body and in every stream chunk,
and the ``X-Selfdistill-Adapter`` header (the version id, or ``base``). With the tenant's
consent, the (redacted) completion is stored so that feedback can name it, and a user turn that
follows an assistant turn becomes a feedback candidate (implicit feedback), scored by the learner.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from selfdistill.serve import feedback
from selfdistill.serve.generation import Generation, chat_logprobs
from selfdistill.serve.protocol import ChatRequest, FeedbackRequest, chat_messages, parse
from selfdistill.serve.service import SCOPE_HEADER, Route, Service


def _headers(route: Route) -> dict[str, str]:
    return {"X-Selfdistill-Adapter": route.version or route.meta.get("lora") or "base"}


def register(app: FastAPI, service: Service) -> None:
    """Add the chat and feedback routes."""
    from selfdistill.serve.app import read_json

    limit = service.cfg.limits.max_request_bytes

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        req: ChatRequest = parse(ChatRequest, await read_json(request, limit))
        messages = chat_messages(req.messages, service.cfg.limits.max_message_chars)
        tenant = service.tenant(req.user, request.headers.get(SCOPE_HEADER))
        learning = service.learns(tenant)
        route = await run_in_threadpool(service.route, req.model, tenant)
        max_tokens = service.max_tokens(req.max_completion_tokens or req.max_tokens)
        ids = service.prompt(messages)
        if learning:
            await run_in_threadpool(feedback.implicit, service, tenant, messages, route)
        gen = Generation(service.engine, ids, route.adapter, max_tokens,
                         temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                         top_logprobs=req.top_logprobs if req.logprobs else 0, stops=req.stops())
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        meta = {"selfdistill": {"tenant": tenant.scope, **route.meta, "learning": learning}}
        head = {"id": cid, "created": created, "model": req.model}

        def finish() -> None:
            if learning:
                feedback.store_completion(service, tenant, cid, messages, gen.text, route)

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _stream(service, gen, route, head, meta, req.logprobs, include_usage, finish),
                media_type="text/event-stream", headers=_headers(route))

        def whole() -> dict[str, Any]:
            with service.engine.pin(route.adapter):
                gen.run()
            finish()
            return {**head, "object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": gen.text},
                "logprobs": chat_logprobs(service.engine.tokenizer, gen.tokens)
                if req.logprobs else None,
                "finish_reason": gen.finish_reason}],
                "usage": _usage(ids, gen), **meta}

        return JSONResponse(await run_in_threadpool(whole), headers=_headers(route))

    @app.post("/v1/feedback")
    async def post_feedback(request: Request) -> Any:
        req: FeedbackRequest = parse(FeedbackRequest, await read_json(request, limit))
        if len(req.text) > service.cfg.limits.max_message_chars:
            raise_too_long(service)
        tenant = service.tenant(req.user, request.headers.get(SCOPE_HEADER))
        return await run_in_threadpool(feedback.explicit, service, tenant, req)


def raise_too_long(service: Service) -> None:
    from selfdistill.serve.protocol import APIError

    raise APIError(400, f"text: longer than {service.cfg.limits.max_message_chars} characters",
                   param="text", code="message_too_long")


def _usage(ids: list[int], gen: Generation) -> dict[str, int]:
    return {"prompt_tokens": len(ids), "completion_tokens": len(gen.tokens),
            "total_tokens": len(ids) + len(gen.tokens)}


def _stream(service: Service, gen: Generation, route: Route, head: dict[str, Any],
            meta: dict[str, Any], logprobs: bool, include_usage: bool,
            finish: Any) -> Iterator[str]:
    """Chat stream chunks: the role first, then content deltas, then the finish reason."""
    tok = service.engine.tokenizer

    def chunk(delta: dict[str, Any], finish_reason: str | None = None,
              lps: Any = None) -> str:
        body = {**head, "object": "chat.completion.chunk", "choices": [{
            "index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish_reason}],
            **meta}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    with service.engine.pin(route.adapter):
        yield chunk({"role": "assistant", "content": ""})
        for piece in gen:
            if piece.text or logprobs:
                yield chunk({"content": piece.text},
                            lps=chat_logprobs(tok, [piece.token]) if logprobs else None)
    finish()
    yield chunk({}, gen.finish_reason)
    if include_usage:
        body = {**head, "object": "chat.completion.chunk", "choices": [],
                "usage": _usage(gen.prompt_ids, gen), **meta}
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"

