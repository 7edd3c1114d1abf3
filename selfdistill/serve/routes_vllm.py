"""vLLM-compatible endpoints: `POST /v1/completions` with token log-probs, and runtime LoRA
loading (`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`; enabled by the
`lora_updates` config or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, as in vLLM). Shapes:
docs/serving.md."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from selfdistill.serve.engine import Token
from selfdistill.serve.generation import Generation, token_str
from selfdistill.serve.protocol import (
    APIError,
    CompletionRequest,
    LoadLoraRequest,
    UnloadLoraRequest,
    parse,
)
from selfdistill.serve.service import Service


def prompts_of(req: CompletionRequest, service: Service) -> list[list[int]]:
    """Token ids of each prompt: text is tokenized as is (no chat template, no special tokens
    added), ids are taken verbatim."""
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]  # one prompt
    if not raw:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    tok = service.engine.tokenizer
    out = []
    for i, p in enumerate(raw):
        where = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if len(p) > service.cfg.limits.max_message_chars:
                raise APIError(400, f"{where}: {len(p)} characters; the limit is "
                               f"{service.cfg.limits.max_message_chars}", param="prompt")
            p = tok(p, add_special_tokens=False)["input_ids"]
        service.check_prompt(list(p), where)
        out.append(list(p))
    return out


class _Choice:
    """One prompt's completion and its vLLM/OpenAI `choices[]` entry."""

    def __init__(self, service: Service, req: CompletionRequest, index: int,
                 prompt: list[int], adapter: str | None, max_tokens: int) -> None:
        self.service, self.req, self.index, self.prompt = service, req, index, prompt
        self.gen = Generation(
            service.engine, prompt, adapter, max_tokens, temperature=req.temperature,
            top_p=req.top_p, seed=None if req.seed is None else req.seed + index,
            top_logprobs=req.logprobs or 0, stops=req.stops())
        self.prompt_tokens: list[Token | None] = []
        want_prompt = req.echo or req.prompt_logprobs is not None
        if want_prompt:
            k = max(req.logprobs or 0, req.prompt_logprobs or 0)
            self.prompt_tokens = service.engine.prompt_logprobs(prompt, adapter, k)

    def _str(self, tid: int) -> str:
        return token_str(self.service.engine.tokenizer, tid, self.req.return_tokens_as_token_ids)

    def logprobs(self, items: list[tuple[int, Token | None]]) -> dict[str, Any]:
        """The legacy completions `logprobs` object over (token id, Token or None = no log-prob)
        pairs: text offsets, token strings, their log-probs and the top alternatives."""
        out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                               "top_logprobs": []}
        pos, tok = 0, self.service.engine.tokenizer
        for tid, t in items:
            s = self._str(tid)
            out["text_offset"].append(pos)
            pos += len(tok.decode([tid]))
            out["tokens"].append(s)
            out["token_logprobs"].append(None if t is None else t.logprob)
            top = None
            if t is not None and self.req.logprobs:
                top = {**{self._str(k): v for k, v in t.top.items()}, s: t.logprob}
            out["top_logprobs"].append(top)
        return out

    def entry(self, text: str, tokens: list[Token], finish: str | None,
              first: bool = True) -> dict[str, Any]:
        """A `choices[]` entry for `text`/`tokens` (a whole completion, or one stream chunk)."""
        req, echo = self.req, self.req.echo and first
        prefix = self.service.engine.tokenizer.decode(self.prompt) if echo else ""
        shown = list(zip(self.prompt, self.prompt_tokens, strict=True)) if echo else []
        shown += [(t.id, t) for t in tokens]
        c: dict[str, Any] = {
            "index": self.index, "text": prefix + text,
            "logprobs": self.logprobs(shown) if req.logprobs is not None else None,
            "finish_reason": finish, "stop_reason": None,
        }
        if req.prompt_logprobs is not None and first:
            c["prompt_logprobs"] = [
                None if t is None else {str(t.id): {"logprob": t.logprob, "rank": None,
                                                    "decoded_token": self._str(t.id)},
                                        **{str(k): {"logprob": v, "rank": r + 1,
                                                    "decoded_token": self._str(k)}
                                           for r, (k, v) in enumerate(t.top.items())}}
                for t in self.prompt_tokens]
        if req.return_token_ids:
            c["prompt_token_ids"] = self.prompt if first else None
            c["token_ids"] = [t.id for t in tokens]
        return c


