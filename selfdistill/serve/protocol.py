"""Request shapes of the OpenAI-compatible API and OpenAI-style errors.

Unknown request fields are ignored (as the OpenAI API and vLLM do for fields they do not use);
known ones are validated, and every problem becomes an `APIError` that the app renders as
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from selfdistill.chat import Message

CHAT_ROLES = ("system", "developer", "user", "assistant")
"""Roles a chat request may use; `developer` (OpenAI's newer name) is served as `system`."""


class APIError(Exception):
    """An error a client caused (4xx) or a server condition it should see (503)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SamplingParams(_Request):
    """What chat and text completions share."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stop: str | list[str] | None = None
    user: str | None = Field(None, max_length=200)

    def stops(self) -> list[str]:
        """The stop strings as a list (empty strings dropped)."""
        raw = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in raw if s]


class StreamOptions(_Request):
    include_usage: bool = False


class ChatRequest(SamplingParams):
    """POST /v1/chat/completions."""

    messages: list[Any] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)
    stream_options: StreamOptions | None = None


class CompletionRequest(SamplingParams):
    """POST /v1/completions (vLLM-compatible): `prompt` is text, token ids, or a list of
    either (one choice per prompt)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False


class FeedbackRequest(_Request):
    """POST /v1/feedback."""

    completion_id: str = Field(min_length=1, max_length=100)
    text: str = Field(min_length=1)
    rating: float | None = Field(None, ge=-1, le=1)
    user: str | None = Field(None, max_length=200)


class LoadLoraRequest(_Request):
    """POST /v1/load_lora_adapter (vLLM)."""

    lora_name: str = Field(min_length=1, max_length=200)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = Field(False, description="replace an adapter loaded under this name")


class UnloadLoraRequest(_Request):
    """POST /v1/unload_lora_adapter (vLLM)."""

    lora_name: str = Field(min_length=1, max_length=200)
    lora_int_id: int | None = None


def parse(model: type[_Request], body: Any) -> Any:
    """Validate a JSON body; APIError 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{param or 'body'}: {err['msg']}", param=param) from None


def chat_messages(raw: list[Any], max_chars: int) -> list[Message]:
    """Validate chat messages: role in `CHAT_ROLES`, content a string or a list of text parts,
    at most `max_chars` characters each, and a user turn last (the one to answer)."""
    out: list[Message] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"{where} must be an object with 'role' and 'content'", param=where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise APIError(
                400,
                f"{where}.role {role!r} is not supported; use one of {', '.join(CHAT_ROLES)}",
                param=f"{where}.role",
            )
        content = _text(m.get("content"), f"{where}.content")
        if len(content) > max_chars:
            raise APIError(
                400,
                f"{where}.content has {len(content)} characters; the limit is {max_chars}",
                param=f"{where}.content",
                code="message_too_long",
            )
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if out[-1]["role"] != "user":
        raise APIError(
            400, "the last message must be a user turn (the one to answer)", param="messages"
        )
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise APIError(400, f"{where}[{j}]: only text parts are supported", param=where)
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}[{j}].text must be a string", param=where)
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(400, f"{where} must be a string or a list of text parts", param=where)