def _usage(choices: list[_Choice]) -> dict[str, int]:
    p = sum(len(c.prompt) for c in choices)
    n = sum(len(c.gen.tokens) for c in choices)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def register(app: FastAPI, service: Service) -> None:
    """Add the vLLM-compatible routes."""
    from selfdistill.serve.app import read_json

    limit = service.cfg.limits.max_request_bytes

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req: CompletionRequest = parse(CompletionRequest, await read_json(request, limit))
        route = service.route(req.model)
        max_tokens = service.max_tokens(req.max_tokens)
        prompts = prompts_of(req, service)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "object": "text_completion", "created": created, "model": req.model}
        meta = {"selfdistill": route.meta}

        def make() -> list[_Choice]:
            return [_Choice(service, req, i, p, route.adapter, max_tokens)
                    for i, p in enumerate(prompts)]

        if req.stream:
            return StreamingResponse(_stream(service, route.adapter, make, head, meta),
                                     media_type="text/event-stream")

        def whole() -> dict[str, Any]:
            with service.engine.pin(route.adapter):
                choices = make()
                for c in choices:
                    c.gen.run()
            return {**head, "choices": [c.entry(c.gen.text, c.gen.tokens, c.gen.finish_reason)
                                        for c in choices],
                    "usage": _usage(choices), **meta}

        return await run_in_threadpool(whole)

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> Any:
        _allowed(service)
        req: LoadLoraRequest = parse(LoadLoraRequest, await read_json(request, limit))
        if req.lora_name in service.aliases or (
                req.lora_name in service.loras and not req.load_inplace):
            raise APIError(400, f"The lora adapter '{req.lora_name}' has already been loaded.",
                           param="lora_name")
        path = Path(req.lora_path)
        if not (path / "adapter_config.json").is_file():
            raise APIError(400, f"lora_path {req.lora_path}: not a PEFT adapter directory "
                           "(no adapter_config.json)", param="lora_path")
        name = f"lora-{uuid.uuid4().hex[:12]}"
        try:
            await run_in_threadpool(service.engine.load, name, path)
        except Exception as exc:  # the loader's reason, e.g. a shape mismatch
            raise APIError(400, f"cannot load LoRA adapter from {path}: {exc}",
                           param="lora_path") from None
        old = service.loras.get(req.lora_name)
        service.loras[req.lora_name] = name  # new requests get the new weights from here on
        if old is not None:  # load_inplace: running requests finish on the old ones
            await run_in_threadpool(service.engine.unload, old)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> Any:
        _allowed(service)
        req: UnloadLoraRequest = parse(UnloadLoraRequest, await read_json(request, limit))
        name = service.loras.pop(req.lora_name, None)
        if name is None:
            raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.",
                           param="lora_name", code="lora_not_found")
        await run_in_threadpool(service.engine.unload, name)
        return PlainTextResponse(
            f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def _allowed(service: Service) -> None:
    if not service.cfg.lora_updates_enabled():
        raise APIError(404, "runtime LoRA updating is off: start the server with "
                       "lora_updates=true (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
                       code="lora_updates_disabled")


def _stream(service: Service, adapter: str | None, make: Any, head: dict[str, Any],
            meta: dict[str, Any]) -> Iterator[str]:
    """Server-sent events: one chunk per token per choice, then `data: [DONE]`."""
    with service.engine.pin(adapter):
        choices = make()
        for c in choices:
            first = True
            for piece in c.gen:
                chunk = {**head, "choices": [c.entry(piece.text, [piece.token], None, first)],
                         **meta}
                first = False
                yield f"data: {json.dumps(chunk)}\n\n"
            end = {**head, "choices": [c.entry("", [], c.gen.finish_reason, False)], **meta}
            if c.req.logprobs is not None:
                end["choices"][0]["logprobs"] = None
            yield f"data: {json.dumps(end)}\n\n"
    yield "data: [DONE]\n\n"
